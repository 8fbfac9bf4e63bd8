"""Time the client's clip + noise + top-k path and the server's Haar-wavelet noise on one
update of ResNet-18 size (11,181,642 parameters, the shapes of torchvision's resnet18 with
10 classes), on one thread. Also prints the top-k upload bytes against the dense size.

    python -m benchmarks.mechanisms_bench [--repeats 5] [--sparsity 0.4]

Targets (issue 3): top-k path < 0.3 s, wavelet < 2 s.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
import numpy as np
from flwr.app import ArrayRecord

from dpfl.dpcore.privacy.mechanisms import (
    clip_and_noise,
    haar_padded_size,
    haar_wavelet_noise,
    make_rng,
    sparse_decode,
    sparse_encode,
    topk_sparsify,
    unflatten,
)
from dpfl.strategies.parts.topk import payload_bytes


def resnet18_shapes(num_classes: int = 10) -> list[tuple[int, ...]]:
    """Parameter shapes of torchvision resnet18 (BatchNorm weight+bias, no running stats)."""
    shapes: list[tuple[int, ...]] = [(64, 3, 7, 7), (64,), (64,)]
    in_ch = 64
    for out_ch, stride in ((64, 1), (128, 2), (256, 2), (512, 2)):
        for block in range(2):
            s = stride if block == 0 else 1
            shapes += [(out_ch, in_ch, 3, 3), (out_ch,), (out_ch,), (out_ch, out_ch, 3, 3), (out_ch,), (out_ch,)]
            if block == 0 and (s != 1 or in_ch != out_ch):
                shapes += [(out_ch, in_ch, 1, 1), (out_ch,), (out_ch,)]
            in_ch = out_ch
    return shapes + [(num_classes, 512), (num_classes,)]


def timed(fn, repeats: int) -> tuple[float, object]:
    times, out = [], None
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--sparsity", type=float, default=0.4)
    args = parser.parse_args()

    shapes = resnet18_shapes()
    d = sum(int(np.prod(s)) for s in shapes)
    rng = np.random.default_rng(0)
    update = (rng.standard_normal(d, dtype=np.float32) * 1e-3).astype(np.float32)
    clip, sigma, m = 1.0, 1.0, 10.0
    print(f"update: {d:,} parameters in {len(shapes)} tensors (ResNet-18 size), {args.repeats} repeats, median")

    for mode in ("per-layer", "global"):

        def client_path():
            noisy, _ = clip_and_noise(update, clip, sigma * clip / m**0.5, make_rng(0, 3, 1, 0))
            arrays = unflatten(noisy, shapes)
            return sparse_encode(arrays, topk_sparsify(arrays, args.sparsity, mode))

        seconds, encoded = timed(client_path, args.repeats)
        upload = payload_bytes(ArrayRecord(encoded))
        dense = payload_bytes(ArrayRecord(unflatten(update, shapes)))
        decode_s, _ = timed(lambda: sparse_decode(encoded, shapes, args.sparsity, mode), args.repeats)
        print(
            f"clip + noise + top-k ({mode}, p={args.sparsity}): {seconds:.3f} s (target < 0.3 s); "
            f"upload {upload / 2**20:.1f} MiB vs dense {dense / 2**20:.1f} MiB = {upload / dense:.3f}; "
            f"server decode + checks {decode_s:.3f} s"
        )

    clip_noise_s, _ = timed(
        lambda: clip_and_noise(update, clip, sigma * clip / m**0.5, make_rng(0, 3, 1, 0)), args.repeats
    )
    print(f"  of which clip + noise alone: {clip_noise_s:.3f} s")

    n = haar_padded_size(d)
    seconds, _ = timed(lambda: haar_wavelet_noise(update, sigma * n**0.5 * clip, make_rng(0, 2, 1)), args.repeats)
    print(f"Haar-wavelet noise (pad {d:,} -> n = 2^{n.bit_length() - 1} = {n:,}): {seconds:.3f} s (target < 2 s)")


if __name__ == "__main__":
    main()
