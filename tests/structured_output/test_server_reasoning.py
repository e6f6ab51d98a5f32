"""``--reasoning-parser``: thinking goes to reasoning_content, and grammars wait for it to end.

SmolLM2 does not think, so the prompts open (or close) the ``<think>`` block themselves, and
``deepseek_r1`` (thinking from the first token) reads the output.
"""

from __future__ import annotations

from collections.abc import Iterator

import openai
import pytest
from so_helpers import ServerProcess

CHOICES = ["yes", "no"]


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    proc = ServerProcess("--reasoning-parser", "deepseek_r1").wait_ready()
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> openai.OpenAI:
    return server.client()


def test_reasoning_content_whole_and_streamed(client: openai.OpenAI) -> None:
    model = client.models.list().data[0].id
    kwargs = {
        "model": model,
        "messages": [{"role": "user", "content": "Is water wet?"}],
        "max_tokens": 12,
        "temperature": 0,
    }
    r = client.chat.completions.create(**kwargs)
    message = r.choices[0].message
    reasoning = message.model_extra["reasoning_content"]
    assert reasoning and message.content is None  # no </think>: all of it is thinking
    chunks = list(client.chat.completions.create(stream=True, **kwargs))
    streamed = "".join(
        (c.choices[0].delta.model_extra or {}).get("reasoning_content") or "" for c in chunks if c.choices
    )
    assert streamed == reasoning
    assert not any(c.choices[0].delta.content for c in chunks if c.choices)


def test_grammar_applies_only_after_reasoning(client: openai.OpenAI) -> None:
    model = client.models.list().data[0].id
    extra = {"structured_outputs": {"choice": CHOICES}}
    thinking = client.completions.create(
        model=model, prompt="Is water wet? <think>", max_tokens=12, temperature=0, extra_body=extra
    )
    # Still thinking: unconstrained, so it runs to max_tokens (a choice would stop after a word).
    assert thinking.choices[0].finish_reason == "length" and thinking.choices[0].text not in CHOICES
    answered = client.completions.create(
        model=model,
        prompt="Is water wet? <think>Yes it is.</think>",
        max_tokens=12,
        temperature=0,
        extra_body=extra,
    )
    assert answered.choices[0].text in CHOICES and answered.choices[0].finish_reason == "stop"
