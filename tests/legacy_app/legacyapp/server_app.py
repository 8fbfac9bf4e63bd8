"""The app's legacy ServerApp (server_fn), with dpfl's LegacyDPFedAvg where FedAvg was. Its own evaluate
metrics aggregation function; the final History written to the results file."""

import json
from pathlib import Path

from flwr.app import Context
from flwr.common import ndarrays_to_parameters
from flwr.server import Server, ServerApp, ServerAppComponents, ServerConfig
from flwr.server.client_manager import SimpleClientManager

from legacyapp.task import initial_weights
from strategies import DPFedAvg, LegacyDPFedAvg


def mean_accuracy(results) -> dict:
    """The app's own aggregation of the clients' evaluate metrics: an unweighted mean."""
    return {"mean_accuracy": sum(m["accuracy"] for _, m in results) / len(results)}


class RecordingServer(Server):
    """Flower's legacy Server that writes what its History holds when the run ends."""

    def __init__(self, out: Path, **kwargs) -> None:
        super().__init__(**kwargs)
        self.out = out

    def fit(self, num_rounds, timeout):
        history, elapsed = super().fit(num_rounds, timeout)
        strategy = self.strategy
        self.out.write_text(
            json.dumps(
                {
                    "metrics_distributed": {k: v for k, v in history.metrics_distributed.items()},
                    "metrics_distributed_fit": {k: v for k, v in history.metrics_distributed_fit.items()},
                    "epsilon": strategy.describe()["epsilon"],
                    "delta": strategy.describe()["delta"],
                    "rounds": len(strategy.history),
                }
            )
        )
        return history, elapsed


def server_fn(context: Context) -> ServerAppComponents:
    cfg = context.run_config
    rounds = int(cfg["num-server-rounds"])
    strategy = LegacyDPFedAvg(
        DPFedAvg(
            sample_rate=1.0,
            clipping_norm=float(cfg["clipping-norm"]),
            noise_multiplier=float(cfg["noise-multiplier"]),
            noise_placement="distributed",
            delta=1e-3,
            fraction_evaluate=1.0,
        ),
        evaluate_metrics_aggregation_fn=mean_accuracy,
        num_rounds=rounds,
        initial_parameters=ndarrays_to_parameters(initial_weights()),
    )
    server = RecordingServer(Path(str(cfg["results-file"])), client_manager=SimpleClientManager(), strategy=strategy)
    return ServerAppComponents(server=server, config=ServerConfig(num_rounds=rounds))


app = ServerApp(server_fn=server_fn)
