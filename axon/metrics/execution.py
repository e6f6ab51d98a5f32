"""axon's execution metrics: padding per bucket, graph executions, compilation and start-up.

vllm-neuron's set under the ``axon:`` prefix, on the same ``/metrics`` page as vLLM's names:

  axon:num_seqs_padding              histogram of the padded batch of decode-only steps
  axon:num_batched_tokens_padding    histogram of the padded token count of prefill steps
  axon:num_padding_tokens            counter of padded rows (work done for no token)
  axon:bucket_execution_count        counter per bucket (decode_b8, prefill_s512)
  axon:compilation_time_seconds      gauge per compiled graph (tokens_8) and cache hit|miss
  axon:model_load_time_seconds       gauge
  axon:startup_time_seconds          gauge: engine core start until ready to serve

Each engine core (``engine`` label) has its own series of each.
"""

from __future__ import annotations

from collections.abc import Mapping

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from axon.metrics.labels import per_engine
from axon.step_outputs import SchedulerStats

_SEQS_BUCKETS = [2**i for i in range(11)]  # 1 .. 1024
_TOKENS_BUCKETS = [2**i for i in range(5, 15)]  # 32 .. 16384


class ExecutionMetrics:
    def __init__(
        self, registry: CollectorRegistry, labelnames: list[str], labelvalues: Mapping[int, list[str]]
    ) -> None:
        """``labelvalues``: engine index -> its values of ``labelnames``."""
        self.labelvalues = labelvalues
        self.num_seqs_padding = per_engine(
            Histogram(
                "axon:num_seqs_padding",
                "Padded batch size of decode-only steps.",
                labelnames,
                buckets=_SEQS_BUCKETS,
                registry=registry,
            ),
            labelvalues,
        )
        self.num_batched_tokens_padding = per_engine(
            Histogram(
                "axon:num_batched_tokens_padding",
                "Padded token count of steps that prefill.",
                labelnames,
                buckets=_TOKENS_BUCKETS,
                registry=registry,
            ),
            labelvalues,
        )
        self.num_padding_tokens = per_engine(
            Counter(
                "axon:num_padding_tokens", "Padded rows computed for no token.", labelnames, registry=registry
            ),
            labelvalues,
        )
        self.bucket_execution_count = Counter(
            "axon:bucket_execution_count",
            "Steps run per bucket.",
            [*labelnames, "bucket_name"],
            registry=registry,
        )
        self.compilation_time = Gauge(
            "axon:compilation_time_seconds",
            "Seconds to compile (or load from the compile cache) each graph.",
            [*labelnames, "bucket_name", "cache"],
            registry=registry,
        )
        self.model_load_time = per_engine(
            Gauge(
                "axon:model_load_time_seconds",
                "Seconds to load the model weights.",
                labelnames,
                registry=registry,
            ),
            labelvalues,
        )
        self.startup_time = per_engine(
            Gauge(
                "axon:startup_time_seconds",
                "Seconds from the engine core's start until it was ready to serve.",
                labelnames,
                registry=registry,
            ),
            labelvalues,
        )

    def record(self, stats: SchedulerStats, engine_idx: int = 0) -> None:
        labelvalues = self.labelvalues[engine_idx]
        if (b := stats.bucket) is not None:
            is_decode = b.name.startswith("decode_")
            padding = self.num_seqs_padding if is_decode else self.num_batched_tokens_padding
            padding[engine_idx].observe(b.padded_tokens)
            self.num_padding_tokens[engine_idx].inc(b.padded_tokens - b.num_tokens)
            self.bucket_execution_count.labels(*labelvalues, b.name).inc()
        for c in stats.compiles:
            cache = "hit" if c.cache_hit else "miss"
            self.compilation_time.labels(*labelvalues, c.name, cache).set(c.seconds)
        if stats.model_load_time_s is not None:
            self.model_load_time[engine_idx].set(stats.model_load_time_s)
        if stats.startup_time_s is not None:
            self.startup_time[engine_idx].set(stats.startup_time_s)
