"""The one channel from the model runner to the attention layers.

The runner describes its step (``CommonAttentionMetadata``) and runs a forward inside
``set_forward_context``, which has the layers' backend build its metadata for the step, once,
and hands it to the layers: they read it with ``get_forward_context()`` and find one another
by index (``attention_layers[layer_idx]``). It is reset in ``finally``, so a failed step never
leaks metadata into the next one, and model ``forward(input_ids, positions)`` stays clean. It is
per thread: a bucket compiling in the background runs its own (empty) forward beside the
serving one.
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
    attn_metadata: Any  # the backend's record of this step (``build_metadata``)
    attention_layers: Sequence[Any] = ()  # the model's attention layers, by layer index
    # Attention data parallelism: the step's rows this rank attends (its requests' tokens), which
    # ``attn_metadata`` describes alone; None: every row.
    attention_rows: Any = None
    # LoRA: the step's rows grouped by adapter slot (model/layers/lora.py: LoRASlots); None: none.
    lora_slots: Any = None


@contextmanager
def set_forward_context(
    common: Any, attention_layers: Sequence[Any] = (), attention_rows: Any = None, lora_slots: Any = None
) -> Iterator[Any]:
    """Run a forward over the step ``common`` describes (the rows ``attention_rows`` of it, if
    given); yields the backend's metadata."""
    backend = attention_layers[0].backend if attention_layers else None
    metadata = common if backend is None else backend.build_metadata(common)
    prev = getattr(_local, "context", None)
    _local.context = ForwardContext(metadata, attention_layers, attention_rows, lora_slots)
    try:
        if backend is not None:
            backend.begin_step(metadata, attention_layers)
        yield metadata
    finally:
        if backend is not None:
            backend.end_step()
        _local.context = prev


def get_forward_context() -> ForwardContext:
    context = getattr(_local, "context", None)
    assert context is not None, "attention layer called outside set_forward_context()"
    return context
