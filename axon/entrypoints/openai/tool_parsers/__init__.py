"""Tool-call parsers for ``tool_choice="auto"`` (``--enable-auto-tool-choice --tool-call-parser NAME``)."""

from __future__ import annotations

from axon.entrypoints.openai.tool_parsers.base import ParsedOutput, ToolParser
from axon.entrypoints.openai.tool_parsers.hermes import HermesToolParser
from axon.entrypoints.openai.tool_parsers.llama3_json import Llama3JsonToolParser
from axon.entrypoints.openai.tool_parsers.openai_harmony import OpenAIToolParser

TOOL_PARSERS: dict[str, type[ToolParser]] = {
    HermesToolParser.name: HermesToolParser,
    Llama3JsonToolParser.name: Llama3JsonToolParser,
    OpenAIToolParser.name: OpenAIToolParser,
}


def get_tool_parser(name: str) -> ToolParser:
    if name not in TOOL_PARSERS:
        raise ValueError(f"tool call parser {name!r} is not supported; supported: {', '.join(TOOL_PARSERS)}")
    return TOOL_PARSERS[name]()


__all__ = ["TOOL_PARSERS", "ParsedOutput", "ToolParser", "get_tool_parser"]
