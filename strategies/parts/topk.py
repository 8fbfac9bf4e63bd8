"""DP-FedSAM-top_k server (DP-FedSAM paper, Algorithm 1 Option II; docs/algorithms.md §3).

Clients clip, add their noise share, then keep the k = ceil(p * size) largest-magnitude
coordinates (post-processing: no privacy cost) and upload them in sparse form
(`dpcore.privacy.mechanisms.sparse_encode`). The server decodes and checks every upload, rejecting
malformed ones (indices out of range or duplicated, wrong counts), and averages the
dense sums with the fixed denominator m, not the number of non-zeros. It measures the
bytes it received next to what dense float32 uploads would have cost.

`TopKCodec` is that codec, a part of the wrapper (the codec role, `strategies.parts.part`); the preset `DPFedSAMTopK`
(`strategies.presets`) returns the wrapper composed with it from the flat keywords `sparsity` and `topk_mode`.
"""

from __future__ import annotations

import numpy as np
from flwr.app import ArrayRecord, RecordDict

from dpfl.dpcore.privacy import protocol as keys
from dpfl.dpcore.privacy.mechanisms import TOPK_MODES, sparse_decode, sparse_encode, topk_sparsify
from dpfl.dpcore.privacy.settings import one_of, require
from dpfl.strategies.parts.noise_placement import PLACEMENTS
from dpfl.strategies.parts.part import Part, arrays_key
from dpfl.strategies.parts.reply_rules import MetricRule, reply_arrays


def payload_bytes(record: ArrayRecord) -> int:
    """Bytes of the serialized arrays of a record (what travels, npy headers included)."""
    return sum(len(array.data) for array in record.values())


class TopKCodec(Part):
    """Top-k sparse uploads: sparsity p in (0, 1] (k = ceil(p * size)) and mode `per-layer` (k per tensor, the
    paper's Eq. 12) or `global` (k over the whole update, its Definition 5). Needs noise the server adds or tops
    up: top-k after noise must run on the client, before upload."""

    roles = ("codec",)
    keyword = "sparsity"
    reply_rules = {keys.KEPT_VALUES: MetricRule(low=0, integer=True)}

    def __init__(self, sparsity: float = 0.4, topk_mode: str = "per-layer") -> None:
        require(0 < sparsity <= 1, "sparsity", sparsity, "must be in (0, 1]")
        one_of("topk_mode", topk_mode, TOPK_MODES)
        self.sparsity, self.topk_mode = sparsity, topk_mode
        self.upload_bytes_total = 0
        self.dense_bytes_total = 0
        self._honest_bytes: tuple[list, int] = ([], 0)  # (shapes, bytes of an honest upload for them)

    def check(self, privacy, others: frozenset[str]) -> None:
        require(
            PLACEMENTS[privacy.noise_placement].server_adds_noise,
            "noise_placement",
            privacy.noise_placement,
            "'local' is not supported with top-k uploads (the local-DP mod noises dense updates): use 'central' "
            "or 'distributed'",
        )

    def caveats(self, dp) -> list[str]:
        """Top-k of each client's noisy share (the paper's order, distributed noise) is not post-processing of
        the release: which coordinates of the sum are exactly zero depends on who took part."""
        if dp.noise.noise_in_shares and dp.privacy.noise_multiplier > 0 and self.sparsity < 1:
            return [
                "top-k after distributed noise: the support of the released sum depends on who took "
                "part (docs/topk-wavelet.md); noise-placement = 'central' gives the accounted epsilon"
            ]
        return []

    def client_config(self, dp, server_round: int) -> dict:
        return {keys.SPARSITY: float(self.sparsity), keys.TOPK_MODE: self.topk_mode}

    def decode(self, dp, content: RecordDict) -> tuple[list[np.ndarray], bool]:
        """Dense update from the sparse upload (always an update); raises (-> rejected) if it is malformed."""
        shapes = [a.shape for a in dp.round.everything]
        encoded = reply_arrays(content[arrays_key(dp)])
        return sparse_decode(encoded, shapes, self.sparsity, self.topk_mode), True

    def round_metrics(self, dp, server_round: int, replies: list) -> dict:
        """Bytes received and what dense uploads would have cost (totals over who arrived: diagnostics); the bytes
        of one honest upload (from the settings: published)."""
        arrived = [m for m in replies if not m.has_error() and arrays_key(dp) in m.content.array_records]
        upload = sum(payload_bytes(m.content[arrays_key(dp)]) for m in arrived)
        dense = len(arrived) * payload_bytes(dp.round.arrays)
        self.upload_bytes_total += upload
        self.dense_bytes_total += dense
        metrics = {
            "upload_bytes": upload,
            "dense_bytes": dense,
            "dense_bytes_per_client": payload_bytes(dp.round.arrays),
        }
        if (honest := self.honest_upload_bytes(dp)) is not None:
            metrics["upload_bytes_per_client"] = honest
        return metrics

    def honest_upload_bytes(self, dp) -> int | None:
        """Bytes of one honest client's sparse upload for the current model under `per-layer` top-k: they depend
        only on the shapes and p (the counts k_j and the support encoding), so they are public. Under `global`
        top-k each tensor's share of the k values depends on the client's data: None (a diagnostic)."""
        if self.topk_mode != "per-layer":
            return None
        shapes = [a.shape for a in dp.round.everything]
        if shapes != self._honest_bytes[0]:
            example = [np.arange(1, int(np.prod(s)) + 1, dtype=np.float32).reshape(s) for s in shapes]
            encoded = sparse_encode(example, topk_sparsify(example, self.sparsity, self.topk_mode))
            self._honest_bytes = (shapes, payload_bytes(ArrayRecord(encoded)))
        return self._honest_bytes[1]

    def state_dict(self) -> dict:
        return {"upload_bytes_total": self.upload_bytes_total, "dense_bytes_total": self.dense_bytes_total}

    def load_state_dict(self, state: dict) -> None:
        self.upload_bytes_total = int(state["upload_bytes_total"])
        self.dense_bytes_total = int(state["dense_bytes_total"])

    def summary(self) -> str:
        return f"\t└──> top-k: p={self.sparsity:.3g} ({self.topk_mode}), sparse uploads"

    def describe(self, dp) -> dict:
        per_client = {}
        if dp.round.arrays is not None and (honest := self.honest_upload_bytes(dp)) is not None:
            dense = payload_bytes(dp.round.arrays)
            per_client = {
                "upload_bytes_per_client": honest,
                "dense_bytes_per_client": dense,
                "upload_fraction_of_dense": honest / dense,
            }
        return {"sparsity": self.sparsity, "topk_mode": self.topk_mode, **per_client}

    def describe_diagnostics(self, dp) -> dict:
        """Byte totals over the uploads that arrived (they count participants)."""
        return {
            "upload_bytes_total": self.upload_bytes_total,
            "dense_bytes_total": self.dense_bytes_total,
            "upload_fraction_of_dense": (
                self.upload_bytes_total / self.dense_bytes_total if self.dense_bytes_total else None
            ),
        }
