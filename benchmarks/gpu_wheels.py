"""The wheels a GPU machine without a network needs to run the project: every runtime dependency (pyproject.toml)
and what they need in turn, for CPython 3.12 on x86-64 Linux, less what that machine's image already holds
(`DEVICE_HAS`); Ray, which Flower's simulation needs, in a folder apart; Ray and PyWavelets without what nothing
here loads (`UNUSED`).

    python -m benchmarks.gpu_wheels [--out .whl] [--ray-out .whlray]

Run it here, where the package registry is reachable; both folders must be ignored by git (.git/info/exclude) and
travel with the command (`carry`), 64 MiB in all. There, before anything else:

    python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl .whlray/*.whl
    export PYTHONPATH=/tmp/site:$PWD PATH=/tmp/site/bin:$PATH   # flwr, flower-superlink and ray are there

(docs/gpu.md, "The prepared checks"). A requirement is followed through its wheel's Requires-Dist, with the
markers evaluated for that machine and only the extras asked for; one version of each package is kept.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tomllib
import zipfile
from email.parser import Parser
from fnmatch import fnmatch
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

PYTHON = ("3.12", "3.12.3")  # the H200 image's python3 (docs/gpu.md)
PLATFORMS = ["manylinux1_x86_64", "manylinux2014_x86_64"] + [f"manylinux_2_{n}_x86_64" for n in range(17, 40)]
# The H200 image's Python packages (read on 2026-11-17; python3 3.12.3, torch 2.11.0, numpy 2.5.2): a second
# version carried there would stop the install.
DEVICE_HAS = frozenset(
    canonicalize_name(n)
    for n in """
    absl-py accelerate aiofiles aiohappyeyeballs aiohttp aiosignal annotated-doc anyio attrs botorch build certifi
    charset-normalizer chex click cloudpickle cmake colorama contourpy coverage cuda-bindings cuda-core
    cuda-pathfinder cuda-toolkit cupy-cuda13x cycler cython diffrax e3nn einops equinox etils execnet filelock
    flatbuffers flax fonttools formulaic frozenlist fsspec gpytorch grpcio h11 h5py hf-xet httpcore httpx
    huggingface-hub humanize hypothesis idna imageio iniconfig interface-meta jax jax-cuda13-pjrt jax-cuda13-plugin
    jaxlib jaxtyping jinja2 joblib kiwisolver lazy-loader lightning lightning-utilities linear-operator lineax
    llvmlite lxml markdown markdown-it-py markupsafe matplotlib mdurl meson ml-dtypes mpi4py mpmath msgpack
    multidict multipledispatch mypy-extensions nanobind narwhals networkx ninja numba numba-cuda numpy numpyro
    nvidia-cublas nvidia-cuda-cupti nvidia-cuda-nvrtc nvidia-cuda-runtime nvidia-cudnn-cu13 nvidia-cufft
    nvidia-cufile nvidia-curand nvidia-cusolver nvidia-cusparse nvidia-cusparselt-cu13 nvidia-ml-py nvidia-nccl-cu13
    nvidia-nvjitlink nvidia-nvshmem-cu13 nvidia-nvtx onnx onnx-ir onnxruntime onnxscript opencv-python-headless
    optax opt-einsum opt-einsum-fx optimistix orbax-checkpoint packaging pandas pathspec patsy peft pillow pip
    pluggy portalocker prometheus-client propcache protobuf psutil pyarrow pybind11 py-cpuinfo pygments pyparsing
    pyproject-hooks pyre-extensions pytest pytest-benchmark pytest-cov pytest-mock pytest-timeout pytest-xdist
    python-dateutil pytorch-lightning pyyaml regex requests rich sacrebleu safetensors scikit-build-core
    scikit-image scikit-learn scipy seaborn sentencepiece sentence-transformers setuptools shellingham simplejson
    six sortedcontainers statsmodels sympy tabulate tensorboard tensorboard-data-server tensorstore threadpoolctl
    tifffile tiktoken timm tokenizers toolz torch torchaudio torchdiffeq torch-geometric torchmetrics torchvision
    tqdm transformers treescope triton typer typing-extensions typing-inspect urllib3 uvloop wadler-lindig werkzeug
    wheel wrapt xarray xxhash yarl zipp
    """.split()
)
NOT_NEEDED = {"uv": "Flower's installer of an app's dependencies (17 MB): the checks run without it"}
UNUSED = {  # what a wheel carries that nothing here loads: left out (fnmatch patterns of its paths)
    "ray": ["ray/jars/*", "ray/dashboard/client/build/*", "ray/rllib/*", "ray/tune/*", "ray/train/*", "ray/serve/*",
            "ray/data/*"],
    "pywavelets": ["pywt/tests/*", "pywt/data/*.npz"],  # 3.5 MB of test data and sample signals
}  # fmt: skip


def project_requirements(pyproject: Path) -> list[Requirement]:
    return [Requirement(r) for r in tomllib.loads(pyproject.read_text())["project"]["dependencies"]]


def marker_environment(extra: str = "") -> dict[str, str]:
    return {
        "python_version": PYTHON[0],
        "python_full_version": PYTHON[1],
        "implementation_name": "cpython",
        "platform_python_implementation": "CPython",
        "sys_platform": "linux",
        "platform_system": "Linux",
        "platform_machine": "x86_64",
        "os_name": "posix",
        "extra": extra,
    }


def needs(wheel: Path, extras: set[str]) -> list[Requirement]:
    """The wheel's Requires-Dist that apply there: markers true without an extra or with one of `extras`."""
    with zipfile.ZipFile(wheel) as archive:
        name = next(n for n in archive.namelist() if n.endswith(".dist-info/METADATA"))
        metadata = Parser().parsestr(archive.read(name).decode())
    out = []
    for line in metadata.get_all("Requires-Dist") or []:
        requirement = Requirement(line)
        marker = requirement.marker
        if marker is None or any(marker.evaluate(marker_environment(e)) for e in ["", *extras]):
            out.append(requirement)
    return out


def download(requirement: Requirement, folder: Path) -> Path:
    """One wheel for CPython 3.12 on x86-64 Linux (no dependencies) into `folder` (kept if it is there); its path."""
    platforms = [arg for p in PLATFORMS for arg in ("--platform", p)]
    spec = f"{requirement.name}{requirement.specifier}"
    subprocess.run(
        [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:", "--python-version",
         PYTHON[0], "--implementation", "cp", *platforms, "-d", str(folder), spec],
        check=True,
    )  # fmt: skip
    name = canonicalize_name(requirement.name)
    return next(w for w in folder.glob("*.whl") if canonicalize_name(w.name.split("-")[0]) == name)


def closure(roots: list[Requirement], out: Path, ray_out: Path) -> list[Path]:
    """Every wheel the roots need that the image lacks (less NOT_NEEDED), breadth first; the first requirement of a
    name decides its version (the roots' own come first)."""
    queue, seen, wheels = list(roots), set(), []
    while queue:
        requirement = queue.pop(0)
        name = canonicalize_name(requirement.name)
        if name in DEVICE_HAS or name in NOT_NEEDED or name in seen:
            continue
        seen.add(name)
        wheel = download(requirement, ray_out if name == "ray" else out)
        print(f"{name:28s} {wheel.name}")
        wheels.append(wheel)
        queue += needs(wheel, set(requirement.extras))
    return wheels


def strip(wheel: Path, unused: list[str]) -> int:
    """Rewrite the wheel without the paths `unused` matches, its RECORD to match; the bytes it had."""
    full = wheel.with_suffix(".full")
    wheel.rename(full)
    kept = lambda path: not any(fnmatch(path, pattern) for pattern in unused)  # noqa: E731
    with zipfile.ZipFile(full) as source, zipfile.ZipFile(wheel, "w", zipfile.ZIP_DEFLATED, compresslevel=9) as slim:
        for item in filter(lambda i: kept(i.filename), source.infolist()):
            data = source.read(item)
            if item.filename.endswith(".dist-info/RECORD"):
                data = "".join(f"{line}\n" for line in data.decode().splitlines() if kept(line.split(",")[0]))
            slim.writestr(item, data)
    size = full.stat().st_size
    full.unlink()
    return size


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path(".whl"))
    parser.add_argument("--ray-out", type=Path, default=Path(".whlray"))
    args = parser.parse_args()
    for folder in (args.out, args.ray_out):
        folder.mkdir(parents=True, exist_ok=True)
    wheels = closure(
        project_requirements(Path(__file__).resolve().parents[1] / "pyproject.toml"), args.out, args.ray_out
    )
    for wheel in wheels:
        if (unused := UNUSED.get(canonicalize_name(wheel.name.split("-")[0]))) is not None:
            before = strip(wheel, unused)
            print(f"{wheel.name} stripped: {before / 2**20:.1f} MiB -> {wheel.stat().st_size / 2**20:.1f} MiB")
    total = sum(w.stat().st_size for folder in (args.out, args.ray_out) for w in folder.glob("*.whl"))
    print(f"{len(wheels)} wheels, {total / 2**20:.1f} MiB in all (the limit of what travels: 64 MiB with the tree)")


if __name__ == "__main__":
    main()
