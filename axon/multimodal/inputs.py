"""The records of a multimodal prompt (and of a prompt given as embeddings) that travel from
the front end to the worker."""

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


class PromptEmbeds(msgspec.Struct, forbid_unknown_fields=True):
    """A prompt given as embeddings (``--enable-prompt-embeds``): row i is position i's input
    embedding, in place of a token's; the prompt's token ids are placeholders."""

    data: bytes  # [num_tokens, hidden] of ``dtype``, row-major
    dtype: str  # "float32" | "bfloat16" | "float16"
    num_tokens: int
    hidden: int

    def tensor(self):  # -> torch.Tensor (torch is imported where it is used)
        import torch

        flat = torch.frombuffer(bytearray(self.data), dtype=getattr(torch, self.dtype))
        return flat.view(self.num_tokens, self.hidden)
