"""Structured outputs and tool calling through a real ``axon serve`` and the official client.

One server for the module (SmolLM2-135M, float32, greedy): requests run concurrently so that
they share batches, which is also how the mixed-batch test checks that unconstrained rows are
left alone.
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
from so_helpers import HERMES_TEMPLATE, ServerProcess

MODEL = "axon-so"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    template = tmp_path_factory.mktemp("template") / "hermes.jinja"
    template.write_text(HERMES_TEMPLATE)
    args = ["--served-model-name", MODEL, "--chat-template", str(template)]
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
NAME = {"type": "string", "minLength": 1, "maxLength": 12}
SCHEMAS: list[tuple[str, dict]] = [
    (
        "a person",
        {
            "type": "object",
            "properties": {"name": NAME, "age": {"type": "integer", "minimum": 0, "maximum": 120}},
            "required": ["name", "age"],
        },
    ),
    (
        "a city with its location",
        {
            "type": "object",
            "properties": {
                "city": NAME,
                "location": {
                    "type": "object",
                    "properties": {
                        "lat": {"type": "number", "minimum": -90, "maximum": 90},
                        "lon": {"type": "number", "minimum": -180, "maximum": 180},
                    },
                    "required": ["lat", "lon"],
                },
            },
            "required": ["city", "location"],
        },
    ),
    (
        "three lucky numbers",
        {
            "type": "object",
            "properties": {
                "numbers": {
                    "type": "array",
                    "items": {"type": "integer", "minimum": 0, "maximum": 99},
                    "minItems": 3,
                    "maxItems": 3,
                }
            },
            "required": ["numbers"],
        },
    ),
    (
        "a traffic light colour",
        {
            "type": "object",
            "properties": {"colour": {"enum": ["red", "amber", "green"]}},
            "required": ["colour"],
        },
    ),
    (
        "a yes/no flag and a note",
        {
            "type": "object",
            "properties": {"flag": {"type": "boolean"}, "note": {"type": "null"}},
            "required": ["flag", "note"],
        },
    ),
    (
        "a temperature reading",
        {
            "type": "object",
            "properties": {"celsius": {"type": "number", "minimum": -50, "maximum": 60}},
            "required": ["celsius"],
        },
    ),
    (
        "an airport code",
        {
            "type": "object",
            "properties": {"code": {"type": "string", "pattern": "^[A-Z]{3}$"}},
            "required": ["code"],
        },
    ),
    (
        "a book, subtitle optional",
        {
            "type": "object",
            "properties": {
                "title": NAME,
                "subtitle": NAME,
                "pages": {"type": "integer", "minimum": 1, "maximum": 2000},
            },
            "required": ["title", "pages"],
        },
    ),
    (
        "two addresses",
        {
            "$defs": {
                "address": {
                    "type": "object",
                    "properties": {"street": NAME, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                    "required": ["street", "zip"],
                }
            },
            "type": "object",
            "properties": {"home": {"$ref": "#/$defs/address"}, "work": {"$ref": "#/$defs/address"}},
            "required": ["home", "work"],
        },
    ),
    (
        "a team of people",
        {
            "type": "object",
            "properties": {
                "members": {
                    "type": "array",
                    "minItems": 1,
                    "maxItems": 3,
                    "items": {
                        "type": "object",
                        "properties": {"name": NAME, "role": {"enum": ["dev", "ops"]}},
                        "required": ["name", "role"],
                    },
                }
            },
            "required": ["members"],
        },
    ),
    (
        "a versioned record",
        {
            "type": "object",
            "properties": {"version": {"const": 2}, "id": {"type": "integer", "minimum": 1, "maximum": 1000}},
            "required": ["version", "id"],
        },
    ),
    (
        "an id that is a string or a number",
        {
            "type": "object",
            "properties": {"id": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 999}, NAME]}},
            "required": ["id"],
        },
    ),
    (
        "a 2x2 matrix",
        {
            "type": "object",
            "properties": {
                "rows": {
                    "type": "array",
                    "minItems": 2,
                    "maxItems": 2,
                    "items": {
                        "type": "array",
                        "minItems": 2,
                        "maxItems": 2,
                        "items": {"type": "integer", "minimum": -9, "maximum": 9},
                    },
                }
            },
            "required": ["rows"],
        },
    ),
    (
        "an event with a date",
        {
            "type": "object",
            "properties": {"event": NAME, "date": {"type": "string", "format": "date"}},
            "required": ["event", "date"],
        },
    ),
    (
        "a positive score",
        {
            "type": "object",
            "properties": {"score": {"type": "integer", "exclusiveMinimum": 0, "maximum": 10}},
            "required": ["score"],
        },
    ),
    (
        "a nickname or null",
        {
            "type": "object",
            "properties": {"nickname": {"type": ["string", "null"], "maxLength": 10}},
            "required": ["nickname"],
        },
    ),
    (
        "a closed product record",
        {
            "type": "object",
            "properties": {
                "sku": {"type": "string", "pattern": "^[A-Z]{2}-[0-9]{3}$"},
                "price": {"type": "number", "minimum": 0, "maximum": 1000},
                "in_stock": {"type": "boolean"},
            },
            "required": ["sku", "price", "in_stock"],
            "additionalProperties": False,
        },
    ),
    (
        "a dice roll",
        {"type": "object", "properties": {"roll": {"enum": [1, 2, 3, 4, 5, 6]}}, "required": ["roll"]},
    ),
    (
        "a company with a CEO and an address",
        {
            "type": "object",
            "properties": {
                "company": {
                    "type": "object",
                    "properties": {
                        "name": NAME,
                        "ceo": {
                            "type": "object",
                            "properties": {
                                "name": NAME,
                                "since": {"type": "integer", "minimum": 1990, "maximum": 2025},
                            },
                            "required": ["name", "since"],
                        },
                    },
                    "required": ["name", "ceo"],
                }
            },
            "required": ["company"],
        },
    ),
    (
        "a list of tags",
        {
            "type": "object",
            "properties": {
                "tags": {
                    "type": "array",
                    "minItems": 1,
                    "maxItems": 4,
                    "items": {"type": "string", "minLength": 1, "maxLength": 8},
                }
            },
            "required": ["tags"],
        },
    ),
    (
        "a point",
        {
            "type": "array",
            "prefixItems": [
                {"type": "integer", "minimum": 0, "maximum": 9},
                {"type": "integer", "minimum": 0, "maximum": 9},
            ],
            "items": False,
            "minItems": 2,
        },
    ),
    ("a rating", {"type": "integer", "minimum": 1, "maximum": 5}),
]


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
                max_tokens=60,
                temperature=0,
                extra_body={"guided_json": SCHEMAS[i][1]},
            )

        return call

    alone = [r.choices[0].text for r in run_all(server, [plain(p) for p in prompts])]
    mixed = run_all(server, [plain(p) for p in prompts] + [constrained(i) for i in range(3)])
    assert [r.choices[0].text for r in mixed[:3]] == alone
    for i, r in enumerate(mixed[3:]):
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


def test_tools_rendered_and_tool_messages_accepted(client: openai.OpenAI) -> None:
    plain = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=1)
    with_tools = client.chat.completions.create(
        model=MODEL, messages=ASK, tools=TOOLS, tool_choice="none", max_tokens=1
    )
    assert with_tools.usage.prompt_tokens > plain.usage.prompt_tokens + 50  # the template rendered them
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
