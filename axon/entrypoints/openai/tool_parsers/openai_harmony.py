"""``openai``: GPT-OSS's tool calls in the harmony format (``axon/reasoning/harmony.py``): a
message addressed ``to=functions.NAME`` is a call of NAME whose body is its JSON arguments; the
``final`` channel is the content. It reads the whole output (the reasoning parser's answer has
the markers removed), with the special tokens kept."""

from __future__ import annotations

from typing import ClassVar

from axon.entrypoints.openai.tool_parsers.base import ParsedOutput, ToolParser, checked
from axon.entrypoints.openai.tool_parsers.json_scan import PartialCall
from axon.reasoning.harmony import final_text, parse_messages

FUNCTIONS = "functions."


class OpenAIToolParser(ToolParser):
    name = "openai"
    reads_whole_output: ClassVar[bool] = True
    needs_special_tokens: ClassVar[bool] = True

    def parse(self, text: str, final: bool) -> ParsedOutput:
        messages = parse_messages(text, final)
        calls = [
            PartialCall(
                m.recipient[len(FUNCTIONS) :], m.body.strip() if m.complete else m.body.lstrip(), m.complete
            )
            for m in messages
            if m.recipient is not None and m.recipient.startswith(FUNCTIONS)
        ]
        content = final_text(messages)
        parsed = ParsedOutput(content, calls)
        return checked(content, parsed) if final else parsed
