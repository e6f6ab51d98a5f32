"""Incremental detokenization and stop strings, by their invariants on SmolLM2's tokenizer."""

from __future__ import annotations

import random

import pytest
import transformers as tf

from axon.engine.detokenizer import DecodeStream, IncrementalDetokenizer, _stream_backend
from axon.sampling_params import SamplingParams

TEXTS = [
    "Hello, world! How are you today?",
    "Émojis 🎉🚀 and accents: naïve café, 日本語のテキスト.",
    "def f(x):\n    return x ** 2  # squared\n",
    "  leading spaces and\ttabs\n\nnew lines",
]


@pytest.fixture(scope="module", params=["stream", "window"])
def tokenizer(request: pytest.FixtureRequest, smollm2_path: str):
    """SmolLM2's fast tokenizer, detokenized through a DecodeStream ("stream") or, as for a
    tokenizer a stream cannot follow, by decoding windows of tokens ("window")."""
    tokenizer = tf.AutoTokenizer.from_pretrained(smollm2_path)
    assert (_stream_backend(tokenizer) is not None) is (DecodeStream is not None)
    if request.param == "window":
        tokenizer.clean_up_tokenization_spaces = True  # SmolLM2 has nothing to clean up
        assert _stream_backend(tokenizer) is None
    elif DecodeStream is None:
        pytest.skip("tokenizers < 0.21 has no DecodeStream")
    return tokenizer


def test_random_tokens_decode_as_a_whole(tokenizer) -> None:
    """Any token sequence (byte pieces of split characters, special tokens) streams to the text
    of decoding it at once."""
    rng = random.Random(1)
    for skip in (True, False):
        for _ in range(20):
            ids = [rng.randrange(len(tokenizer)) for _ in range(rng.randint(1, 40))]
            prompt = [rng.randrange(1000) for _ in range(8)]
            detok = IncrementalDetokenizer(tokenizer, prompt, SamplingParams(skip_special_tokens=skip))
            for tok in ids:
                detok.update([tok])
            whole = tokenizer.decode(ids, skip_special_tokens=skip)
            if "\ufffd" not in whole:  # else the stream still holds an unfinished character back
                assert detok.output_text == whole, ids


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
