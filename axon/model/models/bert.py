"""BERT encoders (all-MiniLM-L6-v2 and other sentence-transformers BERT models).

A bidirectional encoder needs no KV cache: one forward over the step's flat layout of whole
prompts (encoder-only attention layers: ``AttentionType.ENCODER_ONLY``) gives every token's
hidden state, which the runner's pooler (``axon/model/pooler.py``) reduces to one vector per
sequence. Everything but attention runs on the [T, hidden] tokens alone, with no padding between
sequences, and is compiled per bucket like a decoder (bias, GELU, residual and LayerNorm fused
around the GEMMs). Parameter names equal Hugging Face's ``BertModel``, so checkpoints load by
name (a ``bert.`` prefix, as in ``BertForMaskedLM`` checkpoints, is stripped).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from axon.model.layers.attention import AttentionBackend, AttentionType
from axon.model.layers.attention.layer import Attention
from axon.model.models.weights import load_by_name

_ACTIVATIONS = {"gelu": F.gelu, "relu": F.relu, "gelu_new": lambda x: F.gelu(x, approximate="tanh")}
# Checkpoint tensors an encoder without a classification head does not use.
_UNUSED_PREFIXES = ("pooler.", "cls.")


@dataclass(frozen=True)
class EncoderArch:
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    vocab_size: int
    max_position: int
    type_vocab_size: int
    layer_norm_eps: float
    hidden_act: str

    @staticmethod
    def from_hf(cfg: dict[str, Any]) -> EncoderArch:
        act = cfg.get("hidden_act", "gelu")
        if act not in _ACTIVATIONS:
            raise ValueError(
                f"hidden_act {act!r} is not supported by BertModel; expected one of {sorted(_ACTIVATIONS)}"
            )
        pos_type = cfg.get("position_embedding_type", "absolute")
        if pos_type != "absolute":
            raise ValueError(f"position_embedding_type {pos_type!r} is not supported; expected 'absolute'")
        return EncoderArch(
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=cfg["num_attention_heads"],
            vocab_size=cfg["vocab_size"],
            max_position=cfg.get("max_position_embeddings", 512),
            type_vocab_size=cfg.get("type_vocab_size", 2),
            layer_norm_eps=cfg.get("layer_norm_eps", 1e-12),
            hidden_act=act,
        )


class BertEmbeddings(nn.Module):
    def __init__(self, arch: EncoderArch) -> None:
        super().__init__()
        self.word_embeddings = nn.Embedding(arch.vocab_size, arch.hidden_size)
        self.position_embeddings = nn.Embedding(arch.max_position, arch.hidden_size)
        self.token_type_embeddings = nn.Embedding(arch.type_vocab_size, arch.hidden_size)
        self.LayerNorm = nn.LayerNorm(arch.hidden_size, eps=arch.layer_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        # input_ids, positions [T] -> [T, hidden]; every token has type 0 (single-segment input).
        x = self.word_embeddings(input_ids) + self.position_embeddings(positions)
        x = x + self.token_type_embeddings.weight[0]
        return self.LayerNorm(x)


class BertSelfAttention(nn.Module):
    def __init__(self, arch: EncoderArch, backend: AttentionBackend) -> None:
        super().__init__()
        h = arch.hidden_size
        self.num_heads, self.head_dim = arch.num_heads, h // arch.num_heads
        self.query = nn.Linear(h, h)
        self.key = nn.Linear(h, h)
        self.value = nn.Linear(h, h)
        self.attn = Attention(
            self.num_heads, self.num_heads, self.head_dim, backend, attn_type=AttentionType.ENCODER_ONLY
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x [T, hidden] -> [T, hidden]
        t = x.shape[0]

        def heads(proj: nn.Linear) -> torch.Tensor:
            return proj(x).view(t, self.num_heads, self.head_dim)  # [T, H, D]

        return self.attn(heads(self.query), heads(self.key), heads(self.value)).reshape(t, -1)


class BertAttention(nn.Module):
    def __init__(self, arch: EncoderArch, backend: AttentionBackend) -> None:
        super().__init__()
        self.self = BertSelfAttention(arch, backend)
        self.output = _DenseNorm(arch.hidden_size, arch.hidden_size, arch.layer_norm_eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.output(self.self(x), x)


class _DenseNorm(nn.Module):
    """Post-norm residual: LayerNorm(dense(h) + residual) (HF's BertSelfOutput / BertOutput)."""

    def __init__(self, in_size: int, out_size: int, eps: float) -> None:
        super().__init__()
        self.dense = nn.Linear(in_size, out_size)
        self.LayerNorm = nn.LayerNorm(out_size, eps=eps)

    def forward(self, h: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return self.LayerNorm(self.dense(h) + residual)


class BertIntermediate(nn.Module):
    def __init__(self, arch: EncoderArch) -> None:
        super().__init__()
        self.dense = nn.Linear(arch.hidden_size, arch.intermediate_size)
        self.act = _ACTIVATIONS[arch.hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(self.dense(x))


class BertLayer(nn.Module):
    def __init__(self, arch: EncoderArch, backend: AttentionBackend) -> None:
        super().__init__()
        self.attention = BertAttention(arch, backend)
        self.intermediate = BertIntermediate(arch)
        self.output = _DenseNorm(arch.intermediate_size, arch.hidden_size, arch.layer_norm_eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.attention(x)
        return self.output(self.intermediate(x), x)


class BertEncoder(nn.Module):
    def __init__(self, arch: EncoderArch, backend: AttentionBackend) -> None:
        super().__init__()
        self.layer = nn.ModuleList(BertLayer(arch, backend) for _ in range(arch.num_layers))


class BertModel(nn.Module):
    """forward(input_ids [T], positions [T]) -> last hidden states [T, hidden], over the step's
    whole prompts; a token attends only within its own sequence, so its output does not depend
    on what it is batched with."""

    is_pooling_model = True
    attention_type = AttentionType.ENCODER_ONLY.value

    def __init__(self, hf_config: dict[str, Any], backend: AttentionBackend) -> None:
        super().__init__()
        self.arch = EncoderArch.from_hf(hf_config)
        self.embeddings = BertEmbeddings(self.arch)
        self.encoder = BertEncoder(self.arch, backend)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        x = self.embeddings(input_ids, positions)
        for layer in self.encoder.layer:
            x = layer(x)
        return x

    def attention_layers(self) -> list[Attention]:
        return [layer.attention.self.attn for layer in self.encoder.layer]

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy checkpoint tensors by name; every parameter must be covered exactly once."""

        def rename(name: str) -> str | None:
            name = name.removeprefix("bert.")
            return None if name.endswith("position_ids") or name.startswith(_UNUSED_PREFIXES) else name

        load_by_name(self, weights, rename)
