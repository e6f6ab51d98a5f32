"""The tool-parser interface: model text -> (content, tool calls), for ``tool_choice="auto"``.

``parse(text, final)`` sees the whole output so far. While streaming (``final=False``) it must
be prefix-monotonic: content and each call's arguments only grow, and calls are only appended,
so that a stream of diffs adds up to the final answer. With ``final=True`` an output whose
calls do not parse is returned whole as content (as vLLM does).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

from axon.entrypoints.openai.tool_parsers.json_scan import PartialCall, is_json_object


@dataclass
class ParsedOutput:
    content: str
    calls: list[PartialCall] = field(default_factory=list)


class ToolParser:
    name: str = ""
    # True: parse() gets the whole output, not the reasoning parser's answer (harmony's calls
    # live in messages the reasoning parser strips).
    reads_whole_output: ClassVar[bool] = False
    # True: its requests are detokenized with skip_special_tokens=False (markers that are
    # special tokens stay in the text).
    needs_special_tokens: ClassVar[bool] = False

    def parse(self, text: str, final: bool) -> ParsedOutput:
        raise NotImplementedError


def checked(text: str, parsed: ParsedOutput) -> ParsedOutput:
    """The final answer: every call named, complete and with object arguments, or all content."""
    for call in parsed.calls:
        if call.name is None or not call.complete or not is_json_object(call.arguments):
            return ParsedOutput(content=text)
    return parsed
