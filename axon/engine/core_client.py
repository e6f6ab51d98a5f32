"""One engine-core process as the front end (``AsyncLLM``) sees it, and the choice of the core
a new request goes to when ``--data-parallel-size N`` runs several.

Socket layout: every core has its own pair, bound by the front end in its IPC folder.

    front end                                        engine core i (core_proc.py)
    PUSH input-i  --(ADD / ABORT / SHUTDOWN)-->      PULL
    PULL output-i <--(READY / OUTPUTS / DEAD / HEARTBEAT)-- PUSH

A message's socket says which core sent it, so the wire format is the one-core format
unchanged, and a core knows nothing of the others. Each core's output socket has its own
reader task in the front end.
"""

from __future__ import annotations

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
    """``config`` for engine core ``index``: its data_parallel_rank set (CPU pinning reads it)."""
    return replace(config, parallel_config=replace(config.parallel_config, data_parallel_rank=index))


class EngineCoreHandle:
    """Engine core ``index`` of ``num_engines``: its process, its two sockets and what the
    front end knows of it (when it was last heard, its latest stats, its requests in flight)."""

    def __init__(
        self, ctx: zmq.asyncio.Context, config: AxonConfig, index: int, num_engines: int, ipc_dir: str
    ) -> None:
        self.config = config
        self.index = index
        # How messages name it: unchanged from the one-core server when there is one.
        self.name = "the engine core" if num_engines == 1 else f"engine core {index}"
        self.input = ctx.socket(zmq.PUSH)
        self.output = ctx.socket(zmq.PULL)
        self._suffix = "" if num_engines == 1 else f"-{index}"
        suffix = self._suffix
        self.input_addr = f"ipc://{os.path.join(ipc_dir, 'input' + suffix)}"
        self.output_addr = f"ipc://{os.path.join(ipc_dir, 'output' + suffix)}"
        self.process: multiprocessing.process.BaseProcess | None = None
        self.pid: int | None = None
        self.num_blocks = 0
        self.scheduler_stats: SchedulerStats | None = None  # its latest report
        self.num_inflight = 0  # child requests sent to it and not yet seen to finish
        self.last_heard = time.monotonic()  # of any message from it

    @property
    def kv_cache_usage(self) -> float:
        return self.scheduler_stats.kv_cache_usage if self.scheduler_stats is not None else 0.0

    # ---- life cycle ------------------------------------------------------------------------
    def start(self) -> None:
        self.input.bind(self.input_addr)
        self.output.bind(self.output_addr)
        ctx = multiprocessing.get_context("spawn")
        self.process = ctx.Process(
            target=run_engine_core,
            args=(self.config, self.input_addr, self.output_addr),
            name="axon-engine-core" + self._suffix,
            # Not daemonic, so that it may start worker processes (tensor parallelism); it
            # is stopped by shutdown() and dies with this process (core_proc.py).
            daemon=False,
        )
        self.process.start()

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
            assert self.process is not None
            if not self.process.is_alive():
                raise EngineDeadError(f"{self.name} exited with code {self.process.exitcode} during start-up")
        raise EngineDeadError(f"{self.name} did not start within {STARTUP_TIMEOUT_S:.0f} s")

    async def stop(self, join_s: float) -> None:
        """Stop the process and reap it, in bounded time whatever state the core is in."""
        if self.process is None:
            return
        if self.process.is_alive():
            # A dead or stopped core never reads it: queue it (or drop it) without waiting.
            with contextlib.suppress(zmq.Again):
                await self.input.send_multipart([SHUTDOWN, b""], flags=zmq.NOBLOCK)
        await asyncio.to_thread(_stop_process, self.process, join_s)

    def close(self) -> None:
        self.input.close(linger=0)
        self.output.close(linger=0)

    # ---- liveness ------------------------------------------------------------------------------
    def problem(self, heartbeat_timeout_s: float) -> tuple[str, str] | None:
        """``(code, message)`` when the process is not running, gone or silent too long."""
        if self.process is None:
            return "engine_dead", f"{_capitalized(self.name)} is not running."
        if not self.process.is_alive():
            return "engine_dead", f"The engine is dead: {self.exit_message()}"
        silent_s = time.monotonic() - self.last_heard
        if silent_s > heartbeat_timeout_s:
            return "engine_stalled", (
                f"{_capitalized(self.name)} has not answered for {silent_s:.0f} s (bound "
                f"{heartbeat_timeout_s:.0f} s, --engine-heartbeat-timeout): it is stalled."
            )
        return None

    def is_gone(self) -> bool:
        return self.process is not None and not self.process.is_alive()

    def exit_message(self) -> str:
        assert self.process is not None
        return f"{self.name} process exited with code {self.process.exitcode}"


def _capitalized(text: str) -> str:
    return text[:1].upper() + text[1:]


def _stop_process(process: multiprocessing.process.BaseProcess, join_s: float) -> None:
    """Join ``process`` for ``join_s``, then kill it (SIGKILL also ends a stopped process) and
    reap it, so that no zombie outlives the server."""
    process.join(join_s)
    if process.is_alive():
        logger.warning(
            "the engine core process %s did not exit within %.0f s; killing it", process.name, join_s
        )
        process.kill()
    process.join()
