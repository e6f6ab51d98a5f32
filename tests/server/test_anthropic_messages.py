"""POST /v1/messages through a real ``axon serve`` (the bundled SmolLM2) and the official
``anthropic`` SDK: ``messages.create`` and ``messages.stream`` answer what the chat completion of
the same messages answers, with and without tools (a tool_use block, then its tool_result back),
stop sequences, count_tokens, ``x-api-key`` auth, and Anthropic-shaped errors for bad input
with the server still serving."""

from __future__ import annotations

from collections.abc import Iterator

import anthropic
import httpx
import openai
import pytest

from tests.server.conftest import ServerProcess
from tests.server.test_responses_api import CITY

KEY = "sk-test-key"
# The SDK (2.x) has no sampling arguments; the server reads temperature as older clients send it.
GREEDY = {"temperature": 0}
WEATHER = {"name": "get_weather", "description": "The weather in a city.", "input_schema": CITY}


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    proc = ServerProcess("--enable-auto-tool-choice", "--tool-call-parser", "hermes", "--api-key", KEY)
    try:
        yield proc.wait_ready()
    finally:
        proc.stop()


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.url, api_key=KEY, max_retries=0)


@pytest.fixture(scope="module")
def model(server: ServerProcess) -> str:
    return server.client(api_key=KEY).models.list().data[0].id


def _chat(server: ServerProcess, model: str, messages: list[dict], max_tokens: int, **kwargs) -> object:
    return server.client(api_key=KEY).chat.completions.create(
        model=model, messages=messages, max_tokens=max_tokens, temperature=0, **kwargs
    )


def test_a_message_answers_what_the_chat_answers(client, server: ServerProcess, model: str) -> None:
    message = client.messages.create(
        model=model,
        system="Be brief.",
        messages=[{"role": "user", "content": [{"type": "text", "text": "Name three colours."}]}],
        max_tokens=12,
        extra_body=GREEDY,
    )
    chat = _chat(
        server,
        model,
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name three colours."}],
        12,
    )
    assert message.type == "message" and message.role == "assistant" and message.id.startswith("msg_")
    assert message.content[0].type == "text"
    assert message.content[0].text == chat.choices[0].message.content
    assert message.stop_reason == {"length": "max_tokens", "stop": "end_turn"}[chat.choices[0].finish_reason]
    assert message.usage.input_tokens == chat.usage.prompt_tokens
    assert message.usage.output_tokens == chat.usage.completion_tokens


def test_a_streamed_message_has_anthropics_events(client, model: str) -> None:
    kwargs = {
        "model": model,
        "messages": [{"role": "user", "content": "Write a haiku."}],
        "max_tokens": 16,
        "extra_body": GREEDY,
    }
    whole = client.messages.create(**kwargs)
    with client.messages.stream(**kwargs) as stream:
        events = list(stream)
        final = stream.get_final_message()
    kinds = [e.type for e in events]
    assert kinds[0] == "message_start" and "message_stop" in kinds
    assert kinds.count("content_block_start") == kinds.count("content_block_stop") == 1
    text = "".join(e.delta.text for e in events if e.type == "content_block_delta")
    assert text == whole.content[0].text == final.content[0].text
    assert final.stop_reason == whole.stop_reason and final.usage.output_tokens == whole.usage.output_tokens


def test_stop_sequences_and_count_tokens(client, server: ServerProcess, model: str) -> None:
    messages = [{"role": "user", "content": "Count from one to ten in words."}]
    free = (
        client.messages.create(model=model, messages=messages, max_tokens=24, extra_body=GREEDY)
        .content[0]
        .text
    )
    stop = free.split()[3]  # a word the answer reaches
    message = client.messages.create(
        model=model, messages=messages, max_tokens=24, extra_body=GREEDY, stop_sequences=[stop]
    )
    assert message.stop_reason == "stop_sequence" and message.stop_sequence == stop
    assert message.content[0].text == free[: free.index(stop)]
    counted = client.messages.count_tokens(model=model, messages=messages)
    assert counted.input_tokens == _chat(server, model, messages, 1).usage.prompt_tokens


@pytest.mark.parametrize("tool_choice", [{"type": "any"}, {"type": "tool", "name": "get_weather"}])
def test_tools_give_a_tool_use_block_and_take_its_result(client, model: str, tool_choice: dict) -> None:
    question = {"role": "user", "content": "What is the weather in Paris?"}
    kwargs = {
        "model": model,
        "tools": [WEATHER],
        "tool_choice": tool_choice,
        "max_tokens": 150,
        "extra_body": GREEDY,
    }
    message = client.messages.create(messages=[question], **kwargs)
    uses = [b for b in message.content if b.type == "tool_use"]
    assert uses and uses[0].name == "get_weather" and isinstance(uses[0].input["city"], str)
    assert message.stop_reason == "tool_use"
    with client.messages.stream(messages=[question], **kwargs) as stream:
        final = stream.get_final_message()
    streamed = [b for b in final.content if b.type == "tool_use"]
    assert streamed and streamed[0].input == uses[0].input
    # The tool's result goes back in a user turn; the model answers on.
    answer = client.messages.create(
        model=model,
        messages=[
            question,
            {"role": "assistant", "content": [b.model_dump() for b in message.content]},
            {
                "role": "user",
                "content": [{"type": "tool_result", "tool_use_id": uses[0].id, "content": "sunny, 21 C"}],
            },
        ],
        tools=[WEATHER],
        max_tokens=8,
        extra_body=GREEDY,
    )
    assert answer.usage.input_tokens > message.usage.input_tokens


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"messages": [{"role": "wizard", "content": "x"}]}, "role must be 'user' or 'assistant'"),
        (
            {"messages": [{"role": "user", "content": [{"type": "document", "source": {}}]}]},
            "'document' are not supported",
        ),
        (
            {
                "messages": [{"role": "user", "content": "x"}],
                "tools": [{"type": "bash_20250124", "name": "bash"}],
            },
            "custom tools",
        ),
        ({"messages": [{"role": "user", "content": "x"}], "max_tokens": 0}, "max_tokens"),
        ({"messages": [{"role": "user", "content": "x"}], "model": "nope"}, "does not exist"),
    ],
)
def test_bad_input_is_an_anthropic_error_and_the_server_goes_on(
    client, model: str, kwargs: dict, message: str
) -> None:
    kwargs = {"model": model, "max_tokens": 4, **kwargs}
    with pytest.raises(anthropic.APIStatusError, match=message) as err:
        client.messages.create(**kwargs)
    assert err.value.status_code in (400, 404)
    assert err.value.body["type"] == "error" and err.value.body["error"]["type"].endswith("_error")
    assert client.messages.create(
        model=model, messages=[{"role": "user", "content": "Hi"}], max_tokens=2
    ).content


def test_x_api_key_and_bearer_auth(server: ServerProcess, model: str) -> None:
    body = {"model": model, "max_tokens": 2, "messages": [{"role": "user", "content": "Hi"}]}
    wrong = httpx.post(server.url + "/v1/messages", json=body, headers={"x-api-key": "wrong"})
    assert wrong.status_code == 401 and wrong.json()["error"]["type"] == "authentication_error"
    bearer = httpx.post(server.url + "/v1/messages", json=body, headers={"Authorization": f"Bearer {KEY}"})
    assert bearer.status_code == 200 and bearer.json()["type"] == "message"
    # x-api-key works on OpenAI's routes too; their errors keep OpenAI's shape.
    assert openai.OpenAI(base_url=server.url + "/v1", api_key=KEY).models.list().data
    unauthorized = httpx.get(server.url + "/v1/models", headers={"x-api-key": "wrong"})
    assert (
        unauthorized.status_code == 401
        and "error" in unauthorized.json()
        and "type" not in unauthorized.json()
    )


def test_axon_bench_serve_loads_the_messages_api(model: str, tmp_path) -> None:
    """``axon bench serve --endpoint-type messages`` against a server without a key."""
    import json
    import subprocess
    import sys

    server = ServerProcess()
    try:
        server.wait_ready()
        result = tmp_path / "result.json"
        cmd = [sys.executable, "-m", "axon.entrypoints.cli", "bench", "serve", "--base-url", server.url,
               "--endpoint-type", "messages", "--num-prompts", "4", "--random-input-len", "16",
               "--random-output-len", "5", "--ignore-eos", "--disable-tqdm", "--save-result",
               "--result-dir", str(tmp_path), "--result-filename", result.name]  # fmt: skip
        subprocess.run(cmd, check=True, capture_output=True, timeout=120)
    finally:
        server.stop()
    r = json.loads(result.read_text())
    assert (r["completed"], r["failed"], r["total_output_tokens"]) == (4, 0, 20)
    assert r["backend"] == "anthropic-messages" and r["endpoint"] == "/v1/messages"
