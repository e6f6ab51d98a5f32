"""LoRA adapters on a tiny random Llama against transformers + peft (float32): random PEFT
adapters built by the tests (every q/k/v/o/gate/up/down target; one with rsLoRA and another
rank), greedy output equal to the adapter merged into the model; a mixed batch of two adapters
and the base model equal to each alone (compiled and eager, and with more adapters than slots
over time); the adapter in the prefix-cache keys; every bad adapter folder a ValueError that
names the problem."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import transformers as tf
from peft import LoraConfig, get_peft_model

from axon import LLM, LoRARequest, SamplingParams

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
PROMPTS = [[1, 504, 345, 282, 260, 114, 30, 198], [7, 91, 402, 17, 250, 6, 99, 310, 44, 12, 5]]
NEW = 8
PARAMS = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True)


def _make_adapter(base: str, out: Path, seed: int, rank: int = 8, rslora: bool = False) -> str:
    torch.manual_seed(seed)
    model = tf.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    config = LoraConfig(
        r=rank, lora_alpha=2 * rank, target_modules=TARGETS, use_rslora=rslora, lora_dropout=0.0
    )
    peft_model = get_peft_model(model, config)
    with torch.no_grad():  # PEFT starts B at zero (a no-op adapter): make it count
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.2)
    peft_model.save_pretrained(out)
    return str(out)


def _merged_greedy(base: str, adapter: str | None, prompt: list[int]) -> list[int]:
    model = tf.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval()
    if adapter is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, adapter).merge_and_unload()
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(NEW):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt) :]


@pytest.fixture(scope="module")
def base(tiny_model_dir) -> str:
    return tiny_model_dir("llama")


@pytest.fixture(scope="module")
def adapters(base: str, tmp_path_factory: pytest.TempPathFactory) -> list[LoRARequest]:
    root = tmp_path_factory.mktemp("adapters")
    first = _make_adapter(base, root / "a", seed=1)
    second = _make_adapter(base, root / "b", seed=2, rank=4, rslora=True)
    third = _make_adapter(base, root / "c", seed=3)
    return [LoRARequest("a", 1, first), LoRARequest("b", 2, second), LoRARequest("c", 3, third)]


def _ids(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


def test_an_adapter_answers_what_it_merged_answers(base: str, adapters: list[LoRARequest]) -> None:
    llm = LLM(model=base, dtype="float32", enable_lora=True, max_loras=2, max_lora_rank=8)
    for lora in adapters[:2]:
        got = _ids(
            llm.generate(
                [{"prompt_token_ids": p} for p in PROMPTS], PARAMS, use_tqdm=False, lora_request=lora
            )
        )
        assert got == [_merged_greedy(base, lora.lora_path, p) for p in PROMPTS], lora.lora_name
    plain = _ids(llm.generate([{"prompt_token_ids": p} for p in PROMPTS], PARAMS, use_tqdm=False))
    assert plain == [_merged_greedy(base, None, p) for p in PROMPTS]


@pytest.mark.parametrize("eager", [True, False])
def test_a_mixed_batch_equals_each_alone(base: str, adapters: list[LoRARequest], eager: bool) -> None:
    llm = LLM(model=base, dtype="float32", enable_lora=True, max_loras=2, enforce_eager=eager, block_size=4)
    a, b, c = adapters
    prompts = [{"prompt_token_ids": p} for p in PROMPTS * 3]
    loras = [a, a, b, b, None, None]
    mixed = _ids(llm.generate(prompts, PARAMS, use_tqdm=False, lora_request=loras))
    alone = [
        _ids(llm.generate([p], PARAMS, use_tqdm=False, lora_request=[lo]))[0] for p, lo in zip(prompts, loras)
    ]
    assert mixed == alone
    assert mixed[0] != mixed[4] and mixed[0] != mixed[2]  # the adapters change the answer
    # Three adapters over two slots: the scheduler holds the third back until a slot frees.
    three = _ids(llm.generate(prompts[:3] * 1, PARAMS, use_tqdm=False, lora_request=[a, b, c]))
    assert three[2] == _ids(llm.generate([prompts[2]], PARAMS, use_tqdm=False, lora_request=[c]))[0]
    assert three[:2] == [alone[0], alone[3]]


def test_the_adapter_is_in_the_prefix_cache_keys(base: str, adapters: list[LoRARequest]) -> None:
    llm = LLM(model=base, dtype="float32", enable_lora=True, max_loras=2, block_size=4)
    prompt = {"prompt_token_ids": PROMPTS[1]}
    llm.generate(prompt, PARAMS, use_tqdm=False, lora_request=adapters[0])
    same = llm.generate(prompt, PARAMS, use_tqdm=False, lora_request=adapters[0])[0]
    other = llm.generate(prompt, PARAMS, use_tqdm=False, lora_request=adapters[1])[0]
    base_model = llm.generate(prompt, PARAMS, use_tqdm=False)[0]
    assert same.num_cached_tokens > 0 and other.num_cached_tokens == 0 and base_model.num_cached_tokens == 0


def _broken(adapter: str, tmp: Path, change) -> str:
    folder = tmp / "broken"
    shutil.copytree(adapter, folder)
    change(folder)
    return str(folder)


def _set_config(folder: Path, **changes) -> None:
    path = folder / "adapter_config.json"
    config = json.loads(path.read_text())
    config.update(changes)
    path.write_text(json.dumps(config))


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda f: (f / "adapter_model.safetensors").unlink(), "adapter_model.safetensors is missing"),
        (lambda f: (f / "adapter_config.json").unlink(), "adapter_config.json is missing"),
        (lambda f: _set_config(f, r=64), "rank 64, above --max-lora-rank 8"),
        (lambda f: _set_config(f, r=4), "this model needs"),
    ],
)
def test_a_bad_adapter_is_named_and_loads_nothing(
    base: str, adapters, tmp_path: Path, change, message: str
) -> None:
    llm = LLM(model=base, dtype="float32", enable_lora=True, max_lora_rank=8)
    bad = LoRARequest("bad", 9, _broken(adapters[0].lora_path, tmp_path, change))
    with pytest.raises(ValueError, match=message):
        llm.generate({"prompt_token_ids": PROMPTS[0]}, PARAMS, use_tqdm=False, lora_request=bad)
    assert _ids(llm.generate({"prompt_token_ids": PROMPTS[0]}, PARAMS, use_tqdm=False)) == [
        _merged_greedy(base, None, PROMPTS[0])
    ]


def test_lora_needs_the_flag_and_a_supported_model(base: str, adapters) -> None:
    with pytest.raises(ValueError, match="--enable-lora"):
        LLM(model=base).generate(
            {"prompt_token_ids": PROMPTS[0]}, PARAMS, use_tqdm=False, lora_request=adapters[0]
        )
    with pytest.raises(ValueError, match="lora_int_id must be an integer >= 1"):
        LoRARequest("x", 0, "/nowhere")


def test_axon_serve_with_lora_modules(base: str, adapters: list[LoRARequest], tmp_path: Path) -> None:
    """--lora-modules through a real ``axon serve`` and the openai client: each adapter is a
    model of its own name, answering what LLM.generate answers with it; runtime load and
    unload under VLLM_ALLOW_RUNTIME_LORA_UPDATING; bad adapters are 400s, and the server goes on."""
    from concurrent.futures import ThreadPoolExecutor

    import openai

    from tests.server.conftest import ServerProcess, serve_usage_error

    a, b, c = adapters
    llm = LLM(model=base, dtype="float32", enable_lora=True, max_loras=2)
    expected = {
        lo.lora_name if lo else "base": _ids(
            llm.generate({"prompt_token_ids": PROMPTS[0]}, PARAMS, use_tqdm=False, lora_request=lo)
        )[0]
        for lo in (a, b, c, None)
    }
    server = ServerProcess(
        "--model", base, "--served-model-name", "base", "--enable-lora", "--max-loras", "2",
        "--lora-modules", f"a={a.lora_path}", json.dumps({"name": "b", "path": b.lora_path}),
        env={"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"},
    )  # fmt: skip
    try:
        client = server.wait_ready().client()
        cards = {m.id: m for m in client.models.list().data}
        assert (
            set(cards) == {"base", "a", "b"}
            and cards["a"].parent == "base"
            and cards["a"].root == a.lora_path
        )

        with ThreadPoolExecutor(6) as pool:  # the adapters and the base model side by side
            texts = dict(zip(["a", "b", "base", "a", "b", "base"], pool.map(
                lambda m: client.completions.create(model=m, prompt=PROMPTS[0], max_tokens=NEW, temperature=0,
                                                    extra_body={"ignore_eos": True}).choices[0].text,
                ["a", "b", "base", "a", "b", "base"])))  # fmt: skip

        def decode(ids: list[int]) -> str:
            return llm.get_tokenizer().decode(ids, skip_special_tokens=True)

        for name in ("a", "b", "base"):
            assert texts[name] == decode(expected[name]), name
        import httpx

        metrics = httpx.get(server.url + "/metrics").text
        assert 'vllm:lora_requests_info{max_lora="2"' in metrics  # vLLM's series, its adapters in labels
        httpx_post = openai.OpenAI(base_url=server.url, api_key="none").post
        ok = httpx_post(
            "/v1/load_lora_adapter", body={"lora_name": "c", "lora_path": c.lora_path}, cast_to=str
        )
        assert "added" in ok
        c_text = client.completions.create(model="c", prompt=PROMPTS[0], max_tokens=NEW, temperature=0,
                                           extra_body={"ignore_eos": True}).choices[0].text  # fmt: skip
        assert c_text == decode(expected["c"])
        with pytest.raises(openai.BadRequestError, match="is missing"):
            httpx_post(
                "/v1/load_lora_adapter", body={"lora_name": "d", "lora_path": str(tmp_path)}, cast_to=str
            )
        httpx_post("/v1/unload_lora_adapter", body={"lora_name": "c"}, cast_to=str)
        with pytest.raises(openai.NotFoundError):
            client.completions.create(model="c", prompt=PROMPTS[0], max_tokens=2)
        assert client.completions.create(model="a", prompt=PROMPTS[0], max_tokens=2).choices[0].text
    finally:
        server.stop()
    usage = serve_usage_error("--model", base, "--enable-lora", "--lora-modules", f"x={tmp_path}")
    assert "adapter_config.json is missing" in usage
    usage = serve_usage_error("--model", base, "--lora-modules", f"x={a.lora_path}")
    assert "--lora-modules needs --enable-lora" in usage


def test_a_long_prefill_takes_the_per_adapter_path_and_agrees(base: str, adapters: list[LoRARequest]) -> None:
    """A step past DENSE_ROWS rows multiplies each adapter's rows alone; a decode step multiplies
    all slots at once under a mask: both give each adapter's answer."""
    from axon.model.layers.lora import DENSE_ROWS

    llm = LLM(model=base, dtype="float32", enable_lora=True, max_loras=2, enforce_eager=True)
    long = [
        {"prompt_token_ids": [(7 * i + j) % 500 + 1 for i in range(DENSE_ROWS // 2 + 8)]} for j in range(3)
    ]
    a, b, _ = adapters
    together = _ids(llm.generate(long, PARAMS, use_tqdm=False, lora_request=[a, b, None]))
    for prompt, lora, got in zip(long, [a, b, None], together, strict=True):
        assert got == _merged_greedy(base, lora.lora_path if lora else None, prompt["prompt_token_ids"])
