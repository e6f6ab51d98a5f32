"""SamplingParams: vLLM's per-request generation options, validated where they are made.

Pure Python (no torch), so that the core and the process boundary can carry it.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from enum import IntEnum

from axon.structured_output.params import StructuredOutputsParams

__all__ = ["RequestOutputKind", "SamplingParams", "SamplingType", "StructuredOutputsParams"]

# Temperatures below this are treated as greedy (vLLM uses the same cut-off).
_GREEDY_EPS = 1e-5


class SamplingType(IntEnum):
    GREEDY = 0
    RANDOM = 1
    RANDOM_SEED = 2


@dataclass
class SamplingParams:
    """Generation options with vLLM's names and defaults.

    Invalid values raise ``ValueError`` naming the field, at construction time.
    """

    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: no top-k
    min_p: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    logit_bias: dict[int, float] | None = None
    detokenize: bool = True
    # JSON schema, regex, choice, grammar or structural tag the output must match.
    structured_outputs: StructuredOutputsParams | None = None
    # Filled by the input processor, not by users.
    all_stop_token_ids: set[int] = field(default_factory=set, repr=False)

    def __post_init__(self) -> None:
        if self.stop is None:
            self.stop = []
        elif isinstance(self.stop, str):
            self.stop = [self.stop]
        else:
            self.stop = list(self.stop)
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == -1:
            self.top_k = 0
        if self.logit_bias is not None:
            self.logit_bias = {int(k): float(v) for k, v in self.logit_bias.items()}
        self._validate()
        if self.temperature < _GREEDY_EPS:
            # Greedy: the random knobs no longer apply.
            self.top_p, self.top_k, self.min_p = 1.0, 0, 0.0
        self.all_stop_token_ids = set(self.stop_token_ids)

    def _validate(self) -> None:
        def bad(name: str, why: str) -> ValueError:
            return ValueError(f"{name} {why}, got {getattr(self, name)!r}.")

        if not isinstance(self.n, int) or self.n < 1:
            raise bad("n", "must be at least 1")
        if not -2.0 <= self.presence_penalty <= 2.0:
            raise bad("presence_penalty", "must be in [-2, 2]")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            raise bad("frequency_penalty", "must be in [-2, 2]")
        if not self.repetition_penalty > 0.0:
            raise bad("repetition_penalty", "must be greater than 0")
        if not self.temperature >= 0.0:
            raise bad("temperature", "must be non-negative")
        if not 0.0 < self.top_p <= 1.0:
            raise bad("top_p", "must be in (0, 1]")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise bad("top_k", "must be 0 or -1 (disabled) or a positive integer")
        if not 0.0 <= self.min_p <= 1.0:
            raise bad("min_p", "must be in [0, 1]")
        if self.max_tokens is not None and (not isinstance(self.max_tokens, int) or self.max_tokens < 1):
            raise bad("max_tokens", "must be at least 1")
        if not isinstance(self.min_tokens, int) or self.min_tokens < 0:
            raise bad("min_tokens", "must be non-negative")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise bad("min_tokens", f"must not exceed max_tokens ({self.max_tokens})")
        if self.logprobs is not None and self.logprobs < 0:
            raise bad("logprobs", "must be non-negative")
        if self.prompt_logprobs is not None and self.prompt_logprobs < 0:
            raise bad("prompt_logprobs", "must be non-negative")
        if self.seed is not None and not isinstance(self.seed, int):
            raise bad("seed", "must be an integer")
        if any(not s for s in self.stop):
            raise bad("stop", "must not contain empty strings")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            raise bad("stop_token_ids", "must be non-negative integers")
        so = self.structured_outputs
        if so is not None and not isinstance(so, StructuredOutputsParams):
            raise bad("structured_outputs", "must be a StructuredOutputsParams")

    @property
    def sampling_type(self) -> SamplingType:
        if self.temperature < _GREEDY_EPS:
            return SamplingType.GREEDY
        if self.seed is not None:
            return SamplingType.RANDOM_SEED
        return SamplingType.RANDOM

    def update_from_tokenizer(self, eos_token_id: int | None, vocab_size: int) -> None:
        """Resolve the stop-token set and check token ids against the vocabulary."""
        for name, ids in (
            ("stop_token_ids", self.stop_token_ids),
            ("logit_bias", list(self.logit_bias or {})),
        ):
            for tok in ids:
                if not 0 <= tok < vocab_size:
                    raise ValueError(
                        f"{name} holds token id {tok}, outside the vocabulary [0, {vocab_size})."
                    )
        self.all_stop_token_ids = set(self.stop_token_ids)
        if eos_token_id is not None and not self.ignore_eos:
            self.all_stop_token_ids.add(eos_token_id)

    def clone(self) -> SamplingParams:
        return copy.deepcopy(self)


class RequestOutputKind(IntEnum):
    CUMULATIVE = 0
    DELTA = 1
    FINAL_ONLY = 2
