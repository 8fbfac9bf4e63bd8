"""What a client reply must hold, in the words the parts use: the metric rules a part declares (`MetricRule`),
how a reply's metric record is found and read (`read_metrics`, nothing in it can raise), how its arrays are read
(`reply_arrays`), and the norm bound of an honest upload under distributed noise (`upload_norm_bound`). The round
loop's reply gate (`strategies.loop.reply_gate`) applies them to every reply."""

from __future__ import annotations

import io
import math
from dataclasses import dataclass

import numpy as np
from flwr.app import Array, ArrayRecord, RecordDict

METRICS_RECORD = "metrics"  # the name the clients' adapter and Flower's NumPyClient use
HONEST_REJECTION_PROBABILITY = 1e-12  # per upload: how often the norm bound may reject an honest one


@dataclass(frozen=True)
class MetricRule:
    """What one metric of a reply must be: present (if required), a finite real scalar in [low, high]."""

    required: bool = False
    low: float = -math.inf
    high: float = math.inf
    integer: bool = False

    def problem(self, key: str, value) -> str | None:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            return f"metric '{key}' = {value!r} is not a number"
        if not math.isfinite(value):
            return f"metric '{key}' = {value!r} is not finite"
        if self.integer and value != int(value):
            return f"metric '{key}' = {value!r} is not an integer"
        if not self.low <= value <= self.high:
            return f"metric '{key}' = {value!r} is outside [{self.low}, {self.high}]"
        return None


def metric_record(content: RecordDict):
    """A reply's metric record: the one named `metrics`, else the only one ({} if none); None if it has several
    and none of that name."""
    records = content.metric_records
    if METRICS_RECORD in records:
        return records[METRICS_RECORD]
    if len(records) <= 1:
        return next(iter(records.values()), {})
    return None


def reply_arrays(record: ArrayRecord) -> list[np.ndarray]:
    """The record's arrays, the values of `ArrayRecord.to_numpy_ndarrays()` but read-only views of the bytes that
    arrived instead of copies: a reply is read, flattened (one copy) and dropped, so np.load's copy of every
    array (12 ms for a 45 MB resnet18-gn upload) and its header parse (20 us an array) are all it would add."""
    return [npy_view(array) for array in record.values()]


_HEADERS: dict[tuple[str, str], tuple[bytes, tuple, bool, np.dtype]] = {}  # (dtype, shape) sent -> a header seen
_HEADERS_KEPT = 4096  # so that a client sending ever new shapes cannot grow it without bound


def npy_view(array: Array) -> np.ndarray:
    """One Array's values in place (ValueError unless it is numpy-serialized). Its .npy header is read by numpy's
    own parser (`npy_header`), or taken from an earlier array whose header bytes were the same (the (dtype, shape)
    the Array names only finds that entry; the bytes decide); what follows the header is viewed as prod(shape)
    values of that dtype, as np.load reads it."""
    if array.stype != "numpy.ndarray":
        raise ValueError(f"array serialized as {array.stype!r}, expected 'numpy.ndarray'")
    data, hint = array.data, (str(array.dtype), str(array.shape))
    header = _HEADERS.get(hint)
    if header is None or not data.startswith(header[0]):
        header = npy_header(data)
        if len(_HEADERS) < _HEADERS_KEPT:
            _HEADERS[hint] = header
    raw, shape, fortran_order, dtype = header
    values = np.frombuffer(data, dtype=dtype, count=math.prod(shape), offset=len(raw))
    return values.reshape(shape[::-1]).T if fortran_order else values.reshape(shape)


def npy_header(data: bytes) -> tuple[bytes, tuple, bool, np.dtype]:
    """(the header's bytes, shape, fortran_order, dtype) of .npy bytes, by `numpy.lib.format` (version 1.0 or
    2.0, numpy's header size limit); ValueError for an object dtype (a pickle: never read, as Flower's own
    `Array.numpy` never allows it)."""
    stream = io.BytesIO(data)
    version = np.lib.format.read_magic(stream)
    if version not in ((1, 0), (2, 0)):
        raise ValueError(f".npy format version {version} (expected 1.0 or 2.0)")
    read = np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
    shape, fortran_order, dtype = read(stream)
    if dtype.hasobject:
        raise ValueError(f"dtype {dtype} holds Python objects (a pickle): not read")
    return data[: stream.tell()], shape, fortran_order, dtype


def read_metrics(content: RecordDict, rules: dict[str, MetricRule]) -> tuple[dict, str | None]:
    """(the rule-checked metrics as floats/ints, None) or ({}, why the reply's metrics are unusable)."""
    record = metric_record(content)
    if record is None:
        return {}, f"{len(content.metric_records)} metric records and none named '{METRICS_RECORD}'"
    clean = {}
    for key, rule in rules.items():
        if key not in record:
            if rule.required:
                return {}, f"metric '{key}' missing"
            continue
        problem = rule.problem(key, record[key])
        if problem:
            return {}, problem
        clean[key] = int(record[key]) if rule.integer else float(record[key])
    return clean, None


def upload_norm_bound(
    clipping_norm: float, noise_std: float, dim: int, failure_probability: float = HONEST_REJECTION_PROBABILITY
) -> float:
    """B = C (1 + 1e-5) + s (sqrt(d) + t), t = sqrt(2 ln(1 / p)): an honest upload (update clipped to
    C plus its noise share N(0, s^2 I_d)) has norm above B with probability at most p.

    ||clip(Delta) + z|| <= C + ||z||, and z -> ||z|| is 1-Lipschitz with E||z|| <= s sqrt(d), so by
    Gaussian concentration P(||z|| > s sqrt(d) + s t) <= exp(-t^2 / 2) = p. The factor 1e-5 covers
    float32 rounding of the clipped update. An upload above B is rejected: each accepted one moves the
    aggregate by at most B / m.
    """
    t = math.sqrt(2.0 * math.log(1.0 / failure_probability))
    return clipping_norm * (1 + 1e-5) + noise_std * (math.sqrt(dim) + t)
