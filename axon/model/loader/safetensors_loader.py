"""Reading a Hugging Face model folder: its config.json and its safetensors weights."""

import glob
import json
import os
from collections.abc import Iterator
from typing import Any

import torch
from safetensors import safe_open

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


def load_hf_config(folder: str) -> dict[str, Any]:
    """The parsed `config.json` of a Hugging Face model folder."""
    path = os.path.join(folder, "config.json")
    try:
        with open(path, encoding="utf-8") as f:
            config = json.load(f)
    except FileNotFoundError:
        raise ValueError(f"model folder {folder} has no config.json ({path} not found)") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path} is not valid JSON: {e}") from e
    if not isinstance(config, dict):
        raise ValueError(f"{path} holds a JSON {type(config).__name__}, expected an object")  # noqa: TRY004
    return with_text_config(config)


def with_text_config(config: dict[str, Any]) -> dict[str, Any]:
    """A multimodal model's config (Qwen3-VL: the decoder's keys under ``text_config``) with the
    decoder's keys at the top too, where every part of the engine reads a model's (vocab_size,
    max_position_embeddings, ...); the top level's own keys win. Other configs are unchanged."""
    text = config.get("text_config")
    if not isinstance(text, dict):
        return config
    return {**text, **config}


class LazyTensor:
    """A checkpoint tensor not read yet: its ``shape``, and ``read`` for all of it or a slice
    (a tensor-parallel rank reads only its own slice of each weight). Valid until the iterator
    that gave it moves on."""

    def __init__(self, handle: Any, name: str) -> None:
        self._handle, self.name = handle, name
        self.shape = torch.Size(handle.get_slice(name).get_shape())

    def read(self, dim: int | None = None, start: int = 0, count: int = 0) -> torch.Tensor:
        """The whole tensor, or ``count`` entries from ``start`` along ``dim`` (0 or 1)."""
        if dim is None:
            return self._handle.get_tensor(self.name)
        part = self._handle.get_slice(self.name)
        assert dim in (0, 1), dim
        return part[start : start + count] if dim == 0 else part[:, start : start + count]


def iterate_safetensors(folder: str, lazy: bool = False) -> Iterator[tuple[str, Any]]:
    """Every tensor of the folder's weights once, as `(name, tensor)`, read through mmap
    (``lazy``: as a ``LazyTensor``, read when and as far as the consumer asks).

    The files are, in order of preference: the shards named by `model.safetensors.index.json`,
    `model.safetensors`, or every `*.safetensors` in the folder.
    """
    files, index_names = _weight_files(folder)
    seen: set[str] = set()
    for path in files:
        try:
            handle = safe_open(path, framework="pt")
        except Exception as e:  # safetensors raises its own error type for a corrupt header
            raise ValueError(f"cannot read {path}: not a valid safetensors file ({e})") from e
        with handle as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                if name in seen:
                    raise ValueError(f"tensor {name!r} appears in more than one file of {folder}")
                seen.add(name)
                yield name, LazyTensor(f, name) if lazy else f.get_tensor(name)
    missing = index_names - seen
    if missing:
        raise ValueError(
            f"{os.path.join(folder, INDEX_FILE)} lists tensors found in no shard: {sorted(missing)[:5]}"
        )


def _weight_files(folder: str) -> tuple[list[str], set[str]]:
    """The safetensors files to read, and the tensor names an index promises (empty without one)."""
    if not os.path.isdir(folder):
        raise ValueError(f"model folder {folder} does not exist or is not a folder")
    index_path = os.path.join(folder, INDEX_FILE)
    if os.path.isfile(index_path):
        return _indexed_files(folder, index_path)
    single = os.path.join(folder, SINGLE_FILE)
    if os.path.isfile(single):
        return [single], set()
    files = sorted(glob.glob(os.path.join(glob.escape(folder), "*.safetensors")))
    if not files:
        raise ValueError(f"model folder {folder} has no *.safetensors weights")
    return files, set()


def _indexed_files(folder: str, index_path: str) -> tuple[list[str], set[str]]:
    try:
        with open(index_path, encoding="utf-8") as f:
            weight_map = json.load(f)["weight_map"]
    except (json.JSONDecodeError, KeyError, TypeError) as e:
        raise ValueError(f"{index_path} is not a valid safetensors index: {e!r}") from e
    if not isinstance(weight_map, dict) or not weight_map:
        raise ValueError(f"{index_path} has an empty or invalid weight_map")
    # Shard order is the order of first mention, so reading follows the index.
    shard_names = list(dict.fromkeys(weight_map.values()))
    files = [os.path.join(folder, name) for name in shard_names]
    missing = [path for path in files if not os.path.isfile(path)]
    if missing:
        raise ValueError(f"{index_path} names shards missing from {folder}: {missing}")
    return files, set(weight_map)
