"""Paged attention in C++ for the CPU (``axon/csrc/cpu_attention.cpp``).

One kernel call per layer attends every request of a step, decodes and prefill segments
alike, reading K/V blocks in place through the block table: no gather, no mask, no grouping.
Each (request, KV head) is a work item whose rows are the query heads sharing that KV head, so
every K/V tile is read once for all of them; each row's scores, its softmax over the whole
row and its weighted values are summed in one order whatever the step holds (batch
invariance), in float32. It needs the kernels built by ``axon.platforms.cpu_kernels``;
``attention_backend="auto"`` falls back to ``cpu_paged`` where they cannot be built.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from axon.config import default_cache_root
from axon.model.layers.attention.backend import AttentionBackend, AttentionSpec, CommonAttentionMetadata
from axon.platforms.cpu_kernels import load_cpu_kernels

if TYPE_CHECKING:
    from axon.model.layers.attention.layer import Attention


@dataclass
class CpuFlashMetadata:
    common: CommonAttentionMetadata
    query_start_loc: torch.Tensor  # int32 copies of the lengths, as the kernels read them
    seq_lens: torch.Tensor


def _fused_layer_op(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_idx: int, scale: float
) -> torch.Tensor:
    """One layer of the step set by ``begin_step``: write k, v, attend. [T, H, D] out."""
    return torch.ops.axon_cpu.attention(q, k, v, layer_idx, scale)


def _sinks_f32(spec: AttentionSpec) -> torch.Tensor | None:
    """The spec's sinks as the kernels read them (a bound layer's are float32 already: no copy)."""
    return None if spec.sinks is None else spec.sinks.detach().float().contiguous()


class CpuFlashAttentionBackend(AttentionBackend):
    name = "cpu_flash"
    fused_layer_op = staticmethod(_fused_layer_op)
    supports_sliding_window = True
    supports_sinks = True
    supports_context_parallel = True

    def __init__(self, cache_root: str | None = None) -> None:
        if not load_cpu_kernels(cache_root or default_cache_root()):
            raise ValueError(
                "attention_backend 'cpu_flash' needs axon's C++ CPU kernels, which could not be built "
                "here (see the warning above); use 'cpu_paged'"
            )
        # Batch-invariant attention (a row's arithmetic never depends on its step's other rows):
        # on by default; AXON_BATCH_INVARIANT=0 lets decodes take the few-rows path instead.
        torch.ops.axon_cpu.set_batch_invariant(os.environ.get("AXON_BATCH_INVARIANT", "1") != "0")

    def build_metadata(self, common: CommonAttentionMetadata) -> CpuFlashMetadata:
        return CpuFlashMetadata(common, *common.length_tensors())

    def begin_step(self, metadata: CpuFlashMetadata, layers: Sequence[Attention]) -> None:
        """Hand the step's metadata and every decoder layer's cache to the kernels."""
        if not any(layer.is_decoder for layer in layers):
            return  # an encoder: its layers go through forward_encoder
        if any(layer.context_parallel for layer in layers):
            return  # decode context parallelism: its layers go through forward_partial
        assert [layer.layer_idx for layer in layers if layer.is_decoder] == list(range(len(layers))), (
            "the kernels address the caches of a model's decoder layers by layer index"
        )
        caches = [layer.kv_cache for layer in layers]
        assert all(c is not None for c in caches), "KV cache not bound to every attention layer"
        common = metadata.common
        torch.ops.axon_cpu.set_attention_step(
            [c[0] for c in caches],
            [c[1] for c in caches],
            common.slot_mapping,
            common.block_table,
            metadata.query_start_loc,
            metadata.seq_lens,
            common.num_actual_tokens,
            layers[0].kv_scales,
            *self._layer_extras(layers),
            common.window_slot_mapping,
            common.window_block_table,
        )

    def _layer_extras(self, layers: Sequence[Attention]) -> tuple[list[int], list[torch.Tensor]]:
        """Each layer's sliding window (0: none) and float32 sinks (empty: none), or two empty
        lists when no layer has either (the kernels' plain path)."""
        specs = [layer.spec for layer in layers]
        if all(s.sliding_window is None and s.sinks is None for s in specs):
            return [], []
        empty = torch.empty(0)
        windows = [s.sliding_window or 0 for s in specs]
        return windows, [empty if s.sinks is None else _sinks_f32(s) for s in specs]

    def end_step(self) -> None:
        torch.ops.axon_cpu.clear_attention_step()

    def forward_encoder(
        self,
        q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        v: torch.Tensor,
        metadata: CpuFlashMetadata,
        spec: AttentionSpec,
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]; padding rows are zeros
        """The paged kernels over the step's own k and v, every query reading its whole
        sequence: no padding to the longest sequence, no mask."""
        return torch.ops.axon_cpu.encoder_attention(q, k, v, metadata.query_start_loc, spec.scale)

    def forward(
        self,
        q: torch.Tensor,  # [num_tokens, num_heads, head_dim], num_tokens >= num_actual_tokens
        k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
        v_cache: torch.Tensor,
        metadata: CpuFlashMetadata,
        spec: AttentionSpec,
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]; padding rows are zeros
        return torch.ops.axon_cpu.paged_attention(
            *_paged_args(q, k_cache, v_cache, metadata),
            spec.scale,
            spec.sliding_window or 0,
            _sinks_f32(spec),
        )

    def write_kv(
        self,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        metadata: CpuFlashMetadata,
    ) -> None:
        torch.ops.axon_cpu.write_kv(k, v, k_cache, v_cache, metadata.common.slot_mapping)

    def forward_partial(
        self,
        q: torch.Tensor,  # [num_tokens, heads, head_dim]
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        metadata: CpuFlashMetadata,
        spec: AttentionSpec,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        common = metadata.common
        return torch.ops.axon_cpu.paged_attention_partial(
            *_paged_args(q, k_cache, v_cache, metadata), spec.scale, common.dcp_world, common.dcp_rank
        )


def _paged_args(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, metadata: CpuFlashMetadata):
    """What every paged kernel takes first: the step's queries, the caches and the step."""
    common = metadata.common
    return (
        q.contiguous(),
        k_cache,
        v_cache,
        common.block_table,
        metadata.query_start_loc,
        metadata.seq_lens,
        common.num_actual_tokens,
    )
