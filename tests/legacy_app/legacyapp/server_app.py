"""The app's legacy ServerApp (server_fn), with dpfl's LegacyDPFedAvg where FedAvg was, or (run-config key
`strategy`: fedadam, fedprox) the app's own FedAdam or FedProx wrapped in LegacyDifferentialPrivacy in Flower's
signature. Its own evaluate metrics aggregation function; the final History written to the results file."""

import json
from pathlib import Path

from flwr.app import Context
from flwr.common import ndarrays_to_parameters
from flwr.server import Server, ServerApp, ServerAppComponents, ServerConfig
from flwr.server.client_manager import SimpleClientManager
from flwr.server.strategy import FedAdam, FedProx

from dpfl.strategies import DPFedAvg, LegacyDifferentialPrivacy, LegacyDPFedAvg
from legacyapp.task import initial_weights


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
                    "rounds": len(strategy.record.history),
                }
            )
        )
        return history, elapsed


def own_strategy(name: str):
    """The app's own legacy strategy, as it would run without DP."""
    common = {
        "fraction_evaluate": 1.0,
        "evaluate_metrics_aggregation_fn": mean_accuracy,
        "initial_parameters": ndarrays_to_parameters(initial_weights()),
    }
    if name == "fedadam":
        return FedAdam(eta=0.1, eta_l=0.5, tau=1e-3, **common)
    return FedProx(proximal_mu=0.1, **common)


def server_fn(context: Context) -> ServerAppComponents:
    cfg = context.run_config
    rounds = int(cfg["num-server-rounds"])
    sigma, clip = float(cfg["noise-multiplier"]), float(cfg["clipping-norm"])
    if str(cfg["strategy"]) == "dpfedavg":
        strategy = LegacyDPFedAvg(
            DPFedAvg(
                sample_rate=1.0,
                clipping_norm=clip,
                noise_multiplier=sigma,
                noise_placement="distributed",
                delta=1e-3,
                fraction_evaluate=1.0,
            ),
            evaluate_metrics_aggregation_fn=mean_accuracy,
            num_rounds=rounds,
            initial_parameters=ndarrays_to_parameters(initial_weights()),
        )
    else:  # Flower's legacy DP wrapper signature: (strategy, noise_multiplier, clipping_norm, num_sampled_clients)
        strategy = LegacyDifferentialPrivacy(
            own_strategy(str(cfg["strategy"])),
            sigma,
            clip,
            int(cfg["num-sampled-clients"]),
            num_rounds=rounds,
            noise_placement="distributed",
            delta=1e-3,
        )
    server = RecordingServer(Path(str(cfg["results-file"])), client_manager=SimpleClientManager(), strategy=strategy)
    return ServerAppComponents(server=server, config=ServerConfig(num_rounds=rounds))


app = ServerApp(server_fn=server_fn)
