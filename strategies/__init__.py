"""Server strategies: client-level DP as a wrapper around any Flower Message-API strategy, and its variants.

    from flwr.serverapp.strategy import FedAdam
    from strategies import DifferentialPrivacy

    strategy = DifferentialPrivacy(FedAdam(), clipping_norm=0.5, noise_multiplier=1.0, sample_rate=0.5)

`DPFedAvg` is the same wrapper around FedAvg; `LegacyDPFedAvg` runs it under Flower's legacy workflow.
"""

from .dp_fedavg import DifferentialPrivacy, DPFedAvg
from .legacy import LegacyDPFedAvg

__all__ = ["DifferentialPrivacy", "DPFedAvg", "LegacyDPFedAvg"]
