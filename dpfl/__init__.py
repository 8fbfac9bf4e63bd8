"""dpfl: differentially private federated learning for Flower, the public API in one namespace.

    from flwr.serverapp.strategy import FedAdam
    from dpfl import DifferentialPrivacy, dp_privatize_mod

    strategy = DifferentialPrivacy(FedAdam(), clipping_norm=0.5, noise_multiplier=1.0, sample_rate=0.5)
    # the ClientApp, under distributed noise: @app.train(mods=[dp_privatize_mod])

Server side: the DP wrapper around any Flower Message-API strategy (`DifferentialPrivacy`, `DPFedAvg` around
FedAvg), its option objects (`PrivacyOptions`, `SamplingOptions`, `RunOptions`; ALIDPFL's `DPSGDOptions` and
`ServerData`; the modes `NoisePlacementMode`,
...), its parts (`Part`, the roles a part fills: `SelectionRole`, `MechanismRole`, `CodecRole`, `NoiseRole`, and
the shipped parts: `AdaptiveClipping`, `DPFTRL`, `TopKCodec`, `WaveletMechanism`, ...), the algorithms built on it, and the legacy-API adapters
(`LegacyDifferentialPrivacy` around any legacy strategy, `LegacyDPFedAvg`, and their SecAgg+ forms
`SecAggPlusDifferentialPrivacy`, `SecAggPlusDPFedAvg` with `DPSecAggPlusWorkflow`). Client side: the Flower
mods and the NumPyClients to subclass. The ledgers, for a client that accounts for itself. Each name is the object of its home module (strategies, clients, dpcore):
this package only re-exports, and nothing in the project imports it.

Importing it loads neither torch nor Opacus: the NumPyClients (torch) are imported on first use.
"""

from importlib import import_module

from clients.adaptive_clipping import clip_bit_mod, make_clip_bit_mod
from clients.local_dp import make_local_dp_mod
from clients.mods import dp_privatize_mod, make_dp_privatize_mod, uniform_weight_mod
from dpcore.privacy.accountants import epsilon_of
from dpcore.privacy.ledger import ClientLevelLedger, PrivacyLedger, SampleLevelLedgers
from dpcore.privacy.modes import ClientSamplingMode, NoisePlacementMode, PrivacyUnit, TargetEpsilonMode
from strategies.adaptive_clipping import AdaptiveClipping
from strategies.ali_dpfl import ALIDPFL
from strategies.audit import AuditCanaries
from strategies.dp_fedavg import DifferentialPrivacy, DPFedAvg
from strategies.dp_ftrl import DPFTRL
from strategies.dp_ftrl_mf import MatrixFactorizationFTRL
from strategies.legacy import LegacyDPFedAvg
from strategies.legacy_log import quiet_workflow_logs
from strategies.legacy_wrapper import LegacyDifferentialPrivacy
from strategies.mechanism import GaussianMechanism
from strategies.noise_placement import CentralNoise, DistributedNoise, LocalNoise
from strategies.options import DPSGDOptions, PrivacyOptions, RunOptions, SamplingOptions, ServerData
from strategies.partial_sharing import PartialSharingDPFedAvg, PersonalizedDPFedAvg
from strategies.parts import AfterRound, DenseCodec, Part
from strategies.roles import CodecRole, MechanismRole, NoiseRole, SelectionRole
from strategies.sample_epsilon import max_sample_epsilon, max_sample_epsilon_records, with_max_sample_epsilon
from strategies.sampling import ClientSampling, Selection
from strategies.secagg import DPSecAggPlusWorkflow, SecAggPlusDifferentialPrivacy, SecAggPlusDPFedAvg
from strategies.secure_aggregation import SecureAggregation
from strategies.topk import DPFedSAMTopK, TopKCodec
from strategies.wavelet import DPFedAvgWavelet, WaveletMechanism

_TORCH_NAMES = {  # name -> home module, imported on first access (they import torch; the Opacus ones Opacus)
    "TrainingClient": "clients.base",
    "LocalSGD": "clients.base",
    "SAMClient": "clients.sam",
    "TopKSAMClient": "clients.topk",
    "PartialSharingClient": "clients.personalized",
    "DP2FedSAMClient": "clients.personalized",
    "FineTuneClient": "clients.personalized",
    "DPSGDClient": "clients.dpsgd",
    "PrivacyEngine": "clients.opacus_ledger",  # Opacus' own, its steps charged by sample_ledger_mod
    "sample_ledger_mod": "clients.opacus_ledger",
    "make_sample_ledger_mod": "clients.opacus_ledger",
}

__all__ = [
    # server: the DP wrapper, its options and the algorithms on it
    "DifferentialPrivacy",
    "DPFedAvg",
    "AdaptiveClipping",
    "DPFTRL",
    "MatrixFactorizationFTRL",
    "DPFedSAMTopK",
    "DPFedAvgWavelet",
    "PersonalizedDPFedAvg",
    "PartialSharingDPFedAvg",
    "ALIDPFL",
    # server: the wrapper's option objects, its parts and the roles a part fills (docs/architecture.md)
    "PrivacyOptions",
    "SamplingOptions",
    "RunOptions",
    "DPSGDOptions",
    "ServerData",
    "NoisePlacementMode",
    "ClientSamplingMode",
    "TargetEpsilonMode",
    "PrivacyUnit",
    "Part",
    "AfterRound",
    "SelectionRole",
    "MechanismRole",
    "CodecRole",
    "NoiseRole",
    "Selection",
    "ClientSampling",
    "GaussianMechanism",
    "WaveletMechanism",
    "DenseCodec",
    "TopKCodec",
    "CentralNoise",
    "DistributedNoise",
    "LocalNoise",
    "AuditCanaries",
    "SecureAggregation",
    # server: Flower's legacy API and SecAgg+
    "LegacyDPFedAvg",
    "LegacyDifferentialPrivacy",
    "SecAggPlusDifferentialPrivacy",
    "SecAggPlusDPFedAvg",
    "DPSecAggPlusWorkflow",
    "quiet_workflow_logs",
    # client: Flower mods
    "dp_privatize_mod",
    "make_dp_privatize_mod",
    "clip_bit_mod",
    "make_clip_bit_mod",
    "make_local_dp_mod",
    "uniform_weight_mod",
    # sample-level DP in your own Opacus client: its ledger across rounds, the largest epsilon on the server
    "max_sample_epsilon",
    "max_sample_epsilon_records",
    "with_max_sample_epsilon",
    # client: NumPyClients and the Opacus ledger (torch, imported on first use)
    *_TORCH_NAMES,
    # the ledgers
    "PrivacyLedger",
    "ClientLevelLedger",
    "SampleLevelLedgers",
    "epsilon_of",
]


def __getattr__(name: str):
    """The torch-based names, imported from their home module on first access (PEP 562)."""
    if name not in _TORCH_NAMES:
        raise AttributeError(f"module 'dpfl' has no attribute {name!r}")
    value = getattr(import_module(_TORCH_NAMES[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
