"""The config tree: routing of flat vLLM names, validation, immutability, CLI flags."""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import pytest

from axon.config import OPTION_OWNERS, build_config
from axon.entrypoints.cli import build_parser, engine_kwargs


def test_flat_options_land_in_their_sub_config() -> None:
    config = build_config(
        max_model_len=1024,
        max_num_seqs=8,
        block_size=32,
        enable_prefix_caching=False,
        num_gpu_blocks_override=100,
        seed=3,
        enforce_eager=True,
        additional_config='{"neuron_config": {"num_seqs_buckets": [1, 8]}}',
    )
    assert config.model_config.max_model_len == 1024 and config.model_config.seed == 3
    assert config.scheduler_config.max_num_seqs == 8
    assert config.cache_config.block_size == 32 and not config.cache_config.enable_prefix_caching
    assert config.cache_config.num_gpu_blocks_override == 100
    assert config.compilation_config.enforce_eager
    assert config.additional_config == {"neuron_config": {"num_seqs_buckets": [1, 8]}}


def test_config_is_frozen() -> None:
    config = build_config()
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.cache_config.block_size = 8  # type: ignore[misc]


def test_every_option_has_one_owner_and_a_flag() -> None:
    parser = build_parser()
    args = parser.parse_args(
        [
            "generate",
            "hi",
            "--max-num-batched-tokens",
            "512",
            "--no-enable-prefix-caching",
            "--kv-cache-space-gib",
            "0.5",
        ]
    )
    kwargs = engine_kwargs(args)
    assert kwargs == {
        "max_num_batched_tokens": 512,
        "enable_prefix_caching": False,
        "kv_cache_space_gib": 0.5,
    }
    assert build_config(**kwargs).scheduler_config.max_num_batched_tokens == 512
    assert {"model", "dtype", "max_model_len", "max_num_seqs", "block_size", "seed"} <= set(OPTION_OWNERS)


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"max_num_seqs": 0}, "max_num_seqs"),
        ({"gpu_memory_utilization": 1.5}, "gpu_memory_utilization"),
        ({"load_format": "pickle"}, "load_format"),
        ({"tensor_parallel_size": 0}, "tensor_parallel_size must be an integer of at least 1"),
        ({"data_parallel_size": 2, "data_parallel_rank": 2}, "data_parallel_rank must be in 0..1"),
        ({"speculative_config": "{not json"}, "speculative_config"),
        (
            {"quantization": "nonsense"},
            "quantization must be one of int8, int4, fp8, w8a8, gguf .* got 'nonsense'",
        ),
        ({"quantization": "int4", "quantization_group_size": 24}, "quantization_group_size .* got 24"),
        ({"quantization": "fp8", "quantization_group_size": 32}, "quantization_group_size applies only"),
        (
            {"kv_cache_dtype": "int8"},
            "kv_cache_dtype must be one of auto, fp8, fp8_e4m3, fp8_e5m2, got 'int8'",
        ),
        ({"calculate_kv_scales": True}, "calculate_kv_scales applies only to an FP8 KV cache"),
        (
            {"inductor_compile_config": '{"size_assert": false}'},
            "inductor_compile_config has an option Inductor does not know: 'size_assert'; did you mean 'size_asserts'",
        ),
        ({"inductor_compile_config": "[1]"}, "inductor_compile_config must be a JSON object"),
    ],
)
def test_invalid_values_are_named(kwargs: dict, name: str) -> None:
    with pytest.raises(ValueError, match=name):
        build_config(**kwargs)


def test_cpu_kv_space_from_vllm_variable(monkeypatch: pytest.MonkeyPatch, smollm2_path: str) -> None:
    from axon.engine.arg_utils import create_engine_config

    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "2")
    assert create_engine_config(model=smollm2_path).cache_config.kv_cache_space_gib == 2.0
    assert create_engine_config(model=smollm2_path, kv_cache_space_gib=1).cache_config.kv_cache_space_gib == 1


def test_quantization_gguf_needs_a_gguf_file(tmp_path, smollm2_path: str) -> None:
    from axon.engine.arg_utils import create_engine_config

    assert create_engine_config(quantization="gguf").model_config.gguf_file is not None  # the bundled model
    with pytest.raises(ValueError, match="quantization 'gguf' needs a .gguf model file"):
        create_engine_config(model=smollm2_path, quantization="gguf")


def test_a_checkpoint_quantized_in_another_format_is_refused_by_name(tmp_path, smollm2_path: str) -> None:
    import json
    import shutil

    from axon.engine.arg_utils import create_engine_config

    folder = tmp_path / "gptq"
    shutil.copytree(smollm2_path, folder)
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "gptq", "bits": 4}
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="quantized as 'gptq'.*which axon does not read"):
        create_engine_config(model=str(folder))


def test_serve_names_a_bad_speculative_config_field() -> None:
    """A speculative config missing k fails at start-up naming the field, before loading a model."""
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "axon.entrypoints.cli",
            "serve",
            "--speculative-config",
            '{"method": "ngram"}',
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "axon serve: error: speculative_config.num_speculative_tokens" in proc.stderr
    assert "Traceback" not in proc.stderr
