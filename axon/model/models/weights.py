"""Loading checkpoint tensors into a model by name, shared by every model family."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping

import torch
from torch import nn

from axon.model.layers.linear import MergedLinear
from axon.model.layers.tensor_parallel import ShardSlice
from axon.model.loader.safetensors_loader import LazyTensor


def load_by_name(
    model: nn.Module,
    weights: Iterable[tuple[str, torch.Tensor]],
    rename: Callable[[str], str | None],
    optional: frozenset[str] = frozenset(),
    stacked: Mapping[str, tuple[str, int]] | None = None,
) -> None:
    """Copy each tensor into the parameter ``rename(name)`` names (None: the tensor is unused).

    ``stacked`` maps a checkpoint layer name to a ``MergedLinear`` and its shard: with
    ``{"q_proj": ("qkv_proj", 0), ...}``, ``layers.0.self_attn.q_proj.weight`` fills the first
    ``output_sizes[0]`` rows of ``layers.0.self_attn.qkv_proj.weight``.

    A layer split across tensor-parallel ranks (``shard_slices``, see
    axon/model/layers/tensor_parallel.py) takes only its rank's slice of each tensor; a
    ``LazyTensor`` is read no further than that slice.

    Every parameter (every shard of a merged one) but ``optional`` ones must be covered exactly
    once; an unknown name, a shape mismatch or a repeat is an error that names the tensor.
    """
    params = dict(model.named_parameters())
    modules = dict(model.named_modules())
    loaded: set[tuple[str, int | None]] = set()
    for ckpt_name, tensor in weights:
        name = rename(ckpt_name)
        if name is None:
            continue
        name, shard = _unstack(name, stacked or {})
        if name not in params:
            raise ValueError(f"checkpoint tensor {name!r} has no parameter in {type(model).__name__}")
        target = params[name]
        if shard is not None:
            sizes = _output_sizes(modules, name)
            assert sizes is not None, f"{name} is not a merged layer's parameter"
            target = target.narrow(0, sum(sizes[:shard]), sizes[shard])
        module, _, leaf = name.rpartition(".")
        slice_ = getattr(modules[module], "shard_slices", {}).get(leaf)
        if slice_ is not None:
            target, tensor = _rank_slice(target, tensor, slice_, shard or 0, ckpt_name)
        elif isinstance(tensor, LazyTensor):
            tensor = tensor.read()
        if tuple(target.shape) != tuple(tensor.shape):
            raise ValueError(
                f"checkpoint tensor {ckpt_name!r} has shape {tuple(tensor.shape)}, expected {tuple(target.shape)}"
            )
        if (name, shard) in loaded:
            raise ValueError(f"checkpoint tensor {ckpt_name!r} is given twice")
        with torch.no_grad():
            target.copy_(tensor)
        loaded.add((name, shard))
    expected: set[tuple[str, int | None]] = set()
    for name in set(params) - optional:
        sizes = _output_sizes(modules, name) if stacked is not None else None
        expected.update((name, shard) for shard in (range(len(sizes)) if sizes else [None]))
    missing = sorted(f"{n}" if s is None else f"{n} (shard {s})" for n, s in expected - loaded)
    if missing:
        raise ValueError(f"checkpoint lacks {len(missing)} tensors, e.g. {missing[:3]}")


def _rank_slice(
    target: torch.Tensor, tensor: torch.Tensor | LazyTensor, slice_: ShardSlice, part: int, ckpt_name: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """(target, tensor) narrowed to this rank's slice. A padded share (the vocabulary's last
    rows) takes what the checkpoint has and zeroes the rest."""
    dim, start = slice_.dim, slice_.starts[part]
    if len(tensor.shape) != target.dim():
        raise ValueError(
            f"checkpoint tensor {ckpt_name!r} has shape {tuple(tensor.shape)}, expected {target.dim()} dimensions"
        )
    count = min(target.shape[dim], tensor.shape[dim] - start)
    if count <= 0:
        raise ValueError(
            f"checkpoint tensor {ckpt_name!r} has shape {tuple(tensor.shape)}, too small for this rank's "
            f"slice from {start} along dimension {dim}"
        )
    if count < target.shape[dim]:
        with torch.no_grad():
            target.narrow(dim, count, target.shape[dim] - count).zero_()
        target = target.narrow(dim, 0, count)
    if isinstance(tensor, LazyTensor):
        return target, tensor.read(dim, start, count)
    return target, tensor.narrow(dim, start, count)


def _unstack(name: str, stacked: Mapping[str, tuple[str, int]]) -> tuple[str, int | None]:
    parts = name.split(".")
    if len(parts) >= 2 and parts[-2] in stacked:
        merged, shard = stacked[parts[-2]]
        return ".".join([*parts[:-2], merged, parts[-1]]), shard
    return name, None


def _output_sizes(modules: dict[str, nn.Module], param_name: str) -> tuple[int, ...] | None:
    """The shard sizes of the ``MergedLinear`` that owns ``param_name``; None for other layers."""
    module = modules[param_name.rpartition(".")[0]]
    return module.output_sizes if isinstance(module, MergedLinear) else None
