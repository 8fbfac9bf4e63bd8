"""The round loop that every DP strategy runs (`round_loop.DPRoundLoop`), and what it holds: the reply gate that
checks every reply before anything reads it (`reply_gate`), the round in flight (`dp_round`), the run record and
checkpoint state (`run_record`), the option objects (`options`), the wrapped Flower strategy's side (`wrapped`,
`flower_log`, `sample_epsilon`). It imports the parts (`strategies.parts`), never the algorithms above it."""
