"""The one channel from the model runner to the attention layers.

The runner sets the step's attention metadata with ``set_forward_context`` around a forward;
layers read it with ``get_forward_context()``. It is reset in ``finally``, so a failed step
never leaks metadata into the next one, and model ``forward(input_ids, positions)`` stays clean.
It is per thread: a bucket compiling in the background runs its own (empty) forward beside
the serving one.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

_local = threading.local()


@dataclass
class ForwardContext:
    attn_metadata: Any  # the backend's metadata record for this step
    # The model's attention layers in call order: inside a compiled graph the attention op
    # cannot name its layer (a per-layer constant would make every layer its own graph), so
    # each call takes the next one.
    attention_layers: Sequence[Any] = ()
    num_attention_calls: int = 0

    def next_attention_layer(self) -> Any:
        assert self.num_attention_calls < len(self.attention_layers), (
            f"attention op called {self.num_attention_calls + 1} times in one forward, "
            f"but the model has {len(self.attention_layers)} attention layers"
        )
        layer = self.attention_layers[self.num_attention_calls]
        self.num_attention_calls += 1
        return layer


@contextmanager
def set_forward_context(attn_metadata: Any, attention_layers: Sequence[Any] = ()) -> Iterator[None]:
    """Also hands the step to the layers' backend when it keeps one of its own (``begin_step``,
    ``end_step``: the C++ kernels read their step in C++)."""
    prev = getattr(_local, "context", None)
    _local.context = ForwardContext(attn_metadata, attention_layers)
    backend = attention_layers[0].backend if attention_layers else None
    begin_step = getattr(backend, "begin_step", None)
    try:
        if begin_step is not None:
            begin_step(attn_metadata, attention_layers)
        yield
    finally:
        if begin_step is not None:
            backend.end_step()
        _local.context = prev


def get_forward_context() -> ForwardContext:
    context = getattr(_local, "context", None)
    assert context is not None, "attention layer called outside set_forward_context()"
    return context
