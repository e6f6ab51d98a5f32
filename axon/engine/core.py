"""EngineCore: the loop. Each step is schedule -> execute -> update, nothing more.

It owns the scheduler and the executor and knows no tokenizer: it speaks token ids in
(``EngineCoreRequest``) and out (``EngineCoreOutputs``), so it can run in its own process.

The executor (``axon/executor/abstract.py``) returns each step as a future. With async
scheduling (``executor.max_concurrent_batches > 1``) one step is in flight ahead: while step N
runs, this thread schedules step N+1 and queues it behind N, then applies N's output (stop
checks, outputs, detokenization by the caller) while N+1 runs. The executor runs steps in
order, so N+1 reads the tokens N sampled (see ``axon/core/scheduler.py``); outputs are the
same as in synchronous mode. Steps with structured outputs are not scheduled ahead.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Iterable
from concurrent.futures import Future
from typing import Any

from torch.profiler import record_function

from axon.config import AxonConfig, blocks_per_seq, replace
from axon.core.kv_cache_utils import make_block_hasher
from axon.core.request import Request, RequestStatus
from axon.core.scheduler import Scheduler
from axon.engine.messages import EngineCoreOutput, EngineCoreOutputs, EngineCoreRequest, SchedulerStats
from axon.engine.tokenizer import get_tokenizer
from axon.executor.abstract import Executor
from axon.kv_transfer.config import parse_kv_transfer_config
from axon.kv_transfer.factory import make_scheduler_connector
from axon.kv_transfer.kv_events import make_kv_event_publisher, parse_kv_events_config
from axon.metrics.profiler import Profiler, parse_profiler_config
from axon.model.registry import is_encoder_only, resolve_model_class
from axon.scheduler_output import CompileEvent, ModelRunnerOutput, SchedulerOutput
from axon.spec_decode.config import parse_spec_decode_config
from axon.structured_output.manager import StructuredOutputManager

logger = logging.getLogger(__name__)

InFlightStep = tuple[SchedulerOutput, Future[ModelRunnerOutput]]


class EngineCore:
    def __init__(self, config: AxonConfig) -> None:
        t0 = time.perf_counter()
        self.config = config
        # Checked before anything loads: a bad --kv-events-config fails the start at once.
        kv_events_config = parse_kv_events_config(config.kv_transfer_config.kv_events_config)
        m = config.model_config
        max_model_len = m.max_model_len
        assert max_model_len is not None, "resolve_config() sets max_model_len"
        self.executor: Executor = Executor.get_class(config)(config)
        num_blocks = self.executor.determine_num_blocks()
        block_size = config.scheduler_block_size
        window = self.executor.kv_cache_window()
        _check_kv_fits(num_blocks, block_size, max_model_len, window)
        self.executor.initialize_kv_cache(num_blocks)
        self.num_blocks = num_blocks
        self.scheduler = Scheduler(
            config.scheduler_config,
            replace(config.cache_config, block_size=block_size),
            max_model_len,
            num_blocks,
            structured_output_manager=StructuredOutputManager.from_config(
                config, functools.partial(get_tokenizer, config.model_config.tokenizer)
            ),
            encoder_only=is_encoder_only(
                resolve_model_class((m.hf_config or {}).get("architectures"), m.runner)
            ),
            spec_config=parse_spec_decode_config(config.speculative_config.speculative_config),
            **_kv_connector_args(config),
            window=window,
            max_loras=config.lora_config.max_loras if config.lora_config.enable_lora else None,
        )
        self.block_hasher = make_block_hasher(block_size)
        self.async_scheduling = self.executor.max_concurrent_batches > 1
        self._in_flight: InFlightStep | None = None
        # Worker facts not yet reported: compile events, then (first report only) start-up times.
        self._unreported_compiles: list[CompileEvent] = self.executor.compile_or_warm_up_model()
        self.model_load_time_s = self.executor.model_load_time_s
        self.startup_time_s = time.perf_counter() - t0
        self.kv_event_publisher = make_kv_event_publisher(
            kv_events_config, config.parallel_config.data_parallel_rank
        )
        if self.kv_event_publisher.enabled:
            self.scheduler.kv_cache_manager.enable_kv_cache_events()
        logger.info("engine core ready in %.1f s", self.startup_time_s)
        self._reported_startup = False
        self.sleeping = False  # the KV cache's memory released (sleep); no request may run
        settings = parse_profiler_config(config.observability_config.profiler_config)
        rank = config.parallel_config.data_parallel_rank
        self.profiler = None if settings is None else Profiler(settings, f"axon-engine-core-{rank}")

    def add_request(self, request: EngineCoreRequest) -> None:
        self.scheduler.add_request(
            Request(
                req_id=request.req_id,
                prompt_token_ids=request.prompt_token_ids,
                sampling_params=request.sampling_params,
                eos_token_id=request.eos_token_id,
                arrival_time=request.arrival_time,
                cache_salt=request.cache_salt,
                block_hasher=self.block_hasher,
                pooling_params=request.pooling_params,
                kv_transfer_params=request.kv_transfer_params,
                images=request.images,
                prompt_embeds=request.prompt_embeds,
                lora=request.lora,
            )
        )

    def abort_requests(self, req_ids: Iterable[str]) -> None:
        self.scheduler.finish_requests(req_ids, RequestStatus.FINISHED_ABORTED)

    def has_unfinished_requests(self) -> bool:
        """Requests to run, a step in flight, or KV transfers to settle (the steps poll them)."""
        s = self.scheduler
        return s.has_unfinished_requests() or self._in_flight is not None or s.has_pending_transfers()

    def step(self) -> EngineCoreOutputs:
        if self._in_flight is None:
            if not self.has_unfinished_requests():
                return EngineCoreOutputs(outputs=[])
            with record_function("schedule"):
                scheduler_output = self._schedule()
            self._in_flight = self._execute(scheduler_output)
        scheduler_output, future = self._in_flight
        self._in_flight = None
        if self.async_scheduling:
            self._schedule_ahead()
        runner_output = future.result()
        transfers = runner_output.kv_connector_output
        if scheduler_output.is_empty and (transfers is None or transfers.is_empty):
            # Only KV transfers to wait on, and none moved: a pause, not a spin, and no report
            # unless a request ended (a failed load under kv_load_failure_policy "fail").
            outputs = self.scheduler.update_from_output(scheduler_output, runner_output)
            if not outputs:
                time.sleep(_TRANSFER_POLL_S)
                return EngineCoreOutputs(outputs=[])
            return self._finish(scheduler_output, runner_output, outputs)
        return self._finish(scheduler_output, runner_output)

    def _schedule(self) -> SchedulerOutput:
        # A step may be empty while KV transfers settle, and may settle the last of them
        # (an aborted request's load ended: its blocks are freed, nothing is left to run).
        settling = self.scheduler.has_pending_transfers()
        scheduler_output = self.scheduler.schedule()
        if scheduler_output.is_empty and not (settling or self.scheduler.has_pending_transfers()):
            raise RuntimeError(
                f"scheduler made no progress with {self.scheduler.get_num_unfinished_requests()} "
                "unfinished requests (a bug: admission should always allow one)"
            )
        return scheduler_output

    def _execute(self, scheduler_output: SchedulerOutput) -> InFlightStep:
        return scheduler_output, self.executor.execute_model(scheduler_output)

    def _schedule_ahead(self) -> None:
        """Queue step N+1 behind the step in flight, where the scheduler allows it."""
        if not (self.scheduler.has_unfinished_requests() and self.scheduler.can_schedule_ahead()):
            return
        ahead = self.scheduler.schedule()
        if ahead.is_empty and ahead.kv_connector_metadata is None:
            # every running request's next token is in flight and its last
            self.scheduler.finished_req_ids |= ahead.finished_req_ids
        else:
            self._in_flight = self._execute(ahead)

    def _finish(
        self,
        scheduler_output: SchedulerOutput,
        runner_output: ModelRunnerOutput,
        outputs: list[EngineCoreOutput] | None = None,
    ) -> EngineCoreOutputs:
        if outputs is None:
            with record_function("update"):
                outputs = self.scheduler.update_from_output(scheduler_output, runner_output)
        self._publish_kv_events()
        stats = self.make_stats()
        stats.num_scheduled_tokens = scheduler_output.total_num_scheduled_tokens
        stats.bucket = runner_output.bucket
        return EngineCoreOutputs(outputs=outputs, scheduler_stats=stats)

    def _publish_kv_events(self) -> None:
        """The prefix-cache changes of this step (and of the step scheduled ahead), as one batch."""
        events = self.scheduler.kv_cache_manager.take_events()
        if events:
            self.kv_event_publisher.publish(events)

    def make_stats(self) -> SchedulerStats:
        stats = self.scheduler.make_stats()
        stats.compiles, self._unreported_compiles = self._unreported_compiles, []
        report_startup_once(self, stats)
        return stats

    def compile_pending(self) -> bool:
        """Between steps with nothing to run: compile the buckets traffic reached (never beside
        a step in flight: tracing would catch the forward on the other thread). True if any
        bucket compiled; its events go out with the next stats."""
        if self._in_flight is not None:
            return False
        compiles = self.executor.compile_pending()
        self._unreported_compiles += compiles
        return bool(compiles)

    def start_profile(self) -> bool:
        """Profile this process (and every worker process) until ``stop_profile``; False: off."""
        if self.profiler is None:
            return False
        self.profiler.start()
        self.executor.start_profile()
        return True

    def stop_profile(self) -> list[str]:
        """Stop profiling; the trace files written (this process's, then the workers')."""
        if self.profiler is None or not self.profiler.running:
            return []
        path = self.profiler.stop()
        return [p for p in [path, *self.executor.stop_profile()] if p]

    def sleep(self, level: int = 1) -> str | None:
        """Release the KV cache's memory (vLLM's sleep level 1; the weights stay in host memory).
        None when asleep, else why not (requests still running, a level not supported)."""
        if level == 2:
            return (
                "sleep level 2 (discarding the weights) is not supported: level 1 releases the KV "
                "cache, and the weights stay in host memory"
            )
        if level != 1:
            return f"sleep level must be 1 or 2, got {level}"
        if self.has_unfinished_requests():
            return "requests are still running: sleep when the engine is idle"
        if self.scheduler.connector is not None:
            return "a KV connector's registered cache cannot be released"
        if not self.sleeping:
            reset = self.reset_prefix_cache()  # the cache's content is about to go
            assert reset, "no request holds blocks"
            self.executor.sleep()
            self.sleeping = True
        return None

    def wake_up(self) -> None:
        if self.sleeping:
            self.executor.wake_up()
            self.sleeping = False

    def is_sleeping(self) -> bool:
        return self.sleeping

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix block (vLLM's /reset_prefix_cache); False while a running
        request holds blocks (nothing is changed then)."""
        done = self.scheduler.kv_cache_manager.reset_prefix_cache()
        self._publish_kv_events()
        return done

    def check_health(self) -> None:
        """Raise the executor's error if a worker has died (the loop calls it while idle)."""
        self.executor.check_health()

    def shutdown(self) -> None:
        if self.scheduler.connector is not None:
            self.scheduler.connector.shutdown()
        self.executor.shutdown()
        self.kv_event_publisher.shutdown()


def report_startup_once(core: Any, stats: SchedulerStats) -> None:
    """An engine core's start-up times (``model_load_time_s``, ``startup_time_s``) go out with
    its first report only."""
    if not core._reported_startup:
        stats.model_load_time_s = core.model_load_time_s
        stats.startup_time_s = core.startup_time_s
        core._reported_startup = True


def make_engine_core(config: AxonConfig) -> EngineCore:
    """The engine core ``config`` asks for: an encoder server's (``mm_encoder_only``: the vision
    tower alone, axon/engine/encoder_core.py) or the usual one."""
    if config.model_config.mm_encoder_only:
        from axon.engine.encoder_core import EncoderEngineCore

        return EncoderEngineCore(config)  # type: ignore[return-value] (the same face)
    return EngineCore(config)


# How long an engine with only KV transfers to settle waits between polls of them.
_TRANSFER_POLL_S = 0.001


def _kv_connector_args(config: AxonConfig) -> dict:
    """The scheduler half of the KV connector (``kv_transfer_config``), if any."""
    settings = parse_kv_transfer_config(config.kv_transfer_config.kv_transfer_config)
    if settings is None:
        return {}
    connector = make_scheduler_connector(
        settings, config.cache_config.block_size, config.parallel_config.data_parallel_rank
    )
    return {"kv_connector": connector, "kv_load_failure_policy": settings.kv_load_failure_policy}


def _check_kv_fits(num_blocks: int, block_size: int, max_model_len: int, window: int | None = None) -> None:
    needed = blocks_per_seq(max_model_len, block_size, window) + 1  # the window group's too
    if num_blocks < needed:
        raise ValueError(
            f"the KV cache has {num_blocks} blocks of {block_size} tokens, fewer than the {needed} that one "
            f"sequence of max_model_len={max_model_len} needs (block 0 is reserved); raise kv_cache_space_gib "
            f"or num_gpu_blocks_override, or lower max_model_len"
        )
