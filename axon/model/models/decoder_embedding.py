"""Llama-family decoders as embedders (Qwen3-Embedding style): the final normed hidden states of
the decoder in ``llama.py``, pooled by the model runner's pooler (LAST by default).

It runs as generation does: causal attention over the paged KV cache, through the worker's
attention backend, buckets and compiled graphs; only the LM head is gone. A long prompt is
prefilled in segments like any other; the runner keeps the segments' hidden states for pooling.

Parameter names are those of the ``*ForCausalLM`` checkpoints (``model.layers...``); a bare
decoder checkpoint (``layers...``, as Qwen3-Embedding ships) loads too, and ``lm_head`` is unused.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from axon.model.layers.attention import AttentionBackend
from axon.model.layers.attention.layer import Attention
from axon.model.models.llama import STACKED_PARAMS, DecoderArch, LlamaForCausalLM, LlamaModel
from axon.model.models.weights import load_by_name


class DecoderEmbeddingModel(nn.Module):
    """forward(input_ids [T], positions [T]) -> final normed hidden states [T, hidden]."""

    is_pooling_model = True
    default_pooling_type = "LAST"
    decoder_class: type[LlamaForCausalLM] = LlamaForCausalLM

    def __init__(self, hf_config: dict[str, Any], backend: AttentionBackend) -> None:
        super().__init__()
        assert backend is not None, "a decoder embedder needs an attention backend"
        d = self.decoder_class
        self.arch = DecoderArch.from_hf(hf_config, qkv_bias=d.qkv_bias, qk_norm=d.qk_norm)
        self.model = LlamaModel(self.arch, backend)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids, positions)

    def attention_layers(self) -> list[Attention]:
        return [layer.self_attn.attn for layer in self.model.layers]

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy checkpoint tensors by name; every parameter must be covered exactly once."""

        def rename(name: str) -> str | None:
            if "rotary_emb.inv_freq" in name or name.startswith("lm_head."):
                return None
            return name if name.startswith("model.") else "model." + name

        load_by_name(self, weights, rename, stacked=STACKED_PARAMS)


@functools.cache
def as_embedding_model(decoder_class: type[LlamaForCausalLM]) -> type[DecoderEmbeddingModel]:
    """The embedding model of a Llama-family decoder class (vLLM's ``as_embedding_model``)."""
    assert issubclass(decoder_class, LlamaForCausalLM), (
        f"{decoder_class.__name__} has no embedding adapter (the runner check comes first)"
    )
    name = decoder_class.__name__.removesuffix("ForCausalLM") + "EmbeddingModel"
    return type(name, (DecoderEmbeddingModel,), {"decoder_class": decoder_class})
