"""Presets are factories (issue 41 item 6): `DPFedSAMTopK` and `DPFedAvgWavelet` return a DPFedAvg composed with
their part, and what the wavelet preset needed of a subclass (its clients clip under central noise) is declared by
the part."""

import inspect
import logging

import pytest
from flwr.serverapp.strategy import FedAdam

from dpfl.dpcore.privacy import protocol as keys
from dpfl.strategies.dp_fedavg import DPFedAvg
from dpfl.strategies.parts.roles import ROLE_PROTOCOLS, check_roles, role_members
from dpfl.strategies.parts.topk import TopKCodec
from dpfl.strategies.parts.wavelet import WaveletMechanism
from dpfl.strategies.presets import DPFedAvgWavelet, DPFedSAMTopK

COMMON = dict(sample_rate=0.5, clipping_norm=1.5, noise_multiplier=1.0)


def test_the_presets_are_functions_that_return_the_wrapper_holding_their_part():
    assert not inspect.isclass(DPFedSAMTopK) and not inspect.isclass(DPFedAvgWavelet)
    topk = DPFedSAMTopK(FedAdam(), sparsity=0.25, topk_mode="global", **COMMON)
    wavelet = DPFedAvgWavelet(wavelet_calibration="paper", **COMMON)
    assert type(topk) is DPFedAvg and type(wavelet) is DPFedAvg
    assert isinstance(topk.codec, TopKCodec) and (topk.codec.sparsity, topk.codec.topk_mode) == (0.25, "global")
    assert isinstance(topk.strategy, FedAdam) and topk.codec in topk.parts
    assert isinstance(wavelet.mechanism, WaveletMechanism) and wavelet.mechanism.calibration == "paper"
    assert wavelet.mechanism in wavelet.parts
    assert (topk.privacy.clipping_norm, topk.privacy.noise_multiplier, topk.population.sample_rate) == (1.5, 1.0, 0.5)
    assert (topk.name, wavelet.name, DPFedAvg(**COMMON).name) == (
        "DPFedSAMTopK",
        "DPFedAvgWavelet",
        "DifferentialPrivacy",
    )


def test_a_preset_logs_its_own_name(caplog):
    caplog.set_level(logging.INFO, logger="flwr")
    DPFedAvgWavelet(**COMMON).summary()
    assert "\t├──> Client-level DP (DPFedAvgWavelet)" in caplog.messages


def test_a_preset_passes_given_parts_and_flower_positional_arguments():
    topk = DPFedSAMTopK(None, 2.0, 0.5, 3, parts=[WaveletMechanism()], sparsity=0.5)
    assert (topk.privacy.noise_multiplier, topk.privacy.clipping_norm, topk.population.num_sampled_clients) == (
        2.0,
        0.5,
        3,
    )
    assert isinstance(topk.mechanism, WaveletMechanism) and isinstance(topk.codec, TopKCodec)


def test_the_mechanism_declares_that_its_clients_clip_under_central_noise():
    """The same mechanism composed into a plain DPFedAvg makes its clients clip (the preset adds nothing more); the
    Gaussian mechanism does not."""
    for dp in (DPFedAvg(parts=[WaveletMechanism()], **COMMON), DPFedAvgWavelet(**COMMON)):
        assert dp.noise.privatize_config(1.0, 1.5, 1)[keys.PRIVATIZE] is True
    assert DPFedAvg(**COMMON).noise.privatize_config(1.0, 1.5, 1)[keys.PRIVATIZE] is False
    assert "clients_clip_under_central_noise" in role_members(ROLE_PROTOCOLS["mechanism"])[1]


def test_a_mechanism_without_the_declaration_is_refused_naming_it():
    class Bare:  # a mechanism that is not a Part and does not say whether its clients clip
        roles = ("mechanism",)
        make_ledger = ledger_from_state = accounted_noise_multiplier = release = staticmethod(lambda *a: None)

    with pytest.raises(TypeError, match="clients_clip_under_central_noise"):
        check_roles(Bare())


@pytest.mark.parametrize(
    "preset, keywords, needle",
    [
        (DPFedSAMTopK, dict(sparsity=1.5), "sparsity"),
        (DPFedSAMTopK, dict(topk_mode="rows"), "topk_mode"),
        (DPFedAvgWavelet, dict(wavelet_calibration="loose"), "wavelet_calibration"),
        (DPFedAvgWavelet, dict(noise_placement="local"), "noise_placement"),
    ],
)
def test_a_preset_checks_its_settings_as_it_builds(preset, keywords, needle):
    with pytest.raises(ValueError, match=needle):
        preset.check_settings(**COMMON, **keywords)
    with pytest.raises(ValueError, match=needle):
        preset(**COMMON, **keywords)


def test_an_unknown_keyword_is_refused_under_the_preset_name():
    with pytest.raises(TypeError, match="DPFedSAMTopK"):
        DPFedSAMTopK(**COMMON, sparsity_rate=0.1)
