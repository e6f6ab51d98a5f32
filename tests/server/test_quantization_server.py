"""Quantized weights and the FP8 KV cache through a real ``axon serve`` with the official client:
SmolLM2 with each ``--quantization`` value, and with ``--kv-cache-dtype fp8``, answers a chat
with no max_tokens that stops by itself (greedy: the right answer); the start-up log names the
quantization, /metrics' cache_config_info the KV dtype and the cache's blocks (twice as many
in FP8 for the same memory); a bad value stops start-up with exit code 2 and names it.

The servers run in bfloat16, where the quantized GEMMs and the FP8 cache run on axon's kernels.
"""

from __future__ import annotations

import re
from collections.abc import Iterator

import httpx
import pytest
from conftest import ServerProcess, serve_usage_error

KV_SPACE = ["--kv-cache-space-gib", "0.05"]
SERVERS = {
    "gguf": ["--quantization", "gguf"],
    "int8": ["--quantization", "int8", "--enforce-eager"],
    "int4": ["--quantization", "int4", "--enforce-eager"],
    "fp8": ["--quantization", "fp8", "--enforce-eager"],
    "w8a8": ["--quantization", "w8a8", "--enforce-eager"],
    "kv_fp8": ["--kv-cache-dtype", "fp8", "--calculate-kv-scales", "--enforce-eager", *KV_SPACE],
    "kv_auto": ["--enforce-eager", *KV_SPACE],
}
QUESTION = "What is the capital of France? Answer in one sentence."


@pytest.fixture(scope="module")
def servers() -> Iterator[dict[str, ServerProcess]]:
    started = {name: ServerProcess("--dtype", "bfloat16", *args) for name, args in SERVERS.items()}
    try:
        yield {name: proc.wait_ready(timeout_s=300) for name, proc in started.items()}
    finally:
        for proc in started.values():
            proc.stop()


@pytest.mark.parametrize("name", sorted(SERVERS))
def test_a_chat_without_max_tokens_stops_by_itself_with_the_right_answer(
    servers: dict[str, ServerProcess], name: str
) -> None:
    client = servers[name].client()
    reply = client.chat.completions.create(
        model=client.models.list().data[0].id,
        messages=[{"role": "user", "content": QUESTION}],
        temperature=0,
    )
    choice = reply.choices[0]
    assert choice.finish_reason == "stop", choice
    assert "Paris" in choice.message.content
    # Streamed, the same answer.
    stream = client.chat.completions.create(
        model=reply.model, messages=[{"role": "user", "content": QUESTION}], temperature=0, stream=True
    )
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert text == choice.message.content


@pytest.mark.parametrize("method", ["gguf", "int8", "int4", "fp8", "w8a8"])
def test_the_start_up_log_names_the_quantization(servers: dict[str, ServerProcess], method: str) -> None:
    assert re.search(rf"quantized \d+ linear layers to {method}: [\d.]+ MiB", servers[method].log())


def _cache_info(server: ServerProcess) -> dict[str, str]:
    for line in httpx.get(server.url + "/metrics").text.splitlines():
        if line.startswith("vllm:cache_config_info{"):
            return dict(re.findall(r'(\w+)="([^"]*)"', line))
    raise AssertionError("no vllm:cache_config_info on /metrics")


def test_an_fp8_kv_cache_holds_twice_the_blocks_in_the_same_memory(servers: dict[str, ServerProcess]) -> None:
    fp8, auto = _cache_info(servers["kv_fp8"]), _cache_info(servers["kv_auto"])
    assert fp8["kv_cache_dtype"] == "fp8" and auto["kv_cache_dtype"] == "auto"
    assert int(fp8["num_gpu_blocks"]) // 2 == int(auto["num_gpu_blocks"])  # whole blocks of the budget
    assert "float8_e4m3fn" in servers["kv_fp8"].log()


@pytest.mark.parametrize(
    ("flags", "name"),
    [
        (["--quantization", "nonsense"], "quantization"),
        (["--kv-cache-dtype", "fp4"], "kv_cache_dtype"),
        (["--quantization", "int4", "--quantization-group-size", "40"], "quantization_group_size"),
    ],
)
def test_a_bad_value_stops_start_up_naming_it(flags: list[str], name: str) -> None:
    stderr = serve_usage_error(*flags)
    errors = [line for line in stderr.splitlines() if "error" in line.lower()]
    assert len(errors) == 1 and errors[0].startswith(f"axon serve: error: {name} "), stderr[-2000:]


@pytest.mark.parametrize("name", ["gguf", "w8a8", "kv_fp8"])
def test_the_same_request_gives_the_same_tokens_alone_batched_and_again(
    servers: dict[str, ServerProcess], name: str
) -> None:
    from concurrent.futures import ThreadPoolExecutor

    client = servers[name].client()
    model = client.models.list().data[0].id
    others = ["Name three colors.", "Count from one to ten.", "What is 2 + 2?"]

    def ask(question: str) -> str:
        reply = client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": question}], temperature=0, max_tokens=40
        )
        return reply.choices[0].message.content

    alone = ask(QUESTION)
    with ThreadPoolExecutor(4) as pool:
        batched, *_ = pool.map(ask, [QUESTION, *others])
    assert batched == alone
    assert ask(QUESTION) == alone
