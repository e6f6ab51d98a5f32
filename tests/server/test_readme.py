"""The README's server examples, run as written against a fresh server.

The code blocks are read out of README.md, so the test follows the README: only the address is
changed to the test server's. The streaming "Tell me about the Moon." example sends no
max_tokens, so it also checks that generation stops at end-of-sequence by itself.
"""

from __future__ import annotations

import ast
import contextlib
import io
import json
import re
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.server.conftest import ServerProcess

README = Path(__file__).resolve().parents[2] / "README.md"
README_URL = "http://127.0.0.1:8000"


def readme_blocks(lang: str) -> list[str]:
    return re.findall(rf"^```{lang}\n(.*?)^```", README.read_text(), flags=re.DOTALL | re.MULTILINE)


def readme_block(lang: str, marker: str) -> str:
    """The one ``lang`` block that contains ``marker``."""
    found = [b for b in readme_blocks(lang) if marker in b]
    assert len(found) == 1, f"expected one {lang} block with {marker!r} in README.md, found {len(found)}"
    return found[0]


def shell_commands(block: str) -> list[str]:
    """The block's commands, continuation lines joined, comments dropped."""
    commands, current = [], ""
    for line in block.splitlines():
        if not current and (not line.strip() or line.lstrip().startswith("#")):
            continue
        current += line.rstrip("\\").rstrip() + " " if line.endswith("\\") else line
        if not line.endswith("\\"):
            commands.append(current.split("  #")[0].strip())
            current = ""
    return commands


def run_python(code: str, namespace: dict[str, Any]) -> tuple[list[Any], str]:
    """Run ``code`` statement by statement in ``namespace``; the values of its bare expressions
    (the README's calls whose results it shows) and what it printed."""
    values: list[Any] = []
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        for stmt in ast.parse(code).body:
            if isinstance(stmt, ast.Expr):
                values.append(eval(compile(ast.Expression(stmt.value), "README.md", "eval"), namespace))
            else:
                exec(compile(ast.Module([stmt], []), "README.md", "exec"), namespace)  # noqa: S102 (the README's own code)
    return values, out.getvalue()


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    """A fresh server with the engine's default seed: the examples sample without a seed of
    their own, so the same server start and the same requests give the same answers."""
    proc = ServerProcess("--max-model-len", "1024").wait_ready()
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def namespace() -> dict[str, Any]:
    return {}


def test_curl_chat_example(server: ServerProcess) -> None:
    curls = [c for c in shell_commands(readme_block("bash", "axon serve  ")) if c.startswith("curl")]
    assert len(curls) == 1
    proc = subprocess.run(
        curls[0].replace(README_URL, server.url), shell=True, capture_output=True, text=True, check=True
    )
    body = json.loads(proc.stdout)
    assert body["object"] == "chat.completion" and body["choices"][0]["message"]["content"]


def test_python_streaming_example_finishes_by_itself(
    server: ServerProcess, namespace: dict[str, Any]
) -> None:
    code = readme_block("python", "Tell me about the Moon.").replace(README_URL, server.url)
    _, printed = run_python(code, namespace)
    assert printed.strip()
    # No max_tokens: the answer must end at end-of-sequence, well before max_model_len.
    assert namespace["chunk"].choices[0].finish_reason == "stop"


def test_structured_outputs_examples(server: ServerProcess, namespace: dict[str, Any]) -> None:
    if "client" not in namespace:  # the block uses the client of the streaming example
        namespace["client"] = server.client()
    values, _ = run_python(readme_block("python", 'response_format={"type": "json_schema"'), namespace)
    user, yes_no = values
    parsed = json.loads(user.choices[0].message.content)
    assert isinstance(parsed["name"], str) and isinstance(parsed["age"], int)
    assert yes_no.choices[0].text in ("yes", "no")


def test_responses_and_messages_example(server: ServerProcess) -> None:
    """The README's Responses and Anthropic Messages example, as written: a chained response
    (the second one without max_output_tokens, so it ends by itself) and a message."""
    namespace: dict[str, Any] = {}
    code = readme_block("python", "client.responses.create").replace(README_URL, server.url)
    _, printed = run_python(code, namespace)
    assert printed.strip()
    assert namespace["second"].previous_response_id == namespace["first"].id
    assert namespace["second"].status == "completed"
    assert namespace["message"].type == "message" and namespace["message"].content[0].text
