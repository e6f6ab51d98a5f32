"""Incremental detokenization and stop strings, by their invariants on SmolLM2's tokenizer."""

from __future__ import annotations

import random

import pytest
import transformers as tf

from axon.engine.detokenizer import IncrementalDetokenizer
from axon.sampling_params import SamplingParams

TEXTS = [
    "Hello, world! How are you today?",
    "Émojis 🎉🚀 and accents: naïve café, 日本語のテキスト.",
    "def f(x):\n    return x ** 2  # squared\n",
    "  leading spaces and\ttabs\n\nnew lines",
]


@pytest.fixture(scope="module")
def tokenizer(smollm2_path: str):
    return tf.AutoTokenizer.from_pretrained(smollm2_path)


@pytest.mark.parametrize("text", TEXTS)
def test_streamed_deltas_rebuild_the_decoded_text(tokenizer, text: str) -> None:
    prompt = tokenizer.encode("Say:")
    ids = tokenizer.encode(text)
    detok = IncrementalDetokenizer(tokenizer, prompt, SamplingParams())
    rng = random.Random(0)
    pieces, i = [], 0
    while i < len(ids):  # tokens arrive in chunks of 1-3, as with speculative decoding
        n = rng.randint(1, 3)
        assert detok.update(ids[i : i + n]) is None
        pieces.append(detok.next_delta(finished=False))
        assert "\ufffd" not in pieces[-1], "a delta split a UTF-8 character"
        i += n
    pieces.append(detok.next_delta(finished=True))
    assert "".join(pieces) == detok.output_text == tokenizer.decode(ids)


def test_stop_string_across_tokens_is_cut_and_held_back(tokenizer) -> None:
    text = "The answer is forty-two, of course."
    ids = tokenizer.encode(text)
    stop = "y-tw"  # spans token boundaries
    detok = IncrementalDetokenizer(tokenizer, [1], SamplingParams(stop=[stop]))
    streamed = ""
    found = None
    for tok in ids:
        found = detok.update([tok])
        streamed += detok.next_delta(finished=found is not None)
        if found:
            break
        # Never stream a character that could still begin the stop string.
        assert not any(streamed.endswith(stop[:k]) for k in range(1, len(stop)))
    assert found == stop
    assert detok.output_text == streamed == text[: text.index(stop)]


def test_include_stop_str_in_output(tokenizer) -> None:
    ids = tokenizer.encode("one two three four")
    detok = IncrementalDetokenizer(
        tokenizer, [1], SamplingParams(stop=["three"], include_stop_str_in_output=True)
    )
    assert detok.update(ids) == "three"
    assert detok.output_text == "one two three"


def test_skip_special_tokens(tokenizer) -> None:
    ids = tokenizer.encode("hi") + [tokenizer.eos_token_id]
    kept = IncrementalDetokenizer(tokenizer, [1], SamplingParams(skip_special_tokens=False))
    kept.update(ids)
    skipped = IncrementalDetokenizer(tokenizer, [1], SamplingParams())
    skipped.update(ids)
    assert kept.output_text == "hi" + tokenizer.eos_token
    assert skipped.output_text == "hi"
