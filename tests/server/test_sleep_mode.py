"""Sleep mode (``enable_sleep_mode``): sleeping releases the KV cache's memory (every cache tensor
empty) and refuses requests, waking gives it back (zeroed), and the answers are the same before
and after; offline (``LLM.sleep`` / ``wake_up``) and through a real ``axon serve
--enable-sleep-mode`` (``POST /sleep``, ``/wake_up``, ``GET /is_sleeping``), where a request while
asleep is a 503 and a bad level a 400."""

from __future__ import annotations

import httpx
import openai
import pytest

from axon import LLM, SamplingParams
from tests.server.conftest import ServerProcess

IDS = [1, 504, 345, 282, 260, 114, 30, 198]
PARAMS = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


def test_llm_sleep_releases_the_kv_cache_and_wakes_the_same(tiny_model_dir) -> None:
    llm = LLM(model=tiny_model_dir("llama"), dtype="float32", enable_sleep_mode=True, block_size=4)
    before = llm.generate({"prompt_token_ids": IDS}, PARAMS, use_tqdm=False)[0].outputs[0].token_ids
    worker = llm.llm_engine.engine_core.executor.worker
    sizes = [t.numel() for kv in worker.kv_caches for t in kv]
    llm.sleep()
    assert all(t.numel() == 0 for kv in worker.kv_caches for t in kv)
    with pytest.raises(ValueError, match="sleeping"):
        llm.generate({"prompt_token_ids": IDS}, PARAMS, use_tqdm=False)
    with pytest.raises(ValueError, match="level 2"):
        llm.sleep(level=2)
    llm.wake_up()
    assert [t.numel() for kv in worker.kv_caches for t in kv] == sizes
    after = llm.generate({"prompt_token_ids": IDS}, PARAMS, use_tqdm=False)[0]
    assert after.outputs[0].token_ids == before and after.num_cached_tokens == 0  # the prefix cache was reset
    with pytest.raises(ValueError, match="enable_sleep_mode"):
        LLM(model=tiny_model_dir("llama")).sleep()


def test_axon_serve_sleep_and_wake_up() -> None:
    server = ServerProcess("--enable-sleep-mode")
    try:
        client = server.wait_ready().client()
        model = client.models.list().data[0].id
        messages = [{"role": "user", "content": "Name a colour."}]
        before = client.chat.completions.create(model=model, messages=messages, max_tokens=6, temperature=0)
        assert httpx.get(server.url + "/is_sleeping").json() == {"is_sleeping": False}
        assert httpx.post(server.url + "/sleep", params={"level": 1}).status_code == 200
        assert httpx.get(server.url + "/is_sleeping").json() == {"is_sleeping": True}
        with pytest.raises(openai.APIStatusError) as err:
            client.chat.completions.create(model=model, messages=messages, max_tokens=2)
        assert err.value.status_code == 503 and "sleeping" in str(err.value)
        bad = httpx.post(server.url + "/sleep", params={"level": 2})
        assert bad.status_code == 400 and "level 2" in bad.json()["error"]["message"]
        assert httpx.get(server.url + "/is_sleeping").json() == {"is_sleeping": True}
        assert httpx.post(server.url + "/wake_up").status_code == 200
        after = client.chat.completions.create(model=model, messages=messages, max_tokens=6, temperature=0)
        assert after.choices[0].message.content == before.choices[0].message.content
        assert httpx.get(server.url + "/health").status_code == 200
    finally:
        server.stop()
    plain = ServerProcess()
    try:
        assert httpx.post(plain.wait_ready().url + "/sleep").status_code == 404
    finally:
        plain.stop()
