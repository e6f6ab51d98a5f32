"""Architecture name (config.json ``architectures``) -> model class.

A generative decoder runs as an embedder with ``runner="pooling"`` through its embedding adapter
(``as_embedding_model``); a bare decoder architecture (``Qwen3Model``, as transformers saves a
model without its LM head) is an embedder by itself, so ``runner="auto"`` picks pooling for it.
"""

from __future__ import annotations

from torch import nn

from axon.model.models.bert import BertModel
from axon.model.models.decoder_embedding import as_embedding_model
from axon.model.models.gpt_oss import GptOssForCausalLM
from axon.model.models.llama import (
    LlamaForCausalLM,
    MistralForCausalLM,
    Qwen2ForCausalLM,
    Qwen3ForCausalLM,
    Qwen3MoeForCausalLM,
)
from axon.model.models.qwen3_vl import Qwen3VLForConditionalGeneration

_MODELS: dict[str, type[nn.Module]] = {
    "BertModel": BertModel,
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": MistralForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
    "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
    "GptOssForCausalLM": GptOssForCausalLM,
    "Qwen3VLForConditionalGeneration": Qwen3VLForConditionalGeneration,
    "LlamaModel": as_embedding_model(LlamaForCausalLM),
    "MistralModel": as_embedding_model(MistralForCausalLM),
    "Qwen2Model": as_embedding_model(Qwen2ForCausalLM),
    "Qwen3Model": as_embedding_model(Qwen3ForCausalLM),
}


def supported_architectures() -> list[str]:
    return sorted(_MODELS)


def resolve_model_class(architectures: list[str] | None, runner: str = "generate") -> type[nn.Module]:
    """The class for ``architectures``; with ``runner="pooling"``, its embedding model."""
    for arch in architectures or []:
        if arch in _MODELS:
            cls = _MODELS[arch]
            if runner == "pooling" and not is_pooling_model(cls):
                return as_embedding_model(cls)  # type: ignore[arg-type]
            return cls
    raise ValueError(
        f"unsupported architecture {architectures!r}; supported: {', '.join(supported_architectures())}"
    )


def is_pooling_model(model_class: type[nn.Module]) -> bool:
    """Models that produce embeddings (``runner="pooling"``) rather than next-token logits."""
    return bool(getattr(model_class, "is_pooling_model", False))


def can_pool(model_class: type[nn.Module]) -> bool:
    """Whether the class runs with ``runner="pooling"``: an embedder, or a decoder with an adapter."""
    return is_pooling_model(model_class) or issubclass(model_class, LlamaForCausalLM)


def is_encoder_only(model: type[nn.Module] | nn.Module) -> bool:
    """Encoder-only attention (BERT): bidirectional over each whole prompt, no KV cache."""
    return getattr(model, "attention_type", "decoder") == "encoder_only"
