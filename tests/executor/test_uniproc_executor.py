"""Steps through the ``Executor`` interface with a real tiny model and the real scheduler: each
step comes back as a future (done on return without async scheduling), and both modes give the
tokens the offline engine gives."""

from __future__ import annotations

import pytest

from axon import LLM, SamplingParams
from axon.config import AxonConfig
from axon.core.kv_cache_utils import make_block_hasher
from axon.core.request import Request
from axon.core.scheduler import Scheduler
from axon.engine.arg_utils import create_engine_config
from axon.executor.abstract import Executor
from axon.executor.uniproc import UniProcExecutor

PROMPTS = [[5, 17, 42, 9, 300, 12], [7, 7, 8, 120, 33, 2, 61, 90, 14, 250, 3, 44, 18, 19, 21, 99, 5, 6]]
MAX_TOKENS = 6
OPTIONS = {
    "dtype": "float32",
    "max_model_len": 64,
    "max_num_seqs": 4,
    "block_size": 16,
    "max_num_batched_tokens": 16,
}


def _requests(config: AxonConfig) -> list[Request]:
    assert config.model_config.hf_config is not None
    vocab = config.model_config.hf_config["vocab_size"]
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    return [
        Request(
            f"r{i}",
            p,
            params.for_engine(None, vocab, default_max_tokens=MAX_TOKENS),
            eos_token_id=None,
            block_hasher=make_block_hasher(config.cache_config.block_size),
        )
        for i, p in enumerate(PROMPTS)
    ]


def _generate_through(config: AxonConfig) -> tuple[dict[str, list[int]], list[bool]]:
    """Start the executor as EngineCore does, then schedule -> execute_model -> update until done.
    Returns the tokens per request and, per step, whether its future was done on return."""
    executor = Executor.get_class(config)(config)
    assert executor.max_concurrent_batches == (2 if config.scheduler_config.async_scheduling else 1)
    num_blocks = executor.determine_num_blocks()
    executor.initialize_kv_cache(num_blocks)
    assert executor.compile_or_warm_up_model() == []  # bucket_compile=on_demand compiles nothing at start
    assert executor.model_load_time_s > 0
    max_model_len = config.model_config.max_model_len
    assert max_model_len is not None
    scheduler = Scheduler(config.scheduler_config, config.cache_config, max_model_len, num_blocks)
    for request in _requests(config):
        scheduler.add_request(request)
    tokens: dict[str, list[int]] = {f"r{i}": [] for i in range(len(PROMPTS))}
    done_on_return = []
    try:
        while scheduler.has_unfinished_requests():
            scheduler_output = scheduler.schedule()
            future = executor.execute_model(scheduler_output)
            done_on_return.append(future.done())
            runner_output = future.result(timeout=60)
            assert runner_output.bucket is not None, "the step reports the bucket it ran at"
            assert runner_output.bucket.num_tokens == scheduler_output.total_num_scheduled_tokens
            for out in scheduler.update_from_output(scheduler_output, runner_output):
                tokens[out.req_id] += out.new_token_ids
    finally:
        executor.shutdown()
    assert scheduler.kv_cache_manager.usage == 0.0
    return tokens, done_on_return


def test_steps_through_the_interface_equal_the_engine(tiny_model_dir) -> None:
    folder = tiny_model_dir("llama")
    llm = LLM(model=folder, async_scheduling=False, **OPTIONS)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    want = {f"r{i}": list(o.outputs[0].token_ids) for i, o in enumerate(outs)}
    assert all(len(t) == MAX_TOKENS for t in want.values())

    sync_config = create_engine_config(model=folder, async_scheduling=False, **OPTIONS)
    assert Executor.get_class(sync_config) is UniProcExecutor
    got, done_on_return = _generate_through(sync_config)
    assert got == want
    assert len(done_on_return) > MAX_TOKENS, "the longer prompt was prefilled over two steps"
    assert all(done_on_return), "without async scheduling a step runs inline"

    async_config = create_engine_config(model=folder, async_scheduling=True, **OPTIONS)
    got, _ = _generate_through(async_config)
    assert got == want


@pytest.mark.parametrize(
    ("options", "why"),
    [
        ({"distributed_executor_backend": "bogus"}, "is unknown; supported: uni, mp, ray, got 'bogus'"),
        (
            {"distributed_executor_backend": "uni", "tensor_parallel_size": 2},
            "runs one worker; tensor_parallel_size 2 needs 'mp' or 'ray', got 'uni'",
        ),
    ],
)
def test_bad_executor_backends_are_rejected(tiny_model_dir, options: dict, why: str) -> None:
    with pytest.raises(ValueError, match=f"distributed_executor_backend {why}"):
        create_engine_config(model=tiny_model_dir("llama"), **options)
