"""Linear layers on the CPU through oneDNN, each weight reordered once at load time.

``F.linear`` on the CPU hands every call to MKL's GEMM, which copies panels of the weight into
its blocked layout on every call; at decode sizes (a few to a few dozen rows) that copy costs
about as much as the multiplication. On a 2-core AVX2 machine a 16 x 576 @ 576 x 3072 float32
GEMM took 974 us through MKL and 573 us through oneDNN with the weight prepacked, and
SmolLM2's 49,152-row LM head ran at half MKL's time for 1 to 64 rows. ``PackedLinear`` keeps only the packed weight (what
Inductor's freezing pass does for the same reason) and calls oneDNN directly, eager or compiled.

Compiled graphs see one opaque op, ``torch.ops.axon.packed_linear(x, handle)``: an opaque
oneDNN tensor cannot enter a graph, so the op finds its layer by ``handle`` in a registry of
weak references.
"""

from __future__ import annotations

import itertools
import weakref

import torch
from torch import nn

_layers: dict[int, weakref.ReferenceType[PackedLinear]] = {}
_handles = itertools.count()


def onednn_linear_supported(dtype: torch.dtype, device: torch.device) -> bool:
    if device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    if dtype == torch.float32:
        return True
    return dtype == torch.bfloat16 and torch.ops.mkldnn._is_mkldnn_bf16_supported()


def resolve_linear_backend(name: str, dtype: torch.dtype, device: torch.device) -> str:
    """auto: oneDNN where it supports the dtype on this CPU, torch's ``F.linear`` elsewhere."""
    supported = onednn_linear_supported(dtype, device)
    if name == "onednn" and not supported:
        raise ValueError(
            f"linear_backend 'onednn' needs a CPU with oneDNN support for {dtype} "
            f"(device {device.type}); use 'auto' or 'torch'"
        )
    if name == "auto":
        return "onednn" if supported else "torch"
    return name


class MergedLinear(nn.Linear):
    """Several projections of one input as one GEMM (vLLM's merged column layers): q/k/v, or
    gate/up. Output rows are the shards in order; ``output_sizes`` says how many each has."""

    def __init__(self, in_features: int, output_sizes: tuple[int, ...], bias: bool) -> None:
        super().__init__(in_features, sum(output_sizes), bias=bias)
        self.output_sizes = tuple(output_sizes)


class PackedLinear(nn.Module):
    """``nn.Linear``'s forward with the weight in oneDNN's blocked layout for ``batch_hint`` rows."""

    def __init__(self, linear: nn.Linear, batch_hint: int) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.bias = linear.bias
        with torch.no_grad():
            self.packed = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), batch_hint)
        self.handle = next(_handles)
        _layers[self.handle] = weakref.ref(self)
        weakref.finalize(self, _layers.pop, self.handle, None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling():
            return torch.ops.axon.packed_linear(x, self.handle)
        return self.run(x)

    def run(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        out = torch.ops.mkldnn._linear_pointwise(rows, self.packed, self.bias, "none", [], "")
        return out.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"
        )


def pack_linears(model: nn.Module, batch_hint: int) -> int:
    """Replace every ``nn.Linear`` in ``model`` with a ``PackedLinear``; returns how many.

    A weight tied to an embedding stays with the embedding: the packed copy is the layer's own.
    """
    targets = [
        (parent, name, child)
        for parent in model.modules()
        for name, child in parent.named_children()
        if isinstance(child, nn.Linear)
    ]
    for parent, name, child in targets:
        setattr(parent, name, PackedLinear(child, batch_hint))
    return len(targets)


@torch.library.custom_op("axon::packed_linear", mutates_args=())
def packed_linear(x: torch.Tensor, handle: int) -> torch.Tensor:
    return _layer(handle).run(x)


@packed_linear.register_fake
def _(x: torch.Tensor, handle: int) -> torch.Tensor:
    return x.new_empty(*x.shape[:-1], _layer(handle).out_features)


def _layer(handle: int) -> PackedLinear:
    ref = _layers.get(handle)
    layer = ref() if ref is not None else None
    assert layer is not None, f"packed linear layer {handle} no longer exists"
    return layer
