"""``--structured-outputs-config``: the JSON object, checked and typed once at the edge.

Pure Python, so that ``validate_config`` can call it without importing xgrammar.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

# "auto" resolves to xgrammar, vLLM's default backend; the others vLLM knows are not built.
SUPPORTED_BACKENDS = ("auto", "xgrammar")


@dataclass(frozen=True)
class StructuredOutputsOptions:
    backend: str = "auto"
    # Forbid whitespace between JSON tokens (vLLM's name). Small models given free whitespace
    # can emit newlines until max_tokens; this closes that door for every request.
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
        value = getattr(options, name)
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"structured_outputs_config.{name} must be a positive integer, got {value!r}")
    return options
