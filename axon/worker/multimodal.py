"""A multimodal request's images on the worker: encoded once, when the request first runs, then
fed to each step that computes some of their tokens (a chunked prefill may split an image).

The vision tower's features replace the image placeholders' embeddings, and a prompt with
images takes M-RoPE positions ([3, T]: an image token's (t, h, w) grid position): text tokens'
three positions are equal, so a step without image tokens keeps plain positions (shifted by
the request's delta once past the prompt) and may run in a compiled graph; a step with image
tokens runs eagerly.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from axon.model.models.qwen3_vl import ImageRows, mrope_positions


@dataclass
class RequestImages:
    token_rows: torch.Tensor  # [n] the prompt index of each image token, ascending
    embeds: torch.Tensor  # [n, hidden] their features
    deepstack: list[torch.Tensor]  # each [n, hidden]
    positions: torch.Tensor  # [3, prompt length] M-RoPE positions
    delta: int  # a position p past the prompt is p + delta
    prompt_len: int

    def position(self, p: int) -> int:
        """The (shared) position of a text token at index p."""
        return int(self.positions[0, p]) if p < self.prompt_len else p + self.delta

    def rows_in(self, start: int, end: int) -> torch.Tensor:
        """Indices (into token_rows) of the image tokens among prompt indices start .. end - 1."""
        lo = int(torch.searchsorted(self.token_rows, start))
        hi = int(torch.searchsorted(self.token_rows, end))
        return torch.arange(lo, hi)


def encode_request_images(model: nn.Module, prompt_token_ids: list[int], images: list[Any]) -> RequestImages:
    """Run the vision tower over a request's images (engine.messages.ImageInput, in order)."""
    param = next(model.parameters())
    pixels = torch.cat(
        [
            torch.frombuffer(bytearray(i.pixel_values), dtype=torch.float32).view(-1, i.patch_dim)
            for i in images
        ]
    ).to(param.device)
    grids = [tuple(i.grid_thw) for i in images]
    out = model.encode_images(pixels, grids)
    token_rows = torch.cat([torch.arange(i.offset, i.offset + i.num_tokens) for i in images])
    assert token_rows.numel() == out.embeds.shape[0], "the images' tokens and features differ in number"
    positions, delta = mrope_positions(prompt_token_ids, grids, model.image_token_id, model.merge)
    return RequestImages(token_rows, out.embeds, out.deepstack, positions, delta, len(prompt_token_ids))


def step_images(
    parts: list[tuple[RequestImages, int, int, int]], device: torch.device
) -> tuple[ImageRows, list[tuple[int, torch.Tensor]]] | None:
    """The image tokens of a step's ``parts`` (a request's images, its first and end index this
    step, its first row in the step): their ImageRows, and per part (first row, its 3-row
    positions over the whole segment) to write into the step's positions; None: no image token."""
    rows, picks, positions = [], [], []
    for images, start, end, row0 in parts:
        idx = images.rows_in(start, end)
        if idx.numel() == 0:
            continue
        rows.append(images.token_rows[idx] - start + row0)
        picks.append((images, idx))
        p = torch.arange(start, end)
        pos = (p + images.delta).expand(3, -1).clone()
        prompt = p < images.prompt_len
        pos[:, prompt] = images.positions[:, p[prompt]]
        positions.append((row0, pos))
    if not rows:
        return None
    embeds = torch.cat([im.embeds[idx] for im, idx in picks])
    num_deepstack = len(picks[0][0].deepstack)
    deepstack = [torch.cat([im.deepstack[k][idx] for im, idx in picks]) for k in range(num_deepstack)]
    return ImageRows(torch.cat(rows).to(device), embeds, deepstack), positions
