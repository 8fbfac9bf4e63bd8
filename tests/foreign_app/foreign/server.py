"""The foreign app's ServerApp (Message API), with dpfl's DPFedAvg instead of FedAvg."""

import json
from pathlib import Path

from flwr.app import ArrayRecord, Context, MetricRecord
from flwr.serverapp import Grid, ServerApp

from dpfl import DPFedAvg  # dpfl, installed on the server
from foreign.task import accuracy, blobs, initial_weights

app = ServerApp()


@app.main()
def main(grid: Grid, context: Context) -> None:
    cfg = context.run_config
    x, y = blobs(1000, seed=0)
    strategy = DPFedAvg(
        sample_rate=1.0,
        clipping_norm=float(cfg["clipping-norm"]),
        noise_multiplier=float(cfg["noise-multiplier"]),
        noise_placement="distributed",
        min_available_nodes=int(cfg["min-nodes"]),
        secure_rng=True,
    )
    result = strategy.start(
        grid,
        ArrayRecord(initial_weights()),
        num_rounds=int(cfg["num-rounds"]),
        evaluate_fn=lambda rnd, arrays: MetricRecord({"accuracy": accuracy(arrays.to_numpy_ndarrays(), x, y)}),
    )
    final = result.evaluate_metrics_serverapp[max(result.evaluate_metrics_serverapp)]
    summary = {"final_accuracy": final["accuracy"], "history": strategy.record.history, **strategy.describe()}
    out = Path(str(cfg["results-dir"]))
    out.mkdir(parents=True, exist_ok=True)
    (out / "summary.json").write_text(json.dumps(summary, default=str, indent=1))
