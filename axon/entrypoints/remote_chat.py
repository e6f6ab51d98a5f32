"""``axon chat --url URL``: chat with a running OpenAI-compatible server (vLLM's ``vllm chat``).

The conversation is kept here and sent whole each turn to ``/v1/chat/completions`` with
``stream: true`` through the official ``openai`` client; tokens are printed as they arrive.
"""

from __future__ import annotations

import argparse
import os
from typing import Any

import openai


def make_client(url: str, api_key: str | None) -> openai.OpenAI:
    # vLLM's order: --api-key, then the environment (OPENAI_API_KEY, then VLLM_API_KEY).
    key = api_key or os.environ.get("OPENAI_API_KEY") or os.environ.get("VLLM_API_KEY") or "EMPTY"
    return openai.OpenAI(base_url=url, api_key=key, max_retries=0)


def resolve_model_name(client: openai.OpenAI, model_name: str | None) -> str:
    """--model-name, else the first model the server lists (as vLLM's chat does)."""
    if model_name:
        return model_name
    try:
        models = client.models.list().data
    except openai.APIConnectionError as e:
        raise ValueError(f"cannot reach the server at {client.base_url}: {e}") from None
    except openai.APIStatusError as e:
        raise ValueError(f"GET {client.base_url}models answered {e.status_code}: {e.message}") from None
    if not models:
        raise ValueError(f"{client.base_url}models lists no model; pass --model-name")
    return models[0].id


def request_options(args: argparse.Namespace) -> dict[str, Any]:
    """The sampling flags as request fields; vLLM's extras (top_k, ...) go in ``extra_body``."""
    extra = {"top_k": args.top_k, "min_p": args.min_p, "repetition_penalty": args.repetition_penalty}
    options = {
        "max_tokens": args.max_tokens,
        "temperature": args.temperature,
        "top_p": args.top_p,
        "seed": args.sampling_seed,
        "stop": args.stop,
    }
    return {k: v for k, v in options.items() if v is not None} | {"extra_body": extra}


class RemoteChat:
    """One streamed reply per call; a server's 4xx becomes a ValueError (the chat goes on)."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.client = make_client(args.url, args.api_key)
        self.model = resolve_model_name(self.client, args.model_name)
        self.options = request_options(args)

    def reply(self, messages: list[dict[str, str]]) -> str:
        text: list[str] = []
        try:
            stream = self.client.chat.completions.create(
                model=self.model,
                messages=messages,  # type: ignore[arg-type]
                stream=True,
                **self.options,
            )
            for chunk in stream:
                delta = chunk.choices[0].delta.content if chunk.choices else None
                if delta:
                    text.append(delta)
                    print(delta, end="", flush=True)
        except openai.APIStatusError as e:
            raise ValueError(f"the server answered {e.status_code}: {e.message}") from None
        except openai.APIConnectionError as e:
            raise ValueError(f"cannot reach the server at {self.client.base_url}: {e}") from None
        print()
        return "".join(text)
