"""A multimodal prompt's images: checked, processed, and their placeholders expanded.

A prompt holds one image placeholder token (Qwen's ``<|image_pad|>``, the model's
``image_token_id``) per image, as a chat template writes it; each is expanded to as many
placeholders as the image has tokens, and the returned prompt is the expanded one (as vLLM's
``prompt_token_ids`` are). Every problem is a ValueError naming it (a 400 on the server).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any

from axon.multimodal.image import ImageProcessorConfig, load_image, process_image
from axon.multimodal.inputs import ImageInput

DEFAULT_IMAGE_LIMIT = 8


@dataclass(frozen=True)
class ImagePrompts:
    image_token_id: int
    processor: ImageProcessorConfig
    limit: int  # images per prompt
    allowed_local_media_path: str | None = None  # file:// image URLs may read under it

    @staticmethod
    def for_model(
        hf_config: dict[str, Any],
        model_path: str,
        limit_mm_per_prompt: dict[str, Any] | None,
        allowed_local_media_path: str | None = None,
    ) -> ImagePrompts | None:
        """The model's image handling, or None for a model without a vision tower."""
        if "vision_config" not in hf_config or "image_token_id" not in hf_config:
            return None
        limits = dict(limit_mm_per_prompt or {})
        unknown = sorted(set(limits) - {"image"})
        if unknown:
            raise ValueError(f"limit_mm_per_prompt: {unknown} not supported; this model takes 'image'")
        limit = limits.get("image", DEFAULT_IMAGE_LIMIT)
        if not isinstance(limit, int) or isinstance(limit, bool) or limit < 0:
            raise ValueError(f"limit_mm_per_prompt['image'] must be a non-negative integer, got {limit!r}")
        return ImagePrompts(
            int(hf_config["image_token_id"]),
            ImageProcessorConfig.from_folder(model_path),
            limit,
            allowed_local_media_path,
        )

    def expand(self, token_ids: list[int], images: list[Any]) -> tuple[list[int], list[ImageInput]]:
        """(the prompt with each image's placeholder expanded, the images in order)."""
        if len(images) > self.limit:
            raise ValueError(
                f"the prompt has {len(images)} images, more than the {self.limit} allowed "
                "(limit_mm_per_prompt)"
            )
        places = [i for i, t in enumerate(token_ids) if t == self.image_token_id]
        if len(places) != len(images):
            raise ValueError(
                f"the prompt has {len(places)} image placeholder tokens (id {self.image_token_id}) for "
                f"{len(images)} images: it needs one placeholder per image"
            )
        out: list[int] = []
        inputs: list[ImageInput] = []
        previous = 0
        for place, source in zip(places, images, strict=True):
            processed = process_image(load_image(source, self.allowed_local_media_path), self.processor)
            out += token_ids[previous:place]
            pixels = processed.pixel_values.tobytes()
            digest = hashlib.sha256(pixels + repr(processed.grid_thw).encode()).hexdigest()
            inputs.append(
                ImageInput(
                    pixels,
                    processed.pixel_values.shape[1],
                    processed.grid_thw,
                    len(out),
                    processed.num_tokens,
                    digest,
                )
            )
            out += [self.image_token_id] * processed.num_tokens
            previous = place + 1
        out += token_ids[previous:]
        return out, inputs


def split_chat_images(conversation: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], list[Any]]:
    """Chat messages whose content parts may be images (OpenAI's ``{"type": "image_url",
    "image_url": {"url": ...}}``, or ``{"type": "image", "image": ...}`` with a PIL image, bytes or
    URL) -> (the messages with each image part as ``{"type": "image"}``, as chat templates expect,
    the images in order)."""
    images: list[Any] = []
    out = []
    for index, message in enumerate(conversation):
        content = message.get("content")
        if not isinstance(content, list):
            out.append(message)
            continue
        parts = []
        for part in content:
            kind = part.get("type") if isinstance(part, dict) else None
            if kind == "image_url":
                url = part.get("image_url")
                url = url.get("url") if isinstance(url, dict) else url
                if not isinstance(url, str):
                    raise ValueError(f"messages[{index}]: an image_url part needs image_url.url")
                images.append(url)
                parts.append({"type": "image"})
            elif kind == "image":
                images.append(part.get("image"))
                parts.append({"type": "image"})
            else:
                parts.append(part)
        out.append({**message, "content": parts})
    return out, images
