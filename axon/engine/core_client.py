"""One engine core as the front end (``AsyncLLM``) sees it, and the choice of the core a new
request goes to when ``--data-parallel-size N`` runs several.

Socket layout: every core has its own pair, bound by the front end; a core on this host
(``LocalEngineCore``, a child process) gets ipc sockets in the front end's IPC folder, a core on
another host (``RemoteEngineCore``, started by ``axon serve --headless`` there) gets tcp sockets
on ``--data-parallel-address``, whose addresses it learns when it joins (``dp_handshake.py``).

    front end                                        engine core i (core_proc.py)
    PUSH input-i  --(ADD / ABORT / SHUTDOWN)-->      PULL
    PULL output-i <--(READY / OUTPUTS / DEAD / HEARTBEAT)-- PUSH

A message's socket says which core sent it, so the wire format is the one-core format
unchanged, and a core knows nothing of the others. Each core's output socket has its own
reader task in the front end. Both kinds are balanced, counted (``engine`` = global rank) and
stopped alike; they differ in how they start and in how their death is seen: a local core's
process is watched, a remote core has none here and is dead on DEAD, on its host's report, or
on heartbeat silence.
"""

from __future__ import annotations

import abc
import asyncio
import contextlib
import logging
import multiprocessing
import os
import time
from collections.abc import Sequence

import msgspec
import zmq
import zmq.asyncio

from axon.config import AxonConfig, replace
from axon.engine.core_proc import HEARTBEAT, READY, SHUTDOWN, run_engine_core
from axon.step_outputs import SchedulerStats

logger = logging.getLogger(__name__)

STARTUP_TIMEOUT_S = 600.0
# A remote core's SHUTDOWN is still in the tcp send queue when the front end closes its socket:
# closing waits this long for it to leave (a gone host never takes it).
_REMOTE_LINGER_MS = 2000


class EngineDeadError(RuntimeError):
    pass


def choose_engine(num_inflight: Sequence[int], kv_cache_usage: Sequence[float]) -> int:
    """The index of the least loaded core: fewest requests in flight (sent by the front end and
    not yet seen to finish), then the lowest KV-cache usage in its latest report, then the
    lowest index.

    The front end's own count moves the moment it sends a request, so a burst of requests
    spreads evenly before any core has reported; KV usage separates cores with as many
    requests whose prompts or outputs differ in length.
    """
    assert num_inflight and len(num_inflight) == len(kv_cache_usage), "one entry per core"
    return min(range(len(num_inflight)), key=lambda i: (num_inflight[i], kv_cache_usage[i], i))


def core_config(config: AxonConfig, index: int) -> AxonConfig:
    """``config`` for engine core ``index`` (its global rank): its data_parallel_rank set (CPU
    pinning reads it)."""
    return replace(config, parallel_config=replace(config.parallel_config, data_parallel_rank=index))


class EngineCoreHandle(abc.ABC):
    """Engine core ``index`` (its global rank) of ``num_engines``: its two sockets and what the
    front end knows of it (when it was last heard, its latest stats, its requests in flight).
    Where it runs, how it starts and how its death shows are a subclass's."""

    def __init__(self, ctx: zmq.asyncio.Context, config: AxonConfig, index: int, num_engines: int) -> None:
        self.config = config
        self.index = index
        # How messages name it: unchanged from the one-core server when there is one.
        self.name = "the engine core" if num_engines == 1 else f"engine core {index}"
        self.input = ctx.socket(zmq.PUSH)
        self.output = ctx.socket(zmq.PULL)
        self.input_addr = ""  # set before the core connects
        self.output_addr = ""
        self.pid: int | None = None  # in its host's namespace, from READY
        self.host: str | None = None  # the host it runs on, when not this one (once it joined)
        self.num_blocks = 0
        self.scheduler_stats: SchedulerStats | None = None  # its latest report
        self.num_inflight = 0  # child requests sent to it and not yet seen to finish
        self.last_heard = time.monotonic()  # of any message from it

    @property
    def kv_cache_usage(self) -> float:
        return self.scheduler_stats.kv_cache_usage if self.scheduler_stats is not None else 0.0

    # ---- life cycle ------------------------------------------------------------------------
    @abc.abstractmethod
    def start(self) -> None:
        """Bind the sockets and, for a local core, start its process."""

    async def wait_ready(self) -> None:
        """Wait for READY; EngineDeadError with the core's error if it fails to start."""
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while time.monotonic() < deadline:
            if await self.output.poll(500):
                kind, payload = await self.output.recv_multipart()
                if kind == HEARTBEAT:  # the core beats while it loads
                    continue
                if kind != READY:
                    raise EngineDeadError(f"{self.name} failed to start:\n{msgspec.msgpack.decode(payload)}")
                ready = msgspec.msgpack.decode(payload)
                self.num_blocks, self.pid = ready["num_blocks"], ready.get("pid")
                self.last_heard = time.monotonic()
                return
            failure = self._start_failure()
            if failure is not None:
                raise EngineDeadError(failure)
        raise EngineDeadError(self._start_timeout())

    @abc.abstractmethod
    async def stop(self, join_s: float) -> None:
        """Stop the core, in bounded time whatever state it is in."""

    def close(self) -> None:
        self.input.close(linger=0)
        self.output.close(linger=0)

    async def _send_shutdown(self) -> None:
        # A dead or stopped core never reads it: queue it (or drop it) without waiting.
        with contextlib.suppress(zmq.Again):
            await self.input.send_multipart([SHUTDOWN, b""], flags=zmq.NOBLOCK)

    def _start_failure(self) -> str | None:
        """Why the core can no longer start, when that is known before its READY times out."""
        return None

    def _start_timeout(self) -> str:
        return f"{self.name} did not start within {STARTUP_TIMEOUT_S:.0f} s"

    # ---- liveness ------------------------------------------------------------------------------
    def problem(self, heartbeat_timeout_s: float) -> tuple[str, str] | None:
        """``(code, message)`` when the core is dead, or silent too long."""
        death = self.death(heartbeat_timeout_s)
        if death is not None:
            return "engine_dead", f"The engine is dead: {death}"
        silent_s = time.monotonic() - self.last_heard
        if silent_s > heartbeat_timeout_s:
            return "engine_stalled", (
                f"{_capitalized(self.name)} has not answered for {silent_s:.0f} s (bound "
                f"{heartbeat_timeout_s:.0f} s, --engine-heartbeat-timeout): it is stalled."
            )
        return None

    @abc.abstractmethod
    def death(self, heartbeat_timeout_s: float) -> str | None:
        """How the core died (a message that names it), once that is known; None while alive."""


class LocalEngineCore(EngineCoreHandle):
    """A core in a child process of this one, behind ipc sockets in ``ipc_dir``. Dead when its
    process is gone (checked directly, so no window shows a dead engine alive); silence alone
    is a stall that may pass (a stopped or swapped-out process)."""

    def __init__(
        self, ctx: zmq.asyncio.Context, config: AxonConfig, index: int, num_engines: int, ipc_dir: str
    ) -> None:
        super().__init__(ctx, config, index, num_engines)
        self._suffix = "" if num_engines == 1 else f"-{index}"
        self.input_addr = f"ipc://{os.path.join(ipc_dir, 'input' + self._suffix)}"
        self.output_addr = f"ipc://{os.path.join(ipc_dir, 'output' + self._suffix)}"
        self.process: multiprocessing.process.BaseProcess | None = None

    def start(self) -> None:
        self.input.bind(self.input_addr)
        self.output.bind(self.output_addr)
        self.process = start_core_process(self.config, self.input_addr, self.output_addr, self._suffix)

    def _start_failure(self) -> str | None:
        assert self.process is not None
        if not self.process.is_alive():
            return f"{self.name} exited with code {self.process.exitcode} during start-up"
        return None

    async def stop(self, join_s: float) -> None:
        """Stop the process and reap it."""
        if self.process is None:
            return
        if self.process.is_alive():
            await self._send_shutdown()
        await asyncio.to_thread(stop_process, self.process, join_s)

    def problem(self, heartbeat_timeout_s: float) -> tuple[str, str] | None:
        if self.process is None:
            return "engine_dead", f"{_capitalized(self.name)} is not running."
        return super().problem(heartbeat_timeout_s)

    def death(self, heartbeat_timeout_s: float) -> str | None:
        if self.process is None or self.process.is_alive():
            return None
        return f"{self.name} process exited with code {self.process.exitcode}"


class RemoteEngineCore(EngineCoreHandle):
    """A core on another host, started there by ``axon serve --headless``. Its sockets are bound
    here on tcp://(--data-parallel-address):(a free port); the head's handshake server
    (``dp_handshake.py``)
    hands their addresses over when the core's host joins, and records ``host`` and, if one of
    that host's cores ends without SHUTDOWN, ``exit_report``. With no process here, it is dead
    on DEAD (the output loop), on that report, or once silent past the heartbeat timeout."""

    def __init__(self, ctx: zmq.asyncio.Context, config: AxonConfig, index: int, num_engines: int) -> None:
        super().__init__(ctx, config, index, num_engines)
        p = config.parallel_config
        self.address = p.data_parallel_address
        self.join_endpoint = f"tcp://{p.data_parallel_address}:{p.data_parallel_rpc_port}"
        self.exit_report: str | None = None

    def start(self) -> None:
        for sock in (self.input, self.output):
            sock.bind(f"tcp://{self.address}:*")
        self.input_addr = self.input.getsockopt_string(zmq.LAST_ENDPOINT)
        self.output_addr = self.output.getsockopt_string(zmq.LAST_ENDPOINT)

    def _start_failure(self) -> str | None:
        return f"{self.name} on {self.host}: {self.exit_report} during start-up" if self.exit_report else None

    def _start_timeout(self) -> str:
        if self.host is None:
            return (
                f"{self.name} did not join at {self.join_endpoint} within {STARTUP_TIMEOUT_S:.0f} s: "
                f"start `axon serve --headless` with --data-parallel-start-rank covering rank "
                f"{self.index} on its host"
            )
        return f"{self.name} on {self.host} did not start within {STARTUP_TIMEOUT_S:.0f} s"

    async def stop(self, join_s: float) -> None:
        """Send SHUTDOWN; its host reaps the process. ``close`` lingers until it has left."""
        if self.host is not None:
            await self._send_shutdown()

    def close(self) -> None:
        self.input.close(linger=_REMOTE_LINGER_MS)
        self.output.close(linger=0)

    def death(self, heartbeat_timeout_s: float) -> str | None:
        if self.exit_report is not None:
            return f"{self.name} on {self.host}: {self.exit_report}"
        silent_s = time.monotonic() - self.last_heard
        if silent_s > heartbeat_timeout_s:
            return (
                f"{self.name} on {self.host} has not been heard for {silent_s:.0f} s (bound "
                f"{heartbeat_timeout_s:.0f} s, --engine-heartbeat-timeout): its host, its process "
                "or the network is gone"
            )
        return None


def start_core_process(
    config: AxonConfig, input_addr: str, output_addr: str, suffix: str
) -> multiprocessing.process.BaseProcess:
    """``run_engine_core`` in a new (spawned) process of this one."""
    ctx = multiprocessing.get_context("spawn")
    process = ctx.Process(
        target=run_engine_core,
        args=(config, input_addr, output_addr),
        name="axon-engine-core" + suffix,
        # Not daemonic, so that it may start worker processes (tensor parallelism); it is
        # stopped by its starter and dies with it (core_proc.py).
        daemon=False,
    )
    process.start()
    return process


def _capitalized(text: str) -> str:
    return text[:1].upper() + text[1:]


def stop_process(process: multiprocessing.process.BaseProcess, join_s: float) -> None:
    """Join ``process`` for ``join_s``, then kill it (SIGKILL also ends a stopped process) and
    reap it, so that no zombie outlives the server."""
    process.join(join_s)
    if process.is_alive():
        logger.warning(
            "the engine core process %s did not exit within %.0f s; killing it", process.name, join_s
        )
        process.kill()
    process.join()
