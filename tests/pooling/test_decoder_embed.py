"""Decoders as embedders (Qwen3-Embedding style) against transformers' Qwen3 hidden states.

The model is a tiny random-weight Qwen3 (transformers' own classes), saved with SmolLM2's
tokenizer and a vocabulary that covers it, so text prompts work. The oracle is transformers'
final normed hidden state at the last token (or the mean over tokens), in float32.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

TEXTS = [
    "Hello world",
    "The quick brown fox jumps over the lazy dog.",
    "A",
    "Embeddings from a decoder take the last token's hidden state.",
    "short one",
    "Paris is the capital and most populous city of France, on the Seine.",
]
INSTRUCTION = "Instruct: Given a query, retrieve relevant passages\nQuery:"


def _qwen3_config(vocab_size: int):
    import transformers as tf

    return tf.Qwen3Config(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        vocab_size=vocab_size,
        max_position_embeddings=512,
        tie_word_embeddings=True,
    )


@pytest.fixture(scope="module")
def hf_model(tmp_path_factory: pytest.TempPathFactory, smollm2_path: str):
    """(folder with architecture Qwen3ForCausalLM, the transformers model, its tokenizer)."""
    import transformers as tf

    tokenizer = tf.AutoTokenizer.from_pretrained(smollm2_path)
    torch.manual_seed(0)
    model = tf.Qwen3ForCausalLM(_qwen3_config(len(tokenizer))).eval()
    folder = Path(tmp_path_factory.mktemp("tiny-qwen3-embedding"))
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return str(folder), model, tokenizer


@pytest.fixture(scope="module")
def embedder(hf_model):
    from axon import LLM

    return LLM(model=hf_model[0], runner="pooling", dtype="float32")


def _hidden(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model.model(torch.tensor([ids])).last_hidden_state[0]  # [L, hidden]


def _normalized(v: torch.Tensor) -> np.ndarray:
    return torch.nn.functional.normalize(v, dim=-1).numpy()


def test_last_token_matches_transformers(embedder, hf_model) -> None:
    _, model, tokenizer = hf_model
    outputs = embedder.embed(TEXTS)  # one batch of mixed lengths
    for text, out in zip(TEXTS, outputs, strict=True):
        ids = tokenizer.encode(text)
        assert out.prompt_token_ids == ids
        expected = _normalized(_hidden(model, ids)[-1])
        vec = np.asarray(out.outputs.embedding)
        assert vec.shape == (64,)
        assert float(vec @ expected) >= 0.9999, text
        assert np.allclose(vec, expected, atol=1e-5), text


def test_batched_equals_one_by_one(embedder) -> None:
    batched = embedder.embed(TEXTS)
    for text, out in zip(TEXTS, batched, strict=True):
        single = embedder.embed(text)[0]
        assert np.allclose(single.outputs.embedding, out.outputs.embedding, atol=1e-5), text


def test_pooler_config_mean_without_normalize(hf_model) -> None:
    from axon import LLM

    folder, model, tokenizer = hf_model
    llm = LLM(
        model=folder,
        runner="pooling",
        dtype="float32",
        pooler_config='{"pooling_type": "MEAN", "normalize": false}',
    )
    for text, out in zip(TEXTS[:3], llm.embed(TEXTS[:3]), strict=True):
        expected = _hidden(model, tokenizer.encode(text)).mean(0).numpy()
        assert np.allclose(out.outputs.embedding, expected, atol=1e-5), text


def test_segmented_prompts_batched_with_others_equal_alone(hf_model) -> None:
    """A decoder embedder runs like generation: prompts longer than the step budget are prefilled
    over several steps through the paged KV cache, batched with the other requests' segments; the
    runner pools every segment's hidden states (MEAN needs them all) into what one forward gives."""
    from axon import LLM

    folder, model, tokenizer = hf_model
    llm = LLM(
        model=folder,
        runner="pooling",
        dtype="float32",
        max_num_batched_tokens=8,
        pooler_config='{"pooling_type": "MEAN", "normalize": false}',
    )
    batched = llm.embed(TEXTS)
    for text, out in zip(TEXTS, batched, strict=True):
        expected = _hidden(model, tokenizer.encode(text)).mean(0).numpy()
        assert np.allclose(out.outputs.embedding, expected, atol=1e-5), text
        assert np.allclose(llm.embed(text)[0].outputs.embedding, out.outputs.embedding, atol=1e-5), text
    assert llm.llm_engine.engine_core.scheduler.kv_cache_manager.usage == 0


def test_instruction_is_prepended_to_text(hf_model, embedder) -> None:
    from axon import LLM

    folder, _, tokenizer = hf_model
    llm = LLM(model=folder, runner="pooling", dtype="float32", pooler_config={"instruction": INSTRUCTION})
    out = llm.embed("What is the capital of France?")[0]
    assert out.prompt_token_ids == tokenizer.encode(INSTRUCTION + "What is the capital of France?")
    assert out.prompt == "What is the capital of France?"
    plain = embedder.embed(INSTRUCTION + "What is the capital of France?")[0]
    assert np.allclose(out.outputs.embedding, plain.outputs.embedding, atol=1e-6)
    ids = tokenizer.encode("no instruction for token ids")
    assert llm.embed({"prompt_token_ids": ids})[0].prompt_token_ids == ids
    with pytest.raises(ValueError, match="empty"):
        llm.embed("")


def test_bare_decoder_checkpoint_is_an_embedder(tmp_path, hf_model, embedder) -> None:
    """A Qwen3Model folder (no LM head, unprefixed names, as Qwen3-Embedding ships) pools by default."""
    from axon import LLM

    _, model, tokenizer = hf_model
    model.model.save_pretrained(tmp_path)  # architectures: ["Qwen3Model"]
    tokenizer.save_pretrained(tmp_path)
    llm = LLM(model=str(tmp_path), dtype="float32")
    assert llm.runner_type == "pooling"
    for a, b in zip(llm.embed(TEXTS[:2]), embedder.embed(TEXTS[:2]), strict=True):
        assert np.allclose(a.outputs.embedding, b.outputs.embedding, atol=1e-6)


def test_runner_and_pooler_config_errors(hf_model) -> None:
    from axon import LLM
    from axon.engine.arg_utils import create_engine_config

    folder = hf_model[0]
    assert create_engine_config(model=folder).model_config.runner == "generate"  # explicit pooling only
    with pytest.raises(ValueError, match="pooler_config applies only to embedding models"):
        create_engine_config(model=folder, pooler_config={"normalize": False})
    with pytest.raises(ValueError, match="unknown key 'pooling'"):
        create_engine_config(model=folder, runner="pooling", pooler_config={"pooling": "LAST"})
    with pytest.raises(ValueError, match="pooling_type 'FIRST' is not supported"):
        create_engine_config(model=folder, runner="pooling", pooler_config={"pooling_type": "FIRST"})
    llm = LLM(model=folder, runner="pooling", dtype="float32")
    with pytest.raises(ValueError, match="embed"):
        llm.generate("hi")
