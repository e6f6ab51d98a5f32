"""A multimodal request's images on the worker: encoded once, when the request first runs, then
fed to each step that computes some of their tokens (a chunked prefill may split an image).

The vision tower's features replace the image placeholders' embeddings, and a prompt with
images takes M-RoPE positions ([3, T]: an image token's (t, h, w) grid position): text tokens'
three positions are equal, so a step without image tokens keeps plain positions (shifted by
the request's delta once past the prompt) and may run in a compiled graph; a step with image
tokens runs eagerly. Features are kept by image digest (``EncoderCache``), so an image that
returns is not encoded again.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from axon.kv_transfer.ec_connector import ECSharedStorageConnector, Features
from axon.model.models.llama import EmbedRows
from axon.model.models.qwen3_vl import mrope_positions


@dataclass
class RequestImages:
    token_rows: torch.Tensor  # [n] the prompt index of each image token, ascending
    embeds: torch.Tensor  # [n, hidden] their features
    deepstack: list[torch.Tensor]  # each [n, hidden]
    positions: torch.Tensor  # [3, prompt length] M-RoPE positions
    delta: int  # a position p past the prompt is p + delta
    prompt_len: int

    def positions_for(self, start: int, end: int) -> torch.Tensor:
        """[3, end - start] positions of indices start .. end - 1: the prompt's M-RoPE ones, then
        p + delta on all three rows."""
        p = torch.arange(start, end)
        out = (p + self.delta).expand(3, -1).clone()
        prompt = p < self.prompt_len
        out[:, prompt] = self.positions[:, p[prompt]]
        return out

    def rows_in(self, start: int, end: int) -> torch.Tensor:
        """Indices (into token_rows) of the image tokens among prompt indices start .. end - 1."""
        lo = int(torch.searchsorted(self.token_rows, start))
        hi = int(torch.searchsorted(self.token_rows, end))
        return torch.arange(lo, hi)


class EncoderCache:
    """Vision features by image digest, so an image that returns (the same picture in another
    request or turn) is not encoded again: least recently used first out once they hold more
    than ``max_tokens`` image tokens (vLLM's encoder cache, on the worker's device)."""

    def __init__(self, max_tokens: int = 4096) -> None:
        self.max_tokens = max_tokens
        self.entries: OrderedDict[str, tuple[torch.Tensor, list[torch.Tensor]]] = OrderedDict()
        self.num_tokens = 0
        self.hits = self.misses = 0

    def get(self, digest: str) -> tuple[torch.Tensor, list[torch.Tensor]] | None:
        entry = self.entries.get(digest)
        if entry is not None:
            self.entries.move_to_end(digest)
        return entry

    def put(self, digest: str, embeds: torch.Tensor, deepstack: list[torch.Tensor]) -> None:
        if digest in self.entries or embeds.shape[0] > self.max_tokens:
            return
        self.entries[digest] = (embeds, deepstack)
        self.num_tokens += embeds.shape[0]
        while self.num_tokens > self.max_tokens:
            _, (old, _) = self.entries.popitem(last=False)
            self.num_tokens -= old.shape[0]


def encode_request_images(
    model: nn.Module,
    requests: list[tuple[list[int], list[Any]]],
    cache: EncoderCache | None = None,
    ec: ECSharedStorageConnector | None = None,
) -> list[RequestImages]:
    """Requests' images (each a prompt and its engine ImageInputs, in order) through the vision
    tower (see ``encode_images``), with the M-RoPE positions of each prompt."""
    images = [i for _, request_images in requests for i in request_images]
    found = encode_images(model.visual, images, cache, ec)
    return [_request_images(model, prompt, request_images, found) for prompt, request_images in requests]


def encode_images(
    tower: nn.Module,
    images: list[Any],
    cache: EncoderCache | None = None,
    ec: ECSharedStorageConnector | None = None,
) -> dict[str, Features]:
    """Features by digest of ``images`` (engine ImageInputs): those the cache holds taken from it,
    then (an EC consumer) those an encoder server stored loaded, all the others encoded together
    in one call of the vision ``tower`` (their attention packed in one op); an EC producer
    stores what it encoded."""
    found: dict[str, Features | None] = (
        {i.digest: cache.get(i.digest) for i in images} if cache is not None else {}
    )
    todo = list({i.digest: i for i in images if found.get(i.digest) is None}.values())
    if ec is not None and ec.settings.is_consumer and todo:
        param = tower.pos_embed.weight
        shape = (tower.out_dim, len(tower.deepstack_visual_indexes))
        for image in todo:
            found[image.digest] = ec.load(image.digest, image.num_tokens, *shape, param.device, param.dtype)
        todo = [i for i in todo if found[i.digest] is None]
    if todo:
        pixels = torch.cat(
            [
                torch.frombuffer(bytearray(i.pixel_values), dtype=torch.float32).view(-1, i.patch_dim)
                for i in todo
            ]
        )
        out = tower(pixels, [tuple(i.grid_thw) for i in todo])
        start = 0
        for image in todo:
            end = start + image.num_tokens
            found[image.digest] = (out.embeds[start:end], [d[start:end] for d in out.deepstack])
            if ec is not None and ec.settings.is_producer:
                ec.save(image.digest, *found[image.digest])
            start = end
    if cache is not None:
        for digest, features in found.items():
            cache.put(digest, *features)  # type: ignore[misc]
        cache.misses += len(todo)
        cache.hits += len(images) - len(todo)
    return found  # type: ignore[return-value]


def _request_images(
    model: nn.Module, prompt_token_ids: list[int], images: list[Any], found: dict
) -> RequestImages:
    embeds = torch.cat([found[i.digest][0] for i in images])
    num_deepstack = len(found[images[0].digest][1])
    deepstack = [torch.cat([found[i.digest][1][k] for i in images]) for k in range(num_deepstack)]
    token_rows = torch.cat([torch.arange(i.offset, i.offset + i.num_tokens) for i in images])
    assert token_rows.numel() == embeds.shape[0], "the images' tokens and features differ in number"
    grids = [tuple(i.grid_thw) for i in images]
    positions, delta = mrope_positions(prompt_token_ids, grids, model.image_token_id, model.merge)
    return RequestImages(token_rows, embeds, deepstack, positions, delta, len(prompt_token_ids))


def step_images(parts: list[tuple[RequestImages, int, int, int]], device: torch.device) -> EmbedRows | None:
    """The image tokens of a step's ``parts`` (a request's images, its first and end index this
    step, its first row in the step) as the model takes them; None: the step has none."""
    rows, picks = [], []
    for images, start, end, row0 in parts:
        idx = images.rows_in(start, end)
        if idx.numel() == 0:
            continue
        rows.append(images.token_rows[idx] - start + row0)
        picks.append((images, idx))
    if not rows:
        return None
    embeds = torch.cat([im.embeds[idx] for im, idx in picks])
    num_deepstack = len(picks[0][0].deepstack)
    deepstack = [torch.cat([im.deepstack[k][idx] for im, idx in picks]) for k in range(num_deepstack)]
    return EmbedRows(torch.cat(rows).to(device), embeds, deepstack)
