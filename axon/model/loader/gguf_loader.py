"""GGUF -> Hugging Face model folder, converted once and cached on disk.

The rest of axon only ever loads Hugging Face folders; a GGUF file becomes one here. Layout of a
converted folder (`{cache_root}/gguf/{stem}-{hash}`):

    config.json              the transformers config of the architecture
    generation_config.json   bos/eos (eos also lists the file's end-of-turn token)
    tokenizer.json           from transformers' GGUF tokenizer conversion
    tokenizer_config.json    with the file's `chat_template`
    model.safetensors        float32 weights under transformers' parameter names
                             (over SHARD_MAX_BYTES: model-0000i-of-0000n.safetensors + index)

The hash covers the file's realpath, size, mtime and LOADER_VERSION, so an edited file or a new
converter gets a new folder. A folder is built under a temporary name and renamed into place,
so a folder that exists is complete, and concurrent converters race harmlessly.
"""

import hashlib
import json
import math
import os
import re
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFReader, ReaderTensor
from gguf.quants import dequantize
from safetensors.torch import save_file

from axon.model.layers.quant import QuantizedWeight
from axon.model.loader.gguf_blocks import KEPT_QUANTIZED, quantized_weight
from axon.startup import startup_phase

# Bump whenever the folder's contents would change for the same GGUF file.
LOADER_VERSION = "1"
SHARD_MAX_BYTES = 2 << 30

_T = GGMLQuantizationType
SUPPORTED_TENSOR_TYPES = frozenset(
    {_T.F32, _T.F16, _T.BF16, _T.Q4_0, _T.Q4_1, _T.Q5_0, _T.Q5_1, _T.Q8_0}
    | {_T.Q2_K, _T.Q3_K, _T.Q4_K, _T.Q5_K, _T.Q6_K}
)


@dataclass(frozen=True)
class GGUFArchitecture:
    """How one GGUF `general.architecture` maps onto a transformers model."""

    hf_architecture: str
    model_type: str
    # llama.cpp interleaves q/k rows per head for its rotary layout (llama files only).
    permuted_rotary: bool
    qkv_bias: bool
    qk_norm: bool
    moe: bool = False  # every layer's MLP a mixture of experts (expert_count, ffn_*_exps)


GGUF_ARCHITECTURES: dict[str, GGUFArchitecture] = {
    "llama": GGUFArchitecture("LlamaForCausalLM", "llama", True, False, False),
    "qwen2": GGUFArchitecture("Qwen2ForCausalLM", "qwen2", False, True, False),
    "qwen3": GGUFArchitecture("Qwen3ForCausalLM", "qwen3", False, False, True),
    "qwen3moe": GGUFArchitecture("Qwen3MoeForCausalLM", "qwen3_moe", False, False, True, moe=True),
}

_GLOBAL_TENSOR_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_TENSOR_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    # Mixture of experts: the router, and each projection of every expert stacked [E, out, in]
    # (split into Hugging Face's per-expert tensors as they are written).
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_exps": "mlp.experts.gate_proj",
    "ffn_up_exps": "mlp.experts.up_proj",
    "ffn_down_exps": "mlp.experts.down_proj",
}
_LAYER_TENSOR = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
# Not a parameter: llama3 rope frequency factors, folded into config.json's rope_scaling.
_ROPE_FREQS = "rope_freqs.weight"


def gguf_to_hf_folder(gguf_path: str, cache_root: str) -> str:
    """Convert a GGUF file to a Hugging Face model folder under `cache_root`; return its path.

    A second call for the same unchanged file returns the cached folder without reading weights.
    Raises ValueError for a missing, corrupt, truncated or unsupported file.
    """
    path = os.path.realpath(gguf_path)
    _check_magic(gguf_path, path)
    parent = os.path.join(cache_root, "gguf")
    folder = os.path.join(parent, _cache_key(path))
    if os.path.isdir(folder):
        return folder
    reader = _open_reader(path)
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".tmp-", dir=parent)
    os.chmod(tmp, 0o755)  # mkdtemp's 0700 would hide the published folder from other users
    try:
        with startup_phase(f"converting {gguf_path} to a Hugging Face folder (once per file)"):
            _write_hf_folder(reader, path, tmp)
        _publish(tmp, folder)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return folder


def _cache_key(path: str) -> str:
    stat = os.stat(path)
    ident = f"{path}\0{stat.st_size}\0{stat.st_mtime_ns}\0{LOADER_VERSION}"
    stem = os.path.splitext(os.path.basename(path))[0]
    return f"{stem}-{hashlib.sha256(ident.encode()).hexdigest()[:20]}"


def _publish(tmp: str, folder: str) -> None:
    try:
        os.rename(tmp, folder)
    except OSError:
        # Another process published the same key first; its folder is equally complete.
        if not os.path.isdir(folder):
            raise


# ---- reading the file -------------------------------------------------------------------------


def _check_magic(given_path: str, path: str) -> None:
    if not os.path.exists(path):
        raise ValueError(f"GGUF file not found: {given_path}")
    if not os.path.isfile(path):
        raise ValueError(f"GGUF path is not a file: {given_path}")
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != b"GGUF":
        raise ValueError(f"{given_path} is not a GGUF file: it starts with {magic!r}, not b'GGUF'")


def _open_reader(path: str) -> GGUFReader:
    try:
        reader = GGUFReader(path, "r")
    except Exception as e:  # gguf reports corruption as assorted numpy/struct errors
        raise ValueError(f"{path} is a corrupt or truncated GGUF file: {type(e).__name__}: {e}") from e
    size = os.path.getsize(path)
    for tensor in reader.tensors:
        if tensor.data_offset + tensor.n_bytes > size or tensor.data.nbytes != tensor.n_bytes:
            raise ValueError(f"{path} is truncated: tensor {tensor.name} ends past the end of the file")
    return reader


class _Metadata:
    """Typed access to a GGUF file's key/value metadata."""

    def __init__(self, reader: GGUFReader, path: str) -> None:
        self.reader = reader
        self.path = path
        self.arch = str(self.get("general.architecture", required=True))

    def get(self, key: str, default: Any = None, required: bool = False) -> Any:
        field = self.reader.get_field(key)
        if field is None:
            if required:
                raise ValueError(f"{self.path} lacks the GGUF metadata key {key!r}")
            return default
        return field.contents()

    def arch_get(self, key: str, default: Any = None, required: bool = False) -> Any:
        return self.get(f"{self.arch}.{key}", default, required)


def _architecture(meta: _Metadata) -> GGUFArchitecture:
    spec = GGUF_ARCHITECTURES.get(meta.arch)
    if spec is None:
        raise ValueError(
            f"{meta.path} has GGUF architecture {meta.arch!r}, which axon cannot load; "
            f"supported: {sorted(GGUF_ARCHITECTURES)}"
        )
    if int(meta.get("split.count", 1)) > 1:
        raise ValueError(f"{meta.path} is one part of a split GGUF; merge it with gguf-split first")
    return spec


# ---- config.json ------------------------------------------------------------------------------


def _hf_config(meta: _Metadata, spec: GGUFArchitecture, tensors: dict[str, ReaderTensor]) -> dict[str, Any]:
    hidden_size = int(meta.arch_get("embedding_length", required=True))
    num_heads = int(meta.arch_get("attention.head_count", required=True))
    head_dim = int(meta.arch_get("attention.key_length", hidden_size // num_heads))
    rotary_dim = int(meta.arch_get("rope.dimension_count", head_dim))
    if rotary_dim != head_dim:
        raise ValueError(
            f"{meta.path}: partial rotary (rope.dimension_count {rotary_dim} != head_dim {head_dim})"
        )
    rope_theta = float(meta.arch_get("rope.freq_base", 10000.0))
    # [hidden_size, vocab_size] in ggml order: ne[1] is the vocabulary.
    vocab_size = int(tensors["token_embd.weight"].shape[1])
    config: dict[str, Any] = {
        "architectures": [spec.hf_architecture],
        "model_type": spec.model_type,
        "hidden_size": hidden_size,
        "intermediate_size": int(meta.arch_get("feed_forward_length", required=not spec.moe) or 0),
        "num_hidden_layers": int(meta.arch_get("block_count", required=True)),
        "num_attention_heads": num_heads,
        "num_key_value_heads": int(meta.arch_get("attention.head_count_kv", num_heads)),
        "head_dim": head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": float(meta.arch_get("attention.layer_norm_rms_epsilon", required=True)),
        "rope_theta": rope_theta,
        "max_position_embeddings": int(meta.arch_get("context_length", required=True)),
        "vocab_size": vocab_size,
        "tie_word_embeddings": "output.weight" not in tensors,
        "torch_dtype": "float32",
    }
    if spec.model_type != "qwen2":
        config["attention_bias"] = False
    if spec.moe:  # llama.cpp's qwen3moe: every layer sparse, top-k renormalized
        experts = int(meta.arch_get("expert_count", required=True))
        config |= {
            "num_experts": experts,
            "num_experts_per_tok": int(meta.arch_get("expert_used_count", required=True)),
            "moe_intermediate_size": int(meta.arch_get("expert_feed_forward_length", required=True)),
            "norm_topk_prob": True,
            "decoder_sparse_step": 1,
            "mlp_only_layers": [],
        }
    for key in ("bos_token_id", "eos_token_id", "padding_token_id"):
        token_id = meta.get(f"tokenizer.ggml.{key}")
        if token_id is not None:
            config[key.replace("padding", "pad")] = int(token_id)
    rope_scaling = _rope_scaling(meta, tensors, head_dim, rope_theta)
    config["rope_parameters"] = {"rope_type": "default", "rope_theta": rope_theta, **(rope_scaling or {})}
    if rope_scaling is not None:
        config["rope_scaling"] = rope_scaling
    return config


def _rope_scaling(
    meta: _Metadata, tensors: dict[str, ReaderTensor], head_dim: int, rope_theta: float
) -> dict[str, Any] | None:
    if _ROPE_FREQS in tensors:
        return _llama3_rope_scaling(meta, tensors[_ROPE_FREQS], head_dim, rope_theta)
    kind = meta.arch_get("rope.scaling.type")
    factor = meta.arch_get("rope.scaling.factor", meta.arch_get("rope.scale_linear"))
    if kind is None and factor is not None:
        kind = "linear"
    if kind in (None, "none") or factor is None or float(factor) == 1.0:
        return None
    if kind == "linear":
        return {"rope_type": "linear", "factor": float(factor)}
    if kind == "yarn":
        original = meta.arch_get("rope.scaling.original_context_length", required=True)
        return {
            "rope_type": "yarn",
            "factor": float(factor),
            "original_max_position_embeddings": int(original),
        }
    raise ValueError(f"{meta.path}: rope scaling type {kind!r} is not supported (supported: linear, yarn)")


def _llama3_rope_scaling(
    meta: _Metadata, freqs_tensor: ReaderTensor, head_dim: int, rope_theta: float
) -> dict[str, Any]:
    """Recover llama3 rope_scaling from llama.cpp's per-frequency factors.

    Only ratios of (original context, low, high) enter the factors, so fixing Llama 3.x's
    original context and checking the fit loses nothing.
    """
    stored = _dequantize(freqs_tensor).numpy().astype(np.float64)  # [head_dim // 2]
    scaling = {
        "rope_type": "llama3",
        "factor": float(stored.max()),
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    expected = llama3_rope_factors(scaling, head_dim, rope_theta)
    if stored.shape != expected.shape or not np.allclose(stored, expected, rtol=1e-3):
        raise ValueError(f"{meta.path}: {_ROPE_FREQS} does not match any llama3 rope scaling axon knows")
    return scaling


def llama3_rope_factors(scaling: dict[str, Any], head_dim: int, rope_theta: float) -> np.ndarray:
    """Per-frequency divisors llama.cpp stores as `rope_freqs.weight`, shape [head_dim // 2]."""
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    context = scaling["original_max_position_embeddings"]
    wavelen = 2 * math.pi * rope_theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    smooth = np.clip((context / wavelen - low) / (high - low), 0.0, 1.0)
    return 1.0 / ((1.0 - smooth) / factor + smooth)


def _generation_config(meta: _Metadata, config: dict[str, Any]) -> dict[str, Any]:
    generation: dict[str, Any] = {}
    if "bos_token_id" in config:
        generation["bos_token_id"] = config["bos_token_id"]
    eos_ids = [config["eos_token_id"]] if "eos_token_id" in config else []
    eot = meta.get("tokenizer.ggml.eot_token_id")
    if eot is not None and int(eot) not in eos_ids:
        eos_ids.append(int(eot))
    if eos_ids:
        generation["eos_token_id"] = eos_ids[0] if len(eos_ids) == 1 else eos_ids
    if "pad_token_id" in config:
        generation["pad_token_id"] = config["pad_token_id"]
    return generation


# ---- weights ----------------------------------------------------------------------------------


def _hf_tensor_name(gguf_name: str) -> str | None:
    if gguf_name in _GLOBAL_TENSOR_NAMES:
        return _GLOBAL_TENSOR_NAMES[gguf_name]
    match = _LAYER_TENSOR.fullmatch(gguf_name)
    if match is None or match.group(2) not in _LAYER_TENSOR_NAMES:
        return None
    layer, part, kind = match.groups()
    return f"model.layers.{layer}.{_LAYER_TENSOR_NAMES[part]}.{kind}"


def _expected_hf_names(spec: GGUFArchitecture, config: dict[str, Any]) -> set[str]:
    names = {"model.embed_tokens.weight", "model.norm.weight"}
    if not config["tie_word_embeddings"]:
        names.add("lm_head.weight")
    layer_parts = ["self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"]
    layer_parts += ["self_attn.o_proj.weight", "input_layernorm.weight", "post_attention_layernorm.weight"]
    mlp = ["gate_proj", "up_proj", "down_proj"]
    if spec.moe:
        layer_parts += ["mlp.gate.weight", *(f"mlp.experts.{part}.weight" for part in mlp)]
    else:
        layer_parts += [f"mlp.{part}.weight" for part in mlp]
    if spec.qkv_bias:
        layer_parts += ["self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias"]
    if spec.qk_norm:
        layer_parts += ["self_attn.q_norm.weight", "self_attn.k_norm.weight"]
    for layer in range(config["num_hidden_layers"]):
        names.update(f"model.layers.{layer}.{part}" for part in layer_parts)
    return names


def _plan_tensors(
    meta: _Metadata, spec: GGUFArchitecture, config: dict[str, Any], tensors: dict[str, ReaderTensor]
) -> dict[str, ReaderTensor]:
    """HF name -> GGUF tensor, checked complete and dequantizable before any weight is read."""
    plan: dict[str, ReaderTensor] = {}
    for gguf_name, tensor in tensors.items():
        if gguf_name == _ROPE_FREQS:
            continue
        hf_name = _hf_tensor_name(gguf_name)
        if hf_name is None:
            raise ValueError(f"{meta.path}: tensor {gguf_name!r} has no place in a {meta.arch} model")
        if tensor.tensor_type not in SUPPORTED_TENSOR_TYPES:
            supported = sorted(t.name for t in SUPPORTED_TENSOR_TYPES)
            raise ValueError(
                f"{meta.path}: tensor {gguf_name!r} has type {tensor.tensor_type.name}, "
                f"which axon cannot dequantize; supported: {supported}"
            )
        plan[hf_name] = tensor
    expected = _expected_hf_names(spec, config)
    if set(plan) != expected:
        missing, extra = sorted(expected - set(plan)), sorted(set(plan) - expected)
        raise ValueError(
            f"{meta.path}: tensors do not fit a {meta.arch} model: missing {missing[:5]}, unexpected {extra[:5]}"
        )
    return plan


def _dequantize(tensor: ReaderTensor) -> torch.Tensor:
    # ggml lists dims fastest-first (ne[0] = columns); numpy and torch want them reversed.
    shape = tuple(int(n) for n in reversed(tensor.shape.tolist()))
    values = dequantize(tensor.data, tensor.tensor_type).reshape(shape)
    if not values.flags.writeable or values.dtype != np.float32:
        values = np.array(values, dtype=np.float32)  # off the read-only mmap
    return torch.from_numpy(values)


def unpermute_rotary_rows(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's q/k row permutation.

    Per head, HF rows are [first half of rotary dims | second half]; llama.cpp stores them
    interleaved (row 2i from the first half, row 2i+1 from the second).
    weight: [num_heads * head_dim, ...] -> same shape.
    """
    head_dim = weight.shape[0] // num_heads
    split = weight.reshape(num_heads, head_dim // 2, 2, *weight.shape[1:])
    return split.transpose(1, 2).reshape(weight.shape).contiguous()


def _iter_hf_tensors(
    spec: GGUFArchitecture, config: dict[str, Any], plan: dict[str, ReaderTensor]
) -> Iterator[tuple[str, torch.Tensor]]:
    for hf_name, tensor in plan.items():
        weight = _dequantize(tensor)
        if spec.permuted_rotary and ".self_attn.q_proj." in hf_name:
            weight = unpermute_rotary_rows(weight, config["num_attention_heads"])
        elif spec.permuted_rotary and ".self_attn.k_proj." in hf_name:
            weight = unpermute_rotary_rows(weight, config["num_key_value_heads"])
        if ".mlp.experts." in hf_name:  # [E, out, in] -> one tensor per expert
            block, part = hf_name.split(".mlp.experts.")
            for expert, w in enumerate(weight):
                yield f"{block}.mlp.experts.{expert}.{part}", w.contiguous()
            continue
        yield hf_name, weight


def _write_safetensors(tensors: Iterator[tuple[str, torch.Tensor]], folder: str) -> None:
    """Write shards of at most SHARD_MAX_BYTES (one tensor may exceed it), holding one in memory."""
    shard_files: list[str] = []
    weight_map: dict[str, int] = {}
    shard: dict[str, torch.Tensor] = {}
    shard_bytes = total_bytes = 0

    def flush() -> None:
        name = f"shard-{len(shard_files)}.tmp"
        save_file(shard, os.path.join(folder, name), metadata={"format": "pt"})
        shard_files.append(name)
        shard.clear()

    for name, tensor in tensors:
        nbytes = tensor.numel() * tensor.element_size()
        if shard and shard_bytes + nbytes > SHARD_MAX_BYTES:
            flush()
            shard_bytes = 0
        shard[name] = tensor
        weight_map[name] = len(shard_files)
        shard_bytes += nbytes
        total_bytes += nbytes
    flush()
    if len(shard_files) == 1:
        os.rename(os.path.join(folder, shard_files[0]), os.path.join(folder, "model.safetensors"))
        return
    count = len(shard_files)
    final = [f"model-{i + 1:05d}-of-{count:05d}.safetensors" for i in range(count)]
    for tmp_name, final_name in zip(shard_files, final, strict=True):
        os.rename(os.path.join(folder, tmp_name), os.path.join(folder, final_name))
    index = {
        "metadata": {"total_size": total_bytes},
        "weight_map": {k: final[i] for k, i in weight_map.items()},
    }
    _write_json(os.path.join(folder, "model.safetensors.index.json"), index)


# ---- tokenizer and folder ---------------------------------------------------------------------


def _write_tokenizer(path: str, folder: str, chat_template: str | None, max_length: int) -> None:
    """Save transformers' fast tokenizer built from the file's own tokenizer metadata."""
    from transformers import AutoTokenizer  # heavy; only needed on a cache miss

    # A folder holding only the GGUF, so no stray tokenizer files beside the original are used.
    source = os.path.join(folder, ".source")
    os.mkdir(source)
    try:
        os.symlink(path, os.path.join(source, "model.gguf"))
        tokenizer = AutoTokenizer.from_pretrained(source, gguf_file="model.gguf", local_files_only=True)
    except Exception as e:  # transformers raises assorted types for tokenizers it cannot convert
        raise ValueError(
            f"{path}: cannot build a tokenizer from its metadata: {type(e).__name__}: {e}"
        ) from e
    finally:
        shutil.rmtree(source)
    tokenizer.save_pretrained(folder, save_jinja_files=False)
    config_path = os.path.join(folder, "tokenizer_config.json")
    with open(config_path, encoding="utf-8") as f:
        tokenizer_config = json.load(f)
    for key in ("is_local", "local_files_only"):  # facts about this load, not the tokenizer
        tokenizer_config.pop(key, None)
    tokenizer_config["model_max_length"] = max_length
    if chat_template is not None:
        tokenizer_config["chat_template"] = chat_template
    _write_json(config_path, tokenizer_config)


def _write_json(path: str, data: dict[str, Any]) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(data, f, indent=2, ensure_ascii=False)
        f.write("\n")


def _write_hf_folder(reader: GGUFReader, path: str, folder: str) -> None:
    meta = _Metadata(reader, path)
    spec = _architecture(meta)
    tensors = {tensor.name: tensor for tensor in reader.tensors}
    if "token_embd.weight" not in tensors:
        raise ValueError(f"{path} has no token_embd.weight tensor")
    config = _hf_config(meta, spec, tensors)
    plan = _plan_tensors(meta, spec, config, tensors)
    _write_json(os.path.join(folder, "config.json"), config)
    _write_json(os.path.join(folder, "generation_config.json"), _generation_config(meta, config))
    _write_tokenizer(path, folder, meta.get("tokenizer.chat_template"), config["max_position_embeddings"])
    _write_safetensors(_iter_hf_tensors(spec, config, plan), folder)
    for name in os.listdir(folder):
        os.chmod(os.path.join(folder, name), 0o644)


def quantized_linear_weights(gguf_path: str) -> dict[str, QuantizedWeight]:
    """HF weight name -> that 2-D weight's blocks as a ``QuantizedWeight``, for every tensor of
    a type kept quantized (``gguf_blocks.KEPT_QUANTIZED``), stacked experts as one weight per
    expert (``...mlp.experts.{e}.gate_proj.weight``); F32/F16 tensors are left out. q/k rows
    are un-permuted as the converted folder's are (whole rows: the blocks move as they are)."""
    reader = _open_reader(gguf_path)
    meta = _Metadata(reader, gguf_path)
    spec = _architecture(meta)
    tensors = {tensor.name: tensor for tensor in reader.tensors}
    config = _hf_config(meta, spec, tensors)
    heads = {".self_attn.q_proj.": "num_attention_heads", ".self_attn.k_proj.": "num_key_value_heads"}
    out: dict[str, QuantizedWeight] = {}
    for hf_name, tensor in _plan_tensors(meta, spec, config, tensors).items():
        if tensor.tensor_type not in KEPT_QUANTIZED:
            continue
        if ".mlp.experts." in hf_name and len(tensor.shape) == 3:  # [E, out, in]: one per expert
            cols, rows, _ = (int(n) for n in tensor.shape.tolist())
            block, part = hf_name.split(".mlp.experts.")
            for expert, data in enumerate(tensor.data):
                out[f"{block}.mlp.experts.{expert}.{part}"] = quantized_weight(
                    data, tensor.tensor_type, rows, cols
                )
            continue
        if len(tensor.shape) != 2:
            continue
        cols, rows = (int(n) for n in tensor.shape.tolist())  # ggml: ne[0] = columns
        weight = quantized_weight(tensor.data, tensor.tensor_type, rows, cols)
        for part, key in heads.items():
            if spec.permuted_rotary and part in hf_name:
                weight = weight.permute_rows(_unpermute_order(rows, config[key]))
        out[hf_name] = weight
    return out


def _unpermute_order(rows: int, num_heads: int) -> torch.Tensor:
    """The row order ``unpermute_rotary_rows`` gives: HF row i is GGUF row order[i]."""
    return unpermute_rotary_rows(torch.arange(rows).unsqueeze(1), num_heads).squeeze(1)
