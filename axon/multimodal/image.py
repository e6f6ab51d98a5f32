"""Qwen-VL images: resizing, normalization and patches, as transformers' image processor computes
them (``Qwen2VLImageProcessorPil``, which Qwen2-VL, Qwen2.5-VL and Qwen3-VL share), with PIL and
numpy only.

An image becomes a grid of ``patch_size`` x ``patch_size`` patches whose sides are multiples of
``patch_size * merge_size`` (every ``merge_size`` x ``merge_size`` patches merge into one token of
the language model):

1. resized (bicubic) to the nearest such size whose pixel count lies in [min_pixels, max_pixels],
   keeping the aspect ratio (``smart_resize``);
2. scaled to [0, 1] and normalized per channel ((x - mean) / std);
3. cut into patches in merge-block order (the patches of one merged token are consecutive), each
   repeated ``temporal_patch_size`` times (an image is one frame of a video), flattened to
   ``channels * temporal_patch_size * patch_size ** 2`` values.

So an image gives ``pixel_values`` [grid_h * grid_w, patch_dim] and its grid (1, grid_h, grid_w),
and ``grid_h * grid_w / merge_size ** 2`` placeholder tokens in the prompt.
"""

from __future__ import annotations

import base64
import binascii
import io
import json
import math
import os
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass
from typing import Any

import numpy as np
from PIL import Image


@dataclass(frozen=True)
class ImageProcessorConfig:
    """A model folder's ``preprocessor_config.json`` (Qwen3-VL's defaults where it has none)."""

    patch_size: int = 16
    temporal_patch_size: int = 2
    merge_size: int = 2
    min_pixels: int = 65536
    max_pixels: int = 16777216
    image_mean: tuple[float, ...] = (0.5, 0.5, 0.5)
    image_std: tuple[float, ...] = (0.5, 0.5, 0.5)

    @staticmethod
    def from_folder(folder: str) -> ImageProcessorConfig:
        path = os.path.join(folder, "preprocessor_config.json")
        if not os.path.isfile(path):
            return ImageProcessorConfig()
        with open(path, encoding="utf-8") as f:
            raw: dict[str, Any] = json.load(f)
        size = raw.get("size") or {}
        default = ImageProcessorConfig()
        return ImageProcessorConfig(
            patch_size=int(raw.get("patch_size", default.patch_size)),
            temporal_patch_size=int(raw.get("temporal_patch_size", default.temporal_patch_size)),
            merge_size=int(raw.get("merge_size", default.merge_size)),
            min_pixels=int(size.get("shortest_edge", raw.get("min_pixels", default.min_pixels))),
            max_pixels=int(size.get("longest_edge", raw.get("max_pixels", default.max_pixels))),
            image_mean=tuple(float(v) for v in raw.get("image_mean", default.image_mean)),
            image_std=tuple(float(v) for v in raw.get("image_std", default.image_std)),
        )


@dataclass(frozen=True)
class ProcessedImage:
    pixel_values: np.ndarray  # [grid_h * grid_w, patch_dim] float32
    grid_thw: tuple[int, int, int]  # (1, grid_h, grid_w) in patches
    merge_size: int

    @property
    def num_tokens(self) -> int:
        """Placeholder tokens of the image in the language model's prompt."""
        t, h, w = self.grid_thw
        return t * h * w // self.merge_size**2


def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """The size nearest (height, width) with both sides multiples of ``factor`` and a pixel count
    in [min_pixels, max_pixels], the aspect ratio kept as closely as possible."""
    if max(height, width) / min(height, width) > 200:
        raise ValueError(f"an image's aspect ratio must be under 200, got {height} x {width} pixels")
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt(height * width / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def to_rgb(image: Image.Image) -> Image.Image:
    """RGB; a transparent image is laid on white first (as transformers' ``convert_to_rgb``)."""
    if image.mode == "RGB":
        return image
    if image.mode in ("RGBA", "LA", "P"):
        rgba = image.convert("RGBA")
        background = Image.new("RGBA", rgba.size, (255, 255, 255))
        return Image.alpha_composite(background, rgba).convert("RGB")
    return image.convert("RGB")


def process_image(image: Image.Image, config: ImageProcessorConfig) -> ProcessedImage:
    """One image's patches and grid (the module docstring's steps)."""
    image = to_rgb(image)
    factor = config.patch_size * config.merge_size
    height, width = smart_resize(image.height, image.width, factor, config.min_pixels, config.max_pixels)
    image = image.resize((width, height), resample=Image.Resampling.BICUBIC)
    pixels = np.asarray(image).astype(np.float64) * (1 / 255)  # [H, W, C], as numpy's rescale
    pixels = pixels.astype(np.float32)
    mean = np.asarray(config.image_mean, dtype=np.float32)
    std = np.asarray(config.image_std, dtype=np.float32)
    pixels = ((pixels - mean) / std).transpose(2, 0, 1)  # [C, H, W]
    p, m, t = config.patch_size, config.merge_size, config.temporal_patch_size
    channels = pixels.shape[0]
    grid_h, grid_w = height // p, width // p
    patches = pixels.reshape(channels, grid_h // m, m, p, grid_w // m, m, p)
    patches = patches.transpose(1, 4, 2, 5, 0, 3, 6)  # (gh, gw, mh, mw, C, ph, pw)
    patches = np.broadcast_to(patches[:, :, :, :, :, None], (*patches.shape[:5], t, p, p))
    flat = np.ascontiguousarray(patches.reshape(grid_h * grid_w, channels * t * p * p), dtype=np.float32)
    return ProcessedImage(flat, (1, grid_h, grid_w), m)


MAX_IMAGE_PIXELS = 64 * 1024 * 1024


# Fetching an http(s) image URL (vLLM's VLLM_IMAGE_FETCH_TIMEOUT, in seconds) and its largest size.
FETCH_TIMEOUT_S = float(
    os.environ.get("AXON_IMAGE_FETCH_TIMEOUT", os.environ.get("VLLM_IMAGE_FETCH_TIMEOUT", "5"))
)
MAX_IMAGE_BYTES = 32 * 1024 * 1024


def load_image(source: Any, allowed_local_media_path: str | None = None) -> Image.Image:
    """A PIL image from a PIL image, bytes, a ``data:image/...;base64,`` URL, an ``http(s)`` URL
    (fetched within ``FETCH_TIMEOUT_S``, at most ``MAX_IMAGE_BYTES``) or a ``file://`` URL under
    ``allowed_local_media_path``. A ValueError names what is wrong."""
    if isinstance(source, Image.Image):
        return source
    if isinstance(source, str):
        source = _url_bytes(source, allowed_local_media_path)
    if not isinstance(source, (bytes, bytearray)):
        kind = type(source).__name__
        raise ValueError(f"an image must be a PIL image, bytes or a URL, got {kind}")  # noqa: TRY004 (a 400)
    try:
        image = Image.open(io.BytesIO(source))
        if image.width * image.height > MAX_IMAGE_PIXELS:
            raise ValueError(
                f"the image has {image.width} x {image.height} pixels, more than {MAX_IMAGE_PIXELS}"
            )
        image.load()
    except (OSError, Image.DecompressionBombError, SyntaxError) as e:
        raise ValueError(f"the image cannot be decoded: {e}") from None
    return image


def _url_bytes(url: str, allowed_local_media_path: str | None) -> bytes:
    if url.startswith("data:"):
        header, _, payload = url.partition(",")
        if ";base64" not in header:
            raise ValueError("an image data URL must be base64-encoded (data:image/...;base64,...)")
        try:
            return base64.b64decode(payload, validate=True)
        except (binascii.Error, ValueError):
            raise ValueError("the image data URL's base64 payload does not decode") from None
    if url.startswith(("http://", "https://")):
        return _at_most_max(_fetch(url), "the image at the URL")
    if url.startswith("file://"):
        if allowed_local_media_path is None:
            raise ValueError("file:// image URLs need --allowed-local-media-path (the folder they may read)")
        root = os.path.realpath(allowed_local_media_path)
        path = os.path.realpath(urllib.parse.unquote(url[len("file://") :]))
        if os.path.commonpath([root, path]) != root:
            raise ValueError(
                f"the image file is outside --allowed-local-media-path {allowed_local_media_path}"
            )
        try:
            with open(path, "rb") as f:
                data = f.read(MAX_IMAGE_BYTES + 1)
        except OSError as e:
            raise ValueError(f"the image file cannot be read: {e.strerror}") from None
        return _at_most_max(data, "the image file")
    raise ValueError(f"an image URL must be a data:, http(s):// or file:// URL, got {url[:40]!r}")


def _fetch(url: str) -> bytes:
    try:
        with urllib.request.urlopen(url, timeout=FETCH_TIMEOUT_S) as response:
            data = response.read(MAX_IMAGE_BYTES + 1)
    except (urllib.error.URLError, TimeoutError, OSError) as e:
        reason = getattr(e, "reason", e)
        raise ValueError(
            f"the image URL could not be fetched within {FETCH_TIMEOUT_S:g} s: {reason}"
        ) from None
    return data


def _at_most_max(data: bytes, what: str) -> bytes:
    """``data`` (read up to one byte past the limit), or a ValueError if it is past the limit."""
    if len(data) > MAX_IMAGE_BYTES:
        raise ValueError(f"{what} is larger than {MAX_IMAGE_BYTES} bytes")
    return data
