"""The ``axon`` command line: misspelled flags, generated help, chat and bench flag pairing."""

from __future__ import annotations

import argparse
import socket

import pytest

from axon.config import option_docs, option_fields
from axon.entrypoints.bench_serve import resolve_backend
from axon.entrypoints.cli import build_parser, main


@pytest.mark.parametrize(
    ("argv", "usage", "suggestion"),
    [
        (["serve", "--max-model-length", "512"], "usage: axon serve", "--max-model-len"),
        (["generate", "hi", "--max-tokns", "4"], "usage: axon generate", "--max-tokens"),
        (["bench", "serve", "--num-promts", "3"], "usage: axon bench serve", "--num-prompts"),
        (["chat", "--system-promt", "x"], "usage: axon chat", "--system-prompt"),
    ],
)
def test_misspelled_flag_gets_did_you_mean_and_the_subcommand_usage(
    argv: list[str], usage: str, suggestion: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith(usage), err[:200]
    assert f"(did you mean {suggestion}?)" in err
    assert "usage: axon [-h]" not in err  # not the top-level usage


def _engine_actions(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    group = next(g for g in parser._action_groups if g.title == "engine options (vLLM's names)")
    return group._group_actions


@pytest.mark.parametrize("command", ["serve", "generate", "chat"])
def test_every_engine_flag_has_help_and_its_default(command: str) -> None:
    sub = build_parser()._subparsers._group_actions[0].choices[command]  # type: ignore[union-attr]
    actions = _engine_actions(sub)
    assert len(actions) >= 40
    for action in actions:
        assert action.help and len(action.help) > 20, action.option_strings
        assert "(default: " in action.help, action.option_strings
    help_text = sub.format_help()  # argparse renders every help string (a stray % would raise)
    assert "--max-model-len" in help_text and "(default: 256)" in help_text  # max_num_seqs


def test_every_option_is_documented_once_in_the_config() -> None:
    docs = option_docs()
    assert [f.name for _, f in option_fields() if not docs.get(f.name)] == []


def test_chat_url_refuses_engine_flags(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["chat", "--url", "http://127.0.0.1:9/v1", "--max-model-len", "64"]) == 2
    assert "--max-model-len: engine options apply to the offline chat" in capsys.readouterr().err


def test_chat_url_without_a_server_says_so(capsys: pytest.CaptureFixture[str]) -> None:
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    assert main(["chat", "--url", f"http://127.0.0.1:{port}/v1", "-q", "hi"]) == 2
    assert f"cannot reach the server at http://127.0.0.1:{port}/v1" in capsys.readouterr().err


def test_chat_flags_keep_vllm_names() -> None:
    args = build_parser().parse_args(
        ["chat", "--url", "http://h:1/v1", "--model-name", "m", "--system-prompt", "s", "--api-key", "k"]
    )
    assert (args.url, args.model_name, args.system_prompt, args.api_key) == ("http://h:1/v1", "m", "s", "k")
    assert build_parser().parse_args(["chat", "--system", "old"]).system_prompt == "old"


@pytest.mark.parametrize(
    ("backend", "endpoint", "expected"),
    [
        (None, None, ("openai", "/v1/completions")),
        ("openai-chat", None, ("openai-chat", "/v1/chat/completions")),
        ("openai", None, ("openai", "/v1/completions")),
        ("vllm", None, ("vllm", "/v1/completions")),
        (None, "/v1/chat/completions", ("openai-chat", "/v1/chat/completions")),
        ("openai-chat", "/v1/chat/completions", ("openai-chat", "/v1/chat/completions")),
        ("openai", "/proxy/v1/completions", ("openai", "/proxy/v1/completions")),
        ("openai-responses", None, ("openai-responses", "/v1/responses")),
        (None, "/v1/responses", ("openai-responses", "/v1/responses")),
        (None, "/v1/messages", ("anthropic-messages", "/v1/messages")),
    ],
)
def test_bench_backend_and_endpoint_pair_as_in_vllm(
    backend: str | None, endpoint: str | None, expected: tuple[str, str]
) -> None:
    assert resolve_backend(backend, endpoint) == expected


@pytest.mark.parametrize(
    ("backend", "endpoint"),
    [
        ("openai-chat", "/v1/completions"),
        ("openai", "/v1/chat/completions"),
        (None, "v1/completions"),
        ("anthropic-messages", "/v1/responses"),
    ],
)
def test_bench_backend_and_endpoint_mismatch_is_refused(backend: str | None, endpoint: str) -> None:
    with pytest.raises(ValueError, match="--endpoint"):
        resolve_backend(backend, endpoint)


def test_bench_accepts_vllm_backend_flag() -> None:
    args = build_parser().parse_args(["bench", "serve", "--backend", "openai-chat"])
    assert args.backend == "openai-chat" and args.endpoint is None
