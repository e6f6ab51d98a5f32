"""The server's own flags (vLLM's names); the engine flags come from the config tree."""

from __future__ import annotations

import argparse
import json
import os

from axon.config import AxonConfig
from axon.engine.core_proc import DEFAULT_HEARTBEAT_TIMEOUT_S

DEFAULT_MAX_REQUEST_BODY_SIZE = 32 * 1024 * 1024


def _json_list(text: str) -> list[str]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(
            f"expected a JSON list such as '[\"*\"]', got {text!r}: {e}"
        ) from None
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise argparse.ArgumentTypeError(f"expected a JSON list of strings, got {text!r}")
    return value


def add_server_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("server options (vLLM's names)")
    g.add_argument("--host", default="127.0.0.1", help="address to bind (default: 127.0.0.1 only)")
    g.add_argument("--port", type=int, default=8000)
    g.add_argument(
        "--served-model-name",
        nargs="+",
        default=None,
        help="names the API answers to; the first is reported in responses (default: the model)",
    )
    g.add_argument(
        "--api-key", default=None, help="require 'Authorization: Bearer KEY' on /v1 (or VLLM_API_KEY)"
    )
    g.add_argument(
        "--chat-template", default=None, help="a chat template: a file path or the template itself"
    )
    g.add_argument(
        "--trust-request-chat-template",
        action="store_true",
        help="accept a chat_template sent in a request body (default: refused with 400, since a "
        "template is code the server runs)",
    )
    g.add_argument(
        "--engine-heartbeat-timeout",
        type=float,
        default=DEFAULT_HEARTBEAT_TIMEOUT_S,
        metavar="SECONDS",
        help="/health answers 503 (engine_stalled) once the engine core has sent nothing, not even "
        "its 1 s heartbeat, for this long; an engine core on another host is dead after this long, "
        "and a --headless host stops once the head has not answered for this long "
        f"(default: {DEFAULT_HEARTBEAT_TIMEOUT_S:.0f})",
    )
    g.add_argument(
        "--headless",
        action="store_true",
        help="run engine cores only, no API server: --data-parallel-size-local of them, global "
        "ranks --data-parallel-start-rank onward, which join the head (axon serve "
        "--data-parallel-size N) at --data-parallel-address:--data-parallel-rpc-port",
    )
    g.add_argument("--allowed-origins", type=_json_list, default=["*"], help="CORS origins, a JSON list")
    g.add_argument("--allowed-methods", type=_json_list, default=["*"], help="CORS methods, a JSON list")
    g.add_argument("--allowed-headers", type=_json_list, default=["*"], help="CORS headers, a JSON list")
    g.add_argument("--allow-credentials", action="store_true", help="CORS: allow credentials")
    g.add_argument(
        "--max-log-len", type=int, default=None, help="truncate logged prompts to this many chars/ids"
    )
    g.add_argument(
        "--enable-log-requests", action="store_true", help="log each request's prompt and parameters"
    )
    g.add_argument(
        "--disable-log-requests", action="store_true", help="accepted for older vLLM scripts; the default"
    )
    g.add_argument(
        "--max-waiting-requests",
        type=int,
        default=None,
        help="answer 503 (Retry-After) once this many requests wait beyond what the engine runs",
    )
    g.add_argument(
        "--max-request-body-size",
        type=int,
        default=DEFAULT_MAX_REQUEST_BODY_SIZE,
        help="bytes; larger request bodies get 413 (default: 32 MiB)",
    )
    g.add_argument(
        "--uvicorn-log-level",
        default="info",
        choices=["critical", "error", "warning", "info", "debug", "trace"],
    )
    g.add_argument("--disable-uvicorn-access-log", action="store_true")
    g.add_argument(
        "--enable-auto-tool-choice",
        action="store_true",
        help='allow tool_choice "auto" (needs --tool-call-parser)',
    )
    g.add_argument(
        "--tool-call-parser", default=None, help="how tool calls are read from text: hermes, llama3_json"
    )
    g.add_argument(
        "--lora-modules",
        nargs="+",
        default=[],
        metavar="NAME=PATH",
        help="LoRA adapters (PEFT folders) served as models of their own name (needs --enable-lora); "
        'also JSON: {"name": ..., "path": ...}',
    )


def validate_server_args(args: argparse.Namespace) -> None:
    if not 0 <= args.port <= 65535:
        raise ValueError(f"--port must be in [0, 65535], got {args.port}")
    if args.max_waiting_requests is not None and args.max_waiting_requests < 0:
        raise ValueError(f"--max-waiting-requests must be non-negative, got {args.max_waiting_requests}")
    if args.max_request_body_size < 1:
        raise ValueError(f"--max-request-body-size must be positive, got {args.max_request_body_size}")
    if args.engine_heartbeat_timeout <= 0:
        raise ValueError(f"--engine-heartbeat-timeout must be positive, got {args.engine_heartbeat_timeout}")
    if args.max_log_len is not None and args.max_log_len < 0:
        raise ValueError(f"--max-log-len must be non-negative, got {args.max_log_len}")
    if args.enable_auto_tool_choice and args.tool_call_parser is None:
        raise ValueError("--enable-auto-tool-choice needs --tool-call-parser (hermes, llama3_json)")
    if args.tool_call_parser is not None:
        from axon.entrypoints.openai.tool_parsers import get_tool_parser

        get_tool_parser(args.tool_call_parser)


def check_lora_modules(args: argparse.Namespace, config: AxonConfig) -> None:
    """--lora-modules against the engine: LoRA on, and every adapter folder fit for the model
    (before the model loads)."""
    modules = lora_modules(args.lora_modules)
    if not modules:
        return
    lo = config.lora_config
    if not lo.enable_lora:
        raise ValueError("--lora-modules needs --enable-lora")
    from axon.model.layers.lora import decoder_layer_shapes, load_peft_adapter

    shapes = decoder_layer_shapes(config.model_config.hf_config or {})
    for name, path in modules:
        load_peft_adapter(path, name, shapes, lo.max_lora_rank)


def lora_modules(values: list[str]) -> list[tuple[str, str]]:
    """``--lora-modules``: (name, path) pairs from NAME=PATH or vLLM's JSON form."""
    out = []
    for value in values:
        if value.lstrip().startswith("{"):
            try:
                spec = json.loads(value)
                name, path = spec["name"], spec["path"]
            except (ValueError, KeyError, TypeError) as e:
                raise ValueError(f"--lora-modules {value!r}: JSON needs 'name' and 'path' ({e})") from None
        else:
            name, sep, path = value.partition("=")
            if not sep or not name or not path:
                raise ValueError(f"--lora-modules {value!r}: give NAME=PATH")
        out.append((name, path))
    names = [n for n, _ in out]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise ValueError(f"--lora-modules names {twice[0]!r} twice")
    return out


def load_chat_template(value: str | None) -> str | None:
    """A file path or an inline template (vLLM's rule: text with braces or newlines is inline)."""
    if value is None:
        return None
    path = os.path.expanduser(value)
    if os.path.isfile(path):
        with open(path, encoding="utf-8") as f:
            return f.read()
    if any(c in value for c in "{}\n"):
        return value
    raise ValueError(f"--chat-template {value!r} is neither a readable file nor a template")


def api_key(args: argparse.Namespace) -> str | None:
    return args.api_key or os.environ.get("VLLM_API_KEY") or None
