"""How ``axon router`` picks a backend: the backends' state and the routing policies, behind one
small interface and a registry.

A policy orders a role's backends for one request: the ones it prefers first, then the rest of
the healthy ones, then the ones marked down (a last resort: they may have come back since the last
probe). The proxy tries them in that order until one answers.
"""

from __future__ import annotations

import itertools
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from axon.entrypoints.router.prefix_index import PrefixIndex, chain_keys


@dataclass
class Backend:
    """One server behind the router. ``in_flight`` counts the requests this router has open
    there (the least-loaded policy's load); ``up`` is the last verdict of a probe or a request."""

    url: str
    role: str  # "prefill" | "decode" | "replica" | "encode"
    index: int  # position among its role's backends: the server index of the prefix index
    up: bool = True
    in_flight: int = 0


class RoutingPolicy(Protocol):
    async def order(self, backends: Sequence[Backend], path: str, body: dict[str, Any]) -> list[Backend]:
        """All of ``backends``, most preferred first, the ones marked down last."""
        ...


def healthy_first(ordered: Sequence[Backend]) -> list[Backend]:
    return [b for b in ordered if b.up] + [b for b in ordered if not b.up]


class RoundRobin:
    def __init__(self) -> None:
        self._turn = itertools.count()

    def rotation(self, backends: Sequence[Backend]) -> list[Backend]:
        start = next(self._turn) % len(backends)
        return list(backends[start:]) + list(backends[:start])

    async def order(self, backends: Sequence[Backend], path: str, body: dict[str, Any]) -> list[Backend]:
        return healthy_first(self.rotation(backends))


class LeastLoaded:
    """Fewest requests in flight through this router; ties go round robin."""

    def __init__(self) -> None:
        self._round_robin = RoundRobin()

    async def order(self, backends: Sequence[Backend], path: str, body: dict[str, Any]) -> list[Backend]:
        rotated = self._round_robin.rotation(backends)
        return healthy_first(sorted(rotated, key=lambda b: b.in_flight))  # sorted() is stable


# (path, body) -> the prompt's token ids as the server would compute them, or None (unknown).
Tokenize = Callable[[str, dict[str, Any]], Awaitable[list[int] | None]]
# (prompt tokens, tokens of the chosen server's cached prefix) -> None: the router's metrics.
MatchObserver = Callable[[int, int], None]


class PrefixAware:
    """The server holding the longest leading run of the prompt's full blocks; ties (and prompts
    that cannot be tokenized) go to the least loaded."""

    def __init__(self, index: PrefixIndex, tokenize: Tokenize, observe: MatchObserver) -> None:
        self.index = index
        self._tokenize = tokenize
        self._observe = observe
        self._least_loaded = LeastLoaded()

    async def order(self, backends: Sequence[Backend], path: str, body: dict[str, Any]) -> list[Backend]:
        by_load = await self._least_loaded.order(backends, path, body)
        token_ids = await self._tokenize(path, body)
        if token_ids is None:
            return by_load
        keys = chain_keys(token_ids, self.index.block_size)
        matched = {b.index: self.index.num_leading_blocks(b.index, keys) for b in backends}
        ordered = healthy_first(sorted(by_load, key=lambda b: -matched[b.index]))
        self._observe(len(token_ids), matched[ordered[0].index] * self.index.block_size)
        return ordered


# The fields of a chat request that shape its rendered prompt, which POST /tokenize takes too.
CHAT_TEMPLATE_FIELDS = (
    "add_generation_prompt",
    "continue_final_message",
    "chat_template",
    "chat_template_kwargs",
    "add_special_tokens",
    "tools",
)


def tokenize_request(path: str, body: dict[str, Any]) -> dict[str, Any] | list[int] | None:
    """The POST /tokenize body that gives the token ids the server will compute for ``body``'s
    prompt; the ids themselves when the client sent ids; None for a batch of prompts or a body
    with no prompt (its server will say what is wrong)."""
    model = {"model": body["model"]} if "model" in body else {}
    if path.endswith("/chat/completions"):
        messages = body.get("messages")
        if not isinstance(messages, list):
            return None
        return {**model, "messages": messages, **{k: body[k] for k in CHAT_TEMPLATE_FIELDS if k in body}}
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]
    if isinstance(prompt, str):
        special = {"add_special_tokens": body["add_special_tokens"]} if "add_special_tokens" in body else {}
        return {**model, "prompt": prompt, **special}
    if isinstance(prompt, list) and prompt and all(type(t) is int for t in prompt):
        return prompt
    return None


POLICIES: dict[str, str] = {
    "round_robin": "the next backend in turn",
    "least_loaded": "the backend with the fewest requests in flight through this router",
    "prefix": "the backend holding the longest cached prefix of the prompt (from its KV events; "
    "ties to the least loaded)",
}


def make_policy(
    name: str,
    index: PrefixIndex | None = None,
    tokenize: Tokenize | None = None,
    observe: MatchObserver | None = None,
) -> RoutingPolicy:
    if name == "round_robin":
        return RoundRobin()
    if name == "least_loaded":
        return LeastLoaded()
    if name == "prefix":
        assert index is not None and tokenize is not None and observe is not None, "prefix needs its index"
        return PrefixAware(index, tokenize, observe)
    raise ValueError(f"unknown routing policy {name!r}; supported: {', '.join(POLICIES)}")
