"""``axon router``: the prefix index by its invariants, the policies, the KV-event decoder, the
command line's usage errors, vLLM's disaggregated protocol against recording fake servers, and
the replica path through real ``axon serve`` processes with the official client (greedy answers
equal the servers' own, requests spread, a 4xx comes back unchanged, a client that leaves aborts
its request, a killed replica loses no request).
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import httpx
import msgspec
import openai
import psutil
import pytest
from aiohttp import web

from axon.entrypoints.cli import main
from axon.entrypoints.router.policies import Backend, make_policy, tokenize_request
from axon.entrypoints.router.prefix_index import (
    Cleared,
    KVEventSubscriber,
    PrefixIndex,
    Removed,
    ServerBlocks,
    Stored,
    chain_keys,
)
from axon.entrypoints.router.proxy import PREFILL_KV_TRANSFER_PARAMS, prefill_request
from axon.kv_transfer import kv_events
from tests.server.conftest import ServerProcess, free_port

BS = 4  # block size of the index tests

# ---- the prefix index -----------------------------------------------------------------------


def test_chain_keys_name_whole_prefixes() -> None:
    tokens = list(range(10))
    keys = chain_keys(tokens, BS)
    assert len(keys) == 2  # the partial third block has no key
    assert chain_keys(tokens[:8], BS) == keys  # a prefix's keys are the leading keys
    assert len(set(keys)) == 2
    # the same block after another parent is another key: a key names the whole prefix
    assert chain_keys([9, 9, 9, 9] + tokens[4:8], BS)[1] != keys[1]


def _stored(hashes: list[Any], parent: Any, tokens: list[int]) -> Stored:
    return Stored(hashes, parent, tokens, BS)


def test_index_matches_by_content_not_engine_hash() -> None:
    index = PrefixIndex(2, BS)
    prompt = list(range(100, 112))
    # Server 0 stores the prompt's three blocks in two events; server 1 only the first block, under
    # other engine hashes (another engine's seed).
    index.apply(0, [_stored([1, 2], None, prompt[:8]), _stored([3], 2, prompt[8:12])])
    index.apply(1, [_stored([77], None, prompt[:4])])
    keys = chain_keys(prompt + [5, 6], BS)
    assert [index.num_leading_blocks(s, keys) for s in (0, 1)] == [3, 1]
    # a chain whose parent the router never saw is not indexed: it cannot match from the root
    index.apply(1, [_stored([78], 999, prompt[4:8])])
    assert index.num_leading_blocks(1, keys) == 1


def test_index_removal_counts_blocks_of_equal_content() -> None:
    blocks = ServerBlocks()
    prompt = list(range(8))
    blocks.store([1, 2], None, prompt, BS)
    blocks.store([11], None, prompt[:4], BS)  # the first block again, another engine hash (a salt)
    keys = chain_keys(prompt, BS)
    blocks.remove([1])
    assert blocks.num_leading_blocks(keys) == 2  # hash 11 still holds the first block's content
    blocks.remove([11, 12345])  # an unknown hash is nothing to remove
    assert blocks.num_leading_blocks(keys) == 0
    blocks.clear()
    assert not blocks.content_key and not blocks.num_blocks


def test_all_blocks_cleared_empties_one_server() -> None:
    index = PrefixIndex(2, BS)
    for server in (0, 1):
        index.apply(server, [_stored([1], None, [1, 2, 3, 4])])
    index.apply(0, [Cleared()])
    keys = chain_keys([1, 2, 3, 4], BS)
    assert [index.num_leading_blocks(s, keys) for s in (0, 1)] == [0, 1]


def test_index_agrees_with_a_reference_after_random_events() -> None:
    """A simulated engine stores chains (a child only under a cached parent, as the engine's block
    table guarantees), evicts any block and sometimes clears; after every event the index's
    match of every known prompt equals the reference's: the longest run of leading prefixes the
    engine holds, whatever engine hash (salt) holds each."""
    rng = random.Random(0)
    prompts = [[rng.randrange(3) for _ in range(5 * BS)] for _ in range(12)]
    engine: dict[int, tuple[int, ...]] = {}  # engine hash -> the whole prefix its block ends
    index = PrefixIndex(1, BS)
    by_prefix = {}  # (salt, prefix) -> engine hash
    for step in range(600):
        op = rng.random()
        if op < 0.55:
            prompt, salt = rng.choice(prompts), rng.randrange(2)
            n = 0  # the cached run of this salt's chain
            while n < 5 and by_prefix.get((salt, tuple(prompt[: (n + 1) * BS]))) in engine:
                n += 1
            m = rng.randint(n, 5)
            if m == n:
                continue
            hashes = [
                by_prefix.setdefault((salt, tuple(prompt[: (i + 1) * BS])), 1000 * step + i)
                for i in range(n, m)
            ]
            for i, h in zip(range(n, m), hashes, strict=True):
                engine[h] = tuple(prompt[: (i + 1) * BS])
            parent = by_prefix[(salt, tuple(prompt[: n * BS]))] if n else None
            event: Any = _stored(hashes, parent, prompt[n * BS : m * BS])
        elif op < 0.97 and engine:
            victim = rng.choice(sorted(engine))
            del engine[victim]
            by_prefix = {k: h for k, h in by_prefix.items() if h != victim}
            event = Removed([victim])
        else:
            engine.clear()
            by_prefix.clear()
            event = Cleared()
        index.apply(0, [event])
        held = set(engine.values())
        for prompt in prompts:
            expected = 0
            while expected < 5 and tuple(prompt[: (expected + 1) * BS]) in held:
                expected += 1
            assert index.num_leading_blocks(0, chain_keys(prompt, BS)) == expected, step


# vLLM before vllm-project/vllm#42892 sent each event as an array, its tag first, and (with a
# sha256 block hasher) bytes block hashes.
class ArrayBlockStored(msgspec.Struct, array_like=True, tag="BlockStored"):
    block_hashes: list[bytes]
    parent_block_hash: bytes | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None


class ArrayBlockRemoved(msgspec.Struct, array_like=True, tag="BlockRemoved"):
    block_hashes: list[bytes]
    medium: str | None


def test_kv_event_messages_decode_into_the_index() -> None:
    """axon's publisher records (maps tagged by "type") and older vLLM's (tagged arrays), as
    ZMQ frames [topic, seq, payload], reach the index; an undecodable message is skipped."""
    index = PrefixIndex(2, BS)
    prompt = list(range(8))
    axon_batches = [
        kv_events.KVEventBatch(
            1.0, [kv_events.BlockStored([11, 12], None, prompt, BS, None, "GPU", None)], 0
        ),
        kv_events.KVEventBatch(2.0, [kv_events.BlockRemoved([12], "GPU")], 0),
    ]
    old_vllm_batches = [
        kv_events.EventBatch(1.0, [ArrayBlockStored([b"\x01" * 32], None, prompt[:4], BS, None, "GPU")]),
        kv_events.EventBatch(
            2.0, [ArrayBlockStored([b"\x02" * 32], b"\x01" * 32, prompt[4:], BS, None, "GPU")]
        ),
        kv_events.EventBatch(3.0, [ArrayBlockRemoved([b"\x01" * 32], "GPU")]),
    ]
    keys = chain_keys(prompt, BS)
    for server, batches in enumerate((axon_batches, old_vllm_batches)):
        subscriber = KVEventSubscriber("tcp://127.0.0.1:1", server, index)
        for seq, batch in enumerate(batches):
            subscriber.handle([b"kv", seq.to_bytes(8, "big"), msgspec.msgpack.encode(batch)])
            if seq == len(batches) - 2:  # all stored, before the last batch removes one
                assert index.num_leading_blocks(server, keys) == 2
        subscriber.handle([b"kv", (9).to_bytes(8, "big"), b"\x93not an event batch"])
    assert [index.num_leading_blocks(s, keys) for s in (0, 1)] == [1, 0]
    subscriber.handle(
        [
            b"",
            (10).to_bytes(8, "big"),
            msgspec.msgpack.encode(kv_events.KVEventBatch(4.0, [kv_events.AllBlocksCleared()])),
        ]
    )
    assert not index.servers[1].num_blocks


# ---- the policies ---------------------------------------------------------------------------


def _backends(n: int, role: str = "replica") -> list[Backend]:
    return [Backend(f"http://h{i}", role, i) for i in range(n)]


def _first_choices(policy: Any, backends: list[Backend], n: int, body: dict | None = None) -> list[int]:
    async def run() -> list[int]:
        return [(await policy.order(backends, "/v1/completions", body or {}))[0].index for _ in range(n)]

    return asyncio.run(run())


def test_round_robin_takes_turns_and_skips_down_backends() -> None:
    backends = _backends(3)
    assert _first_choices(make_policy("round_robin"), backends, 6) == [0, 1, 2, 0, 1, 2]
    backends[1].up = False
    ordered = asyncio.run(make_policy("round_robin").order(backends, "/v1/completions", {}))
    assert [b.index for b in ordered] == [0, 2, 1]  # the down one is the last resort


def test_least_loaded_takes_the_fewest_in_flight() -> None:
    backends = _backends(3)
    backends[0].in_flight, backends[1].in_flight, backends[2].in_flight = 3, 1, 2
    assert _first_choices(make_policy("least_loaded"), backends, 3) == [1, 1, 1]
    backends[1].up = False
    assert _first_choices(make_policy("least_loaded"), backends, 1) == [2]


def test_prefix_policy_takes_the_longest_cached_prefix_then_the_least_loaded() -> None:
    index = PrefixIndex(3, BS)
    prompt = list(range(20, 32))
    index.apply(0, [_stored([1], None, prompt[:4])])
    index.apply(2, [_stored([1, 2], None, prompt[:8])])
    observed: list[tuple[int, int]] = []

    async def tokenize(path: str, body: dict) -> list[int] | None:
        return body.get("ids")

    policy = make_policy("prefix", index, tokenize, lambda q, m: observed.append((q, m)))
    backends = _backends(3)
    backends[2].in_flight = 5  # load does not outweigh a longer prefix
    assert _first_choices(policy, backends, 1, {"ids": prompt}) == [2]
    assert observed == [(12, 8)]
    index.apply(0, [_stored([2], 1, prompt[4:8])])  # a tie: the less loaded
    assert _first_choices(policy, backends, 1, {"ids": prompt}) == [0]
    backends[0].up = False
    assert _first_choices(policy, backends, 1, {"ids": prompt}) == [2]
    assert _first_choices(policy, backends, 1, {}) == [1]  # no tokens: the least loaded


def test_tokenize_request_renders_what_the_server_renders() -> None:
    chat = {
        "model": "m",
        "messages": [{"role": "user", "content": "hi"}],
        "add_generation_prompt": False,
        "n": 2,
    }
    assert tokenize_request("/v1/chat/completions", chat) == {
        "model": "m",
        "messages": chat["messages"],
        "add_generation_prompt": False,
    }
    assert tokenize_request("/v1/completions", {"prompt": ["a b"]}) == {"prompt": "a b"}
    assert tokenize_request("/v1/completions", {"prompt": [[1, 2, 3]]}) == [1, 2, 3]
    assert tokenize_request("/v1/completions", {"prompt": ["a", "b"]}) is None  # a batch


def test_prefill_request_follows_vllms_protocol() -> None:
    body = {
        "model": "m",
        "messages": [],
        "stream": True,
        "stream_options": {"include_usage": True},
        "max_completion_tokens": 50,
        "min_tokens": 5,
        "temperature": 0.5,
    }
    assert prefill_request(body) == {
        "model": "m",
        "messages": [],
        "stream": False,
        "max_tokens": 1,
        "max_completion_tokens": 1,
        "temperature": 0.5,
        "kv_transfer_params": PREFILL_KV_TRANSFER_PARAMS,
    }
    assert "max_completion_tokens" not in prefill_request({"prompt": "x"})


# ---- the command line -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        ([], "no backends"),
        (["--prefill", "a:1"], "--prefill needs --decode"),
        (["--decode", "a:1"], "--decode needs --prefill"),
        (["--replica", "a:1", "--prefill", "b:1", "--decode", "c:1"], "does not go with --prefill"),
        (["--replica", "a:1", "--policy", "prefix"], "--policy prefix needs --kv-events"),
        (
            ["--replica", "a:1", "b:1", "--policy", "prefix", "--kv-events", "tcp://a:5"],
            "got 1 endpoints for 2",
        ),
        (["--replica", "a:1", "--policy", "prefix", "--kv-events", "tcp://*:5557"], "not *"),
        (["--replica", "a:1", "--kv-events", "tcp://a:5"], "--kv-events is read by --policy prefix only"),
        (["--replica", "http://a:1/v1"], "root URL"),
        (["--replica", "a:1", "http://a:1"], "given twice"),
        (["--replica", "a:1", "--block-size", "0"], "--block-size must be at least 1"),
        (["--replica", "a:1", "--policy", "fastest"], "invalid choice: 'fastest'"),
    ],
)
def test_usage_errors_name_the_flag(
    flags: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    try:
        code = main(["router", *flags])
    except SystemExit as e:  # argparse's own checks
        code = e.code
    assert code == 2
    assert message in capsys.readouterr().err


# ---- processes ------------------------------------------------------------------------------


class RouterProcess(ServerProcess):
    """``axon router`` on a free 127.0.0.1 port (ServerProcess's start, log, wait and stop)."""

    def __init__(self, *flags: str) -> None:  # not super().__init__: that one starts `serve`
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = tempfile.mktemp(prefix="axon-router-", suffix=".log")
        self._log = open(self.log_path, "w")  # noqa: SIM115 (closed in stop())
        cmd = [sys.executable, "-m", "axon.entrypoints.cli", "router", "--host", "127.0.0.1"]
        self.proc = subprocess.Popen(
            [*cmd, "--port", str(self.port), "--health-interval", "0.5", *flags],
            stdout=self._log,
            stderr=subprocess.STDOUT,
        )

    def samples(self, name: str, **labels: str) -> float:
        """The sum of ``name``'s samples whose labels include ``labels``."""
        total = 0.0
        for line in httpx.get(self.url + "/metrics").text.splitlines():
            if line.startswith((name + "{", name + " ")) and all(
                f'{k}="{v}"' in line for k, v in labels.items()
            ):
                total += float(line.rsplit(" ", 1)[1])
        return total


def _eventually(check: Any, timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if check():
            return True
        time.sleep(0.1)
    return False


# ---- the disaggregated protocol, against recording fake servers -----------------------------

BAD_INPUT = {"error": {"message": "bad input", "type": "invalid_request_error", "param": "x", "code": None}}


@dataclass
class FakeServer:
    """An OpenAI-shaped server that records each request and answers as ``mode`` says: ok,
    error500, error400, or break (a stream that dies after its first event)."""

    name: str
    port: int = field(default_factory=free_port)
    mode: str = "ok"
    received: list[tuple[str, dict[str, str], dict[str, Any]]] = field(default_factory=list)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def kv_transfer_params(self) -> dict[str, Any]:
        return {"do_remote_prefill": True, "remote_engine_id": self.name, "remote_block_ids": [1, 2]}

    async def generate(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.received.append((request.path, {k.lower(): v for k, v in request.headers.items()}, body))
        if self.mode in ("error500", "error400"):
            return web.json_response(BAD_INPUT, status=int(self.mode[-3:]))
        chat = request.path.endswith("/chat/completions")
        words = ["Hello", " from", f" {self.name}"]
        if not body.get("stream"):
            choice = (
                {"message": {"role": "assistant", "content": "".join(words)}}
                if chat
                else {"text": "".join(words)}
            )
            return web.json_response(
                {
                    "id": "x",
                    "object": "chat.completion" if chat else "text_completion",
                    "created": 0,
                    "model": "fake",
                    "choices": [{"index": 0, "finish_reason": "length", **choice}],
                    "kv_transfer_params": self.kv_transfer_params,
                }
            )
        out = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await out.prepare(request)
        for word in words:
            choice = {"delta": {"content": word}} if chat else {"text": word}
            chunk = {
                "id": "x",
                "object": "chunk",
                "created": 0,
                "model": "fake",
                "choices": [{"index": 0, **choice}],
            }
            await out.write(f"data: {json.dumps(chunk)}\n\n".encode())
            if self.mode == "break":
                request.transport.close()  # dies mid-answer
                return out
        await out.write(b"data: [DONE]\n\n")
        return out

    async def health(self, request: web.Request) -> web.Response:
        return web.Response()

    async def start(self) -> web.AppRunner:
        app = web.Application()
        app.router.add_post("/v1/completions", self.generate)
        app.router.add_post("/v1/chat/completions", self.generate)
        app.router.add_get("/health", self.health)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", self.port).start()
        return runner


@pytest.fixture(scope="module")
def fakes() -> Iterator[dict[str, FakeServer]]:
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    servers = {name: FakeServer(name) for name in ("p1", "p2", "d1")}
    runners = [asyncio.run_coroutine_threadsafe(s.start(), loop).result() for s in servers.values()]
    yield servers
    for runner in runners:
        asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result()
    loop.call_soon_threadsafe(loop.stop)
    thread.join()


@pytest.fixture(scope="module")
def disagg_router(fakes: dict[str, FakeServer]) -> Iterator[RouterProcess]:
    router = RouterProcess("--prefill", fakes["p1"].url, fakes["p2"].url, "--decode", fakes["d1"].url)
    yield router.wait_ready(30)
    router.stop()


@pytest.fixture()
def disagg(
    disagg_router: RouterProcess, fakes: dict[str, FakeServer]
) -> tuple[RouterProcess, dict[str, FakeServer]]:
    for server in fakes.values():
        server.mode = "ok"
        server.received.clear()
    return disagg_router, fakes


def test_disaggregated_request_takes_vllms_two_steps(disagg) -> None:
    router, fakes = disagg
    client = router.client()
    reply = client.completions.create(
        model="fake", prompt="Hi", max_tokens=5, extra_headers={"X-Request-Id": "r1"}
    )
    assert reply.choices[0].text == "Hello from d1"
    [(prefill_server, prefill)] = [(s, r) for s in ("p1", "p2") for r in fakes[s].received]
    [(path, d_headers, decode)] = fakes["d1"].received
    assert prefill[2] == {
        "model": "fake",
        "prompt": "Hi",
        "max_tokens": 1,
        "stream": False,
        "kv_transfer_params": PREFILL_KV_TRANSFER_PARAMS,
    }
    assert path == prefill[0] == "/v1/completions"
    assert decode == {"model": "fake", "prompt": "Hi", "max_tokens": 5, **_params(fakes[prefill_server])}
    assert prefill[1]["x-request-id"] == d_headers["x-request-id"] == "r1"


def _params(server: FakeServer) -> dict[str, Any]:
    return {"kv_transfer_params": server.kv_transfer_params}


def test_disaggregated_chat_streams_the_decode_answer(disagg) -> None:
    router, fakes = disagg
    stream = router.client().chat.completions.create(
        model="fake",
        messages=[{"role": "user", "content": "Hi"}],
        max_completion_tokens=7,
        stream=True,
        stream_options={"include_usage": True},
    )
    assert "".join(c.choices[0].delta.content or "" for c in stream) == "Hello from d1"
    [prefill] = [r[2] for s in ("p1", "p2") for r in fakes[s].received]
    assert prefill["max_completion_tokens"] == prefill["max_tokens"] == 1
    assert not prefill["stream"] and "stream_options" not in prefill
    [(_, _, decode)] = fakes["d1"].received
    assert decode["stream"] and decode["stream_options"] == {"include_usage": True}
    assert decode["max_completion_tokens"] == 7 and "max_tokens" not in decode


def test_a_failing_prefill_server_passes_the_request_on(disagg) -> None:
    router, fakes = disagg
    fakes["p1"].mode = "error500"
    for _ in range(2):  # whichever prefill server the turn names first, p2 takes it
        assert (
            router.client().completions.create(model="fake", prompt="Hi").choices[0].text == "Hello from d1"
        )
    assert [r[2]["kv_transfer_params"] for r in fakes["d1"].received] == [fakes["p2"].kv_transfer_params] * 2
    assert router.samples("axon_router:retries_total", role="prefill") >= 1
    assert router.samples("axon_router:backend_failures_total", backend=fakes["p1"].url) >= 1


def test_no_prefill_server_means_the_decode_server_computes_the_prompt(disagg) -> None:
    router, fakes = disagg
    fakes["p1"].mode = fakes["p2"].mode = "error500"
    fallbacks = router.samples("axon_router:fallbacks_total")
    reply = router.client().completions.create(model="fake", prompt="Hi", max_tokens=3)
    assert reply.choices[0].text == "Hello from d1"
    assert [r[2] for r in fakes["d1"].received] == [{"model": "fake", "prompt": "Hi", "max_tokens": 3}]
    assert router.samples("axon_router:fallbacks_total") == fallbacks + 1


def test_a_4xx_from_the_prefill_server_is_the_clients_answer(disagg) -> None:
    router, fakes = disagg
    fakes["p1"].mode = fakes["p2"].mode = "error400"
    answer = httpx.post(router.url + "/v1/completions", json={"model": "fake", "prompt": "Hi"})
    assert answer.status_code == 400 and answer.json() == BAD_INPUT
    assert sum(len(fakes[s].received) for s in ("p1", "p2")) == 1  # not retried
    assert not fakes["d1"].received


def test_a_stream_that_breaks_off_ends_with_an_error_event(disagg) -> None:
    router, fakes = disagg
    fakes["d1"].mode = "break"
    stream = router.client().completions.create(model="fake", prompt="Hi", stream=True)
    texts = []
    with pytest.raises(openai.APIError, match="failed mid-answer"):
        for chunk in stream:
            texts.append(chunk.choices[0].text)
    assert texts == ["Hello"]
    assert len(fakes["d1"].received) == 1  # bytes had reached the client: no retry


def test_router_pages_and_unknown_paths(disagg_router: RouterProcess) -> None:
    router = disagg_router
    # (d1 may be down from the test before, until its next probe)
    assert _eventually(lambda: httpx.get(router.url + "/health").status_code == 200, 5.0)
    health = httpx.get(router.url + "/health")
    assert health.json()["status"] == "ok"
    assert {b["role"] for b in health.json()["backends"]} == {"prefill", "decode"}
    missing = httpx.post(router.url + "/v1/nothing", json={})
    assert missing.status_code == 404
    assert missing.json()["error"]["message"] == "Invalid URL (POST /v1/nothing)"
    bad = httpx.post(router.url + "/v1/completions", content=b"{not json")
    assert bad.status_code == 400 and "not JSON" in bad.json()["error"]["message"]
    page = httpx.get(router.url + "/metrics").text
    for name in ("requests_total", "requests_in_flight", "backend_up", "request_latency_seconds_bucket"):
        assert f"axon_router:{name}" in page


MAX_TOKENS = 16
QUESTIONS = ["What is the capital of France?", "Why is the sky blue?"]
PROMPTS = ["The quick brown fox", "Once upon a time"]


# ---- disaggregated: real axon serve processes -----------------------------------------------


@pytest.fixture(scope="module")
def storage_1p1d(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tuple[RouterProcess, list[ServerProcess]]]:
    """A prefill and a decode server sharing KV through SharedStorageConnector (no NIXL needed),
    behind a router."""
    extra = {"shared_storage_path": str(tmp_path_factory.mktemp("kv-store"))}
    servers = [
        ServerProcess(
            "--kv-transfer-config",
            json.dumps(
                {
                    "kv_connector": "SharedStorageConnector",
                    "kv_role": role,
                    "kv_connector_extra_config": extra,
                }
            ),
        )
        for role in ("kv_producer", "kv_consumer")
    ]
    router = RouterProcess("--prefill", servers[0].url, "--decode", servers[1].url)
    try:
        for server in servers:
            server.wait_ready()
        yield router.wait_ready(30), servers
    finally:
        router.stop()
        for server in servers:
            server.stop()


def test_disaggregated_answers_equal_one_servers(storage_1p1d) -> None:
    """Through the router the decode server loads each prompt's KV from the prefill server and
    answers as one server answers alone (the prefill server without kv_transfer_params)."""
    router, (prefill, decode) = storage_1p1d
    model = prefill.client().models.list().data[0].id
    # prompts of several full blocks: only full blocks travel, the rest is computed on the decode side
    prompts = [
        f"{p}, as the old story goes, in a small village by the sea where the fishermen" for p in PROMPTS
    ]
    loaded = decode.metric("vllm:shared_storage_bytes_transferred_count")
    messages = [{"role": "user", "content": QUESTIONS[0]}]
    answers = {}
    for server in (router, prefill):
        client = server.client()
        kwargs: dict[str, Any] = {"model": model, "temperature": 0, "max_tokens": MAX_TOKENS}
        stream = client.completions.create(prompt=prompts[0], stream=True, **kwargs)
        answers[server.url] = [
            client.completions.create(prompt=prompts[1], **kwargs).choices[0].text,
            "".join(c.choices[0].text for c in stream if c.choices),
            client.chat.completions.create(messages=messages, **kwargs).choices[0].message.content,
        ]
    assert answers[router.url] == answers[prefill.url]
    assert all(answers[router.url])
    assert decode.metric("vllm:shared_storage_bytes_transferred_count") >= loaded + 3
    assert router.samples("axon_router:fallbacks_total") == 0
    assert router.samples("axon_router:requests_total", role="prefill") == 3
    assert router.samples("axon_router:requests_total", role="decode") == 3


# ---- replicas: real axon serve processes ----------------------------------------------------


@pytest.fixture(scope="module")
def kv_events_ports() -> list[int]:
    return [free_port(), free_port()]


@pytest.fixture(scope="module")
def replicas(kv_events_ports: list[int]) -> Iterator[list[ServerProcess]]:
    """Two replicas that publish their KV cache events (read by the prefix policy's router)."""
    started = [
        ServerProcess(
            "--kv-events-config",
            json.dumps({"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://*:{port}"}),
        )
        for port in kv_events_ports
    ]
    try:
        yield [s.wait_ready() for s in started]
    finally:
        for s in started:
            s.stop()


@pytest.fixture(scope="module")
def router(replicas: list[ServerProcess]) -> Iterator[RouterProcess]:
    router = RouterProcess("--replica", *(s.url for s in replicas))
    yield router.wait_ready(30)
    router.stop()


@pytest.fixture(scope="module")
def model(replicas: list[ServerProcess]) -> str:
    return replicas[0].client().models.list().data[0].id


def _answers(server: ServerProcess, model: str, stream: bool) -> list[str]:
    client = server.client()
    out = []
    for prompt in PROMPTS:
        kwargs: dict[str, Any] = {
            "model": model,
            "prompt": prompt,
            "max_tokens": MAX_TOKENS,
            "temperature": 0,
        }
        if stream:
            out.append("".join(c.choices[0].text for c in client.completions.create(stream=True, **kwargs)))
        else:
            out.append(client.completions.create(**kwargs).choices[0].text)
    for question in QUESTIONS:
        kwargs = {"model": model, "messages": [{"role": "user", "content": question}], "temperature": 0}
        if stream:
            chunks = client.chat.completions.create(stream=True, max_tokens=MAX_TOKENS, **kwargs)
            out.append("".join(c.choices[0].delta.content or "" for c in chunks))
        else:
            reply = client.chat.completions.create(max_completion_tokens=MAX_TOKENS, **kwargs)
            out.append(reply.choices[0].message.content or "")
    return out


def _finished(server: ServerProcess) -> float:
    return sum(server.successes_per_engine().values())


def test_replicas_answer_as_the_servers_do_and_share_the_work(router, replicas, model) -> None:
    before = [_finished(s) for s in replicas]
    with ThreadPoolExecutor(4) as pool:  # the same greedy answers in any batch (batch invariance)
        answers = {
            (server, stream): pool.submit(_answers, server, model, stream)
            for server in (router, replicas[0])
            for stream in (False, True)
        }
    through_router = {stream: answers[router, stream].result() for stream in (False, True)}
    direct = {stream: answers[replicas[0], stream].result() for stream in (False, True)}
    assert through_router == direct
    assert all(through_router[True])
    gained = [_finished(s) - b for s, b in zip(replicas, before, strict=True)]
    # the router's 8 requests in turn: 4 each; replica 0 answered the 8 direct ones too
    assert gained == [12, 4]
    for server in replicas:
        assert router.samples("axon_router:requests_total", backend=server.url, role="replica") == 4


def test_a_4xx_comes_back_unchanged(router, replicas, model) -> None:
    body = {"model": model, "prompt": "Hi", "max_tokens": -1}
    direct = httpx.post(replicas[0].url + "/v1/completions", json=body)
    routed = httpx.post(router.url + "/v1/completions", json=body)
    assert routed.status_code == direct.status_code == 400
    assert routed.json() == direct.json()
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        router.client().completions.create(model=model, prompt="Hi", max_tokens=-1)
    assert router.samples("axon_router:backend_up") == 2  # the client's error is no backend's


def test_models_and_health_come_from_the_replicas(router, replicas) -> None:
    assert router.client().models.list().data[0].id == replicas[0].client().models.list().data[0].id
    assert httpx.get(router.url + "/health").status_code == 200


def test_a_client_that_leaves_aborts_its_request(router, replicas) -> None:
    def running() -> float:
        return sum(s.metric("vllm:num_requests_running") for s in replicas)

    body = {"prompt": "Once upon a time", "max_tokens": 400, "ignore_eos": True, "temperature": 0}
    with httpx.stream("POST", router.url + "/v1/completions", json={**body, "stream": True}) as r:
        lines = r.iter_lines()  # held: a discarded iterator would close the connection early
        for i, _ in enumerate(lines):
            if i >= 4:
                break
        assert running() == 1
    assert _eventually(lambda: running() == 0, 5.0)
    try:  # a non-streaming client that gives up
        httpx.post(router.url + "/v1/completions", json=body, timeout=1.0)
    except httpx.TimeoutException:
        pass
    assert _eventually(lambda: running() == 0, 5.0)


@pytest.fixture(scope="module")
def prefix_router(replicas: list[ServerProcess], kv_events_ports: list[int]) -> Iterator[RouterProcess]:
    endpoints = [f"tcp://127.0.0.1:{port}" for port in kv_events_ports]
    router = RouterProcess(
        "--replica", *(s.url for s in replicas), "--policy", "prefix", "--kv-events", *endpoints
    )
    yield router.wait_ready(30)
    router.stop()


SHARED_PREFIX = "You answer questions about the city library, its rooms, its books and its maps. " * 6


def test_prefix_policy_sends_a_cached_prefix_where_it_is_cached(prefix_router, replicas, model) -> None:
    """After one request with a long prefix, the next ones with that prefix go to the replica
    whose KV events said it holds it, and hit its prefix cache there."""

    def per_replica(read: Any) -> list[float]:
        return [read(s) for s in replicas]

    def routed() -> list[float]:
        return per_replica(lambda s: prefix_router.samples("axon_router:requests_total", backend=s.url))

    def hits() -> list[float]:
        return per_replica(lambda s: s.metric("vllm:prefix_cache_hits_total"))

    def ask(i: int) -> None:
        prompt = f"{SHARED_PREFIX}Question {i}: where are the maps?"
        prefix_router.client().completions.create(model=model, prompt=prompt, max_tokens=2, temperature=0)

    before = routed()
    ask(0)
    [holder] = [i for i, (now, then) in enumerate(zip(routed(), before, strict=True)) if now > then]
    url = replicas[holder].url
    assert _eventually(lambda: prefix_router.samples("axon_router:prefix_cached_blocks", backend=url) >= 4)
    before, hits_before = routed(), hits()
    for i in range(1, 4):
        ask(i)
    gained = [now - then for now, then in zip(routed(), before, strict=True)]
    assert gained[holder] == 3 and gained[1 - holder] == 0
    cache_hits = [now - then for now, then in zip(hits(), hits_before, strict=True)]
    assert cache_hits[holder] >= 3 * 4 * 16  # at least the 4 blocks the router saw, each time
    assert prefix_router.samples("axon_router:prefix_matched_tokens_total") >= 3 * 4 * 16
    assert 0 < prefix_router.samples("axon_router:prefix_hit_rate") <= 1


def test_a_killed_replica_loses_no_request(router, replicas, model) -> None:
    """Replica 1 dies (its whole process tree, as a host would) while it answers requests; they
    go to replica 0 and every client gets its full greedy answer. Runs last: it kills a replica."""
    victim = replicas[1]
    prompts = [f"{p} number {i}" for i in range(2) for p in PROMPTS]
    kwargs: dict[str, Any] = {
        "model": model,
        "max_tokens": 48,
        "temperature": 0,
        "extra_body": {"ignore_eos": True},
    }

    def ask(server: ServerProcess, prompt: str) -> str:
        return server.client().completions.create(prompt=prompt, **kwargs).choices[0].text

    with ThreadPoolExecutor(len(prompts)) as pool:
        expected = list(pool.map(lambda p: ask(replicas[0], p), prompts))
        answers = [pool.submit(ask, router, p) for p in prompts]
        assert _eventually(lambda: victim.metric("vllm:num_requests_running") > 0, 30.0)
        tree = [victim.proc.pid] + [c.pid for c in psutil.Process(victim.proc.pid).children(recursive=True)]
        for pid in tree:
            os.kill(pid, signal.SIGKILL)
        assert [a.result(timeout=120) for a in answers] == expected
    assert router.samples("axon_router:backend_failures_total", backend=victim.url) >= 1
    assert router.samples("axon_router:retries_total", role="replica") >= 1
    assert router.samples("axon_router:unserved_requests_total") == 0
    assert _eventually(lambda: router.samples("axon_router:backend_up", backend=victim.url) == 0)
    assert ask(router, prompts[0]) == expected[0]
    assert httpx.get(router.url + "/health").json()["status"] == "ok"
