"""Through a real ``axon serve`` in bfloat16 with the official client: a greedy chat request
gets the same text and the same logprobs alone or among concurrent requests, streamed or not,
and again after its prompt is in the prefix cache."""

from __future__ import annotations

import functools
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest
from conftest import ServerProcess

QUESTIONS = [
    "What is the capital of France?",
    "Name three colours of the rainbow.",
    "Why is the sky blue? Answer in one sentence.",
    "Write a haiku about autumn.",
    "What is 17 times 3?",
    "Give me a synonym for happy.",
    "Which planet is the largest?",
    "Translate 'good morning' into Spanish.",
    "What do bees make?",
    "Tell me a fun fact about octopuses.",
]


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    proc = ServerProcess("--dtype", "bfloat16", "--max-num-seqs", "16").wait_ready()
    yield proc
    proc.stop()


def _ask(client, question: str, stream: bool, max_tokens: int | None = 48) -> tuple[str, list[float]]:
    kwargs = {
        "model": client.models.list().data[0].id,
        "messages": [{"role": "user", "content": question}],
        "temperature": 0.0,
        "logprobs": True,
    }
    if max_tokens is not None:
        kwargs["max_tokens"] = max_tokens
    if not stream:
        choice = client.chat.completions.create(**kwargs).choices[0]
        return choice.message.content, [t.logprob for t in choice.logprobs.content]
    text, logprobs = "", []
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        if chunk.choices:
            choice = chunk.choices[0]
            text += choice.delta.content or ""
            if choice.logprobs and choice.logprobs.content:
                logprobs += [t.logprob for t in choice.logprobs.content]
    return text, logprobs


def test_same_answer_alone_batched_streamed_and_cached(server: ServerProcess) -> None:
    client = server.client()
    alone = [_ask(client, q, stream=False) for q in QUESTIONS]
    assert all(text and logprobs for text, logprobs in alone)
    for stream in (True, False):  # the second round hits the prefix cache
        with ThreadPoolExecutor(len(QUESTIONS)) as pool:
            together = list(pool.map(functools.partial(_ask, client, stream=stream), QUESTIONS))
        for question, got, want in zip(QUESTIONS, together, alone):
            assert got == want, f"{question!r} (stream={stream}) differs from the request alone"


def test_a_chat_that_stops_by_itself_streams_the_same_text(server: ServerProcess) -> None:
    client = server.client()
    question = "In two sentences, what is a CPU?"
    plain = _ask(client, question, stream=False, max_tokens=None)
    assert plain[0]
    assert _ask(client, question, stream=True, max_tokens=None) == plain
