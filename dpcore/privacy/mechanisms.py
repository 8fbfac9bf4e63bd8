"""Privacy mechanisms on flat update vectors (numpy only; used by server and clients).

Every mechanism exists here once. Updates travel as lists of arrays; mechanisms act
on the concatenation of all of them (the "global" vector of docs/algorithms.md §0).
"""

from __future__ import annotations

import math
import secrets
from collections.abc import Sequence

import numpy as np
import pywt

from .modes import ClientSamplingMode

Shapes = list[tuple[int, ...]]


def flatten(arrays: Sequence[np.ndarray]) -> np.ndarray:
    """Concatenate arrays into one float32 vector."""
    if not arrays:
        return np.zeros(0, dtype=np.float32)
    return np.concatenate([np.asarray(a, dtype=np.float32).ravel() for a in arrays])


def float_indices(arrays: Sequence[np.ndarray]) -> list[int]:
    """Positions of the floating-point arrays: what DP trains, clips and noises (the others pass through)."""
    return [i for i, a in enumerate(arrays) if np.issubdtype(np.asarray(a).dtype, np.floating)]


def unflatten(vector: np.ndarray, shapes: Shapes) -> list[np.ndarray]:
    """Split a flat vector back into arrays of the given shapes."""
    sizes = [int(np.prod(s)) for s in shapes]
    if vector.size != sum(sizes):
        raise ValueError(f"vector has {vector.size} entries, shapes need {sum(sizes)}")
    parts = np.split(vector, np.cumsum(sizes)[:-1]) if sizes else []
    return [p.reshape(s) for p, s in zip(parts, shapes)]


NORM_CHUNK = 1 << 20  # l2_norm's float64 copy, 8 MB at most: 5x faster on an 11 M update than one copy of it all


def l2_norm(vector: np.ndarray) -> float:
    """||v||_2 = sqrt(sum_j v_j^2), accumulated in float64, NORM_CHUNK entries at a time (a vector of up to
    NORM_CHUNK entries: one float64 dot product)."""
    v = np.ravel(vector)
    total = 0.0
    for start in range(0, max(v.size, 1), NORM_CHUNK):
        chunk = np.asarray(v[start : start + NORM_CHUNK], dtype=np.float64)
        total += float(np.dot(chunk, chunk))
    return math.sqrt(total)


def sum_updates(updates: Sequence[np.ndarray], size: int) -> np.ndarray:
    """sum_i Delta_i in float32, added one update after the other into one vector: the same sums, bit for bit, as
    np.sum(updates, axis=0), without the (n, d) copy it stacks first (4.5 GB for 100 resnet18-gn updates)."""
    total = np.zeros(size, np.float32)
    for update in updates:
        total += update
    return total


def clip_to_norm(vector: np.ndarray, clip_norm: float) -> tuple[np.ndarray, float]:
    """v * min(1, C / ||v||_2); returns (clipped vector, norm before clipping).

    clip_norm <= 0 means no clipping (only for non-private reference runs).
    """
    norm = l2_norm(vector)
    if clip_norm <= 0 or norm <= clip_norm:
        return vector, norm
    return (vector * (clip_norm / norm)).astype(vector.dtype, copy=False), norm


def make_rng(seed: int, *stream: int, secure: bool = False) -> np.random.Generator:
    """Generator for one noise stream: seeded from (seed, *stream), or from OS entropy.

    Seeded noise makes runs reproducible, but anyone who knows the seed can remove
    the noise; `secure=True` draws the seed from the OS (like Opacus' secure_mode).
    """
    if secure:
        return np.random.default_rng(secrets.randbits(128))
    return np.random.default_rng(np.random.SeedSequence([int(seed), *map(int, stream)]))


def gaussian_noise(size: int, std: float, rng: np.random.Generator) -> np.ndarray:
    """N(0, std^2 I_size) as float32."""
    if std <= 0:
        return np.zeros(size, dtype=np.float32)
    noise = rng.standard_normal(size, dtype=np.float32)
    noise *= np.float32(std)
    return noise


def clip_and_noise(
    vector: np.ndarray, clip_norm: float, noise_std: float, rng: np.random.Generator
) -> tuple[np.ndarray, float]:
    """Client share of the Gaussian mechanism: clip to C, add N(0, noise_std^2 I).

    Returns (privatized vector, norm before clipping).
    """
    clipped, norm = clip_to_norm(vector, clip_norm)
    return clipped + gaussian_noise(clipped.size, noise_std, rng), norm


TRUNCATION_PROBABILITY = 1e-12  # per round: how often a Poisson sample may exceed the noise shares n_s


def noise_share_count(
    population: int, sample_rate: float, client_sampling: str = "poisson", tail: float = TRUNCATION_PROBABILITY
) -> int:
    """n_s, how many noise shares make up sigma^2 C^2 under distributed noise (docs/algorithms.md §0).

    Each client adds N(0, sigma^2 C^2 / n_s) and the server tops up the n_s - k shares that did not
    arrive, so the released sum carries N(0, sigma^2 C^2) whatever the number k <= n_s of
    participants: its variance does not reveal k. Fixed-size sampling: n_s = m. Poisson sampling:
    the smallest n with P(Binomial(M, q) >= n) <= tail (at most M + 1, where it is 0: a neighbouring
    federation has one client more); a round whose sample is larger keeps n_s of it, and the ledger
    reserves that probability out of delta (`truncation_probability`).
    """
    if client_sampling == ClientSamplingMode.FIXED:
        return max(1, round(sample_rate * population))
    from scipy.stats import binom

    tails = binom.sf(np.arange(population + 1), population, sample_rate)  # P(X >= n) for n = 1 .. M + 1
    return int(np.argmax(tails <= tail)) + 1 if (tails <= tail).any() else population + 1


def truncation_probability(population: int, sample_rate: float, noise_shares: int) -> float:
    """P(Binomial(population, q) >= n_s): the chance that the other clients of a round already fill the
    n_s shares, the only event on which the truncated mechanism differs from the sampled Gaussian one
    (for a federation of `population` clients and its neighbours)."""
    from scipy.stats import binom

    return float(binom.sf(noise_shares - 1, population, sample_rate))


def distributed_noise_std(noise_multiplier: float, clip_norm: float, noise_shares: float) -> float:
    """Per-client noise std sigma*C/sqrt(n_s), so n_s shares sum to N(0, sigma^2 C^2)."""
    return noise_multiplier * clip_norm / float(np.sqrt(noise_shares))


def topup_noise_std(noise_multiplier: float, clip_norm: float, noise_shares: float, received: int) -> float:
    """Server top-up std sigma*C*sqrt((n_s - k)/n_s) when k < n_s noisy shares arrived."""
    missing = max(0.0, noise_shares - received)
    return noise_multiplier * clip_norm * float(np.sqrt(missing / noise_shares))


def update_problem(arrays: Sequence[np.ndarray], shapes: Shapes) -> str | None:
    """Why a client update cannot be averaged in (wrong count/shape, non-float, not finite as float32), else None."""
    if len(arrays) != len(shapes):
        return f"expected {len(shapes)} arrays, got {len(arrays)}"
    for i, (a, shape) in enumerate(zip(arrays, shapes)):
        if tuple(a.shape) != tuple(shape):
            return f"array {i} has shape {tuple(a.shape)}, expected {tuple(shape)}"
        if not np.issubdtype(a.dtype, np.floating):
            return f"array {i} has dtype {a.dtype}, expected a float type"
        with np.errstate(over="ignore", invalid="ignore"):
            if not np.all(np.isfinite(np.asarray(a, dtype=np.float32))):  # finite in the dtype it is summed in
                return f"array {i} contains NaN or Inf (as float32)"
    return None


# ---------------------------------------------------------------------------- top-k sparsification
TOPK_MODES = ("per-layer", "global")
_EXACT_PARTITION_BELOW = 1 << 16  # smaller vectors: one argpartition; larger: a band around the quantile


def topk_count(size: int, fraction: float) -> int:
    """k = ceil(p * size) (DP-FedSAM Eq. 12), at least 1; rounding guards against 0.7 * 10 = 7.000000000000001."""
    if not 0 < fraction <= 1:
        raise ValueError(f"sparsity={fraction!r} must be in (0, 1]")
    return min(size, max(1, math.ceil(round(fraction * size, 6)))) if size else 0


def topk_mask(vector: np.ndarray, k: int) -> np.ndarray:
    """Boolean mask of k coordinates of largest |v| (exact; ties at the k-th value broken arbitrarily).

    Large vectors: estimate the (1 - k/n) quantile of |v| from a strided sample, take every
    coordinate above a band around it, and argpartition only inside the band. The result is the
    exact top-k whenever the band holds the k-th value; otherwise it falls back to a full
    argpartition. Either way every selected |v| >= every unselected |v|.
    """
    n = vector.size
    if k >= n:
        return np.ones(n, dtype=bool)
    if k <= 0:
        return np.zeros(n, dtype=bool)
    magnitude = np.abs(vector)
    if n >= _EXACT_PARTITION_BELOW:
        sample = magnitude[:: max(1, n // 8192)]
        q = 1.0 - k / n
        low, high = np.quantile(sample, [max(0.0, q - 0.01), min(1.0, q + 0.01)])
        mask = magnitude > high
        need = k - int(np.count_nonzero(mask))
        band = np.flatnonzero((magnitude >= low) & ~mask)
        if 0 <= need <= band.size:
            if need:
                mask[band[np.argpartition(magnitude[band], band.size - need)[band.size - need :]]] = True
            return mask
    mask = np.zeros(n, dtype=bool)
    mask[np.argpartition(magnitude, n - k)[n - k :]] = True
    return mask


def topk_sparsify(arrays: Sequence[np.ndarray], fraction: float, mode: str = "per-layer") -> list[np.ndarray]:
    """Masks of the kept coordinates: per tensor k_j = ceil(p * size_j) (`per-layer`), or
    k = ceil(p * d) over the concatenated update (`global`, DP-FedSAM Definition 5)."""
    if mode == "per-layer":
        return [topk_mask(np.ravel(a), topk_count(a.size, fraction)) for a in arrays]
    if mode == "global":
        vector = flatten(arrays)
        mask = topk_mask(vector, topk_count(vector.size, fraction))
        return unflatten(mask, [(a.size,) for a in arrays])
    raise ValueError(f"topk mode={mode!r} is not one of: {', '.join(TOPK_MODES)}")


def sparse_encode(arrays: Sequence[np.ndarray], masks: Sequence[np.ndarray]) -> list[np.ndarray]:
    """Compact upload of the kept coordinates: per tensor [support, values (float32)].

    support is whichever is smaller: the sorted int32 indices (8 bytes per kept value with its
    value) or the bit mask packed into uint8 (size/8 bytes + 4 per kept value). At p = 0.4 the
    mask form costs 1.725 bytes per parameter against 4 dense; indices win below p = 1/32.
    """
    encoded: list[np.ndarray] = []
    for array, mask in zip(arrays, masks):
        flat = np.asarray(array, dtype=np.float32).ravel()
        values = flat[mask]
        if 4 * values.size < flat.size / 8:
            encoded.append(np.flatnonzero(mask).astype(np.int32))
        else:
            encoded.append(np.packbits(mask))
        encoded.append(values)
    return encoded


def _indices_to_dense(j: int, support: np.ndarray, values: np.ndarray, size: int) -> np.ndarray:
    """Tensor j's dense flat array from int32 indices: in range, strictly increasing, one per value."""
    if support.ndim != 1 or support.size != values.size:
        raise ValueError(f"tensor {j}: {support.size} indices for {values.size} values")
    if support.size and (support.min() < 0 or support.max() >= size):
        raise ValueError(f"tensor {j}: index out of range [0, {size}) (min {support.min()}, max {support.max()})")
    steps = np.diff(support)
    if np.any(steps == 0):
        raise ValueError(f"tensor {j}: duplicated index {support[1:][steps == 0][0]}")
    if np.any(steps < 0):
        raise ValueError(f"tensor {j}: indices are not sorted")
    out = np.zeros(size, dtype=np.float32)
    out[support] = values
    return out


def _mask_to_dense(j: int, support: np.ndarray, values: np.ndarray, size: int) -> np.ndarray:
    """Tensor j's dense flat array from a packed uint8 bit mask: right length, zero padding, one bit per value."""
    if support.shape != ((size + 7) // 8,):
        raise ValueError(f"tensor {j}: bit mask has shape {support.shape}, expected ({(size + 7) // 8},)")
    bits = np.unpackbits(support)
    if np.any(bits[size:]):
        raise ValueError(f"tensor {j}: bit mask marks positions beyond the tensor's {size} entries")
    mask = bits[:size].astype(bool)
    if int(np.count_nonzero(mask)) != values.size:
        raise ValueError(
            f"tensor {j}: bit mask keeps {np.count_nonzero(mask)} entries but {values.size} values were sent"
        )
    out = np.zeros(size, dtype=np.float32)
    out[mask] = values
    return out


def _decode_tensor(j: int, support: np.ndarray, values: np.ndarray, size: int) -> np.ndarray:
    """Tensor j's dense flat array from its support (int32 indices or uint8 mask) and float values."""
    if values.ndim != 1 or not np.issubdtype(values.dtype, np.floating):
        raise ValueError(f"tensor {j}: values must be a 1-D float array, got {values.dtype} {values.shape}")
    if support.dtype == np.int32:
        return _indices_to_dense(j, support, values, size)
    if support.dtype == np.uint8:
        return _mask_to_dense(j, support, values, size)
    raise ValueError(f"tensor {j}: support must be int32 indices or a uint8 bit mask, got {support.dtype}")


def sparse_decode(
    encoded: Sequence[np.ndarray], shapes: Shapes, fraction: float, mode: str = "per-layer"
) -> list[np.ndarray]:
    """Dense arrays from `sparse_encode`'s form; ValueError if the upload is malformed.

    Checked: two arrays per tensor, support dtype (int32 indices or uint8 mask), indices in
    range and strictly increasing (so no duplicates), mask length and zero padding bits,
    one value per kept coordinate, and the number kept: ceil(p * size) per tensor
    (`per-layer`) or ceil(p * d) in all (`global`).
    """
    if len(encoded) != 2 * len(shapes):
        raise ValueError(
            f"sparse update has {len(encoded)} arrays, expected {2 * len(shapes)} (support and values per tensor)"
        )
    dense, kept = [], 0
    for j, shape in enumerate(shapes):
        support, values = np.asarray(encoded[2 * j]), np.asarray(encoded[2 * j + 1])
        size = int(np.prod(shape))
        out = _decode_tensor(j, support, values, size)
        if mode == "per-layer" and values.size != topk_count(size, fraction):
            raise ValueError(
                f"tensor {j}: {values.size} values kept, per-layer top-k with "
                f"p={fraction} keeps {topk_count(size, fraction)}"
            )
        kept += values.size
        dense.append(out.reshape(shape))
    if mode == "global":
        total = sum(int(np.prod(s)) for s in shapes)
        if kept != topk_count(total, fraction):
            raise ValueError(f"{kept} values kept, global top-k with p={fraction} keeps {topk_count(total, fraction)}")
    elif mode != "per-layer":
        raise ValueError(f"topk mode={mode!r} is not one of: {', '.join(TOPK_MODES)}")
    return dense


# ---------------------------------------------------------------------------- Haar-wavelet noise
def haar_padded_size(size: int) -> int:
    """n = 2^L >= size (and >= 2): the length the vector is zero-padded to."""
    return 1 << max(1, (int(size) - 1).bit_length())


def haar_weights(n: int) -> list[int]:
    """W per coefficient array of `pywt.wavedec(x, 'haar')` (base first, then details coarse to
    fine): n for the base coefficient, the node's block size 2^l for a level-l detail."""
    levels = int(math.log2(n))
    return [n] + [2**l for l in range(levels, 0, -1)]


def haar_coefficients(vector: np.ndarray) -> list[np.ndarray]:
    """The wavelet paper's Haar coefficients (its section 4.3): base = mean, detail = (mean(L) - mean(R)) / 2.

    pywt's Haar is orthonormal: its level-l coefficient is 2^(l/2) times the paper's, so
    the paper's = pywt's / sqrt(W) (W = block size, n for the base). Zero-pads to 2^L.
    """
    v = np.asarray(vector, dtype=np.float64)
    n = haar_padded_size(v.size)
    coeffs = pywt.wavedec(np.pad(v, (0, n - v.size)), "haar", level=int(math.log2(n)))
    return [c / math.sqrt(w) for c, w in zip(coeffs, haar_weights(n))]


def haar_wavelet_noise(vector: np.ndarray, scale: float, rng: np.random.Generator) -> np.ndarray:
    """The published wavelet mechanism (the wavelet paper's WaveletNoise of Algorithm 2; docs/algorithms.md §6).

    Pad to n = 2^L, Haar transform, add N(0, (scale / W)^2) to every paper-normalised coefficient
    (scale = sigma_H * C; W = n for the base, the block size for a detail), inverse, unpad.
    In pywt's orthonormal coordinates (coefficient = sqrt(W) * the paper's) the noise std is
    scale / sqrt(W), so the noise covariance has eigenvalues scale^2 / W; the smallest,
    scale^2 / n, lies along the all-ones vector: see `wavelet_effective_noise_multiplier`.
    """
    v = np.asarray(vector, dtype=np.float32)
    n = haar_padded_size(v.size)
    coeffs = pywt.wavedec(np.pad(v, (0, n - v.size)), "haar", level=int(math.log2(n)))
    if scale > 0:
        for c, w in zip(coeffs, haar_weights(n)):
            c += gaussian_noise(c.size, scale / math.sqrt(w), rng)
    return pywt.waverec(coeffs, "haar")[: v.size].astype(np.float32, copy=False)


def wavelet_effective_noise_multiplier(sigma_h: float, n: int) -> float:
    """sigma_H / sqrt(n): the Gaussian noise multiplier the wavelet mechanism really has.

    With covariance Sigma = (sigma_H C)^2 sum_W u_W u_W^T / W (orthonormal u_W), a shift of norm
    C along the all-ones direction (W = n) sees noise std sigma_H C / sqrt(n); the privacy
    loss is that of a Gaussian mechanism with multiplier 1 / (C sqrt(lambda_max(Sigma^-1))).
    """
    return sigma_h / math.sqrt(n)


def haar_coefficient_norms(rows: np.ndarray, chunk: int = 8) -> np.ndarray:
    """||H||_2 of the paper's Haar coefficients of every row (what DP-SGD-WAV clips to C).

    One batched pywt transform per `chunk` rows; the paper's coefficient is pywt's / sqrt(W),
    so ||H||^2 = sum over coefficients of c^2 / W.
    """
    rows = np.atleast_2d(np.asarray(rows, dtype=np.float64))
    n = haar_padded_size(rows.shape[1])
    weights = haar_weights(n)
    norms = np.empty(len(rows))
    for start in range(0, len(rows), chunk):
        block = np.pad(rows[start : start + chunk], ((0, 0), (0, n - rows.shape[1])))
        coeffs = pywt.wavedec(block, "haar", level=int(math.log2(n)), axis=-1)
        norms[start : start + chunk] = np.sqrt(sum(np.einsum("ij,ij->i", c, c) / w for c, w in zip(coeffs, weights)))
    return norms


def haar_coefficient_norm(vector: np.ndarray) -> float:
    """||H||_2 of the paper's Haar coefficients H of one vector."""
    return float(haar_coefficient_norms(np.asarray(vector)[None])[0])


def coefficient_clipping_noise_multiplier(sigma_h: float, n: int) -> float:
    """sigma_H / n: the Gaussian noise multiplier of DP-SGD-WAV (the wavelet paper's Algorithm 1; docs/algorithms.md §6).

    Derivation. Let H = D^(-1/2) U g be the paper's coefficients of a gradient g (padded to
    n = 2^L), U the orthonormal Haar matrix (pywt) and D = diag(W): W = n for the base
    coefficient, the block size for a detail. Algorithm 1 clips ||H||_2 <= C per sample and
    adds N(0, sigma_H^2 C^2 / W^2) to every coefficient of the sum: a Gaussian mechanism in
    H-space with covariance S = sigma_H^2 C^2 D^-2. Adding or removing one sample shifts the
    sum by some h with ||h||_2 <= C, and the privacy loss depends only on the whitened shift
    ||S^(-1/2) h||_2 = ||D h||_2 / (sigma_H C) <= max(W) C / (sigma_H C) = n / sigma_H, reached
    at h = C e_base (a constant gradient of norm C sqrt(n) in parameter space, whose
    coefficient norm is only C). So the mechanism (and its Poisson subsampling) has the
    privacy of a Gaussian mechanism with noise multiplier sigma_H / n, not sigma_H; the
    inverse transform afterwards is post-processing.
    """
    return sigma_h / n
