"""Teacher-forced logits of an axon model, for validation against the oracle (transformers).

Runs the model on one sequence through the real paged-attention path, on a private KV cache
(the layers' own cache is restored afterwards), optionally in prefill segments so that the
cached-prefix branch of attention is exercised too. It drives a model as the runner does, so it
lives with the runner (debug/ is below model/ and may not import it).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from axon.forward_context import set_forward_context
from axon.model.layers.attention import Segment, describe_step


@torch.inference_mode()
def teacher_forced_logits(
    model: nn.Module,
    token_ids: list[int],
    block_size: int = 16,
    segment: int | None = None,
    positions: torch.Tensor | None = None,
    extra: Callable[[int, int], dict[str, Any]] | None = None,
) -> torch.Tensor:
    """[len(token_ids), vocab] float32 logits; ``segment`` splits the prefill into chunks.
    ``positions``: the sequence's positions ([L], or [3, L] for M-RoPE; default 0 .. L - 1);
    ``extra(start, end)``: more keyword arguments of the forward over tokens start .. end - 1
    (a multimodal model's image features)."""
    layers = model.attention_layers()
    arch = model.arch
    param = next(model.parameters())
    num_blocks = -(-len(token_ids) // block_size) + 1
    shape = (num_blocks, block_size, arch.num_kv_heads, arch.head_dim)
    saved = [(layer.layer_idx, layer.kv_cache) for layer in layers]
    for i, layer in enumerate(layers):
        layer.bind_kv_cache(
            i,
            (
                torch.zeros(shape, dtype=param.dtype, device=param.device),
                torch.zeros(shape, dtype=param.dtype, device=param.device),
            ),
        )
    # Blocks 1..n in reverse order, so that a wrong block-table lookup cannot pass by accident.
    block_ids = list(range(num_blocks - 1, 0, -1))
    step = segment or len(token_ids)
    out = []
    try:
        for start in range(0, len(token_ids), step):
            end = min(start + step, len(token_ids))
            step_positions = (
                torch.arange(start, end, device=param.device)
                if positions is None
                else positions[..., start:end]
            )
            metadata = describe_step([Segment(block_ids, start, end)], block_size, param.device)
            ids = torch.tensor(token_ids[start:end], device=param.device)
            with set_forward_context(metadata, layers):
                hidden = model(ids, step_positions, **(extra(start, end) if extra is not None else {}))
            out.append(model.compute_logits(hidden).float())
    finally:
        for layer, (idx, kv) in zip(layers, saved, strict=True):
            layer.layer_idx, layer.kv_cache = idx, kv
    return torch.cat(out)
