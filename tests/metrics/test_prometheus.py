"""PrometheusStatLogger and LoggingStatLogger fed real IterationStats, read back as a scraper would."""

from __future__ import annotations

import logging

import pytest
from prometheus_client.parser import text_string_to_metric_families

from axon.metrics.loggers import LoggingStatLogger
from axon.metrics.prometheus import (
    ITL_BUCKETS_S,
    REQUEST_LATENCY_BUCKETS_S,
    TTFT_BUCKETS_S,
    PrometheusStatLogger,
    build_1_2_5_buckets,
    render_metrics,
)
from axon.metrics.stats import IterationStats, RequestTimes
from axon.step_outputs import EngineCoreOutput, SchedulerStats

MODEL = "test-model"
LABELS = {"model_name": MODEL, "engine": "0"}


def scrape(stat_logger: PrometheusStatLogger) -> dict[tuple[str, tuple], float]:
    """(sample name, sorted labels) -> value, from the rendered text page."""
    text = render_metrics(stat_logger.registry).decode()
    samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            samples[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return samples


def value(samples: dict, name: str, **extra: str) -> float:
    return samples[(name, tuple(sorted({**LABELS, **extra}.items())))]


def iteration(now: float) -> IterationStats:
    return IterationStats(now=now)


def two_requests_lifecycle() -> list[tuple[SchedulerStats | None, IterationStats]]:
    """Request a (prompt 10, arrives at 100.0) and b (prompt 4, arrives at 100.5), step by step.

    a: scheduled at 100.1, first token at 100.2, tokens at 100.25 and 100.45, stops.
    b: scheduled at 100.6, first token at 101.0 (2 tokens at once), runs out of length at 101.3.
    """
    a = RequestTimes(arrival_time=100.0, num_prompt_tokens=10, max_tokens=3)
    b = RequestTimes(arrival_time=100.5, num_prompt_tokens=4, max_tokens=3, n=2)
    steps = []
    it = iteration(100.2)
    it.update_from_output(EngineCoreOutput("a", [1], first_scheduled_time=100.1), a)
    steps.append((SchedulerStats(num_running_reqs=1, kv_cache_usage=0.25, prefix_cache_queries=10), it))
    it = iteration(100.25)
    it.update_from_output(EngineCoreOutput("a", [2]), a)
    steps.append((SchedulerStats(num_running_reqs=1, num_waiting_reqs=1, kv_cache_usage=0.3), it))
    it = iteration(100.45)
    it.update_from_output(EngineCoreOutput("a", [3], finish_reason="stop"), a)
    it.finish(a, "stop")
    steps.append((SchedulerStats(num_waiting_reqs=1, kv_cache_usage=0.1, num_preemptions=2), it))
    it = iteration(101.0)
    it.update_from_output(EngineCoreOutput("b", [], first_scheduled_time=100.6), b)
    it.update_from_output(EngineCoreOutput("b", [4, 5]), b)
    steps.append((None, it))
    it = iteration(101.3)
    it.update_from_output(EngineCoreOutput("b", [6], finish_reason="length"), b)
    it.finish(b, "length")
    steps.append(
        (
            SchedulerStats(
                num_running_reqs=0,
                num_waiting_reqs=0,
                kv_cache_usage=0.0,
                prefix_cache_queries=4,
                prefix_cache_hits=3,
                num_preemptions=3,
            ),
            it,
        )
    )
    return steps


@pytest.fixture
def fed() -> PrometheusStatLogger:
    stat_logger = PrometheusStatLogger(MODEL, max_model_len=512)
    for scheduler_stats, it in two_requests_lifecycle():
        stat_logger.record(scheduler_stats, it)
    return stat_logger


def test_gauges_follow_the_latest_scheduler_stats() -> None:
    stat_logger = PrometheusStatLogger(MODEL)
    stat_logger.record(SchedulerStats(num_running_reqs=3, num_waiting_reqs=2, kv_cache_usage=0.75), None)
    s = scrape(stat_logger)
    assert value(s, "vllm:num_requests_running") == 3
    assert value(s, "vllm:num_requests_waiting") == 2
    assert value(s, "vllm:kv_cache_usage_perc") == 0.75
    stat_logger.record(None, iteration(1.0))  # no scheduler report: the gauges keep their values
    assert value(scrape(stat_logger), "vllm:num_requests_running") == 3
    stat_logger.record(SchedulerStats(num_running_reqs=1), None)
    s = scrape(stat_logger)
    assert value(s, "vllm:num_requests_running") == 1
    assert value(s, "vllm:num_requests_waiting") == 0
    assert value(s, "vllm:kv_cache_usage_perc") == 0.0


def test_counters_have_total_names_and_exact_values(fed: PrometheusStatLogger) -> None:
    s = scrape(fed)
    assert value(s, "vllm:prompt_tokens_total") == 14
    assert value(s, "vllm:generation_tokens_total") == 6
    assert value(s, "vllm:prefix_cache_queries_total") == 14
    assert value(s, "vllm:prefix_cache_hits_total") == 3
    assert value(s, "vllm:num_preemptions_total") == 3
    assert value(s, "vllm:request_success_total", finished_reason="stop") == 1
    assert value(s, "vllm:request_success_total", finished_reason="length") == 1
    assert value(s, "vllm:request_success_total", finished_reason="abort") == 0
    # The final gauges: everything finished.
    assert value(s, "vllm:num_requests_running") == 0
    assert value(s, "vllm:kv_cache_usage_perc") == 0.0


def test_latency_histograms(fed: PrometheusStatLogger) -> None:
    s = scrape(fed)
    # TTFT: a 0.2 s, b 0.5 s.
    assert value(s, "vllm:time_to_first_token_seconds_count") == 2
    assert value(s, "vllm:time_to_first_token_seconds_sum") == pytest.approx(0.7)
    assert value(s, "vllm:time_to_first_token_seconds_bucket", le="0.25") == 1
    assert value(s, "vllm:time_to_first_token_seconds_bucket", le="0.5") == 2
    assert value(s, "vllm:time_to_first_token_seconds_bucket", le="+Inf") == 2
    # ITL: a 0.05 and 0.2, b 0.3; the old TPOT name sees the same values.
    for name in ("vllm:inter_token_latency_seconds", "vllm:time_per_output_token_seconds"):
        assert value(s, f"{name}_count") == 3
        assert value(s, f"{name}_sum") == pytest.approx(0.55)
        assert value(s, f"{name}_bucket", le="0.075") == 1
        assert value(s, f"{name}_bucket", le="0.15") == 1
        assert value(s, f"{name}_bucket", le="0.3") == 3  # 101.3 - 101.0 is 0.29999999999999716
    # E2E: a 0.45, b 0.8; queue: a 0.1, b 0.1.
    assert value(s, "vllm:e2e_request_latency_seconds_count") == 2
    assert value(s, "vllm:e2e_request_latency_seconds_sum") == pytest.approx(1.25)
    assert value(s, "vllm:e2e_request_latency_seconds_bucket", le="0.5") == 1
    assert value(s, "vllm:e2e_request_latency_seconds_bucket", le="1.0") == 2
    assert value(s, "vllm:request_queue_time_seconds_count") == 2
    assert value(s, "vllm:request_queue_time_seconds_sum") == pytest.approx(0.2)


def test_token_histograms(fed: PrometheusStatLogger) -> None:
    s = scrape(fed)
    assert value(s, "vllm:request_prompt_tokens_count") == 2
    assert value(s, "vllm:request_prompt_tokens_sum") == 14
    assert value(s, "vllm:request_prompt_tokens_bucket", le="5.0") == 1
    assert value(s, "vllm:request_prompt_tokens_bucket", le="10.0") == 2
    assert value(s, "vllm:request_generation_tokens_sum") == 6
    assert value(s, "vllm:request_params_max_tokens_sum") == 6
    assert value(s, "vllm:request_params_n_sum") == 3
    assert value(s, "vllm:request_params_n_bucket", le="1.0") == 1
    # One observation per record call: 10+1, 1, 1, 4+2, 1 tokens.
    assert value(s, "vllm:iteration_tokens_total_count") == 5
    assert value(s, "vllm:iteration_tokens_total_sum") == 20
    # Token buckets stop at max_model_len.
    assert value(s, "vllm:request_prompt_tokens_bucket", le="500.0") == 2
    assert ("vllm:request_prompt_tokens_bucket", tuple(sorted({**LABELS, "le": "1000.0"}.items()))) not in s


def test_bucket_boundaries_are_vllms() -> None:
    assert build_1_2_5_buckets(100) == [1, 2, 5, 10, 20, 50, 100]
    assert build_1_2_5_buckets(4096)[-1] == 2000
    s = scrape(PrometheusStatLogger(MODEL))

    def les(name: str) -> list[float]:
        return sorted(
            float(dict(k[1])["le"]) for k in s if k[0] == f"{name}_bucket" and dict(k[1])["le"] != "+Inf"
        )

    assert les("vllm:time_to_first_token_seconds") == TTFT_BUCKETS_S
    assert les("vllm:inter_token_latency_seconds") == ITL_BUCKETS_S
    assert les("vllm:e2e_request_latency_seconds") == REQUEST_LATENCY_BUCKETS_S


def test_preemptions_count_the_increase_of_the_cumulative_total() -> None:
    stat_logger = PrometheusStatLogger(MODEL)
    for total in (0, 2, 2, 5, 5):
        stat_logger.record(SchedulerStats(num_preemptions=total), None)
    assert value(scrape(stat_logger), "vllm:num_preemptions_total") == 5
    stat_logger.record(SchedulerStats(num_preemptions=1), None)  # a new core counts from 0 again
    assert value(scrape(stat_logger), "vllm:num_preemptions_total") == 6


def test_two_loggers_do_not_share_state() -> None:
    first, second = PrometheusStatLogger("m1"), PrometheusStatLogger("m2")
    it = iteration(1.0)
    it.update_from_output(EngineCoreOutput("a", [1, 2]), RequestTimes(0.5, 7, None))
    first.record(SchedulerStats(num_running_reqs=4), it)
    assert first.registry is not second.registry
    page = render_metrics(second.registry).decode()
    assert 'vllm:prompt_tokens_total{engine="0",model_name="m2"} 0.0' in page
    assert 'vllm:num_requests_running{engine="0",model_name="m2"} 0.0' in page
    assert "m1" not in page
    assert (
        'vllm:prompt_tokens_total{engine="0",model_name="m1"} 7.0' in render_metrics(first.registry).decode()
    )


def test_extra_collectors_share_the_page() -> None:
    from prometheus_client import Counter

    stat_logger = PrometheusStatLogger(MODEL)
    extra = Counter("axon:compiles", "Graph compiles.", stat_logger.labelnames, registry=None)
    stat_logger.register(extra)
    extra.labels(*stat_logger.labelvalues).inc(2)
    assert value(scrape(stat_logger), "axon:compiles_total") == 2


def test_cache_config_info() -> None:
    stat_logger = PrometheusStatLogger(MODEL, cache_config_info={"block_size": 16, "num_gpu_blocks": 100})
    s = scrape(stat_logger)
    assert (
        s[("vllm:cache_config_info", (("block_size", "16"), ("engine", "0"), ("num_gpu_blocks", "100")))] == 1
    )


# ---- several engine cores (--data-parallel-size) ---------------------------------------------------
def test_each_engine_has_its_own_series_fed_by_its_own_reports() -> None:
    stat_logger = PrometheusStatLogger(MODEL, engine_indexes=[0, 1], num_speculative_tokens=2)
    steps = two_requests_lifecycle()
    for scheduler_stats, it in steps:
        stat_logger.record(scheduler_stats, it, engine_idx=1)
    stat_logger.record(SchedulerStats(num_running_reqs=7, num_preemptions=3), None, engine_idx=0)
    stat_logger.record(SchedulerStats(num_preemptions=5), None, engine_idx=1)  # 3 before, its own
    s = scrape(stat_logger)

    def of(engine: str, name: str, **extra: str) -> float:
        return s[(name, tuple(sorted({**LABELS, "engine": engine, **extra}.items())))]

    # Engine 1 got the two requests, engine 0 only a load report: nothing mixes.
    assert of("1", "vllm:request_success_total", finished_reason="stop") == 1
    assert of("0", "vllm:request_success_total", finished_reason="stop") == 0
    assert of("1", "vllm:prompt_tokens_total") == 14 and of("0", "vllm:prompt_tokens_total") == 0
    assert of("0", "vllm:num_requests_running") == 7
    assert of("0", "vllm:num_preemptions_total") == 3 and of("1", "vllm:num_preemptions_total") == 5
    # Every series of every engine is there from the first scrape.
    for engine in ("0", "1"):
        assert of(engine, "vllm:spec_decode_num_drafts_total") == 0
        assert of(engine, "axon:startup_time_seconds") == 0
        assert of(engine, "vllm:time_to_first_token_seconds_count") >= 0


def test_cache_config_info_per_engine() -> None:
    stat_logger = PrometheusStatLogger(MODEL, engine_indexes=[0, 1], cache_config_info={"block_size": 16})
    stat_logger.record_num_blocks(100, engine_idx=0)
    stat_logger.record_num_blocks(90, engine_idx=1)
    info = {k: v for k, v in scrape(stat_logger).items() if k[0] == "vllm:cache_config_info"}
    assert {dict(labels)["engine"]: dict(labels)["num_gpu_blocks"] for _, labels in info} == {
        "0": "100",
        "1": "90",
    }
    assert set(info.values()) == {1}


def test_a_logging_line_per_engine(caplog: pytest.LogCaptureFixture, clock: list[float]) -> None:
    loggers = [LoggingStatLogger(0), LoggingStatLogger(1)]
    for engine_idx, running in ((0, 3), (1, 5)):
        for stat_logger in loggers:  # every logger is offered every engine's report
            stat_logger.record(SchedulerStats(num_running_reqs=running), None, engine_idx=engine_idx)
    with caplog.at_level(logging.INFO, logger="axon.metrics"):
        for stat_logger in loggers:
            stat_logger.log()
    lines = [r.getMessage() for r in caplog.records]
    assert lines[0].startswith("Engine 000:") and "Running: 3 reqs" in lines[0]
    assert lines[1].startswith("Engine 001:") and "Running: 5 reqs" in lines[1]


# ---- LoggingStatLogger ---------------------------------------------------------------------------
def test_logging_line(caplog: pytest.LogCaptureFixture, clock: list[float]) -> None:
    clock[0] = 1000.0
    stat_logger = LoggingStatLogger()
    for scheduler_stats, it in two_requests_lifecycle()[:3]:
        stat_logger.record(scheduler_stats, it)
    clock[0] += 2.0
    with caplog.at_level(logging.INFO, logger="axon.metrics"):
        stat_logger.log()
    (record,) = caplog.records
    assert record.name == "axon.metrics" and record.levelno == logging.INFO
    assert record.getMessage() == (
        "Engine 000: Avg prompt throughput: 5.0 tokens/s, Avg generation throughput: 1.5 tokens/s, "
        "Running: 0 reqs, Waiting: 1 reqs, KV cache usage: 10.0%, Prefix cache hit rate: 0.0%"
    )


def test_logging_counts_only_since_the_last_line_and_skips_idle(
    caplog: pytest.LogCaptureFixture, clock: list[float]
) -> None:
    stat_logger = LoggingStatLogger()
    steps = two_requests_lifecycle()
    caplog.set_level(logging.INFO, logger="axon.metrics")
    for scheduler_stats, it in steps[:3]:
        stat_logger.record(scheduler_stats, it)
    clock[0] = 5.0
    stat_logger.log()
    for scheduler_stats, it in steps[3:]:
        stat_logger.record(scheduler_stats, it)
    clock[0] = 15.0
    stat_logger.log()
    clock[0] = 20.0
    stat_logger.log()  # nothing happened and nothing runs or waits: no line
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) == 2
    assert "Avg prompt throughput: 0.4 tokens/s, Avg generation throughput: 0.3 tokens/s" in messages[1]
    assert "Running: 0 reqs, Waiting: 0 reqs, KV cache usage: 0.0%" in messages[1]
    assert "Prefix cache hit rate: 21.4%" in messages[1]  # 3 hits of 14 queried tokens


def test_execution_metrics_from_scheduler_stats() -> None:
    from axon.scheduler_output import BucketStep, CompileEvent

    logger = PrometheusStatLogger(MODEL)
    first = SchedulerStats(
        bucket=BucketStep("prefill_s128", num_tokens=100, padded_tokens=128),
        compiles=[
            CompileEvent("tokens_128", 3.5, cache_hit=False),
            CompileEvent("tokens_8", 0.4, cache_hit=True),
        ],
        model_load_time_s=1.25,
        startup_time_s=2.5,
    )
    logger.record(first, None)
    for _ in range(3):
        logger.record(SchedulerStats(bucket=BucketStep("decode_b8", num_tokens=5, padded_tokens=8)), None)
    s = scrape(logger)
    assert value(s, "axon:bucket_execution_count_total", bucket_name="decode_b8") == 3
    assert value(s, "axon:bucket_execution_count_total", bucket_name="prefill_s128") == 1
    assert value(s, "axon:num_padding_tokens_total") == 28 + 3 * 3
    assert value(s, "axon:num_seqs_padding_count") == 3 and value(s, "axon:num_seqs_padding_sum") == 24
    assert value(s, "axon:num_seqs_padding_bucket", le="8.0") == 3
    assert value(s, "axon:num_seqs_padding_bucket", le="4.0") == 0
    assert value(s, "axon:num_batched_tokens_padding_sum") == 128
    assert value(s, "axon:compilation_time_seconds", bucket_name="tokens_128", cache="miss") == 3.5
    assert value(s, "axon:compilation_time_seconds", bucket_name="tokens_8", cache="hit") == 0.4
    assert value(s, "axon:model_load_time_seconds") == 1.25
    assert value(s, "axon:startup_time_seconds") == 2.5
