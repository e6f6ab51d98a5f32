"""Loading checkpoint tensors into a model by name, shared by every model family."""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
from torch import nn


def load_by_name(
    model: nn.Module,
    weights: Iterable[tuple[str, torch.Tensor]],
    rename: Callable[[str], str | None],
    optional: frozenset[str] = frozenset(),
) -> None:
    """Copy each tensor into the parameter ``rename(name)`` names (None: the tensor is unused).

    Every parameter but ``optional`` ones must be covered; an unknown name or a shape mismatch
    is an error that names the tensor.
    """
    params = dict(model.named_parameters())
    loaded: set[str] = set()
    for ckpt_name, tensor in weights:
        name = rename(ckpt_name)
        if name is None:
            continue
        if name not in params:
            raise ValueError(f"checkpoint tensor {name!r} has no parameter in {type(model).__name__}")
        param = params[name]
        if tuple(param.shape) != tuple(tensor.shape):
            raise ValueError(
                f"checkpoint tensor {name!r} has shape {tuple(tensor.shape)}, expected {tuple(param.shape)}"
            )
        with torch.no_grad():
            param.copy_(tensor)
        loaded.add(name)
    missing = set(params) - loaded - optional
    if missing:
        raise ValueError(f"checkpoint lacks {len(missing)} tensors, e.g. {sorted(missing)[:3]}")
