"""The in-process executor: one worker, called directly. Multi-worker executors (tensor
parallelism) implement the same three methods."""

from __future__ import annotations

from axon.config import AxonConfig
from axon.core.scheduler_output import ModelRunnerOutput, SchedulerOutput
from axon.worker.worker import Worker


class UniProcExecutor:
    def __init__(self, config: AxonConfig) -> None:
        self.worker = Worker(config)

    def determine_num_blocks(self) -> int:
        return self.worker.determine_num_blocks()

    def initialize_kv_cache(self, num_blocks: int) -> None:
        self.worker.initialize_kv_cache(num_blocks)

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self.worker.execute_model(scheduler_output)
