"""Encoder disaggregation (1E1PD) through real processes and the official ``openai`` client: an
encoder server (``axon serve --mm-encoder-only``, ec_producer), a prefill/decode server
(ec_consumer) and ``axon router --encode ... --replica ...``. A chat with images through the
router answers what a plain ``LLM.chat`` answers, the encoder has stored each image's features,
a bad image is the encoder's 400 and everything goes on serving, and with the encoder server
gone the prefill/decode server encodes the images itself."""

from __future__ import annotations

import io
import json
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
from PIL import Image

from axon import LLM, SamplingParams
from tests.router.test_router import RouterProcess
from tests.server.conftest import ServerProcess
from tests.server.test_qwen3_vl_server import PNGS, _data_url, _messages, _png

ARGS = ("--dtype", "float32", "--max-model-len", "256")


def _ec(role: str, path: Path) -> str:
    extra = {"shared_storage_path": str(path)}
    return json.dumps(
        {"ec_connector": "ECExampleConnector", "ec_role": role, "ec_connector_extra_config": extra}
    )


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("ec-store")


@pytest.fixture(scope="module")
def epd(qwen3_vl_dir: str, store: Path) -> Iterator[tuple[RouterProcess, ServerProcess, ServerProcess]]:
    encoder = ServerProcess(
        "--model", qwen3_vl_dir, *ARGS, "--mm-encoder-only", "--ec-transfer-config", _ec("ec_producer", store)
    )  # fmt: skip
    pd = ServerProcess("--model", qwen3_vl_dir, *ARGS, "--ec-transfer-config", _ec("ec_consumer", store))
    router = None
    try:
        encoder.wait_ready()
        pd.wait_ready()
        router = RouterProcess("--encode", encoder.url, "--replica", pd.url)
        yield router.wait_ready(), encoder, pd
    finally:
        for proc in (router, pd, encoder):
            if proc is not None:
                proc.stop()


@pytest.fixture(scope="module")
def offline(qwen3_vl_dir: str) -> LLM:
    return LLM(model=qwen3_vl_dir, dtype="float32", max_model_len=256)


def _offline_answer(llm: LLM, pngs: list[bytes], max_tokens: int) -> str:
    messages = _messages()
    messages[0]["content"] += [{"type": "image", "image": Image.open(io.BytesIO(p))} for p in pngs]
    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    return llm.chat(messages, params, use_tqdm=False)[0].outputs[0].text


def test_a_chat_through_the_router_answers_what_one_server_computes(epd, offline: LLM, store: Path) -> None:
    router, _, _ = epd
    client = router.client()
    model = client.models.list().data[0].id
    messages = _messages(*(_data_url(p) for p in PNGS))
    whole = client.chat.completions.create(model=model, messages=messages, max_tokens=8, temperature=0)
    assert whole.choices[0].message.content == _offline_answer(offline, PNGS, 8)
    assert len(list(store.glob("*.ec"))) == len(PNGS)  # the encoder stored both images' features
    stream = client.chat.completions.create(
        model=model, messages=messages, max_tokens=8, temperature=0, stream=True
    )
    assert (
        "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
        == whole.choices[0].message.content
    )
    assert router.samples("axon_router:requests_total", role="encode") == 2 * len(PNGS)
    assert router.samples("axon_router:encoder_fallbacks_total") == 0


def test_the_encoder_server_answers_with_no_tokens_once_the_features_are_stored(epd) -> None:
    _, encoder, _ = epd
    client = encoder.client()
    model = client.models.list().data[0].id
    reply = client.chat.completions.create(model=model, messages=_messages(_data_url(PNGS[0])), max_tokens=1)
    assert reply.choices[0].message.content == ""
    assert reply.choices[0].finish_reason == "length"
    assert reply.usage.completion_tokens == 0 and reply.usage.prompt_tokens > 6  # the image's tokens counted


def test_a_bad_image_is_the_encoders_400_and_all_goes_on(epd, offline: LLM) -> None:
    router, _, _ = epd
    client = router.client()
    model = client.models.list().data[0].id
    with pytest.raises(openai.BadRequestError, match="cannot be decoded"):
        client.chat.completions.create(
            model=model, messages=_messages("data:image/png;base64,bm90IGFuIGltYWdl"), max_tokens=2
        )
    reply = client.chat.completions.create(
        model=model, messages=_messages(_data_url(PNGS[1])), max_tokens=4, temperature=0
    )
    assert reply.choices[0].message.content == _offline_answer(offline, PNGS[1:], 4)
    # A chat without images never meets the encoder: the main job, a chat that stops by itself.
    text_only = [{"role": "user", "content": "Say hi."}]
    before = router.samples("axon_router:requests_total", role="encode")
    reply = client.chat.completions.create(model=model, messages=text_only, temperature=0)
    assert reply.choices[0].finish_reason in ("stop", "length")
    assert router.samples("axon_router:requests_total", role="encode") == before


def test_without_the_encoder_the_pd_server_encodes_itself(epd, offline: LLM, store: Path) -> None:
    router, encoder, _ = epd
    encoder.stop()
    before = set(store.glob("*.ec"))
    pngs = [_png(80, 64, 11), _png(64, 80, 12)]  # images the prefill/decode server has not seen
    client = router.client()
    model = client.models.list().data[0].id
    reply = client.chat.completions.create(
        model=model, messages=_messages(*(_data_url(p) for p in pngs)), max_tokens=8, temperature=0
    )
    assert reply.choices[0].message.content == _offline_answer(offline, pngs, 8)
    assert router.samples("axon_router:encoder_fallbacks_total") == len(pngs)
    assert set(store.glob("*.ec")) == before  # no encoder server stored them
