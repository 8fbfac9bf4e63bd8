"""DP-FedSAM-top_k server (DP-FedSAM paper, Algorithm 1 Option II; docs/algorithms.md §3).

Clients clip, add their noise share, then keep the k = ceil(p * size) largest-magnitude
coordinates (post-processing: no privacy cost) and upload them in sparse form
(`dpcore.privacy.mechanisms.sparse_encode`). The server decodes and checks every upload, rejecting
malformed ones (indices out of range or duplicated, wrong counts), and averages the
dense sums with the fixed denominator m, not the number of non-zeros. It measures the
bytes it received next to what dense float32 uploads would have cost.
"""

from __future__ import annotations

from collections.abc import Iterable
from logging import INFO

import numpy as np
from flwr.app import ArrayRecord, Message, MetricRecord, RecordDict
from flwr.common import log
from flwr.serverapp.strategy import Strategy

from dpcore.privacy import protocol as keys
from dpcore.privacy.mechanisms import TOPK_MODES, sparse_decode, sparse_encode, topk_sparsify
from dpcore.privacy.settings import one_of, require

from .dp_fedavg import DPFedAvg
from .reply_gate import MetricRule


def payload_bytes(record: ArrayRecord) -> int:
    """Bytes of the serialized arrays of a record (what travels, npy headers included)."""
    return sum(len(array.data) for array in record.values())


class DPFedSAMTopK(DPFedAvg):
    """DPFedAvg whose clients upload top-k sparse updates.

    Parameters (besides DPFedAvg's): sparsity p in (0, 1] (k = ceil(p * size)) and
    topk_mode `per-layer` (k per tensor, the paper's Eq. 12) or `global` (k over the whole
    update, its Definition 5). Needs `distributed` noise: top-k after noise must run on the
    client, before upload.
    """

    reply_metric_rules = {**DPFedAvg.reply_metric_rules, keys.KEPT_VALUES: MetricRule(low=0, integer=True)}

    def __init__(
        self, strategy: Strategy | None = None, *, sparsity: float = 0.4, topk_mode: str = "per-layer", **kwargs
    ) -> None:
        self.check_topk(sparsity, topk_mode, kwargs.get("noise_placement", "central"))
        super().__init__(strategy, **kwargs)
        self.sparsity, self.topk_mode = sparsity, topk_mode
        self.upload_bytes_total = 0
        self.dense_bytes_total = 0
        self._honest_bytes: tuple[list, int] = ([], 0)  # (shapes, bytes of an honest upload for them)

    @classmethod
    def check_settings(cls, *, sparsity: float = 0.4, topk_mode: str = "per-layer", **settings) -> None:
        cls.check_topk(sparsity, topk_mode, settings.get("noise_placement", "central"))
        super().check_settings(**settings)

    @staticmethod
    def check_topk(sparsity: float, topk_mode: str, noise_placement: str) -> None:
        require(0 < sparsity <= 1, "sparsity", sparsity, "must be in (0, 1]")
        one_of("topk_mode", topk_mode, TOPK_MODES)
        require(
            noise_placement != "local",
            "noise_placement",
            noise_placement,
            "'local' is not supported with top-k uploads (the local-DP mod noises dense updates): use 'central' "
            "or 'distributed'",
        )

    def guarantee_caveats(self) -> list[str]:
        """Top-k of each client's noisy share (the paper's order, distributed noise) is not post-processing of
        the release: which coordinates of the sum are exactly zero depends on who took part."""
        caveats = super().guarantee_caveats()
        if self.noise_placement == "distributed" and self.noise_multiplier > 0 and self.sparsity < 1:
            caveats.append(
                "top-k after distributed noise: the support of the released sum depends on who took "
                "part (docs/topk-wavelet.md); noise-placement = 'central' gives the accounted epsilon"
            )
        return caveats

    def client_train_config(self, server_round: int) -> dict:
        return {
            **super().client_train_config(server_round),
            keys.SPARSITY: float(self.sparsity),
            keys.TOPK_MODE: self.topk_mode,
        }

    def decode_update(self, content: RecordDict) -> tuple[list[np.ndarray], bool]:
        """Dense update from the sparse upload (always an update); raises (-> rejected) if it is malformed."""
        assert self.current_arrays is not None
        shapes = [a.shape for a in self.current_arrays.to_numpy_ndarrays()]
        encoded = content[self.arrayrecord_key].to_numpy_ndarrays()
        return sparse_decode(encoded, shapes, self.sparsity, self.topk_mode), True

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        replies = list(replies)
        assert self.current_arrays is not None
        arrived = [m for m in replies if not m.has_error() and self.arrayrecord_key in m.content.array_records]
        upload = sum(payload_bytes(m.content[self.arrayrecord_key]) for m in arrived)
        dense = len(arrived) * payload_bytes(self.current_arrays)
        self.upload_bytes_total += upload
        self.dense_bytes_total += dense
        arrays, metrics = super().aggregate_train(server_round, replies)
        assert metrics is not None
        metrics["upload_bytes"] = upload  # totals over who arrived: diagnostics
        metrics["dense_bytes"] = dense
        metrics["dense_bytes_per_client"] = payload_bytes(self.current_arrays)
        if (honest := self.honest_upload_bytes()) is not None:
            metrics["upload_bytes_per_client"] = honest  # from the settings: published
        return arrays, metrics

    def honest_upload_bytes(self) -> int | None:
        """Bytes of one honest client's sparse upload for the current model under `per-layer` top-k: they depend
        only on the shapes and p (the counts k_j and the support encoding), so they are public. Under `global`
        top-k each tensor's share of the k values depends on the client's data: None (a diagnostic)."""
        assert self.current_arrays is not None
        if self.topk_mode != "per-layer":
            return None
        shapes = [a.shape for a in self.current_arrays.to_numpy_ndarrays()]
        if shapes != self._honest_bytes[0]:
            example = [np.arange(1, int(np.prod(s)) + 1, dtype=np.float32).reshape(s) for s in shapes]
            encoded = sparse_encode(example, topk_sparsify(example, self.sparsity, self.topk_mode))
            self._honest_bytes = (shapes, payload_bytes(ArrayRecord(encoded)))
        return self._honest_bytes[1]

    def extra_state(self) -> dict:
        return {
            **super().extra_state(),
            "upload_bytes_total": self.upload_bytes_total,
            "dense_bytes_total": self.dense_bytes_total,
        }

    def load_extra_state(self, state: dict) -> None:
        super().load_extra_state(state)
        self.upload_bytes_total, self.dense_bytes_total = (
            int(state["upload_bytes_total"]),
            int(state["dense_bytes_total"]),
        )

    def summary(self) -> None:
        super().summary()
        log(INFO, "\t└──> top-k: p=%.3g (%s), sparse uploads", self.sparsity, self.topk_mode)

    def describe(self) -> dict:
        per_client = {}
        if self.current_arrays is not None and (honest := self.honest_upload_bytes()) is not None:
            dense = payload_bytes(self.current_arrays)
            per_client = {
                "upload_bytes_per_client": honest,
                "dense_bytes_per_client": dense,
                "upload_fraction_of_dense": honest / dense,
            }
        return {**super().describe(), "sparsity": self.sparsity, "topk_mode": self.topk_mode, **per_client}

    def describe_diagnostics(self) -> dict:
        """Byte totals over the uploads that arrived (they count participants)."""
        return {
            **super().describe_diagnostics(),
            "upload_bytes_total": self.upload_bytes_total,
            "dense_bytes_total": self.dense_bytes_total,
            "upload_fraction_of_dense": (
                self.upload_bytes_total / self.dense_bytes_total if self.dense_bytes_total else None
            ),
        }
