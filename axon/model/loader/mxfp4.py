"""MXFP4 (OCP microscaling, FP4 E2M1 values in blocks of 32 sharing one E8M0 scale), as GPT-OSS
checkpoints store their experts: ``<name>_blocks`` uint8 [..., rows, in / 32, 16] (two 4-bit codes
a byte, the low nibble first) and ``<name>_scales`` uint8 [..., rows, in / 32] (the block's
power of two, biased by 127).

axon dequantizes them once at load, into the model's dtype: the experts then run on the same
kernels as any other bf16 or float32 weight (the fused MoE op in bf16). An FP4 code times a
power of two is exact in bf16 (and float32), so nothing is lost beyond what MXFP4 lost.
"""

from __future__ import annotations

import torch

# The 16 FP4 E2M1 codes: sign, two exponent bits, one mantissa bit.
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[..., rows, G, 16] codes and [..., rows, G] scales -> [..., rows, G * 32] in ``dtype``."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError(f"MXFP4 blocks and scales must be uint8, got {blocks.dtype} and {scales.dtype}")
    if blocks.shape[:-1] != scales.shape or blocks.shape[-1] != 16:
        raise ValueError(
            f"MXFP4 blocks {tuple(blocks.shape)} and scales {tuple(scales.shape)} do not match "
            "([..., G, 16] and [..., G])"
        )
    lut = torch.tensor(FP4_VALUES, dtype=torch.float32)
    codes = torch.stack([blocks & 0x0F, blocks >> 4], dim=-1).long()  # [..., G, 16, 2]: low nibble first
    values = lut[codes].flatten(-3)  # [..., G * 32]
    exponents = (scales.to(torch.int32) - 127).repeat_interleave(32, dim=-1)
    return torch.ldexp(values, exponents.float()).to(dtype)


def quantize_mxfp4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[..., rows, in] (in a multiple of 32) -> (blocks, scales): each block of 32 scaled by the
    power of two that brings its largest magnitude to at most 6, each value rounded to the
    nearest FP4 code. For tests and for writing checkpoints in OpenAI's layout."""
    *prefix, inputs = weight.shape
    if inputs % 32:
        raise ValueError(f"MXFP4 needs a multiple of 32 inputs, got {inputs}")
    groups = weight.float().reshape(*prefix, inputs // 32, 32)
    peak = groups.abs().amax(dim=-1).clamp_min(2.0**-126)
    exponent = torch.ceil(torch.log2(peak / 6.0)).clamp(-127, 127)
    scaled = groups / torch.ldexp(torch.ones_like(exponent), exponent)[..., None]
    magnitudes = torch.tensor(FP4_VALUES[:8])
    code = (scaled.abs()[..., None] - magnitudes).abs().argmin(dim=-1)  # nearest magnitude
    code = code + 8 * (scaled < 0).long()
    code = code.reshape(*prefix, inputs // 32, 16, 2)
    blocks = (code[..., 0] | (code[..., 1] << 4)).to(torch.uint8)
    return blocks, (exponent + 127).to(torch.uint8)
