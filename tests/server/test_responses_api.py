"""POST /v1/responses through a real ``axon serve`` (the bundled SmolLM2) and the official
``openai`` SDK's ``client.responses``: plain and streamed answers equal the chat completion of the
same messages, a function tool (required and named), a JSON schema through ``text.format``,
chaining by ``previous_response_id``, ``GET`` and background responses with ``cancel``, and each
bad input a 400 with the server still serving."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator

import openai
import pytest

from tests.server.conftest import ServerProcess

CITY = {
    "type": "object",
    "properties": {"city": {"type": "string"}},
    "required": ["city"],
    "additionalProperties": False,
}
WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather in a city.",
    "parameters": CITY,
}


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    proc = ServerProcess("--enable-auto-tool-choice", "--tool-call-parser", "hermes")
    try:
        yield proc.wait_ready()
    finally:
        proc.stop()


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> openai.OpenAI:
    return server.client()


def _chat_text(client: openai.OpenAI, messages: list[dict], max_tokens: int) -> tuple[str, object]:
    reply = client.chat.completions.create(
        model=_model(client), messages=messages, max_tokens=max_tokens, temperature=0
    )
    return reply.choices[0].message.content, reply.usage


def _model(client: openai.OpenAI) -> str:
    return client.models.list().data[0].id


def test_a_response_answers_what_the_chat_answers(client: openai.OpenAI) -> None:
    model = _model(client)
    response = client.responses.create(
        model=model,
        input="Name three colours.",
        instructions="Be brief.",
        max_output_tokens=12,
        temperature=0,
    )
    text, usage = _chat_text(
        client,
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name three colours."}],
        12,
    )
    assert response.output_text == text
    assert response.object == "response" and response.id.startswith("resp_")
    assert response.status in ("completed", "incomplete")
    assert response.usage.input_tokens == usage.prompt_tokens
    assert response.usage.output_tokens == usage.completion_tokens
    if response.status == "incomplete":
        assert response.incomplete_details.reason == "max_output_tokens"
    # The main job: no max_output_tokens, the answer stops by itself.
    whole = client.responses.create(model=model, input="Say hello.", temperature=0)
    assert whole.status == "completed" and whole.output_text


def test_a_streamed_response_sends_the_event_types(client: openai.OpenAI) -> None:
    model = _model(client)
    kwargs = {"model": model, "input": "Write a haiku about rain.", "max_output_tokens": 16, "temperature": 0}
    whole = client.responses.create(**kwargs)
    events = list(client.responses.create(stream=True, **kwargs))
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] in ("response.completed", "response.incomplete")
    for kind in ("response.output_item.added", "response.content_part.added", "response.output_text.done",
                 "response.content_part.done", "response.output_item.done"):  # fmt: skip
        assert kinds.count(kind) == 1, kind
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == whole.output_text == events[-1].response.output_text
    assert [e.sequence_number for e in events] == list(range(len(events)))


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "name": "get_weather"}])
def test_a_function_tool_call(client: openai.OpenAI, tool_choice) -> None:
    model = _model(client)
    kwargs = {
        "model": model,
        "input": "What is the weather in Paris?",
        "tools": [WEATHER],
        "tool_choice": tool_choice,
        "max_output_tokens": 40,
        "temperature": 0,
    }
    response = client.responses.create(**kwargs)
    calls = [item for item in response.output if item.type == "function_call"]
    assert len(calls) >= 1 and calls[0].name == "get_weather"
    assert isinstance(json.loads(calls[0].arguments)["city"], str)
    events = list(client.responses.create(stream=True, **kwargs))
    arguments = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    done = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert done and done[0].arguments.startswith(arguments[: len(done[0].arguments)])
    assert json.loads(done[0].arguments) == json.loads(calls[0].arguments)
    # The call's output goes back as an input item, and the model answers on.
    follow = client.responses.create(
        model=model,
        previous_response_id=response.id,
        input=[{"type": "function_call_output", "call_id": calls[0].call_id, "output": "sunny, 21 C"}],
        max_output_tokens=8,
        temperature=0,
    )
    assert follow.status in ("completed", "incomplete")


def test_a_json_schema_format(client: openai.OpenAI) -> None:
    schema = {
        "type": "object",
        "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
        "required": ["name", "age"],
        "additionalProperties": False,
    }
    response = client.responses.create(
        model=_model(client),
        input="Invent a person.",
        text={"format": {"type": "json_schema", "name": "person", "schema": schema, "strict": True}},
        max_output_tokens=60,
        temperature=0,
    )
    person = json.loads(response.output_text)
    assert set(person) == {"name", "age"} and isinstance(person["age"], int)


def test_previous_response_id_continues_the_conversation(client: openai.OpenAI) -> None:
    model = _model(client)
    first = client.responses.create(model=model, input="My name is Ada.", max_output_tokens=10, temperature=0)
    second = client.responses.create(
        model=model,
        input="What is my name?",
        previous_response_id=first.id,
        max_output_tokens=10,
        temperature=0,
    )
    messages = [
        {"role": "user", "content": "My name is Ada."},
        {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": "What is my name?"},
    ]
    assert second.output_text == _chat_text(client, messages, 10)[0]
    assert second.previous_response_id == first.id
    assert client.responses.retrieve(second.id).output_text == second.output_text


def test_background_responses_are_polled_and_cancelled(client: openai.OpenAI) -> None:
    model = _model(client)
    queued = client.responses.create(model=model, input="Count to ten.", max_output_tokens=8, background=True)
    assert queued.status in ("queued", "in_progress")
    deadline = time.monotonic() + 60
    while client.responses.retrieve(queued.id).status in ("queued", "in_progress"):
        assert time.monotonic() < deadline
        time.sleep(0.1)
    assert client.responses.retrieve(queued.id).output_text
    long = client.responses.create(
        model=model, input="Write a long story.", max_output_tokens=400, background=True,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    cancelled = client.responses.cancel(long.id)
    assert cancelled.status == "cancelled"
    assert client.responses.retrieve(long.id).status == "cancelled"
    with pytest.raises(openai.BadRequestError, match="already finished"):
        client.responses.cancel(long.id)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"input": "x", "tools": [{"type": "web_search"}]}, "tools of type 'web_search' are not supported"),
        ({"input": [{"type": "file_search_call", "id": "x"}]}, "input items of type 'file_search_call'"),
        (
            {"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]},
            "'input_file' are not",
        ),
        (
            {"input": "x", "previous_response_id": "resp_nope"},
            "Previous response with id 'resp_nope' not found",
        ),
        ({"input": "x", "text": {"format": {"type": "yaml"}}}, "text.format of type 'yaml'"),
        ({"input": "x", "background": True, "store": False}, "must be stored"),
        ({"input": [{"role": "wizard", "content": "x"}]}, "Invalid request"),
    ],
)
def test_bad_input_is_a_400_and_the_server_goes_on(client: openai.OpenAI, kwargs: dict, message: str) -> None:
    with pytest.raises(openai.BadRequestError, match=message):
        client.responses.create(model=_model(client), max_output_tokens=4, **kwargs)
    with pytest.raises(openai.NotFoundError, match="not found"):
        client.responses.retrieve("resp_missing")
    assert (
        client.responses.create(model=_model(client), input="Hi", max_output_tokens=2).output_text is not None
    )


@pytest.mark.parametrize("endpoint_type", ["responses", "chat"])
def test_axon_bench_serve_loads_the_responses_api(
    server: ServerProcess, endpoint_type: str, tmp_path
) -> None:
    """``axon bench serve --endpoint-type responses`` counts what the server streams."""
    import subprocess
    import sys

    result = tmp_path / "result.json"
    cmd = [sys.executable, "-m", "axon.entrypoints.cli", "bench", "serve", "--base-url", server.url,
           "--endpoint-type", endpoint_type, "--num-prompts", "4", "--random-input-len", "16",
           "--random-output-len", "5", "--ignore-eos", "--disable-tqdm", "--save-result",
           "--result-dir", str(tmp_path), "--result-filename", result.name]  # fmt: skip
    subprocess.run(cmd, check=True, capture_output=True, timeout=120)
    r = json.loads(result.read_text())
    assert (r["completed"], r["failed"], r["total_output_tokens"]) == (4, 0, 20)
    assert r["endpoint"] == {"responses": "/v1/responses", "chat": "/v1/chat/completions"}[endpoint_type]
