"""``hermes``: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, the format of Hermes,
Qwen2.5/Qwen3 and SmolLM2-style templates. Text before the first tag is the content."""

from __future__ import annotations

from axon.entrypoints.openai.tool_parsers.base import ParsedOutput, ToolParser, checked
from axon.entrypoints.openai.tool_parsers.json_scan import PartialCall, call_from_object
from axon.reasoning.think import held_back

START, END = "<tool_call>", "</tool_call>"


class HermesToolParser(ToolParser):
    name = "hermes"

    def parse(self, text: str, final: bool) -> ParsedOutput:
        first = text.find(START)
        if first < 0:
            if final:
                return ParsedOutput(text)
            return ParsedOutput(text[: len(text) - held_back(text, START)].rstrip())
        calls: list[PartialCall] = []
        pos = first
        while pos >= 0:
            call, object_end = call_from_object(text, pos + len(START), ("arguments", "parameters"))
            if call is None:  # not a call object: the whole output is content
                return ParsedOutput(text) if final else ParsedOutput(text[:first].rstrip(), calls)
            calls.append(call)
            if object_end is None:
                break
            close = text.find(END, object_end)
            pos = -1 if close < 0 else text.find(START, close + len(END))
        parsed = ParsedOutput(text[:first].rstrip(), calls)
        return checked(text, parsed) if final else parsed
