"""Profiling with vLLM's surface: ``--profiler-config`` and ``POST /start_profile`` /
``/stop_profile`` on a real ``axon serve`` write Chrome traces of the engine core and the API
server with the named step ranges; ``axon bench serve --profile`` drives them; without the
config the routes are 404s; offline ``LLM.start_profile`` / ``stop_profile`` do the same."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from axon import LLM, SamplingParams
from tests.server.conftest import ServerProcess, serve_usage_error

ENGINE_RANGES = {"schedule", "prepare_inputs", "sample", "update"}


def _names(path: str) -> set[str]:
    with open(path) as f:
        trace = json.load(f)
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    return {e.get("name", "") for e in events}


def test_profile_routes_write_traces_with_the_step_ranges(tmp_path: Path) -> None:
    config = json.dumps({"profiler": "torch", "torch_profiler_dir": str(tmp_path)})
    server = ServerProcess("--profiler-config", config)
    try:
        client = server.wait_ready().client()
        model = client.models.list().data[0].id
        assert httpx.post(server.url + "/start_profile").status_code == 200
        for _ in range(2):
            client.chat.completions.create(
                model=model, messages=[{"role": "user", "content": "Hi"}], max_tokens=4
            )
        stopped = httpx.post(server.url + "/stop_profile", timeout=120)
        assert stopped.status_code == 200
        traces = stopped.json()["traces"]
        engine = [t for t in traces if "engine-core" in Path(t).name]
        front = [t for t in traces if "api-server" in Path(t).name]
        assert len(engine) == 1 and len(front) == 1 and all(Path(t).parent == tmp_path for t in traces)
        names = _names(engine[0])
        assert ENGINE_RANGES <= names and any(n.startswith("forward ") for n in names), sorted(names)[:50]
        assert "detokenize" in _names(front[0])
        # axon bench serve --profile starts and stops it around its run.
        before = set(tmp_path.iterdir())
        cmd = [sys.executable, "-m", "axon.entrypoints.cli", "bench", "serve", "--base-url", server.url,
               "--num-prompts", "2", "--random-input-len", "8", "--random-output-len", "2", "--profile",
               "--disable-tqdm"]  # fmt: skip
        subprocess.run(cmd, check=True, capture_output=True, timeout=120)
        assert len(set(tmp_path.iterdir()) - before) == 2
    finally:
        server.stop()


def test_profile_routes_are_404_without_the_config_and_a_bad_config_is_named() -> None:
    server = ServerProcess()
    try:
        assert httpx.post(server.wait_ready().url + "/start_profile").status_code == 404
    finally:
        server.stop()
    usage = serve_usage_error("--profiler-config", '{"profiler": "torch"}')
    assert "torch_profiler_dir" in usage


def test_llm_profile(tiny_model_dir, tmp_path: Path) -> None:
    config = {"profiler": "torch", "torch_profiler_dir": str(tmp_path)}
    llm = LLM(model=tiny_model_dir("llama"), profiler_config=config)
    llm.start_profile()
    llm.generate({"prompt_token_ids": [1, 2, 3, 4]}, SamplingParams(max_tokens=3), use_tqdm=False)
    (trace,) = llm.stop_profile()
    assert ENGINE_RANGES <= _names(trace)
    with pytest.raises(ValueError, match="profiler_config"):
        LLM(model=tiny_model_dir("llama")).start_profile()
