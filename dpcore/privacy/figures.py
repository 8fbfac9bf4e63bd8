"""The figures a run publishes, each declared once: one `Figure` row per name in `FIGURES`.

A row says where the figure goes: metrics.jsonl (published per round: the ledger covers it), summary.json
only (`per_round = False`), or diagnostics.jsonl (`published = False`: computed from raw client replies, not
covered by epsilon); whether it is on the `Round r/R:` or `Finished:` log line; its TensorBoard / W&B tag;
and, for a privacy figure that may be no guarantee, the caveat: such a figure has a mark
`<name>_is_guarantee`, a row of its own, which is False on every output that carries the figure when it
is none. Everything that writes or shows figures draws from these rows: the round record's split
(`strategies.loop.run_record.PUBLISHED_KEYS`), the log lines (`LOG_KEYS`, `DIAGNOSTIC_LOG_KEYS`,
`fl_app.server_app.SUMMARY_LOG_KEYS`), the dashboards (`fl_app.dashboards.TAGS`) and the figure table of
docs/running.md (`python -m dpfl.dpcore.privacy.figures --write` redraws it; a test keeps it current).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

GUARANTEE_SUFFIX = "_is_guarantee"


@dataclass(frozen=True)
class Figure:
    """One figure of a run's outputs.

    name: its key in metrics.jsonl / summary.json / diagnostics.jsonl, on the log line and in W&B.
    doc: what it is (one line of docs/running.md's table).
    published: covered by epsilon (metrics.jsonl, summary.json); False: a non-private diagnostic.
    per_round: in every round's record; False: summary.json only (a figure of the whole run).
    tag: its TensorBoard / W&B scalar tag ("" none; a dict of values: one scalar per entry, `<tag>/<entry>`).
    round_line, finish_line: on the `Round r/R:` line (a diagnostic after the not-private mark), on the
        `Finished:` line.
    caveat: when the figure is no guarantee; non-empty: the mark `<name>_is_guarantee` says so.
    former: names older runs wrote for it (`with_current_names` reads them as `name`).
    """

    name: str
    doc: str
    published: bool = True
    per_round: bool = True
    tag: str = ""
    round_line: bool = False
    finish_line: bool = False
    caveat: str = ""
    former: tuple[str, ...] = ()

    @property
    def mark(self) -> str:
        """The key saying this figure is no guarantee ("" for a figure that always is one, or no privacy figure)."""
        return self.name + GUARANTEE_SUFFIX if self.caveat else ""


def guarantee_mark(figure: Figure) -> Figure:
    """The row of `figure`'s mark: a published key on the round line, present (False) only when it is none."""
    return Figure(
        figure.mark,
        f"`False` when `{figure.name}` is no guarantee: {figure.caveat} (absent: it is one)",
        round_line=True,
    )


DECLARED = (
    # the run, in summary.json
    Figure("rounds_completed", "rounds the run completed, a resumed run's included", per_round=False, finish_line=True),
    Figure(
        "final_accuracy",
        "the released model's accuracy on the server-held test set after the last round (null under partial sharing)",
        per_round=False,
        finish_line=True,
    ),
    Figure("final_loss", "its loss there", per_round=False, finish_line=True),
    # each round, in metrics.jsonl (a `Finished:` line figure's last value in summary.json too)
    Figure("round", "the round number"),
    Figure(
        "accuracy", "the released model's accuracy on the server-held test set", tag="eval/accuracy", round_line=True
    ),
    Figure("loss", "the released model's loss on the server-held test set", tag="eval/loss", round_line=True),
    Figure("val_accuracy", "its accuracy on the server's validation split (`validation-fraction` > 0)"),
    Figure("val_loss", "its loss on the server's validation split"),
    Figure(
        "epsilon",
        "the ledger's epsilon so far (a non-private run: null); ALI-DPFL: the largest client's",
        tag="privacy/epsilon",
        round_line=True,
        finish_line=True,
        caveat="seeded noise (`secure-rng = false`) or top-k after distributed noise",
    ),
    Figure("delta", "the ledger's delta", round_line=True, finish_line=True),
    Figure(
        "epsilon_against_server",
        "epsilon against the server itself, which sees each upload (not under SecAgg+)",
        tag="privacy/epsilon_against_server",
        round_line=True,
        finish_line=True,
        caveat="distributed noise without SecAgg+, where clients send norms and losses in the clear",
    ),
    Figure(
        "claimed_epsilon",
        'the epsilon a paper\'s analysis would print (wavelet noise, `wavelet-calibration = "paper"`)',
        tag="privacy/epsilon_claimed_by_paper",
        round_line=True,
        finish_line=True,
        caveat="always (the paper's figure; the true one is `epsilon`)",
        former=("epsilon_claimed",),
    ),
    Figure("epsilon_min", "ALI-DPFL: the smallest client's epsilon", tag="privacy/epsilon_min_client", round_line=True),
    Figure(
        "epsilon_per_client",
        "ALI-DPFL: each client's epsilon (it grows only in the rounds the client took part in)",
        tag="privacy/epsilon_client",
    ),
    Figure("tau", "ALI-DPFL: the local DP-SGD steps sent this round", tag="ali_dpfl/tau", round_line=True),
    Figure("tau_star", "ALI-DPFL: the real-valued optimum of eq. (9)", tag="ali_dpfl/tau_star"),
    Figure("tau_next", "ALI-DPFL: the steps the next round sends", round_line=True),
    Figure("mu", "ALI-DPFL: the mu estimate tau follows", tag="ali_dpfl/mu"),
    Figure("steps_budget", "ALI-DPFL: R_c, the DP-SGD steps the target epsilon allows"),
    Figure("local_steps_total", "ALI-DPFL: the most DP-SGD steps any client has taken"),
    Figure(
        "upload_bytes_per_client",
        "top-k: the bytes of one honest upload, from the settings",
        tag="topk/upload_bytes_per_client",
    ),
    Figure("dense_bytes_per_client", "top-k: the bytes of a dense upload", tag="topk/dense_bytes_per_client"),
    Figure("clipping_norm", "adaptive clipping: C used this round", tag="adaptive_clipping/clipping_norm"),
    Figure("clipping_norm_next", "adaptive clipping: C of the next round"),
    Figure(
        "unclipped_fraction_noisy",
        "adaptive clipping: the noisy fraction of updates within C",
        tag="adaptive_clipping/unclipped_fraction_noisy",
    ),
    # each round, in diagnostics.jsonl: not covered by epsilon (on the log line with `publish-diagnostics`)
    Figure(
        "personalized_accuracy",
        "clients' mean accuracy of their personalized models (the run's: diagnostics-summary.json)",
        published=False,
        round_line=True,
        finish_line=True,
    ),
    Figure("clients", "replies aggregated", published=False, round_line=True),
    Figure("rejected", "replies the reply gate refused", published=False, round_line=True),
    Figure("failures", "nodes that failed or did not reply", published=False, round_line=True),
    Figure("clipped_fraction", "fraction of updates above the clipping norm", published=False, round_line=True),
    Figure("update_norm_mean", "mean update norm before clipping", published=False, round_line=True),
    Figure("train_loss", "clients' training loss", published=False, round_line=True),
)
FIGURES = DECLARED + tuple(guarantee_mark(f) for f in DECLARED if f.caveat)


def published_and_former_names() -> frozenset[str]:
    """The published figures' names, their marks' and the former names: what only the run itself may write."""
    return frozenset(n for f in FIGURES if f.published for n in (f.name, f.mark, *f.former) if n)


def published_names() -> frozenset[str]:
    """The round-record keys the ledger covers (metrics.jsonl); every other key is a diagnostic."""
    return frozenset(f.name for f in FIGURES if f.published and f.per_round)


def round_line_names(published: bool = True) -> tuple[str, ...]:
    """The keys of the `Round r/R:` line in order (published=False: those after the not-private mark)."""
    return tuple(f.name for f in FIGURES if f.round_line and f.published == published)


def finish_line_names(published: bool = True) -> tuple[str, ...]:
    """The summary.json keys of the `Finished:` line in order (published=False: diagnostics-summary.json's, after
    the not-private mark)."""
    return tuple(f.name for f in FIGURES if f.finish_line and f.published == published)


def dashboard_tags() -> dict[str, str]:
    """{published key: TensorBoard / W&B tag}."""
    return {f.name: f.tag for f in FIGURES if f.tag and f.published}


def guarantee_marks() -> dict[str, str]:
    """{figure: the key that is False when the figure is no guarantee}."""
    return {f.name: f.mark for f in FIGURES if f.mark}


def with_current_names(record: dict) -> dict:
    """`record` (of a run folder written by an older version) with each figure under its current name."""
    current = {old: f.name for f in FIGURES for old in f.former}
    return {current.get(k, k): v for k, v in record.items()}


# ---------------------------------------------------------------------------- docs/running.md's table
FIGURES_DOC = "docs/running.md"
TABLE_START = "<!-- figures: drawn from dpcore/privacy/figures.py, `python -m dpfl.dpcore.privacy.figures --write` -->"
TABLE_END = "<!-- end of figures -->"


def written_to(figure: Figure) -> str:
    """The files that hold the figure: per round, and the run's value (a `Finished:` line figure)."""
    per_round = ["metrics.jsonl" if figure.published else "diagnostics.jsonl"] * figure.per_round
    run = ["summary.json" if figure.published else "diagnostics-summary.json"] * figure.finish_line
    return ", ".join(per_round + run) + ("" if figure.published else " (not private)")


def log_lines(figure: Figure) -> str:
    """The log lines that show the figure (a diagnostic only with `publish-diagnostics = true`)."""
    lines = ["Round"] * figure.round_line + ["Finished"] * figure.finish_line
    return ", ".join(lines) + ("" if figure.published or not lines else " (after `not private:`)")


def figure_table() -> str:
    """The markdown table of every figure, between its markers."""
    lines = [
        TABLE_START,
        "| figure | written to | log line | TensorBoard / W&B tag | what it is |",
        "|---|---|---|---|---|",
        *(
            f"| `{f.name}` | {written_to(f)} | {log_lines(f)} | {f'`{f.tag}`' if f.tag else ''} | {f.doc} |"
            for f in FIGURES
        ),
        TABLE_END,
    ]
    return "\n".join(lines)


def with_figure_table(text: str) -> str:
    """`text` (docs/running.md) with the figure table between its markers redrawn."""
    start, end = text.index(TABLE_START), text.index(TABLE_END) + len(TABLE_END)
    return text[:start] + figure_table() + text[end:]


if __name__ == "__main__":
    if "--write" in sys.argv:
        doc = Path(__file__).resolve().parents[2] / FIGURES_DOC
        doc.write_text(with_figure_table(doc.read_text()))
        print(f"wrote the figure table of {doc}")
    else:
        print(figure_table())
