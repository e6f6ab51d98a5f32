"""Compiled buckets: the same greedy tokens as eager on every bucket a run uses, background
compilation that switches buckets over mid-run, the disk cache hit on a second start, and a
second host starting warm from a shared store."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from axon import LLM, SamplingParams

# Two graphs: 4 decode rows, 32 prefill/mixed tokens.
BUCKETS = {
    "max_num_seqs": 4,
    "num_seqs_buckets": [4],
    "max_num_batched_tokens": 32,
    "num_batched_tokens_buckets": [32],
}
PROMPTS = [
    {"prompt_token_ids": [(7 * i + 3 * j) % 500 for j in range(n)]} for i, n in enumerate((5, 30, 11, 2))
]
PARAMS = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)


def _worker(llm: LLM):
    return llm.llm_engine.engine_core.executor.worker


def _tokens(llm: LLM) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, PARAMS, use_tqdm=False)]


def _assert_reports_compiles_once(llm: LLM, names: list[str]) -> None:
    """The compile events reach the stats the metrics read (axon:compilation_time_seconds), once."""
    core = llm.llm_engine.engine_core
    assert sorted(c.name for c in core.make_stats().compiles) == names
    assert core.make_stats().compiles == []


@pytest.fixture(scope="module")
def eager_tokens(tiny_model_dir) -> list[list[int]]:
    llm = LLM(
        model=tiny_model_dir("llama"), dtype="float32", max_model_len=128, enforce_eager=True, **BUCKETS
    )
    return _tokens(llm)


def test_compiled_equals_eager_on_every_bucket(tiny_model_dir, tmp_path, eager_tokens) -> None:
    llm = LLM(
        model=tiny_model_dir("llama"),
        dtype="float32",
        max_model_len=128,
        enforce_eager=False,
        bucket_compile="warmup",
        cache_root=str(tmp_path),
        **BUCKETS,
    )
    compiler = _worker(llm).compiler
    assert sorted(compiler.stats.records) == [4, 32] and not compiler.stats.failures
    # Every ready bucket runs its own rewritten bytecode (no Dynamo lookup or guards per step).
    assert sorted(compiler._direct) == [4, 32]
    _assert_reports_compiles_once(llm, ["tokens_32", "tokens_4"])
    assert _tokens(llm) == eager_tokens
    assert compiler.stats.graph_steps >= 10  # every step: one prefill step, then decodes


def test_on_demand_compiles_what_traffic_reached_when_idle(tiny_model_dir, tmp_path, eager_tokens) -> None:
    llm = LLM(
        model=tiny_model_dir("llama"),
        dtype="float32",
        max_model_len=128,
        enforce_eager=False,
        cache_root=str(tmp_path),
        **BUCKETS,
    )
    compiler = _worker(llm).compiler
    assert compiler.stats.records == {}  # nothing compiled before traffic
    assert _tokens(llm) == eager_tokens  # eager: the buckets are not compiled yet
    assert compiler.stats.records == {} and compiler.stats.graph_steps == 0
    # Idle now: the two buckets the first call reached compile (the next call would do it).
    assert llm.llm_engine.engine_core.compile_pending()
    _assert_reports_compiles_once(llm, ["tokens_32", "tokens_4"])
    assert _tokens(llm) == eager_tokens
    assert sorted(compiler.stats.records) == [4, 32] and not compiler.stats.failures
    assert compiler.stats.graph_steps >= 10


def _graph_modules(root) -> list[str]:
    """The Python modules Inductor wrote for the graphs under cache root ``root``."""
    return [p.read_text() for p in (root / "compile").rglob("*.py")]


def test_inductor_options_reach_the_graphs(tiny_model_dir, tmp_path) -> None:
    """By default (CPU) each bucket's graph calls its kernels from C++ (cpp_wrapper) and checks
    no input's size and strides; ``inductor_compile_config`` turns either back. The tokens and
    logprobs are the same bits whichever wrapper calls the kernels, and as eager (bf16)."""
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=3)

    def run(root: str, **options) -> list:
        llm = LLM(model=tiny_model_dir("llama"), dtype="bfloat16", max_model_len=128, cache_root=root,
                  **BUCKETS, **options)  # fmt: skip
        outs = llm.generate(PROMPTS, params, use_tqdm=False)
        if not options.get("enforce_eager"):
            assert sorted(_worker(llm).compiler.stats.records) == [4, 32]
            assert not _worker(llm).compiler.stats.failures
        return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs]

    eager = run(str(tmp_path / "eager"), enforce_eager=True)
    default = run(str(tmp_path / "default"), enforce_eager=False, bucket_compile="warmup")
    python = run(
        str(tmp_path / "python"),
        enforce_eager=False,
        bucket_compile="warmup",
        inductor_compile_config={"cpp_wrapper": False, "size_asserts": True},
    )
    assert default == eager and python == eager
    cpp_modules = _graph_modules(tmp_path / "default")
    assert cpp_modules and all("CppWrapperCodeCache" in m for m in cpp_modules)
    assert not any("assert_size_stride(" in m for m in cpp_modules)
    python_modules = _graph_modules(tmp_path / "python")
    assert python_modules and not any("CppWrapperCodeCache" in m for m in python_modules)
    assert all("assert_size_stride(" in m for m in python_modules)


_START = textwrap.dedent(
    """
    import json, sys
    from axon import LLM
    llm = LLM(model=sys.argv[1], dtype="float32", max_model_len=128, enforce_eager=False,
              bucket_compile="warmup", cache_root=sys.argv[2], **json.loads(sys.argv[3]))
    stats = llm.llm_engine.engine_core.executor.worker.compiler.stats
    print(json.dumps({"graphs": len(stats.records), "hits": stats.num_cache_hits}))
    """
)


def _share_kernels(root, kernel_cache_root: str) -> None:
    """The C++ kernels are not what these tests are about: a fresh cache root reuses the suite's
    build instead of building them again (a minute on 2 cores)."""
    root.mkdir(exist_ok=True)
    (root / "kernels").symlink_to(os.path.join(kernel_cache_root, "kernels"))


def test_second_start_hits_the_compile_cache(tiny_model_dir, tmp_path, kernel_cache_root) -> None:
    _share_kernels(tmp_path, kernel_cache_root)

    def start() -> dict:
        env = {**os.environ, "AXON_ENFORCE_EAGER": "0"}
        args = [sys.executable, "-c", _START, tiny_model_dir("llama"), str(tmp_path), json.dumps(BUCKETS)]
        out = subprocess.run(args, capture_output=True, text=True, timeout=900, env=env, check=True)
        return json.loads(out.stdout.strip().splitlines()[-1])

    assert start() == {"graphs": 2, "hits": 0}
    assert start() == {"graphs": 2, "hits": 2}


def test_a_new_host_starts_warm_from_the_shared_store(tiny_model_dir, tmp_path, kernel_cache_root) -> None:
    """Two hosts (two cache roots) and one shared store: the first compiles and publishes, the
    second, whose own cache is empty, loads every graph from what it fetched."""
    store = tmp_path / "store"

    def start(host: str) -> dict:
        root = tmp_path / host
        _share_kernels(root, kernel_cache_root)
        env = {**os.environ, "AXON_ENFORCE_EAGER": "0"}
        options = json.dumps({**BUCKETS, "compile_cache_store": str(store)})
        args = [sys.executable, "-c", _START, tiny_model_dir("llama"), str(root), options]
        out = subprocess.run(args, capture_output=True, text=True, timeout=900, env=env, check=True)
        return json.loads(out.stdout.strip().splitlines()[-1])

    assert start("host-a") == {"graphs": 2, "hits": 0}
    assert any(store.iterdir())
    assert start("host-b") == {"graphs": 2, "hits": 2}


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_moe_model_compiles_with_its_experts_as_one_op(tiny_model_dir, tmp_path, dtype: str) -> None:
    """Qwen3-MoE's sparse blocks (the fused op in bf16 where it runs, the loop over experts
    otherwise) inside every bucket's graph: the same greedy tokens as eager."""
    folder = tiny_model_dir("qwen3_moe")
    eager = LLM(model=folder, dtype=dtype, max_model_len=128, enforce_eager=True, **BUCKETS)
    compiled = LLM(
        model=folder,
        dtype=dtype,
        max_model_len=128,
        enforce_eager=False,
        bucket_compile="warmup",
        cache_root=str(tmp_path),
        **BUCKETS,
    )
    compiler = _worker(compiled).compiler
    assert sorted(compiler.stats.records) == [4, 32] and not compiler.stats.failures
    assert _tokens(compiled) == _tokens(eager)
    assert compiler.stats.graph_steps >= 10
