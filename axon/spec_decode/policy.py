"""How many tokens to draft per request in the next step (pure Python: the scheduler owns it).

On a CPU a decode step of a small batch reads every weight for a handful of tokens: verifying
k drafts costs little more than one token, so speculation pays. A large batch is already
compute-bound: every rejected draft is a row of wasted GEMM work, and speculation costs. The
policy (``adaptive``, on by default) drafts

    k = the largest j <= num_speculative_tokens whose expected gain pays for its rows:
        expected tokens per request  E(j) = 1 + a + a^2 + ... + a^j   (a: measured acceptance
                                                                      rate per draft position)
        relative step cost           C(j) = 1 + j * B / knee          (B: running requests)

and 0 when no j has E(j) / C(j) > 1. ``knee`` is the number of rows a step holds before it
stops being weight-bound (64 on the CPUs measured, see benchmarks/spec_decode.py); acceptance
is an exponential moving average over verified drafts, starting optimistic (0.7) and probed
again every ``probe_every`` steps while speculation is off, so a workload that turns
copy-heavy is noticed. ``adaptive: false`` always drafts num_speculative_tokens (vLLM's
behaviour); ``disable_by_batch_size`` (vLLM's key) drafts nothing while more requests run.
"""

from __future__ import annotations

from dataclasses import dataclass

from axon.spec_decode.config import SpecDecodeConfig

INITIAL_ACCEPTANCE = 0.7
EMA_WEIGHT = 0.1  # of each step's verified drafts
DEFAULT_KNEE = 64


@dataclass
class DraftPolicy:
    config: SpecDecodeConfig
    knee: int = DEFAULT_KNEE
    probe_every: int = 64
    acceptance: float = INITIAL_ACCEPTANCE
    _steps_off: int = 0

    def num_drafts(self, batch_size: int) -> int:
        """Drafts per request for a step of ``batch_size`` decoding requests."""
        k = self.config.num_speculative_tokens
        limit = self.config.disable_by_batch_size
        if batch_size == 0 or (limit is not None and batch_size > limit):
            return 0
        if not self.config.adaptive:
            return k
        best, best_gain = 0, 1.0
        expected = 1.0
        for j in range(1, k + 1):
            expected += self.acceptance**j
            gain = expected / (1.0 + j * batch_size / self.knee)
            if gain > best_gain:
                best, best_gain = j, gain
        if best == 0:
            self._steps_off += 1
            if self._steps_off >= self.probe_every:  # look again: acceptance may have changed
                self._steps_off = 0
                return 1
        return best

    def record(self, num_drafts: int, num_accepted: int) -> None:
        """One request's verification: ``num_accepted`` of its ``num_drafts`` drafts accepted."""
        if num_drafts == 0:
            return
        # The per-position rate a with a + a^2 + ... matching the accepted run: estimated from
        # the accepted share, weighted by how many drafts were checked.
        rate = num_accepted / num_drafts
        weight = min(1.0, EMA_WEIGHT * num_drafts)
        self.acceptance += weight * (rate - self.acceptance)
