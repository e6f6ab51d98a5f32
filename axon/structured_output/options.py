"""``--structured-outputs-config``: the JSON object, checked and typed once at the edge.

Pure Python, so that ``validate_config`` can call it without importing xgrammar.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from axon.sampling_params import StructuredOutputsParams, check_positive_int

# "auto" resolves to xgrammar, vLLM's default backend; the others vLLM knows are not built.
SUPPORTED_BACKENDS = ("auto", "xgrammar")
DEFAULT_MAX_WHITESPACE_CNT = 2


@dataclass(frozen=True)
class StructuredOutputsOptions:
    backend: str = "auto"
    # JSON grammars (json_schema, json_object, required and named tool calls) allow at most this
    # many whitespace characters between two JSON tokens; null: any number (xgrammar's own
    # default). Unbounded, a small model sampling at temperature > 0 can write newlines until
    # max_tokens (SmolLM2-135M did): benchmarks/structured_whitespace.py measured the choice.
    max_whitespace_cnt: int | None = DEFAULT_MAX_WHITESPACE_CNT
    # Stricter still (vLLM's name): only the single spaces of ", " and ": ", no newlines.
    disable_any_whitespace: bool = False
    disable_fallback: bool = False  # accepted for vLLM compatibility: there is one backend
    # Always so here: xgrammar compiles schemas in strict mode, which refuses properties a
    # schema does not name unless it says additionalProperties. Accepted for vLLM compatibility.
    disable_additional_properties: bool = False
    # Threads that compile grammars off the engine loop.
    num_compile_threads: int = 2
    # Compiled grammars kept by spec (least recently used dropped first).
    cache_size: int = 256

    @property
    def resolved_backend(self) -> str:
        return "xgrammar" if self.backend == "auto" else self.backend

    def whitespace(self, params: StructuredOutputsParams) -> Whitespace:
        """The whitespace a request's JSON grammar allows: its own settings over the server's."""
        if self.disable_any_whitespace or params.disable_any_whitespace:
            return Whitespace(any_whitespace=False, max_whitespace_cnt=None)
        if params.max_whitespace_cnt is not None:
            return Whitespace(any_whitespace=True, max_whitespace_cnt=params.max_whitespace_cnt)
        return Whitespace(any_whitespace=True, max_whitespace_cnt=self.max_whitespace_cnt)


@dataclass(frozen=True)
class Whitespace:
    """Between JSON tokens: up to ``max_whitespace_cnt`` of space, tab, CR, LF (None: any number),
    or, when ``any_whitespace`` is false, exactly the single spaces of ", " and ": "."""

    any_whitespace: bool
    max_whitespace_cnt: int | None


def parse_structured_outputs_config(raw: dict[str, Any] | None) -> StructuredOutputsOptions:
    """The config dict -> options; unknown keys and bad values raise ValueError naming them."""
    if raw is None:
        return StructuredOutputsOptions()
    if not isinstance(raw, dict):
        raise ValueError(f"structured_outputs_config must be a JSON object, got {raw!r}")  # noqa: TRY004
    known = {f.name: f for f in fields(StructuredOutputsOptions)}
    unknown = sorted(set(raw) - set(known))
    if unknown:
        raise ValueError(f"structured_outputs_config has unknown keys {unknown}; supported: {sorted(known)}")
    options = StructuredOutputsOptions(**raw)
    if options.backend not in SUPPORTED_BACKENDS:
        raise ValueError(
            f"structured_outputs_config.backend {options.backend!r} is not supported; "
            f"supported: {', '.join(SUPPORTED_BACKENDS)}"
        )
    for name in ("disable_any_whitespace", "disable_fallback", "disable_additional_properties"):
        if not isinstance(getattr(options, name), bool):
            raise ValueError(f"structured_outputs_config.{name} must be true or false, got {raw[name]!r}")  # noqa: TRY004
    for name in ("num_compile_threads", "cache_size"):
        check_positive_int(f"structured_outputs_config.{name}", getattr(options, name))
    if options.max_whitespace_cnt is not None:
        check_positive_int("structured_outputs_config.max_whitespace_cnt", options.max_whitespace_cnt)
    return options
