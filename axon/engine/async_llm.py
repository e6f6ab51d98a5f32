"""AsyncLLM: the server's engine. The front end (tokenize, detokenize, stream) runs here, in
the server's event loop; the EngineCore runs in its own process (``core_proc.py``).

``generate()`` yields RequestOutputs as the core produces tokens; leaving the generator early
(a client that disconnects) aborts the request, so its KV blocks are freed at once. If the
core process dies, every pending request fails with ``EngineDeadError`` and ``errored`` is set.

Liveness: the core sends a heartbeat every second from a thread of its own (``core_proc.py``).
``health_problem()`` names a dead core (DEAD received, or its process gone, checked directly so
there is no window in which a dead engine looks alive) or a stalled one (nothing heard for
``heartbeat_timeout_s``: the process is stopped or frozen). Shutdown never waits on the core:
SHUTDOWN is sent without blocking, the process is joined for a bounded time, then killed and
reaped.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import multiprocessing
import os
import tempfile
import time
from collections.abc import AsyncIterator
from typing import Any

import msgspec
import zmq
import zmq.asyncio

from axon.config import AxonConfig
from axon.engine.core_proc import (
    ABORT,
    ADD,
    DEAD,
    DEFAULT_HEARTBEAT_TIMEOUT_S,
    HEARTBEAT,
    OUTPUTS,
    READY,
    SHUTDOWN,
    decode_outputs,
    encode,
    run_engine_core,
)
from axon.engine.input_processor import InputProcessor, PromptType
from axon.engine.output_processor import OutputProcessor, ParentRequest, PoolingRequest
from axon.engine.pooling_inputs import PoolingInput, PoolingInputProcessor
from axon.engine.tokenizer import get_tokenizer
from axon.metrics.stats import IterationStats, RequestTimes, StatLogger
from axon.outputs import EmbeddingRequestOutput, RequestOutput
from axon.pooling_params import PoolingParams
from axon.sampling_params import RequestOutputKind, SamplingParams
from axon.step_outputs import SchedulerStats

logger = logging.getLogger(__name__)

_STARTUP_TIMEOUT_S = 600.0
_SHUTDOWN_JOIN_S = 5.0  # a live core finishes its step and exits on SHUTDOWN well within this


class EngineDeadError(RuntimeError):
    pass


class AsyncLLM:
    def __init__(
        self,
        config: AxonConfig,
        stat_loggers: list[StatLogger] | None = None,
        chat_template: str | None = None,
        heartbeat_timeout_s: float = DEFAULT_HEARTBEAT_TIMEOUT_S,
    ) -> None:
        self.config = config
        self.heartbeat_timeout_s = heartbeat_timeout_s
        assert config.model_config.tokenizer is not None, "resolve_config() sets the tokenizer"
        self.tokenizer = get_tokenizer(config.model_config.tokenizer, chat_template)
        self.input_processor = InputProcessor(config.model_config, self.tokenizer)
        pooling = config.model_config.runner == "pooling"
        self.pooling_inputs = PoolingInputProcessor(config, self.input_processor) if pooling else None
        self.output_processor = OutputProcessor(self.tokenizer)
        self.stat_loggers = stat_loggers or []
        self.errored = False
        self.dead_error: str | None = None
        self.num_blocks = 0
        self.scheduler_stats: SchedulerStats | None = None  # the core's latest report
        self._queues: dict[str, asyncio.Queue[Any]] = {}  # RequestOutputs or an Exception
        self._children: dict[str, list[str]] = {}
        self._times: dict[str, RequestTimes] = {}
        self._counter = itertools.count()
        self._ipc_dir = tempfile.mkdtemp(prefix="axon-ipc-")
        self._ctx = zmq.asyncio.Context()
        self._input = self._ctx.socket(zmq.PUSH)
        self._output = self._ctx.socket(zmq.PULL)
        self._process: multiprocessing.process.BaseProcess | None = None
        self._output_task: asyncio.Task[None] | None = None
        self._last_heard = time.monotonic()  # of any message from the core

    # ---- life cycle ------------------------------------------------------------------------
    async def start(self) -> None:
        """Start the engine-core process and wait until its model is loaded."""
        input_addr = f"ipc://{os.path.join(self._ipc_dir, 'input')}"
        output_addr = f"ipc://{os.path.join(self._ipc_dir, 'output')}"
        self._input.bind(input_addr)
        self._output.bind(output_addr)
        ctx = multiprocessing.get_context("spawn")
        self._process = ctx.Process(
            target=run_engine_core,
            args=(self.config, input_addr, output_addr),
            name="axon-engine-core",
            daemon=True,
        )
        self._process.start()
        kind, payload = await self._wait_ready()
        if kind != READY:
            raise EngineDeadError(f"the engine core failed to start:\n{msgspec.msgpack.decode(payload)}")
        self.num_blocks = msgspec.msgpack.decode(payload)["num_blocks"]
        self._last_heard = time.monotonic()
        self._output_task = asyncio.create_task(self._output_loop())

    async def _wait_ready(self) -> list[bytes]:
        deadline = time.monotonic() + _STARTUP_TIMEOUT_S
        while time.monotonic() < deadline:
            if await self._output.poll(500):
                message = await self._output.recv_multipart()
                if message[0] != HEARTBEAT:  # the core beats while it loads
                    return message
                continue
            assert self._process is not None
            if not self._process.is_alive():
                raise EngineDeadError(
                    f"the engine core exited with code {self._process.exitcode} during start-up"
                )
        raise EngineDeadError(f"the engine core did not start within {_STARTUP_TIMEOUT_S:.0f} s")

    async def shutdown(self) -> None:
        """Stop the core and reap its process, in bounded time whatever state the core is in."""
        if self._output_task is not None:
            self._output_task.cancel()
        if self._process is not None:
            if self._process.is_alive():
                # A dead or stopped core never reads it: queue it (or drop it) without waiting.
                with contextlib.suppress(zmq.Again):
                    await self._input.send_multipart([SHUTDOWN, b""], flags=zmq.NOBLOCK)
            await asyncio.to_thread(_stop_process, self._process, _SHUTDOWN_JOIN_S)
        self._input.close(linger=0)
        self._output.close(linger=0)
        self._ctx.term()

    def is_alive(self) -> bool:
        return self.health_problem() is None

    def health_problem(self) -> tuple[str, str] | None:
        """``(code, message)`` when the core is dead or stalled; None while it is alive and heard."""
        if self.errored:
            return "engine_dead", f"The engine is dead: {self.dead_error}"
        if self._process is None:
            return "engine_dead", "The engine core is not running."
        if not self._process.is_alive():
            return "engine_dead", f"The engine is dead: {self._exit_message()}"
        silent_s = time.monotonic() - self._last_heard
        if silent_s > self.heartbeat_timeout_s:
            return "engine_stalled", (
                f"The engine core has not answered for {silent_s:.0f} s (bound "
                f"{self.heartbeat_timeout_s:.0f} s, --engine-heartbeat-timeout): it is stalled."
            )
        return None

    def _exit_message(self) -> str:
        assert self._process is not None
        return f"the engine core process exited with code {self._process.exitcode}"

    # ---- requests ----------------------------------------------------------------------------
    def get_tokenizer(self) -> Any:
        return self.tokenizer

    def num_pending_requests(self) -> int:
        return len(self._queues)

    async def generate(
        self,
        prompt: PromptType,
        params: SamplingParams,
        request_id: str | None = None,
        output_kind: RequestOutputKind = RequestOutputKind.DELTA,
    ) -> AsyncIterator[RequestOutput]:
        """Validate (ValueError before anything is queued), then stream this request's outputs.

        ``request_id`` is the caller's (a client may send any, twice at once); the engine's id
        is made unique by a suffix from this engine's counter, and is the ``request_id`` of the
        RequestOutputs yielded.
        """
        if self.errored:
            raise EngineDeadError(self.dead_error or "the engine core is not running")
        request_id = f"{request_id or 'req'}-{next(self._counter)}"
        text, prompt_token_ids = self.input_processor.tokenize(prompt)
        children = self.input_processor.process_n(request_id, prompt_token_ids, params)
        self.output_processor.check_new_ids([c.req_id for c in children])
        frames = [encode(ADD, child) for child in children]
        queue: asyncio.Queue[RequestOutput | Exception] = asyncio.Queue()
        parent = ParentRequest(request_id, text, prompt_token_ids, params.n, output_kind)
        self._queues[request_id] = queue
        self._children[request_id] = [c.req_id for c in children]
        for index, (child, frame) in enumerate(zip(children, frames, strict=True)):
            self.output_processor.add_request(parent, child.req_id, index, params)
            self._times[child.req_id] = RequestTimes(
                child.arrival_time, len(prompt_token_ids), child.sampling_params.max_tokens, params.n
            )
            await self._input.send_multipart(frame)
        finished = False
        try:
            while not finished:
                item = await queue.get()
                if isinstance(item, Exception):
                    raise item
                finished = item.finished
                yield item
        finally:
            self._queues.pop(request_id, None)
            if not finished:
                await self.abort(request_id)

    def process_pooling(
        self, prompt: PromptType, params: PoolingParams, request_id: str | None = None
    ) -> PoolingInput:
        """Tokenize and validate one embedding input (ValueError); blocking: call it off the loop."""
        assert self.pooling_inputs is not None, "an embedding model (runner='pooling') pools"
        return self.pooling_inputs.process(f"{request_id or 'embd'}-{next(self._counter)}", prompt, params)

    async def encode(self, item: PoolingInput) -> EmbeddingRequestOutput:
        """Run one processed embedding request in the core; cancelling it aborts it there."""
        if self.errored:
            raise EngineDeadError(self.dead_error or "the engine core is not running")
        core = item.request
        request_id = core.req_id
        self.output_processor.check_new_ids([request_id])
        queue: asyncio.Queue[Any] = asyncio.Queue()
        self._queues[request_id] = queue
        self._children[request_id] = [request_id]
        self.output_processor.add_pooling_request(
            PoolingRequest(request_id, item.prompt, core.prompt_token_ids)
        )
        self._times[request_id] = RequestTimes(core.arrival_time, len(core.prompt_token_ids), None, 1)
        finished = False
        try:
            await self._input.send_multipart(encode(ADD, core))
            result = await queue.get()
            if isinstance(result, Exception):
                raise result
            finished = True
            return result
        finally:
            self._queues.pop(request_id, None)
            if not finished:
                await self.abort(request_id)

    async def abort(self, request_id: str) -> None:
        child_ids = self._children.pop(request_id, [])
        if not child_ids:
            return
        self.output_processor.abort_requests(child_ids)
        for child_id in child_ids:
            self._times.pop(child_id, None)
        if not self.errored:
            await self._input.send_multipart(encode(ABORT, child_ids))

    # ---- outputs from the core ------------------------------------------------------------
    async def _output_loop(self) -> None:
        try:
            while True:
                kind, payload = await self._output.recv_multipart()
                self._last_heard = time.monotonic()
                if kind == HEARTBEAT:
                    continue
                if kind == DEAD:
                    self._die(msgspec.msgpack.decode(payload))
                    return
                if kind == OUTPUTS:
                    await self._process_outputs(decode_outputs(payload))
        except asyncio.CancelledError:
            raise
        except Exception as e:  # a bug here must fail requests, not hang them
            logger.exception("output loop failed")
            self._die(f"output processing failed: {e!r}")

    async def _process_outputs(self, core_outputs) -> None:
        iteration = IterationStats()
        if core_outputs.scheduler_stats is not None:
            self.scheduler_stats = core_outputs.scheduler_stats
        for out in core_outputs.outputs:
            times = self._times.get(out.req_id)
            if times is not None:
                iteration.update_from_output(out, times)
        request_outputs, stopped = self.output_processor.process_outputs(core_outputs.outputs)
        if stopped:
            await self._input.send_multipart(encode(ABORT, stopped))
        for out in core_outputs.outputs:
            times = self._times.get(out.req_id)
            child_done = out.finished or out.req_id in stopped
            if times is not None and child_done:
                reason = "stop" if out.req_id in stopped else out.finish_reason
                iteration.finish(times, reason or "abort")
                del self._times[out.req_id]
        for request_output in request_outputs:
            queue = self._queues.get(request_output.request_id)
            if queue is not None:
                queue.put_nowait(request_output)
            if request_output.finished:
                self._children.pop(request_output.request_id, None)
        for stat_logger in self.stat_loggers:
            stat_logger.record(core_outputs.scheduler_stats, iteration)

    def _die(self, error: str) -> None:
        """``error``: a reason or the core's traceback. The log gets it whole; clients, /health
        and ``dead_error`` get its last line (the exception), never file paths and frames."""
        self.errored = True
        self.dead_error = error.strip().splitlines()[-1] if error.strip() else "unknown error"
        logger.error("engine core died: %s", error)
        for queue in self._queues.values():
            queue.put_nowait(EngineDeadError(self.dead_error))

    async def watch_process(self) -> None:
        """Turn a silent death of the core process (killed, crashed) into ``errored``; once
        dead either way, reap the process (it exits right after sending DEAD)."""
        while not self.errored:
            await asyncio.sleep(0.5)
            if self._process is not None and not self._process.is_alive():
                # Give a DEAD message already on the wire a moment to arrive first.
                await asyncio.sleep(0.2)
                if not self.errored:
                    self._die(self._exit_message())
        if self._process is not None:
            await asyncio.to_thread(_stop_process, self._process, _SHUTDOWN_JOIN_S)


def _stop_process(process: multiprocessing.process.BaseProcess, join_s: float) -> None:
    """Join ``process`` for ``join_s``, then kill it (SIGKILL also ends a stopped process) and
    reap it, so that no zombie outlives the server."""
    process.join(join_s)
    if process.is_alive():
        logger.warning("the engine core did not exit within %.0f s; killing it", join_s)
        process.kill()
    process.join()
