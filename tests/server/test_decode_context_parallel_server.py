"""``axon serve -tp 2 -dcp 2`` through the official client: a tiny random Llama with one KV head
(both ranks hold it, each every other position of each sequence) over SmolLM2's tokenizer,
float32. Completions sent at once and a chat that runs to the end of the context give what one
rank gives offline; bad input is a 400 and the server goes on serving."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest

from axon import LLM, SamplingParams
from tests.server.conftest import COMPLETION_PROMPTS, ServerProcess

MAX_MODEL_LEN = 256


@pytest.fixture(scope="module")
def folder(tiny_model_dir) -> str:
    return tiny_model_dir("llama_one_kv_head_full_vocab")


@pytest.fixture(scope="module")
def server(folder: str) -> Iterator[ServerProcess]:
    proc = ServerProcess("--model", folder, "--max-model-len", str(MAX_MODEL_LEN), "-tp", "2", "-dcp", "2")
    try:
        yield proc.wait_ready()
    finally:
        proc.stop()


@pytest.fixture(scope="module")
def one_rank(folder: str) -> Iterator[LLM]:
    llm = LLM(model=folder, dtype="float32", max_model_len=MAX_MODEL_LEN)
    yield llm
    llm.llm_engine.engine_core.shutdown()


def test_the_start_up_log_names_the_sharding(server: ServerProcess) -> None:
    log = server.log()
    assert "tensor-parallel rank 1 of 2, decode-context-parallel rank 1 of 2" in log
    assert "each block id 32 positions across 2 ranks (decode context parallel)" in log


def test_completions_sent_at_once_equal_one_rank(server: ServerProcess, one_rank: LLM) -> None:
    client = server.client()
    model = client.models.list().data[0].id
    prompts = COMPLETION_PROMPTS[:8]

    def complete(prompt: str) -> str:
        reply = client.completions.create(model=model, prompt=prompt, max_tokens=40, temperature=0)
        assert reply.usage.completion_tokens == 40
        return reply.choices[0].text

    with ThreadPoolExecutor(len(prompts)) as pool:
        served = list(pool.map(complete, prompts))
    params = SamplingParams(temperature=0, max_tokens=40)
    assert served == [o.outputs[0].text for o in one_rank.generate(prompts, params, use_tqdm=False)]


def test_a_chat_without_max_tokens_runs_to_its_end_as_one_rank(server: ServerProcess, one_rank: LLM) -> None:
    """No max_tokens: the answer ends by itself or at the end of the context, many blocks in,
    streamed as it is returned whole, and as one rank writes it."""
    client = server.client()
    model = client.models.list().data[0].id
    messages = [{"role": "user", "content": "Tell me a long story about the sea."}]
    whole = client.chat.completions.create(model=model, messages=messages, temperature=0)
    usage = whole.usage
    assert whole.choices[0].finish_reason == "stop" or usage.total_tokens == MAX_MODEL_LEN
    stream = client.chat.completions.create(model=model, messages=messages, temperature=0, stream=True)
    assert (
        "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
        == whole.choices[0].message.content
    )
    params = SamplingParams(temperature=0, max_tokens=MAX_MODEL_LEN - usage.prompt_tokens)
    want = one_rank.chat(messages, params, use_tqdm=False)[0].outputs[0]
    assert whole.choices[0].message.content == want.text


def test_bad_input_is_a_400_and_the_server_goes_on(server: ServerProcess) -> None:
    client = server.client()
    model = client.models.list().data[0].id
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=model, prompt="Hello " * 300, max_tokens=4)
    assert f"This model's maximum context length is {MAX_MODEL_LEN} tokens" in str(err.value)
    reply = client.completions.create(model=model, prompt="Hello", max_tokens=3, temperature=0)
    assert reply.usage.completion_tokens == 3
