"""The periodic one-line engine report, as vLLM's ``LoggingStatLogger`` prints it."""

from __future__ import annotations

import logging
import time

from axon.metrics.spec_decode import SpecDecodingLogging
from axon.metrics.stats import IterationStats
from axon.step_outputs import SchedulerStats

logger = logging.getLogger("axon.metrics")


class LoggingStatLogger:
    """A ``StatLogger`` that logs throughput and load at INFO each time ``log()`` is called.

    Throughputs are the tokens recorded since the previous line over the time since it.
    Running, waiting and KV usage are the core's latest report. The prefix-cache hit rate is
    over the logger's lifetime (hits / queried tokens), 0 until anything was queried.
    A line is skipped when no token was processed since the last one and nothing runs or waits.
    With speculation on, vLLM's "SpecDecoding metrics" line follows, over the same interval.

    One logger per engine core, as in vLLM: it keeps the reports of engine ``engine_index``
    (its lines read "Engine 001: ...") and leaves the other engines' to their own loggers.
    """

    def __init__(self, engine_index: int = 0) -> None:
        self.engine_index = engine_index
        self.last_scheduler_stats = SchedulerStats()
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0
        self.spec_decoding = SpecDecodingLogging()
        self._reset(time.monotonic())

    def _reset(self, now: float) -> None:
        self.num_prompt_tokens = 0
        self.num_generation_tokens = 0
        self.last_log_time = now

    def record(
        self,
        scheduler_stats: SchedulerStats | None,
        iteration_stats: IterationStats | None,
        engine_idx: int = 0,
    ) -> None:
        if engine_idx != self.engine_index:
            return
        if scheduler_stats is not None:
            self.last_scheduler_stats = scheduler_stats
            self.prefix_cache_queries += scheduler_stats.prefix_cache_queries
            self.prefix_cache_hits += scheduler_stats.prefix_cache_hits
            if scheduler_stats.spec_decoding is not None:
                self.spec_decoding.observe(scheduler_stats.spec_decoding)
        if iteration_stats is not None:
            self.num_prompt_tokens += iteration_stats.num_prompt_tokens
            self.num_generation_tokens += iteration_stats.num_generation_tokens

    def log(self) -> None:
        now = time.monotonic()
        stats = self.last_scheduler_stats
        idle = stats.num_running_reqs == 0 and stats.num_waiting_reqs == 0
        if idle and self.num_prompt_tokens == 0 and self.num_generation_tokens == 0:
            self._reset(now)
            return
        elapsed = max(now - self.last_log_time, 1e-9)
        hit_rate = self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else 0.0
        logger.info(
            "Engine %03d: Avg prompt throughput: %.1f tokens/s, Avg generation throughput: %.1f tokens/s, "
            "Running: %d reqs, Waiting: %d reqs, KV cache usage: %.1f%%, Prefix cache hit rate: %.1f%%",
            self.engine_index,
            self.num_prompt_tokens / elapsed,
            self.num_generation_tokens / elapsed,
            stats.num_running_reqs,
            stats.num_waiting_reqs,
            stats.kv_cache_usage * 100,
            hit_rate * 100,
        )
        self.spec_decoding.log(elapsed)
        self._reset(now)
