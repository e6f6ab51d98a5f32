"""``axon serve -tp 2 --attention-dp-size 2`` on the bundled SmolLM2 (9 heads, which 2 ranks
cannot split: each rank holds the whole attention and attends its own requests, the MLP and the
vocabulary split in two), through the official client: the server's main job, concurrent greedy
completions equal to one rank's, and bad input answered 400 while the server goes on."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest

from axon import LLM, SamplingParams
from tests.server.conftest import COMPLETION_PROMPTS, ServerProcess

MODEL = "SmolLM2-135M-Instruct"
QUESTION = [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    proc = ServerProcess("-tp", "2", "--attention-dp-size", "2")
    try:
        yield proc.wait_ready(300)
    finally:
        proc.stop()


def test_the_start_up_log_names_the_split(server: ServerProcess) -> None:
    log = server.log()
    assert "tensor-parallel rank 1 of 2, attention data-parallel (whole attention, own requests)" in log
    assert "attention data parallelism: 2 ranks' budgets make one pool of" in log


def test_chat_without_max_tokens_stops_by_itself(server: ServerProcess) -> None:
    reply = server.client().chat.completions.create(model=MODEL, messages=QUESTION, temperature=0)
    assert reply.choices[0].finish_reason == "stop"
    assert "Paris" in reply.choices[0].message.content


def test_completions_sent_at_once_equal_one_rank(server: ServerProcess) -> None:
    client = server.client()
    prompts = COMPLETION_PROMPTS[:8]

    def complete(prompt: str) -> str:
        reply = client.completions.create(model=MODEL, prompt=prompt, max_tokens=24, temperature=0)
        return reply.choices[0].text

    with ThreadPoolExecutor(len(prompts)) as pool:
        served = list(pool.map(complete, prompts))
    llm = LLM(dtype="float32", max_model_len=512)
    params = SamplingParams(temperature=0, max_tokens=24)
    try:
        assert served == [o.outputs[0].text for o in llm.generate(prompts, params, use_tqdm=False)]
    finally:
        llm.llm_engine.engine_core.shutdown()


def test_bad_input_is_a_400_and_the_server_goes_on(server: ServerProcess) -> None:
    client = server.client()
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=MODEL, messages=QUESTION, temperature=-1)
    assert "temperature" in str(err.value)
    reply = client.completions.create(model=MODEL, prompt="Hello", max_tokens=3, temperature=0)
    assert reply.usage.completion_tokens == 3
