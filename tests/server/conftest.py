"""A real ``axon serve`` process on a free 127.0.0.1 port, and clients for it.

Each test module shares one server (``server`` is module-scoped); the lifecycle tests start
their own with ``ServerProcess``. The server's log goes to a file, shown when a start fails.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator

import httpx
import openai
import pytest

BASE_ARGS = ["--max-model-len", "512", "--max-num-seqs", "16", "--dtype", "float32"]
START_TIMEOUT_S = 120.0
# Short completion prompts that several equality tests send at once.
COMPLETION_PROMPTS = [
    "The quick brown fox",
    "Once upon a time",
    "In a galaxy far away",
    "The best way to learn",
    "My favourite food is",
    "The weather today is",
    "Python is a language that",
    "The ocean is",
    "A good friend is",
    "The history of Rome",
    "Mountains are",
    "Coffee or tea:",
    "The number seven",
    "Music makes people",
    "At the end of the day",
    "Trains and planes",
]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    def __init__(self, *extra_args: str, env: dict[str, str] | None = None) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = tempfile.mktemp(prefix="axon-serve-", suffix=".log")
        self._log = open(self.log_path, "w")  # noqa: SIM115 (closed in stop())
        cmd = [sys.executable, "-m", "axon.entrypoints.cli", "serve", "--port", str(self.port)]
        self.proc = subprocess.Popen(
            cmd + BASE_ARGS + list(extra_args),
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env={**os.environ, **(env or {})},
        )

    def wait_ready(self, timeout_s: float = START_TIMEOUT_S) -> ServerProcess:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"axon serve exited with {self.proc.returncode}:\n{self.log()}")
            try:
                if httpx.get(self.url + "/health", timeout=2.0).status_code == 200:
                    return self
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        raise RuntimeError(f"axon serve did not become healthy in {timeout_s} s:\n{self.log()}")

    def log(self) -> str:
        self._log.flush()
        with open(self.log_path) as f:
            return f.read()

    def client(self, api_key: str = "none", **kwargs) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key=api_key, max_retries=0, **kwargs)

    def async_client(self, api_key: str = "none") -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=self.url + "/v1", api_key=api_key, max_retries=0)

    def metric(self, name: str) -> float:
        """The first sample of ``name`` on /metrics."""
        for line in httpx.get(self.url + "/metrics").text.splitlines():
            if line.startswith((name + "{", name + " ")):
                return float(line.rsplit(" ", 1)[1])
        raise KeyError(f"{name} not on /metrics")

    def successes_per_engine(self) -> dict[str, float]:
        """engine label -> requests finished there (every finish reason), from /metrics."""
        counts: dict[str, float] = {}
        for line in httpx.get(self.url + "/metrics").text.splitlines():
            if line.startswith("vllm:request_success_total{"):
                engine = line.split('engine="', 1)[1].split('"', 1)[0]
                counts[engine] = counts.get(engine, 0.0) + float(line.rsplit(" ", 1)[1])
        return counts

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()


def serve_usage_error(*flags: str) -> str:
    """``axon serve`` with bad ``flags``: it must stop at start-up with exit code 2 and a usage
    error, no traceback; returns its stderr."""
    proc = subprocess.run(
        [sys.executable, "-m", "axon.entrypoints.cli", "serve", *flags],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
    return proc.stderr


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    proc = ServerProcess().wait_ready()
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> openai.OpenAI:
    return server.client()


@pytest.fixture(scope="session")
def tokenizer(smollm2_path: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_path)
