"""A chat choice's text -> reasoning, content and tool calls; whole, or as OpenAI stream deltas.

    text ──reasoning parser──> (reasoning_content, answer)
    answer ──tool plan──> none: content | auto: the tool parser | required: a JSON array of
                          {"name", "parameters"} | named: the arguments themselves

Streaming re-parses the whole text so far on each delta and sends what is new. Every parser
here is prefix-monotonic while the text grows, so the deltas add up to the final message.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from axon.entrypoints.openai.protocol import random_uuid
from axon.entrypoints.openai.tool_choice import ToolPlan
from axon.entrypoints.openai.tool_parsers.json_scan import PartialCall, call_from_object, skip_ws
from axon.reasoning import ReasoningParser


@dataclass
class ChatOutput:
    reasoning: str
    content: str
    calls: list[PartialCall] = field(default_factory=list)


class ChatOutputParser:
    def __init__(self, plan: ToolPlan, reasoning: ReasoningParser | None) -> None:
        self.plan = plan
        self.reasoning = reasoning

    @property
    def is_plain(self) -> bool:
        """Nothing to parse: the text is the content (the common case keeps its old path)."""
        return self.reasoning is None and self.plan.mode == "none"

    @property
    def needs_special_tokens(self) -> bool:
        """Whether the text must keep special tokens (markers the parsers read)."""
        tools = self.plan.parser is not None and self.plan.parser.needs_special_tokens
        return tools or (self.reasoning is not None and self.reasoning.needs_special_tokens)

    @property
    def calls_finish_with_tool_calls(self) -> bool:
        """OpenAI reports ``tool_calls`` for auto and required calls, ``stop`` for a named one."""
        return self.plan.mode in ("auto", "required")

    def parse(self, text: str, final: bool) -> ChatOutput:
        reasoning, answer = ("", text) if self.reasoning is None else self.reasoning.split(text, final)
        mode = self.plan.mode
        if mode == "named":
            name = self.plan.function_name
            return ChatOutput(reasoning, "", [PartialCall(name, answer.strip(), complete=final)])
        if mode == "required":
            return ChatOutput(reasoning, "", array_calls(answer))
        if mode == "auto":
            assert self.plan.parser is not None, "plan_tools gives auto a parser"
            parser = self.plan.parser
            parsed = parser.parse(text if parser.reads_whole_output else answer, final)
            return ChatOutput(reasoning, parsed.content, parsed.calls)
        return ChatOutput(reasoning, answer)

    def message_fields(self, text: str) -> dict[str, Any]:
        """content, reasoning_content and tool_calls of the whole (non-streamed) message."""
        out = self.parse(text, final=True)
        calls = [tool_call(call, new_tool_call_id()) for call in out.calls if call.name is not None]
        return {
            "content": out.content or (None if calls or out.reasoning else out.content),
            "reasoning_content": out.reasoning or None,
            "tool_calls": calls,
        }


def array_calls(text: str) -> list[PartialCall]:
    """The calls of ``[{"name": ..., "parameters": {...}}, ...]`` as far as it has arrived."""
    pos = skip_ws(text, 0)
    if pos >= len(text) or text[pos] != "[":
        return []
    pos += 1
    calls: list[PartialCall] = []
    while True:
        pos = skip_ws(text, pos)
        if pos >= len(text) or text[pos] == "]":
            return calls
        if text[pos] == ",":
            pos += 1
            continue
        call, end = call_from_object(text, pos, ("parameters", "arguments"))
        if call is None:
            return calls
        calls.append(call)
        if end is None:
            return calls
        pos = end


def new_tool_call_id() -> str:
    return f"chatcmpl-tool-{random_uuid()}"


def tool_call(call: PartialCall, call_id: str) -> dict[str, Any]:
    return {"id": call_id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}


class ChoiceStreamer:
    """One choice's stream: each ``delta`` returns the new reasoning, content and tool-call
    pieces as DeltaMessage fields (an empty dict when nothing new can be sent yet)."""

    def __init__(self, parser: ChatOutputParser) -> None:
        self.parser = parser
        self.text = ""
        self.sent_reasoning = ""
        self.sent_content = ""
        self.sent_arguments: list[str] = []  # per call already announced
        self.call_ids: list[str] = []

    @property
    def num_calls(self) -> int:
        return len(self.call_ids)

    def delta(self, new_text: str, final: bool) -> dict[str, Any]:
        self.text += new_text
        out = self.parser.parse(self.text, final)
        fields: dict[str, Any] = {}
        reasoning = _new_part(out.reasoning, self.sent_reasoning)
        if reasoning:
            self.sent_reasoning = out.reasoning
            fields["reasoning_content"] = reasoning
        content = _new_part(out.content, self.sent_content)
        if content:
            self.sent_content = out.content
            fields["content"] = content
        tool_deltas = self._tool_deltas(out.calls)
        if tool_deltas:
            fields["tool_calls"] = tool_deltas
        return fields

    def _tool_deltas(self, calls: list[PartialCall]) -> list[dict[str, Any]]:
        deltas: list[dict[str, Any]] = []
        for index, call in enumerate(calls):
            if call.name is None:
                break  # calls are announced in order, each once its name is known
            if index == len(self.call_ids):
                self.call_ids.append(new_tool_call_id())
                self.sent_arguments.append("")
                header = {"index": index, "id": self.call_ids[index], "type": "function"}
                deltas.append({**header, "function": {"name": call.name, "arguments": ""}})
            new_arguments = _new_part(call.arguments, self.sent_arguments[index])
            if new_arguments:
                self.sent_arguments[index] = call.arguments
                if deltas and deltas[-1]["index"] == index:
                    deltas[-1]["function"]["arguments"] += new_arguments
                else:
                    deltas.append({"index": index, "function": {"arguments": new_arguments}})
        return deltas


def _new_part(current: str, sent: str) -> str:
    """What ``current`` adds to what was sent (nothing if it does not extend it)."""
    if len(current) > len(sent) and current.startswith(sent):
        return current[len(sent) :]
    return ""
