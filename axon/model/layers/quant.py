"""Quantized linear layers: fewer bytes per weight for a memory-bound decode.

``--quantization`` (vLLM's flag) chooses how each linear layer's weight is stored:

    int8   weight-only, signed 8-bit codes, one scale per output channel (or per
           ``--quantization-group-size`` inputs), computed at load (W8A16)
    int4   weight-only, 4-bit codes 0..15 with a scale and a minimum per group of inputs
           (default 128; Q4_1's form), computed at load (W4A16)
    fp8    FP8 E4M3 codes, one scale per output channel (amax / 448), computed at load
    w8a8   int8 weights per output channel, and each call's activations quantized to int8 per
           row (token): int32 sums on AMX-INT8 or AVX-512 VNNI (``W8A8Linear``)
    gguf   a GGUF file's own blocks (Q8_0, Q4_0, Q4_1, Q4_K, Q5_K, Q6_K), re-laid out without
           rounding: the codes, scales and minimums are the file's (``gguf_blocks.py``)

Every weight-only form is ``w[n][k] = code * scale + min`` with one scale (and min) per output
``n`` and ``group`` consecutive inputs: a ``QuantizedWeight``. On CPUs with AVX-512 BF16 and VBMI
the layer runs ``torch.ops.axon_cpu.quant_linear`` (``axon/csrc/cpu_linear_quant.h``): it streams
the codes, turns each slice into exact bf16 numbers next to the tiles, sums each group's products
in float32 and adds that sum times the group's scale (plus the min times the group's input sum),
in one order whatever the batch. Elsewhere (CUDA, other CPUs, float32 models) the layer
dequantizes its weight on each call and runs ``F.linear``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from axon.model.layers.linear import keep_output_sizes
from axon.model.layers.moe import FusedMoE

# Code kinds, as the C++ kernel numbers them.
KIND_INT8, KIND_UINT4, KIND_FP8 = 0, 1, 2
KIND_NAMES = {KIND_INT8: "int8", KIND_UINT4: "uint4", KIND_FP8: "fp8_e4m3"}
FP8_E4M3_MAX = 448.0
GROUP_COLS = 64  # output columns per packed panel (kGroupCols in the kernel)

DEFAULT_GROUP_SIZE = {"int4": 128}  # int8 and fp8: one scale per output channel
# Methods whose codes hold the LM head too: int8's per-channel rounding moves the logits little
# (benchmarks/quant_accuracy.py), and on a small model the head is a fifth of the bytes a decode
# step reads. fp8 (3 mantissa bits), int4 and w8a8 keep it in the model's dtype.
QUANTIZED_LM_HEAD = frozenset({"int8"})


@dataclass
class QuantizedWeight:
    """An [N, K] weight as codes with per-(output, group of inputs) scales and minimums."""

    codes: torch.Tensor  # [N, K]: int8 (KIND_INT8), uint8 0..15 (KIND_UINT4), float8_e4m3fn (KIND_FP8)
    kind: int
    scales: torch.Tensor  # [N, K // group] float32
    mins: torch.Tensor | None  # [N, K // group] float32; None: zero
    group: int

    @property
    def shape(self) -> tuple[int, int]:
        return int(self.codes.shape[0]), int(self.codes.shape[1])

    def dequantize(self) -> torch.Tensor:
        """[N, K] float32: code * scale + min, rounded once (as the kernel's fused multiply-add)."""
        w = self.codes.double() * self.scales.double().repeat_interleave(self.group, dim=1)
        if self.mins is not None:
            w = w + self.mins.double().repeat_interleave(self.group, dim=1)
        return w.float()

    def permute_rows(self, order: torch.Tensor) -> QuantizedWeight:
        """Row i of the result is row order[i] of this weight."""
        mins = self.mins[order] if self.mins is not None else None
        return QuantizedWeight(self.codes[order], self.kind, self.scales[order], mins, self.group)

    def select_columns(self, start: int, width: int) -> QuantizedWeight:
        """Inputs ``start .. start + width - 1`` (whole groups) of this weight."""
        assert start % self.group == 0 and width % self.group == 0, "columns must be whole groups"
        g0, g1 = start // self.group, (start + width) // self.group
        mins = self.mins[:, g0:g1].contiguous() if self.mins is not None else None
        codes = self.codes[:, start : start + width].contiguous()
        return QuantizedWeight(codes, self.kind, self.scales[:, g0:g1].contiguous(), mins, self.group)

    def nbytes(self) -> int:
        n, k = self.shape
        code_bytes = n * k // 2 if self.kind == KIND_UINT4 else n * k
        tables = 1 if self.mins is None else 2
        return code_bytes + tables * self.scales.numel() * 4


def _grouped(w: torch.Tensor, group: int) -> torch.Tensor:
    n, k = w.shape
    return w.float().reshape(n, k // group, group)


def quantize_int8(w: torch.Tensor, group: int) -> QuantizedWeight:
    """Symmetric: scale = amax / 127 per group, codes = round(w / scale)."""
    g = _grouped(w, group)
    amax = g.abs().amax(dim=-1)
    scales = torch.where(amax > 0, amax / 127.0, torch.ones_like(amax))
    codes = torch.round(g / scales[..., None]).clamp(-127, 127).to(torch.int8).reshape(w.shape)
    return QuantizedWeight(codes, KIND_INT8, scales.contiguous(), None, group)


def quantize_int4(w: torch.Tensor, group: int) -> QuantizedWeight:
    """Asymmetric: min = the group's minimum, scale = (max - min) / 15, codes = round((w - min) / scale)."""
    g = _grouped(w, group)
    lo, hi = g.amin(dim=-1), g.amax(dim=-1)
    scales = torch.where(hi > lo, (hi - lo) / 15.0, torch.ones_like(lo))
    codes = torch.round((g - lo[..., None]) / scales[..., None]).clamp(0, 15).to(torch.uint8).reshape(w.shape)
    return QuantizedWeight(codes, KIND_UINT4, scales.contiguous(), lo.contiguous(), group)


def quantize_fp8(w: torch.Tensor) -> QuantizedWeight:
    """E4M3 per output channel: scale = amax / 448, codes = w / scale rounded to E4M3."""
    amax = w.float().abs().amax(dim=1, keepdim=True)
    scales = torch.where(amax > 0, amax / FP8_E4M3_MAX, torch.ones_like(amax))
    codes = (w.float() / scales).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn)
    return QuantizedWeight(codes, KIND_FP8, scales.contiguous(), None, int(w.shape[1]))


def default_group_size(method: str, k: int) -> int:
    """int4: 128 inputs, or the largest power of two from 64 down to 16 that divides ``k``
    (576 -> 64), else ``k``; int8 and fp8: all ``k`` (one scale per output channel)."""
    if method != "int4":
        return k
    group = DEFAULT_GROUP_SIZE["int4"]
    while k % group and group > 16:
        group //= 2
    return group if k % group == 0 else k


def quantize_weight(w: torch.Tensor, method: str, group_size: int | None) -> QuantizedWeight:
    """``w`` [N, K] -> its ``method`` ("int8", "int4", "fp8") form; ``group_size`` None: the
    method's default. A group that does not divide K (or is odd) is an error naming it."""
    k = int(w.shape[1])
    group = group_size or default_group_size(method, k)
    if method == "fp8":
        return quantize_fp8(w)
    if k % group:
        raise ValueError(
            f"quantization_group_size {group} must divide every quantized layer's inputs; a layer has {k}"
        )
    if method == "int8":
        return quantize_int8(w, group)
    if method == "int4":
        return quantize_int4(w, group)
    raise ValueError(f"unknown quantization method {method!r}")


def concat_rows(parts: list[QuantizedWeight]) -> QuantizedWeight:
    """One weight whose rows are ``parts``' rows in order (a merged q/k/v or gate/up layer), in a
    form every part fits without rounding: 8-bit codes if any part has them (4-bit codes 0..15 fit),
    the smallest group (a larger group's scale repeats), minimums if any part has them (zero else)."""
    kinds = {p.kind for p in parts}
    if len(kinds) > 1 and KIND_FP8 in kinds:
        raise ValueError(f"cannot merge fp8 codes with {sorted(KIND_NAMES[k] for k in kinds)}")
    kind = KIND_INT8 if KIND_INT8 in kinds else parts[0].kind
    group = min(p.group for p in parts)
    if any(p.group % group for p in parts):
        raise ValueError(f"cannot merge groups {[p.group for p in parts]}")
    any_mins = any(p.mins is not None for p in parts)
    codes, scales, mins = [], [], []
    for p in parts:
        codes.append(p.codes.to(torch.int8) if kind == KIND_INT8 and p.kind == KIND_UINT4 else p.codes)
        scales.append(p.scales.repeat_interleave(p.group // group, dim=1))
        if any_mins:
            m = p.mins if p.mins is not None else torch.zeros_like(p.scales)
            mins.append(m.repeat_interleave(p.group // group, dim=1))
    return QuantizedWeight(
        torch.cat(codes), kind, torch.cat(scales), torch.cat(mins) if any_mins else None, group
    )


def _unpack_order() -> torch.Tensor:
    """Where each of 64 byte codes is stored so that the kernel's in-lane unpacking yields codes
    0-31, then 32-63 (``bytes_to_bf16`` in cpu_linear_quant.h): stored[position[j]] = code j."""
    j = torch.arange(64)
    half, within = j // 32, j % 32
    return 16 * (within // 8) + 8 * half + within % 8


_UNPACK_ORDER = _unpack_order()


def pack_codes(codes: torch.Tensor, kind: int) -> torch.Tensor:
    """[N, K] codes -> the kernel's panel order (``cpu_linear_quant.h``), flat uint8; rows past N
    are 0. Byte codes (int8, fp8) are stored sign-magnitude, each 64 in unpacking order."""
    n, k = codes.shape
    groups = -(-n // GROUP_COLS)
    if kind == KIND_INT8:
        if bool((codes == -128).any()):
            raise ValueError("int8 codes must lie in -127..127")
        raw = (codes.to(torch.int16).abs() | ((codes < 0).to(torch.int16) << 7)).to(torch.uint8)
    else:
        raw = codes.view(torch.uint8) if codes.dtype != torch.uint8 else codes
    padded = torch.zeros(groups * GROUP_COLS, k, dtype=torch.uint8)
    padded[:n] = raw
    # [group][block][column][k2][k % 2] -> [group][k2][block][column][k % 2]
    steps = padded.view(groups, 4, 16, k // 2, 2).permute(0, 3, 1, 2, 4).reshape(groups, k // 2, 4, 32)
    if kind == KIND_UINT4:  # blocks 0 and 2 in low nibbles, 1 and 3 in high ones
        steps = steps[:, :, 0::2] | (steps[:, :, 1::2] << 4)
    else:
        chunks = steps.reshape(groups, k // 2, 2, 64)
        steps = torch.empty_like(chunks)
        steps[..., _UNPACK_ORDER] = chunks
    return steps.contiguous().view(-1)


def pack_table(table: torch.Tensor) -> torch.Tensor:
    """[N, K // group] float32 -> [group of 64 columns][K // group][64], flat; columns past N are 0."""
    n, kg = table.shape
    groups = -(-n // GROUP_COLS)
    padded = torch.zeros(groups * GROUP_COLS, kg, dtype=torch.float32)
    padded[:n] = table
    return padded.view(groups, GROUP_COLS, kg).transpose(1, 2).contiguous().view(-1)


def quant_kernel_supported() -> bool:
    """axon's quantized GEMM is loaded and this CPU runs it (AVX-512 BF16 and VBMI)."""
    ops = torch.ops.axon_cpu
    return hasattr(ops, "quant_linear_supported") and bool(ops.quant_linear_supported())


def kernel_tensors(
    weight: QuantizedWeight, allow_half: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(codes, scales, mins) of ``weight`` in the kernel's layout. The kernel takes uint4 codes with
    mins (zeros where the weight has none). With ``allow_half`` the tables are float16 where that
    loses nothing (GGUF's Q8_0, Q4_0, Q4_1 scales are float16): fewer bytes to stream."""
    mins = weight.mins
    if mins is None and weight.kind == KIND_UINT4:
        mins = torch.zeros_like(weight.scales)
    tables = [t for t in (weight.scales, mins) if t is not None]
    half = allow_half and all(torch.equal(t.half().float(), t) for t in tables)
    dtype = torch.float16 if half else torch.float32
    return (
        pack_codes(weight.codes, weight.kind),
        pack_table(weight.scales).to(dtype),
        pack_table(mins).to(dtype) if mins is not None else None,
    )


class QuantLinear(nn.Module):
    """``nn.Linear``'s forward on a ``QuantizedWeight``: axon's kernel where ``use_kernel``, else
    dequantize and ``F.linear``."""

    def __init__(self, weight: QuantizedWeight, bias: torch.Tensor | None, use_kernel: bool) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.kind, self.group = weight.kind, weight.group
        self.register_buffer("bias", bias, persistent=False)
        # The kernel takes groups of 16 inputs or more (one tile product each).
        self.use_kernel = use_kernel and weight.group % 16 == 0 and quant_kernel_supported()
        self.weight_bytes = weight.nbytes()
        if self.use_kernel:
            codes, scales, mins = kernel_tensors(weight, allow_half=True)
            self.register_buffer("codes", codes, persistent=False)
            self.register_buffer("scales", scales, persistent=False)
            self.register_buffer("mins", mins, persistent=False)
        else:
            self.weight = weight

    def forward(self, x: torch.Tensor, float_out: bool = False) -> torch.Tensor:
        if self.use_kernel:
            return torch.ops.axon_cpu.quant_linear(
                x,
                self.codes,
                self.kind,
                self.scales,
                self.mins,
                self.group,
                self.out_features,
                self.bias,
                float_out,
            )
        w = self.weight.dequantize().to(device=x.device, dtype=x.dtype)
        y = F.linear(x, w, self.bias)
        return y.float() if float_out else y

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"codes={KIND_NAMES[self.kind]}, group={self.group}, bias={self.bias is not None}"
        )


def quantize_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of x -> int8 codes (as float64) and per-row scales: amax / 127, rounded to nearest even."""
    rows = x.float().reshape(-1, x.shape[-1])
    amax = rows.abs().amax(dim=1, keepdim=True)
    scales = torch.where(amax > 0, amax / 127.0, torch.ones_like(amax))
    return torch.round(rows * (1.0 / scales)).clamp(-127, 127).double(), scales


class W8A8Linear(nn.Module):
    """int8 weights (one scale per output channel) times activations quantized to int8 per row at
    each call, summed in int32 (``cpu_linear_w8a8.h``): AMX-INT8 or AVX-512 VNNI. Without the
    kernel, the same arithmetic in float64 (exact for these sums)."""

    def __init__(self, weight: QuantizedWeight, bias: torch.Tensor | None, use_kernel: bool) -> None:
        super().__init__()
        assert weight.kind == KIND_INT8 and weight.group == weight.shape[1], "w8a8: per-channel int8"
        self.out_features, self.in_features = weight.shape
        self.register_buffer("bias", bias, persistent=False)
        self.use_kernel = use_kernel and self.in_features % 64 == 0 and w8a8_kernel_supported()
        self.weight_bytes = weight.nbytes()
        n, k = weight.shape
        panels = -(-n // GROUP_COLS)
        codes = torch.zeros(panels * GROUP_COLS, k, dtype=torch.int8)
        codes[:n] = weight.codes
        scales = torch.zeros(panels * GROUP_COLS)
        scales[:n] = weight.scales[:, 0]
        if self.use_kernel:  # [panel][k / 4][block][column][k % 4]
            quads = codes.view(panels, 4, 16, k // 4, 4).permute(0, 3, 1, 2, 4).contiguous().view(-1)
            self.register_buffer("codes", quads, persistent=False)
            self.register_buffer("col_sums", codes.sum(dim=1, dtype=torch.int32), persistent=False)
        else:
            self.register_buffer("codes", codes[:n], persistent=False)
        self.register_buffer("w_scales", scales, persistent=False)

    def forward(self, x: torch.Tensor, float_out: bool = False) -> torch.Tensor:
        if self.use_kernel:
            return torch.ops.axon_cpu.w8a8_linear(
                x, self.codes, self.w_scales, self.col_sums, self.out_features, self.bias, float_out
            )
        xq, x_scales = quantize_activations(x)
        acc = (xq @ self.codes.double().T).float()
        y = acc * (x_scales * self.w_scales[: self.out_features])
        if self.bias is not None:
            y = y + self.bias.float()
        y = y.view(*x.shape[:-1], self.out_features)
        return y if float_out else y.to(x.dtype)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, w8a8, bias={self.bias is not None}"


def w8a8_kernel_supported() -> bool:
    ops = torch.ops.axon_cpu
    return hasattr(ops, "w8a8_linear_supported") and bool(ops.w8a8_linear_supported())


def quantize_experts(
    model: nn.Module,
    method: str,
    group_size: int | None,
    use_kernel: bool,
    given: dict[str, QuantizedWeight] | None = None,
) -> int:
    """Every ``FusedMoE``'s experts to ``method``'s codes, each expert's gate/up and down weights
    quantized on their own as a linear layer's would be (``w8a8``: int8 weight-only codes, the
    activations staying bf16). ``given`` (gguf): HF weight name -> a GGUF file's blocks
    (``...mlp.experts.{e}.gate_proj.weight``, ...): a block keeps its experts' blocks as they are
    where it has every one and its share of them is whole groups, else stays as loaded.

    Where the fused op runs (``use_kernel``, axon's quantized kernel on this CPU) the block keeps
    only the codes and runs ``fused_moe_quant``; elsewhere its weights are replaced by the
    dequantized codes (the same numbers, on the loop; a GGUF block already holds them). Returns
    how many blocks hold codes or their values."""
    form = "int8" if method == "w8a8" else method
    count = 0
    for name, block in model.named_modules():
        if not isinstance(block, FusedMoE):
            continue
        if given is not None:
            pair = _gguf_experts(name, block, given)
            if pair is None:
                continue
            w13, w2 = pair
        else:
            with torch.no_grad():
                w13 = [quantize_weight(w, form, group_size) for w in block.w13_weight.detach()]
                w2 = [quantize_weight(w, form, group_size) for w in block.w2_weight.detach()]
        count += 1
        groups = (w13[0].group, w2[0].group)
        if use_kernel and all(g % 16 == 0 for g in groups) and quant_kernel_supported():
            tensors = [[kernel_tensors(q, allow_half=False) for q in w] for w in (w13, w2)]
            stacked = [
                [
                    torch.stack([t[i] for t in per_expert]) if per_expert[0][i] is not None else None
                    for i in range(3)
                ]
                for per_expert in tensors
            ]
            kinds = (w13[0].kind, w2[0].kind)
            block.use_quantized(kinds, groups, stacked[0], stacked[1], sum(q.nbytes() for q in w13 + w2))
        elif given is None:
            with torch.no_grad():
                block.w13_weight.copy_(torch.stack([q.dequantize() for q in w13]))
                block.w2_weight.copy_(torch.stack([q.dequantize() for q in w2]))
    return count


def _gguf_experts(
    name: str, block: FusedMoE, given: dict[str, QuantizedWeight]
) -> tuple[list[QuantizedWeight], list[QuantizedWeight]] | None:
    """This rank's experts of the block at module ``name`` from a GGUF file's blocks: each
    expert's gate and up rows (its share of the width) merged, and its down weight's columns of
    that share; None where an expert is missing or the share splits a group of inputs."""
    prefix = name.removesuffix(".experts")
    first, width = block.intermediate_start, block.intermediate_size
    rows = torch.arange(first, first + width)
    w13, w2 = [], []
    for e in range(block.first_expert, block.first_expert + block.num_local_experts):
        parts = [given.get(f"{prefix}.experts.{e}.{p}_proj.weight") for p in ("gate", "up", "down")]
        if any(p is None for p in parts):
            return None
        gate, up, down = parts
        if first % down.group or width % down.group:
            return None
        w13.append(concat_rows([gate.permute_rows(rows), up.permute_rows(rows)]))
        w2.append(down.select_columns(first, width))
    if (
        len({(q.kind, q.group, q.mins is None) for q in w13}) > 1
        or len({(q.kind, q.group, q.mins is None) for q in w2}) > 1
    ):
        return None  # the stacked op takes one form per weight
    return w13, w2


def quantize_linears(
    model: nn.Module,
    method: str,
    group_size: int | None,
    use_kernel: bool,
    given: dict[str, QuantizedWeight] | None = None,
) -> int:
    """Replace every ``nn.Linear`` in ``model`` with a ``QuantLinear``; returns how many.

    ``given`` (gguf): module name -> its weight already quantized (the file's blocks, the LM head's
    included); a layer not in it stays as it is (a GGUF tensor stored as F32/F16 has no codes).
    Other methods quantize each layer's own weight, all but the MoE routers and, but for
    ``QUANTIZED_LM_HEAD``'s methods, the LM head (vLLM's convention: the logits are the most
    sensitive to rounding; on SmolLM2, fp8 with the head in bf16 keeps 92% top-1 agreement with
    bf16 over 1,000 positions, 84.5% with the head in FP8). The layer keeps its own copy: a
    weight tied to an embedding stays with the embedding, in full precision.
    """
    targets = [
        (parent, name, child, f"{parent_name}.{name}" if parent_name else name)
        for parent_name, parent in model.named_modules()
        for name, child in parent.named_children()
        if isinstance(child, nn.Linear)
    ]
    count = 0
    for parent, name, child, full_name in targets:
        if given is None and full_name == "lm_head" and method not in QUANTIZED_LM_HEAD:
            continue  # as vLLM: the LM head stays in the model's dtype
        if given is None and isinstance(getattr(parent, "experts", None), FusedMoE):
            continue  # a mixture of experts' router: its top-k choice is the most sensitive part
        if given is not None:
            weight = given.get(full_name)
            if weight is None:
                continue
            if weight.shape != tuple(child.weight.shape):
                raise ValueError(
                    f"{full_name}: quantized weight {weight.shape} for a {tuple(child.weight.shape)} layer"
                )
        else:
            weight = quantize_weight(
                child.weight.detach(), "int8" if method == "w8a8" else method, group_size
            )
        bias = child.bias.detach() if child.bias is not None else None
        layer_class = W8A8Linear if method == "w8a8" else QuantLinear
        layer = layer_class(weight, bias, use_kernel)
        keep_output_sizes(child, layer)
        setattr(parent, name, layer)
        count += 1
    return count
