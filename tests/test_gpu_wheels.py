"""benchmarks.gpu_wheels without the network: which of a wheel's requirements apply on the GPU machine (CPython
3.12 on x86-64 Linux, the extras asked for), and a wheel stripped of its unused paths and their RECORD lines."""

import zipfile

from benchmarks.gpu_wheels import DEVICE_HAS, NOT_NEEDED, needs, strip

METADATA = """Metadata-Version: 2.1
Name: demo
Version: 1.0
Requires-Dist: always>=1
Requires-Dist: old-python ; python_version < '3.11'
Requires-Dist: windows-only ; sys_platform == 'win32'
Requires-Dist: for-linux ; sys_platform == 'linux' and python_full_version >= '3.12'
Requires-Dist: ray==2.55.1 ; extra == 'simulation'
Requires-Dist: agent-thing ; extra == 'agent'
"""


def wheel(path, files: dict[str, str]):
    with zipfile.ZipFile(path, "w") as archive:
        for name, text in files.items():
            archive.writestr(name, text)
    return path


def test_only_the_requirements_that_apply_there_are_followed(tmp_path):
    demo = wheel(tmp_path / "demo-1.0-py3-none-any.whl", {"demo-1.0.dist-info/METADATA": METADATA})
    assert [r.name for r in needs(demo, set())] == ["always", "for-linux"]
    assert [r.name for r in needs(demo, {"simulation"})] == ["always", "for-linux", "ray"]
    assert str(needs(demo, {"simulation"})[-1].specifier) == "==2.55.1"


def test_a_stripped_wheel_keeps_the_rest_and_a_record_that_matches(tmp_path):
    record = (
        "ray/__init__.py,sha256=a,1\nray/rllib/x.py,sha256=b,2\nray/rllib/y/z.py,sha256=c,3\nray/core/so,sha256=d,4\n"
    )
    files = {
        "ray/__init__.py": "x = 1\n",
        "ray/rllib/x.py": "y" * 5000,
        "ray/rllib/y/z.py": "z",
        "ray/core/so": "binary",
        "ray-2.55.1.dist-info/RECORD": record,
    }
    path = wheel(tmp_path / "ray-2.55.1-cp312-cp312-manylinux2014_x86_64.whl", files)
    before = path.stat().st_size
    assert strip(path, ["ray/rllib/*"]) == before
    with zipfile.ZipFile(path) as slim:
        assert sorted(slim.namelist()) == ["ray-2.55.1.dist-info/RECORD", "ray/__init__.py", "ray/core/so"]
        assert slim.read("ray/core/so") == b"binary"
        kept = slim.read("ray-2.55.1.dist-info/RECORD").decode().splitlines()
    assert kept == ["ray/__init__.py,sha256=a,1", "ray/core/so,sha256=d,4"]
    assert not list(tmp_path.glob("*.full"))  # the original is gone


def test_the_image_list_holds_torch_and_numpy_and_what_is_left_out_is_not_in_it():
    assert {"torch", "numpy", "matplotlib", "grpcio", "protobuf"} <= DEVICE_HAS
    assert not DEVICE_HAS & set(NOT_NEEDED)
    assert all("-" not in name or not name.endswith("-") for name in DEVICE_HAS)  # no name split by a line wrap
