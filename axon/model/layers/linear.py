"""Linear layers on the CPU, each weight packed once at load time: axon's bfloat16 kernel or oneDNN.

``CpuBf16Linear`` (``linear_backend="cpu_bf16"``, the default for bfloat16 on CPUs with
AVX-512 BF16) runs ``torch.ops.axon_cpu.packed_linear`` (``axon/csrc/cpu_linear.cpp``) on a
weight packed into a plain bf16 buffer: a C++ op on ordinary tensors, so a compiled graph calls
it directly, with no Python in between (a Python custom op cost ~30 us a call, about a millisecond
per decode step of an 8-layer model). On 2 Zen 4 cores it matches oneDNN's speed from 1 to 8,192
rows. On CPUs with AMX (Intel Xeon since Sapphire Rapids) the same op runs every row count on
the tile unit (``torch.ops.axon_cpu.linear_uses_amx()``): prefills and batches 4 to 8 times
faster than its AVX-512 path there, and one summation order for every row count, so batching
never changes a request's numbers. ``torch.ops.axon_cpu.set_linear_amx(False)`` (or
``AXON_CPU_AMX=0`` for a whole process) keeps the AVX-512 path on such a CPU.

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


def cpu_bf16_linear_supported(dtype: torch.dtype, device: torch.device, cpu_kernels: bool) -> bool:
    """axon's kernel: bfloat16 on a CPU with AVX-512 BF16, once the kernels are loaded."""
    return (
        cpu_kernels
        and device.type == "cpu"
        and dtype == torch.bfloat16
        and bool(torch.ops.axon_cpu.linear_supported())
    )


def onednn_linear_supported(dtype: torch.dtype, device: torch.device) -> bool:
    if device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    if dtype == torch.float32:
        return True
    return dtype == torch.bfloat16 and torch.ops.mkldnn._is_mkldnn_bf16_supported()


def resolve_linear_backend(
    name: str, dtype: torch.dtype, device: torch.device, cpu_kernels: bool = False
) -> str:
    """auto: axon's bf16 kernel where it runs, else oneDNN where it supports the dtype on this
    CPU, else torch's ``F.linear``. ``cpu_kernels``: axon's C++ kernels are loaded."""
    bf16 = cpu_bf16_linear_supported(dtype, device, cpu_kernels)
    onednn = onednn_linear_supported(dtype, device)
    if name == "cpu_bf16" and not bf16:
        raise ValueError(
            f"linear_backend 'cpu_bf16' needs dtype bfloat16 on a CPU with AVX-512 BF16 and axon's "
            f"C++ kernels (got {dtype} on {device.type}); use 'auto', 'onednn' or 'torch'"
        )
    if name == "onednn" and not onednn:
        raise ValueError(
            f"linear_backend 'onednn' needs a CPU with oneDNN support for {dtype} "
            f"(device {device.type}); use 'auto' or 'torch'"
        )
    if name == "auto":
        return "cpu_bf16" if bf16 else "onednn" if onednn else "torch"
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


class CpuBf16Linear(nn.Module):
    """``nn.Linear``'s forward on axon's AVX-512 BF16 kernel, the weight packed once into a
    bf16 buffer (layout in ``axon/csrc/cpu_linear.cpp``)."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.bias = linear.bias
        with torch.no_grad():
            packed = torch.ops.axon_cpu.pack_linear_weight(linear.weight.detach())
        self.register_buffer("packed", packed, persistent=False)

    def forward(self, x: torch.Tensor, float_out: bool = False) -> torch.Tensor:
        # [..., in_features] bf16 -> [..., out_features], bf16 or float32
        return torch.ops.axon_cpu.packed_linear(x, self.packed, self.out_features, self.bias, float_out)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"
        )


def pack_linears(model: nn.Module, backend: str, batch_hint: int) -> int:
    """Replace every ``nn.Linear`` in ``model`` with the packed layer of ``backend`` ("cpu_bf16"
    or "onednn"); returns how many.

    A weight tied to an embedding stays with the embedding: the packed copy is the layer's own.
    """
    assert backend in ("cpu_bf16", "onednn"), backend
    targets = [
        (parent, name, child)
        for parent in model.modules()
        for name, child in parent.named_children()
        if isinstance(child, nn.Linear)
    ]
    if backend == "cpu_bf16":  # the kernel takes inputs in pairs; an odd width stays nn.Linear
        targets = [t for t in targets if t[2].in_features % 2 == 0]
    for parent, name, child in targets:
        layer = CpuBf16Linear(child) if backend == "cpu_bf16" else PackedLinear(child, batch_hint)
        keep_output_sizes(child, layer)
        setattr(parent, name, layer)
    return len(targets)


def keep_output_sizes(old: nn.Module, new: nn.Module) -> None:
    """A merged layer's replacement (packed, quantized) keeps its shards' sizes (LoRA reads them)."""
    sizes = getattr(old, "output_sizes", None)
    if sizes is not None:
        new.output_sizes = sizes


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
