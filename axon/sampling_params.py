"""SamplingParams: vLLM's per-request generation options, validated where they are made;
EngineSamplingParams: the engine's resolved record of them, the one that crosses into the core;
and StructuredOutputsParams (vLLM keeps it here too): what one request's output must match.
Exactly one constraint is set; ``kind_and_spec`` turns it into the (kind, spec text) pair that
names the compiled grammar in the cache.

Pure Python (no torch), so that the core and the process boundary can carry it.
"""

from __future__ import annotations

import copy
import enum
import json
import math
import numbers
from collections.abc import Callable
from dataclasses import dataclass
from enum import IntEnum
from typing import Any

import msgspec

__all__ = [
    "EngineSamplingParams",
    "RequestOutputKind",
    "SamplingParams",
    "SamplingType",
    "StructuredOutputsParams",
]


class GrammarKind(str, enum.Enum):
    JSON = "json"  # a JSON schema
    JSON_OBJECT = "json_object"  # any JSON object
    REGEX = "regex"
    CHOICE = "choice"
    GRAMMAR = "grammar"  # EBNF / GBNF
    STRUCTURAL_TAG = "structural_tag"


_CONSTRAINTS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")


@dataclass
class StructuredOutputsParams:
    """One of ``json`` (a schema, dict or JSON text), ``regex``, ``choice`` (a list of strings),
    ``grammar`` (EBNF), ``json_object`` (True) or ``structural_tag`` (JSON text).

    Whitespace between JSON tokens (the server-wide defaults come from
    ``--structured-outputs-config``): ``max_whitespace_cnt`` allows up to that many characters
    for this request (None: the server's bound); ``disable_any_whitespace`` allows only the
    single spaces of ", " and ": ".
    """

    json: str | dict[str, Any] | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: str | None = None
    disable_any_whitespace: bool = False
    max_whitespace_cnt: int | None = None
    # Accepted for vLLM compatibility; both are what axon does anyway (one backend, strict schemas).
    disable_fallback: bool = False
    disable_additional_properties: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.structural_tag, dict):
            self.structural_tag = json.dumps(self.structural_tag)
        if self.json_object is False:
            self.json_object = None
        given = [name for name in _CONSTRAINTS if getattr(self, name) is not None]
        if len(given) != 1:
            what = "none" if not given else ", ".join(given)
            raise ValueError(
                "structured_outputs must set exactly one of json, regex, choice, grammar, json_object, "
                f"structural_tag; got {what}"
            )
        if self.choice is not None and (not self.choice or not all(isinstance(c, str) for c in self.choice)):
            raise ValueError(
                f"structured_outputs.choice must be a non-empty list of strings, got {self.choice!r}"
            )
        if self.max_whitespace_cnt is not None:
            check_positive_int("structured_outputs.max_whitespace_cnt", self.max_whitespace_cnt)
        for name in ("regex", "grammar", "structural_tag"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value.strip()):
                raise ValueError(f"structured_outputs.{name} must be a non-empty string, got {value!r}")

    def kind_and_spec(self) -> tuple[GrammarKind, str]:
        """(kind, canonical spec text): equal specs share one compiled grammar."""
        if self.json is not None:
            schema = self.json if isinstance(self.json, str) else json.dumps(self.json)
            return GrammarKind.JSON, schema
        if self.json_object:
            return GrammarKind.JSON_OBJECT, ""
        if self.regex is not None:
            return GrammarKind.REGEX, self.regex
        if self.choice is not None:
            return GrammarKind.CHOICE, json.dumps(self.choice)
        if self.grammar is not None:
            return GrammarKind.GRAMMAR, self.grammar
        assert self.structural_tag is not None, "__post_init__ checks that one constraint is set"
        return GrammarKind.STRUCTURAL_TAG, self.structural_tag

    @classmethod
    def from_dict(cls, data: dict[str, Any], where: str = "structured_outputs") -> StructuredOutputsParams:
        """From a request's JSON; unknown keys are errors that name the key."""
        if not isinstance(data, dict):
            raise ValueError(f"{where} must be an object, got {data!r}")  # noqa: TRY004
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"{where} has unknown keys {unknown}; supported: {sorted(known)}")
        return cls(**data)


def check_positive_int(where: str, value: Any) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{where} must be a positive integer, got {value!r}")


def choice_as_ebnf(choices: list[str]) -> str:
    """``root ::= "a" | "b"``: each choice as an EBNF string literal (JSON escapes are EBNF's)."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


# Temperatures below this are treated as greedy (vLLM uses the same cut-off).
_GREEDY_EPS = 1e-5
# Integers cross the process boundary as msgpack int64; a seed may also use uint64's range,
# which is what torch.Generator.manual_seed accepts.
INT64_MIN, INT64_MAX, UINT64_MAX = -(2**63), 2**63 - 1, 2**64 - 1
# OpenAI's range for logit_bias values.
MAX_ABS_LOGIT_BIAS = 100.0


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
    # vLLM's extra arguments for connectors and plugins; axon reads "kv_transfer_params"
    # (disaggregated prefill/decode, axon/kv_transfer/).
    extra_args: dict[str, Any] | None = None

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
        for name in _FLOAT_FIELDS:  # numpy scalars pass validation; the engine's record wants floats
            setattr(self, name, float(getattr(self, name)))
        if self.temperature < _GREEDY_EPS:
            # Greedy: the random knobs no longer apply.
            self.top_p, self.top_k, self.min_p = 1.0, 0, 0.0

    def _validate(self) -> None:
        def bad(name: str, why: str) -> ValueError:
            return ValueError(f"{name} {why}, got {getattr(self, name)!r}.")

        self._validate_ranges(bad)
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
        if self.seed is not None and not (
            isinstance(self.seed, int) and INT64_MIN <= self.seed <= UINT64_MAX
        ):
            raise bad("seed", f"must be an integer in [{INT64_MIN}, {UINT64_MAX}]")
        if any(not s for s in self.stop):
            raise bad("stop", "must not contain empty strings")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            raise bad("stop_token_ids", "must be non-negative integers")
        for value in (self.logit_bias or {}).values():
            if not -MAX_ABS_LOGIT_BIAS <= value <= MAX_ABS_LOGIT_BIAS:  # NaN fails too
                raise bad(
                    "logit_bias", f"values must be in [-{MAX_ABS_LOGIT_BIAS:g}, {MAX_ABS_LOGIT_BIAS:g}]"
                )
        so = self.structured_outputs
        if so is not None and not isinstance(so, StructuredOutputsParams):
            raise bad("structured_outputs", "must be a StructuredOutputsParams")

    def _validate_ranges(self, bad: Callable[[str, str], ValueError]) -> None:
        """Floats are finite and integers fit int64 (msgpack's range), whatever the field."""
        for name in _FLOAT_FIELDS:
            value = getattr(self, name)
            if not isinstance(value, numbers.Real) or isinstance(value, bool) or not math.isfinite(value):
                raise bad(name, "must be a finite number")
        for name in _INT_FIELDS:
            value = getattr(self, name)
            if value is not None and isinstance(value, int) and not INT64_MIN <= value <= INT64_MAX:
                raise bad(name, f"must be in [{INT64_MIN}, {INT64_MAX}]")

    @property
    def sampling_type(self) -> SamplingType:
        return _sampling_type(self.temperature, self.seed)

    def for_engine(
        self, eos_token_id: int | None, vocab_size: int, default_max_tokens: int
    ) -> EngineSamplingParams:
        """The engine's record of these options (one sample), resolved against the model.

        Token ids are checked against the vocabulary; ``max_tokens`` falls back to
        ``default_max_tokens`` (what the context leaves); EOS joins the stop ids unless
        ``ignore_eos``. Raises ``ValueError`` naming the field.
        """
        assert self.stop_token_ids is not None, "__post_init__ makes it a list"
        for name, ids in (
            ("stop_token_ids", self.stop_token_ids),
            ("logit_bias", list(self.logit_bias or {})),
        ):
            for tok in ids:
                if not 0 <= tok < vocab_size:
                    raise ValueError(
                        f"{name} holds token id {tok}, outside the vocabulary [0, {vocab_size})."
                    )
        stop_ids = set(self.stop_token_ids)
        if eos_token_id is not None and not self.ignore_eos:
            stop_ids.add(eos_token_id)
        return EngineSamplingParams(
            max_tokens=self.max_tokens if self.max_tokens is not None else default_max_tokens,
            all_stop_token_ids=frozenset(stop_ids),
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            min_p=self.min_p,
            seed=self.seed,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            repetition_penalty=self.repetition_penalty,
            min_tokens=self.min_tokens,
            ignore_eos=self.ignore_eos,
            logprobs=self.logprobs,
            prompt_logprobs=self.prompt_logprobs,
            logit_bias=dict(self.logit_bias) if self.logit_bias else None,
            structured_outputs=copy.deepcopy(self.structured_outputs),
        )

    def clone(self) -> SamplingParams:
        return copy.deepcopy(self)


class RequestOutputKind(IntEnum):
    CUMULATIVE = 0
    DELTA = 1
    FINAL_ONLY = 2


_FLOAT_FIELDS = (
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "temperature",
    "top_p",
    "min_p",
)
_INT_FIELDS = ("n", "top_k", "max_tokens", "min_tokens", "logprobs", "prompt_logprobs")


def _sampling_type(temperature: float, seed: int | None) -> SamplingType:
    if temperature < _GREEDY_EPS:
        return SamplingType.GREEDY
    if seed is not None:
        return SamplingType.RANDOM_SEED
    return SamplingType.RANDOM


class EngineSamplingParams(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """What the engine (scheduler, worker, sampler, grammar manager) reads of one sample's options.

    Built by ``SamplingParams.for_engine`` in the front end from validated options, with what
    needs the model already resolved: ``max_tokens`` is filled and ``all_stop_token_ids`` holds
    EOS (unless ``ignore_eos``) and the user's stop ids. It crosses into the engine-core process
    inside ``EngineCoreRequest``. Invariant: a plain record with no ``__post_init__`` (msgspec
    re-runs that on decode), so decoding gives back exactly what was encoded and derives nothing.
    The front end keeps the user's ``SamplingParams`` (stop strings, detokenizing) for itself.
    """

    max_tokens: int
    all_stop_token_ids: frozenset[int]
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0: no top-k
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_tokens: int = 0
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    logit_bias: dict[int, float] | None = None
    # Its __post_init__ only normalizes user input idempotently, so its round trip is exact too.
    structured_outputs: StructuredOutputsParams | None = None

    @property
    def sampling_type(self) -> SamplingType:
        return _sampling_type(self.temperature, self.seed)
