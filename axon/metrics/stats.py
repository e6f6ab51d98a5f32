"""Per-iteration and per-request statistics, computed in the front end from core outputs.

The engine core reports what only it knows (``SchedulerStats``: running/waiting, KV usage,
prefix-cache counters, preemptions, scheduled tokens); the front end timestamps tokens as they
arrive and derives TTFT, inter-token latency and end-to-end latency, as vLLM V1 does.
Stat loggers (Prometheus, the periodic log line) consume both through ``StatLogger``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Protocol

from axon.step_outputs import EngineCoreOutput, SchedulerStats


@dataclass
class FinishedRequestStats:
    finish_reason: str
    e2e_latency: float
    queue_time: float
    num_prompt_tokens: int
    num_generation_tokens: int
    max_tokens: int | None
    n: int


@dataclass
class RequestTimes:
    arrival_time: float
    num_prompt_tokens: int
    max_tokens: int | None
    n: int = 1
    first_token_time: float = 0.0
    last_token_time: float = 0.0
    first_scheduled_time: float = 0.0
    num_generation_tokens: int = 0


@dataclass
class IterationStats:
    now: float = field(default_factory=time.time)
    num_prompt_tokens: int = 0
    num_generation_tokens: int = 0
    time_to_first_tokens: list[float] = field(default_factory=list)
    inter_token_latencies: list[float] = field(default_factory=list)
    finished_requests: list[FinishedRequestStats] = field(default_factory=list)

    def update_from_output(self, out: EngineCoreOutput, times: RequestTimes) -> None:
        n = len(out.new_token_ids)
        if times.first_scheduled_time == 0.0 and out.first_scheduled_time:
            times.first_scheduled_time = out.first_scheduled_time
        if out.pooled is not None:  # a pooling request: its prompt, computed once, is all it has
            self.num_prompt_tokens += times.num_prompt_tokens
        if n == 0:
            return
        self.num_generation_tokens += n
        if times.num_generation_tokens == 0:
            self.num_prompt_tokens += times.num_prompt_tokens
            self.time_to_first_tokens.append(self.now - times.arrival_time)
            times.first_token_time = self.now
        else:
            self.inter_token_latencies.append(self.now - times.last_token_time)
        times.last_token_time = self.now
        times.num_generation_tokens += n

    def finish(self, times: RequestTimes, finish_reason: str) -> None:
        queued_until = times.first_scheduled_time or times.first_token_time or self.now
        self.finished_requests.append(
            FinishedRequestStats(
                finish_reason=finish_reason,
                e2e_latency=self.now - times.arrival_time,
                queue_time=max(queued_until - times.arrival_time, 0.0),
                num_prompt_tokens=times.num_prompt_tokens,
                num_generation_tokens=times.num_generation_tokens,
                max_tokens=times.max_tokens,
                n=times.n,
            )
        )


class StatLogger(Protocol):
    def record(
        self,
        scheduler_stats: SchedulerStats | None,
        iteration_stats: IterationStats | None,
        engine_idx: int = 0,
    ) -> None:
        """One report of engine core ``engine_idx`` (0 .. data_parallel_size - 1)."""
        ...

    def log(self) -> None:
        """Called periodically (every few seconds) by the server."""
        ...
