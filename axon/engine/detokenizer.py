"""Incremental detokenization and stop strings that may span tokens.

With a fast (Rust) tokenizer, text grows through the ``tokenizers`` library's ``DecodeStream``:
one call per token, which holds a token back while it ends an incomplete UTF-8 sequence (as
vLLM does). Otherwise (or where the tokenizer cleans up spaces after decoding, which a stream
cannot do) a short window of recent tokens is decoded twice (up to the previous read point, and
up to the newest token) and the difference kept; a window that ends in an incomplete UTF-8
sequence (U+FFFD) waits for the next token. Both give the text of decoding every token at once.
"""

from __future__ import annotations

from typing import Any

from axon.sampling_params import SamplingParams

try:
    from tokenizers.decoders import DecodeStream
except ImportError:  # tokenizers < 0.21
    DecodeStream = None

# Prompt tokens kept as left context, so the first output token decodes with its leading space.
_CONTEXT_TOKENS = 5


def _stream_backend(tokenizer: Any) -> Any | None:
    """The Rust tokenizer behind a transformers fast tokenizer, if a DecodeStream can follow it."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if DecodeStream is None or backend is None or getattr(tokenizer, "clean_up_tokenization_spaces", False):
        return None
    return backend


class _StreamDecoder:
    """Text of each new token from a DecodeStream, primed with the prompt's last tokens."""

    def __init__(self, backend: Any, prompt_token_ids: list[int], skip_special_tokens: bool) -> None:
        self.backend, self.skip_special_tokens = backend, skip_special_tokens
        self.stream = DecodeStream(skip_special_tokens=skip_special_tokens)
        for token_id in self._context(prompt_token_ids):
            self.next(token_id)

    def _context(self, prompt_token_ids: list[int]) -> list[int]:
        """The prompt's shortest suffix of _CONTEXT_TOKENS or more tokens (up to 24) that decodes
        to whole characters: a suffix that begins or ends inside a character would make the
        stream's first output token start with U+FFFD."""
        for n in range(min(_CONTEXT_TOKENS, len(prompt_token_ids)), min(24, len(prompt_token_ids)) + 1):
            suffix = prompt_token_ids[-n:]
            if "\ufffd" not in self.backend.decode(suffix, skip_special_tokens=False):
                return suffix
        return []

    def next(self, token_id: int) -> str:
        try:
            return self.stream.step(self.backend, token_id) or ""
        except (OverflowError, TypeError):  # an id outside the vocabulary decodes to nothing
            return ""
        except Exception as e:
            # A byte-level sequence the stream cannot continue (it raises "Invalid prefix"):
            # start a new stream at this token, as vLLM does.
            if "Invalid prefix" not in str(e):
                raise
            self.stream = DecodeStream(skip_special_tokens=self.skip_special_tokens)
            return self.stream.step(self.backend, token_id) or ""


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Any, prompt_token_ids: list[int], params: SamplingParams) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = params.skip_special_tokens
        self.stop = list(params.stop or [])
        self.include_stop = params.include_stop_str_in_output
        self.enabled = params.detokenize and tokenizer is not None  # None: skip_tokenizer_init
        self.tokens = list(prompt_token_ids[-_CONTEXT_TOKENS:])
        backend = _stream_backend(tokenizer) if self.enabled else None
        self._stream = (
            None if backend is None else _StreamDecoder(backend, prompt_token_ids, self.skip_special_tokens)
        )
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
        if self._stream is not None:
            return self._stream.next(token_id)
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
