"""Llama-family decoders as embedders (Qwen3-Embedding style): the final normed hidden states of
the decoder in ``llama.py``, pooled by the ``PoolingRunner`` as an encoder's are (LAST by default).

The decoder's attention layers write and read a paged KV cache found through the forward context
(``axon/forward_context.py``). An embedding forward is one causal prefill of every sequence, so
each call builds a throw-away cache that holds exactly this batch, and the matching metadata:

    padded batch [B, L]  ->  tokens | seq0 | seq1 | ... |   (real tokens only, T in all)
    block 0 is the null block; seq i owns the next ceil(len_i / block_size) blocks
    one (k, v) cache of those blocks, shared by all layers (each overwrites it before reading)
    hidden [T, H]        ->  [B, L, H] again (padding rows zero), the poolers' layout

Parameter names are those of the ``*ForCausalLM`` checkpoints (``model.layers...``); a bare
decoder checkpoint (``layers...``, as Qwen3-Embedding ships) loads too, and ``lm_head`` is unused.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from axon.forward_context import set_forward_context
from axon.model.layers.attention import AttentionBackend, AttentionMetadata
from axon.model.models.llama import STACKED_PARAMS, DecoderArch, LlamaForCausalLM, LlamaModel
from axon.model.models.weights import load_by_name

_BLOCK_SIZE = 16


class DecoderEmbeddingModel(nn.Module):
    """forward(input_ids [B, L], attention_mask [B, L], right-padded) -> hidden [B, L, hidden]."""

    is_pooling_model = True
    default_pooling_type = "LAST"
    decoder_class: type[LlamaForCausalLM] = LlamaForCausalLM

    def __init__(self, hf_config: dict[str, Any], backend: AttentionBackend) -> None:
        super().__init__()
        assert backend is not None, "a decoder embedder needs an attention backend"
        d = self.decoder_class
        self.arch = DecoderArch.from_hf(hf_config, qkv_bias=d.qkv_bias, qk_norm=d.qk_norm)
        self.model = LlamaModel(self.arch, backend)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        keep = attention_mask.bool()  # [B, L]
        seq_lens = attention_mask.sum(1).tolist()
        flat_ids = input_ids[keep]  # [T], the sequences concatenated
        positions = (attention_mask.cumsum(1) - 1)[keep]  # [T]
        metadata = causal_prefill_metadata(seq_lens, _BLOCK_SIZE, input_ids.device)
        layers = [layer.self_attn.attn for layer in self.model.layers]
        num_blocks = int(metadata.block_table.max()) + 1
        weight = self.model.embed_tokens.weight
        shape = (num_blocks, _BLOCK_SIZE, self.arch.num_kv_heads, self.arch.head_dim)
        # One cache serves every layer: layers run in order, and each writes all T slots before
        # it reads them, so a layer never sees the previous layer's K/V (block 0, never read,
        # and the tails of last blocks past seq_len stay unread too).
        cache = (weight.new_empty(shape), weight.new_empty(shape))
        try:
            for i, attn in enumerate(layers):
                attn.bind_kv_cache(i, cache)
            with set_forward_context(metadata, layers):
                hidden = self.model(flat_ids, positions)  # [T, hidden]
        finally:
            for attn in layers:
                attn.kv_cache = None  # the cache lives for this forward only
        out = hidden.new_zeros((*input_ids.shape, hidden.shape[-1]))  # [B, L, hidden]
        out[keep] = hidden
        return out

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy checkpoint tensors by name; every parameter must be covered exactly once."""

        def rename(name: str) -> str | None:
            if "rotary_emb.inv_freq" in name or name.startswith("lm_head."):
                return None
            return name if name.startswith("model.") else "model." + name

        load_by_name(self, weights, rename, stacked=STACKED_PARAMS)


def causal_prefill_metadata(seq_lens: list[int], block_size: int, device: torch.device) -> AttentionMetadata:
    """Metadata of one step in which every sequence is a whole prefill, in fresh blocks 1, 2, ..."""
    num_blocks = [math.ceil(n / block_size) for n in seq_lens]
    block_table = torch.zeros((len(seq_lens), max(num_blocks)), dtype=torch.int64)  # [B, max_blocks]
    slots, query_start_loc, next_block = [], [0], 1
    for i, (n, k) in enumerate(zip(seq_lens, num_blocks, strict=True)):
        blocks = torch.arange(next_block, next_block + k, dtype=torch.int64)
        block_table[i, :k] = blocks
        offsets = torch.arange(n, dtype=torch.int64)
        slots.append(blocks[offsets // block_size] * block_size + offsets % block_size)
        query_start_loc.append(query_start_loc[-1] + n)
        next_block += k
    return AttentionMetadata(
        num_actual_tokens=query_start_loc[-1],
        slot_mapping=torch.cat(slots).to(device),
        query_start_loc=query_start_loc,
        seq_lens=list(seq_lens),
        block_table=block_table.to(device),
        block_size=block_size,
    )


@functools.cache
def as_embedding_model(decoder_class: type[LlamaForCausalLM]) -> type[DecoderEmbeddingModel]:
    """The embedding model of a Llama-family decoder class (vLLM's ``as_embedding_model``)."""
    assert issubclass(decoder_class, LlamaForCausalLM), (
        f"{decoder_class.__name__} has no embedding adapter (the runner check comes first)"
    )
    name = decoder_class.__name__.removesuffix("ForCausalLM") + "EmbeddingModel"
    return type(name, (DecoderEmbeddingModel,), {"decoder_class": decoder_class})
