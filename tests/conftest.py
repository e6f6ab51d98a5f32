"""Shared fixtures: the bundled SmolLM2 folder and tiny random-weight models of each family.

Random models are built with transformers' own config and model classes, saved as safetensors
folders with SmolLM2's tokenizer, so axon and the oracle load the very same weights.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

# The suite runs eagerly (compiling every engine's buckets would cost minutes on a CI machine);
# the compilation tests ask for enforce_eager=False themselves. Server subprocesses inherit it.
os.environ.setdefault("AXON_ENFORCE_EAGER", "1")

TINY_DIMS = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 512,
    "max_position_embeddings": 512,
}
MOE_DIMS = {"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 48}
GPT_OSS_DIMS = TINY_DIMS | {
    "num_hidden_layers": 4,
    "head_dim": 16,
    "intermediate_size": 32,
    "num_local_experts": 4,
    "num_experts_per_tok": 2,
    "sliding_window": 8,
    "rope_parameters": {
        "rope_type": "yarn",
        "factor": 8.0,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "truncate": False,
        "original_max_position_embeddings": 64,
        "rope_theta": 150000.0,
    },
}


def tiny_hf_config(family: str, tokenizer=None):
    import transformers as tf

    if family == "llama_full_vocab":
        # Four layers over the tokenizer's whole vocabulary, so text and chat prompts fit it.
        dims = TINY_DIMS | {"num_hidden_layers": 4, "vocab_size": len(tokenizer)}
        return tf.LlamaConfig(
            **dims,
            tie_word_embeddings=True,
            bos_token_id=tokenizer.bos_token_id,
            eos_token_id=tokenizer.eos_token_id,
        )
    if family == "llama_one_kv_head_full_vocab":  # decode context parallelism through axon serve
        dims = TINY_DIMS | {"num_hidden_layers": 4, "vocab_size": len(tokenizer), "num_key_value_heads": 1}
        return tf.LlamaConfig(
            **dims,
            tie_word_embeddings=True,
            bos_token_id=tokenizer.bos_token_id,
            eos_token_id=tokenizer.eos_token_id,
        )
    if family == "llama":
        return tf.LlamaConfig(**TINY_DIMS, tie_word_embeddings=False)
    if family == "llama3":
        return tf.LlamaConfig(
            **TINY_DIMS,
            rope_scaling={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
        )
    if family == "llama_one_kv_head_odd_vocab":
        # Tensor parallelism's corners: one KV head for two ranks, a vocabulary 2 does not divide.
        return tf.LlamaConfig(**{**TINY_DIMS, "num_key_value_heads": 1, "vocab_size": 509})
    if family == "llama_tied":
        return tf.LlamaConfig(**TINY_DIMS, tie_word_embeddings=True)
    if family == "qwen2":
        return tf.Qwen2Config(**TINY_DIMS)
    if family == "qwen3":
        return tf.Qwen3Config(**TINY_DIMS, head_dim=32)
    if family == "qwen3_one_kv_head":  # decode context parallelism: one KV head on every rank
        return tf.Qwen3Config(**{**TINY_DIMS, "num_key_value_heads": 1}, head_dim=32)
    if family == "qwen3_moe":
        # Layer 0 sparse (8 experts, 2 per token), layer 1 dense (mlp_only_layers).
        return tf.Qwen3MoeConfig(
            **TINY_DIMS, head_dim=32, **MOE_DIMS, norm_topk_prob=False, mlp_only_layers=[1]
        )
    if family == "qwen3_moe_step2":
        # Four layers, every second one sparse (decoder_sparse_step), top-k renormalized.
        dims = TINY_DIMS | {"num_hidden_layers": 4}
        return tf.Qwen3MoeConfig(**dims, head_dim=32, **MOE_DIMS, norm_topk_prob=True, decoder_sparse_step=2)
    if family == "qwen3_moe_full_vocab":
        # Every layer sparse, over the tokenizer's whole vocabulary (chat and text prompts fit it).
        dims = TINY_DIMS | {"vocab_size": len(tokenizer)}
        return tf.Qwen3MoeConfig(
            **dims,
            head_dim=32,
            **MOE_DIMS,
            tie_word_embeddings=True,
            bos_token_id=tokenizer.bos_token_id,
            eos_token_id=tokenizer.eos_token_id,
        )
    if family == "gpt_oss":
        # Alternating sliding (window 8) and full attention, sinks, YaRN, 4 experts (2 a token).
        return tf.GptOssConfig(**GPT_OSS_DIMS)
    if family == "gpt_oss_full_vocab":
        dims = GPT_OSS_DIMS | {"vocab_size": len(tokenizer)}
        return tf.GptOssConfig(
            **dims,
            tie_word_embeddings=True,
            bos_token_id=tokenizer.bos_token_id,
            eos_token_id=tokenizer.eos_token_id,
        )
    if family == "mistral":
        return tf.MistralConfig(**TINY_DIMS, sliding_window=None)
    raise KeyError(family)


@pytest.fixture(scope="session")
def smollm2_path() -> str:
    from axon.engine.arg_utils import create_engine_config

    path = create_engine_config().model_config.model_path
    assert path is not None
    return path


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory, smollm2_path: str):
    """family -> folder of a tiny random model (built once per session)."""
    import transformers as tf

    built: dict[str, str] = {}

    def make(family: str) -> str:
        if family not in built:
            torch.manual_seed(0)
            tokenizer = tf.AutoTokenizer.from_pretrained(smollm2_path)
            config = tiny_hf_config(family, tokenizer)
            model = tf.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
            with torch.no_grad():  # biases default to zero; make them count
                for name, p in model.named_parameters():
                    if name.endswith("bias"):
                        p.normal_(0, 0.1)
                    elif name.endswith("sinks"):  # GPT-OSS: sinks that take a real share of each softmax
                        p.normal_(0, 1.0)
            folder = Path(tmp_path_factory.mktemp(f"tiny-{family}"))
            model.save_pretrained(folder)
            tokenizer.save_pretrained(folder)
            built[family] = str(folder)
        return built[family]

    return make


@pytest.fixture(autouse=True, scope="session")
def _threads() -> None:
    torch.set_num_threads(min(2, os.cpu_count() or 1))


@pytest.fixture(scope="session")
def kernel_cache_root() -> str:
    """Where axon's C++ CPU kernels are built: the default cache root, shared with the engines
    the tests start, so the suite builds them once."""
    from axon.config import default_cache_root

    return default_cache_root()


# Qwen's vision tokens, added to SmolLM2's tokenizer for the tiny Qwen3-VL.
VISION_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>"]
# A ChatML template that writes Qwen's image placeholder for each {"type": "image"} part.
VL_CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@pytest.fixture(scope="session")
def qwen3_vl_dir(tmp_path_factory: pytest.TempPathFactory, smollm2_path: str) -> str:
    """A tiny random Qwen3-VL (3 decoder layers, a 3-block vision tower with two deepstack
    layers, patches of 16, an 8 x 8 position table), SmolLM2's tokenizer with Qwen's vision
    tokens and an image-aware chat template, images resized to 4,096 .. 16,384 pixels."""
    import json

    import transformers as tf

    tokenizer = tf.AutoTokenizer.from_pretrained(smollm2_path)
    tokenizer.add_special_tokens({"additional_special_tokens": VISION_TOKENS})
    tokenizer.chat_template = VL_CHAT_TEMPLATE
    start, end, pad = tokenizer.convert_tokens_to_ids(VISION_TOKENS)
    text = {
        "vocab_size": len(tokenizer),
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 3,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 32,
        "max_position_embeddings": 512,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [6, 5, 5],
                            "mrope_interleaved": True},
        "tie_word_embeddings": True,
        "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": tokenizer.eos_token_id,
    }  # fmt: skip
    vision = {
        "depth": 3,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_heads": 2,
        "out_hidden_size": 64,
        "patch_size": 16,
        "spatial_merge_size": 2,
        "temporal_patch_size": 2,
        "num_position_embeddings": 64,
        "deepstack_visual_indexes": [0, 1],
    }
    config = tf.Qwen3VLConfig(
        text_config=text,
        vision_config=vision,
        image_token_id=pad,
        vision_start_token_id=start,
        vision_end_token_id=end,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    model = tf.Qwen3VLForConditionalGeneration(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" not in name:
                p.normal_(0, 0.05)
    folder = Path(tmp_path_factory.mktemp("tiny-qwen3-vl"))
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    (folder / "preprocessor_config.json").write_text(
        json.dumps(
            {
                "patch_size": 16,
                "temporal_patch_size": 2,
                "merge_size": 2,
                "image_mean": [0.5, 0.5, 0.5],
                "image_std": [0.5, 0.5, 0.5],
                "size": {"shortest_edge": 64 * 64, "longest_edge": 128 * 128},
            }
        )
    )
    return str(folder)
