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
mods and the NumPyClients to subclass. The ledgers, for a client that accounts for itself. Each name is the object
of its home module (dpfl.strategies, dpfl.clients, dpfl.dpcore): this package only re-exports, and nothing in the
project imports its names.

Installed, the repository's packages live under this one name (`dpfl.strategies`, `dpfl.clients`,
`dpfl.dpcore`, `dpfl.fl_app`; pyproject.toml's package-dir), so an app's own `strategies` or `clients` module
never meets ours. In a checkout or a FAB they stay top-level folders beside this one, and the package path below
finds them there.

Importing it loads nothing else: each name is imported from its home module on first use (the NumPyClients
import torch, the Opacus pieces Opacus).
"""

import os
from importlib import import_module

# a checkout or a FAB: the packages are folders beside this one (installed, pyproject's package-dir puts them inside)
_HERE = os.path.dirname(os.path.abspath(__file__))
_BESIDE = os.path.dirname(_HERE)
_PACKAGES = ("strategies", "clients", "dpcore", "fl_app")
if not any(os.path.isdir(os.path.join(_HERE, p)) for p in _PACKAGES) and any(
    os.path.isfile(os.path.join(_BESIDE, p, "__init__.py")) for p in _PACKAGES
):
    __path__.append(_BESIDE)

_HOMES = {  # name -> home module, imported on first access
    "clip_bit_mod": "dpfl.clients.adaptive_clipping",
    "make_clip_bit_mod": "dpfl.clients.adaptive_clipping",
    "make_local_dp_mod": "dpfl.clients.local_dp",
    "dp_privatize_mod": "dpfl.clients.mods",
    "make_dp_privatize_mod": "dpfl.clients.mods",
    "uniform_weight_mod": "dpfl.clients.mods",
    "answer_client_id": "dpfl.clients.identity",  # a ClientApp's answer to the server's identity query
    "SampleBudgetSpent": "dpfl.clients.sample_budget",  # a per-client target's refusal (make_private_with_epsilon)
    "epsilon_of": "dpfl.dpcore.privacy.accountants",
    "ClientLevelLedger": "dpfl.dpcore.privacy.ledger",
    "PrivacyLedger": "dpfl.dpcore.privacy.ledger",
    "SampleLevelLedgers": "dpfl.dpcore.privacy.ledger",
    "ClientSamplingMode": "dpfl.dpcore.privacy.modes",
    "NoisePlacementMode": "dpfl.dpcore.privacy.modes",
    "PrivacyUnit": "dpfl.dpcore.privacy.modes",
    "TargetEpsilonMode": "dpfl.dpcore.privacy.modes",
    "ServerView": "dpfl.dpcore.privacy.modes",  # what a noise part answers (server_view)
    "SamplingForm": "dpfl.dpcore.privacy.modes",  # what a selection part answers (sampling_form)
    "AdaptiveClipping": "dpfl.strategies.parts.adaptive_clipping",
    "ALIDPFL": "dpfl.strategies.sample_level.ali_dpfl",
    "AuditCanaries": "dpfl.strategies.parts.audit",
    "DifferentialPrivacy": "dpfl.strategies.dp_fedavg",
    "DPFedAvg": "dpfl.strategies.dp_fedavg",
    "DPFTRL": "dpfl.strategies.parts.dp_ftrl",
    "MatrixFactorizationFTRL": "dpfl.strategies.parts.dp_ftrl_mf",
    "PaperClaim": "dpfl.strategies.parts.wavelet",
    "LegacyDPFedAvg": "dpfl.strategies.legacy.adapter",
    "quiet_workflow_logs": "dpfl.strategies.legacy.log",
    "LegacyDifferentialPrivacy": "dpfl.strategies.legacy.wrapper",
    "GaussianMechanism": "dpfl.strategies.parts.mechanism",
    "CentralNoise": "dpfl.strategies.parts.noise_placement",
    "DistributedNoise": "dpfl.strategies.parts.noise_placement",
    "LocalNoise": "dpfl.strategies.parts.noise_placement",
    "DPSGDOptions": "dpfl.strategies.loop.options",
    "PrivacyOptions": "dpfl.strategies.loop.options",
    "RunOptions": "dpfl.strategies.loop.options",
    "SamplingOptions": "dpfl.strategies.loop.options",
    "ServerData": "dpfl.strategies.loop.options",
    "PartialSharingDPFedAvg": "dpfl.strategies.partial_sharing",
    "PersonalizedDPFedAvg": "dpfl.strategies.partial_sharing",
    "AfterRound": "dpfl.strategies.parts.part",
    "DenseCodec": "dpfl.strategies.parts.part",
    "Part": "dpfl.strategies.parts.part",
    "CodecRole": "dpfl.strategies.parts.roles",
    "MechanismRole": "dpfl.strategies.parts.roles",
    "NoiseRole": "dpfl.strategies.parts.roles",
    "SelectionRole": "dpfl.strategies.parts.roles",
    "max_sample_epsilon": "dpfl.strategies.loop.sample_epsilon",
    "max_sample_epsilon_records": "dpfl.strategies.loop.sample_epsilon",
    "with_max_sample_epsilon": "dpfl.strategies.loop.sample_epsilon",
    "ClientSampling": "dpfl.strategies.parts.sampling",
    "Selection": "dpfl.strategies.parts.sampling",
    "DPSecAggPlusWorkflow": "dpfl.strategies.legacy.secagg",
    "SecAggPlusDifferentialPrivacy": "dpfl.strategies.legacy.secagg",
    "SecAggPlusDPFedAvg": "dpfl.strategies.legacy.secagg",
    "SecureAggregation": "dpfl.strategies.parts.secure_aggregation",
    "DPFedSAMTopK": "dpfl.strategies.presets",
    "TopKCodec": "dpfl.strategies.parts.topk",
    "DPFedAvgWavelet": "dpfl.strategies.presets",
    "WaveletMechanism": "dpfl.strategies.parts.wavelet",
}
_TORCH_HOMES = {  # the same, for the names that import torch (the Opacus ones Opacus)
    "TrainingClient": "dpfl.clients.base",
    "LocalSGD": "dpfl.clients.base",
    "SAMClient": "dpfl.clients.sam",
    "TopKSAMClient": "dpfl.clients.topk",
    "PartialSharingClient": "dpfl.clients.personalized",
    "DP2FedSAMClient": "dpfl.clients.personalized",
    "FineTuneClient": "dpfl.clients.personalized",
    "DPSGDClient": "dpfl.clients.dpsgd",
    "PrivacyEngine": "dpfl.clients.opacus_ledger",
    "sample_ledger_mod": "dpfl.clients.opacus_ledger",
    "make_sample_ledger_mod": "dpfl.clients.opacus_ledger",
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
    "ServerView",
    "SamplingForm",
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
    "PaperClaim",
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
    "answer_client_id",
    # sample-level DP in your own Opacus client: its ledger across rounds, the largest epsilon on the server
    "max_sample_epsilon",
    "max_sample_epsilon_records",
    "with_max_sample_epsilon",
    "SampleBudgetSpent",  # what make_private_with_epsilon under the mod raises past a per-client target
    # client: NumPyClients and the Opacus ledger (torch, imported on first use)
    *_TORCH_HOMES,
    # the ledgers
    "PrivacyLedger",
    "ClientLevelLedger",
    "SampleLevelLedgers",
    "epsilon_of",
]


def __getattr__(name: str):
    """Every public name, imported from its home module on first access (PEP 562)."""
    home = _HOMES.get(name) or _TORCH_HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'dpfl' has no attribute {name!r}")
    value = getattr(import_module(home), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
