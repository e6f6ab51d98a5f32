"""Build the model for a resolved ModelConfig and fill its weights (checkpoint or dummy)."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from axon.config import ModelConfig
from axon.model.layers.attention import AttentionBackend
from axon.model.layers.linear import pack_linears
from axon.model.loader.safetensors_loader import iterate_safetensors
from axon.model.registry import resolve_model_class
from axon.platforms import move_to_huge_pages
from axon.startup import startup_phase


def build_empty(make: Callable[[], nn.Module], dtype: torch.dtype, device: torch.device | str) -> nn.Module:
    """``make()``'s module with parameters of ``dtype`` on ``device``, left uninitialised: built
    on the meta device (no memory, no random init), then materialised in place."""
    prev = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device("meta"):
            model = make()
    finally:
        torch.set_default_dtype(prev)
    return model.to_empty(device=device)


def load_model(
    model_config: ModelConfig,
    dtype: torch.dtype,
    device: torch.device,
    backend: AttentionBackend,
    linear_backend: str = "torch",
    linear_batch_hint: int = 16,
) -> nn.Module:
    """``linear_backend`` is resolved ("cpu_bf16", "onednn" or "torch"); the first two pack each
    linear layer's weight once (oneDNN's for ``linear_batch_hint`` rows, the usual decode batch)."""
    hf = model_config.hf_config
    assert hf is not None and model_config.model_path is not None, "resolve_config() comes first"
    with startup_phase(f"loading the weights of {model_config.model_path} ({dtype})"):
        cls = resolve_model_class(hf.get("architectures"), model_config.runner)
        # Parameters are built without initialisation (meta), then materialised in place; buffers
        # (rotary tables) are computed for real, in float32.
        model = build_empty(lambda: cls(hf, backend), dtype, device)
        if hasattr(model, "tie_weights"):
            model.tie_weights()
        for module in model.modules():
            if hasattr(module, "reset_buffers"):
                module.reset_buffers()
        if model_config.load_format == "dummy":
            _init_dummy_weights(model, model_config.seed)
        else:
            model.load_weights(iterate_safetensors(model_config.model_path))
        if linear_backend != "torch":
            pack_linears(model, linear_backend, linear_batch_hint)
        if device.type == "cpu":
            move_to_huge_pages(model)
        return model.eval()


def _init_dummy_weights(model: nn.Module, seed: int) -> None:
    """Random weights with a sane scale: N(0, 0.02) matrices, unit norms, zero biases.

    Drawn in place on the parameters' device by a generator of that device (one per device,
    seeded with ``seed``): a draw on the host and a copy would cost seconds of CPU time per
    billion parameters before a GPU engine could start. The same seed gives the same weights on
    the same device."""
    generators: dict[torch.device, torch.Generator] = {}
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight") or "layernorm" in name.lower():
                param.fill_(1.0)
            elif name.endswith(".bias"):
                param.zero_()
            else:
                if param.device not in generators:
                    generators[param.device] = torch.Generator(param.device).manual_seed(seed)
                param.normal_(0.0, 0.02, generator=generators[param.device])
