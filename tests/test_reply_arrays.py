"""`reply_arrays`: a reply's arrays read in place, the values Flower's own `ArrayRecord.to_numpy_ndarrays()` gives,
and every forged byte string refused with a ValueError (which the reply gate turns into a rejected reply;
tests/test_fuzz_replies.py sends such replies through every strategy path)."""

import io

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord

from dpfl.strategies.parts import reply_rules
from dpfl.strategies.parts.reply_rules import npy_view, reply_arrays

RNG = np.random.default_rng(7)
ARRAYS = [
    RNG.standard_normal((16, 1, 8, 8)).astype(np.float32),
    RNG.standard_normal(10).astype(np.float64),
    RNG.standard_normal((3, 4)).astype(np.float16),
    np.asfortranarray(RNG.standard_normal((3, 4, 5)).astype(np.float32)),
    RNG.standard_normal((2, 3)).astype(">f4"),
    np.array(2.5, np.float32),
    np.zeros((0, 7), np.float32),
    np.arange(6, dtype=np.int64).reshape(2, 3),
    np.array([True, False]),
]


def npy_bytes(array, allow_pickle: bool = False) -> bytes:
    stream = io.BytesIO()
    np.save(stream, array, allow_pickle=allow_pickle)
    return stream.getvalue()


def forged(data: bytes, dtype: str = "float32", shape=(4, 3), stype: str = "numpy.ndarray") -> Array:
    return Array(dtype=dtype, shape=shape, stype=stype, data=data)


def test_the_values_dtypes_and_shapes_are_flowers_own():
    record = ArrayRecord(ARRAYS)
    ours, flowers = reply_arrays(record), record.to_numpy_ndarrays()
    assert len(ours) == len(flowers) == len(ARRAYS)
    for mine, theirs, sent in zip(ours, flowers, ARRAYS):
        assert mine.dtype == theirs.dtype == sent.dtype
        assert mine.shape == theirs.shape == sent.shape
        np.testing.assert_array_equal(mine, theirs)
        assert not mine.flags.writeable  # a view of the bytes that arrived, never written


def test_the_arrays_are_views_of_the_bytes_not_copies():
    array = Array(RNG.standard_normal(1000).astype(np.float32))
    view = npy_view(array)
    assert np.shares_memory(view, np.frombuffer(array.data, np.uint8))


def test_a_header_taken_from_the_cache_is_the_same_bytes_or_parsed_anew():
    honest = RNG.standard_normal((4, 3)).astype(np.float32)
    np.testing.assert_array_equal(npy_view(forged(npy_bytes(honest))), honest)  # (float32, (4, 3)) -> its header
    other = RNG.standard_normal((3, 4)).astype(np.float32)  # same name and shape sent, other header bytes
    assert npy_view(forged(npy_bytes(other))).shape == (3, 4)  # read as the bytes say, then the gate's shape check
    wide = RNG.standard_normal((4, 3))  # float64 under a float32 name
    assert npy_view(forged(npy_bytes(wide))).dtype == np.float64


@pytest.mark.parametrize(
    "data, stype, message",
    [
        (npy_bytes(np.ones((4, 3), np.float32))[:-1], "numpy.ndarray", "smaller than requested"),
        (b"\x93NUMPY\x01\x00" + b"\xff" * 40, "numpy.ndarray", "header"),
        (b"not numpy at all, just bytes", "numpy.ndarray", "magic string"),
        (npy_bytes(np.array([{"x": 1}] * 12, dtype=object).reshape(4, 3), True), "numpy.ndarray", "pickle"),
        (npy_bytes(np.ones((4, 3), np.float32)), "torch.Tensor", "torch.Tensor"),
    ],
    ids=["truncated", "bad-header", "garbage", "pickled-objects", "other-serialization"],
)
def test_forged_bytes_raise_a_value_error(data, stype, message):
    with pytest.raises(ValueError, match=message):
        reply_arrays(ArrayRecord({"w": forged(data, stype=stype)}))


def test_a_client_naming_ever_new_shapes_cannot_grow_the_cache_without_bound(monkeypatch):
    monkeypatch.setattr(reply_rules, "_HEADERS", {})
    monkeypatch.setattr(reply_rules, "_HEADERS_KEPT", 5)
    for n in range(1, 20):
        array = np.ones(n, np.float32)
        np.testing.assert_array_equal(npy_view(Array(array)), array)
    assert len(reply_rules._HEADERS) == 5


def test_the_benchmarks_honest_replies_all_pass_the_gate(monkeypatch, capsys):
    from benchmarks import server_replies

    monkeypatch.setattr("sys.argv", ["server_replies", "--replies", "20", "--models", "cnn-mnist", "--repeats", "1"])
    server_replies.main()  # asserts that the wrapper accepted all 20 replies
    row = capsys.readouterr().out.splitlines()[-1].split()
    assert row[0] == "cnn-mnist" and row[1] == "26,010"
    assert all(float(ms) > 0 for ms in row[2:5])  # three timings printed (compared in docs, never asserted)
