"""The ``axon`` command: ``axon serve [MODEL]``, ``axon generate PROMPT``, ``axon chat``,
``axon bench serve``, ``axon router`` (a proxy for disaggregated prefill/decode or replicas) and
``axon train-eagle3``, with vLLM's flag names.

Engine flags are generated from the config tree (``axon/config.py``), so every option has one
name everywhere: ``--max-model-len`` on the command line is ``max_model_len`` in ``LLM(...)``,
and its help is the field's docstring there.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import sys
import types
from collections.abc import Callable, Iterator, Sequence
from typing import Any, NoReturn, Union, get_args, get_origin, get_type_hints

from axon.config import AxonConfig, option_docs, option_fields
from axon.startup import configure_logging

# Exit code for bad user input, as argparse uses.
EXIT_USAGE = 2


class AxonArgumentParser(argparse.ArgumentParser):
    """argparse, but an unknown flag is reported by the (sub)command that got it, with its own
    usage and the nearest flag it does have ("did you mean --max-model-len?").

    Plain argparse lets a subcommand pass unknown flags up to the top-level parser, which then
    prints the top-level usage and no suggestion. Subparsers are made with this class too.
    """

    def parse_known_args(  # type: ignore[override]
        self, args: Sequence[str] | None = None, namespace: argparse.Namespace | None = None
    ) -> tuple[argparse.Namespace, list[str]]:
        namespace, extras = super().parse_known_args(args, namespace)
        if extras:
            self.error(f"unrecognized arguments: {' '.join(extras)}{self._suggestion(extras)}")
        return namespace, extras

    def _suggestion(self, extras: list[str]) -> str:
        flags = [s for action in self._actions for s in action.option_strings if s.startswith("--")]
        for arg in extras:
            if arg.startswith("--"):
                close = difflib.get_close_matches(arg.split("=", 1)[0], flags, n=1, cutoff=0.6)
                if close:
                    return f" (did you mean {close[0]}?)"
        return ""

    def error(self, message: str) -> NoReturn:
        self.print_usage(sys.stderr)
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message}\n")


def _flag_type(sub: str, f: dataclasses.Field[Any]) -> Any:
    hint = get_type_hints(type(getattr(AxonConfig(), sub)))[f.name]
    if get_origin(hint) in (Union, types.UnionType):
        hint = next(a for a in get_args(hint) if a is not type(None))
    if get_origin(hint) in (dict, tuple):
        return str  # JSON text (parsed by build_config) or a list such as 1,2,4 (by the resolver)
    return hint


def _flag_help(f: dataclasses.Field[Any]) -> str:
    """The field's docstring in axon/config.py and its default (the flag's own default is None,
    meaning "not given", so that the config stays the one source of defaults)."""
    default = f.default
    shown = ("on" if default else "off") if isinstance(default, bool) else default
    return f"{option_docs()[f.name]} (default: {shown})".replace("%", "%%")


# vLLM's short forms of the parallelism flags.
_SHORT_FLAGS = {
    "tensor_parallel_size": "-tp",
    "pipeline_parallel_size": "-pp",
    "data_parallel_size": "-dp",
    "data_parallel_size_local": "-dpl",
    "data_parallel_start_rank": "-dpr",
    "data_parallel_address": "-dpa",
    "data_parallel_rpc_port": "-dpp",
    "decode_context_parallel_size": "-dcp",
    "enable_expert_parallel": "-ep",
}


def add_engine_args(parser: argparse.ArgumentParser, skip: frozenset[str] = frozenset()) -> None:
    """One flag per config option, except ``model`` and the names in ``skip`` (which the
    caller defines itself, as ``serve`` does for ``--served-model-name``)."""
    group = parser.add_argument_group("engine options (vLLM's names)")
    for sub, f in option_fields():
        if f.name == "model" or f.name in skip:
            continue
        flags = ["--" + f.name.replace("_", "-"), *([_SHORT_FLAGS[f.name]] if f.name in _SHORT_FLAGS else [])]
        kind = _flag_type(sub, f)
        if kind is bool:
            group.add_argument(
                *flags, action=argparse.BooleanOptionalAction, default=None, help=_flag_help(f)
            )
        else:
            group.add_argument(*flags, type=kind, default=None, metavar=f.name.upper(), help=_flag_help(f))
    group.add_argument(
        "--additional-config",
        type=str,
        default=None,
        metavar="JSON",
        help='extra options, JSON; vllm-neuron\'s {"neuron_config": {...}} keys are read (default: {})',
    )


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """Only the flags the user gave, so the config's own defaults stay the single source."""
    names = [f.name for _, f in option_fields() if f.name != "model"] + ["additional_config"]
    return {n: getattr(args, n) for n in names if getattr(args, n, None) is not None}


def _sampling_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("sampling")
    g.add_argument("--max-tokens", type=int, default=128, help="the most tokens per answer (default: 128)")
    g.add_argument("--temperature", type=float, default=0.0, help="0: greedy (default: 0)")
    g.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling (default: 1: off)")
    g.add_argument("--top-k", type=int, default=0, help="keep the k likeliest tokens (default: 0: off)")
    g.add_argument("--min-p", type=float, default=0.0, help="drop tokens below min_p x the top (default: 0)")
    g.add_argument("--sampling-seed", type=int, default=None, help="per-request seed (default: None)")
    g.add_argument("--repetition-penalty", type=float, default=1.0, help="(default: 1: off)")
    g.add_argument("--stop", action="append", default=None, help="a stop string; repeat for several")


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
    parser = AxonArgumentParser(prog="axon", description="axon: LLM inference with vLLM's surface.")
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
    _add_chat_parser(sub)
    _add_serve_parser(sub)
    _add_router_parser(sub)
    _add_train_eagle3_parser(sub)
    _add_debug_parser(sub)
    from axon.entrypoints.bench_serve import add_bench_parser

    add_bench_parser(sub)
    return parser


def _add_debug_parser(sub: Any) -> None:
    debug = sub.add_parser("debug", help="accuracy debugging against transformers")
    debug_sub = debug.add_subparsers(dest="debug_command", required=True)
    acc = debug_sub.add_parser(
        "accuracy",
        help="logit validation, then per-module capture and compare to find the first layer that "
        "drifts, then replacement to confirm it; an HTML report (exit 1 when validation fails)",
    )
    acc.add_argument("--model", required=True, help="HF folder or .gguf file")
    acc.add_argument(
        "--prompts", default=None, help="a text file, one prompt per line (default: four built in)"
    )
    acc.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    acc.add_argument(
        "--reference",
        default=None,
        help="the HF folder transformers loads as the oracle (default: --model's)",
    )
    acc.add_argument("--atol", type=float, default=2e-3, help="per-module compare tolerance (default: 2e-3)")
    acc.add_argument("--rtol", type=float, default=2e-3)
    acc.add_argument("--output", required=True, help="the HTML report to write")


def cmd_debug(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from axon.entrypoints.accuracy import DEFAULT_PROMPTS, run_accuracy

    prompts = DEFAULT_PROMPTS
    if args.prompts is not None:
        with open(args.prompts, encoding="utf-8") as f:
            prompts = [line.rstrip("\n") for line in f if line.strip()]
        if not prompts:
            raise ValueError(f"--prompts {args.prompts}: no prompt in the file")
    bar = tqdm(total=6, desc="accuracy", unit="stage")

    def progress(stage: str) -> None:
        bar.set_postfix_str(stage)
        bar.update(1)

    report = run_accuracy(args.model, prompts, args.dtype, args.atol, args.rtol, progress, args.reference)
    bar.close()
    with open(args.output, "w", encoding="utf-8") as f:
        f.write(report.html)
    print(report.verdict)
    if report.comparison.first_divergence:
        print(f"first divergence: {report.comparison.first_divergence}")
    if report.confirmation:
        print(report.confirmation)
    print(f"report: {args.output}")
    return 0 if report.validation.passed else 1


def _add_chat_parser(sub: Any) -> None:
    chat = sub.add_parser(
        "chat",
        help="an interactive chat that streams tokens as they come: with a running server "
        "(--url, vLLM's `vllm chat`) or, without --url, with a model loaded in this process",
    )
    remote = chat.add_argument_group("a running server (vLLM's `vllm chat` flags)")
    remote.add_argument(
        "--url",
        default=None,
        help="the server's OpenAI API, e.g. http://localhost:8000/v1 (default: none: load the "
        "model here, offline, with the engine options below)",
    )
    remote.add_argument(
        "--model-name", default=None, help="the served model (default: the first of /v1/models)"
    )
    remote.add_argument(
        "--api-key", default=None, help="(default: $OPENAI_API_KEY, then $VLLM_API_KEY, else none)"
    )
    chat.add_argument(
        "--system-prompt", "--system", dest="system_prompt", default=None, help="a system prompt"
    )
    chat.add_argument(
        "-q", "--quick", metavar="MESSAGE", default=None, help="send MESSAGE, print the answer, exit"
    )
    chat.add_argument(
        "--model",
        default=None,
        help="offline: HF folder or .gguf file (default: bundled SmolLM2-135M-Instruct)",
    )
    _sampling_args(chat)
    add_engine_args(chat)


def _add_serve_parser(sub: Any) -> None:
    from axon.entrypoints.openai.cli_args import add_server_args

    serve = sub.add_parser("serve", help="an OpenAI-compatible HTTP server (vLLM's `vllm serve`)")
    serve.add_argument(
        "model_tag", nargs="?", default=None, help="HF folder or .gguf file (default: bundled SmolLM2)"
    )
    serve.add_argument("--model", default=None, help="the same as MODEL")
    add_server_args(serve)
    add_engine_args(serve, skip=frozenset({"served_model_name"}))


def _add_router_parser(sub: Any) -> None:
    from axon.entrypoints.router.policies import POLICIES

    router = sub.add_parser(
        "router",
        help="an OpenAI-compatible proxy: disaggregated prefill/decode (--prefill, --decode; vLLM's "
        "protocol) or plain replicas (--replica), optionally with encoder servers (--encode)",
    )
    router.add_argument("--host", default="0.0.0.0", help="(default: 0.0.0.0)")
    router.add_argument("--port", type=int, default=8000, help="(default: 8000)")
    role = router.add_argument_group("backends: http://HOST:PORT (or HOST:PORT), one or more each")
    role.add_argument("--prefill", nargs="+", default=[], metavar="URL", help="prefill servers")
    role.add_argument("--decode", nargs="+", default=[], metavar="URL", help="decode servers")
    role.add_argument(
        "--replica", nargs="+", default=[], metavar="URL", help="plain servers (no disaggregation)"
    )
    role.add_argument(
        "--encode",
        nargs="+",
        default=[],
        metavar="URL",
        help="encoder servers (--mm-encoder-only): each image of a chat is encoded there first, the "
        "chat then goes to --replica or --prefill/--decode servers that load the features "
        "(--ec-transfer-config)",
    )
    routing = router.add_argument_group("routing")
    routing.add_argument(
        "--policy",
        default="round_robin",
        choices=list(POLICIES),
        help="; ".join(f"{name}: {text}" for name, text in POLICIES.items()) + " (default: round_robin)",
    )
    routing.add_argument(
        "--kv-events",
        nargs="+",
        default=[],
        metavar="ENDPOINT",
        help="with --policy prefix: each --prefill (or --replica) server's KV events endpoint, in the "
        "same order, e.g. tcp://HOST:5557 (its --kv-events-config endpoint)",
    )
    routing.add_argument(
        "--block-size", type=int, default=16, help="the servers' KV block size, in tokens (default: 16)"
    )
    router.add_argument(
        "--health-interval",
        type=float,
        default=5.0,
        metavar="SECONDS",
        help="how often each backend's /health is probed (default: 5)",
    )


def _add_train_eagle3_parser(sub: Any) -> None:
    from axon.spec_decode.train_eagle3 import TrainOptions

    defaults = TrainOptions(output="")
    train = sub.add_parser(
        "train-eagle3",
        help="train an EAGLE3 draft head for a target by self-distillation on this machine, saved in "
        'the public format (--speculative-config \'{"method": "eagle3", "model": DIR, ...}\')',
    )
    train.add_argument(
        "--target", default=None, help="HF folder or .gguf file (default: bundled SmolLM2-135M-Instruct)"
    )
    train.add_argument("--output", required=True, help="folder the head is written to")
    options = [
        ("--num-prompts", int, "training prompts, answered by the target"),
        ("--follow-ups", int, "follow-up user turns per training prompt, answered in the same conversation"),
        ("--num-eval-prompts", int, "held-out prompts of the acceptance estimate"),
        ("--max-tokens", int, "the most tokens per generated answer"),
        ("--epochs", int, "passes over the training data"),
        ("--draft-vocab-size", int, "target tokens the head can draft (the most frequent ones)"),
        ("--lr", float, "peak learning rate (AdamW, warm-up then cosine decay)"),
        ("--num-steps", int, "draft steps unrolled in training and in the acceptance estimate"),
        ("--seed", int, "seed of the prompt order and the head's initial weights"),
    ]
    for flag, kind, text in options:
        default = getattr(defaults, flag[2:].replace("-", "_"))
        train.add_argument(flag, type=kind, default=default, help=f"{text} (default: {default})")
    train.add_argument(
        "--dtype",
        default=defaults.dtype,
        choices=("auto", "float32", "bfloat16"),
        help="the target's dtype in generation and its pass; the head trains in float32 (default: auto)",
    )


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
    configure_logging("axon")  # start-up phases go to stderr; the answer to stdout
    engine = _make_engine(args)
    params = _sampling_params(args)
    use_template = not args.chat_template_off and engine.get_tokenizer().chat_template is not None
    prompt = _chat_prompt(engine, [{"role": "user", "content": args.prompt}]) if use_template else args.prompt
    _stream(engine, prompt, params)
    return 0


def cmd_chat(args: argparse.Namespace) -> int:
    if args.url is None:
        configure_logging("axon")
        engine = _make_engine(args)
        params = _sampling_params(args)
        return _chat_loop(lambda messages: _stream(engine, _chat_prompt(engine, messages), params), args)
    offline_only = sorted(engine_kwargs(args)) + (["model"] if args.model else [])
    if offline_only:
        flags = ", ".join("--" + n.replace("_", "-") for n in offline_only)
        raise ValueError(f"{flags}: engine options apply to the offline chat (no --url) only")
    from axon.entrypoints.remote_chat import RemoteChat

    return _chat_loop(RemoteChat(args).reply, args)


def _chat_loop(reply: Callable[[list[dict[str, str]]], str], args: argparse.Namespace) -> int:
    """Read user turns (or the one --quick message), stream each answer; the conversation
    grows with every turn. An error on one turn (e.g. the conversation outgrew max_model_len)
    is printed and that turn dropped."""
    messages = [{"role": "system", "content": args.system_prompt}] if args.system_prompt else []
    for line in [args.quick] if args.quick is not None else _input_lines():
        messages.append({"role": "user", "content": line})
        try:
            answer = reply(messages)
        except ValueError as e:
            print(f"error: {e}", file=sys.stderr)
            messages.pop()
            continue
        messages.append({"role": "assistant", "content": answer})
    return 0


def _input_lines() -> Iterator[str]:
    """Lines from stdin, up to an empty line or EOF (Ctrl-D)."""
    print("axon chat: type a message, an empty line or Ctrl-D to quit.", file=sys.stderr)
    while True:
        try:
            line = input("> ")
        except EOFError:
            return
        if not line.strip():
            return
        yield line


def cmd_serve(args: argparse.Namespace) -> int:
    from axon.engine.arg_utils import create_engine_config
    from axon.entrypoints.openai.api_server import run_server
    from axon.entrypoints.openai.cli_args import check_lora_modules, load_chat_template, validate_server_args

    # Before the model is located: a GGUF conversion logs.
    configure_logging("headless" if args.headless else "api-server")
    validate_server_args(args)
    load_chat_template(args.chat_template)  # a bad path fails here, before the model loads
    if args.model_tag is not None and args.model is not None and args.model_tag != args.model:
        raise ValueError(f"two models given: {args.model_tag!r} and --model {args.model!r}")
    names = args.served_model_name  # several names (nargs="+"); the config holds the first
    kwargs = {k: v for k, v in engine_kwargs(args).items() if k != "served_model_name"}
    _check_data_parallel_hosts(args.headless, kwargs)
    if names:
        kwargs["served_model_name"] = names[0]
    config = create_engine_config(model=args.model_tag or args.model, **kwargs)
    if args.headless:
        from axon.entrypoints.headless import run_headless

        return run_headless(args, config)
    check_lora_modules(args, config)
    assert config.model_config.served_model_name is not None
    return run_server(args, config, names or [config.model_config.served_model_name])


def _check_data_parallel_hosts(headless: bool, kwargs: dict[str, Any]) -> None:
    """Which ranks this host runs: the head's are 0..L-1, a --headless host's S..S+L-1 (the
    ranges themselves are checked with the config)."""
    if "data_parallel_rank" in kwargs:
        raise ValueError(
            "--data-parallel-rank: axon serve numbers its engine cores itself (a host runs ranks "
            "--data-parallel-start-rank onward, --data-parallel-size-local of them); one core per "
            "process behind an external load balancer (vLLM's --data-parallel-rank) is not implemented"
        )
    if headless and kwargs.get("data_parallel_size_local") is None:
        raise ValueError(
            "--headless needs --data-parallel-size-local: how many engine cores this host runs "
            "(ranks --data-parallel-start-rank onward)"
        )
    if headless and kwargs["data_parallel_size_local"] < 1:
        raise ValueError(
            f"--data-parallel-size-local must be at least 1 with --headless (a host that runs engine "
            f"cores), got {kwargs['data_parallel_size_local']}"
        )
    if not headless and kwargs.get("data_parallel_start_rank", 0) != 0:
        raise ValueError(
            f"--data-parallel-start-rank {kwargs['data_parallel_start_rank']} applies to --headless "
            "hosts: the head's own engine cores are ranks 0..L-1 (--data-parallel-size-local L)"
        )


def cmd_router(args: argparse.Namespace) -> int:
    from axon.entrypoints.router.config import RouterConfig, backend_url
    from axon.entrypoints.router.proxy import run_router

    config = RouterConfig(
        prefill_urls=tuple(backend_url(u) for u in args.prefill),
        decode_urls=tuple(backend_url(u) for u in args.decode),
        replica_urls=tuple(backend_url(u) for u in args.replica),
        encode_urls=tuple(backend_url(u) for u in args.encode),
        policy=args.policy,
        kv_events_endpoints=tuple(args.kv_events),
        block_size=args.block_size,
        health_interval_s=args.health_interval,
        host=args.host,
        port=args.port,
    )
    configure_logging("router")
    return run_router(config)


def cmd_bench(args: argparse.Namespace) -> int:
    from axon.entrypoints.bench_serve import run_bench

    return run_bench(args)


def cmd_train_eagle3(args: argparse.Namespace) -> int:
    import time

    from axon.spec_decode.train_eagle3 import TrainOptions, train_eagle3

    configure_logging("axon")
    options = TrainOptions(
        output=args.output,
        target=args.target,
        num_prompts=args.num_prompts,
        num_eval_prompts=args.num_eval_prompts,
        max_tokens=args.max_tokens,
        epochs=args.epochs,
        draft_vocab_size=args.draft_vocab_size,
        lr=args.lr,
        seed=args.seed,
        dtype=args.dtype,
        num_steps=args.num_steps,
        follow_ups=args.follow_ups,
    )
    start = time.perf_counter()
    report = train_eagle3(options, engine_chat_generator(args.target, args.dtype, args.seed))
    k = options.num_steps
    phases = ", ".join(f"{name} {sec:.0f} s" for name, sec in report.seconds.items())
    print(f"EAGLE3 head written to {report.output} in {time.perf_counter() - start:.0f} s ({phases})")
    print(
        f"trained on {report.num_train_tokens} response tokens; the draft vocabulary of "
        f"{options.draft_vocab_size} covers {report.draft_vocab_coverage:.1%} of them and "
        f"{report.held_out_vocab_coverage:.1%} of the held-out answers'"
    )
    for name, est in (("a random head", report.before), ("trained", report.after)):
        rates = ", ".join(f"{r:.2f}" for r in est.step_rates)
        print(
            f"held-out acceptance ({name}, greedy, k={k}, {est.num_chains} chains): mean acceptance "
            f"length {est.mean_acceptance_length:.2f}; per draft position {rates}"
        )
    return 0


def engine_chat_generator(model: str | None, dtype: str, seed: int):
    """``train_eagle3``'s ``generate``: greedy chat answers from axon's engine, turn by turn (each
    turn of every conversation in one batch, after the answers to the turns before it), which is
    freed once they are in (the target pass loads its own copy)."""

    def generate(dialogues: list[list[str]], max_tokens: int) -> list[list[tuple[list[int], list[int]]]]:
        from axon.entrypoints.llm import LLM
        from axon.sampling_params import SamplingParams

        llm = LLM(model=model, dtype=dtype, seed=seed, max_num_seqs=64)
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
        histories: list[list[dict[str, str]]] = [[] for _ in dialogues]
        answered: list[list[tuple[list[int], list[int]]]] = [[] for _ in dialogues]
        for turn in range(max((len(d) for d in dialogues), default=0)):
            active = [i for i, d in enumerate(dialogues) if turn < len(d)]
            asked = [[*histories[i], {"role": "user", "content": dialogues[i][turn]}] for i in active]
            for i, conversation, out in zip(active, asked, llm.chat(asked, params), strict=True):
                histories[i] = [*conversation, {"role": "assistant", "content": out.outputs[0].text}]
                answered[i].append((list(out.prompt_token_ids or []), list(out.outputs[0].token_ids)))
        return answered

    return generate


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    commands = {
        "generate": cmd_generate,
        "chat": cmd_chat,
        "serve": cmd_serve,
        "bench": cmd_bench,
        "router": cmd_router,
        "train-eagle3": cmd_train_eagle3,
        "debug": cmd_debug,
    }
    try:
        return commands[args.command](args)
    except ValueError as e:
        print(f"axon {args.command}: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
