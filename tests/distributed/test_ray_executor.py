"""The ``ray`` executor on a local Ray instance that the test starts itself (``ray start
--head`` on 127.0.0.1), as a user's cluster would be: the same greedy tokens and
log-probabilities as one rank, and a killed actor ends the engine with an error naming it."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest

from axon import LLM, SamplingParams
from axon.executor.abstract import WorkerError

ray = pytest.importorskip("ray")

PROMPTS = [[5, 17, 42, 9, 300, 12], [7, 7, 8, 120, 33, 2, 61, 90, 14, 250, 3, 44, 18, 19, 21, 99, 5, 6]]
OPTIONS = {"dtype": "float32", "max_model_len": 128, "max_num_seqs": 4, "block_size": 16}
PARAMS = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=3)


def _ray(*args: str) -> subprocess.CompletedProcess:
    ray_cli = os.path.join(os.path.dirname(sys.executable), "ray")
    # A test cluster on 127.0.0.1 without token authentication: Ray 2.59+ turns it on for a head
    # started where a token file exists, and ray.init(address=...) does not send the token.
    env = {**os.environ, "RAY_AUTH_MODE": "disabled"}
    return subprocess.run([ray_cli, *args], capture_output=True, text=True, timeout=120, check=False, env=env)


@pytest.fixture(scope="module")
def ray_cluster() -> Iterator[str]:
    """A one-host Ray cluster of 2 CPUs on 127.0.0.1; its address is set in RAY_ADDRESS."""
    port = 6390 + os.getpid() % 500
    started = _ray(
        "start",
        "--head",
        "--node-ip-address=127.0.0.1",
        f"--port={port}",
        "--num-cpus=2",
        "--include-dashboard=false",
        "--object-store-memory=200000000",
        "--disable-usage-stats",
    )
    assert started.returncode == 0, started.stdout + started.stderr
    address = f"127.0.0.1:{port}"
    previous = os.environ.get("RAY_ADDRESS")
    os.environ["RAY_ADDRESS"] = address
    try:
        yield address
    finally:
        if previous is None:
            os.environ.pop("RAY_ADDRESS", None)
        else:
            os.environ["RAY_ADDRESS"] = previous
        _ray("stop", "--force")


def _outputs(llm: LLM) -> list[tuple[list[int], list[float]]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], PARAMS, use_tqdm=False)
    return [
        (
            o.outputs[0].token_ids,
            [d[t].logprob for d, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)],
        )
        for o in outs
    ]


def test_ray_tp2_equals_one_rank_and_a_dead_actor_ends_the_engine(ray_cluster: str, tiny_model_dir) -> None:
    folder = tiny_model_dir("qwen2")
    one = LLM(model=folder, **OPTIONS)
    want = _outputs(one)
    one.llm_engine.engine_core.shutdown()

    llm = LLM(model=folder, tensor_parallel_size=2, distributed_executor_backend="ray", **OPTIONS)
    got = _outputs(llm)
    for (want_tokens, want_lps), (got_tokens, got_lps) in zip(want, got, strict=True):
        assert got_tokens == want_tokens
        assert got_lps == pytest.approx(want_lps, abs=2e-5)

    executor = llm.llm_engine.engine_core.executor
    ray.kill(executor._actors[1])
    start = time.monotonic()
    with pytest.raises(WorkerError, match="worker rank 1"):
        for _ in range(3):  # the first step may already be on its way when the kill lands
            llm.generate([{"prompt_token_ids": PROMPTS[0]}], SamplingParams(max_tokens=4), use_tqdm=False)
    assert time.monotonic() - start < 30
    llm.llm_engine.engine_core.shutdown()


def test_axon_serve_on_the_ray_cluster(ray_cluster: str, tiny_model_dir) -> None:
    """``axon serve --distributed-executor-backend ray`` through the official client: the ranks
    are actors of the running cluster, and the text equals one rank's."""
    from tests.server.conftest import ServerProcess

    folder = tiny_model_dir("llama_full_vocab")
    texts = []
    for args in (("--tensor-parallel-size", "2", "--distributed-executor-backend", "ray"), ()):
        server = ServerProcess(folder, *args, env={"RAY_ADDRESS": ray_cluster}).wait_ready()
        try:
            reply = server.client().completions.create(
                model=folder, prompt="The capital of France is", max_tokens=12, temperature=0
            )
            texts.append(reply.choices[0].text)
            if args:
                assert "2 Ray actors ready" in server.log()
        finally:
            server.stop()
    assert texts[0] == texts[1] and texts[0]
