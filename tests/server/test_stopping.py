"""Requests end where users expect: at end-of-sequence when no max_tokens is sent (the path most
clients take), at max_tokens under ignore_eos, never before min_tokens, at a stop token id.

The server once ran every request without max_tokens to max_model_len, because EOS was lost on
the way into the engine-core process (tests/engine/test_wire.py checks that boundary); offline
runs could not see it. Greedy decoding keeps every answer here fixed; SmolLM2 answers PROMPT in
about ten tokens, far below the 512-token context of the ``server`` fixture.
"""

from __future__ import annotations

import openai
import pytest

PROMPT = "What is the capital of France?"
MESSAGES = [{"role": "user", "content": PROMPT}]
COMPLETION_PROMPT = "The capital of France is"
BRIEF = 64  # an answer that ends at EOS is far shorter than the context's 512 tokens
GREEDY = {"temperature": 0}


def _model(client: openai.OpenAI) -> str:
    return client.models.list().data[0].id


def test_chat_without_max_tokens_stops_at_eos(client: openai.OpenAI) -> None:
    response = client.chat.completions.create(model=_model(client), messages=MESSAGES, n=2, **GREEDY)
    assert [c.finish_reason for c in response.choices] == ["stop", "stop"]
    assert "Paris" in response.choices[0].message.content
    assert response.choices[0].message.content == response.choices[1].message.content
    assert response.usage.completion_tokens < 2 * BRIEF


def test_streamed_chat_without_max_tokens_stops_at_eos(client: openai.OpenAI) -> None:
    stream = client.chat.completions.create(
        model=_model(client),
        messages=MESSAGES,
        n=2,
        stream=True,
        stream_options={"include_usage": True},
        **GREEDY,
    )
    finish: dict[int, str] = {}
    usage = None
    for chunk in stream:
        for choice in chunk.choices:
            if choice.finish_reason is not None:
                finish[choice.index] = choice.finish_reason
        usage = chunk.usage or usage
    assert finish == {0: "stop", 1: "stop"}
    assert usage is not None and usage.completion_tokens < 2 * BRIEF


@pytest.mark.parametrize("stream", [False, True])
def test_completion_without_max_tokens_stops_at_eos(client: openai.OpenAI, stream: bool) -> None:
    kwargs = {"model": _model(client), "prompt": COMPLETION_PROMPT, "max_tokens": None, **GREEDY}
    if stream:
        chunks = list(client.completions.create(stream=True, **kwargs))
        text = "".join(c.choices[0].text for c in chunks if c.choices)
        finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    else:
        response = client.completions.create(**kwargs)
        text, finish = response.choices[0].text, [response.choices[0].finish_reason]
        assert response.usage.completion_tokens < BRIEF
    assert finish == ["stop"] and "Paris" in text


def test_ignore_eos_runs_to_max_tokens(client: openai.OpenAI) -> None:
    response = client.chat.completions.create(
        model=_model(client), messages=MESSAGES, max_tokens=24, extra_body={"ignore_eos": True}, **GREEDY
    )
    assert response.choices[0].finish_reason == "length"
    assert response.usage.completion_tokens == 24


def test_min_tokens_holds_off_eos(client: openai.OpenAI) -> None:
    plain = client.chat.completions.create(model=_model(client), messages=MESSAGES, **GREEDY)
    assert plain.choices[0].finish_reason == "stop"
    min_tokens = plain.usage.completion_tokens + 4
    held = client.chat.completions.create(
        model=_model(client),
        messages=MESSAGES,
        max_tokens=BRIEF,
        extra_body={"min_tokens": min_tokens},
        **GREEDY,
    )
    assert held.usage.completion_tokens >= min_tokens


def test_stop_token_ids_stop_it(client: openai.OpenAI, tokenizer) -> None:
    plain = client.chat.completions.create(model=_model(client), messages=MESSAGES, **GREEDY)
    answer_ids = tokenizer.encode(plain.choices[0].message.content, add_special_tokens=False)
    stop_id = answer_ids[2]  # the third token the model writes
    stopped = client.chat.completions.create(
        model=_model(client), messages=MESSAGES, extra_body={"stop_token_ids": [stop_id]}, **GREEDY
    )
    choice = stopped.choices[0]
    assert choice.finish_reason == "stop" and choice.model_extra["stop_reason"] == stop_id
    assert stopped.usage.completion_tokens == 3
