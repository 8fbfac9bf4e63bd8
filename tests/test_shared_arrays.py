"""dpfl_tools/shared_arrays.py: a worker's replies with their arrays in shared memory come back bit for bit."""

from __future__ import annotations

import pickle
from multiprocessing.shared_memory import SharedMemory

import numpy as np
import pytest
from flwr.app import ArrayRecord, Error, Message, MetricRecord, RecordDict
from flwr.supercore.task_identity import TaskIdentity

from dpfl_tools import shared_arrays
from dpfl_tools.shared_arrays import ReplyBlock


def replies() -> list[Message]:
    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 1, 1, 1
    rng = np.random.default_rng(0)
    content = [
        RecordDict(
            {
                "arrays": ArrayRecord([rng.standard_normal((i + 2, 3)).astype(np.float32), np.arange(i + 4)]),
                "head": ArrayRecord([rng.standard_normal(5)]),
                "metrics": MetricRecord({"num-examples": 10 + i}),
            }
        )
        for i in range(3)
    ]
    instruction = Message(RecordDict(), dst_node_id=100, message_type="train")
    instruction.metadata.__dict__["_message_id"] = "1"  # as a Grid stamps it
    out = [Message(c, reply_to=instruction) for c in content]
    return out[:1] + [Message(Error(code=1, reason="node crashed"), reply_to=instruction)] + out[1:]


def arrays(msgs: list[Message]) -> list:
    return [
        (key, a.dtype, a.shape, a.numpy())
        for m in msgs
        if not m.has_error()
        for record in m.content.array_records.values()
        for key, a in record.items()
    ]


def test_packed_replies_travel_without_their_bytes_and_come_back_bit_for_bit():
    """Three rounds: the worker's block is made once and kept; a round that needs more grows it (a new block, the
    old one freed); the worker's close frees the last one."""
    worker, server = ReplyBlock(processes=2), ReplyBlock()
    before = arrays(replies())
    names = []
    for _ in range(2):
        sent, name, sizes = worker.pack(replies())
        assert len(sizes) == 3 * 3 and sum(sizes) > 0 and name is not None
        assert all(len(a.data) == 0 for _, _, a in shared_arrays.arrays_of(sent))  # the pipe carries no array bytes
        back = server.unpack(*pickle.loads(pickle.dumps((sent, name, sizes))))
        after = arrays(back)
        assert [(k, d, s) for k, d, s, _ in after] == [(k, d, s) for k, d, s, _ in before]
        for (*_, x), (*_, y) in zip(after, before):
            assert x.dtype == y.dtype and np.array_equal(x, y)
        assert back[1].has_error() and back[1].error.reason == "node crashed"
        assert [m.content["metrics"]["num-examples"] for m in back if not m.has_error()] == [10, 11, 12]
        names.append(name)
    assert names[0] == names[1]  # kept across rounds
    larger = replies() + replies()
    sent, name, sizes = worker.pack(larger)
    assert name != names[0] and len(sizes) == 18
    with pytest.raises(FileNotFoundError):
        SharedMemory(name=names[0])  # the outgrown block is freed
    assert len(arrays(server.unpack(sent, name, sizes))) == 18
    worker.close(unlink=True)
    server.close(unlink=False)
    with pytest.raises(FileNotFoundError):
        SharedMemory(name=name)


@pytest.mark.parametrize("processes", [1, 4])
def test_a_block_larger_than_its_share_of_dev_shm_goes_through_the_pipe(monkeypatch, processes):
    total = sum(len(a.data) for _, _, a in shared_arrays.arrays_of(replies()))
    monkeypatch.setattr(shared_arrays, "shm_room", lambda: 2 * processes * total - 1)
    worker = ReplyBlock(processes)
    sent, name, sizes = worker.pack(replies())
    assert name is None and sizes == [] and worker.block is None
    assert arrays(ReplyBlock().unpack(sent, name, sizes))[0][3].shape == (2, 3)
    monkeypatch.setattr(shared_arrays, "shm_room", lambda: 2 * processes * total)
    sent, name, sizes = worker.pack(replies())
    assert name is not None
    ReplyBlock().unpack(sent, name, sizes)
    worker.close(unlink=True)
