"""Disaggregated prefill/decode through real ``axon serve`` processes on 127.0.0.1, with vLLM's
request protocol (``kv_transfer_params``) and the official client: 1P1D and 2P1D over NIXL
(UCX on loopback, host memory), and the same over the shared-storage connector.

The prefill server is also the reference: a request without ``kv_transfer_params`` is served
there whole, so a disaggregated answer must equal its greedy answer token for token. (Not the
decode server: its prefix cache would then hold the prompt, and nothing would be loaded.)
"""

from __future__ import annotations

import importlib.util
import json
import os
import time
from collections.abc import Iterator

import openai
import pytest
from conftest import ServerProcess, free_port

HAVE_NIXL = importlib.util.find_spec("nixl_cu12") is not None or importlib.util.find_spec("nixl") is not None
needs_nixl = pytest.mark.skipif(not HAVE_NIXL, reason="NIXL is not installed (pip install nixl-cu12)")

PROMPTS = [
    (
        "The history of the city of Rome begins with a small settlement on the banks of the Tiber, "
        "where shepherds and farmers lived among seven hills."
    ),
    (
        "A short guide to brewing coffee: start with fresh beans, grind them just before brewing, and "
        "use water just below boiling. Then"
    ),
    (
        "Write a haiku about autumn leaves falling on a quiet river, where the water carries them past "
        "the old mill and under the stone bridge."
    ),
]
QUESTION = "Describe the water cycle in two sentences."
PREFILL = {"do_remote_decode": True, "do_remote_prefill": False}


def _nixl(role: str, **extra: object) -> tuple[tuple[str, ...], dict[str, str]]:
    config = {"kv_connector": "NixlConnector", "kv_role": role, "kv_connector_extra_config": extra}
    env = {"UCX_NET_DEVICES": "lo", "VLLM_NIXL_SIDE_CHANNEL_PORT": str(free_port())}
    return ("--kv-transfer-config", json.dumps(config)), env


def _storage(role: str, path: str) -> tuple[tuple[str, ...], dict[str, str]]:
    extra = {"shared_storage_path": path}
    config = {"kv_connector": "SharedStorageConnector", "kv_role": role, "kv_connector_extra_config": extra}
    return ("--kv-transfer-config", json.dumps(config)), {}


def _start(*setups: tuple[tuple[str, ...], dict[str, str]]) -> list[ServerProcess]:
    servers = [ServerProcess(*args, "--enforce-eager", env=env) for args, env in setups]
    for s in servers:
        s.wait_ready()
    return servers


class Pair:
    """Prefill servers and one decode server, and the two hops of vLLM's proxy."""

    def __init__(self, prefill: list[ServerProcess], decode: ServerProcess) -> None:
        self.prefill, self.decode = prefill, decode
        self.storage_path = ""  # SharedStorageConnector's folder
        self.model = decode.client().models.list().data[0].id

    def prefill_params(self, server: ServerProcess, prompt: str) -> dict:
        out = server.client().completions.create(
            model=self.model,
            prompt=prompt,
            max_tokens=1,
            temperature=0,
            extra_body={"kv_transfer_params": PREFILL},
        )
        params = out.model_extra["kv_transfer_params"]
        assert params["do_remote_prefill"] is True, params
        return params

    def complete(self, prompt: str, params: dict | None, stream: bool = False, max_tokens: int = 24) -> str:
        """On the decode server with ``params``; without them, the reference on a prefill server."""
        extra = {} if params is None else {"extra_body": {"kv_transfer_params": params}}
        client = (self.prefill[0] if params is None else self.decode).client()
        if not stream:
            out = client.completions.create(
                model=self.model, prompt=prompt, max_tokens=max_tokens, temperature=0, **extra
            )
            return out.choices[0].text
        chunks = client.completions.create(
            model=self.model, prompt=prompt, max_tokens=max_tokens, temperature=0, stream=True, **extra
        )
        return "".join(c.choices[0].text for c in chunks if c.choices)

    def kv_usage_settles_to_zero(self, timeout_s: float = 10.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            usage = [
                s.metric("vllm:kv_cache_usage_perc")
                for s in (*self.prefill, self.decode)
                if s.proc.poll() is None
            ]
            if all(u == 0.0 for u in usage):
                return
            time.sleep(0.1)
        raise AssertionError(f"KV cache usage did not return to 0: {usage}")


@pytest.fixture(scope="module")
def nixl_2p1d() -> Iterator[Pair]:
    if not HAVE_NIXL:
        pytest.skip("NIXL is not installed (pip install nixl-cu12)")
    servers = _start(_nixl("kv_producer"), _nixl("kv_producer"), _nixl("kv_consumer", handshake_timeout=2))
    yield Pair(servers[:2], servers[2])
    for s in servers:
        s.stop()


@pytest.fixture(scope="module")
def storage_1p1d(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pair]:
    path = str(tmp_path_factory.mktemp("kv-store"))
    servers = _start(_storage("kv_producer", path), _storage("kv_consumer", path))
    pair = Pair(servers[:1], servers[1])
    pair.storage_path = path
    yield pair
    for s in servers:
        s.stop()


@needs_nixl
@pytest.mark.parametrize("stream", [False, True], ids=["full", "streamed"])
def test_nixl_1p1d_equals_one_server(nixl_2p1d: Pair, stream: bool) -> None:
    pair = nixl_2p1d
    for prompt in PROMPTS:
        want = pair.complete(prompt, None)
        params = pair.prefill_params(pair.prefill[0], prompt)
        assert params["remote_block_ids"] and params["remote_port"], params
        assert pair.complete(prompt, params, stream=stream) == want
    pair.kv_usage_settles_to_zero()
    # The decode server loaded every prompt: nothing of them was recomputed there (the
    # transfers reached its metrics).
    assert pair.decode.metric("vllm:nixl_bytes_transferred_count") >= len(PROMPTS)


@needs_nixl
def test_nixl_2p1d_chat_without_max_tokens(nixl_2p1d: Pair) -> None:
    """Both prefill servers feed one decode server; a chat request that stops by itself."""
    pair = nixl_2p1d
    messages = [{"role": "user", "content": QUESTION}]
    decode = pair.decode.client()
    want = (
        pair.prefill[0].client().chat.completions.create(model=pair.model, messages=messages, temperature=0)
    )
    assert want.choices[0].finish_reason == "stop"
    loaded = pair.decode.metric("vllm:nixl_bytes_transferred_count")
    for prefill in pair.prefill:
        first = prefill.client().chat.completions.create(
            model=pair.model,
            messages=messages,
            temperature=0,
            max_tokens=1,
            extra_body={"kv_transfer_params": PREFILL},
        )
        params = first.model_extra["kv_transfer_params"]
        got = decode.chat.completions.create(
            model=pair.model, messages=messages, temperature=0, extra_body={"kv_transfer_params": params}
        )
        assert got.choices[0].message.content == want.choices[0].message.content
        assert got.choices[0].finish_reason == "stop"
    # Each prefill server's KV was loaded: the decode server computed neither prompt itself.
    assert pair.decode.metric("vllm:nixl_bytes_transferred_count") == loaded + len(pair.prefill)
    pair.kv_usage_settles_to_zero()


@needs_nixl
def test_nixl_failed_transfers_recompute_the_prompt(nixl_2p1d: Pair) -> None:
    """A transfer that cannot happen (no side channel there; blocks the remote does not have)
    makes the decode server compute the prompt itself: same answer, and nothing leaks."""
    pair = nixl_2p1d
    prompt = PROMPTS[0]
    want = pair.complete(prompt, None)
    good = pair.prefill_params(pair.prefill[1], prompt)
    dead_port = {**good, "remote_engine_id": "nobody", "remote_port": free_port()}
    failed = pair.decode.metric("vllm:nixl_num_failed_transfers_total")
    assert pair.complete(prompt, dead_port) == want
    bad_blocks = {**good, "remote_block_ids": [10**6] * len(good["remote_block_ids"])}
    assert pair.complete(prompt, bad_blocks) == want
    assert pair.decode.metric("vllm:nixl_num_failed_transfers_total") >= failed + 2
    # The prefill server never heard from a reader: its blocks wait for the timeout, so read
    # them now, to leave both servers empty.
    assert pair.complete(prompt, good) == want
    pair.kv_usage_settles_to_zero()


@needs_nixl
def test_nixl_dead_prefill_server_loses_no_request() -> None:
    """The prefill server dies between its answer and the decode server's read: the decode
    server recomputes the prompt, and the client gets the same answer."""
    prefill, decode = _start(_nixl("kv_producer"), _nixl("kv_consumer", handshake_timeout=2))
    try:
        pair = Pair([prefill], decode)
        want = pair.complete(PROMPTS[1], None)
        params = pair.prefill_params(prefill, PROMPTS[1])
        prefill.proc.kill()
        prefill.proc.wait()
        assert pair.complete(PROMPTS[1], params, stream=True) == want
        pair.kv_usage_settles_to_zero()
    finally:
        prefill.stop()
        decode.stop()


def test_bad_kv_transfer_params_are_a_400(storage_1p1d: Pair) -> None:
    pair = storage_1p1d
    with pytest.raises(openai.BadRequestError, match="kv_transfer_params"):
        pair.decode.client().completions.create(
            model=pair.model, prompt="hello", max_tokens=2, extra_body={"kv_transfer_params": "yes"}
        )
    with pytest.raises(openai.BadRequestError, match="kv_transfer_params needs n=1"):
        pair.decode.client().completions.create(
            model=pair.model, prompt="hello", max_tokens=2, n=2, extra_body={"kv_transfer_params": PREFILL}
        )
    # The server keeps serving.
    assert pair.complete(PROMPTS[2], None)


@pytest.mark.parametrize("stream", [False, True], ids=["full", "streamed"])
def test_shared_storage_1p1d_equals_one_server(storage_1p1d: Pair, stream: bool) -> None:
    pair = storage_1p1d
    for prompt in PROMPTS:
        want = pair.complete(prompt, None)
        params = pair.prefill_params(pair.prefill[0], prompt)
        assert pair.complete(prompt, params, stream=stream) == want
    pair.kv_usage_settles_to_zero()
    assert pair.decode.metric("vllm:shared_storage_bytes_transferred_count") >= len(PROMPTS)
    # Every file was loaded, or found useless (its blocks were in the decode server's prefix
    # cache), by the request it was made for: none is left behind.
    assert not os.listdir(pair.storage_path)


def test_shared_storage_corrupt_file_recomputes(storage_1p1d: Pair) -> None:
    """A KV file that is not what it claims (overwritten: an injected transfer error) fails the
    load: the decode server computes the prompt itself, and answers the same."""
    pair = storage_1p1d
    prompt = "Twice: " + PROMPTS[1]
    want = pair.complete(prompt, None)
    before = set(os.listdir(pair.storage_path))
    params = pair.prefill_params(pair.prefill[0], prompt)
    (new,) = set(os.listdir(pair.storage_path)) - before
    with open(os.path.join(pair.storage_path, new), "wb") as f:
        f.write(b"not KV at all")
    failed = pair.decode.metric("vllm:shared_storage_num_failed_transfers_total")
    assert pair.complete(prompt, params) == want
    assert pair.decode.metric("vllm:shared_storage_num_failed_transfers_total") == failed + 1
    pair.kv_usage_settles_to_zero()


def test_kv_transfer_config_errors_name_the_key() -> None:
    from axon.kv_transfer.config import parse_kv_transfer_config

    with pytest.raises(ValueError, match="kv_connector must be one of NixlConnector, SharedStorageConnector"):
        parse_kv_transfer_config({"kv_connector": "LMCacheConnector", "kv_role": "kv_both"})
    with pytest.raises(ValueError, match="kv_role must be one of"):
        parse_kv_transfer_config({"kv_connector": "NixlConnector", "kv_role": "producer"})
    with pytest.raises(ValueError, match="unknown key 'kv_rol'; did you mean 'kv_role'"):
        parse_kv_transfer_config({"kv_connector": "NixlConnector", "kv_rol": "kv_both"})
    with pytest.raises(ValueError, match="kv_load_failure_policy must be one of recompute, fail"):
        parse_kv_transfer_config(
            {"kv_connector": "NixlConnector", "kv_role": "kv_both", "kv_load_failure_policy": "retry"}
        )
