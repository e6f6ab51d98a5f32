"""Reasoning parsers: split a thinking model's output into reasoning and answer, by name.

    --reasoning-parser deepseek_r1   thinking from the first token, until </think>
    --reasoning-parser qwen3         thinking only when the output opens with <think>
    --reasoning-parser openai_gptoss GPT-OSS's harmony format: the analysis channel

Pure Python. The front end uses ``split`` on the text; the engine core uses the markers (as
token ids) to start a request's grammar only after its reasoning has ended.
"""

from __future__ import annotations

from axon.reasoning.harmony import HarmonyReasoningParser
from axon.reasoning.think import DeepSeekR1ReasoningParser, Qwen3ReasoningParser, ReasoningParser

REASONING_PARSERS: dict[str, type[ReasoningParser]] = {
    "deepseek_r1": DeepSeekR1ReasoningParser,
    "qwen3": Qwen3ReasoningParser,
    "openai_gptoss": HarmonyReasoningParser,
}


def get_reasoning_parser(name: str) -> type[ReasoningParser]:
    if name not in REASONING_PARSERS:
        raise ValueError(
            f"reasoning_parser {name!r} is not supported; supported: {', '.join(REASONING_PARSERS)}"
        )
    return REASONING_PARSERS[name]


__all__ = ["REASONING_PARSERS", "ReasoningParser", "get_reasoning_parser"]
