"""The presets: functions that return the DP wrapper (`DPFedAvg`) composed with a part, not subclasses.

- `DPFedSAMTopK`: top-k sparse uploads (`strategies.parts.topk.TopKCodec`), from the flat keywords `sparsity`
  and `topk_mode` (DP-FedSAM paper, Algorithm 1 Option II);
- `DPFedAvgWavelet`: Haar-wavelet server noise (`strategies.parts.wavelet.WaveletMechanism`), from the flat
  keyword `wavelet_calibration` (the wavelet paper's Algorithm 2).
"""

from __future__ import annotations

from dpfl.strategies.dp_fedavg import DPFedAvg

from .parts.topk import TopKCodec
from .parts.wavelet import WaveletMechanism


def DPFedSAMTopK(strategy=None, *args, sparsity: float = 0.4, topk_mode: str = "per-layer", **keywords) -> DPFedAvg:
    """DPFedAvg composed with top-k sparse uploads (`TopKCodec(sparsity, topk_mode)` after the given `parts`): a
    preset, not a subclass; the other arguments are DPFedAvg's."""
    return DPFedAvg(strategy, *args, **topk_keywords(sparsity, topk_mode, **keywords), name="DPFedSAMTopK")


def topk_keywords(sparsity: float = 0.4, topk_mode: str = "per-layer", parts=(), **keywords) -> dict:
    """DPFedAvg's keywords with the codec that `sparsity` and `topk_mode` name after the given parts."""
    return {**keywords, "parts": [*parts, TopKCodec(sparsity, topk_mode)]}


DPFedSAMTopK.check_settings = lambda **keywords: DPFedAvg.check_settings(**topk_keywords(**keywords))


def DPFedAvgWavelet(strategy=None, *args, wavelet_calibration: str = "exact", **keywords) -> DPFedAvg:
    """DPFedAvg with the server's Gaussian noise replaced by Haar-wavelet noise (`WaveletMechanism`, after the given
    `parts`): a preset, not a subclass; the other arguments are DPFedAvg's. Under central noise its clients clip too
    (Algorithm 2), and the server clips again."""
    return DPFedAvg(strategy, *args, **wavelet_keywords(wavelet_calibration, **keywords), name="DPFedAvgWavelet")


def wavelet_keywords(wavelet_calibration: str = "exact", parts=(), **keywords) -> dict:
    """DPFedAvg's keywords with the mechanism that `wavelet_calibration` names after the given parts."""
    return {**keywords, "parts": [*parts, WaveletMechanism(wavelet_calibration)]}


DPFedAvgWavelet.check_settings = lambda **keywords: DPFedAvg.check_settings(**wavelet_keywords(**keywords))
