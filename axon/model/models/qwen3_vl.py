"""Qwen3-VL (``Qwen3VLForConditionalGeneration``): a vision tower whose merged patch features
take the place of a prompt's image placeholder tokens, and Qwen3's decoder with M-RoPE.

Vision tower (``Qwen3VLVisionModel``), per image of ``grid_thw`` (t, h, w) patches:

    patches [t*h*w, C*T*P*P] -> patch_embed (a Conv3d with kernel = stride: one linear map)
      + learned position embeddings (a square table bilinearly resampled to the image's h x w)
      -> depth ViT blocks (LayerNorm, bidirectional attention within the image with 2-D rotary
         positions (row, column), GELU-tanh MLP); the images of one call are packed into one
         attention op (axon's C++ ``encoder_attention``: each attends to its own patches, no
         padding), torch's SDPA per image elsewhere
      -> merger: every 2x2 patches (consecutive: the processor emits them in merge-block order)
         concatenated and projected to the decoder's width: one token per 4 patches.
    "Deepstack": after the blocks in ``deepstack_visual_indexes`` a merger of their own turns the
    stream into more features of the same tokens, which are added to the decoder's hidden states
    at the image tokens after its first layers (one per feature).

Decoder: Qwen3 (q/k norms) with ``MRotaryEmbedding``: each token's (t, h, w) positions, text
tokens all three equal (``mrope_positions``).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from axon.model.layers.attention.backend import AttentionBackend
from axon.model.layers.attention.encoder import encoder_attention
from axon.model.layers.rotary import MRotaryEmbedding
from axon.model.models.llama import STACKED_PARAMS, Qwen3ForCausalLM
from axon.model.models.weights import load_by_name
from axon.platforms.cpu_kernels import use_cpu_kernels

# ---- the vision tower ----


class VisionAttention(nn.Module):
    def __init__(self, dim: int, num_heads: int) -> None:
        super().__init__()
        self.num_heads, self.head_dim = num_heads, dim // num_heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cu_seqlens: list[int]
    ) -> torch.Tensor:
        t = x.shape[0]
        q, k, v = self.qkv(x).view(t, 3, self.num_heads, self.head_dim).unbind(1)
        # Rotary in float32, as transformers' apply_rotary_pos_emb_vision.
        q, k = (_rotate(y.float(), cos, sin).to(x.dtype) for y in (q, k))
        scale = self.head_dim**-0.5
        if use_cpu_kernels(q):  # every image of the call in one packed op: no padding, no mask
            out = torch.ops.axon_cpu.encoder_attention(
                q, k, v.contiguous(), torch.tensor(cu_seqlens, dtype=torch.int32), scale
            )
        else:
            out = encoder_attention(q, k, v, cu_seqlens, scale)
        return self.proj(out.reshape(t, -1))


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None] + rotated * sin[:, None]


class VisionBlock(nn.Module):
    def __init__(self, dim: int, num_heads: int, intermediate: int) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(dim, eps=1e-6)
        self.norm2 = nn.LayerNorm(dim, eps=1e-6)
        self.attn = VisionAttention(dim, num_heads)
        self.mlp = nn.Module()
        self.mlp.linear_fc1 = nn.Linear(dim, intermediate)
        self.mlp.linear_fc2 = nn.Linear(intermediate, dim)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cu_seqlens: list[int]
    ) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), cos, sin, cu_seqlens)
        h = F.gelu(self.mlp.linear_fc1(self.norm2(x)), approximate="tanh")
        return x + self.mlp.linear_fc2(h)


class PatchMerger(nn.Module):
    """Every ``merge ** 2`` consecutive patches -> one token of ``out_dim``: LayerNorm (per
    patch, or over the concatenation with ``postshuffle_norm``), then a GELU MLP."""

    def __init__(self, dim: int, merge: int, out_dim: int, postshuffle_norm: bool) -> None:
        super().__init__()
        self.merged = dim * merge**2
        self.postshuffle_norm = postshuffle_norm
        self.norm = nn.LayerNorm(self.merged if postshuffle_norm else dim, eps=1e-6)
        self.linear_fc1 = nn.Linear(self.merged, self.merged)
        self.linear_fc2 = nn.Linear(self.merged, out_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = (
            self.norm(x.view(-1, self.merged))
            if self.postshuffle_norm
            else self.norm(x).view(-1, self.merged)
        )
        return self.linear_fc2(F.gelu(self.linear_fc1(x)))


@dataclass
class VisionOutput:
    embeds: torch.Tensor  # [tokens, out_dim]: every image's tokens, in order
    deepstack: list[torch.Tensor]  # per deepstack layer, [tokens, out_dim]


class Qwen3VLVisionModel(nn.Module):
    def __init__(self, cfg: dict[str, Any]) -> None:
        super().__init__()
        dim, self.num_heads = cfg["hidden_size"], cfg["num_heads"]
        self.merge = cfg.get("spatial_merge_size", 2)
        self.patch_dim = (
            cfg.get("in_channels", 3) * cfg.get("temporal_patch_size", 2) * cfg.get("patch_size", 16) ** 2
        )
        self.patch_embed = nn.Module()
        self.patch_embed.proj = nn.Linear(self.patch_dim, dim)  # the Conv3d, flattened
        self.pos_embed = nn.Embedding(cfg["num_position_embeddings"], dim)
        self.side = int(cfg["num_position_embeddings"] ** 0.5)
        head_dim = dim // self.num_heads
        self.rope_theta = float((cfg.get("rope_parameters") or {}).get("rope_theta", 10000.0))
        self.rotary_dim = head_dim // 2  # rows and columns rotate half of a head each
        self.register_buffer("inv_freq", torch.empty(self.rotary_dim // 2), persistent=False)
        if self.inv_freq.device.type != "meta":
            self.reset_buffers()
        self.out_dim = out = cfg["out_hidden_size"]
        self.blocks = nn.ModuleList(
            VisionBlock(dim, self.num_heads, cfg["intermediate_size"]) for _ in range(cfg["depth"])
        )
        self.merger = PatchMerger(dim, self.merge, out, postshuffle_norm=False)
        self.deepstack_visual_indexes = list(cfg.get("deepstack_visual_indexes") or [])
        self.deepstack_merger_list = nn.ModuleList(
            PatchMerger(dim, self.merge, out, postshuffle_norm=True) for _ in self.deepstack_visual_indexes
        )

    def reset_buffers(self) -> None:
        """The rotary frequencies (a buffer: recomputed after a model is built on the meta device)."""
        spatial = self.rotary_dim
        exponent = torch.arange(0, spatial, 2, dtype=torch.float32) / spatial
        self.inv_freq = (1.0 / self.rope_theta**exponent).to(self.pos_embed.weight.device)

    def _positions(self, grids: Sequence[tuple[int, int, int]]) -> tuple[torch.Tensor, torch.Tensor]:
        """Per patch, in merge-block order: its learned position embedding (the table resampled
        bilinearly, corners aligned, to the image's grid) and its (row, column)."""
        m, table = self.merge, self.pos_embed.weight
        square = table.view(self.side, self.side, -1).permute(2, 0, 1)[None].float()  # [1, D, S, S]

        def merge_order(x: torch.Tensor) -> torch.Tensor:  # [h, w, n] -> [h * w, n], block by block
            h, w, n = x.shape
            return x.reshape(h // m, m, w // m, m, n).permute(0, 2, 1, 3, 4).reshape(h * w, n)

        embeds, rows_cols = [], []
        for t, h, w in grids:
            grid = F.interpolate(square, size=(h, w), mode="bilinear", align_corners=True)[0]  # [D, h, w]
            embeds.append(merge_order(grid.permute(1, 2, 0)).repeat(t, 1))
            rc = torch.stack(torch.meshgrid(torch.arange(h), torch.arange(w), indexing="ij"), dim=-1)
            rows_cols.append(merge_order(rc).repeat(t, 1))
        return torch.cat(embeds).to(table.dtype), torch.cat(rows_cols).to(table.device)

    def forward(self, pixel_values: torch.Tensor, grids: Sequence[tuple[int, int, int]]) -> VisionOutput:
        """pixel_values [patches, patch_dim] of ``grids``' images, in order."""
        table = self.pos_embed.weight  # the tower's dtype and device (linears may be packed)
        pos_embeds, rows_cols = self._positions(grids)
        x = self.patch_embed.proj(pixel_values.to(table.device, table.dtype)) + pos_embeds
        freqs = rows_cols[..., None].float() * self.inv_freq  # [N, 2, head_dim / 4]
        freqs = torch.cat([freqs[:, 0], freqs[:, 1]], dim=-1)
        emb = torch.cat([freqs, freqs], dim=-1)  # [N, head_dim]
        cos, sin = emb.cos(), emb.sin()
        cu_seqlens = [0, *itertools.accumulate(h * w for t, h, w in grids for _ in range(t))]
        deepstack = []
        for i, block in enumerate(self.blocks):
            x = block(x, cos, sin, cu_seqlens)
            if i in self.deepstack_visual_indexes:
                deepstack.append(self.deepstack_merger_list[self.deepstack_visual_indexes.index(i)](x))
        return VisionOutput(self.merger(x), deepstack)


# ---- prompt positions ----


def mrope_positions(
    token_ids: Sequence[int], grids: Sequence[tuple[int, int, int]], image_token_id: int, merge: int
) -> tuple[torch.Tensor, int]:
    """[3, len(token_ids)] M-RoPE positions of a prompt whose image placeholders are already
    expanded (one run of ``image_token_id`` per image, ``grids`` in order), and the delta that
    every later position adds (position p >= len(token_ids) is p + delta on all three rows), as
    transformers' ``get_rope_index``: text advances one position per token; an image's tokens
    take (start, start + row, start + column) and the next text starts past its larger side."""
    ids = torch.tensor(list(token_ids))
    out = torch.empty(3, len(ids), dtype=torch.int64)
    current, i, images = 0, 0, iter(grids)
    for is_image, run in itertools.groupby(ids.tolist(), key=lambda t: t == image_token_id):
        n = len(list(run))
        if not is_image:
            out[:, i : i + n] = torch.arange(current, current + n)
            current += n
        else:
            try:
                t, h, w = next(images)
            except StopIteration:
                raise ValueError("more image placeholder runs than images") from None
            gt, gh, gw = t, h // merge, w // merge
            if n != gt * gh * gw:
                raise ValueError(f"an image of {gt * gh * gw} tokens has a run of {n} placeholders")
            tt, hh, ww = torch.meshgrid(torch.arange(gt), torch.arange(gh), torch.arange(gw), indexing="ij")
            out[:, i : i + n] = torch.stack([tt.reshape(-1), hh.reshape(-1), ww.reshape(-1)]) + current
            current += max(gh, gw)
        i += n
    delta = int(out.max()) + 1 - len(ids) if len(ids) else 0
    return out, delta


# ---- the model ----


class Qwen3VLForConditionalGeneration(Qwen3ForCausalLM):
    """forward(input_ids, positions, embeds=None): positions [T] or, for a step with image
    tokens, [3, T] (``mrope_positions``); ``embeds`` the step's image tokens' features from
    ``encode_images`` (``EmbedRows`` with the deepstack features)."""

    supports_tensor_parallel = False

    def __init__(self, hf_config: dict[str, Any], backend: AttentionBackend) -> None:
        super().__init__(hf_config, backend)
        rope = hf_config.get("rope_parameters") or hf_config.get("rope_scaling") or {}
        a = self.arch
        rotary = MRotaryEmbedding(
            a.head_dim,
            a.max_position,
            a.rope_theta,
            a.rope_scaling,
            list(rope.get("mrope_section") or [24, 20, 20]),
            bool(rope.get("mrope_interleaved", True)),
        )
        for layer in self.model.layers:
            layer.self_attn.rotary = rotary
        self.visual = Qwen3VLVisionModel(hf_config["vision_config"])
        self.image_token_id = int(hf_config["image_token_id"])
        self.merge = self.visual.merge

    def encode_images(
        self, pixel_values: torch.Tensor, grids: Sequence[tuple[int, int, int]]
    ) -> VisionOutput:
        return self.visual(pixel_values, grids)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        tied = self.arch.tie_word_embeddings

        def rename(name: str) -> str | None:
            if "rotary_emb.inv_freq" in name or (name == "lm_head.weight" and tied):
                return None
            for old, new in (("model.visual.", "visual."), ("model.language_model.", "model.")):
                if name.startswith(old):
                    return new + name[len(old) :]
            return name

        optional = frozenset({"lm_head.weight"} if tied else ())
        load_by_name(self, _flat_patch_embed(weights), rename, optional, STACKED_PARAMS)

    @staticmethod
    def vision_tower(hf_config: dict[str, Any]) -> Qwen3VLVisionModel:
        """The vision tower alone (an encoder server's model, ``--mm-encoder-only``)."""
        return Qwen3VLVisionModel(hf_config["vision_config"])

    @staticmethod
    def load_vision_weights(tower: Qwen3VLVisionModel, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """The checkpoint's vision weights into ``vision_tower``'s module; the rest is not read."""

        def rename(name: str) -> str | None:
            for prefix in ("model.visual.", "visual."):
                if name.startswith(prefix):
                    return name[len(prefix) :]
            return None

        load_by_name(tower, _flat_patch_embed(weights), rename)


def _flat_patch_embed(weights: Iterable[tuple[str, Any]]) -> Iterable[tuple[str, Any]]:
    """The checkpoint's tensors, its Conv3d patch embedding ([out, C, T, P, P]) as the linear map."""
    for name, tensor in weights:
        if name.endswith("patch_embed.proj.weight"):
            t = tensor.read() if hasattr(tensor, "read") else tensor
            tensor = t.reshape(t.shape[0], -1)
        yield name, tensor
