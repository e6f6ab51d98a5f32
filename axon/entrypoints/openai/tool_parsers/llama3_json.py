"""``llama3_json``: Llama 3.x's JSON tool calls, ``{"name": ..., "parameters": {...}}``, several
separated by ``;``, optionally after ``<|python_tag|>``. An output that does not open with a
JSON object is plain content."""

from __future__ import annotations

from axon.entrypoints.openai.tool_parsers.base import ParsedOutput, ToolParser, checked
from axon.entrypoints.openai.tool_parsers.json_scan import PartialCall, call_from_object, skip_ws

PYTHON_TAG = "<|python_tag|>"


class Llama3JsonToolParser(ToolParser):
    name = "llama3_json"

    def parse(self, text: str, final: bool) -> ParsedOutput:
        pos = skip_ws(text, 0)
        if text.startswith(PYTHON_TAG, pos):
            pos = skip_ws(text, pos + len(PYTHON_TAG))
            if pos >= len(text):
                return ParsedOutput("")  # the tag alone: a call is coming (or nothing at all)
        elif not final and PYTHON_TAG.startswith(text[pos:]):
            return ParsedOutput("")  # empty so far, or maybe the tag: not decided yet
        if pos >= len(text) or text[pos] != "{":
            return ParsedOutput(text)
        calls: list[PartialCall] = []
        while True:
            call, end = call_from_object(text, pos, ("parameters", "arguments"))
            if call is None:
                return ParsedOutput(text) if final else ParsedOutput("", calls)
            calls.append(call)
            if end is None:
                break
            pos = skip_ws(text, end)
            if pos < len(text) and text[pos] == ";":
                pos = skip_ws(text, pos + 1)
                if pos < len(text) and text[pos] == "{":
                    continue
            break
        parsed = ParsedOutput("", calls)
        return checked(text, parsed) if final else parsed
