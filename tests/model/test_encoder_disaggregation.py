"""Encoder disaggregation offline (``--mm-encoder-only``, ``--ec-transfer-config``), on the tiny
random Qwen3-VL: the EC connector's files by their invariants (what is saved loads back bit for
bit, a missing or wrong file is a miss), an encoder-only engine that stores what the whole
model's vision tower computes and generates nothing, a consumer that loads the stored features
instead of running its tower and answers what a plain engine answers, and one that encodes
itself when the store has nothing (or garbage)."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from axon import LLM, SamplingParams
from axon.kv_transfer.ec_connector import (
    ECSharedStorageConnector,
    ECTransferSettings,
    parse_ec_transfer_config,
)

PROMPT = (
    "Look:<|vision_start|><|image_pad|><|vision_end|> and<|vision_start|><|image_pad|><|vision_end|> tell."
)
PARAMS = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


def _image(h: int, w: int, seed: int) -> Image.Image:
    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8))


PROMPTS = [
    {"prompt": PROMPT, "multi_modal_data": {"image": [_image(64, 96, 1), _image(96, 64, 2)]}},
    {"prompt": PROMPT, "multi_modal_data": {"image": [_image(96, 64, 2), _image(80, 80, 3)]}},
]
NUM_DISTINCT_IMAGES = 3


def _ec(role: str, path: Path) -> dict:
    return {
        "ec_connector": "ECExampleConnector",
        "ec_role": role,
        "ec_connector_extra_config": {"shared_storage_path": str(path)},
    }


def _llm(qwen3_vl_dir: str, **kwargs) -> LLM:
    return LLM(model=qwen3_vl_dir, dtype="float32", max_model_len=256, enable_prefix_caching=False, **kwargs)


def _tower_calls(llm: LLM) -> list[int]:
    """A list that grows by the number of images of each call of the engine's vision tower."""
    core = llm.llm_engine.engine_core
    tower = core.tower if hasattr(core, "tower") else core.executor.worker.model.visual
    calls: list[int] = []
    tower.register_forward_pre_hook(lambda module, args: calls.append(len(args[1])))
    return calls


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        ("x", "must be a JSON object"),
        (
            {"ec_connector": "Nope", "ec_role": "ec_producer"},
            "ec_connector must be one of ECExampleConnector",
        ),
        ({"ec_connector": "ECExampleConnector", "ec_role": "kv_producer"}, "ec_role must be one of"),
        ({"ec_connector": "ECExampleConnector", "ec_role": "ec_both", "ec_rol": 1}, "did you mean 'ec_role'"),
        (
            {"ec_connector": "ECExampleConnector", "ec_role": "ec_both", "ec_connector_extra_config": []},
            "must be a JSON object",
        ),
        (
            {
                "ec_connector": "ECExampleConnector",
                "ec_role": "ec_both",
                "ec_connector_extra_config": {"ttl_seconds": 0},
            },
            "ttl_seconds must be a number above 0",
        ),
    ],
)
def test_bad_ec_transfer_configs_are_named(raw, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_ec_transfer_config(raw)


def test_features_load_back_bit_for_bit_and_a_bad_file_is_a_miss(tmp_path: Path) -> None:
    ec = ECSharedStorageConnector(
        ECTransferSettings("ECExampleConnector", "ec_both", {"shared_storage_path": str(tmp_path)})
    )
    embeds = torch.randn(6, 8, dtype=torch.bfloat16)
    deepstack = [torch.randn(6, 8, dtype=torch.bfloat16) for _ in range(2)]
    assert ec.load("ab12", 6, 8, 2, torch.device("cpu"), torch.bfloat16) is None  # nothing stored
    ec.save("ab12", embeds, deepstack)
    assert os.listdir(tmp_path) == ["ab12.ec"]  # no temporary file left behind
    got, got_deepstack = ec.load("ab12", 6, 8, 2, torch.device("cpu"), torch.bfloat16)
    assert torch.equal(got, embeds) and all(
        torch.equal(a, b) for a, b in zip(got_deepstack, deepstack, strict=True)
    )
    # Another shape than the image's (a different model's features) or a broken file: a miss.
    assert ec.load("ab12", 7, 8, 2, torch.device("cpu"), torch.bfloat16) is None
    assert ec.load("ab12", 6, 8, 3, torch.device("cpu"), torch.bfloat16) is None
    (tmp_path / "cd34.ec").write_bytes(b"not safetensors")
    assert ec.load("cd34", 6, 8, 2, torch.device("cpu"), torch.bfloat16) is None
    assert ec.num_load_failures == 3
    with pytest.raises(ValueError, match="hexadecimal"):
        ec.path_for("../x")


def test_an_encoder_server_stores_what_the_model_computes_and_a_consumer_loads_it(
    qwen3_vl_dir: str, tmp_path: Path
) -> None:
    plain = _llm(qwen3_vl_dir)
    expected = [o.outputs[0].token_ids for o in plain.generate(PROMPTS, PARAMS, use_tqdm=False)]

    encoder = _llm(qwen3_vl_dir, mm_encoder_only=True, ec_transfer_config=_ec("ec_producer", tmp_path))
    encoder_calls = _tower_calls(encoder)
    answers = encoder.generate(PROMPTS, PARAMS, use_tqdm=False)
    assert all(a.outputs[0].token_ids == [] and a.outputs[0].finish_reason == "length" for a in answers)
    assert encoder_calls == [NUM_DISTINCT_IMAGES]  # every distinct image, in one packed call
    assert len(list(tmp_path.glob("*.ec"))) == NUM_DISTINCT_IMAGES
    # The stored features are the whole model's tower's, image by image.
    worker_model = plain.llm_engine.engine_core.executor.worker.model
    for prompt in PROMPTS:
        images = plain.llm_engine.input_processor.tokenize_multimodal(prompt)[2]
        for image in images:
            pixels = torch.frombuffer(bytearray(image.pixel_values), dtype=torch.float32).view(
                -1, image.patch_dim
            )
            out = worker_model.encode_images(pixels, [tuple(image.grid_thw)])
            stored = encoder.llm_engine.engine_core.connector.load(
                image.digest,
                image.num_tokens,
                out.embeds.shape[1],
                len(out.deepstack),
                torch.device("cpu"),
                torch.float32,
            )
            torch.testing.assert_close(stored[0], out.embeds, rtol=1e-5, atol=1e-5)
            for got, want in zip(stored[1], out.deepstack, strict=True):
                torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)

    consumer = _llm(qwen3_vl_dir, ec_transfer_config=_ec("ec_consumer", tmp_path))
    consumer_calls = _tower_calls(consumer)
    got = [o.outputs[0].token_ids for o in consumer.generate(PROMPTS, PARAMS, use_tqdm=False)]
    assert got == expected
    assert consumer_calls == []  # every image loaded, none encoded
    assert (
        consumer.llm_engine.engine_core.executor.worker.runner.ec_connector.num_loaded == NUM_DISTINCT_IMAGES
    )


def test_a_consumer_uses_the_stored_features(qwen3_vl_dir: str, tmp_path: Path) -> None:
    """Features changed in the store change the answer: the consumer reads them, not its tower."""
    encoder = _llm(qwen3_vl_dir, mm_encoder_only=True, ec_transfer_config=_ec("ec_producer", tmp_path))
    encoder.generate(PROMPTS[:1], PARAMS, use_tqdm=False)
    plain = _llm(qwen3_vl_dir).generate(PROMPTS[:1], PARAMS, use_tqdm=False)[0].outputs[0].token_ids
    from safetensors.torch import load_file, save_file

    for path in tmp_path.glob("*.ec"):
        tensors = load_file(path)
        save_file({k: torch.randn_like(v) * 10 for k, v in tensors.items()}, path)
    consumer = _llm(qwen3_vl_dir, ec_transfer_config=_ec("ec_consumer", tmp_path))
    assert consumer.generate(PROMPTS[:1], PARAMS, use_tqdm=False)[0].outputs[0].token_ids != plain


def test_a_consumer_encodes_what_the_store_lacks_or_cannot_give(qwen3_vl_dir: str, tmp_path: Path) -> None:
    expected = [o.outputs[0].token_ids for o in _llm(qwen3_vl_dir).generate(PROMPTS, PARAMS, use_tqdm=False)]
    (tmp_path / "0123abcd.ec").write_bytes(b"junk")  # an unrelated broken file
    consumer = _llm(qwen3_vl_dir, ec_transfer_config=_ec("ec_consumer", tmp_path))
    calls = _tower_calls(consumer)
    got = [o.outputs[0].token_ids for o in consumer.generate(PROMPTS, PARAMS, use_tqdm=False)]
    assert got == expected
    assert calls == [NUM_DISTINCT_IMAGES]
    assert list(tmp_path.glob("*.ec")) == [tmp_path / "0123abcd.ec"]  # a consumer stores nothing


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"mm_encoder_only": True}, "give --ec-transfer-config"),
        ({"mm_encoder_only": True, "ec_transfer_config": "consumer"}, 'ec_role": "ec_producer"'),
    ],
)
def test_an_encoder_server_needs_a_producer_role(
    qwen3_vl_dir: str, tmp_path: Path, kwargs, message: str
) -> None:
    if kwargs.get("ec_transfer_config") == "consumer":
        kwargs = dict(kwargs, ec_transfer_config=_ec("ec_consumer", tmp_path))
    with pytest.raises(ValueError, match=message):
        _llm(qwen3_vl_dir, **kwargs)


def test_encoder_disaggregation_needs_a_vision_model(smollm2_path: str, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="is for multimodal models: LlamaForCausalLM has no vision encoder"):
        LLM(model=smollm2_path, mm_encoder_only=True, ec_transfer_config=_ec("ec_producer", tmp_path))
    with pytest.raises(ValueError, match="--ec-transfer-config is for multimodal models"):
        LLM(model=smollm2_path, ec_transfer_config=_ec("ec_consumer", tmp_path))
