"""Incremental detokenization and stop strings that may span tokens.

Text grows by decoding a short window of recent tokens twice (up to the previous read point,
and up to the newest token) and keeping the difference; a window that ends in an incomplete
UTF-8 sequence (U+FFFD) waits for the next token. Only the window is decoded each step.
"""

from __future__ import annotations

from typing import Any

from axon.sampling_params import SamplingParams

# Prompt tokens kept as left context, so the first output token decodes with its leading space.
_CONTEXT_TOKENS = 5


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Any, prompt_token_ids: list[int], params: SamplingParams) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = params.skip_special_tokens
        self.stop = list(params.stop or [])
        self.include_stop = params.include_stop_str_in_output
        self.enabled = params.detokenize
        self.tokens = list(prompt_token_ids[-_CONTEXT_TOKENS:])
        self.prefix_offset = 0
        self.read_offset = len(self.tokens)
        self.output_text = ""
        self._sent_offset = 0
        # Characters withheld from a stream while they may still begin a stop string.
        self.stop_buffer = max((len(s) for s in self.stop), default=1) - 1 if not self.include_stop else 0

    def update(self, new_token_ids: list[int]) -> str | None:
        """Append tokens; return the stop string if one now appears (text is cut there)."""
        if not self.enabled:
            return None
        for token_id in new_token_ids:
            before = len(self.output_text)
            self.output_text += self._decode_next(token_id)
            stop = self._find_stop(before)
            if stop is not None:
                return stop
        return None

    def _decode_next(self, token_id: int) -> str:
        self.tokens.append(token_id)
        decode = self.tokenizer.decode
        prefix = decode(
            self.tokens[self.prefix_offset : self.read_offset], skip_special_tokens=self.skip_special_tokens
        )
        full = decode(self.tokens[self.prefix_offset :], skip_special_tokens=self.skip_special_tokens)
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            self.prefix_offset, self.read_offset = self.read_offset, len(self.tokens)
            return full[len(prefix) :]
        return ""

    def _find_stop(self, new_from: int) -> str | None:
        for stop in self.stop:
            # A stop string may begin up to len(stop) - 1 characters before the new text.
            idx = self.output_text.find(stop, max(0, new_from - len(stop) + 1))
            if idx != -1:
                self.output_text = self.output_text[: idx + len(stop) if self.include_stop else idx]
                return stop
        return None

    def next_delta(self, finished: bool) -> str:
        """Text not yet streamed, holding back what might still turn into a stop string."""
        end = (
            len(self.output_text)
            if finished
            else max(len(self.output_text) - self.stop_buffer, self._sent_offset)
        )
        delta = self.output_text[self._sent_offset : end]
        self._sent_offset = end
        return delta
