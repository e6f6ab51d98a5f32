"""Architecture name (config.json ``architectures``) -> model class."""

from __future__ import annotations

from torch import nn

from axon.model.models.bert import BertModel
from axon.model.models.llama import LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM

_MODELS: dict[str, type[nn.Module]] = {
    "BertModel": BertModel,
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": MistralForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
}


def supported_architectures() -> list[str]:
    return sorted(_MODELS)


def resolve_model_class(architectures: list[str] | None) -> type[nn.Module]:
    for arch in architectures or []:
        if arch in _MODELS:
            return _MODELS[arch]
    raise ValueError(
        f"unsupported architecture {architectures!r}; supported: {', '.join(supported_architectures())}"
    )


def is_pooling_model(model_class: type[nn.Module]) -> bool:
    """Encoders that produce embeddings (``runner="pooling"``) rather than next-token logits."""
    return bool(getattr(model_class, "is_pooling_model", False))
