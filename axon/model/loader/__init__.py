"""Model weight loading: Hugging Face safetensors folders, and GGUF files converted to them."""

from axon.model.loader.default_model import DEFAULT_MODEL_NAME, default_model_path
from axon.model.loader.gguf_loader import GGUF_ARCHITECTURES, SUPPORTED_TENSOR_TYPES, gguf_to_hf_folder
from axon.model.loader.safetensors_loader import iterate_safetensors, load_hf_config

__all__ = [
    "DEFAULT_MODEL_NAME",
    "GGUF_ARCHITECTURES",
    "SUPPORTED_TENSOR_TYPES",
    "default_model_path",
    "gguf_to_hf_folder",
    "iterate_safetensors",
    "load_hf_config",
]
