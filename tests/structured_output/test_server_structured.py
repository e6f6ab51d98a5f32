"""Structured outputs and tool calling through a real ``axon serve`` and the official client.

One server for the module (SmolLM2-135M, float32, greedy unless a test samples): requests run
concurrently so that they share batches, which is also how the mixed-batch test checks that
unconstrained rows are left alone. SmolLM2's own chat template ignores tools, so requests with
tools render through axon's ChatML tool template (axon/engine/templates/chatml_tools.jinja).
"""

from __future__ import annotations

import ast
import asyncio
import json
import re
from collections.abc import Iterator

import httpx
import jsonschema
import openai
import pytest
from so_helpers import ServerProcess

from benchmarks.json_schemas import NAME, SCHEMAS

MODEL = "axon-so"


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    args = ["--served-model-name", MODEL]
    args += ["--enable-auto-tool-choice", "--tool-call-parser", "hermes", "--max-num-seqs", "24"]
    proc = ServerProcess(*args).wait_ready()
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> openai.OpenAI:
    return server.client()


def run_all(server: ServerProcess, calls: list) -> list:
    """Run coroutine factories concurrently (one batch) on an async client."""

    async def main() -> list:
        async with server.async_client() as aclient:
            return await asyncio.gather(*(call(aclient) for call in calls))

    return asyncio.run(main())


def chat_messages(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


# ---- JSON schemas ------------------------------------------------------------------------------
def _schema_request(index: int, description: str, schema: dict):
    """Three ways of asking, in turn: response_format, structured_outputs, guided_json."""
    messages = chat_messages(f"Give me {description} as JSON.")
    way = index % 3

    async def call(aclient: openai.AsyncOpenAI):
        kwargs: dict = {"model": MODEL, "messages": messages, "max_tokens": 160, "temperature": 0}
        if way == 0:
            kwargs["response_format"] = {
                "type": "json_schema",
                "json_schema": {"name": f"s{index}", "schema": schema, "strict": True},
            }
        elif way == 1:
            kwargs["extra_body"] = {"structured_outputs": {"json": schema}}
        else:
            kwargs["extra_body"] = {"guided_json": schema}
        return await aclient.chat.completions.create(**kwargs)

    return call


def test_json_schemas_validate(server: ServerProcess) -> None:
    assert len(SCHEMAS) >= 20
    calls = [_schema_request(i, d, s) for i, (d, s) in enumerate(SCHEMAS)]
    responses = run_all(server, calls)
    for (description, schema), r in zip(SCHEMAS, responses, strict=True):
        choice = r.choices[0]
        assert choice.finish_reason == "stop", (description, choice.message.content)
        value = json.loads(choice.message.content)
        jsonschema.validate(value, schema)


def test_json_object_and_completions_endpoint(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(
        model=MODEL,
        messages=chat_messages('Repeat this JSON object: {"animal": "cat", "legs": 4}'),
        response_format={"type": "json_object"},
        max_tokens=120,
        temperature=0,
        extra_body={"structured_outputs": None},
    )
    assert isinstance(json.loads(r.choices[0].message.content), dict)
    schema = SCHEMAS[0][1]
    r = client.completions.create(
        model=MODEL,
        prompt="A person as JSON:",
        max_tokens=80,
        temperature=0,
        extra_body={
            "response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": schema}}
        },
    )
    jsonschema.validate(json.loads(r.choices[0].text), schema)
    assert r.choices[0].finish_reason == "stop"


# ---- regex, choice, grammar --------------------------------------------------------------------
ARITHMETIC = r"""
root ::= term (op term){0,3}
term ::= number | "(" number op number ")"
op ::= "+" | "-" | "*"
number ::= [1-9] [0-9]?
"""


def _is_arithmetic(text: str) -> bool:
    tree = ast.parse(text, mode="eval")
    allowed = (ast.Expression, ast.BinOp, ast.Constant, ast.Add, ast.Sub, ast.Mult)
    return all(isinstance(node, allowed) for node in ast.walk(tree))


def test_regex_choice_grammar(server: ServerProcess) -> None:
    phone = r"[0-9]{3}-[0-9]{4}"
    word = r"[A-Z][a-z]{2,8}"
    colours = ["red", "green", "blue", "light blue"]

    async def completion_regex(aclient):
        return await aclient.completions.create(
            model=MODEL,
            prompt="Call me at",
            max_tokens=20,
            temperature=0,
            extra_body={"structured_outputs": {"regex": phone}},
        )

    async def chat_regex(aclient):
        return await aclient.chat.completions.create(
            model=MODEL,
            messages=chat_messages("Name a fruit."),
            max_tokens=20,
            temperature=0,
            extra_body={"guided_regex": word},
        )

    async def chat_choice(aclient):
        return await aclient.chat.completions.create(
            model=MODEL,
            messages=chat_messages("What colour is the sky?"),
            max_tokens=10,
            temperature=0,
            extra_body={"structured_outputs": {"choice": colours}},
        )

    async def completion_choice(aclient):
        return await aclient.completions.create(
            model=MODEL,
            prompt="The sky is",
            max_tokens=10,
            temperature=0.8,
            seed=3,
            extra_body={"guided_choice": colours},
        )

    async def grammar(aclient):
        return await aclient.chat.completions.create(
            model=MODEL,
            messages=chat_messages("Write a sum of small numbers."),
            max_tokens=30,
            temperature=0,
            extra_body={"structured_outputs": {"grammar": ARITHMETIC}},
        )

    async def guided_grammar(aclient):
        return await aclient.completions.create(
            model=MODEL,
            prompt="2 + 3 * 4 =",
            max_tokens=30,
            temperature=1.0,
            seed=7,
            extra_body={"guided_grammar": ARITHMETIC},
        )

    r1, r2, r3, r4, r5, r6 = run_all(
        server, [completion_regex, chat_regex, chat_choice, completion_choice, grammar, guided_grammar]
    )
    assert re.fullmatch(phone, r1.choices[0].text) and r1.choices[0].finish_reason == "stop"
    assert re.fullmatch(word, r2.choices[0].message.content)
    assert r3.choices[0].message.content in colours and r3.choices[0].finish_reason == "stop"
    assert r4.choices[0].text in colours
    for text in (r5.choices[0].message.content, r6.choices[0].text):
        assert _is_arithmetic(text), text


def test_streamed_structured_output_matches(client: openai.OpenAI) -> None:
    schema = SCHEMAS[2][1]
    kwargs = {
        "model": MODEL,
        "messages": chat_messages("Give me three lucky numbers as JSON."),
        "max_tokens": 80,
        "temperature": 0,
        "extra_body": {"structured_outputs": {"json": schema}},
    }
    full = client.chat.completions.create(**kwargs).choices[0].message.content
    stream = client.chat.completions.create(stream=True, **kwargs)
    chunks = list(stream)
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == full
    jsonschema.validate(json.loads(streamed), schema)
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"


def test_mixed_batch_leaves_unconstrained_requests_unchanged(server: ServerProcess) -> None:
    prompts = ["The capital of France is", "Once upon a time", "def fibonacci(n):"]

    def plain(prompt: str):
        async def call(aclient):
            return await aclient.completions.create(model=MODEL, prompt=prompt, max_tokens=16, temperature=0)

        return call

    def constrained(i: int):
        async def call(aclient):
            return await aclient.completions.create(
                model=MODEL,
                prompt=f"Record {i} as JSON:",
                max_tokens=120,  # room for digits: SmolLM2 writes 1.000000, one token each
                temperature=0,
                extra_body={"guided_json": SCHEMAS[i][1]},
            )

        return call

    alone = [r.choices[0].text for r in run_all(server, [plain(p) for p in prompts])]
    mixed = run_all(server, [plain(p) for p in prompts] + [constrained(i) for i in range(3)])
    assert [r.choices[0].text for r in mixed[:3]] == alone
    for i, r in enumerate(mixed[3:]):
        assert r.choices[0].finish_reason == "stop", r.choices[0].text
        jsonschema.validate(json.loads(r.choices[0].text), SCHEMAS[i][1])


# ---- tool calling ------------------------------------------------------------------------------
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": NAME, "unit": {"enum": ["celsius", "fahrenheit"]}},
            "required": ["city", "unit"],
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "Current time in a time zone",
        "parameters": {"type": "object", "properties": {"zone": NAME}, "required": ["zone"]},
    },
}
TOOLS = [WEATHER, TIME]
PARAMETERS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
ASK = chat_messages("What is the weather in Paris?")
# Forces the hermes format, so that "auto" (the model's choice, read by the parser) is deterministic.
HERMES_CALL = (
    r'<tool_call>\n\{"name": "get_weather", "arguments": \{"city": "[A-Z][a-z]{1,10}", '
    r'"unit": "(celsius|fahrenheit)"\}\}\n</tool_call>'
)


def _check_calls(tool_calls) -> None:
    assert tool_calls
    for call in tool_calls:
        assert call.type == "function" and call.id
        jsonschema.validate(json.loads(call.function.arguments), PARAMETERS[call.function.name])


def _stream_tool_calls(stream) -> tuple[list[dict], str | None, str]:
    """Rebuild tool calls from OpenAI stream deltas: (calls, last finish_reason, content)."""
    calls: dict[int, dict] = {}
    finish, content = None, ""
    for chunk in stream:
        if not chunk.choices:
            continue
        choice = chunk.choices[0]
        content += choice.delta.content or ""
        for d in choice.delta.tool_calls or []:
            call = calls.setdefault(d.index, {"id": None, "name": None, "arguments": ""})
            if d.id:
                assert call["id"] is None, "a call's id is sent once"
                call["id"] = d.id
            if d.function and d.function.name:
                call["name"] = d.function.name
            if d.function and d.function.arguments:
                call["arguments"] += d.function.arguments
        finish = choice.finish_reason or finish
    return [calls[i] for i in sorted(calls)], finish, content


@pytest.mark.parametrize("stream", [False, True])
def test_named_tool_choice(client: openai.OpenAI, stream: bool) -> None:
    kwargs = {
        "model": MODEL,
        "messages": ASK,
        "tools": TOOLS,
        "max_tokens": 60,
        "temperature": 0,
        "tool_choice": {"type": "function", "function": {"name": "get_time"}},
    }
    if not stream:
        r = client.chat.completions.create(**kwargs)
        calls = r.choices[0].message.tool_calls
        _check_calls(calls)
        assert [c.function.name for c in calls] == ["get_time"] and r.choices[0].finish_reason == "stop"
        return
    calls, finish, content = _stream_tool_calls(client.chat.completions.create(stream=True, **kwargs))
    assert [c["name"] for c in calls] == ["get_time"] and calls[0]["id"] and finish == "stop" and not content
    jsonschema.validate(json.loads(calls[0]["arguments"]), PARAMETERS["get_time"])


@pytest.mark.parametrize("stream", [False, True])
def test_required_tool_choice(client: openai.OpenAI, stream: bool) -> None:
    kwargs = {
        "model": MODEL,
        "messages": ASK,
        "tools": TOOLS,
        "tool_choice": "required",
        "max_tokens": 100,
        "temperature": 0,
    }
    if not stream:
        r = client.chat.completions.create(**kwargs)
        _check_calls(r.choices[0].message.tool_calls)
        assert r.choices[0].finish_reason == "tool_calls"
        return
    calls, finish, _ = _stream_tool_calls(client.chat.completions.create(stream=True, **kwargs))
    assert calls and finish == "tool_calls"
    for call in calls:
        jsonschema.validate(json.loads(call["arguments"]), PARAMETERS[call["name"]])


@pytest.mark.parametrize("stream", [False, True])
def test_auto_tool_choice_parses_hermes_calls(client: openai.OpenAI, stream: bool) -> None:
    kwargs = {
        "model": MODEL,
        "messages": ASK,
        "tools": TOOLS,
        "tool_choice": "auto",
        "max_tokens": 60,
        "temperature": 0,
        "extra_body": {"structured_outputs": {"regex": HERMES_CALL}},
    }
    if not stream:
        r = client.chat.completions.create(**kwargs)
        message = r.choices[0].message
        _check_calls(message.tool_calls)
        assert message.tool_calls[0].function.name == "get_weather" and not message.content
        assert r.choices[0].finish_reason == "tool_calls"
        return
    calls, finish, content = _stream_tool_calls(client.chat.completions.create(stream=True, **kwargs))
    assert [c["name"] for c in calls] == ["get_weather"] and finish == "tool_calls" and not content.strip()
    jsonschema.validate(json.loads(calls[0]["arguments"]), PARAMETERS["get_weather"])


def test_sampled_json_and_tool_calls_end_well_before_max_tokens(server: ServerProcess) -> None:
    """With free whitespace between JSON tokens SmolLM2 at temperature 0.7 wrote newlines until
    max_tokens (a named call's arguments were "\\n\\n\\t\\r..."); bounded, every answer ends."""
    sampled = {"model": MODEL, "temperature": 0.7, "max_tokens": 200}  # 308 prompt tokens with tools

    def schema_answer(seed: int):
        async def call(aclient):
            return await aclient.chat.completions.create(
                messages=chat_messages("Give me a person as JSON."),
                response_format={
                    "type": "json_schema",
                    "json_schema": {"name": "p", "schema": SCHEMAS[0][1]},
                },
                seed=seed,
                **sampled,
            )

        return call

    def tool_call(seed: int, tool_choice):
        async def call(aclient):
            return await aclient.chat.completions.create(
                messages=ASK, tools=TOOLS, tool_choice=tool_choice, seed=seed, **sampled
            )

        return call

    named = {"type": "function", "function": {"name": "get_weather"}}
    seeds = range(4)
    calls = [schema_answer(s) for s in seeds] + [tool_call(s, "required") for s in seeds]
    calls += [tool_call(s, named) for s in seeds]
    responses = run_all(server, calls)
    for r in responses:
        assert r.usage.completion_tokens < 100, r.choices[0].message
    for r in responses[: len(seeds)]:
        assert r.choices[0].finish_reason == "stop"
        jsonschema.validate(json.loads(r.choices[0].message.content), SCHEMAS[0][1])
    for r in responses[len(seeds) :]:
        _check_calls(r.choices[0].message.tool_calls)


def test_readme_tool_example(client: openai.OpenAI) -> None:
    """README.md's tools example as written: SmolLM2 answers `auto` in text (it makes no call by
    itself, see the README); `required` makes a call valid for the schema."""
    tools = [
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "description": "Get the current weather in a city",
                "parameters": {
                    "type": "object",
                    "properties": {"city": {"type": "string"}},
                    "required": ["city"],
                },
            },
        }
    ]
    ask = [{"role": "user", "content": "What's the weather in Paris?"}]
    r = client.chat.completions.create(
        model=MODEL, messages=ask, tools=tools, tool_choice="auto", temperature=0
    )
    message = r.choices[0].message
    if message.tool_calls:  # a model that calls tools: the parser read a valid call
        assert (
            r.choices[0].finish_reason == "tool_calls"
            and message.tool_calls[0].function.name == "get_weather"
        )
        jsonschema.validate(
            json.loads(message.tool_calls[0].function.arguments), tools[0]["function"]["parameters"]
        )
    else:
        assert (
            message.content and "<tool_call>" not in message.content and r.choices[0].finish_reason == "stop"
        )
    r = client.chat.completions.create(model=MODEL, messages=ask, tools=tools, tool_choice="required")
    calls = r.choices[0].message.tool_calls
    assert calls and r.choices[0].finish_reason == "tool_calls"
    for call in calls:
        assert call.function.name == "get_weather"
        jsonschema.validate(json.loads(call.function.arguments), tools[0]["function"]["parameters"])


def test_auto_without_a_call_is_content(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(
        model=MODEL,
        messages=chat_messages("Say hello."),
        tools=TOOLS,
        max_tokens=8,
        temperature=0,
        extra_body={"guided_regex": "Hello there"},
    )
    assert r.choices[0].message.content == "Hello there" and not r.choices[0].message.tool_calls
    assert r.choices[0].finish_reason == "stop"


def test_tools_rendered_and_tool_messages_accepted(server: ServerProcess, client: openai.OpenAI) -> None:
    plain = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=1)
    with_tools = client.chat.completions.create(
        model=MODEL, messages=ASK, tools=TOOLS, tool_choice="none", max_tokens=1
    )
    assert with_tools.usage.prompt_tokens > plain.usage.prompt_tokens + 50  # the template rendered them
    assert "the model's chat template ignores tools; using axon's tool-aware template" in server.log()
    call = {
        "id": "call_1",
        "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'},
    }
    conversation = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": 21}'},
    ]
    r = client.chat.completions.create(
        model=MODEL, messages=conversation, tools=TOOLS, tool_choice="none", max_tokens=8, temperature=0
    )
    assert r.choices[0].message.content and r.usage.prompt_tokens > with_tools.usage.prompt_tokens


# ---- bad input ---------------------------------------------------------------------------------
CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
BAD = [
    (
        CHAT,
        {
            "messages": ASK,
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "x", "schema": {"type": "foo"}},
            },
        },
        "not a valid JSON schema",
    ),
    (COMPLETIONS, {"prompt": "Hi", "structured_outputs": {"regex": "[a-"}}, "regex cannot be compiled"),
    (CHAT, {"messages": ASK, "guided_grammar": "root ::= ("}, "grammar cannot be compiled"),
    (
        CHAT,
        {"messages": ASK, "tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
        "'nope', which is not in `tools`",
    ),
    (
        CHAT,
        {"messages": ASK, "tools": [{"type": "function", "function": {"description": "no name"}}]},
        "has no name",
    ),
    (CHAT, {"messages": ASK, "tool_choice": "required"}, "`tools` must be set"),
    (CHAT, {"messages": ASK, "guided_regex": "a", "guided_choice": ["a"]}, "only one of"),
    (
        CHAT,
        {"messages": ASK, "response_format": {"type": "json_object"}, "guided_regex": "a"},
        "only one output constraint",
    ),
    (COMPLETIONS, {"prompt": "Hi", "structured_outputs": {"json_schema": {}}}, "unknown keys"),
    (COMPLETIONS, {"prompt": "Hi", "response_format": {"type": "yaml"}}, "response_format.type"),
    (
        COMPLETIONS,
        {"prompt": "Hi", "structured_outputs": {"json": {}, "max_whitespace_cnt": 0}},
        "max_whitespace_cnt must be a positive integer",
    ),
    (
        CHAT,
        {"messages": ASK, "tools": TOOLS, "tool_choice": "required", "guided_regex": "a"},
        "cannot be combined",
    ),
]


@pytest.mark.parametrize(("path", "body", "message"), BAD)
def test_bad_input_is_400_and_server_keeps_serving(
    server: ServerProcess, path: str, body: dict, message: str
) -> None:
    r = httpx.post(server.url + path, json={"max_tokens": 4, **body}, timeout=30)
    assert r.status_code == 400, r.text
    assert message in r.json()["error"]["message"]
    ok = httpx.post(
        server.url + COMPLETIONS, json={"prompt": "Hi", "max_tokens": 2, "temperature": 0}, timeout=30
    )
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 2
