"""The in-process executor: one worker, called directly.

Without async scheduling a step runs inline on the caller's thread and returns a completed
future. With it, every step runs on one step thread, in submission order, so the caller can
schedule step N+1 while step N runs; that thread's intra-op threads are set up once by
``Worker.init_thread``. Compiles run on the caller's thread, only with no step in flight
(tracing beside a forward would catch it).
"""

from __future__ import annotations

import logging
from concurrent.futures import Future, ThreadPoolExecutor

from axon.config import AxonConfig
from axon.executor.abstract import Executor, resolve_async_scheduling
from axon.scheduler_output import CompileEvent, ModelRunnerOutput, SchedulerOutput
from axon.worker.worker import Worker

logger = logging.getLogger(__name__)


class UniProcExecutor(Executor):
    def __init__(self, config: AxonConfig) -> None:
        self.worker = Worker(config)
        self._step_thread = (
            ThreadPoolExecutor(1, thread_name_prefix="axon-step", initializer=self.worker.init_thread)
            if resolve_async_scheduling(config)
            else None
        )

    @property
    def max_concurrent_batches(self) -> int:
        return 1 if self._step_thread is None else 2

    @property
    def model_load_time_s(self) -> float:
        return self.worker.model_load_time_s

    def determine_num_blocks(self) -> int:
        return self.worker.determine_num_blocks()

    def kv_cache_window(self) -> int | None:
        return self.worker.kv_cache_window()

    def initialize_kv_cache(self, num_blocks: int) -> None:
        self.worker.initialize_kv_cache(num_blocks)

    def compile_or_warm_up_model(self) -> list[CompileEvent]:
        return self.worker.compile_or_warm_up_model()

    def execute_model(self, scheduler_output: SchedulerOutput) -> Future[ModelRunnerOutput]:
        if self._step_thread is not None:
            return self._step_thread.submit(self._execute, scheduler_output)
        future: Future[ModelRunnerOutput] = Future()
        try:
            future.set_result(self._execute(scheduler_output))
        except Exception as e:  # noqa: BLE001 (the future carries it, as the step thread's would)
            future.set_exception(e)
        return future

    def compile_pending(self) -> list[CompileEvent]:
        return self.worker.compile_pending()

    def _call_workers(self, method: str) -> None:
        getattr(self.worker, method)()

    def shutdown(self) -> None:
        if self._step_thread is not None:
            self._step_thread.shutdown(wait=False, cancel_futures=True)
        self.worker.shutdown()

    def _execute(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        try:
            return self.worker.execute_model(scheduler_output)
        except Exception:
            logger.exception(
                "step failed; scheduled tokens per request: %s", scheduler_output.num_scheduled_tokens
            )
            raise
