"""Speculative decoding's metrics: the core's per-report counts summed in the front end (across
the msgspec boundary) into vLLM's Prometheus counters and its periodic "SpecDecoding metrics"
line, checked by their invariants over random verifications and by exact values."""

from __future__ import annotations

import itertools
import logging

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_prometheus import MODEL, scrape, value

from axon.metrics.loggers import LoggingStatLogger
from axon.metrics.prometheus import PrometheusStatLogger
from axon.step_outputs import SchedulerStats, SpecDecodingStats

K = 4
SPEC_COUNTERS = (
    "vllm:spec_decode_num_drafts_total",
    "vllm:spec_decode_num_draft_tokens_total",
    "vllm:spec_decode_num_accepted_tokens_total",
)

# One verification: (drafts verified, of which accepted); the draft length varies per step as
# the adaptive policy's does. A True between them is the core sending a report.
verification = st.integers(1, K).flatmap(lambda n: st.tuples(st.just(n), st.integers(0, n)))
events = st.lists(st.one_of(verification, st.just(True)), max_size=60)


def reports(steps: list) -> tuple[list[SchedulerStats], SpecDecodingStats]:
    """The core's reports, each through the wire as ``SchedulerStats``, and the running total."""
    since_report, totals, out = SpecDecodingStats(), SpecDecodingStats(), []
    for event in [*steps, True]:
        if event is True:
            wire = msgspec.msgpack.encode(SchedulerStats(spec_decoding=since_report.take()))
            out.append(msgspec.msgpack.decode(wire, type=SchedulerStats))
        else:
            since_report.observe(*event)
            totals.observe(*event)
    return out, totals


def check_invariants(s: SpecDecodingStats) -> None:
    per_pos = s.num_accepted_tokens_per_pos
    assert s.num_accepted_tokens <= s.num_draft_tokens <= K * s.num_drafts
    assert sum(per_pos) == s.num_accepted_tokens  # each accepted draft sits at one position
    assert all(a >= b for a, b in itertools.pairwise(per_pos)), f"{per_pos} increases"
    assert not per_pos or per_pos[0] <= s.num_drafts
    assert len(per_pos) <= K


@settings(max_examples=200, deadline=None)
@given(steps=events)
def test_reports_add_up_to_the_totals(steps: list) -> None:
    sent, totals = reports(steps)
    check_invariants(totals)
    summed = SpecDecodingStats()
    for stats in sent:
        assert stats.spec_decoding is not None
        check_invariants(stats.spec_decoding)
        summed.add(stats.spec_decoding)
    check_invariants(summed)
    assert (summed.num_drafts, summed.num_draft_tokens, summed.num_accepted_tokens) == (
        totals.num_drafts,
        totals.num_draft_tokens,
        totals.num_accepted_tokens,
    )
    assert summed.num_accepted_tokens_per_pos == totals.num_accepted_tokens_per_pos

    prom = PrometheusStatLogger(MODEL, num_speculative_tokens=K)
    for stats in sent:
        prom.record(stats, None)
    s = scrape(prom)
    assert value(s, "vllm:spec_decode_num_drafts_total") == totals.num_drafts
    assert value(s, "vllm:spec_decode_num_draft_tokens_total") == totals.num_draft_tokens
    assert value(s, "vllm:spec_decode_num_accepted_tokens_total") == totals.num_accepted_tokens
    per_pos = [
        value(s, "vllm:spec_decode_num_accepted_tokens_per_pos_total", position=str(i)) for i in range(K)
    ]
    padded = totals.num_accepted_tokens_per_pos + [0] * (K - len(totals.num_accepted_tokens_per_pos))
    assert per_pos == padded


def test_take_starts_afresh_without_sharing_lists() -> None:
    stats = SpecDecodingStats()
    stats.observe(3, 2)
    taken = stats.take()
    stats.observe(2, 1)
    assert taken.num_accepted_tokens_per_pos == [1, 1, 0]
    assert (stats.num_drafts, stats.num_accepted_tokens_per_pos) == (1, [1, 0])


def test_counters_only_when_speculation_is_on() -> None:
    off = PrometheusStatLogger(MODEL)
    stray = SpecDecodingStats()
    stray.observe(2, 1)
    off.record(SchedulerStats(spec_decoding=stray), None)
    assert not any(name.startswith("vllm:spec_decode") for name, _ in scrape(off))
    on = scrape(PrometheusStatLogger(MODEL, num_speculative_tokens=3))
    for name in SPEC_COUNTERS:
        assert value(on, name) == 0  # present before the first draft, as in vLLM
    for pos in range(3):
        assert value(on, "vllm:spec_decode_num_accepted_tokens_per_pos_total", position=str(pos)) == 0


def test_logging_line_over_the_interval(caplog: pytest.LogCaptureFixture, clock: list[float]) -> None:
    stat_logger = LoggingStatLogger()
    caplog.set_level(logging.INFO, logger="axon.metrics")
    first, second = SpecDecodingStats(), SpecDecodingStats()
    first.observe(3, 3)
    first.observe(3, 1)
    second.observe(2, 0)
    second.observe(3, 2)
    for spec in (first, second):
        stat_logger.record(SchedulerStats(num_running_reqs=1, spec_decoding=spec), None)
    clock[0] = 10.0
    stat_logger.log()
    stat_logger.record(SchedulerStats(num_running_reqs=1, spec_decoding=SpecDecodingStats()), None)
    clock[0] = 20.0
    stat_logger.log()  # nothing verified since the last line: no spec line
    spec_lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("SpecDecoding")]
    assert spec_lines == [
        (
            "SpecDecoding metrics: Mean acceptance length: 2.50, Accepted throughput: 0.60 tokens/s, "
            "Drafted throughput: 1.10 tokens/s, Accepted: 6 tokens, Drafted: 11 tokens, "
            "Per-position acceptance rate: 0.750, 0.500, 0.250, Avg Draft acceptance rate: 54.5%"
        )
    ]
