"""The records of a multimodal prompt that travel from the front end to the worker."""

from __future__ import annotations

import msgspec


class ImageInput(msgspec.Struct, forbid_unknown_fields=True):
    """One image of a prompt, processed for the model's vision tower (axon/multimodal/image.py):
    its patches and grid, and where its placeholder tokens start in the (expanded) prompt."""

    pixel_values: bytes  # float32 [num_patches, patch_dim], row-major
    patch_dim: int
    grid_thw: tuple[int, int, int]
    offset: int  # the prompt index of its first placeholder token
    num_tokens: int  # its placeholder tokens
    digest: str  # sha256 of its patches and grid (prefix-cache keys)
