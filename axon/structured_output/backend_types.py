"""The grammar-backend interface (vLLM's): a backend compiles specs, a grammar follows one request.

A backend is chosen by name from ``BACKENDS``; a new one (llguidance, outlines) implements
these two classes and registers itself there.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

from axon.sampling_params import GrammarKind
from axon.structured_output.options import Whitespace


class StructuredOutputGrammar(ABC):
    """One request's matcher: where it is in its grammar, and what may come next."""

    @abstractmethod
    def accept_tokens(self, req_id: str, tokens: list[int]) -> bool:
        """Advance over ``tokens``; False (state unchanged past the bad token) if one is rejected."""

    @abstractmethod
    def validate_tokens(self, tokens: list[int]) -> list[int]:
        """The longest prefix of ``tokens`` the grammar accepts, without advancing (drafts)."""

    @abstractmethod
    def rollback(self, num_tokens: int) -> None:
        """Undo the last ``num_tokens`` accepted tokens (rejected speculative tokens)."""

    @abstractmethod
    def fill_bitmask(self, bitmask: Any, index: int) -> None:
        """Write the allowed next tokens into row ``index`` of the packed int32 ``bitmask``."""

    @abstractmethod
    def is_terminated(self) -> bool:
        """The grammar has accepted its end (the stop token): the request is complete."""

    @abstractmethod
    def reset(self) -> None:
        """Back to the start state."""


class StructuredOutputBackend(ABC):
    """Compiles grammar specs for one tokenizer and vocabulary."""

    vocab_size: int

    @abstractmethod
    def compile(self, kind: GrammarKind, spec: str, whitespace: Whitespace) -> Any:
        """A compiled grammar (shared between requests with the same spec). Raises ValueError.
        ``whitespace`` applies to JSON grammars (schemas and any-object)."""

    @abstractmethod
    def matcher(self, compiled: Any, max_rollback_tokens: int) -> StructuredOutputGrammar:
        """A fresh per-request grammar state over ``compiled``."""

    @abstractmethod
    def allocate_bitmask(self, num_rows: int) -> Any:
        """A packed int32 bitmask [num_rows, ceil(vocab_size / 32)], every token allowed."""
