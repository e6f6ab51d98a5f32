"""The ``axon`` command: ``axon serve [MODEL]``, ``axon generate PROMPT``, ``axon chat`` and
``axon bench serve``, with vLLM's flag names.

Engine flags are generated from the config tree (``axon/config.py``), so every option has one
name everywhere: ``--max-model-len`` on the command line is ``max_model_len`` in ``LLM(...)``.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import types
from typing import Any, Union, get_args, get_origin, get_type_hints

from axon.config import AxonConfig, option_fields

# Exit code for bad user input, as argparse uses.
EXIT_USAGE = 2


def _flag_type(sub: str, f: dataclasses.Field[Any]) -> Any:
    hint = get_type_hints(type(getattr(AxonConfig(), sub)))[f.name]
    if get_origin(hint) in (Union, types.UnionType):
        hint = next(a for a in get_args(hint) if a is not type(None))
    if get_origin(hint) in (dict, tuple):
        return str  # JSON text (parsed by build_config) or a list such as 1,2,4 (by the resolver)
    return hint


def add_engine_args(parser: argparse.ArgumentParser, skip: frozenset[str] = frozenset()) -> None:
    """One flag per config option, except ``model`` and the names in ``skip`` (which the
    caller defines itself, as ``serve`` does for ``--served-model-name``)."""
    group = parser.add_argument_group("engine options (vLLM's names)")
    for sub, f in option_fields():
        if f.name == "model" or f.name in skip:
            continue
        flag = "--" + f.name.replace("_", "-")
        kind = _flag_type(sub, f)
        if kind is bool:
            group.add_argument(flag, action=argparse.BooleanOptionalAction, default=None)
        else:
            group.add_argument(flag, type=kind, default=None, metavar=f.name.upper())
    group.add_argument("--additional-config", type=str, default=None, metavar="JSON")


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """Only the flags the user gave, so the config's own defaults stay the single source."""
    names = [f.name for _, f in option_fields() if f.name != "model"] + ["additional_config"]
    return {n: getattr(args, n) for n in names if getattr(args, n, None) is not None}


def _sampling_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("sampling")
    g.add_argument("--max-tokens", type=int, default=128)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--min-p", type=float, default=0.0)
    g.add_argument("--sampling-seed", type=int, default=None, help="per-request seed")
    g.add_argument("--repetition-penalty", type=float, default=1.0)
    g.add_argument("--stop", action="append", default=None)


def _sampling_params(args: argparse.Namespace):
    from axon.sampling_params import SamplingParams

    return SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        min_p=args.min_p,
        seed=args.sampling_seed,
        repetition_penalty=args.repetition_penalty,
        stop=args.stop,
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="axon", description="axon: LLM inference with vLLM's surface.")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="complete one prompt and print the text")
    gen.add_argument("prompt")
    gen.add_argument(
        "--model", default=None, help="HF folder or .gguf file (default: bundled SmolLM2-135M-Instruct)"
    )
    gen.add_argument(
        "--chat-template-off", action="store_true", help="send the prompt raw, not as a chat message"
    )
    _sampling_args(gen)
    add_engine_args(gen)
    chat = sub.add_parser("chat", help="an interactive chat that streams tokens as they come")
    chat.add_argument(
        "--model", default=None, help="HF folder or .gguf file (default: bundled SmolLM2-135M-Instruct)"
    )
    chat.add_argument("--system", default=None, help="a system prompt")
    _sampling_args(chat)
    add_engine_args(chat)
    _add_serve_parser(sub)
    from axon.entrypoints.bench_serve import add_bench_parser

    add_bench_parser(sub)
    return parser


def _add_serve_parser(sub: Any) -> None:
    from axon.entrypoints.openai.cli_args import add_server_args

    serve = sub.add_parser("serve", help="an OpenAI-compatible HTTP server (vLLM's `vllm serve`)")
    serve.add_argument(
        "model_tag", nargs="?", default=None, help="HF folder or .gguf file (default: bundled SmolLM2)"
    )
    serve.add_argument("--model", default=None, help="the same as MODEL")
    add_server_args(serve)
    add_engine_args(serve, skip=frozenset({"served_model_name"}))


def _make_engine(args: argparse.Namespace):
    from axon.engine.arg_utils import create_engine_config
    from axon.engine.llm_engine import LLMEngine

    return LLMEngine(create_engine_config(model=args.model, **engine_kwargs(args)))


def _stream(engine, prompt: Any, params) -> str:
    """Run one request, printing text as it arrives; returns the whole text."""
    from axon.sampling_params import RequestOutputKind

    request_id = engine.add_request(prompt, params, output_kind=RequestOutputKind.DELTA)
    text = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.request_id == request_id:
                delta = out.outputs[0].text
                text.append(delta)
                print(delta, end="", flush=True)
    print()
    return "".join(text)


def _chat_prompt(engine, messages: list[dict[str, str]]) -> dict[str, list[int]]:
    from axon.engine.tokenizer import render_chat

    _, token_ids = render_chat(engine.get_tokenizer(), messages)
    return {"prompt_token_ids": token_ids}


def cmd_generate(args: argparse.Namespace) -> int:
    if not args.prompt.strip():
        raise ValueError("the prompt is empty")
    engine = _make_engine(args)
    params = _sampling_params(args)
    use_template = not args.chat_template_off and engine.get_tokenizer().chat_template is not None
    prompt = _chat_prompt(engine, [{"role": "user", "content": args.prompt}]) if use_template else args.prompt
    _stream(engine, prompt, params)
    return 0


def cmd_chat(args: argparse.Namespace) -> int:
    engine = _make_engine(args)
    params = _sampling_params(args)
    messages = [{"role": "system", "content": args.system}] if args.system else []
    print("axon chat: type a message, an empty line or Ctrl-D to quit.", file=sys.stderr)
    while True:
        try:
            line = input("> ")
        except EOFError:
            break
        if not line.strip():
            break
        messages.append({"role": "user", "content": line})
        try:
            reply = _stream(engine, _chat_prompt(engine, messages), params)
        except ValueError as e:  # e.g. the conversation outgrew max_model_len
            print(f"error: {e}", file=sys.stderr)
            messages.pop()
            continue
        messages.append({"role": "assistant", "content": reply})
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    from axon.engine.arg_utils import create_engine_config
    from axon.entrypoints.openai.api_server import run_server
    from axon.entrypoints.openai.cli_args import load_chat_template, validate_server_args

    validate_server_args(args)
    load_chat_template(args.chat_template)  # a bad path fails here, before the model loads
    if args.model_tag is not None and args.model is not None and args.model_tag != args.model:
        raise ValueError(f"two models given: {args.model_tag!r} and --model {args.model!r}")
    names = args.served_model_name  # several names (nargs="+"); the config holds the first
    kwargs = {k: v for k, v in engine_kwargs(args).items() if k != "served_model_name"}
    if names:
        kwargs["served_model_name"] = names[0]
    config = create_engine_config(model=args.model_tag or args.model, **kwargs)
    assert config.model_config.served_model_name is not None
    return run_server(args, config, names or [config.model_config.served_model_name])


def cmd_bench(args: argparse.Namespace) -> int:
    from axon.entrypoints.bench_serve import run_bench

    return run_bench(args)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    commands = {"generate": cmd_generate, "chat": cmd_chat, "serve": cmd_serve, "bench": cmd_bench}
    try:
        return commands[args.command](args)
    except ValueError as e:
        print(f"axon {args.command}: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
