"""A Grid over several processes, each a grid (default `CohortGrid`) for its share of the nodes.

One process feeds the CPU or the GPU from one Python thread, and what a client costs outside the batched steps
(its Context and data, its upload, the reply Message) is sequential Python (docs/gpu.md). `ProcessGrid` runs P
worker processes, worker k a grid of its own over the nodes whose index i (node id 100 + i) has i % P == k, and
sends each worker its share of a round's messages at once, so the shares train side by side, on the CPU's cores
and on one GPU, as the actors of Flower's Ray simulation do. A node's Context (its state: personal heads, a
DP-SGD client's ledger) lives in its worker for the whole run. The ServerApp, the strategy and the privacy
ledger stay in this process and get the replies the one grid would send (each node trains from its own
generators, so only the float rounding of a batch can differ: tests/test_process_grid.py); the replies' arrays
come back through shared memory (dpfl_tools/shared_arrays.py). Each worker takes its share of the host's cores
(`cohort_train.cores()`: torch's threads and the uploads' pool, cores // P; P workers of all the cores each would
run P times more threads than cores) and of its device's memory budget. Where torch sees several GPUs and the run
config's `device` setting is `auto` or `cuda`, worker k trains on GPU k % G (`placement`).

A worker that dies (killed, out of memory) took its nodes' Contexts with it: the round raises, the run folder
says "failed" after its last completed round, and `python -m dpfl_tools.launch --resume RUN_DIR` continues from
there, as after a crash of the one process.
"""

from __future__ import annotations

import multiprocessing
import pickle
import sys
from collections.abc import Callable, Mapping
from multiprocessing.connection import Connection
from typing import Any, NamedTuple

from flwr.app import Message

from dpfl.clients.cohort import train as cohort_train
from dpfl.fl_app.settings import Settings
from dpfl_tools.inprocess import InProcessGrid, error_reply, simulated_crash
from dpfl_tools.shared_arrays import ReplyBlock


class WorkerSpec(NamedTuple):
    """What each worker process is started with (pickled once per worker)."""

    grid_class: type[InProcessGrid]
    client_app: Any
    num_nodes: int
    run_config: dict
    grid_kwargs: dict
    initializer: Callable[..., None] | None
    initargs: tuple
    processes: int
    device: str | None  # the run's device setting; None: a ClientApp of one's own chooses


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
        device = run_config.training.device if isinstance(run_config, Settings) else None
        grid_kwargs = {**grid_kwargs, "run_id": self.run_id}  # one run: its workers' nodes share its run id
        spec = WorkerSpec(
            grid_class, client_app, num_nodes, dict(config), grid_kwargs, initializer, initargs, processes, device
        )
        self.workers: list[tuple[Any, Connection]] = []
        self.blocks = [ReplyBlock() for _ in range(processes)]  # where each worker's replies' arrays come back
        self.worker_peaks: list[dict] = [{} for _ in range(processes)]  # each worker's `peak_memory()`, last round
        for k in range(processes):
            self.workers.append(self.start_worker(k, spec))
        for k, (proc, conn) in enumerate(self.workers):  # each has built its grid, or the error is raised here
            try:
                started = conn.recv()
            except (EOFError, OSError):
                proc.join(5)
                started = RuntimeError(f"it died (exit code {proc.exitcode})")
            if isinstance(started, BaseException):
                self.close()
                raise RuntimeError(f"worker process {k} of the ProcessGrid could not build its grid: {started}")

    def start_worker(self, k: int, spec: WorkerSpec) -> tuple[Any, Connection]:
        """(process, this end of its pipe) of a fresh interpreter (spawn: CUDA cannot be forked) running `serve`
        as worker k."""
        spawn = multiprocessing.get_context("spawn")
        mine, theirs = spawn.Pipe()
        proc = spawn.Process(target=serve, args=(theirs, k, spec), daemon=True)
        try:
            proc.start()  # pickles spec
        except (pickle.PicklingError, AttributeError, TypeError) as exc:
            self.close()
            raise ValueError(
                f"client_app = {spec.client_app!r} (or grid_kwargs / initializer) does not pickle ({exc}); a "
                "ProcessGrid's workers need one defined at a module's top level, as fl_app.client_app.app"
            ) from None
        theirs.close()
        return proc, mine

    def worker_of(self, node_id: int) -> int:
        return (node_id - 100) % len(self.workers)

    def exchange(self, messages: list[Message]) -> list[Message]:
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
            for k, share in enumerate(shares):
                if share:
                    replies.update(zip(map(id, share), self.receive(k)))
        except (EOFError, OSError) as exc:
            raise self.lost(exc) from None
        answered = [replies[id(msg)] for msg in sent]
        if self.keep_messages:
            self.sent.extend(sent)
            self.received.extend(answered)
        return answered

    def receive(self, k: int) -> list[Message]:
        """Worker k's replies, in the order of its share (their arrays out of its block), its peak memory kept in
        `worker_peaks`; RuntimeError if its grid raised."""
        answer = self.workers[k][1].recv()
        if isinstance(answer, BaseException):
            raise RuntimeError(f"a worker process of the ProcessGrid raised {type(answer).__name__}: {answer}")
        *packed, self.worker_peaks[k] = answer
        return self.blocks[k].unpack(*packed)

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


def placement(k: int, processes: int, device: str | None, gpus: int) -> tuple[int | None, int]:
    """(the GPU worker k makes torch's current one, or None to leave it; how many workers share its memory
    budget). With `device` (the run's setting) `auto` or `cuda` and `gpus` > 1, worker k trains on GPU k % gpus,
    beside the workers j with j % gpus == k % gpus; otherwise (None: a ClientApp of one's own, whose run config
    is not the project's) all `processes` share the CPU, one GPU or `cuda:N`."""
    if device not in ("auto", "cuda") or gpus < 2:
        return None, processes
    return k % gpus, len(range(k % gpus, processes, gpus))


def peak_memory() -> dict[str, float | None]:
    """This process's peak RSS and peak CUDA memory allocated by torch (None where it used no CUDA), in MiB."""
    import resource

    import torch

    cuda = torch.cuda.max_memory_allocated() / 2**20 if torch.cuda.is_initialized() else None
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / (2**20 if sys.platform == "darwin" else 2**10)
    return {"rss_mib": rss, "cuda_max_allocated_mib": cuda}


def serve(conn: Connection, k: int, spec: WorkerSpec) -> None:
    """Worker k's loop: build its grid once (then say "ready", or send the error), then answer each share of
    messages sent until None: (its `ReplyBlock.pack`ed replies, its `peak_memory()`)."""
    import torch

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    gpu, sharing = placement(k, spec.processes, spec.device, gpus)
    if gpu is not None:
        torch.cuda.set_device(gpu)  # `cuda` (and `auto`) is torch's current device
    cohort_train.PROCESS_SHARE = 1 / sharing  # the workers train at once: each its share of the memory budget
    cohort_train.PROCESSES = spec.processes  # and of the cores: its torch threads and its upload threads
    torch.set_num_threads(cohort_train.cores())
    try:
        if spec.initializer is not None:
            spec.initializer(*spec.initargs)
        grid = spec.grid_class(
            spec.client_app, spec.num_nodes, spec.run_config, keep_messages=False, **spec.grid_kwargs
        )
    except Exception as exc:  # the ProcessGrid raises it before any round
        conn.send(RuntimeError(f"{type(exc).__name__}: {exc}"))
        return
    conn.send("ready")
    block = ReplyBlock(spec.processes)
    try:
        while (share := conn.recv()) is not None:
            try:
                conn.send((*block.pack(list(grid.send_and_receive(share))), peak_memory()))
            except Exception as exc:  # a grid's own failure (a node's is its Error reply): the ServerApp sees it
                conn.send(RuntimeError(f"{type(exc).__name__}: {exc}"))
    except (EOFError, BrokenPipeError, KeyboardInterrupt):
        pass  # the ProcessGrid's process ended or was interrupted (Ctrl-C reaches every worker): end quietly
    finally:
        block.close(unlink=True)
        conn.close()
