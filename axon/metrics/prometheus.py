"""Prometheus metrics with vLLM's names, labels and buckets, so vLLM's dashboards work on axon.

Every metric carries the labels ``model_name`` and ``engine``, as vLLM V1's
``PrometheusStatLogger`` does: one series per engine core (``engine_indexes``; ``"0"`` alone
unless ``--data-parallel-size`` runs several), each fed by ``record(..., engine_idx=i)`` with
that core's reports. ``vllm:cache_config_info`` too has one series per engine, with that
engine's own ``num_gpu_blocks`` (vLLM's front end sums them into one number). Each logger owns its own
``CollectorRegistry`` (never prometheus_client's global one), so several engines or tests in one
process do not collide; the server exposes it with ``render_metrics(logger.registry)``.

Counter semantics of the inputs (see ``SchedulerStats``): ``prefix_cache_queries`` and
``prefix_cache_hits`` are deltas since the core's previous report, ``num_preemptions`` is the
core's running total, so only its increase is counted. ``spec_decoding`` holds deltas too; its
counters exist only when the logger is built with ``num_speculative_tokens`` (speculation on).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import prometheus_client
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.registry import Collector

from axon.metrics.execution import ExecutionMetrics
from axon.metrics.kv_transfer import KVTransferProm
from axon.metrics.labels import LABELNAMES, engine_labelvalues, per_engine
from axon.metrics.spec_decode import SpecDecodingProm
from axon.metrics.stats import FinishedRequestStats, IterationStats
from axon.step_outputs import SchedulerStats

# The Content-Type of ``render_metrics``'s body, for ``GET /metrics``.
CONTENT_TYPE_LATEST = prometheus_client.CONTENT_TYPE_LATEST

TTFT_BUCKETS_S = [
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
]  # fmt: skip
ITL_BUCKETS_S = [
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
    40.0, 80.0,
]  # fmt: skip
REQUEST_LATENCY_BUCKETS_S = [
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
    480.0, 960.0, 1920.0, 7680.0,
]  # fmt: skip
# vLLM builds these from its CUDA-graph capture sizes; this is its default list.
ITERATION_TOKENS_BUCKETS = [1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384]
PARAMS_N_BUCKETS = [1, 2, 5, 10, 20]
FINISH_REASONS = ("stop", "length", "abort")


def build_1_2_5_buckets(max_value: int) -> list[int]:
    """1, 2, 5, 10, 20, 50, ... up to and including ``max_value`` (vLLM's token-count buckets)."""
    if max_value < 1:
        raise ValueError(f"max_value must be >= 1, got {max_value}")
    buckets: list[int] = []
    exponent = 0
    while True:
        for mantissa in (1, 2, 5):
            value = mantissa * 10**exponent
            if value > max_value:
                return buckets
            buckets.append(value)
        exponent += 1


def render_metrics(registry: CollectorRegistry) -> bytes:
    """The registry in Prometheus' text exposition format (serve with ``CONTENT_TYPE_LATEST``)."""
    return prometheus_client.generate_latest(registry)


class PrometheusStatLogger:
    """A ``StatLogger`` that keeps vLLM's Prometheus metrics in ``self.registry``."""

    def __init__(
        self,
        model_name: str,
        max_model_len: int = 8192,
        engine_indexes: Sequence[int] = (0,),
        cache_config_info: Mapping[str, object] | None = None,
        num_speculative_tokens: int = 0,
        kv_connector: str | None = None,
        max_lora: int | None = None,
    ) -> None:
        assert engine_indexes, "at least one engine"
        self.registry = CollectorRegistry(auto_describe=True)
        self.engine_indexes = list(engine_indexes)
        self.labelnames = list(LABELNAMES)
        self.labelvalues_per_engine = engine_labelvalues(model_name, self.engine_indexes)
        # The first engine's label values, for single-engine extensions (``register``).
        self.labelvalues = self.labelvalues_per_engine[self.engine_indexes[0]]
        self._last_num_preemptions = dict.fromkeys(self.engine_indexes, 0)
        self._make_gauges(cache_config_info)
        self._make_counters()
        self._make_histograms(max_model_len)
        self.execution = ExecutionMetrics(self.registry, self.labelnames, self.labelvalues_per_engine)
        self.spec_decoding = (
            SpecDecodingProm(
                self.registry, self.labelnames, self.labelvalues_per_engine, num_speculative_tokens
            )
            if num_speculative_tokens
            else None
        )
        self.kv_transfer = (
            KVTransferProm(self.registry, self.labelnames, self.labelvalues_per_engine, kv_connector)
            if kv_connector
            else None
        )
        self.max_lora = max_lora
        self._lora_labels: tuple[str, ...] | None = None
        self.lora_info = (
            Gauge(
                "vllm:lora_requests_info",
                "Running stats on lora requests.",
                ["max_lora", "waiting_lora_adapters", "running_lora_adapters"],
                registry=self.registry,
            )
            if max_lora is not None
            else None
        )

    # ---- the extension point -----------------------------------------------------------------
    def register(self, collector: Collector) -> None:
        """Add an axon-specific collector to this logger's registry (exposed on the same page).

        Build metrics with ``registry=None`` and ``labelnames=self.labelnames`` and label them
        with ``*self.labelvalues_per_engine[i]`` (``*self.labelvalues`` for the first engine)
        to match the rest of the page.
        """
        self.registry.register(collector)

    # ---- StatLogger ------------------------------------------------------------------------
    def record(
        self,
        scheduler_stats: SchedulerStats | None,
        iteration_stats: IterationStats | None,
        engine_idx: int = 0,
    ) -> None:
        if scheduler_stats is not None:
            self._record_scheduler(scheduler_stats, engine_idx)
        if iteration_stats is not None:
            self._record_iteration(iteration_stats, engine_idx)

    def log(self) -> None:
        """Prometheus is scraped, not pushed: nothing to do."""

    # ---- internals -----------------------------------------------------------------------
    def _record_scheduler(self, stats: SchedulerStats, engine_idx: int) -> None:
        self.execution.record(stats, engine_idx)
        if self.spec_decoding is not None and stats.spec_decoding is not None:
            self.spec_decoding.record(stats.spec_decoding, engine_idx)
        if self.kv_transfer is not None and stats.kv_transfer is not None:
            self.kv_transfer.record(stats.kv_transfer, engine_idx)
        if self.lora_info is not None and stats.running_lora_adapters is not None:
            self._record_lora(stats)
        self.num_requests_running[engine_idx].set(stats.num_running_reqs)
        self.num_requests_waiting[engine_idx].set(stats.num_waiting_reqs)
        self.kv_cache_usage_perc[engine_idx].set(stats.kv_cache_usage)
        self.prefix_cache_queries[engine_idx].inc(stats.prefix_cache_queries)
        self.prefix_cache_hits[engine_idx].inc(stats.prefix_cache_hits)
        # A total below the last one means a new core started counting from zero.
        increase = stats.num_preemptions - self._last_num_preemptions[engine_idx]
        if increase < 0:
            increase = stats.num_preemptions
        self.num_preemptions[engine_idx].inc(increase)
        self._last_num_preemptions[engine_idx] = stats.num_preemptions

    def _record_lora(self, stats: SchedulerStats) -> None:
        """vLLM's ``lora_requests_info``: one series, its labels the adapters running and
        waiting (comma-separated), its value when they were last reported."""
        assert self.lora_info is not None
        labels = (
            str(self.max_lora),
            ",".join(stats.waiting_lora_adapters or []),
            ",".join(stats.running_lora_adapters or []),
        )
        if self._lora_labels is not None and self._lora_labels != labels:
            self.lora_info.remove(*self._lora_labels)
        self._lora_labels = labels
        self.lora_info.labels(*labels).set_to_current_time()

    def _record_iteration(self, it: IterationStats, engine_idx: int) -> None:
        self.prompt_tokens[engine_idx].inc(it.num_prompt_tokens)
        self.generation_tokens[engine_idx].inc(it.num_generation_tokens)
        num_tokens = it.num_prompt_tokens + it.num_generation_tokens
        if num_tokens:
            self.iteration_tokens[engine_idx].observe(num_tokens)
        for ttft in it.time_to_first_tokens:
            self.time_to_first_token[engine_idx].observe(ttft)
        for itl in it.inter_token_latencies:
            self.inter_token_latency[engine_idx].observe(itl)
            self.time_per_output_token[engine_idx].observe(itl)
        for finished in it.finished_requests:
            self._record_finished(finished, engine_idx)

    def _record_finished(self, req: FinishedRequestStats, engine_idx: int) -> None:
        self._success(req.finish_reason, engine_idx).inc()
        self.e2e_request_latency[engine_idx].observe(req.e2e_latency)
        self.request_queue_time[engine_idx].observe(req.queue_time)
        self.request_prompt_tokens[engine_idx].observe(req.num_prompt_tokens)
        self.request_generation_tokens[engine_idx].observe(req.num_generation_tokens)
        self.request_params_n[engine_idx].observe(req.n)
        if req.max_tokens is not None:
            self.request_params_max_tokens[engine_idx].observe(req.max_tokens)

    def _success(self, finish_reason: str, engine_idx: int) -> Counter:
        return self.request_success.labels(*self.labelvalues_per_engine[engine_idx], finish_reason)

    def _per_engine(self, metric):
        return per_engine(metric, self.labelvalues_per_engine)

    def _make_gauges(self, cache_config_info: Mapping[str, object] | None) -> None:
        def gauge(name: str, doc: str) -> dict[int, Gauge]:
            return self._per_engine(Gauge(name, doc, self.labelnames, registry=self.registry))

        self.num_requests_running = gauge(
            "vllm:num_requests_running", "Number of requests in model execution batches."
        )
        self.num_requests_waiting = gauge(
            "vllm:num_requests_waiting", "Number of requests waiting to be processed."
        )
        self.kv_cache_usage_perc = gauge(
            "vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage."
        )
        self._cache_info: Gauge | None = None
        self._cache_info_labels: dict[int, dict[str, str]] = {}
        if cache_config_info:
            labels = {name: str(value) for name, value in cache_config_info.items()}
            labels.setdefault("num_gpu_blocks", "None")  # known once the engine has sized the cache
            self._cache_info = Gauge(
                "vllm:cache_config_info",
                "Information of the LLMEngine CacheConfig",
                sorted([*labels, "engine"]),
                registry=self.registry,
            )
            for engine_idx in self.engine_indexes:
                self._set_cache_info({**labels, "engine": str(engine_idx)}, engine_idx)

    def _set_cache_info(self, labels: dict[str, str], engine_idx: int) -> None:
        assert self._cache_info is not None
        old = self._cache_info_labels.get(engine_idx)
        if old:
            self._cache_info.remove(*(old[n] for n in sorted(old)))
        self._cache_info_labels[engine_idx] = labels
        self._cache_info.labels(*(labels[n] for n in sorted(labels))).set(1)

    def record_num_blocks(self, num_blocks: int, engine_idx: int = 0) -> None:
        """Engine ``engine_idx``'s KV cache size in blocks, as vLLM's cache_config_info reports it
        (num_gpu_blocks)."""
        if self._cache_info is not None:
            labels = {**self._cache_info_labels[engine_idx], "num_gpu_blocks": str(num_blocks)}
            self._set_cache_info(labels, engine_idx)

    def _make_counters(self) -> None:
        def counter(name: str, doc: str) -> dict[int, Counter]:
            return self._per_engine(Counter(name, doc, self.labelnames, registry=self.registry))

        self.prefix_cache_queries = counter(
            "vllm:prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens."
        )
        self.prefix_cache_hits = counter(
            "vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens."
        )
        self.num_preemptions = counter(
            "vllm:num_preemptions", "Cumulative number of preemption from the engine."
        )
        self.prompt_tokens = counter("vllm:prompt_tokens", "Number of prefill tokens processed.")
        self.generation_tokens = counter("vllm:generation_tokens", "Number of generation tokens processed.")
        self.request_success = Counter(
            "vllm:request_success",
            "Count of successfully processed requests.",
            [*self.labelnames, "finished_reason"],
            registry=self.registry,
        )
        for engine_idx in self.engine_indexes:
            for reason in FINISH_REASONS:  # present (at 0) from the first scrape, as in vLLM
                self._success(reason, engine_idx)

    def _make_histograms(self, max_model_len: int) -> None:
        def histogram(name: str, doc: str, buckets: list) -> dict[int, Histogram]:
            return self._per_engine(
                Histogram(name, doc, self.labelnames, buckets=buckets, registry=self.registry)
            )

        token_buckets = build_1_2_5_buckets(max_model_len)
        self.time_to_first_token = histogram(
            "vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.", TTFT_BUCKETS_S
        )
        self.inter_token_latency = histogram(
            "vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.", ITL_BUCKETS_S
        )
        self.time_per_output_token = histogram(
            "vllm:time_per_output_token_seconds",
            "Histogram of time per output token in seconds (the same values as inter_token_latency).",
            ITL_BUCKETS_S,
        )
        self.e2e_request_latency = histogram(
            "vllm:e2e_request_latency_seconds",
            "Histogram of e2e request latency in seconds.",
            REQUEST_LATENCY_BUCKETS_S,
        )
        self.request_queue_time = histogram(
            "vllm:request_queue_time_seconds",
            "Histogram of time spent in WAITING phase for request.",
            REQUEST_LATENCY_BUCKETS_S,
        )
        self.request_prompt_tokens = histogram(
            "vllm:request_prompt_tokens", "Number of prefill tokens processed.", token_buckets
        )
        self.request_generation_tokens = histogram(
            "vllm:request_generation_tokens", "Number of generation tokens processed.", token_buckets
        )
        self.iteration_tokens = histogram(
            "vllm:iteration_tokens_total",
            "Histogram of number of tokens per engine_step.",
            ITERATION_TOKENS_BUCKETS,
        )
        self.request_params_n = histogram(
            "vllm:request_params_n", "Histogram of the n request parameter.", PARAMS_N_BUCKETS
        )
        self.request_params_max_tokens = histogram(
            "vllm:request_params_max_tokens", "Histogram of the max_tokens request parameter.", token_buckets
        )
