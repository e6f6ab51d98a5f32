"""``<think>...</think>`` reasoning, the format of DeepSeek-R1 and Qwen3.

``split(text, final)`` works on the whole output so far and is prefix-monotonic while streaming
(``final=False``): each call's reasoning and content extend the previous call's, because a
possible partial marker at the end of the text is held back until it is decided. Streaming is
then a diff of successive splits, and the streamed deltas add up to the final split.
"""

from __future__ import annotations

from typing import ClassVar


def held_back(text: str, marker: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``marker``."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:n]):
            return n
    return 0


class ReasoningParser:
    start_marker: ClassVar[str] = "<think>"
    end_marker: ClassVar[str] = "</think>"
    # True: its requests are detokenized with skip_special_tokens=False (its markers are special
    # tokens that must stay in the text).
    needs_special_tokens: ClassVar[bool] = False

    def split(self, text: str, final: bool) -> tuple[str, str]:
        """(reasoning, content) of the output ``text`` so far."""
        body = text.lstrip()
        if body.startswith(self.start_marker):
            return self._split_thinking(body[len(self.start_marker) :], final)
        if not final and self.start_marker.startswith(body):
            return "", ""  # maybe the opening marker, not decided yet
        return self._split_unopened(text, final)

    def _split_unopened(self, text: str, final: bool) -> tuple[str, str]:
        """(reasoning, content) of an output that does not open with the start marker."""
        raise NotImplementedError

    def _split_thinking(self, text: str, final: bool) -> tuple[str, str]:
        """``text`` starts inside the reasoning (any opening marker already removed)."""
        end = text.find(self.end_marker)
        if end >= 0:
            return text[:end], text[end + len(self.end_marker) :]
        if final:
            return text, ""
        return text[: len(text) - held_back(text, self.end_marker)], ""


class DeepSeekR1ReasoningParser(ReasoningParser):
    """Reasoning from the first token (the template may already have opened ``<think>``)."""

    def _split_unopened(self, text: str, final: bool) -> tuple[str, str]:
        return self._split_thinking(text, final)


class Qwen3ReasoningParser(ReasoningParser):
    """Reasoning only when the output opens with ``<think>``; otherwise all of it is the answer."""

    def _split_unopened(self, text: str, final: bool) -> tuple[str, str]:
        return "", text
