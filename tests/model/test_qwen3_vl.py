"""Qwen3-VL against transformers (float32) on a tiny random model: the image processor, M-RoPE
positions, the vision tower, teacher-forced logits with zero, one and two images (whole and in
prefill segments), greedy generation through ``LLM.generate`` with images (chunked prefills,
eager and compiled), prefix caching keyed by the image, and bad input."""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch
import transformers as tf
from PIL import Image
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

from axon import LLM, SamplingParams
from axon.model.models.llama import EmbedRows
from axon.model.models.qwen3_vl import mrope_positions
from axon.multimodal.image import ImageProcessorConfig, process_image
from axon.worker.logit_validation import teacher_forced_logits

PIXELS = {"shortest_edge": 64 * 64, "longest_edge": 128 * 128}  # the fixture's preprocessor_config
TWO_IMAGES = (
    "Look:<|vision_start|><|image_pad|><|vision_end|> and<|vision_start|><|image_pad|><|vision_end|> tell."
)


def _image(h: int, w: int, seed: int, mode: str = "RGB") -> Image.Image:
    rng = np.random.default_rng(seed)
    channels = {"RGB": 3, "RGBA": 4, "L": 1}[mode]
    array = rng.integers(0, 256, (h, w, channels), dtype=np.uint8)
    return Image.fromarray(array[..., 0] if mode == "L" else array, mode)


def _hf_processor(**size) -> Qwen2VLImageProcessorPil:
    return Qwen2VLImageProcessorPil(
        patch_size=16, temporal_patch_size=2, merge_size=2, image_mean=[0.5] * 3, image_std=[0.5] * 3,
        size=size or {"shortest_edge": 65536, "longest_edge": 16777216},
    )  # fmt: skip


@pytest.mark.parametrize(("h", "w", "mode"), [(448, 448, "RGB"), (300, 517, "RGB"), (1000, 30, "RGB"),
                                               (64, 64, "RGBA"), (90, 70, "L")])  # fmt: skip
def test_images_become_the_patches_transformers_makes(h: int, w: int, mode: str) -> None:
    image = _image(h, w, seed=h + w, mode=mode)
    expected = _hf_processor()(images=[image], return_tensors="np")
    got = process_image(image, ImageProcessorConfig())
    assert got.grid_thw == tuple(expected["image_grid_thw"][0])
    np.testing.assert_array_equal(got.pixel_values, expected["pixel_values"])


@pytest.fixture(scope="module")
def hf_model(qwen3_vl_dir: str):
    return tf.Qwen3VLForConditionalGeneration.from_pretrained(qwen3_vl_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def tokenizer(qwen3_vl_dir: str):
    return tf.AutoTokenizer.from_pretrained(qwen3_vl_dir)


@pytest.fixture(scope="module")
def llm(qwen3_vl_dir: str) -> LLM:
    return LLM(
        model=qwen3_vl_dir, dtype="float32", max_model_len=256, block_size=4, max_num_batched_tokens=16
    )


IMAGES = [_image(64, 96, 1), _image(96, 64, 2)]


def _expanded(tokenizer, text: str, images: list[Image.Image]) -> tuple[list[int], dict]:
    """transformers' inputs: the prompt with each placeholder expanded to its image's tokens,
    the pixel values, grids and token types."""
    pad = tokenizer.convert_tokens_to_ids("<|image_pad|>")
    mm: dict = {}
    counts: list[int] = []
    if images:
        processed = _hf_processor(**PIXELS)(images=images, return_tensors="pt")
        mm = {"pixel_values": processed["pixel_values"], "image_grid_thw": processed["image_grid_thw"]}
        counts = [t * h * w // 4 for t, h, w in processed["image_grid_thw"].tolist()]
    prompt: list[int] = []
    for t in tokenizer(text)["input_ids"]:
        prompt += [pad] * counts.pop(0) if t == pad else [t]
    mm["mm_token_type_ids"] = torch.tensor([[1 if t == pad else 0 for t in prompt]])
    return prompt, mm


@pytest.mark.parametrize("num_images", [0, 1, 2])
def test_logits_with_zero_one_and_two_images_are_transformers(
    hf_model, tokenizer, llm, num_images: int
) -> None:
    text = {0: "A text-only prompt of a few words.", 1: "See:<|vision_start|><|image_pad|><|vision_end|> ok.",
            2: TWO_IMAGES}[num_images]  # fmt: skip
    images = IMAGES[:num_images]
    prompt, mm = _expanded(tokenizer, text, images)
    with torch.no_grad():
        expected = hf_model(input_ids=torch.tensor([prompt]), **mm).logits[0]
    model = llm.llm_engine.engine_core.executor.worker.model
    positions, extra = None, None
    if images:
        grids = [tuple(g) for g in mm["image_grid_thw"].tolist()]
        positions, delta = mrope_positions(prompt, grids, model.image_token_id, model.merge)
        hf_positions, hf_delta = hf_model.model.get_rope_index(
            torch.tensor([prompt]), mm["mm_token_type_ids"], image_grid_thw=mm["image_grid_thw"]
        )
        assert torch.equal(positions, hf_positions[:, 0]) and delta == int(hf_delta)
        with torch.no_grad():
            vision = model.encode_images(mm["pixel_values"], grids)
            hf_vision = hf_model.model.visual(mm["pixel_values"], grid_thw=mm["image_grid_thw"])
        torch.testing.assert_close(vision.embeds, hf_vision.pooler_output, atol=1e-5, rtol=1e-5)
        for ours, theirs in zip(vision.deepstack, hf_vision.deepstack_features, strict=True):
            torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=1e-5)
        rows = torch.tensor([i for i, t in enumerate(prompt) if t == model.image_token_id])

        def extra(start: int, end: int) -> dict:
            pick = ((rows >= start) & (rows < end)).nonzero().squeeze(1)
            if pick.numel() == 0:
                return {}
            deep = [d[pick] for d in vision.deepstack]
            return {"embeds": EmbedRows(rows[pick] - start, vision.embeds[pick], deep)}

    for segment in (None, 7):
        got = teacher_forced_logits(
            model, prompt, block_size=4, segment=segment, positions=positions, extra=extra
        )
        torch.testing.assert_close(got, expected, atol=5e-5, rtol=5e-5)


@pytest.mark.parametrize("enforce_eager", [True, False])
def test_generate_with_images_equals_transformers_greedy(
    qwen3_vl_dir: str, hf_model, tokenizer, enforce_eager: bool
) -> None:
    """Two images in 16-token chunks (a chunk ends inside an image), batched with a text prompt;
    the output's prompt_token_ids are the expanded prompt."""
    llm = LLM(model=qwen3_vl_dir, dtype="float32", max_model_len=256, block_size=4,
              max_num_batched_tokens=16, enforce_eager=enforce_eager)  # fmt: skip
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    outs = llm.generate(
        [{"prompt": TWO_IMAGES, "multi_modal_data": {"image": IMAGES}}, {"prompt": "Just text here."}], params,
        use_tqdm=False,
    )  # fmt: skip
    prompt, mm = _expanded(tokenizer, TWO_IMAGES, IMAGES)
    assert outs[0].prompt_token_ids == prompt
    with torch.no_grad():
        ids = torch.tensor([prompt])
        expected = hf_model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), **mm,
                                     max_new_tokens=10, do_sample=False)[0, len(prompt):]  # fmt: skip
    assert outs[0].outputs[0].token_ids == expected.tolist()
    text_ids = torch.tensor([tokenizer("Just text here.")["input_ids"]])
    with torch.no_grad():
        text_expected = hf_model.generate(input_ids=text_ids, attention_mask=torch.ones_like(text_ids),
                                          max_new_tokens=10, do_sample=False)[0, text_ids.shape[1]:]  # fmt: skip
    assert outs[1].outputs[0].token_ids == text_expected.tolist()


def test_the_same_image_hits_the_prefix_cache_and_another_does_not(llm: LLM) -> None:
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    text = "About this:<|vision_start|><|image_pad|><|vision_end|> it is."

    def run(image: Image.Image):
        return llm.generate([{"prompt": text, "multi_modal_data": {"image": image}}], params, use_tqdm=False)[
            0
        ]

    first = run(IMAGES[0])
    again = run(IMAGES[0].copy())
    other = run(IMAGES[1].rotate(90, expand=True))  # the same grid, other pixels
    assert again.num_cached_tokens > 0 and again.outputs[0].token_ids == first.outputs[0].token_ids
    assert other.num_cached_tokens == 0


def test_bad_images_are_errors_that_name_the_problem(llm: LLM, qwen3_vl_dir: str) -> None:
    params = SamplingParams(max_tokens=2)
    one = "See:<|vision_start|><|image_pad|><|vision_end|>"
    cases = [
        (
            {"prompt": one, "multi_modal_data": {"image": IMAGES}},
            "1 image placeholder tokens .* for 2 images",
        ),
        ({"prompt": "no placeholder", "multi_modal_data": {"image": IMAGES[0]}}, "0 image placeholder"),
        ({"prompt": one, "multi_modal_data": {"image": b"not an image"}}, "cannot be decoded"),
        ({"prompt": one, "multi_modal_data": {"image": "data:image/png;base64,@@@"}}, "does not decode"),
        ({"prompt": one, "multi_modal_data": {"video": IMAGES[0]}}, "'video'.* not supported"),
    ]
    for prompt, message in cases:
        with pytest.raises(ValueError, match=message):
            llm.generate([prompt], params, use_tqdm=False)
    limited = LLM(model=qwen3_vl_dir, dtype="float32", max_model_len=256, limit_mm_per_prompt={"image": 1})
    with pytest.raises(ValueError, match="2 images, more than the 1 allowed"):
        limited.generate(
            [{"prompt": TWO_IMAGES, "multi_modal_data": {"image": IMAGES}}], params, use_tqdm=False
        )
    buffer = io.BytesIO()
    IMAGES[0].save(buffer, format="PNG")
    out = llm.generate(
        [{"prompt": one, "multi_modal_data": {"image": buffer.getvalue()}}], params, use_tqdm=False
    )
    assert len(out[0].outputs[0].token_ids) == 2  # PNG bytes are an image


def test_a_text_only_model_refuses_images(tiny_model_dir) -> None:
    llm = LLM(model=tiny_model_dir("llama"), dtype="float32", max_model_len=64)
    with pytest.raises(ValueError, match="takes no images"):
        llm.generate(
            [{"prompt_token_ids": [1, 2, 3], "multi_modal_data": {"image": IMAGES[0]}}], use_tqdm=False
        )


def test_an_image_that_returns_is_not_encoded_again_and_changes_nothing(qwen3_vl_dir: str) -> None:
    """The encoder cache: the second request with the same image (other text, so no prefix-cache
    hit) takes the image's features from the cache and answers what a fresh engine answers."""
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    second = {
        "prompt": "Again <|vision_start|><|image_pad|><|vision_end|>?",
        "multi_modal_data": {"image": IMAGES[0]},
    }
    llm = LLM(model=qwen3_vl_dir, dtype="float32", max_model_len=256, block_size=4)
    cache = llm.llm_engine.engine_core.executor.worker.runner.encoder_cache
    first = {
        "prompt": "See <|vision_start|><|image_pad|><|vision_end|>.",
        "multi_modal_data": {"image": IMAGES[0]},
    }
    llm.generate([first], params, use_tqdm=False)
    assert (cache.hits, cache.misses) == (0, 1)
    cached = llm.generate([second], params, use_tqdm=False)[0]
    assert (cache.hits, cache.misses) == (1, 1) and cached.num_cached_tokens == 0
    fresh = LLM(model=qwen3_vl_dir, dtype="float32", max_model_len=256, block_size=4)
    assert (
        cached.outputs[0].token_ids
        == fresh.generate([second], params, use_tqdm=False)[0].outputs[0].token_ids
    )


def test_the_encoder_cache_evicts_the_least_recently_used_past_its_budget() -> None:
    from axon.worker.multimodal import EncoderCache

    cache = EncoderCache(max_tokens=10)
    for name, n in (("a", 4), ("b", 4)):
        cache.put(name, torch.zeros(n, 2), [])
    assert cache.get("a") is not None  # a is now the most recent
    cache.put("c", torch.zeros(4, 2), [])  # 12 tokens: b goes
    assert cache.get("b") is None and cache.get("a") is not None and cache.num_tokens == 8
    cache.put("huge", torch.zeros(11, 2), [])  # larger than the whole budget: not kept
    assert cache.get("huge") is None and cache.num_tokens == 8


def test_a_steps_new_images_are_encoded_in_one_call(qwen3_vl_dir: str) -> None:
    """Three requests arriving together (four images of two sizes): one vision-tower call, its
    attention packed over the images, and each request answers what it answers alone."""
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    one = "See <|vision_start|><|image_pad|><|vision_end|>."
    prompts = [
        {"prompt": TWO_IMAGES, "multi_modal_data": {"image": IMAGES}},
        {"prompt": one, "multi_modal_data": {"image": _image(128, 64, 7)}},
        {"prompt": one, "multi_modal_data": {"image": _image(64, 64, 8)}},
    ]
    llm = LLM(
        model=qwen3_vl_dir, dtype="float32", max_model_len=256, block_size=4, enable_prefix_caching=False
    )
    model = llm.llm_engine.engine_core.executor.worker.model
    calls = []
    model.visual.register_forward_pre_hook(lambda tower, args: calls.append(len(args[1])))
    together = llm.generate(prompts, params, use_tqdm=False)
    assert calls == [4]
    alone = LLM(
        model=qwen3_vl_dir, dtype="float32", max_model_len=256, block_size=4, enable_prefix_caching=False
    )
    for prompt, out in zip(prompts, together, strict=True):
        assert (
            out.outputs[0].token_ids
            == alone.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids
        )
