"""Speculative decoding through a real ``axon serve`` with the official client: a greedy chat
that stops by itself answers exactly as a server without speculation does, streamed or not,
alone or among concurrent requests; /metrics carries vLLM's spec-decode counters and the
periodic log vLLM's "SpecDecoding metrics" line; a bad ``--speculative-config`` stops start-up
with exit code 2 and the field's name.

The prompts ask SmolLM2 to copy text it was given, so the ngram lookup finds the continuation
in the prompt and drafts get accepted (and, where the model deviates, rejected).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from conftest import ServerProcess, serve_usage_error

SPEC_CONFIG = (
    '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 2, "prompt_lookup_max": 5}'
)
CODE = "def say_hello(name):\n    message = 'Hello, ' + name + '!'\n    print(message)\n    return message\n"
FOX = "The quick brown fox jumps over the lazy dog."
FRUITS = "apples, bananas, cherries, dates, elderberries, figs, grapes"
PROMPTS = [
    f"Repeat this code, changing only the function name to `greet_user`:\n\n{CODE}",
    f"Copy the following text exactly:\n{FOX} {FOX}",
    f"Rewrite this list in the same order, one item per line:\n{FRUITS}",
]
SPEC_COUNTERS = (
    "vllm:spec_decode_num_drafts_total",
    "vllm:spec_decode_num_draft_tokens_total",
    "vllm:spec_decode_num_accepted_tokens_total",
    "vllm:spec_decode_num_accepted_tokens_per_pos_total",
)
LOG_WAIT_S = 25.0  # the stat line comes every 10 s


@pytest.fixture(scope="module")
def servers() -> Iterator[tuple[ServerProcess, ServerProcess]]:
    """(without speculation, with ngram speculation), started side by side."""
    plain, spec = ServerProcess(), ServerProcess("--speculative-config", SPEC_CONFIG)
    try:
        yield plain.wait_ready(), spec.wait_ready()
    finally:
        plain.stop()
        spec.stop()


@pytest.fixture(scope="module")
def spec_server(servers: tuple[ServerProcess, ServerProcess]) -> ServerProcess:
    return servers[1]


@pytest.fixture(scope="module")
def spec_answers(spec_server: ServerProcess) -> dict[str, tuple[str, str]]:
    """Each prompt's answer from the speculating server, asked alone and not streamed."""
    return {prompt: _chat(spec_server, prompt) for prompt in PROMPTS}


def _chat(server: ServerProcess, prompt: str, stream: bool = False) -> tuple[str, str]:
    """(text, finish_reason) of a greedy chat with no max_tokens (users' natural path)."""
    client = server.client()
    kwargs = {
        "model": client.models.list().data[0].id,
        "messages": [{"role": "user", "content": prompt}],
        "temperature": 0.0,
    }
    if not stream:
        choice = client.chat.completions.create(**kwargs).choices[0]
        return choice.message.content, choice.finish_reason
    text, finish = "", ""
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
            finish = chunk.choices[0].finish_reason or finish
    return text, finish


def _spec_metrics(server: ServerProcess) -> dict[str, float]:
    return {name: server.metric(name) for name in SPEC_COUNTERS}


def test_greedy_text_is_the_same_with_and_without_speculation(servers, spec_answers) -> None:
    plain, _ = servers
    for prompt in PROMPTS:
        want = _chat(plain, prompt)
        assert want[1] == "stop" and want[0], f"{prompt!r} did not stop by itself without speculation"
        assert spec_answers[prompt] == want, f"{prompt!r} answers differently with speculation"


@pytest.fixture(scope="module")
def eagle3_server(smollm2_path: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """A server speculating with a random EAGLE3 head for the bundled SmolLM2 (its drafts are
    mostly rejected: every verification rolls back), the head's linears on the packed kernel."""
    import torch

    from axon.model.layers.attention import get_attention_backend
    from axon.model.loader import load_hf_config
    from axon.spec_decode.eagle3 import (
        build_eagle3,
        eagle3_hf_config,
        init_eagle3_weights,
        parse_eagle3_config,
        save_eagle3,
    )

    target_hf = load_hf_config(smollm2_path)
    folder = str(tmp_path_factory.mktemp("smollm2-eagle3"))
    config = eagle3_hf_config(target_hf, draft_vocab_size=4096, aux_layer_ids=(2, 15, 27))
    head = build_eagle3(
        parse_eagle3_config(config, target_hf), torch.float32, "cpu", get_attention_backend("reference")
    )
    init_eagle3_weights(head, seed=0)
    head.set_vocab_map(torch.arange(4096))
    save_eagle3(head, folder, config)
    spec = f'{{"method": "eagle3", "model": "{folder}", "num_speculative_tokens": 3, "adaptive": false}}'
    server = ServerProcess("--speculative-config", spec)
    try:
        yield server.wait_ready()
    finally:
        server.stop()


def test_eagle3_gives_the_plain_text_streamed_or_not(servers, eagle3_server: ServerProcess) -> None:
    plain, _ = servers
    for prompt in PROMPTS[:2]:
        want = _chat(plain, prompt)
        assert _chat(eagle3_server, prompt) == want, f"{prompt!r} answers differently with EAGLE3"
        assert _chat(eagle3_server, prompt, stream=True) == want
    assert eagle3_server.metric("vllm:spec_decode_num_draft_tokens_total") > 0


def test_streamed_and_not_give_the_same_text(spec_server: ServerProcess, spec_answers) -> None:
    for prompt in PROMPTS:
        assert _chat(spec_server, prompt, stream=True) == spec_answers[prompt]


def test_metrics_count_drafts_and_acceptances(servers) -> None:
    plain, spec = servers
    before = _spec_metrics(spec)
    _chat(spec, PROMPTS[0])
    after = _spec_metrics(spec)
    drafts, drafted, accepted, accepted_pos0 = (after[n] - before[n] for n in SPEC_COUNTERS)
    assert drafts > 0 and drafted > 0 and accepted > 0
    assert accepted <= drafted <= 3 * drafts
    assert 0 < accepted_pos0 <= drafts  # the first position is accepted whenever any is
    page = httpx.get(spec.url + "/metrics").text
    assert 'position="2"' in page  # one counter per position up to num_speculative_tokens
    assert "vllm:spec_decode" not in httpx.get(plain.url + "/metrics").text  # only with speculation


def test_concurrent_requests_get_the_sequential_text(spec_server: ServerProcess, spec_answers) -> None:
    prompts = PROMPTS * 2
    with ThreadPoolExecutor(len(prompts)) as pool:
        together = list(pool.map(lambda p: _chat(spec_server, p), prompts))
    for prompt, got in zip(prompts, together):
        assert got == spec_answers[prompt], f"{prompt!r} among {len(prompts)} concurrent requests differs"


def test_the_periodic_log_reports_speculation(spec_server: ServerProcess) -> None:
    deadline = time.monotonic() + LOG_WAIT_S
    while "SpecDecoding metrics: Mean acceptance length:" not in spec_server.log():
        assert time.monotonic() < deadline, f"no SpecDecoding line in the log:\n{spec_server.log()[-3000:]}"
        _chat(spec_server, PROMPTS[1])  # something to report in the next interval
        time.sleep(1.0)


@pytest.mark.parametrize(
    ("config", "field"),
    [
        ('{"method": "medusa", "num_speculative_tokens": 2}', "speculative_config.method"),
        ('{"method": "ngram", "num_speculative_tokens": 0}', "speculative_config.num_speculative_tokens"),
        ('{"method": ["ngram"], "num_speculative_tokens": 2}', "speculative_config.method"),
    ],
)
def test_a_bad_speculative_config_stops_start_up(config: str, field: str) -> None:
    stderr = serve_usage_error("--speculative-config", config)
    errors = [line for line in stderr.splitlines() if "error" in line.lower()]
    assert len(errors) == 1 and errors[0].startswith(f"axon serve: error: {field} "), stderr[-2000:]
