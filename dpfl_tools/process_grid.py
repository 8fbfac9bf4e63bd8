"""A Grid over several processes, each a grid (default `CohortGrid`) for its share of the nodes.

One process feeds the CPU or the GPU from one Python thread, and what a client costs outside the batched steps
(its Context and data, its upload, the reply Message) is sequential Python (docs/gpu.md). `ProcessGrid` runs P
worker processes, worker k a grid of its own over the nodes whose index i (node id 100 + i) has i % P == k, and
sends each worker its share of a round's messages at once, so the shares train side by side, on the CPU's cores
and on one GPU, as the actors of Flower's Ray simulation do. A node's Context (its state: personal heads, a
DP-SGD client's ledger) lives in its worker for the whole run. The ServerApp, the strategy and the privacy
ledger stay in this process and get the replies the one grid would send (each node trains from its own
generators, so only the float rounding of a batch can differ: tests/test_process_grid.py); the replies' arrays
come back through shared memory (dpfl_tools/shared_arrays.py).

A worker that dies (killed, out of memory) took its nodes' Contexts with it: the round raises, the run folder
says "failed" after its last completed round, and `python -m dpfl_tools.launch --resume RUN_DIR` continues from
there, as after a crash of the one process.
"""

from __future__ import annotations

import multiprocessing
import pickle
from collections.abc import Callable, Iterable, Mapping
from multiprocessing.connection import Connection
from typing import Any

from flwr.app import Message

from dpfl_tools import cohort_train
from dpfl_tools.inprocess import InProcessGrid, error_reply, simulated_crash
from dpfl_tools.shared_arrays import ReplyBlock


class ProcessGrid(InProcessGrid):
    """InProcessGrid whose nodes answer in `processes` worker processes, each a `grid_class(client_app, num_nodes,
    run_config, **grid_kwargs)` (default CohortGrid) answering only its own nodes. `client_app` must pickle (a
    module-level ClientApp, as the project's). `fail` (a simulated crash) runs here, before a message is sent;
    `initializer(*initargs)` in each worker before its grid is built (as multiprocessing.Pool's: a module-level
    function, e.g. a benchmark's stand-in data)."""

    def __init__(
        self,
        client_app: Any,
        num_nodes: int,
        run_config: Mapping[str, Any],
        *,
        processes: int,
        grid_class: type[InProcessGrid] | None = None,
        fail: Callable[[int, Message], bool] | None = None,
        keep_messages: bool = True,
        initializer: Callable[..., None] | None = None,
        initargs: tuple = (),
        **grid_kwargs: Any,
    ) -> None:
        if not isinstance(processes, int) or isinstance(processes, bool) or processes < 1:
            raise ValueError(f"processes = {processes!r}: an integer of at least 1 is allowed")
        super().__init__(client_app, num_nodes, run_config, fail=fail, keep_messages=keep_messages)
        if grid_class is None:
            from dpfl_tools.cohort import CohortGrid

            grid_class = CohortGrid
        config = self.contexts[100].run_config if self.contexts else {}
        processes = min(processes, max(num_nodes, 1))
        spec = (grid_class, client_app, num_nodes, dict(config), grid_kwargs, initializer, initargs, processes)
        self.workers: list[tuple[Any, Connection]] = []
        self.blocks = [ReplyBlock() for _ in range(processes)]  # where each worker's replies' arrays come back
        for _ in range(processes):
            self.workers.append(self.start_worker(spec))
        for k, (proc, conn) in enumerate(self.workers):  # each has built its grid, or the error is raised here
            try:
                started = conn.recv()
            except (EOFError, OSError):
                proc.join(5)
                started = RuntimeError(f"it died (exit code {proc.exitcode})")
            if isinstance(started, BaseException):
                self.close()
                raise RuntimeError(f"worker process {k} of the ProcessGrid could not build its grid: {started}")

    def start_worker(self, spec: tuple) -> tuple[Any, Connection]:
        """(process, this end of its pipe) of a fresh interpreter (spawn: CUDA cannot be forked) running `serve`."""
        spawn = multiprocessing.get_context("spawn")
        mine, theirs = spawn.Pipe()
        proc = spawn.Process(target=serve, args=(theirs, spec), daemon=True)
        try:
            proc.start()  # pickles spec
        except (pickle.PicklingError, AttributeError, TypeError) as exc:
            self.close()
            raise ValueError(
                f"client_app = {spec[1]!r} (or grid_kwargs / initializer) does not pickle ({exc}); a ProcessGrid's "
                "workers need one defined at a module's top level, as fl_app.client_app.app"
            ) from None
        theirs.close()
        return proc, mine

    def worker_of(self, node_id: int) -> int:
        return (node_id - 100) % len(self.workers)

    def send_and_receive(self, messages: Iterable[Message], *, timeout: float | None = None) -> Iterable[Message]:
        if not self.workers:
            raise RuntimeError("the ProcessGrid is closed (its workers ended)")
        sent = [self.stamp(msg) for msg in messages]
        replies: dict[int, Message] = {}
        shares: list[list[Message]] = [[] for _ in self.workers]
        for msg in sent:
            node = msg.metadata.dst_node_id
            if self.crashes(msg):
                replies[id(msg)] = error_reply(msg, simulated_crash(node))
            else:
                shares[self.worker_of(node)].append(msg)
        try:
            for (_, conn), share in zip(self.workers, shares):
                if share:
                    conn.send(share)  # pickled once: the messages of a round share one record of arrays
            for (_, conn), block, share in zip(self.workers, self.blocks, shares):
                if share:
                    replies.update(zip(map(id, share), self.receive(conn, block)))
        except (EOFError, OSError) as exc:
            raise self.lost(exc) from None
        answered = [replies[id(msg)] for msg in sent]
        if self.keep_messages:
            self.sent.extend(sent)
            self.received.extend(answered)
        return answered

    @staticmethod
    def receive(conn: Connection, block: ReplyBlock) -> list[Message]:
        """A worker's replies, in the order of its share (their arrays out of its `block`); RuntimeError if its
        grid raised."""
        answer = conn.recv()
        if isinstance(answer, BaseException):
            raise RuntimeError(f"a worker process of the ProcessGrid raised {type(answer).__name__}: {answer}")
        return block.unpack(*answer)

    def lost(self, exc: BaseException) -> RuntimeError:
        """The error of a round a worker died in (`exc`: what this side saw): the others are ended too (the run
        stops), the dead named."""
        dead = [(k, proc) for k, (proc, _) in enumerate(self.workers) if not proc.is_alive()]
        for proc, conn in self.workers:
            proc.terminate()
            proc.join()
            conn.close()
        for block in self.blocks:
            block.close(unlink=True)  # a killed worker cannot free its own
        self.workers = []
        named = ", ".join(f"{k} (pid {proc.pid}, exit code {proc.exitcode})" for k, proc in dead)
        what = f"worker process {named} of the ProcessGrid died" if dead else f"the ProcessGrid lost a worker ({exc})"
        return RuntimeError(
            f"{what} and took its nodes' Contexts with it; the run stops after its last completed round: resume it "
            "with `python -m dpfl_tools.launch --resume RUN_DIR`"
        )

    def close(self) -> None:
        """End the worker processes (each ends its grid's loop; one that does not in 10 s is terminated)."""
        for _, conn in self.workers:
            try:
                conn.send(None)
            except OSError:
                pass
        for (proc, conn), block in zip(self.workers, self.blocks):
            proc.join(10)
            if proc.is_alive():
                proc.terminate()
                proc.join()
            conn.close()
            block.close(unlink=proc.exitcode != 0)  # a worker that ended well freed its own
        self.workers = []

    def __enter__(self) -> ProcessGrid:
        return self

    def __exit__(self, *_exc) -> None:
        self.close()


def serve(conn: Connection, spec: tuple) -> None:
    """A worker's loop: build its grid once (then say "ready", or send the error), then answer each share of
    messages sent until None."""
    grid_class, client_app, num_nodes, run_config, grid_kwargs, initializer, initargs, processes = spec
    cohort_train.PROCESS_SHARE = 1 / processes  # the workers train at once: each its share of the memory budget
    try:
        if initializer is not None:
            initializer(*initargs)
        grid = grid_class(client_app, num_nodes, run_config, keep_messages=False, **grid_kwargs)
    except Exception as exc:  # the ProcessGrid raises it before any round
        conn.send(RuntimeError(f"{type(exc).__name__}: {exc}"))
        return
    conn.send("ready")
    block = ReplyBlock(processes)
    try:
        while (share := conn.recv()) is not None:
            try:
                conn.send(block.pack(list(grid.send_and_receive(share))))
            except Exception as exc:  # a grid's own failure (a node's is its Error reply): the ServerApp sees it
                conn.send(RuntimeError(f"{type(exc).__name__}: {exc}"))
    except (EOFError, BrokenPipeError, KeyboardInterrupt):
        pass  # the ProcessGrid's process ended or was interrupted (Ctrl-C reaches every worker): end quietly
    finally:
        block.close(unlink=True)
        conn.close()
