"""AsyncLLM: the server's engine. The front end (tokenize, detokenize, stream) runs here, in
the server's event loop; each EngineCore runs in its own process (``core_proc.py``), one per
``data_parallel_size``, each behind its own pair of sockets (``core_client.py``).

``generate()`` yields RequestOutputs as the core produces tokens; leaving the generator early
(a client that disconnects) aborts the request, so its KV blocks are freed at once. If a core
process dies, every pending request fails with ``EngineDeadError`` and ``errored`` is set.

Data parallelism (``--data-parallel-size N``): each request goes whole (all its ``n`` samples)
to the least loaded core (``choose_engine``: fewest requests in flight, then lowest KV usage,
then lowest index); the front end remembers which core runs each child request, so aborts and
stop-string aborts go there. The cores are one engine: if any of them dies, the whole engine is
dead (every pending request fails, ``health_problem()`` names the core) and the others are
stopped. Stat loggers get each core's reports with ``engine_idx`` = its index (global rank).
With ``--data-parallel-size-local L`` < N, ranks L..N-1 run on other hosts (``axon serve
--headless``) and join through ``dp_handshake.py``; once joined they are cores like the others.

Liveness: a core sends a heartbeat every second from a thread of its own (``core_proc.py``).
``health_problem()`` names a dead core (DEAD received, or its process gone, checked directly so
there is no window in which a dead engine looks alive) or a stalled one (nothing heard for
``heartbeat_timeout_s``: the process is stopped or frozen). A remote core has no process here:
silence past ``heartbeat_timeout_s`` is its death, as is its host's report that it exited.
Shutdown never waits on a core:
SHUTDOWN is sent without blocking, the processes are joined together for a bounded time, then
killed and reaped.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import tempfile
import time
from collections.abc import AsyncIterator
from typing import Any

import msgspec
import zmq.asyncio
from torch.profiler import record_function

from axon.config import AxonConfig
from axon.engine.core_client import (
    EngineCoreHandle,
    EngineDeadError,
    LocalEngineCore,
    RemoteEngineCore,
    choose_engine,
    core_config,
)
from axon.engine.core_proc import (
    ABORT,
    ADD,
    DEAD,
    DEFAULT_HEARTBEAT_TIMEOUT_S,
    HEARTBEAT,
    OUTPUTS,
    UTILITY,
    decode_outputs,
    encode,
)
from axon.engine.dp_handshake import HandshakeServer
from axon.engine.input_processor import InputProcessor, PromptType
from axon.engine.output_processor import OutputProcessor, ParentRequest, PoolingRequest
from axon.engine.pooling_inputs import PoolingInput, PoolingInputProcessor
from axon.engine.tokenizer import load_tokenizer
from axon.metrics.stats import IterationStats, RequestTimes, StatLogger
from axon.outputs import EmbeddingRequestOutput, RequestOutput
from axon.pooling_params import PoolingParams
from axon.sampling_params import RequestOutputKind, SamplingParams

logger = logging.getLogger(__name__)

_SHUTDOWN_JOIN_S = 5.0  # a live core finishes its step and exits on SHUTDOWN well within this

__all__ = ["AsyncLLM", "EngineDeadError"]


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
        self.tokenizer = load_tokenizer(config.model_config, chat_template)
        self.input_processor = InputProcessor(config.model_config, self.tokenizer, config.lora_config)
        pooling = config.model_config.runner == "pooling"
        self.pooling_inputs = PoolingInputProcessor(config, self.input_processor) if pooling else None
        self.output_processor = OutputProcessor(self.tokenizer)
        self.stat_loggers = stat_loggers or []
        self.errored = False
        self.dead_error: str | None = None
        self._queues: dict[str, asyncio.Queue[Any]] = {}  # RequestOutputs or an Exception
        self._children: dict[str, list[str]] = {}
        self._times: dict[str, RequestTimes] = {}
        self._engine_of: dict[str, int] = {}  # child request -> its core, until seen to finish
        self._counter = itertools.count()
        self._ipc_dir = tempfile.mkdtemp(prefix="axon-ipc-")
        self._ctx = zmq.asyncio.Context()
        self.cores = self._make_cores(config)
        remote = {core.index: core for core in self.cores if isinstance(core, RemoteEngineCore)}
        self._handshake = HandshakeServer(self._ctx, config.parallel_config, remote) if remote else None
        self._tasks: list[asyncio.Task[None]] = []  # output loops, the handshake server
        self._utility_calls: dict[int, asyncio.Future[Any]] = {}  # call id -> its answer
        self._call_ids = itertools.count()
        self.sleeping = False  # the cores' KV caches released (sleep): requests are refused

    def _make_cores(self, config: AxonConfig) -> list[EngineCoreHandle]:
        """Ranks 0..L-1 (--data-parallel-size-local) run here, the others on other hosts."""
        p = config.parallel_config
        num_engines = p.data_parallel_size
        num_local = num_engines if p.data_parallel_size_local is None else p.data_parallel_size_local
        return [
            LocalEngineCore(self._ctx, core_config(config, i), i, num_engines, self._ipc_dir)
            if i < num_local
            else RemoteEngineCore(self._ctx, core_config(config, i), i, num_engines)
            for i in range(num_engines)
        ]

    @property
    def num_blocks(self) -> int:
        """KV-cache blocks of all cores together (each core's: ``cores[i].num_blocks``)."""
        return sum(core.num_blocks for core in self.cores)

    # ---- life cycle ------------------------------------------------------------------------
    async def start(self) -> None:
        """Start every local engine-core process, let the remote ones join, and wait until each
        has loaded its model; the first core that fails to start fails start-up with its error."""
        if self._handshake is not None:
            self._handshake.bind()  # a port in use fails start-up before any core loads
        for core in self.cores:
            core.start()
        if self._handshake is not None:
            self._tasks.append(asyncio.create_task(self._handshake.serve()))
        waits = [asyncio.create_task(self._wait_ready(core)) for core in self.cores]
        try:
            await asyncio.gather(*waits)
        finally:
            for wait in waits:
                wait.cancel()
        self._tasks += [asyncio.create_task(self._output_loop(core)) for core in self.cores]

    async def _wait_ready(self, core: EngineCoreHandle) -> None:
        await core.wait_ready()
        if len(self.cores) > 1:
            where = f" on {core.host}" if core.host is not None else ""
            logger.info("%s ready: pid %s%s, %d KV-cache blocks", core.name, core.pid, where, core.num_blocks)

    async def shutdown(self) -> None:
        """Stop every core and reap its process, in bounded time whatever state it is in."""
        for task in self._tasks:
            task.cancel()
        await self._stop_cores()
        if self._handshake is not None:
            self._handshake.close()
        for core in self.cores:
            core.close()
        self._ctx.term()  # waits for a remote core's SHUTDOWN to leave (bounded: its linger)

    async def _stop_cores(self) -> None:
        await asyncio.gather(*(core.stop(_SHUTDOWN_JOIN_S) for core in self.cores))

    def is_alive(self) -> bool:
        return self.health_problem() is None

    def health_problem(self) -> tuple[str, str] | None:
        """``(code, message)`` when a core is dead or stalled; None while all are alive and heard."""
        if self.errored:
            return "engine_dead", f"The engine is dead: {self.dead_error}"
        for core in self.cores:
            problem = core.problem(self.heartbeat_timeout_s)
            if problem is not None:
                return problem
        return None

    async def call_utility(self, method: str, *args: Any) -> list[Any]:
        """``EngineCore.<method>(*args)`` on every core, between their steps; the results by core."""
        if self.errored:
            raise EngineDeadError(self.dead_error or "the engine core is not running")
        loop = asyncio.get_running_loop()
        calls = []
        for core in self.cores:
            call_id = next(self._call_ids)
            self._utility_calls[call_id] = future = loop.create_future()
            calls.append(future)
            await core.input.send_multipart(encode(UTILITY, [call_id, method, list(args)]))
        return list(await asyncio.gather(*calls))

    async def sleep(self, level: int = 1) -> None:
        """Release every core's KV cache (ValueError: why not; requests in flight among them)."""
        if self._queues:
            raise ValueError("requests are still running: sleep when the engine is idle")
        was_sleeping, self.sleeping = self.sleeping, True  # no new request from here on
        problems = [p for p in await self.call_utility("sleep", level) if p is not None]
        if problems:
            if not was_sleeping:  # a core that did sleep wakes again
                await self.call_utility("wake_up")
                self.sleeping = False
            raise ValueError(problems[0])

    async def wake_up(self) -> None:
        await self.call_utility("wake_up")
        self.sleeping = False

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
        lora_request: Any = None,
    ) -> AsyncIterator[RequestOutput]:
        """Validate (ValueError before anything is queued), then stream this request's outputs.

        ``request_id`` is the caller's (a client may send any, twice at once); the engine's id
        is made unique by a suffix from this engine's counter, and is the ``request_id`` of the
        RequestOutputs yielded.
        """
        if self.errored:
            raise EngineDeadError(self.dead_error or "the engine core is not running")
        if self.sleeping:
            raise ValueError("the engine is sleeping: wake it up first (POST /wake_up)")
        request_id = f"{request_id or 'req'}-{next(self._counter)}"
        text, prompt_token_ids, children = self.input_processor.process(
            request_id, prompt, params, lora_request
        )
        self.output_processor.check_new_ids([c.req_id for c in children])
        frames = [encode(ADD, child) for child in children]
        queue: asyncio.Queue[RequestOutput | Exception] = asyncio.Queue()
        parent = ParentRequest(request_id, text, prompt_token_ids, params.n, output_kind)
        self._queues[request_id] = queue
        self._children[request_id] = [c.req_id for c in children]
        core = self._least_loaded_core()  # all n samples on one core: they share the prompt's KV
        for index, (child, frame) in enumerate(zip(children, frames, strict=True)):
            self.output_processor.add_request(parent, child.req_id, index, params)
            self._times[child.req_id] = RequestTimes(
                child.arrival_time, len(prompt_token_ids), child.sampling_params.max_tokens, params.n
            )
            self._track(child.req_id, core)
            await core.input.send_multipart(frame)
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
        """Run one processed embedding request in a core; cancelling it aborts it there."""
        if self.errored:
            raise EngineDeadError(self.dead_error or "the engine core is not running")
        request = item.request
        request_id = request.req_id
        self.output_processor.check_new_ids([request_id])
        queue: asyncio.Queue[Any] = asyncio.Queue()
        self._queues[request_id] = queue
        self._children[request_id] = [request_id]
        self.output_processor.add_pooling_request(
            PoolingRequest(request_id, item.prompt, request.prompt_token_ids)
        )
        self._times[request_id] = RequestTimes(request.arrival_time, len(request.prompt_token_ids), None, 1)
        finished = False
        try:
            core = self._least_loaded_core()
            self._track(request_id, core)
            await core.input.send_multipart(encode(ADD, request))
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
        running: dict[int, list[str]] = {}  # core -> its children of this request still running
        for child_id in child_ids:
            self._times.pop(child_id, None)
            index = self._untrack(child_id)
            if index is not None:
                running.setdefault(index, []).append(child_id)
        if not self.errored:
            for index, ids in running.items():
                await self.cores[index].input.send_multipart(encode(ABORT, ids))

    # ---- which core runs what ----------------------------------------------------------------
    def _least_loaded_core(self) -> EngineCoreHandle:
        if len(self.cores) == 1:
            return self.cores[0]
        index = choose_engine(
            [core.num_inflight for core in self.cores], [core.kv_cache_usage for core in self.cores]
        )
        return self.cores[index]

    def _track(self, child_id: str, core: EngineCoreHandle) -> None:
        self._engine_of[child_id] = core.index
        core.num_inflight += 1

    def _untrack(self, child_id: str) -> int | None:
        """Forget a child that finished or was aborted; returns its core (None: already done)."""
        index = self._engine_of.pop(child_id, None)
        if index is not None:
            self.cores[index].num_inflight -= 1
        return index

    # ---- outputs from the cores -----------------------------------------------------------
    async def _output_loop(self, core: EngineCoreHandle) -> None:
        try:
            while True:
                kind, payload = await core.output.recv_multipart()
                core.last_heard = time.monotonic()
                if kind == HEARTBEAT:
                    continue
                if kind == DEAD:
                    self._die(msgspec.msgpack.decode(payload), core)
                    return
                if kind == OUTPUTS:
                    await self._process_outputs(core, decode_outputs(payload))
                elif kind == UTILITY:
                    call_id, result = msgspec.msgpack.decode(payload)
                    future = self._utility_calls.pop(call_id, None)
                    if future is not None and not future.done():
                        future.set_result(result)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # a bug here must fail requests, not hang them
            logger.exception("output loop of %s failed", core.name)
            self._die(f"output processing failed: {e!r}", core)

    async def _process_outputs(self, core: EngineCoreHandle, core_outputs) -> None:
        iteration = IterationStats()
        if core_outputs.scheduler_stats is not None:
            core.scheduler_stats = core_outputs.scheduler_stats
        for out in core_outputs.outputs:
            times = self._times.get(out.req_id)
            if times is not None:
                iteration.update_from_output(out, times)
        with record_function("detokenize"):
            request_outputs, stopped = self.output_processor.process_outputs(core_outputs.outputs)
        if stopped:
            await core.input.send_multipart(encode(ABORT, stopped))
        for out in core_outputs.outputs:
            child_done = out.finished or out.req_id in stopped
            if child_done:
                self._untrack(out.req_id)
            times = self._times.get(out.req_id)
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
            stat_logger.record(core_outputs.scheduler_stats, iteration, engine_idx=core.index)

    def _die(self, error: str, core: EngineCoreHandle) -> None:
        """``error``: a reason or ``core``'s traceback. The log gets it whole; clients, /health
        and ``dead_error`` get its last line (the exception), never file paths and frames, after
        the core's name when there are several. One dead core is a dead engine."""
        if self.errored:
            return
        self.errored = True
        last_line = error.strip().splitlines()[-1] if error.strip() else "unknown error"
        named = len(self.cores) == 1 or last_line.startswith(core.name)
        self.dead_error = last_line if named else f"{core.name}: {last_line}"
        logger.error("%s died: %s", core.name, error)
        for queue in self._queues.values():
            queue.put_nowait(EngineDeadError(self.dead_error))
        for future in self._utility_calls.values():
            if not future.done():
                future.set_exception(EngineDeadError(self.dead_error))
        self._utility_calls.clear()

    async def watch_process(self) -> None:
        """Turn a silent death of a core (a local process killed or crashed; a remote core
        reported gone by its host, or silent past the heartbeat timeout) into ``errored``; once
        dead either way, stop the other cores and reap every local process (a failed core exits
        right after sending DEAD)."""
        while not self.errored:
            await asyncio.sleep(0.5)
            deaths = ((core, core.death(self.heartbeat_timeout_s)) for core in self.cores)
            dead = next(((core, why) for core, why in deaths if why is not None), None)
            if dead is not None:
                # Give a DEAD message already on the wire a moment to arrive first.
                await asyncio.sleep(0.2)
                self._die(dead[1], dead[0])
        await self._stop_cores()
