"""Tool-call and reasoning parsers: whole outputs, and streams cut at every character whose
deltas must add up to the whole answer."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from axon.entrypoints.openai.chat_output import ChatOutputParser, ChoiceStreamer
from axon.entrypoints.openai.errors import OpenAIError
from axon.entrypoints.openai.tool_choice import ToolPlan, plan_tools
from axon.entrypoints.openai.tool_parsers import get_tool_parser
from axon.reasoning import get_reasoning_parser

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}


def stream(parser: ChatOutputParser, text: str, step: int = 1) -> dict:
    """Feed ``text`` in pieces of ``step`` characters and rebuild the message from the deltas."""
    streamer = ChoiceStreamer(parser)
    rebuilt = {"reasoning": "", "content": "", "calls": {}}
    pieces = [text[i : i + step] for i in range(0, len(text), step)] or [""]
    for i, piece in enumerate(pieces):
        fields = streamer.delta(piece, final=i == len(pieces) - 1)
        rebuilt["reasoning"] += fields.get("reasoning_content", "")
        rebuilt["content"] += fields.get("content", "")
        for d in fields.get("tool_calls", []):
            call = rebuilt["calls"].setdefault(d["index"], {"name": None, "arguments": ""})
            call["name"] = d["function"].get("name", call["name"])
            call["arguments"] += d["function"].get("arguments", "")
    return rebuilt


def whole(parser: ChatOutputParser, text: str) -> dict:
    fields = parser.message_fields(text)
    return {
        "reasoning": fields["reasoning_content"] or "",
        "content": fields["content"] or "",
        "calls": {
            i: {"name": c["function"]["name"], "arguments": c["function"]["arguments"]}
            for i, c in enumerate(fields["tool_calls"])
        },
    }


HERMES_OUTPUTS = [
    'I will check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>',
    '<tool_call>{"name": "a", "arguments": {}}</tool_call>\n<tool_call>{"name": "b", "arguments": {"x": [1, {"y": "}"}]}}</tool_call>',
    '<tool_call>{"arguments": {"q": "late name"}, "name": "search"}</tool_call>',
    "Just an answer with a < sign and <tool no call.",
    '<tool_call>{"name": "broken", "arguments": {"x": </tool_call>',
]


@pytest.mark.parametrize("text", HERMES_OUTPUTS)
@pytest.mark.parametrize("step", [1, 3, 1000])
def test_hermes_stream_adds_up_to_the_whole(text: str, step: int) -> None:
    parser = ChatOutputParser(ToolPlan("auto", [WEATHER], parser=get_tool_parser("hermes")), None)
    final = whole(parser, text)
    if final["calls"]:
        assert stream(parser, text, step) == final


def test_hermes_whole_outputs() -> None:
    parser = get_tool_parser("hermes")
    first = parser.parse(HERMES_OUTPUTS[0], final=True)
    assert first.content == "I will check." and first.calls[0].name == "get_weather"
    assert json.loads(first.calls[0].arguments) == {"city": "Paris", "unit": "celsius"}
    second = parser.parse(HERMES_OUTPUTS[1], final=True)
    assert [c.name for c in second.calls] == ["a", "b"] and json.loads(second.calls[1].arguments)["x"][1][
        "y"
    ] == "}"
    assert parser.parse(HERMES_OUTPUTS[3], final=True).content == HERMES_OUTPUTS[3]
    broken = parser.parse(HERMES_OUTPUTS[4], final=True)
    assert broken.content == HERMES_OUTPUTS[4] and not broken.calls  # unparseable: all content


def test_llama3_json() -> None:
    parser = get_tool_parser("llama3_json")
    text = '<|python_tag|>{"name": "f", "parameters": {"a": 1}}; {"name": "g", "parameters": {}}'
    parsed = parser.parse(text, final=True)
    assert [c.name for c in parsed.calls] == ["f", "g"] and parsed.content == ""
    assert parser.parse("The answer is 4.", final=True).content == "The answer is 4."
    assert parser.parse('{"not": "a call"}', final=True).content == '{"not": "a call"}'
    plan = ChatOutputParser(ToolPlan("auto", [WEATHER], parser=parser), None)
    assert stream(plan, text, 2) == whole(plan, text)


def test_required_and_named_streams() -> None:
    required = ChatOutputParser(ToolPlan("required", [WEATHER]), None)
    text = '[{"name": "get_weather", "parameters": {"city": "Oslo"}}, {"name": "get_weather", "parameters": {"city": "Rome"}}]'
    assert stream(required, text, 1) == whole(required, text)
    assert [json.loads(c["arguments"])["city"] for c in whole(required, text)["calls"].values()] == [
        "Oslo",
        "Rome",
    ]
    named = ChatOutputParser(ToolPlan("named", [WEATHER], function_name="get_weather"), None)
    assert stream(named, '{"city": "Lima"}\n', 2) == whole(named, '{"city": "Lima"}\n')
    assert whole(named, '{"city": "Lima"}')["calls"][0] == {
        "name": "get_weather",
        "arguments": '{"city": "Lima"}',
    }


@pytest.mark.parametrize(
    ("name", "text", "reasoning", "content"),
    [
        ("deepseek_r1", "I think so.</think>Yes.", "I think so.", "Yes."),
        ("deepseek_r1", '<think>hmm</think>\n\n{"a": 1}', "hmm", '\n\n{"a": 1}'),
        ("deepseek_r1", "still thinking", "still thinking", ""),
        ("qwen3", "<think>plan</think>Answer", "plan", "Answer"),
        ("qwen3", "Answer without thinking", "", "Answer without thinking"),
        ("qwen3", "<think>cut off", "cut off", ""),
    ],
)
def test_reasoning_split_whole_and_streamed(name: str, text: str, reasoning: str, content: str) -> None:
    parser = ChatOutputParser(ToolPlan("none"), get_reasoning_parser(name)())
    assert whole(parser, text)["reasoning"] == reasoning and whole(parser, text)["content"] == content
    for step in (1, 2, 5):
        assert stream(parser, text, step) == whole(parser, text)


def test_reasoning_then_tool_call() -> None:
    parser = ChatOutputParser(
        ToolPlan("auto", [WEATHER], parser=get_tool_parser("hermes")), get_reasoning_parser("qwen3")()
    )
    text = '<think>need weather</think>\n<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>'
    result = whole(parser, text)
    assert result["reasoning"] == "need weather" and result["calls"][0]["name"] == "get_weather"
    assert stream(parser, text, 1) == result


def _request(**kwargs) -> SimpleNamespace:
    return SimpleNamespace(**{"tools": None, "tool_choice": None, "parallel_tool_calls": True, **kwargs})


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"tool_choice": "required"}, "`tools` must be set"),
        ({"tools": [WEATHER]}, "requires --enable-auto-tool-choice"),
        (
            {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "x"}}},
            "'x', which is not in",
        ),
        ({"tools": [{"type": "function", "function": {}}], "tool_choice": "none"}, "has no name"),
        ({"tools": [{"type": "retrieval"}], "tool_choice": "none"}, "must be {'type': 'function'"),
        ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice must be"),
    ],
)
def test_plan_tools_rejects(kwargs: dict, message: str) -> None:
    with pytest.raises(OpenAIError, match=message):
        plan_tools(_request(**kwargs), enable_auto_tool_choice=False, tool_call_parser=None)


def test_required_grammar_honours_parallel_tool_calls() -> None:
    plan = plan_tools(
        _request(tools=[WEATHER], tool_choice="required", parallel_tool_calls=False), False, None
    )
    grammar = plan.grammar()
    assert grammar is not None and grammar.json["maxItems"] == 1 and grammar.json["minItems"] == 1


# GPT-OSS's harmony format, as the model writes it after the template's <|start|>assistant.
HARMONY_OUTPUTS = [
    # (text, reasoning, content, calls)
    (
        (
            "<|channel|>analysis<|message|>The user wants the weather.<|end|>"
            "<|start|>assistant<|channel|>final<|message|>It is sunny in Paris.<|return|>"
        ),
        "The user wants the weather.",
        "It is sunny in Paris.",
        {},
    ),
    (
        (
            "<|channel|>analysis<|message|>Need the tool.<|end|>"
            '<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}<|call|>'
        ),
        "Need the tool.",
        "",
        {0: {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
    ),
    (  # the recipient in the header before the channel; a preamble; two calls
        (
            "<|channel|>commentary<|message|>Checking both.<|end|>"
            '<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>{"city": "Paris"}<|call|>'
            '<|start|>assistant to=functions.get_time<|channel|>commentary json<|message|>{"tz": "CET"}<|call|>'
        ),
        "",
        "Checking both.",
        {
            0: {"name": "get_weather", "arguments": '{"city": "Paris"}'},
            1: {"name": "get_time", "arguments": '{"tz": "CET"}'},
        },
    ),
    (
        "A model that does not speak harmony: <b>plain</b> text.",
        "",
        "A model that does not speak harmony: <b>plain</b> text.",
        {},
    ),
    ("<|channe", "", "<|channe", {}),  # not a marker after all
    (  # cut off inside the reasoning (max_tokens): all of it is reasoning
        "<|channel|>analysis<|message|>Thinking about <b>tags</b> and <|",
        "Thinking about <b>tags</b> and <|",
        "",
        {},
    ),
]


@pytest.mark.parametrize(("text", "reasoning", "content", "calls"), HARMONY_OUTPUTS)
@pytest.mark.parametrize("step", [1, 4, 1000])
def test_harmony_whole_and_streamed(text: str, reasoning: str, content: str, calls: dict, step: int) -> None:
    plan = ToolPlan("auto", [WEATHER], parser=get_tool_parser("openai"))
    parser = ChatOutputParser(plan, get_reasoning_parser("openai_gptoss")())
    assert parser.needs_special_tokens
    want = {"reasoning": reasoning, "content": content, "calls": calls}
    assert whole(parser, text) == want
    assert stream(parser, text, step) == want


def test_harmony_reasoning_without_tools() -> None:
    parser = ChatOutputParser(ToolPlan("none", []), get_reasoning_parser("openai_gptoss")())
    text = HARMONY_OUTPUTS[0][0]
    assert whole(parser, text) == {
        "reasoning": HARMONY_OUTPUTS[0][1],
        "content": HARMONY_OUTPUTS[0][2],
        "calls": {},
    }
    assert stream(parser, text, 1) == whole(parser, text)
    # A stream never shows part of a marker: no delta holds "<|".
    streamer = ChoiceStreamer(parser)
    for i, ch in enumerate(text):
        fields = streamer.delta(ch, final=i == len(text) - 1)
        assert "<|" not in fields.get("content", "") and "<|" not in fields.get("reasoning_content", "")
