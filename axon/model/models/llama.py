"""The Llama family: Llama (incl. Llama 3 rope scaling, tied embeddings), Mistral, Qwen2
(q/k/v bias), Qwen3 (per-head q/k RMSNorm) and Qwen3-MoE (Qwen3 with sparse MLP blocks). One
decoder, configured by ``DecoderArch``.

Parameter names equal Hugging Face's, so checkpoints load by name, except that q/k/v and
gate/up are merged into one GEMM each (``STACKED_PARAMS``), as vLLM does.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from axon.distributed.parallel_state import get_tp_group, tp_all_reduce
from axon.forward_context import get_forward_context
from axon.model.layers.attention import AttentionBackend
from axon.model.layers.attention.layer import Attention
from axon.model.layers.linear import MergedLinear
from axon.model.layers.moe import FusedMoE, MoeMath, expert_share
from axon.model.layers.norm import RMSNorm
from axon.model.layers.rotary import RotaryEmbedding, rope_parameters
from axon.model.layers.tensor_parallel import (
    VocabParallelEmbedding,
    gather_logits,
    kv_heads,
    padded_vocab_share,
    set_shard,
    split,
)
from axon.model.loader.safetensors_loader import LazyTensor
from axon.model.models.weights import load_by_name
from axon.platforms.cpu_kernels import use_cpu_kernels


@dataclass(frozen=True)
class DecoderArch:
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any]
    max_position: int
    tie_word_embeddings: bool
    qkv_bias: bool
    qk_norm: bool
    # Mixture of experts: the layers whose MLP is a sparse block of num_experts experts
    # (moe_intermediate_size each), num_experts_per_tok of them per token.
    sparse_layers: frozenset[int] = frozenset()
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True

    @staticmethod
    def from_hf(cfg: dict[str, Any], qkv_bias: bool | None = None, qk_norm: bool = False) -> DecoderArch:
        act = cfg.get("hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"hidden_act {act!r} is not supported by the Llama family; expected 'silu'")
        num_heads = cfg["num_attention_heads"]
        theta, scaling = rope_parameters(cfg)
        return DecoderArch(
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=cfg.get("num_key_value_heads") or num_heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // num_heads,
            vocab_size=cfg["vocab_size"],
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=theta,
            rope_scaling=scaling,
            max_position=cfg.get("max_position_embeddings", 2048),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=bool(cfg.get("attention_bias", False)) if qkv_bias is None else qkv_bias,
            qk_norm=qk_norm,
        )


class LlamaAttention(nn.Module):
    """Under tensor parallelism: this rank's query and KV heads (axon/model/layers/tensor_parallel.py)
    and their sinks, o_proj's matching input columns, and one all-reduce of its output. A layer
    may read only the last ``sliding_window`` keys and have attention sinks (GPT-OSS)."""

    def __init__(
        self,
        arch: DecoderArch,
        rotary: RotaryEmbedding,
        backend: AttentionBackend,
        sliding_window: int | None = None,
        sinks: bool = False,
    ) -> None:
        super().__init__()
        h, d = arch.hidden_size, arch.head_dim
        # Attention data parallelism: every head on every rank, each attending its own requests.
        self.data_parallel = get_tp_group().attention_dp
        if self.data_parallel:
            first_q, self.num_heads, first_kv, self.num_kv_heads = 0, arch.num_heads, 0, arch.num_kv_heads
        else:
            first_q, self.num_heads = split(arch.num_heads, "number of attention heads")
            first_kv, self.num_kv_heads = kv_heads(arch.num_kv_heads, arch.num_heads)
        self.head_dim = d
        self.qkv_sizes = (self.num_heads * d, self.num_kv_heads * d, self.num_kv_heads * d)
        self.qkv_proj = MergedLinear(h, self.qkv_sizes, bias=arch.qkv_bias)
        self.o_proj = nn.Linear(self.num_heads * d, h, bias=False)
        if not self.data_parallel:
            starts = (first_q * d, first_kv * d, first_kv * d)
            set_shard(self.qkv_proj, "weight", 0, starts)
            set_shard(self.qkv_proj, "bias", 0, starts)
            set_shard(self.o_proj, "weight", 1, (first_q * d,))
        if arch.qk_norm:
            self.q_norm = RMSNorm(d, arch.rms_norm_eps)
            self.k_norm = RMSNorm(d, arch.rms_norm_eps)
        self.qk_norm = arch.qk_norm
        self.rotary = rotary
        self.attn = Attention(
            self.num_heads,
            self.num_kv_heads,
            d,
            backend,
            sliding_window=sliding_window,
            sinks=torch.empty(self.num_heads) if sinks else None,
        )
        if sinks and not self.data_parallel:
            set_shard(self.attn, "sinks", 0, (first_q,))

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        # x [T, hidden] -> [T, hidden]
        if self.data_parallel:
            # This rank's requests' rows only; the others' come from their ranks through the
            # all-reduce, which sums disjoint rows.
            rows = get_forward_context().attention_rows
            out = self._attend(positions[rows], x[rows])
            return tp_all_reduce(out.new_zeros(x.shape[0], out.shape[1]).index_copy_(0, rows, out))
        return tp_all_reduce(self._attend(positions, x))

    def _attend(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        t = x.shape[0]
        q, k, v = self.qkv_proj(x).split(self.qkv_sizes, dim=-1)
        q = q.view(t, self.num_heads, self.head_dim)
        k = k.view(t, self.num_kv_heads, self.head_dim)
        v = v.view(t, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.rotary(positions, q, k)
        out = self.attn(q, k, v)  # [T, H, D]
        return self.o_proj(out.reshape(t, self.num_heads * self.head_dim))


class SparseMoeBlock(nn.Module):
    """A mixture-of-experts MLP (Qwen3-MoE's): the router ``gate`` (whole on every rank) and the
    experts. Under tensor parallelism each rank holds 1/N of every expert's width, or with
    expert parallelism 1/N of the experts, whole; one all-reduce sums the ranks' outputs."""

    def __init__(self, arch: DecoderArch) -> None:
        super().__init__()
        self.gate = nn.Linear(arch.hidden_size, arch.num_experts, bias=False)
        self.experts = FusedMoE(
            arch.num_experts,
            arch.hidden_size,
            math=MoeMath(arch.num_experts_per_tok, renormalize=arch.norm_topk_prob),
            **expert_share(arch.num_experts, arch.moe_intermediate_size),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return tp_all_reduce(self.experts(x, self.gate(x)))


class LlamaMLP(nn.Module):
    """Under tensor parallelism: this rank's columns of gate/up, down_proj's matching rows, and
    one all-reduce of its output."""

    def __init__(self, arch: DecoderArch) -> None:
        super().__init__()
        first, width = split(arch.intermediate_size, "intermediate_size")
        self.gate_up_proj = MergedLinear(arch.hidden_size, (width, width), bias=False)
        set_shard(self.gate_up_proj, "weight", 0, (first, first))
        self.down_proj = nn.Linear(width, arch.hidden_size, bias=False)
        set_shard(self.down_proj, "weight", 1, (first,))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        if use_cpu_kernels(gate_up):
            return tp_all_reduce(self.down_proj(torch.ops.axon_cpu.silu_and_mul(gate_up)))
        gate, up = gate_up.chunk(2, dim=-1)
        return tp_all_reduce(self.down_proj(F.silu(gate) * up))


# Checkpoint layers that load into a merged one: name -> (merged layer, shard).
STACKED_PARAMS = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}


class LlamaDecoderLayer(nn.Module):
    def __init__(
        self, arch: DecoderArch, rotary: RotaryEmbedding, backend: AttentionBackend, index: int = 0
    ) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(arch, rotary, backend)
        self.mlp = SparseMoeBlock(arch) if index in arch.sparse_layers else LlamaMLP(arch)
        self.input_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)

    def forward(
        self, positions: torch.Tensor, x: torch.Tensor, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # The residual stream is carried beside each sublayer's output and added inside the
        # next norm (vLLM's layout): x + residual, then its norm, in one fused op.
        if residual is None:
            h, residual = self.input_layernorm(x), x
        else:
            h, residual = self.input_layernorm(x, residual)
        h, residual = self.post_attention_layernorm(self.self_attn(positions, h), residual)
        return self.mlp(h), residual


def default_aux_layers(num_layers: int) -> tuple[int, ...]:
    """vLLM's EAGLE3 layers when a head names none: an early, the middle and a late layer."""
    return (2, num_layers // 2, num_layers - 3)


@dataclass
class EmbedRows:
    """Rows of a step whose input embedding is given rather than looked up: ``rows`` take
    ``embeds``, and ``deepstack[i]`` (a vision tower's, may be empty) is added after decoder
    layer i. A multimodal prompt's image tokens; a prompt given as embeddings."""

    rows: torch.Tensor  # [n] int64
    embeds: torch.Tensor  # [n, hidden]
    deepstack: list[torch.Tensor] = field(default_factory=list)  # each [n, hidden]


class LlamaModel(nn.Module):
    def __init__(self, arch: DecoderArch, backend: AttentionBackend) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(arch.vocab_size, arch.hidden_size)
        rotary = RotaryEmbedding(arch.head_dim, arch.max_position, arch.rope_theta, arch.rope_scaling)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(arch, rotary, backend, i) for i in range(arch.num_layers)
        )
        self.norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        # input_ids, positions [T] -> hidden [T, hidden]
        return self.run(input_ids, positions)[0]

    def run(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        aux_layer_ids: tuple[int, ...] = (),
        embeds: EmbedRows | None = None,
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """hidden [T, hidden] and the input stream [T, hidden] of each of ``aux_layer_ids``;
        ``embeds``: rows whose input embedding is given (images' features, prompt embeddings)."""
        x = self.embed_tokens(input_ids)
        if embeds is None:
            return self.run_embeds(x, positions, aux_layer_ids)
        x = x.index_copy(0, embeds.rows, embeds.embeds.to(x.dtype))

        def add_deepstack(i: int, h: torch.Tensor) -> torch.Tensor:
            if i >= len(embeds.deepstack):
                return h
            return h.index_add(0, embeds.rows, embeds.deepstack[i].to(h.dtype))

        return self.run_embeds(x, positions, aux_layer_ids, add_deepstack if embeds.deepstack else None)

    def run_embeds(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        aux_layer_ids: tuple[int, ...] = (),
        after_layer: Callable[[int, torch.Tensor], torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """``run`` from the input embeddings ``x``; ``after_layer(i, x)`` may change layer i's
        output (before the residual joins it: what it adds, the stream gets)."""
        residual = None
        aux: dict[int, torch.Tensor] = {}
        for i, layer in enumerate(self.layers):
            if i in aux_layer_ids:
                # The layer's input stream, x + residual: the sum its fused input norm forms
                # again (the same float add, so the same numbers); layer 0's is the embedding.
                aux[i] = x if residual is None else x + residual
            x, residual = layer(positions, x, residual)
            if after_layer is not None:
                x = after_layer(i, x)
        return self.norm(x, residual)[0], [aux[i] for i in aux_layer_ids]


class LlamaForCausalLM(nn.Module):
    """forward(input_ids, positions) -> hidden states; compute_logits(hidden) -> [N, vocab].

    With ``set_aux_hidden_state_layers(ids)`` forward returns (hidden, aux) instead: aux
    concatenates the residual stream at the input of each listed layer, in the order given
    (what an EAGLE3 head reads; vLLM's convention)."""

    qkv_bias: bool | None = None  # None: read attention_bias from the config
    qk_norm = False
    stacked_params = STACKED_PARAMS  # checkpoint layer -> (merged layer, shard)
    supports_tensor_parallel = True
    model_class: type[nn.Module]  # the decoder stack (LlamaModel, set below)

    @classmethod
    def arch_from_hf(cls, hf_config: dict[str, Any]) -> DecoderArch:
        return DecoderArch.from_hf(hf_config, qkv_bias=cls.qkv_bias, qk_norm=cls.qk_norm)

    def __init__(self, hf_config: dict[str, Any], backend: AttentionBackend) -> None:
        super().__init__()
        self.arch = self.arch_from_hf(hf_config)
        self.model = self.model_class(self.arch, backend)
        # This rank's rows of the vocabulary (all of it with one rank), as the embedding's.
        first_row, rows = padded_vocab_share(self.arch.vocab_size)
        self.lm_head = nn.Linear(self.arch.hidden_size, rows, bias=False)
        set_shard(self.lm_head, "weight", 0, (first_row,))
        # Layers whose input stream forward also returns (EAGLE3); a plain tuple, so a compiled
        # graph specializes on it and the default () traces exactly the plain model.
        self.aux_layer_ids: tuple[int, ...] = ()
        self.tie_weights()

    def tie_weights(self) -> None:
        """Share the embedding with the LM head (again after ``to_empty``, which unties)."""
        if self.arch.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def set_aux_hidden_state_layers(self, layer_ids: tuple[int, ...]) -> None:
        """Return the input streams of these layers beside the hidden states; () turns it off.
        A layer listed twice appears twice (tiny models' default ids repeat)."""
        layer_ids = tuple(layer_ids)
        num_layers = self.arch.num_layers
        for i in layer_ids:
            if not isinstance(i, int) or isinstance(i, bool) or not 0 <= i < num_layers:
                raise ValueError(
                    f"aux hidden state layer {i!r} is not a layer of this model (0..{num_layers - 1})"
                )
        self.aux_layer_ids = layer_ids

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, embeds: EmbedRows | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        # input_ids, positions [T] -> hidden [T, hidden], or with aux layers set
        # (hidden, aux [T, len(aux_layer_ids) * hidden]); ``embeds``: rows given as embeddings
        if not self.aux_layer_ids and embeds is None:
            return self.model(input_ids, positions)
        hidden, aux = self.model.run(input_ids, positions, self.aux_layer_ids, embeds)
        return hidden if not self.aux_layer_ids else (hidden, torch.cat(aux, dim=-1))

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return gather_logits(self.lm_head(hidden), self.arch.vocab_size)

    def attention_layers(self) -> list[Attention]:
        return [layer.self_attn.attn for layer in self.model.layers]

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy checkpoint tensors by name; every parameter must be covered exactly once."""
        tied = self.arch.tie_word_embeddings

        def rename(name: str) -> str | None:
            if "rotary_emb.inv_freq" in name or (name == "lm_head.weight" and tied):
                return None
            return name

        optional = frozenset({"lm_head.weight"} if tied else ())
        load_by_name(self, weights, rename, optional, STACKED_PARAMS)


LlamaForCausalLM.model_class = LlamaModel


class MistralForCausalLM(LlamaForCausalLM):
    pass


class Qwen2ForCausalLM(LlamaForCausalLM):
    qkv_bias = True


class Qwen3ForCausalLM(LlamaForCausalLM):
    qk_norm = True


class Qwen3MoeForCausalLM(Qwen3ForCausalLM):
    """Qwen3 with sparse MLP blocks: layer i is sparse unless it is in ``mlp_only_layers``, when
    ``(i + 1) % decoder_sparse_step == 0``. Experts load from Hugging Face's per-expert names
    (``mlp.experts.{e}.gate_proj.weight``, ``up_proj``, ``down_proj``) or its stacked ones
    (``mlp.experts.gate_up_proj`` [E, 2I, H], ``mlp.experts.down_proj`` [E, H, I]) into
    ``FusedMoE``'s two weights, each rank only its experts and its slice of their width."""

    @classmethod
    def arch_from_hf(cls, hf_config: dict[str, Any]) -> DecoderArch:
        arch = super().arch_from_hf(hf_config)
        num_experts = hf_config.get("num_experts", hf_config.get("num_local_experts", 0))
        step = hf_config.get("decoder_sparse_step", 1)
        dense = set(hf_config.get("mlp_only_layers") or [])
        sparse = (
            frozenset(i for i in range(arch.num_layers) if i not in dense and (i + 1) % step == 0)
            if num_experts > 0 and step > 0
            else frozenset()
        )
        return dataclasses.replace(
            arch,
            sparse_layers=sparse,
            num_experts=num_experts,
            num_experts_per_tok=hf_config.get("num_experts_per_tok", 0),
            moe_intermediate_size=hf_config.get("moe_intermediate_size", 0),
            norm_topk_prob=bool(hf_config.get("norm_topk_prob", True)),
        )

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        blocks = {name: m for name, m in self.named_modules() if isinstance(m, FusedMoE)}
        loaded: set[tuple[str, int, str]] = set()  # (block, expert, part) this rank holds

        def load_expert(name: str, block_name: str, expert: int, part: str, tensor: torch.Tensor) -> None:
            block = blocks.get(block_name)
            if block is None or not 0 <= expert < block.num_experts:
                raise ValueError(f"checkpoint tensor {name!r} has no parameter in {type(self).__name__}")
            local = expert - block.first_expert
            if not 0 <= local < block.num_local_experts:
                return  # another rank's expert
            width, start = block.intermediate_size, block.intermediate_start
            size = self.arch.moe_intermediate_size  # the whole expert's width
            full = (block.hidden_size, size) if part == "down_proj" else (size, block.hidden_size)
            if tuple(tensor.shape) != full:
                raise ValueError(
                    f"checkpoint tensor {name!r} has shape {tuple(tensor.shape)}, expected {full}"
                )
            dim = 1 if part == "down_proj" else 0  # [H, I]: this rank's columns; [I, H]: its rows
            tensor = (
                tensor.read(dim, start, width)
                if isinstance(tensor, LazyTensor)
                else tensor.narrow(dim, start, width)
            )
            if part == "down_proj":
                target = block.w2_weight[local]
            else:  # the gate or the up half
                target = block.w13_weight[local].narrow(0, 0 if part == "gate_proj" else width, width)
            if (block_name, expert, part) in loaded:
                raise ValueError(f"checkpoint tensor {name!r} is given twice")
            with torch.no_grad():
                target.copy_(tensor)
            loaded.add((block_name, expert, part))

        def the_rest() -> Iterable[tuple[str, torch.Tensor]]:
            for name, tensor in weights:
                one = _EXPERT_WEIGHT.fullmatch(name)
                stacked = _STACKED_EXPERTS.fullmatch(name)
                if one is not None:
                    load_expert(name, f"{one.group(1)}.experts", int(one.group(2)), one.group(3), tensor)
                elif stacked is not None:
                    # [E, 2I, H] (gate rows, then up rows) or [E, H, I]: expert by expert.
                    whole = tensor.read() if isinstance(tensor, LazyTensor) else tensor
                    block_name = f"{stacked.group(1)}.experts"
                    for e in range(whole.shape[0]):
                        if stacked.group(2) == "down_proj":
                            load_expert(name, block_name, e, "down_proj", whole[e])
                        else:
                            gate, up = whole[e].chunk(2, dim=0)
                            load_expert(name, block_name, e, "gate_proj", gate)
                            load_expert(name, block_name, e, "up_proj", up)
                else:
                    yield name, tensor

        tied = self.arch.tie_word_embeddings

        def rename(name: str) -> str | None:
            if "rotary_emb.inv_freq" in name or (name == "lm_head.weight" and tied):
                return None
            return name

        experts = {f"{b}.{w}" for b in blocks for w in ("w13_weight", "w2_weight")}
        optional = experts | ({"lm_head.weight"} if tied else set())
        load_by_name(self, the_rest(), rename, frozenset(optional), STACKED_PARAMS)
        for block_name, block in blocks.items():
            for e in range(block.first_expert, block.first_expert + block.num_local_experts):
                for part in ("gate_proj", "up_proj", "down_proj"):
                    if (block_name, e, part) not in loaded:
                        raise ValueError(f"checkpoint lacks {block_name}.{e}.{part}.weight")


_EXPERT_WEIGHT = re.compile(r"(.+\.mlp)\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight")
_STACKED_EXPERTS = re.compile(r"(.+\.mlp)\.experts\.(gate_up_proj|down_proj)")
