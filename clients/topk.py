"""DP-FedSAM-top_k client (DP-FedSAM paper, Algorithm 1 Option II; docs/algorithms.md §3).

Local SAM, clip to C, add the noise share, then keep the k = ceil(p * size) largest
|coordinates| (per layer or globally) and upload them in sparse form (dense, zeros included,
under SecAgg+, which sums dense vectors). Top-k comes after the noise, so it is
post-processing and costs no privacy.
"""

from __future__ import annotations

import numpy as np

from dpfl.dpcore.privacy import protocol as keys
from dpfl.dpcore.privacy.mechanisms import sparse_encode, topk_sparsify

from .sam import SAMClient


class TopKSAMClient(SAMClient):
    """SAMClient whose upload is sparsified when the train config carries `sparsity`
    (and `topk-mode`), as DPFedSAMTopK sends it."""

    def upload(self, parameters: list[np.ndarray], new: list[np.ndarray], loss: float, steps: int, config: dict):
        upload, num_examples, metrics = super().upload(parameters, new, loss, steps, config)
        if keys.SPARSITY not in config:
            return upload, num_examples, metrics
        masks = topk_sparsify(upload, float(config[keys.SPARSITY]), str(config.get(keys.TOPK_MODE, "per-layer")))
        metrics[keys.KEPT_VALUES] = int(sum(int(m.sum()) for m in masks))
        if bool(config.get(keys.SECURE_AGGREGATION, False)):  # SecAgg+ sums dense vectors: zeros stay in
            return (
                [np.where(m, np.ravel(a), 0).astype(a.dtype).reshape(a.shape) for a, m in zip(upload, masks)],
                num_examples,
                metrics,
            )
        return sparse_encode(upload, masks), num_examples, metrics
