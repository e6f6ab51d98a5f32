"""Mixture-of-experts MLP: a router picks each token's top-k experts, their SwiGLU MLPs run on
just that token, and the outputs are summed with the router's weights.

``FusedMoE`` holds the experts of one block as two stacked weights (vLLM's names): ``w13_weight``
[E, 2I, H] (each expert's gate rows, then its up rows) and ``w2_weight`` [E, H, I]. Two ways to
run them, both one opaque op inside compiled graphs (a token's experts are data, so the block
cannot be traced into a static graph):

- ``fused`` (bfloat16 on a CPU with AVX-512 BF16, axon's kernels loaded):
  ``torch.ops.axon_cpu.fused_moe`` (``axon/csrc/cpu_moe.h``). The weights are packed once at
  load into the layout of axon's linear kernel; one call routes, sorts the (token, slot) pairs
  by expert, runs each picked expert's two GEMMs over just its rows and sums each token's
  slots in a fixed order, so a token's result does not depend on its batch.
- ``fused_quant`` (``--quantization`` int8, int4, fp8 or w8a8, on the same CPUs as quantized
  linears): ``torch.ops.axon_cpu.fused_moe_quant``, the same block with each expert's weights
  kept as codes (``quant.quantize_experts``) and multiplied by the quantized linear kernel.
- ``loop`` (every other dtype and device): ``moe_loop``, a loop over the experts in torch, the
  way transformers computes the block; it is also the fused op's oracle in the tests.

What a block computes besides its weights is its ``MoeMath``: the routing (Qwen3-MoE's softmax
then top-k, optionally renormalized; GPT-OSS's top-k then softmax), the activation (SwiGLU, or
GPT-OSS's clamped ``swigluoai``) and whether the experts have biases (``w13_bias``, ``w2_bias``).

Under tensor parallelism a block holds this rank's share (``expert_share``): 1/N of every
expert's width (its gate, up and down slices), or with expert parallelism whole experts
``first_expert .. first_expert + L - 1``; a token's slots routed to another rank's experts add
nothing here, and one all-reduce after the block sums the ranks' parts.
"""

from __future__ import annotations

import itertools
import weakref
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from axon.distributed.parallel_state import expert_parallel
from axon.model.layers.tensor_parallel import split

_layers: dict[int, weakref.ReferenceType[FusedMoE]] = {}
_handles = itertools.count()

# How a block turns router logits into weights (the index is the fused op's code):
#   softmax_topk  softmax over the experts, the k largest, renormalized when asked (Qwen3-MoE)
#   topk_softmax  the k largest logits, softmax over just them (GPT-OSS)
ROUTINGS = ("softmax_topk", "topk_softmax")
# What joins an expert's gate and up halves:
#   silu       silu(gate) * up
#   swigluoai  GPT-OSS's: gate clamped above at limit, up to [-limit, limit],
#              gate * sigmoid(alpha * gate) * (up + 1)
ACTIVATIONS = ("silu", "swigluoai")


@dataclass(frozen=True)
class MoeMath:
    """What a block computes besides its weights."""

    top_k: int
    renormalize: bool = True  # softmax_topk: divide the k probabilities by their sum
    routing: str = "softmax_topk"
    activation: str = "silu"
    alpha: float = 1.702  # swigluoai
    limit: float = 7.0  # swigluoai

    def __post_init__(self) -> None:
        if self.routing not in ROUTINGS:
            raise ValueError(f"MoE routing {self.routing!r} is not one of {', '.join(ROUTINGS)}")
        if self.activation not in ACTIVATIONS:
            raise ValueError(f"MoE activation {self.activation!r} is not one of {', '.join(ACTIVATIONS)}")


def route(router_logits: torch.Tensor, math: MoeMath) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights float32 [T, k], expert ids int64 [T, k]) of each token's top-k experts."""
    if math.routing == "topk_softmax":
        top, ids = torch.topk(router_logits.float(), math.top_k, dim=-1)
        return torch.softmax(top, dim=-1), ids
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, math.top_k, dim=-1)
    if math.renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def activate(gate_up: torch.Tensor, math: MoeMath) -> torch.Tensor:
    """[..., 2I] (the gate half, then the up half) -> [..., I]."""
    gate, up = gate_up.chunk(2, dim=-1)
    if math.activation == "swigluoai":
        gate, up = gate.clamp(max=math.limit), up.clamp(-math.limit, math.limit)
        return gate * torch.sigmoid(gate * math.alpha) * (up + 1)
    return F.silu(gate) * up


def moe_loop(
    x: torch.Tensor,  # [T, H]
    router_logits: torch.Tensor,  # [T, E]
    w13: torch.Tensor,  # [L, 2I, H]
    w2: torch.Tensor,  # [L, H, I]
    math: MoeMath,
    first_expert: int = 0,
    w13_bias: torch.Tensor | None = None,  # [L, 2I]
    w2_bias: torch.Tensor | None = None,  # [L, H]
) -> torch.Tensor:
    """The block as a loop over the experts that were picked: [T, H] in x's dtype. w13 and w2
    hold experts first_expert .. first_expert + L - 1; slots of the others add nothing."""
    weights, ids = route(router_logits, math)
    out = torch.zeros_like(x)
    for expert in torch.unique(ids).tolist():
        e = expert - first_expert
        if not 0 <= e < w13.shape[0]:
            continue
        token, slot = torch.where(ids == expert)
        h = F.linear(x[token], w13[e], None if w13_bias is None else w13_bias[e])
        y = F.linear(activate(h, math), w2[e], None if w2_bias is None else w2_bias[e])
        out.index_add_(0, token, y * weights[token, slot, None].to(x.dtype))
    return out


class FusedMoE(nn.Module):
    """The experts of one sparse MLP block; forward(x [T, H], router_logits [T, E]) -> [T, H].

    It holds experts ``first_expert .. first_expert + num_local_experts - 1`` (all of them by
    default), each ``intermediate_size`` wide: columns ``intermediate_start ..`` of the
    checkpoint's experts (the loader reads that slice)."""

    def __init__(
        self,
        num_experts: int,
        hidden_size: int,
        intermediate_size: int,
        math: MoeMath,
        first_expert: int = 0,
        num_local_experts: int | None = None,
        intermediate_start: int = 0,
        bias: bool = False,
    ) -> None:
        super().__init__()
        if not 1 <= math.top_k <= num_experts:
            raise ValueError(
                f"num_experts_per_tok {math.top_k} must be between 1 and num_experts {num_experts}"
            )
        self.num_experts, self.math, self.top_k = num_experts, math, math.top_k
        self.first_expert = first_expert
        self.num_local_experts = num_experts if num_local_experts is None else num_local_experts
        self.hidden_size, self.intermediate_size = hidden_size, intermediate_size
        self.intermediate_start = intermediate_start
        local = self.num_local_experts
        self.w13_weight = nn.Parameter(torch.empty(local, 2 * intermediate_size, hidden_size))
        self.w2_weight = nn.Parameter(torch.empty(local, hidden_size, intermediate_size))
        self.w13_bias = nn.Parameter(torch.empty(local, 2 * intermediate_size)) if bias else None
        self.w2_bias = nn.Parameter(torch.empty(local, hidden_size)) if bias else None
        self.method = "loop"
        self.handle = next(_handles)
        _layers[self.handle] = weakref.ref(self)
        weakref.finalize(self, _layers.pop, self.handle, None)

    def pack(self) -> None:
        """Switch to the fused kernel: each expert's weights in the linear kernel's packed layout
        (the stacked originals are dropped, so the experts stay in memory once)."""
        with torch.no_grad():
            w13 = torch.stack([torch.ops.axon_cpu.pack_linear_weight(w) for w in self.w13_weight])
            w2 = torch.stack([torch.ops.axon_cpu.pack_linear_weight(w) for w in self.w2_weight])
        del self.w13_weight, self.w2_weight
        self.register_buffer("w13_packed", w13, persistent=False)
        self.register_buffer("w2_packed", w2, persistent=False)
        self._float_biases()
        self.method = "fused"

    def use_quantized(
        self,
        kinds: tuple[int, int],
        groups: tuple[int, int],
        w13: list[torch.Tensor | None],
        w2: list[torch.Tensor | None],
        weight_bytes: int,
    ) -> None:
        """Switch to ``fused_moe_quant`` on quantized experts: ``w13`` and ``w2`` are each
        (codes, scales, mins or None) in quant_linear's layout, stacked one row per expert
        (``quant.quantize_experts`` builds them); ``kinds`` and ``groups`` their code kinds and
        inputs per scale. The bf16 weights are dropped."""
        del self.w13_weight, self.w2_weight
        for name, tensors in (("w13", w13), ("w2", w2)):
            for part, t in zip(("codes", "scales", "mins"), tensors, strict=True):
                self.register_buffer(f"{name}_{part}", t, persistent=False)
        self._float_biases()
        self.quant_kinds, self.quant_groups, self.weight_bytes = kinds, groups, weight_bytes
        self.method = "fused_quant"

    def _float_biases(self) -> None:
        if self.w13_bias is not None:  # the kernels add them in float32
            biases = self.w13_bias.detach().float(), self.w2_bias.detach().float()
            del self.w13_bias, self.w2_bias
            self.register_buffer("w13_bias", biases[0], persistent=False)
            self.register_buffer("w2_bias", biases[1], persistent=False)

    def forward(self, x: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
        if self.method == "fused_quant":
            m = self.math
            return torch.ops.axon_cpu.fused_moe_quant(
                x, router_logits, self.w13_codes, self.w13_scales, self.w13_mins, self.w2_codes,
                self.w2_scales, self.w2_mins, *self.quant_kinds, *self.quant_groups, self.w13_bias,
                self.w2_bias, m.top_k, m.renormalize, self.intermediate_size, self.first_expert,
                ROUTINGS.index(m.routing), ACTIVATIONS.index(m.activation), m.alpha, m.limit,
            )  # fmt: skip
        if self.method == "fused":
            m = self.math
            return torch.ops.axon_cpu.fused_moe(
                x, router_logits, self.w13_packed, self.w2_packed, self.w13_bias, self.w2_bias, m.top_k,
                m.renormalize, self.intermediate_size, self.first_expert, ROUTINGS.index(m.routing),
                ACTIVATIONS.index(m.activation), m.alpha, m.limit,
            )  # fmt: skip
        if torch.compiler.is_compiling():
            return torch.ops.axon.moe_loop(x, router_logits, self.handle)
        return self.run_loop(x, router_logits)

    def run_loop(self, x: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
        return moe_loop(
            x,
            router_logits,
            self.w13_weight,
            self.w2_weight,
            self.math,
            self.first_expert,
            self.w13_bias,
            self.w2_bias,
        )

    def extra_repr(self) -> str:
        local = ""
        if self.num_local_experts != self.num_experts:
            local = f"local_experts={self.first_expert}..{self.first_expert + self.num_local_experts - 1}, "
        return (
            f"num_experts={self.num_experts}, {local}top_k={self.top_k}, hidden_size={self.hidden_size}, "
            f"intermediate_size={self.intermediate_size}, routing={self.math.routing}, "
            f"activation={self.math.activation}, bias={self.w13_bias is not None}, method={self.method}"
        )


def expert_share(num_experts: int, intermediate_size: int) -> dict[str, int]:
    """This rank's experts and width (``FusedMoE``'s keyword arguments): with expert
    parallelism 1/N of the experts, whole; else every expert, 1/N of its width."""
    if expert_parallel():
        first_expert, num_local = split(num_experts, "number of experts")
        first_col, width = 0, intermediate_size
    else:
        first_expert, num_local = 0, num_experts
        first_col, width = split(intermediate_size, "moe_intermediate_size")
    return {
        "first_expert": first_expert,
        "num_local_experts": num_local,
        "intermediate_start": first_col,
        "intermediate_size": width,
    }


def pack_experts(model: nn.Module) -> int:
    """Every ``FusedMoE`` of ``model`` to the fused kernel; returns how many."""
    blocks = [m for m in model.modules() if isinstance(m, FusedMoE)]
    for block in blocks:
        block.pack()
    return len(blocks)


@torch.library.custom_op("axon::moe_loop", mutates_args=())
def _moe_loop_op(x: torch.Tensor, router_logits: torch.Tensor, handle: int) -> torch.Tensor:
    ref = _layers.get(handle)
    layer = ref() if ref is not None else None
    assert layer is not None, f"MoE layer {handle} no longer exists"
    return layer.run_loop(x, router_logits)


@_moe_loop_op.register_fake
def _(x: torch.Tensor, router_logits: torch.Tensor, handle: int) -> torch.Tensor:
    return torch.empty_like(x)
