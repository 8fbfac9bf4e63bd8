"""A worker's replies to the ProcessGrid's process with their arrays in shared memory instead of the pipe.

Through a pipe a reply's bytes are copied four times (into the pickle, into and out of the kernel, into the
unpickled bytes): 1.0 to 2.1 s here for ten resnet18-gn replies (45 MB each), against 0.2 s through a block of
shared memory that the worker keeps across rounds (`python -m benchmarks.reply_transfer`, docs/performance.md; a
fresh block each round costs a page fault per 4 KB page and gained far less). Each side holds a `ReplyBlock`: the worker's
`pack` copies every array of its replies into its block (created, or grown, as a round needs) and leaves an empty
Array of the same dtype and shape in its place; the ProcessGrid's `unpack` copies them back out into the replies.
A block that would take more than 1 / (2 P) of the space free in /dev/shm (a container's is often 64 MB) is not
made: those replies go through the pipe whole, and P workers' blocks never take more than half of /dev/shm.
"""

from __future__ import annotations

import os
from multiprocessing.shared_memory import SharedMemory

from flwr.app import Array, Message

SHM_FOLDER = "/dev/shm"


class ReplyBlock:
    """One worker's block of shared memory for its replies' arrays (`processes`: the ProcessGrid's P)."""

    def __init__(self, processes: int = 1) -> None:
        self.processes = processes
        self.block: SharedMemory | None = None

    def pack(self, replies: list[Message]) -> tuple[list[Message], str | None, list[int]]:
        """(replies, the block's name, each array's byte count), the arrays' bytes moved into the block; (replies,
        None, []) as they are where there is nothing to move or the block would not fit (see above)."""
        items = list(arrays_of(replies))
        sizes = [len(array.data) for _, _, array in items]
        total = sum(sizes)
        if not total:
            return replies, None, []
        if self.block is None or self.block.size < total:
            if total > shm_room() / (2 * self.processes):
                return replies, None, []
            self.close(unlink=True)
            try:
                self.block = SharedMemory(create=True, size=total)
            except OSError:  # e.g. no shared memory here at all: the pipe
                return replies, None, []
        offset = 0
        for (record, key, array), size in zip(items, sizes):
            self.block.buf[offset : offset + size] = array.data
            record[key] = Array(array.dtype, tuple(array.shape), array.stype, b"")
            offset += size
        return replies, self.block.name, sizes

    def unpack(self, replies: list[Message], name: str | None, sizes: list[int]) -> list[Message]:
        """The replies with their arrays' bytes copied out of the worker's block `name` (attached on first sight)."""
        if name is None:
            return replies
        if self.block is None or self.block.name != name:
            self.close(unlink=False)  # the worker grew its block: the old one is gone with its name
            self.block = SharedMemory(name=name)
        offset = 0
        for (record, key, array), size in zip(arrays_of(replies), sizes, strict=True):
            data = bytes(self.block.buf[offset : offset + size])
            record[key] = Array(array.dtype, tuple(array.shape), array.stype, data)
            offset += size
        return replies

    def close(self, unlink: bool) -> None:
        """Unmap the block; `unlink` (its worker's side): free it too."""
        if self.block is not None:
            self.block.close()
            if unlink:
                try:
                    self.block.unlink()
                except FileNotFoundError:  # its worker freed it as it ended
                    pass
            self.block = None


def arrays_of(replies: list[Message]):
    """(record, key, Array) of every array of the replies, in a fixed order (records and keys keep theirs)."""
    for reply in replies:
        if not reply.has_error():
            for record in reply.content.array_records.values():
                for key in list(record):
                    yield record, key, record[key]


def shm_room() -> int:
    """Bytes free in /dev/shm (0 where there is none)."""
    try:
        stats = os.statvfs(SHM_FOLDER)
    except OSError:
        return 0
    return stats.f_bavail * stats.f_frsize
