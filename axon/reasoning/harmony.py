"""The harmony format of GPT-OSS, parsed from the output text (``--reasoning-parser openai_gptoss``,
and the ``openai`` tool parser in ``axon/entrypoints/openai/tool_parsers/openai_harmony.py``).

After the chat template's ``<|start|>assistant``, a GPT-OSS model writes messages:

    <|channel|>analysis<|message|>The user asks ...<|end|>
    <|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}<|call|>
    <|start|>assistant<|channel|>final<|message|>It is sunny.<|return|>

The ``analysis`` channel is the reasoning, the ``final`` channel the answer, and a message to
``functions.NAME`` (in its header, before or after the channel) a tool call with its JSON
arguments as the body. The markers are special tokens: a request parsed here is detokenized with
``skip_special_tokens=False`` (``needs_special_tokens``), so they stay in the text.

The ``openai-harmony`` package parses the same format from token ids, but it needs the
``o200k`` vocabulary, which it downloads on first use; this parser needs nothing but the text.
Like every parser here it is prefix-monotonic while the text grows (a partial marker at the end
is held back until it is decided), so streamed deltas add up to the final message.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import ClassVar

from axon.reasoning.think import ReasoningParser, held_back

START, CHANNEL, MESSAGE = "<|start|>", "<|channel|>", "<|message|>"
TERMINATORS = ("<|end|>", "<|return|>", "<|call|>")
_CHANNEL_NAME = re.compile(r"<\|channel\|>([^\s<]+)")
_RECIPIENT = re.compile(r"\bto=([^\s<]+)")


@dataclass
class HarmonyMessage:
    channel: str | None  # analysis, commentary, final; None: the header names none
    recipient: str | None  # e.g. functions.get_weather
    body: str
    complete: bool  # its terminator has arrived


def is_harmony(text: str, final: bool) -> bool | None:
    """Whether ``text`` is in the harmony format: it opens with a header marker. None while
    streaming text too short to tell. Anything else (a model or template that does not speak
    harmony) is plain content."""
    body = text.lstrip()
    if body.startswith((CHANNEL, START)):
        return True
    if not final and (CHANNEL.startswith(body) or START.startswith(body)):
        return None
    return False


def parse_messages(text: str, final: bool) -> list[HarmonyMessage]:
    """The messages of ``text`` so far. While streaming, a header is withheld until its
    ``<|message|>`` arrives and a body's tail until it cannot be the start of a terminator.
    Text that is not in the harmony format (``is_harmony``) is one unaddressed ``final`` message."""
    harmony = is_harmony(text, final)
    if harmony is None:
        return []
    if not harmony:
        return [HarmonyMessage("final", None, text, final)]
    messages: list[HarmonyMessage] = []
    pos = 0
    while pos < len(text):
        body_at = text.find(MESSAGE, pos)
        if body_at < 0:
            break  # a header still arriving (or trailing text outside any message)
        header = text[pos:body_at]
        start = body_at + len(MESSAGE)
        ends = [(text.find(t, start), t) for t in TERMINATORS]
        ends = [(at, t) for at, t in ends if at >= 0]
        channel = _CHANNEL_NAME.search(header)
        recipient = _RECIPIENT.search(header)
        if ends:
            at, terminator = min(ends)
            body, complete, pos = text[start:at], True, at + len(terminator)
        else:
            body, complete, pos = text[start:], final, len(text)
            if not final:
                body = body[: len(body) - max(held_back(body, t) for t in TERMINATORS)]
        messages.append(
            HarmonyMessage(
                channel.group(1) if channel else None,
                recipient.group(1) if recipient else None,
                body,
                complete,
            )
        )
    return messages


def final_text(messages: list[HarmonyMessage]) -> str:
    """The answer: the bodies of the ``final`` channel (and of unaddressed ``commentary``, the
    preambles a model writes before a tool call), in order."""
    return "".join(
        m.body
        for m in messages
        if m.recipient is None and (m.channel == "final" or m.channel == "commentary")
    )


class HarmonyReasoningParser(ReasoningParser):
    """``openai_gptoss``: the ``analysis`` channel is the reasoning, the rest the answer."""

    needs_special_tokens: ClassVar[bool] = True
    # What the structured-output manager watches for: the answer's channel opening.
    start_marker: ClassVar[str] = f"{CHANNEL}analysis{MESSAGE}"
    end_marker: ClassVar[str] = f"{CHANNEL}final{MESSAGE}"

    def split(self, text: str, final: bool) -> tuple[str, str]:
        messages = parse_messages(text, final)
        reasoning = "".join(m.body for m in messages if m.channel == "analysis")
        return reasoning, final_text(messages)
