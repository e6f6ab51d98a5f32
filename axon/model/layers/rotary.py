"""Rotary position embedding with the rope scalings of the supported families.

Rotation is "neox" style (rotate the two halves of each head), as Hugging Face's Llama, Qwen2,
Qwen3 and Mistral do. cos/sin are precomputed for every position up to max_position.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from axon.platforms.cpu_kernels import use_cpu_kernels

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "dynamic", "yarn")


def rope_parameters(hf_config: dict[str, Any]) -> tuple[float, dict[str, Any]]:
    """(rope_theta, scaling dict) from either transformers<5 keys or the newer rope_parameters."""
    params = dict(hf_config.get("rope_parameters") or {})
    legacy = hf_config.get("rope_scaling") or {}
    theta = float(params.pop("rope_theta", hf_config.get("rope_theta", 10000.0)))
    scaling = {**legacy, **params}
    if "type" in scaling and "rope_type" not in scaling:
        scaling["rope_type"] = scaling.pop("type")
    scaling.setdefault("rope_type", "default")
    return theta, scaling


def _inv_freq(rotary_dim: int, theta: float, scaling: dict[str, Any]) -> torch.Tensor:
    # [rotary_dim // 2]
    inv_freq = 1.0 / (theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim))
    kind = scaling["rope_type"]
    if kind in ("default", "dynamic"):
        # dynamic NTK only changes frequencies past the original context; axon caps
        # max_model_len at the trained length, where it equals default.
        return inv_freq
    if kind == "linear":
        return inv_freq / float(scaling["factor"])
    if kind == "yarn":
        return _yarn_inv_freq(inv_freq, rotary_dim, theta, scaling)
    if kind == "llama3":
        factor = float(scaling["factor"])
        low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
        old_len = float(scaling["original_max_position_embeddings"])
        low_wavelen, high_wavelen = old_len / low, old_len / high
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        is_medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return torch.where(is_medium, smoothed, scaled)
    raise ValueError(f"rope_type {kind!r} is not supported; supported: {', '.join(SUPPORTED_ROPE_TYPES)}")


def _yarn_inv_freq(
    extrapolation: torch.Tensor, rotary_dim: int, theta: float, scaling: dict[str, Any]
) -> torch.Tensor:
    """YaRN (transformers' ``_compute_yarn_parameters``): the original frequencies for the
    dimensions that rotate fast within the original context, the interpolated ones (divided by
    ``factor``) for the slow ones, a linear ramp between ``beta_fast`` and ``beta_slow`` rotations."""
    factor = float(scaling["factor"])
    old_len = float(scaling["original_max_position_embeddings"])
    beta_fast, beta_slow = float(scaling.get("beta_fast") or 32), float(scaling.get("beta_slow") or 1)

    def correction_dim(rotations: float) -> float:
        return rotary_dim * math.log(old_len / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, rotary_dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(rotary_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp  # the share of each dimension's original frequency
    return extrapolation / factor * (1 - keep) + extrapolation * keep


def attention_factor(scaling: dict[str, Any]) -> float:
    """What YaRN multiplies cos and sin by (``attention_factor``, else 0.1 ln(factor) + 1, with
    DeepSeek's mscale / mscale_all_dim where given); 1 for every other rope type."""
    if scaling["rope_type"] != "yarn":
        return 1.0
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    factor = float(scaling["factor"])

    def mscale(m: float) -> float:
        return 1.0 if factor <= 1 else 0.1 * m * math.log(factor) + 1.0

    if scaling.get("mscale") and scaling.get("mscale_all_dim"):
        return mscale(float(scaling["mscale"])) / mscale(float(scaling["mscale_all_dim"]))
    return mscale(1.0)


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, max_position: int, theta: float, scaling: dict[str, Any]) -> None:
        super().__init__()
        self.head_dim, self.max_position, self.theta, self.scaling = head_dim, max_position, theta, scaling
        self.register_buffer(
            "cos_cached", torch.empty(max_position, head_dim, dtype=torch.float32), persistent=False
        )
        self.register_buffer(
            "sin_cached", torch.empty(max_position, head_dim, dtype=torch.float32), persistent=False
        )
        if self.cos_cached.device.type != "meta":
            self.reset_buffers()

    def reset_buffers(self) -> None:
        """(Re)compute the cos/sin tables in float32 on the buffers' device."""
        device = self.cos_cached.device
        inv_freq = _inv_freq(self.head_dim, self.theta, self.scaling)
        t = torch.arange(self.max_position, dtype=torch.float32)
        freqs = torch.outer(t, inv_freq)  # [max_position, head_dim // 2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [max_position, head_dim]
        scale = attention_factor(self.scaling)
        self.cos_cached = (emb.cos() * scale).to(device)
        self.sin_cached = (emb.sin() * scale).to(device)

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # positions [T]; q [T, H, D]; k [T, KVH, D]
        if use_cpu_kernels(q):
            return torch.ops.axon_cpu.rotary_neox(positions, q, k, self.cos_cached, self.sin_cached)
        cos = self.cos_cached[positions].to(q.dtype).unsqueeze(1)  # [T, 1, D]
        sin = self.sin_cached[positions].to(q.dtype).unsqueeze(1)
        return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class MRotaryEmbedding(RotaryEmbedding):
    """Multimodal rotary embedding (M-RoPE, Qwen2-VL to Qwen3-VL): a token has three positions
    (temporal, height, width), and each rotary frequency takes one of them. With
    ``mrope_section`` [t, h, w] and ``interleaved`` (Qwen3-VL) frequency i takes the height
    position when i % 3 == 1 and i < 3h, the width position when i % 3 == 2 and i < 3w, else the
    temporal one; not interleaved (Qwen2-VL), the first t frequencies take t, the next h take h,
    the last w take w. A text token's three positions are equal, so ``positions`` [T] (every token
    text) is plain rotary; [3, T] rotates the image tokens of a prefill by their grid."""

    def __init__(
        self,
        head_dim: int,
        max_position: int,
        theta: float,
        scaling: dict[str, Any],
        mrope_section: list[int],
        interleaved: bool,
    ) -> None:
        super().__init__(head_dim, max_position, theta, scaling)
        half = head_dim // 2
        if sum(mrope_section) != half:
            raise ValueError(f"mrope_section {mrope_section} must sum to head_dim / 2 = {half}")
        t, h, w = mrope_section
        if interleaved:
            rows = [
                1 if i % 3 == 1 and i < 3 * h else 2 if i % 3 == 2 and i < 3 * w else 0 for i in range(half)
            ]
        else:
            rows = [0] * t + [1] * h + [2] * w
        # Which of the three positions each of the head's dims rotates by (a tuple: no tensor
        # is built on the meta device with the model).
        self.section_rows = tuple(rows + rows)

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # positions [T] or [3, T]; q [T, H, D]; k [T, KVH, D]
        if positions.dim() == 1:
            return super().forward(positions, q, k)
        dims = torch.arange(self.head_dim, device=positions.device)
        rows = torch.tensor(self.section_rows, device=positions.device)
        table_pos = positions[rows].T  # [T, D]: the position each dim rotates by
        cos = self.cos_cached[table_pos, dims].to(q.dtype).unsqueeze(1)  # [T, 1, D]
        sin = self.sin_cached[table_pos, dims].to(q.dtype).unsqueeze(1)
        return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin
