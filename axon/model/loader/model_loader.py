"""Build the model for a resolved ModelConfig and fill its weights (checkpoint or dummy)."""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
from torch import nn

from axon.config import ModelConfig
from axon.distributed.parallel_state import get_tp_group
from axon.model.layers.attention import AttentionBackend
from axon.model.layers.linear import MergedLinear, pack_linears
from axon.model.layers.moe import FusedMoE
from axon.model.layers.quant import (
    QuantizedWeight,
    QuantLinear,
    W8A8Linear,
    concat_rows,
    quantize_experts,
    quantize_linears,
)
from axon.model.loader.gguf_loader import quantized_linear_weights
from axon.model.loader.safetensors_loader import iterate_safetensors
from axon.model.registry import resolve_model_class
from axon.platforms import move_to_huge_pages
from axon.startup import startup_phase

logger = logging.getLogger(__name__)


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
        tp = get_tp_group().size
        if tp > 1 and not getattr(cls, "supports_tensor_parallel", False):
            raise ValueError(
                f"{cls.__name__} cannot be split across ranks yet: tensor_parallel_size must be 1 for it, got {tp}"
            )
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
            # Under tensor parallelism each rank reads only its slice of each tensor.
            model.load_weights(iterate_safetensors(model_config.model_path, lazy=tp > 1))
        given = None
        if model_config.quantization is not None:
            given = _quantize(model, model_config, use_kernel=linear_backend == "cpu_bf16")
        if linear_backend != "torch":
            pack_linears(model, linear_backend, linear_batch_hint)
        _prepare_experts(model, model_config, fused=linear_backend == "cpu_bf16", given=given)
        if device.type == "cpu":
            move_to_huge_pages(model)
        return model.eval()


def load_vision_tower(
    model_config: ModelConfig, dtype: torch.dtype, device: torch.device, linear_backend: str = "torch"
) -> nn.Module:
    """A multimodal model's vision tower alone, with its checkpoint weights (the decoder's are
    not read): an encoder server's model (``mm_encoder_only``). Dummy weights are the tower's
    own random ones, not those of the whole model's dummy load."""
    hf = model_config.hf_config
    assert hf is not None and model_config.model_path is not None, "resolve_config() comes first"
    cls = resolve_model_class(hf.get("architectures"), model_config.runner)
    if not hasattr(cls, "vision_tower"):
        raise ValueError(f"{cls.__name__} has no vision encoder to run alone")
    with startup_phase(f"loading the vision tower of {model_config.model_path} ({dtype})"):
        tower = build_empty(lambda: cls.vision_tower(hf), dtype, device)
        for module in tower.modules():
            if hasattr(module, "reset_buffers"):
                module.reset_buffers()
        if model_config.load_format == "dummy":
            _init_dummy_weights(tower, model_config.seed)
        else:
            cls.load_vision_weights(tower, iterate_safetensors(model_config.model_path, lazy=True))
        if linear_backend != "torch":
            pack_linears(tower, linear_backend, 256)
        return tower.eval()


def _prepare_experts(
    model: nn.Module,
    model_config: ModelConfig,
    fused: bool,
    given: dict[str, QuantizedWeight] | None = None,
) -> None:
    """Mixture-of-experts blocks on the fused CPU op where the bf16 linear kernel runs (their
    weights packed for it, or under ``--quantization`` kept as codes for the quantized op: a
    GGUF file's own blocks, ``given``), else on the loop over experts; the log says which."""
    blocks = [m for m in model.modules() if isinstance(m, FusedMoE)]
    if not blocks:
        return
    method = model_config.quantization
    if method in ("int8", "int4", "fp8", "w8a8", "gguf"):
        with startup_phase(f"quantizing the experts ({method})"):
            quantize_experts(
                model, method, model_config.quantization_group_size, use_kernel=fused, given=given
            )
    if fused:
        for block in blocks:
            if block.method == "loop":
                block.pack()
    first = blocks[0]
    share = ""
    if first.num_local_experts != first.num_experts:
        share = (
            f", experts {first.first_expert}..{first.first_expert + first.num_local_experts - 1} on this rank"
        )
    elif get_tp_group().size > 1:
        start = first.intermediate_start
        share = f", columns {start}..{start + first.intermediate_size - 1} of each expert on this rank"
    how = {"fused": "fused CPU op", "fused_quant": f"fused CPU op on {method} codes"}.get(
        first.method, "loop over experts"
    )
    if first.method == "fused_quant":
        how += f", {sum(b.weight_bytes for b in blocks) / 2**20:.1f} MiB"
    if method in ("int8", "int4", "fp8", "w8a8") and first.method == "loop":
        how += f" ({method} codes dequantized: no quantized kernel on this path)"
    if method == "gguf" and first.method != "fused_quant":
        how += " (the file's experts dequantized)"
    logger.info(
        "%d sparse MoE blocks of %d experts (%d per token)%s: %s",
        len(blocks),
        first.num_experts,
        first.top_k,
        share,
        how,
    )


def _quantize(
    model: nn.Module, model_config: ModelConfig, use_kernel: bool
) -> dict[str, QuantizedWeight] | None:
    """Every linear layer to ``model_config.quantization``'s form (see axon/model/layers/quant.py);
    for ``gguf`` returns the file's quantized weights by HF name (the experts' among them)."""
    method = model_config.quantization
    with startup_phase(f"quantizing the linear layers ({method})"):
        file_weights, given = None, None
        if method == "gguf":
            assert model_config.gguf_file is not None, "resolve_config() checks that gguf has a GGUF file"
            file_weights = quantized_linear_weights(model_config.gguf_file)
            given = _gguf_module_weights(model, file_weights)
        count = quantize_linears(model, method, model_config.quantization_group_size, use_kernel, given)
        total = sum(m.weight_bytes for m in model.modules() if isinstance(m, (QuantLinear, W8A8Linear)))
        logger.info("quantized %d linear layers to %s: %.1f MiB of weights", count, method, total / 2**20)
    return file_weights


def _gguf_module_weights(model: nn.Module, weights: dict[str, QuantizedWeight]) -> dict[str, QuantizedWeight]:
    """HF weight name -> blocks, to module name -> blocks: merged layers (q/k/v, gate/up) join
    their shards' rows, when every shard is quantized; a tied LM head takes the embedding's."""
    stacked = getattr(model, "stacked_params", {})
    by_module: dict[str, QuantizedWeight] = {}
    shards: dict[str, dict[int, QuantizedWeight]] = {}
    for name, weight in weights.items():
        module, _, leaf = name.rpartition(".")
        parent, _, last = module.rpartition(".")
        if leaf != "weight":
            continue
        if last in stacked:
            merged, shard = stacked[last]
            shards.setdefault(f"{parent}.{merged}", {})[shard] = weight
        else:
            by_module[module] = weight
    modules = dict(model.named_modules())
    for module, parts in shards.items():
        layer = modules.get(module)
        if isinstance(layer, MergedLinear) and sorted(parts) == list(range(len(layer.output_sizes))):
            by_module[module] = concat_rows([parts[i] for i in sorted(parts)])
    embedding = by_module.get("model.embed_tokens")
    if isinstance(modules.get("lm_head"), nn.Linear) and "lm_head" not in by_module and embedding is not None:
        by_module["lm_head"] = embedding
    return by_module


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
