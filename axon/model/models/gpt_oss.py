"""GPT-OSS (``GptOssForCausalLM``, OpenAI's open-weight mixture-of-experts models).

A Llama-shaped decoder with its own parts:

- attention with biased q/k/v/o projections and **sinks** (a learned per-head logit that joins
  every softmax's denominator and attends to nothing), alternating ``sliding_attention`` layers
  (each query reads only the last ``sliding_window`` keys) and ``full_attention`` layers
  (``layer_types``), rotary embeddings with YaRN scaling;
- every MLP a mixture of experts (``axon/model/layers/moe.py``): a biased router whose k largest
  logits are softmaxed (``topk_softmax``), experts with biases and the clamped SwiGLU
  ``swigluoai`` (gate * sigmoid(alpha * gate) * (up + 1), gate and up clamped at ``swiglu_limit``).

Checkpoints: Hugging Face's names. The experts come stacked, ``mlp.experts.gate_up_proj``
[E, H, 2I] with gate and up interleaved column by column (gate = 0::2, up = 1::2) and
``down_proj`` [E, I, H] (both ``x @ W``), or quantized to MXFP4 (``*_blocks`` and ``*_scales``,
as OpenAI ships them), dequantized once at load (``axon/model/loader/mxfp4.py``); they load
into ``FusedMoE``'s [E, 2I (gate, up), H] and [E, H, I].
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from axon.distributed.parallel_state import tp_all_reduce
from axon.model.layers.attention import AttentionBackend
from axon.model.layers.moe import FusedMoE, MoeMath, expert_share
from axon.model.layers.norm import RMSNorm
from axon.model.layers.rotary import RotaryEmbedding
from axon.model.layers.tensor_parallel import (
    VocabParallelEmbedding,
)
from axon.model.loader.mxfp4 import dequantize_mxfp4
from axon.model.loader.safetensors_loader import LazyTensor
from axon.model.models.llama import (
    STACKED_PARAMS,
    DecoderArch,
    LlamaAttention,
    LlamaDecoderLayer,
    LlamaForCausalLM,
    LlamaModel,
)
from axon.model.models.weights import load_by_name

logger = logging.getLogger(__name__)

LAYER_TYPES = ("sliding_attention", "full_attention")


@dataclass(frozen=True)
class GptOssArch(DecoderArch):
    """Llama's decoder dimensions (every MLP sparse: ``sparse_layers`` all of them, each expert
    ``moe_intermediate_size`` wide) and GPT-OSS's own."""

    sliding_window: int = 128
    layer_types: tuple[str, ...] = ()
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0

    @staticmethod
    def from_hf(cfg: dict[str, Any]) -> GptOssArch:  # type: ignore[override]
        num_layers = cfg["num_hidden_layers"]
        layer_types = tuple(
            cfg.get("layer_types")
            or ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(num_layers)]
        )
        unknown = sorted(set(layer_types) - set(LAYER_TYPES))
        if len(layer_types) != num_layers or unknown:
            raise ValueError(
                f"layer_types must name {num_layers} layers, each one of {', '.join(LAYER_TYPES)}; got {list(layer_types)}"
            )
        # GPT-OSS's defaults where its config.json leaves them out.
        base = DecoderArch.from_hf(
            {"rms_norm_eps": 1e-5, "max_position_embeddings": 131072} | cfg, qkv_bias=True
        )
        return GptOssArch(
            **{f.name: getattr(base, f.name) for f in dataclasses.fields(DecoderArch)}
            | {
                "sparse_layers": frozenset(range(num_layers)),
                "num_experts": cfg.get("num_local_experts", cfg.get("num_experts", 0)),
                "num_experts_per_tok": cfg.get("num_experts_per_tok", cfg.get("experts_per_token", 4)),
                "moe_intermediate_size": cfg["intermediate_size"],
                "norm_topk_prob": False,  # its routing softmaxes the top k: nothing to renormalize
            },
            sliding_window=cfg.get("sliding_window") or 128,
            layer_types=layer_types,
            swiglu_alpha=float(cfg.get("swiglu_alpha", 1.702)),
            swiglu_limit=float(cfg.get("swiglu_limit", 7.0)),
        )


class GptOssAttention(LlamaAttention):
    """Llama's attention with biased q/k/v (``arch.qkv_bias``), sinks, the layer's sliding window
    if it is a ``sliding_attention`` layer, and o_proj's bias added once, after the all-reduce."""

    def __init__(
        self, arch: GptOssArch, rotary: RotaryEmbedding, backend: AttentionBackend, index: int
    ) -> None:
        window = arch.sliding_window if arch.layer_types[index] == "sliding_attention" else None
        super().__init__(arch, rotary, backend, sliding_window=window, sinks=True)
        self.o_bias = nn.Parameter(torch.empty(arch.hidden_size))  # the checkpoint's o_proj.bias

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return super().forward(positions, x) + self.o_bias


class GptOssMLP(nn.Module):
    """The router whole on every rank; this rank's experts (``expert_share``); one all-reduce."""

    def __init__(self, arch: GptOssArch) -> None:
        super().__init__()
        self.router = nn.Linear(arch.hidden_size, arch.num_experts, bias=True)
        math = MoeMath(
            arch.num_experts_per_tok,
            routing="topk_softmax",
            activation="swigluoai",
            alpha=arch.swiglu_alpha,
            limit=arch.swiglu_limit,
        )
        self.experts = FusedMoE(
            arch.num_experts,
            arch.hidden_size,
            math=math,
            bias=True,
            **expert_share(arch.num_experts, arch.moe_intermediate_size),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return tp_all_reduce(self.experts(x, self.router(x)))


class GptOssDecoderLayer(LlamaDecoderLayer):
    """Llama's layer (its forward: fused residual adds and norms) with GPT-OSS's parts."""

    def __init__(
        self, arch: GptOssArch, rotary: RotaryEmbedding, backend: AttentionBackend, index: int
    ) -> None:
        nn.Module.__init__(self)
        self.self_attn = GptOssAttention(arch, rotary, backend, index)
        self.mlp = GptOssMLP(arch)
        self.input_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)


class GptOssModel(LlamaModel):
    """Llama's decoder stack (its forward and the EAGLE3 auxiliary states) of GPT-OSS layers."""

    def __init__(self, arch: GptOssArch, backend: AttentionBackend) -> None:
        nn.Module.__init__(self)
        self.embed_tokens = VocabParallelEmbedding(arch.vocab_size, arch.hidden_size)
        rotary = RotaryEmbedding(arch.head_dim, arch.max_position, arch.rope_theta, arch.rope_scaling)
        self.layers = nn.ModuleList(
            GptOssDecoderLayer(arch, rotary, backend, i) for i in range(arch.num_layers)
        )
        self.norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)


class GptOssForCausalLM(LlamaForCausalLM):
    """forward(input_ids, positions) -> hidden states; compute_logits(hidden) -> [N, vocab];
    everything but the architecture and the checkpoint's names is LlamaForCausalLM's."""

    model_class = GptOssModel

    @classmethod
    def arch_from_hf(cls, hf_config: dict[str, Any]) -> GptOssArch:  # type: ignore[override]
        return GptOssArch.from_hf(hf_config)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Hugging Face's names; the stacked experts (plain or MXFP4) into ``FusedMoE``'s layout."""
        blocks = {name: m for name, m in self.named_modules() if isinstance(m, FusedMoE)}
        loaded: set[str] = set()
        pending: dict[str, dict[str, torch.Tensor]] = {}  # MXFP4 tensor -> its blocks and scales
        dequantized: list[str] = []  # the MXFP4 tensors read

        def load_experts(name: str, tensor: torch.Tensor) -> None:
            block_name, _, leaf = name.rpartition(".")
            block = blocks.get(block_name)
            target_name = _EXPERT_TARGETS.get(leaf)
            if block is None or target_name is None:
                raise ValueError(f"checkpoint tensor {name!r} has no parameter in {type(self).__name__}")
            e, h, i = block.num_experts, block.hidden_size, self.arch.moe_intermediate_size
            expected = {
                "gate_up_proj": (e, h, 2 * i),
                "gate_up_proj_bias": (e, 2 * i),
                "down_proj": (e, i, h),
                "down_proj_bias": (e, h),
            }[leaf]
            if tuple(tensor.shape) != expected:
                raise ValueError(
                    f"checkpoint tensor {name!r} has shape {tuple(tensor.shape)}, expected {expected}"
                )
            # This rank's experts, and its columns of their width (all of both on one rank).
            tensor = tensor.narrow(0, block.first_expert, block.num_local_experts)
            start, width = block.intermediate_start, block.intermediate_size
            if leaf.startswith("gate_up_proj"):  # columns interleave gate and up: gate first, then up
                gate, up = tensor[..., 0::2], tensor[..., 1::2]
                tensor = torch.cat([gate[..., start : start + width], up[..., start : start + width]], dim=-1)
            elif leaf == "down_proj":
                tensor = tensor.narrow(1, start, width)
            elif start > 0:  # down_proj_bias: added by the rank holding the first columns only
                tensor = torch.zeros_like(tensor)
            if leaf in ("gate_up_proj", "down_proj"):  # x @ W -> nn.Linear's [out, in]
                tensor = tensor.transpose(1, 2)
            if f"{block_name}.{target_name}" in loaded:
                raise ValueError(f"checkpoint tensor {name!r} is given twice")
            with torch.no_grad():
                getattr(block, target_name).copy_(tensor)
            loaded.add(f"{block_name}.{target_name}")

        def the_rest() -> Iterable[tuple[str, torch.Tensor]]:
            for name, tensor in weights:
                if ".mlp.experts." not in name:
                    name = name.replace(".self_attn.sinks", ".self_attn.attn.sinks")
                    yield name.replace(".self_attn.o_proj.bias", ".self_attn.o_bias"), tensor
                    continue
                tensor = tensor.read() if isinstance(tensor, LazyTensor) else tensor
                base, kind = _mxfp4_part(name)
                if kind is None:
                    load_experts(name, tensor)
                    continue
                parts = pending.setdefault(base, {})
                parts[kind] = tensor
                if len(parts) == 2:  # both halves seen: [E, out, in/32, 16] codes, [E, out, in/32] exponents
                    w = dequantize_mxfp4(
                        parts["blocks"], parts["scales"], self.model.embed_tokens.weight.dtype
                    )
                    load_experts(base, w.transpose(1, 2))  # [E, out, in] -> the checkpoint's x @ W layout
                    del pending[base]
                    dequantized.append(base)

        tied = self.arch.tie_word_embeddings

        def rename(name: str) -> str | None:
            if name == "lm_head.weight" and tied:
                return None
            return name

        experts = {f"{b}.{t}" for b in blocks for t in set(_EXPERT_TARGETS.values())}
        optional = experts | ({"lm_head.weight"} if tied else set())
        load_by_name(self, the_rest(), rename, frozenset(optional), STACKED_PARAMS)
        if dequantized:
            logger.info(
                "dequantized %d MXFP4 expert tensors to %s at load",
                len(dequantized),
                self.lm_head.weight.dtype,
            )
        if pending:
            name = next(iter(pending))
            missing = "scales" if "blocks" in pending[name] else "blocks"
            raise ValueError(f"checkpoint has {name}_{next(iter(pending[name]))} but no {name}_{missing}")
        missing = sorted(experts - loaded)
        if missing:
            raise ValueError(f"checkpoint lacks the experts' {missing[0]} (and {len(missing) - 1} more)")


# Hugging Face's stacked expert tensors -> FusedMoE's parameters.
_EXPERT_TARGETS = {
    "gate_up_proj": "w13_weight",
    "gate_up_proj_bias": "w13_bias",
    "down_proj": "w2_weight",
    "down_proj_bias": "w2_bias",
}


def _mxfp4_part(name: str) -> tuple[str, str | None]:
    """(``...gate_up_proj``, "blocks" | "scales") for an MXFP4 half; (name, None) otherwise."""
    for kind in ("blocks", "scales"):
        if name.endswith(f"_proj_{kind}"):
            return name[: -len(kind) - 1], kind
    return name, None
