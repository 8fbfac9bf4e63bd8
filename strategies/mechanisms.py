"""Privacy mechanisms on flat update vectors (numpy only; used by server and clients).

Every mechanism exists here once. Updates travel as lists of arrays; mechanisms act
on the concatenation of all of them (the "global" vector of ALGORITHMS.md section 0).
"""

from __future__ import annotations

import math
import secrets
from collections.abc import Sequence

import numpy as np
import pywt

Shapes = list[tuple[int, ...]]


def flatten(arrays: Sequence[np.ndarray]) -> np.ndarray:
    """Concatenate arrays into one float32 vector."""
    if not arrays:
        return np.zeros(0, dtype=np.float32)
    return np.concatenate([np.asarray(a, dtype=np.float32).ravel() for a in arrays])


def unflatten(vector: np.ndarray, shapes: Shapes) -> list[np.ndarray]:
    """Split a flat vector back into arrays of the given shapes."""
    sizes = [int(np.prod(s)) for s in shapes]
    if vector.size != sum(sizes):
        raise ValueError(f"vector has {vector.size} entries, shapes need {sum(sizes)}")
    parts = np.split(vector, np.cumsum(sizes)[:-1]) if sizes else []
    return [p.reshape(s) for p, s in zip(parts, shapes)]


def l2_norm(vector: np.ndarray) -> float:
    """||v||_2, accumulated in float64."""
    v = np.asarray(vector, dtype=np.float64)
    return float(np.sqrt(np.dot(v, v)))


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


def distributed_noise_std(noise_multiplier: float, clip_norm: float, expected_clients: float) -> float:
    """Per-client noise std sigma*C/sqrt(m), so m shares sum to N(0, sigma^2 C^2)."""
    return noise_multiplier * clip_norm / float(np.sqrt(expected_clients))


def topup_noise_std(
    noise_multiplier: float, clip_norm: float, expected_clients: float, received: int
) -> float:
    """Server top-up std sigma*C*sqrt((m - k)/m) when only k < m noisy shares arrived."""
    missing = max(0.0, expected_clients - received)
    return noise_multiplier * clip_norm * float(np.sqrt(missing / expected_clients))


def update_problem(arrays: Sequence[np.ndarray], shapes: Shapes) -> str | None:
    """Why a client update cannot be averaged in (wrong count/shape, non-float, non-finite), else None."""
    if len(arrays) != len(shapes):
        return f"expected {len(shapes)} arrays, got {len(arrays)}"
    for i, (a, shape) in enumerate(zip(arrays, shapes)):
        if tuple(a.shape) != tuple(shape):
            return f"array {i} has shape {tuple(a.shape)}, expected {tuple(shape)}"
        if not np.issubdtype(a.dtype, np.floating):
            return f"array {i} has dtype {a.dtype}, expected a float type"
        if not np.all(np.isfinite(a)):
            return f"array {i} contains NaN or Inf"
    return None


# ---------------------------------------------------------------------------- Haar-wavelet noise
def haar_padded_size(size: int) -> int:
    """n = 2^L >= size (and >= 2): the length the vector is zero-padded to."""
    return 1 << max(1, (int(size) - 1).bit_length())


def haar_weights(n: int) -> list[int]:
    """W per coefficient array of `pywt.wavedec(x, 'haar')` (base first, then details coarse to
    fine): n for the base coefficient, the node's block size 2^l for a level-l detail."""
    levels = int(math.log2(n))
    return [n] + [2 ** l for l in range(levels, 0, -1)]


def haar_coefficients(vector: np.ndarray) -> list[np.ndarray]:
    """The paper's Haar coefficients (section 4.3): base = mean, detail = (mean(L) - mean(R)) / 2.

    pywt's Haar is orthonormal: its level-l coefficient is 2^(l/2) times the paper's, so
    the paper's = pywt's / sqrt(W) (W = block size, n for the base). Zero-pads to 2^L.
    """
    v = np.asarray(vector, dtype=np.float64)
    n = haar_padded_size(v.size)
    coeffs = pywt.wavedec(np.pad(v, (0, n - v.size)), "haar", level=int(math.log2(n)))
    return [c / math.sqrt(w) for c, w in zip(coeffs, haar_weights(n))]


def haar_wavelet_noise(vector: np.ndarray, scale: float, rng: np.random.Generator) -> np.ndarray:
    """The published wavelet mechanism (dp-fedavg-wavelet.txt, WaveletNoise of Algorithm 2).

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
        block = np.pad(rows[start:start + chunk], ((0, 0), (0, n - rows.shape[1])))
        coeffs = pywt.wavedec(block, "haar", level=int(math.log2(n)), axis=-1)
        norms[start:start + chunk] = np.sqrt(sum(np.einsum("ij,ij->i", c, c) / w for c, w in zip(coeffs, weights)))
    return norms


def haar_coefficient_norm(vector: np.ndarray) -> float:
    """||H||_2 of the paper's Haar coefficients H of one vector."""
    return float(haar_coefficient_norms(np.asarray(vector)[None])[0])


def coefficient_clipping_noise_multiplier(sigma_h: float, n: int) -> float:
    """sigma_H / n: the Gaussian noise multiplier of DP-SGD-WAV (dp-fedavg-wavelet.txt Algorithm 1).

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
