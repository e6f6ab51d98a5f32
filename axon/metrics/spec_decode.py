"""Speculative decoding's metrics, as vLLM V1 reports them (``vllm/v1/spec_decode/metrics.py``).

The core counts verified drafts (``SchedulerStats.spec_decoding``: counts since its previous
report, None while speculation is off). From them:

  vllm:spec_decode_num_drafts                  counter of verifications (a request's drafts in a step)
  vllm:spec_decode_num_draft_tokens            counter of drafted tokens verified
  vllm:spec_decode_num_accepted_tokens         counter of drafted tokens accepted
  vllm:spec_decode_num_accepted_tokens_per_pos counter per draft position (label ``position``, 0-based)

exist on ``/metrics`` only when speculation is on, as in vLLM, and the periodic log gains vLLM's
"SpecDecoding metrics" line over the interval. As in vLLM, a position's acceptance rate is its
accepted count over all verifications, so with axon's adaptive draft length (which may draft
fewer than ``num_speculative_tokens``) a late position's rate also counts the steps that did
not draft it.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

from prometheus_client import CollectorRegistry, Counter

from axon.metrics.labels import per_engine
from axon.step_outputs import SpecDecodingStats

logger = logging.getLogger("axon.metrics")


class SpecDecodingProm:
    """vLLM's four spec-decode counters, labelled like the rest of the page, one series of each
    per engine (``labelvalues``: engine index -> its values of ``labelnames``)."""

    def __init__(
        self,
        registry: CollectorRegistry,
        labelnames: list[str],
        labelvalues: Mapping[int, list[str]],
        num_speculative_tokens: int,
    ) -> None:
        def counter(name: str, doc: str) -> dict[int, Counter]:
            return per_engine(Counter(name, doc, labelnames, registry=registry), labelvalues)

        self.num_drafts = counter("vllm:spec_decode_num_drafts", "Number of spec decoding drafts.")
        self.num_draft_tokens = counter("vllm:spec_decode_num_draft_tokens", "Number of draft tokens.")
        self.num_accepted_tokens = counter(
            "vllm:spec_decode_num_accepted_tokens", "Number of accepted tokens."
        )
        self._labelvalues = labelvalues
        self._per_pos = Counter(
            "vllm:spec_decode_num_accepted_tokens_per_pos",
            "Accepted tokens per draft position.",
            [*labelnames, "position"],
            registry=registry,
        )
        for engine_idx in labelvalues:
            for pos in range(num_speculative_tokens):  # present (at 0) from the first scrape
                self._position(pos, engine_idx)

    def _position(self, pos: int, engine_idx: int) -> Counter:
        return self._per_pos.labels(*self._labelvalues[engine_idx], str(pos))

    def record(self, stats: SpecDecodingStats, engine_idx: int = 0) -> None:
        self.num_drafts[engine_idx].inc(stats.num_drafts)
        self.num_draft_tokens[engine_idx].inc(stats.num_draft_tokens)
        self.num_accepted_tokens[engine_idx].inc(stats.num_accepted_tokens)
        for pos, n in enumerate(stats.num_accepted_tokens_per_pos):
            self._position(pos, engine_idx).inc(n)


class SpecDecodingLogging:
    """The core's reports summed over one log interval, and vLLM's line about them."""

    def __init__(self) -> None:
        self.interval = SpecDecodingStats()

    def observe(self, stats: SpecDecodingStats) -> None:
        self.interval.add(stats)

    def log(self, elapsed_s: float) -> None:
        """Log the interval's line (nothing when nothing was verified) and start a new one."""
        s, self.interval = self.interval, SpecDecodingStats()
        if s.num_drafts == 0:
            return
        rates = ", ".join(f"{n / s.num_drafts:.3f}" for n in s.num_accepted_tokens_per_pos)
        logger.info(
            "SpecDecoding metrics: Mean acceptance length: %.2f, Accepted throughput: %.2f tokens/s, "
            "Drafted throughput: %.2f tokens/s, Accepted: %d tokens, Drafted: %d tokens, "
            "Per-position acceptance rate: %s, Avg Draft acceptance rate: %.1f%%",
            1 + s.num_accepted_tokens / s.num_drafts,  # the bonus token counts, as in vLLM
            s.num_accepted_tokens / elapsed_s,
            s.num_draft_tokens / elapsed_s,
            s.num_accepted_tokens,
            s.num_draft_tokens,
            rates,
            100 * s.num_accepted_tokens / s.num_draft_tokens if s.num_draft_tokens else float("nan"),
        )
