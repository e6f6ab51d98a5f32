"""The in-process executor: one worker, called directly. Multi-worker executors (tensor
parallelism) implement the same three methods."""

from __future__ import annotations

from axon.config import AxonConfig
from axon.core.scheduler_output import CompileEvent, ModelRunnerOutput, SchedulerOutput
from axon.worker.worker import Worker


class UniProcExecutor:
    def __init__(self, config: AxonConfig) -> None:
        self.worker = Worker(config)

    def determine_num_blocks(self) -> int:
        return self.worker.determine_num_blocks()

    def initialize_kv_cache(self, num_blocks: int) -> None:
        self.worker.initialize_kv_cache(num_blocks)

    def init_thread(self) -> None:
        self.worker.init_thread()

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self.worker.execute_model(scheduler_output)

    def compile_or_warm_up_model(self) -> None:
        self.worker.compile_or_warm_up_model()

    def take_compile_events(self) -> list[CompileEvent]:
        return self.worker.take_compile_events()

    @property
    def model_load_time_s(self) -> float:
        return self.worker.model_load_time_s

    def compile_pending(self) -> bool:
        return self.worker.compile_pending()
