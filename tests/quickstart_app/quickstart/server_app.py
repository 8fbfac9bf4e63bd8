"""ServerApp as in Flower's quickstart-pytorch, with `DifferentialPrivacy(FedAvg(...))` (or FedAdam) where
FedAvg was. It saves the final state dict after loading it into the model by name."""

import json
from pathlib import Path

import torch
from flwr.app import ArrayRecord, Context, MetricRecord
from flwr.serverapp import Grid, ServerApp
from flwr.serverapp.strategy import FedAdam, FedAvg

from dpfl.strategies import DifferentialPrivacy
from quickstart.task import Net, load_data, test

app = ServerApp()


@app.main()
def main(grid: Grid, context: Context) -> None:
    cfg = context.run_config
    model = Net()
    arrays = ArrayRecord(model.state_dict())
    wrapped = {
        "fedavg": FedAvg(fraction_evaluate=0.5),
        "fedadam": FedAdam(fraction_evaluate=0.5, eta=0.05, eta_l=0.1, tau=1e-3),
    }[str(cfg["strategy"])]
    strategy = DifferentialPrivacy(
        wrapped,
        clipping_norm=float(cfg["clipping-norm"]),
        noise_multiplier=float(cfg["noise-multiplier"]),
        sample_rate=1.0,
        noise_placement=str(cfg["noise-placement"]),
        delta=1e-3,
    )
    _, testset = load_data(0, 1)

    def central_evaluate(server_round: int, arrays: ArrayRecord) -> MetricRecord:
        net = Net()
        net.load_state_dict(arrays.to_torch_state_dict())
        loss, accuracy = test(net, testset)
        return MetricRecord({"accuracy": accuracy, "loss": loss})

    result = strategy.start(
        grid=grid, initial_arrays=arrays, num_rounds=int(cfg["num-server-rounds"]), evaluate_fn=central_evaluate
    )
    state_dict = result.arrays.to_torch_state_dict()
    model.load_state_dict(state_dict)  # by name: the keys the server started from
    _, accuracy = test(model, testset)
    out = Path(str(cfg["results-file"]))
    torch.save(state_dict, out.with_suffix(".pt"))
    out.write_text(
        json.dumps(
            {
                "accuracy": accuracy,
                "keys": list(state_dict),
                "dtypes": {k: str(v.dtype) for k, v in state_dict.items()},
                "num_batches_tracked": int(state_dict["bn.num_batches_tracked"]),
                **strategy.privacy_metrics(),
            }
        )
    )
