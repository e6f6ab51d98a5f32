"""The one channel from the model runner to the attention layers.

The runner sets the step's attention metadata with ``set_forward_context`` around a forward;
layers read it with ``get_forward_context()``. It is reset in ``finally``, so a failed step
never leaks metadata into the next one, and model ``forward(input_ids, positions)`` stays clean.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

_forward_context: ForwardContext | None = None


@dataclass
class ForwardContext:
    attn_metadata: Any  # the backend's metadata record for this step


@contextmanager
def set_forward_context(attn_metadata: Any) -> Iterator[None]:
    global _forward_context
    prev = _forward_context
    _forward_context = ForwardContext(attn_metadata)
    try:
        yield
    finally:
        _forward_context = prev


def get_forward_context() -> ForwardContext:
    assert _forward_context is not None, "attention layer called outside set_forward_context()"
    return _forward_context
