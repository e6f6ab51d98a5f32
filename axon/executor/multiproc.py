"""The multiprocess executor (``mp``): one worker process per tensor-parallel rank on this host.

    engine-core process                          worker process, rank r (of tensor_parallel_size)
    MultiprocExecutor --PUSH (one per rank)-->   PULL  loop: call Worker.<method>(*args)
                      <--PULL (shared)--------   PUSH  replies: rank 0's step output; every
                                                        rank's start-up and compile results;
                                                        any rank's error

A call is pickled once and the same bytes go to every rank. Steps are not waited for: only rank
0 replies to ``execute_model`` (every rank computes the same logits and samples the same
tokens), and its output is read when the engine asks for the step's result, so the engine can
queue step N+1 behind step N (async scheduling). The ranks join a torch.distributed group
(gloo, or NCCL on CUDA) and, on the CPU, map a shared-memory segment for their all-reduces
(axon/distributed/parallel_state.py).

Failure is never a hang: a rank that raises sends its traceback and exits; a rank that dies is
seen within ``_POLL_S`` by whoever is waiting for a reply, and by ``check_health`` (an exit-code
check per rank, which the engine loop makes every turn, idle or not). The engine then fails with the rank's error, and shutdown
kills the ranks still stuck in a collective. A rank dies with the engine-core process
(PR_SET_PDEATHSIG), so a killed engine leaves no orphans.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import os
import pickle
import shutil
import signal
import socket
import tempfile
import traceback
import weakref
from collections import deque
from concurrent.futures import Future
from typing import Any

import zmq

from axon.config import AxonConfig
from axon.distributed.parallel_state import SHM_SLOT_BYTES, DistributedInit, create_shm_segment
from axon.executor.abstract import LazyFuture, MultiRankExecutor, WorkerError, resolve_async_scheduling
from axon.platforms.processes import die_with_parent
from axon.scheduler_output import ModelRunnerOutput, SchedulerOutput
from axon.startup import configure_logging, freeze_start_up_heap

logger = logging.getLogger(__name__)

_POLL_S = 0.2  # how often a caller waiting for a reply checks that every rank is alive
_STARTUP_TIMEOUT_S = 1800.0  # loading and compiling a large model on a busy host
_SHUTDOWN_JOIN_S = 5.0
_STEP = "execute_model"


class _Ranks:
    """The worker processes and the sockets to them. Apart from the executor, so that an engine
    dropped without ``shutdown`` (an offline ``LLM`` deleted) stops its ranks when collected."""

    def __init__(self, config: AxonConfig, world: int) -> None:
        self.world = world
        self.stopping = False
        self.failure: str | None = None
        self.ipc_dir = tempfile.mkdtemp(prefix="axon-workers-")
        self.shm_path = create_shm_segment(world, f"tp-{os.getpid()}") if world > 1 else None
        init_method = f"tcp://127.0.0.1:{_free_port()}"
        self.ctx = zmq.Context()
        self.replies = self.ctx.socket(zmq.PULL)
        reply_addr = f"ipc://{os.path.join(self.ipc_dir, 'replies')}"
        self.replies.bind(reply_addr)
        self.commands: list[zmq.Socket] = []
        self.procs: list[multiprocessing.process.BaseProcess] = []
        spawn = multiprocessing.get_context("spawn")
        try:
            for rank in range(world):
                sock = self.ctx.socket(zmq.PUSH)
                command_addr = f"ipc://{os.path.join(self.ipc_dir, f'commands-{rank}')}"
                sock.bind(command_addr)
                self.commands.append(sock)
                dist_init = DistributedInit(rank, world, init_method, self.shm_path, SHM_SLOT_BYTES)
                proc = spawn.Process(
                    target=_worker_main,
                    args=(config, dist_init, command_addr, reply_addr, os.getpid()),
                    name=f"axon-worker-{rank}",
                    # Not daemonic: they stop with the executor (stop(), or its finalizer at exit,
                    # before multiprocessing would join them) and die with the engine core
                    # (PR_SET_PDEATHSIG).
                    daemon=False,
                )
                proc.start()
                self.procs.append(proc)
        except BaseException:  # no rank, socket or segment outlives a failed start
            self.stop()
            raise

    def started(self) -> None:
        """Every rank has mapped the segment: its name is no longer needed."""
        if self.shm_path is not None:
            os.remove(self.shm_path)
            self.shm_path = None

    def check(self) -> None:
        if self.failure is not None:
            raise WorkerError(self.failure)

    def send(self, method: str, *args: Any) -> None:
        self.check()
        message = pickle.dumps((method, args), protocol=pickle.HIGHEST_PROTOCOL)
        for sock in self.commands:
            # Never a blocking send: a PUSH socket whose rank is gone blocks forever (the
            # engine would hang, deaf even to SHUTDOWN). Wait for room in bounded polls, and
            # check between them that every rank lives.
            while True:
                try:
                    sock.send(message, flags=zmq.NOBLOCK)
                    break
                except zmq.Again:
                    sock.poll(int(_POLL_S * 1000), zmq.POLLOUT)
                    self.note_deaths()
                    self.check()

    def recv(self) -> tuple[int, Any] | None:
        """The next "ok" reply as (rank, result), or None after ``_POLL_S`` of silence; raises
        WorkerError when a rank raised or died."""
        if self.replies.poll(int(_POLL_S * 1000)):
            status, rank, payload = pickle.loads(self.replies.recv())
            if status == "error":
                self.failure = self.failure or f"worker rank {rank} failed:\n{payload}"
                raise WorkerError(self.failure)
            return rank, payload
        self.note_deaths()
        self.check()
        return None

    def gather(self, timeout_s: float | None = None) -> list[Any]:
        """One "ok" reply from every rank, in rank order."""
        results: dict[int, Any] = {}
        waited = 0.0
        while len(results) < self.world:
            reply = self.recv()
            if reply is not None:
                results[reply[0]] = reply[1]
                continue
            waited += _POLL_S
            if timeout_s is not None and waited > timeout_s:
                silent = sorted(set(range(self.world)) - set(results))
                raise WorkerError(f"worker ranks {silent} did not reply within {timeout_s:.0f} s")
        return [results[r] for r in range(self.world)]

    def note_deaths(self) -> None:
        if self.stopping:
            return
        for rank, proc in enumerate(self.procs):
            if proc.exitcode is not None and self.failure is None:
                self.failure = f"worker rank {rank} (pid {proc.pid}) exited with code {proc.exitcode}"
                logger.error("%s; the engine stops", self.failure)

    def stop(self) -> None:
        if self.stopping:
            return
        self.stopping = True
        for sock in self.commands:
            with contextlib.suppress(zmq.ZMQError):
                sock.send(pickle.dumps(("shutdown", ())), flags=zmq.NOBLOCK)
        for proc in self.procs:
            proc.join(_SHUTDOWN_JOIN_S / len(self.procs))
            if proc.is_alive():  # stuck in a collective with a dead peer
                proc.kill()
                proc.join(_SHUTDOWN_JOIN_S)
        for sock in [*self.commands, self.replies]:
            sock.close(linger=0)
        self.ctx.term()
        if self.shm_path is not None:
            with contextlib.suppress(FileNotFoundError):
                os.remove(self.shm_path)
        shutil.rmtree(self.ipc_dir, ignore_errors=True)


class MultiprocExecutor(MultiRankExecutor):
    def __init__(self, config: AxonConfig) -> None:
        self.world = config.parallel_config.tensor_parallel_size
        self._async_scheduling = resolve_async_scheduling(config)
        self._pending: deque[LazyFuture] = deque()
        self._ranks = _Ranks(config, self.world)
        # Runs on shutdown(), when the executor is collected, or at exit (before
        # multiprocessing's own exit handler, which would wait for the ranks forever).
        self._stop = weakref.finalize(self, self._ranks.stop)
        try:
            ready = self._ranks.gather(timeout_s=_STARTUP_TIMEOUT_S)
        except BaseException:
            self.shutdown()
            raise
        self._load_time_s = max(r["model_load_time_s"] for r in ready)
        self._ranks.started()
        logger.info("%d worker processes ready (pids %s)", self.world, self.worker_pids)

    @property
    def worker_pids(self) -> list[int]:
        return [p.pid for p in self._ranks.procs]

    # ---- the Executor interface (the rest: MultiRankExecutor) ----------------------------
    def execute_model(self, scheduler_output: SchedulerOutput) -> Future[ModelRunnerOutput]:
        future: LazyFuture = LazyFuture(self._wait_for)
        self._pending.append(future)
        try:
            self._ranks.send(_STEP, scheduler_output)
        except WorkerError as e:
            self._fail_pending(e)
        return future

    def check_health(self) -> None:
        self._ranks.note_deaths()  # cheap: a waitpid per rank
        self._ranks.check()

    def shutdown(self) -> None:
        self._stop()

    # ---- replies ---------------------------------------------------------------------------
    def _call_all(self, method: str, *args: Any) -> list[Any]:
        """Call ``method`` on every rank (no step in flight); the results in rank order."""
        assert not self._pending, f"{method} called with a step in flight"
        self._ranks.send(method, *args)
        return self._ranks.gather()

    def _wait_for(self, future: LazyFuture) -> None:
        """Read rank 0's step replies, in order, until ``future`` has its output."""
        while not future.done():
            try:
                reply = self._ranks.recv()
            except WorkerError as e:
                self._fail_pending(e)
                return
            if reply is not None:
                rank, output = reply
                assert rank == 0, f"rank {rank} replied to a step"
                self._pending.popleft().set_result(output)

    def _fail_pending(self, error: Exception) -> None:
        while self._pending:
            self._pending.popleft().set_exception(error)


def _free_port() -> int:
    """A TCP port free on this host now, for torch.distributed's rendezvous."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker_main(
    config: AxonConfig, dist_init: DistributedInit, command_addr: str, reply_addr: str, parent_pid: int
) -> None:
    """A rank's process: build the Worker, then run the calls the executor sends, in order."""
    die_with_parent(parent_pid)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the engine decides when the ranks stop
    configure_logging(f"worker-{dist_init.rank}")
    ctx = zmq.Context()
    commands = ctx.socket(zmq.PULL)
    commands.connect(command_addr)
    replies = ctx.socket(zmq.PUSH)
    replies.connect(reply_addr)
    rank, code = dist_init.rank, 0

    def reply(status: str, payload: Any) -> None:
        replies.send(pickle.dumps((status, rank, payload), protocol=pickle.HIGHEST_PROTOCOL))

    try:
        from axon.worker.worker import Worker

        worker = Worker(config, dist_init)
        freeze_start_up_heap()
        reply("ok", {"model_load_time_s": worker.model_load_time_s})
        while True:
            method, args = pickle.loads(commands.recv())
            if method == "shutdown":
                break
            result = getattr(worker, method)(*args)
            if method != _STEP or rank == 0:
                reply("ok", result)
    except Exception:  # noqa: BLE001 (every failure must reach the executor)
        error = traceback.format_exc()
        logger.error("worker rank %d failed:\n%s", rank, error)
        with contextlib.suppress(zmq.ZMQError):
            reply("error", error)
        code = 1
    commands.close(linger=0)
    replies.close(linger=2000)
    ctx.term()
    logging.shutdown()
    os._exit(code)  # a rank's threads (torch's, gloo's) must not keep it alive
