"""Server strategies: client-level DP as a wrapper around any Flower Message-API strategy, and its variants.

    from flwr.serverapp.strategy import FedAdam
    from dpfl.strategies import DifferentialPrivacy

    strategy = DifferentialPrivacy(FedAdam(), clipping_norm=0.5, noise_multiplier=1.0, sample_rate=0.5)

`DPFedAvg` is the same wrapper around FedAvg; `LegacyDPFedAvg` runs it under Flower's legacy workflow, and
`LegacyDifferentialPrivacy` wraps any legacy Flower strategy in the signature of Flower's legacy DP wrappers;
`SecAggPlusDifferentialPrivacy` is its form under SecAgg+ (`DPSecAggPlusWorkflow`), `SecAggPlusDPFedAvg`
LegacyDPFedAvg's.
"""

from dpfl.strategies.dp_fedavg import DifferentialPrivacy, DPFedAvg
from dpfl.strategies.legacy.adapter import LegacyDPFedAvg
from dpfl.strategies.legacy.secagg import DPSecAggPlusWorkflow, SecAggPlusDifferentialPrivacy, SecAggPlusDPFedAvg
from dpfl.strategies.legacy.wrapper import LegacyDifferentialPrivacy

__all__ = [
    "DifferentialPrivacy",
    "DPFedAvg",
    "LegacyDPFedAvg",
    "LegacyDifferentialPrivacy",
    "SecAggPlusDifferentialPrivacy",
    "SecAggPlusDPFedAvg",
    "DPSecAggPlusWorkflow",
]
