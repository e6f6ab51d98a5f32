"""``axon bench serve``: a load generator for any OpenAI-compatible server, like ``vllm bench serve``.

It sends ``--num-prompts`` streaming requests (``stream: true`` with ``include_usage``) at a
Poisson rate (``--request-rate``, gamma-shaped by ``--burstiness``), at most
``--max-concurrency`` at a time, and measures per request, client-side:

    TTFT  send -> first chunk carrying text
    ITL   every gap between consecutive text chunks
    TPOT  (E2EL - TTFT) / (output_tokens - 1), for requests with more than one output token
    E2EL  send -> end of the stream

Output tokens come from the server's usage block when it sends one, else from counting the
generated text with the tokenizer. Input tokens are counted with the tokenizer, as vLLM does.
Random prompts are random token ids decoded with the tokenizer (``--tokenizer``, default the
bundled SmolLM2), so they are plain text and portable across servers. The JSON result
(``--save-result``) uses vLLM's field names.

Standalone: ``python -m axon.entrypoints.bench_serve serve --num-prompts 100 ...``.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import math
import sys
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

import numpy as np

# vLLM's --backend names this client speaks -> the endpoint each posts to by default. A backend
# decides the request's shape (prompt vs messages); --endpoint only the path.
BACKEND_ENDPOINTS = {
    "openai": "/v1/completions",
    "vllm": "/v1/completions",
    "openai-chat": "/v1/chat/completions",
    "openai-responses": "/v1/responses",
    "anthropic-messages": "/v1/messages",
}
# --endpoint-type -> the backend that speaks it
ENDPOINT_TYPES = {
    "completions": "openai",
    "chat": "openai-chat",
    "responses": "openai-responses",
    "messages": "anthropic-messages",
}
# The end of each backend's path (what a given --endpoint must end with).
_PATH_ENDS = {
    "openai": "completions",
    "vllm": "completions",
    "openai-chat": "chat/completions",
    "openai-responses": "responses",
    "anthropic-messages": "messages",
}
METRICS = ("ttft", "tpot", "itl", "e2el")
METRIC_TITLES = {
    "ttft": ("Time to First Token", "TTFT"),
    "tpot": ("Time per Output Token (excl. 1st token)", "TPOT"),
    "itl": ("Inter-token Latency", "ITL"),
    "e2el": ("End-to-end Latency", "E2EL"),
}


@dataclass
class SampleRequest:
    prompt: str
    prompt_len: int
    output_len: int


@dataclass
class RequestResult:
    success: bool = False
    prompt_len: int = 0
    output_tokens: int = 0
    generated_text: str = ""
    ttft: float = 0.0
    itl: list[float] = field(default_factory=list)
    latency: float = 0.0
    error: str = ""


# ---- the command line ------------------------------------------------------------------------
def add_serve_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("server")
    g.add_argument("--base-url", default=None, help="e.g. http://127.0.0.1:8000 (overrides --host/--port)")
    g.add_argument("--host", default="127.0.0.1")
    g.add_argument("--port", type=int, default=8000)
    g.add_argument(
        "--backend",
        default=None,
        choices=tuple(BACKEND_ENDPOINTS),
        help="vLLM's names: openai or vllm send completions, openai-chat chat completions; "
        "openai-responses the Responses API, anthropic-messages Anthropic's Messages API "
        "(default: what --endpoint or --endpoint-type is, else openai)",
    )
    g.add_argument(
        "--endpoint-type",
        default=None,
        choices=tuple(ENDPOINT_TYPES),
        help="the API to load: completions, chat, responses or messages (sets --backend)",
    )
    g.add_argument(
        "--endpoint",
        default=None,
        help="the path requests are posted to (default: the backend's, /v1/completions or "
        "/v1/chat/completions)",
    )
    g.add_argument("--model", default=None, help="default: the first model the server's /v1/models lists")
    g.add_argument("--tokenizer", default=None, help="HF tokenizer folder (default: the bundled SmolLM2)")
    d = parser.add_argument_group("dataset")
    d.add_argument("--dataset-name", default="random", choices=("random", "jsonl"))
    d.add_argument(
        "--dataset-path", default=None, help="JSONL: a 'prompt' and optional 'output_len' per line"
    )
    d.add_argument("--random-input-len", type=int, default=1024)
    d.add_argument(
        "--random-output-len", type=int, default=128, help="also the output length of JSONL lines without one"
    )
    d.add_argument("--random-range-ratio", type=float, default=0.0, help="lengths uniform in len*(1±ratio)")
    d.add_argument("--num-prompts", type=int, default=1000)
    d.add_argument("--seed", type=int, default=0)
    t = parser.add_argument_group("traffic")
    t.add_argument("--request-rate", type=float, default=float("inf"), help="requests/s; inf: all at once")
    t.add_argument("--burstiness", type=float, default=1.0, help="gamma shape of arrivals; 1: Poisson")
    t.add_argument("--max-concurrency", type=int, default=None)
    t.add_argument("--ignore-eos", action="store_true", help="send vLLM's ignore_eos extra field")
    t.add_argument("--temperature", type=float, default=0.0)
    r = parser.add_argument_group("results")
    r.add_argument("--disable-tqdm", action="store_true")
    r.add_argument("--metric-percentiles", default="99", help="comma-separated, e.g. 50,90,99")
    r.add_argument(
        "--profile",
        action="store_true",
        help="POST /start_profile before the run and /stop_profile after it (the server needs "
        "--profiler-config)",
    )
    r.add_argument("--save-result", action="store_true")
    r.add_argument("--result-dir", default=".")
    r.add_argument("--result-filename", default=None)
    parser.set_defaults(bench_func=run_bench)


def add_bench_parser(subparsers: Any) -> None:
    """Add ``bench serve`` to the ``axon`` command's subparsers (handler: ``args.bench_func``)."""
    bench = subparsers.add_parser("bench", help="benchmarks")
    bench_sub = bench.add_subparsers(dest="bench_command", required=True)
    serve = bench_sub.add_parser("serve", help="load-test an OpenAI-compatible server")
    add_serve_args(serve)


def validate_args(args: argparse.Namespace) -> None:
    if args.num_prompts < 1:
        raise ValueError(f"--num-prompts must be >= 1, got {args.num_prompts}")
    if not args.request_rate > 0:
        raise ValueError(f"--request-rate must be > 0 (or inf), got {args.request_rate}")
    if not args.burstiness > 0:
        raise ValueError(f"--burstiness must be > 0, got {args.burstiness}")
    if args.max_concurrency is not None and args.max_concurrency < 1:
        raise ValueError(f"--max-concurrency must be >= 1, got {args.max_concurrency}")
    if not 0.0 <= args.random_range_ratio < 1.0:
        raise ValueError(f"--random-range-ratio must be in [0, 1), got {args.random_range_ratio}")
    if args.random_input_len < 1 or args.random_output_len < 1:
        raise ValueError("--random-input-len and --random-output-len must be >= 1")
    if args.dataset_name == "jsonl" and not args.dataset_path:
        raise ValueError("--dataset-name jsonl needs --dataset-path")
    parse_percentiles(args.metric_percentiles)
    if args.endpoint_type is not None:
        typed = ENDPOINT_TYPES[args.endpoint_type]
        if args.backend is not None and args.backend != typed:
            raise ValueError(f"--endpoint-type {args.endpoint_type} is --backend {typed}, not {args.backend}")
        args.backend = typed
    args.backend, args.endpoint = resolve_backend(args.backend, args.endpoint)


def resolve_backend(backend: str | None, endpoint: str | None) -> tuple[str, str]:
    """(backend, endpoint) from either or both, as vLLM pairs them: a chat backend posts to a
    path ending in chat/completions, a completions backend to one ending in completions (and
    the Responses and Messages backends to paths ending in responses and messages)."""
    if endpoint is not None and not endpoint.startswith("/"):
        raise ValueError(f"--endpoint must be a path such as /v1/completions, got {endpoint!r}")
    path = (endpoint or "").rstrip("/")
    if backend is None:
        # the longest matching end decides: chat/completions before completions
        ends = sorted(((end, b) for b, end in _PATH_ENDS.items() if b != "vllm"), key=lambda e: -len(e[0]))
        backend = next((b for end, b in ends if path.endswith(end)), "openai")
    if endpoint is None:
        return backend, BACKEND_ENDPOINTS[backend]
    end = _PATH_ENDS[backend]
    fits = path.endswith(end) and (backend == "openai-chat" or not path.endswith("chat/completions"))
    if not fits:
        want = end if backend != "openai" and backend != "vllm" else "completions (not chat/completions)"
        raise ValueError(f"--backend {backend} posts to a path ending in {want}; --endpoint is {endpoint!r}")
    return backend, endpoint


def parse_percentiles(text: str) -> list[float]:
    try:
        values = [float(p) for p in text.split(",") if p.strip()]
    except ValueError:
        raise ValueError(f"--metric-percentiles must be numbers separated by commas, got {text!r}") from None
    if not values or any(not 0 < p <= 100 for p in values):
        raise ValueError(f"--metric-percentiles must be in (0, 100], got {text!r}")
    return values


def run_bench(args: argparse.Namespace) -> int:
    """Run ``bench serve`` from parsed arguments; 0 when at least one request succeeded."""
    validate_args(args)
    result = asyncio.run(run_benchmark(args))
    return 0 if result["completed"] > 0 else 1


def main(argv: list[str] | None = None) -> int:
    from axon.entrypoints.cli import AxonArgumentParser

    parser = AxonArgumentParser(prog="axon bench", description="axon's benchmarks")
    sub = parser.add_subparsers(dest="bench_command", required=True)
    add_serve_args(sub.add_parser("serve", help="load-test an OpenAI-compatible server"))
    args = parser.parse_args(argv)
    try:
        return run_bench(args)
    except ValueError as e:
        print(f"axon bench serve: error: {e}", file=sys.stderr)
        return 2


# ---- datasets --------------------------------------------------------------------------------
@functools.cache
def load_tokenizer(path: str | None) -> Any:
    from transformers import AutoTokenizer

    if path is None:
        from axon.engine.arg_utils import create_engine_config

        path = create_engine_config().model_config.model_path
    return AutoTokenizer.from_pretrained(path)


def count_tokens(tokenizer: Any, text: str) -> int:
    return len(tokenizer.encode(text, add_special_tokens=False))


def sample_lengths(mean: int, ratio: float, num: int, rng: np.random.Generator) -> list[int]:
    low, high = max(int(mean * (1 - ratio)), 1), max(int(mean * (1 + ratio)), 1)
    return rng.integers(low, high + 1, size=num).tolist()


def random_prompt(tokenizer: Any, target_len: int, candidates: np.ndarray, rng: np.random.Generator) -> str:
    """Decode random token ids into text that re-encodes to about ``target_len`` tokens.

    Decoding and re-encoding merges or splits tokens, so the ids are trimmed or topped up a few
    times, as vLLM's random dataset does; the caller counts the final text's tokens.
    """
    token_ids = rng.choice(candidates, size=target_len).tolist()
    text = tokenizer.decode(token_ids)
    for _ in range(10):
        token_ids = tokenizer.encode(text, add_special_tokens=False)
        if len(token_ids) == target_len:
            break
        if len(token_ids) > target_len:
            token_ids = token_ids[:target_len]
        else:
            token_ids += rng.choice(candidates, size=target_len - len(token_ids)).tolist()
        text = tokenizer.decode(token_ids)
    return text


def random_requests(args: argparse.Namespace, tokenizer: Any) -> list[SampleRequest]:
    rng = np.random.default_rng(args.seed)
    special = set(tokenizer.all_special_ids)
    candidates = np.array([i for i in range(len(tokenizer)) if i not in special])
    input_lens = sample_lengths(args.random_input_len, args.random_range_ratio, args.num_prompts, rng)
    output_lens = sample_lengths(args.random_output_len, args.random_range_ratio, args.num_prompts, rng)
    requests = []
    for input_len, output_len in zip(input_lens, output_lens, strict=True):
        prompt = random_prompt(tokenizer, input_len, candidates, rng)
        requests.append(SampleRequest(prompt, count_tokens(tokenizer, prompt), output_len))
    return requests


def jsonl_requests(args: argparse.Namespace, tokenizer: Any) -> list[SampleRequest]:
    """The first ``--num-prompts`` lines of the file, cycled when it has fewer."""
    lines: list[SampleRequest] = []
    with open(args.dataset_path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            record = json.loads(line)
            if not isinstance(record, dict) or not isinstance(record.get("prompt"), str):
                raise ValueError(  # noqa: TRY004 (bad user input)
                    f"{args.dataset_path}:{number}: each line needs a string 'prompt'"
                )
            output_len = int(record.get("output_len") or args.random_output_len)
            prompt = record["prompt"]
            lines.append(SampleRequest(prompt, count_tokens(tokenizer, prompt), output_len))
    if not lines:
        raise ValueError(f"{args.dataset_path} has no prompts")
    return [lines[i % len(lines)] for i in range(args.num_prompts)]


# ---- traffic -------------------------------------------------------------------------------
def request_intervals(num: int, request_rate: float, burstiness: float, seed: int) -> list[float]:
    """Seconds to wait after each request before the next: gamma(burstiness, 1/(rate*burstiness)).

    Burstiness 1 gives Poisson arrivals; the mean interval is 1/rate for every burstiness.
    """
    if math.isinf(request_rate):
        return [0.0] * num
    rng = np.random.default_rng(seed)
    theta = 1.0 / (request_rate * burstiness)
    return rng.gamma(shape=burstiness, scale=theta, size=num).tolist()


async def arrivals(requests: list[SampleRequest], intervals: list[float]) -> AsyncIterator[SampleRequest]:
    for request, interval in zip(requests, intervals, strict=True):
        yield request
        if interval > 0:
            await asyncio.sleep(interval)


# ---- one request ---------------------------------------------------------------------------
def build_payload(backend: str, model: str, req: SampleRequest, args: argparse.Namespace) -> dict[str, Any]:
    payload: dict[str, Any] = {
        "model": model,
        "max_tokens": req.output_len,
        "temperature": args.temperature,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if backend == "openai-responses":  # usage comes with response.completed
        del payload["max_tokens"], payload["stream_options"]
        payload.update(input=req.prompt, max_output_tokens=req.output_len)
    elif backend == "anthropic-messages":  # usage comes with message_delta
        del payload["stream_options"]
        payload["messages"] = [{"role": "user", "content": req.prompt}]
    elif backend == "openai-chat":
        payload["messages"] = [{"role": "user", "content": req.prompt}]
    else:
        payload["prompt"] = req.prompt
    if args.ignore_eos:
        payload["ignore_eos"] = True
    return payload


def chunk_text(chunk: dict[str, Any]) -> str:
    kind = chunk.get("type")
    if kind == "response.output_text.delta":  # the Responses API
        return chunk.get("delta") or ""
    if kind == "content_block_delta":  # Anthropic's Messages API
        return (chunk.get("delta") or {}).get("text") or ""
    choices = chunk.get("choices") or []
    if not choices:
        return ""
    choice = choices[0]
    if "delta" in choice:
        delta = choice["delta"] or {}
        return (delta.get("content") or "") + (delta.get("reasoning_content") or "")
    return choice.get("text") or ""


async def sse_events(response: Any) -> AsyncIterator[str]:
    """The ``data:`` payloads of a server-sent-event stream, up to ``[DONE]``."""
    async for raw in response.content:
        line = raw.decode("utf-8").strip()
        if not line.startswith("data:"):
            continue  # blank separators, ": keep-alive" comments, event names
        data = line[len("data:") :].strip()
        if data == "[DONE]":
            return
        yield data


async def send_request(
    session: Any, url: str, payload: dict[str, Any], req: SampleRequest, tokenizer: Any
) -> RequestResult:
    result = RequestResult(prompt_len=req.prompt_len)
    text_parts: list[str] = []
    usage_tokens: int | None = None
    start = last = time.perf_counter()
    try:
        async with session.post(url, json=payload) as response:
            if response.status != 200:
                result.error = f"HTTP {response.status}: {(await response.text())[:500]}"
                return result
            async for data in sse_events(response):
                chunk = json.loads(data)
                if "error" in chunk or chunk.get("type") in ("error", "response.failed"):
                    result.error = f"error in stream: {json.dumps(chunk)[:500]}"
                    return result
                usage = chunk.get("usage") or (chunk.get("response") or {}).get("usage")
                if usage:
                    usage_tokens = usage.get("completion_tokens", usage.get("output_tokens", usage_tokens))
                if text := chunk_text(chunk):
                    now = time.perf_counter()
                    if not text_parts:
                        result.ttft = now - start
                    else:
                        result.itl.append(now - last)
                    last = now
                    text_parts.append(text)
        result.latency = time.perf_counter() - start
    except Exception as e:  # noqa: BLE001 (a failed request is a result, not a crash of the run)
        result.error = f"{type(e).__name__}: {e}"
        return result
    result.generated_text = "".join(text_parts)
    if not text_parts and not usage_tokens:
        result.error = "the stream carried no text and no usage"
        return result
    result.output_tokens = (
        usage_tokens if usage_tokens is not None else count_tokens(tokenizer, result.generated_text)
    )
    result.success = True
    return result


# ---- the run -------------------------------------------------------------------------------
def base_url(args: argparse.Namespace) -> str:
    return (args.base_url or f"http://{args.host}:{args.port}").rstrip("/")


async def first_model(session: Any, url: str) -> str:
    import aiohttp

    try:
        async with session.get(f"{url}/v1/models") as response:
            if response.status != 200:
                raise ValueError(f"GET {url}/v1/models answered {response.status}; pass --model")
            models = (await response.json()).get("data") or []
    except aiohttp.ClientError as e:
        raise ValueError(f"cannot reach the server at {url}: {e}") from None
    if not models:
        raise ValueError(f"GET {url}/v1/models lists no model; pass --model")
    return models[0]["id"]


async def _profile_call(session: Any, url: str, route: str) -> None:
    async with session.post(f"{url}/{route}") as response:
        if response.status != 200:
            raise ValueError(
                f"POST {url}/{route} answered {response.status}: start the server with --profiler-config"
            )
        if route == "stop_profile":
            print(
                "Profiler traces:",
                ", ".join((await response.json()).get("traces", [])) or "written by the server",
            )


async def run_benchmark(args: argparse.Namespace) -> dict[str, Any]:
    """Run the benchmark, print vLLM's result table and return (and maybe save) the result."""
    import aiohttp
    from tqdm.asyncio import tqdm

    tokenizer = load_tokenizer(args.tokenizer)
    make = random_requests if args.dataset_name == "random" else jsonl_requests
    requests = make(args, tokenizer)
    intervals = request_intervals(len(requests), args.request_rate, args.burstiness, args.seed)
    url = base_url(args)
    timeout = aiohttp.ClientTimeout(total=6 * 3600)
    connector = aiohttp.TCPConnector(limit=args.max_concurrency or 0)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
        model = args.model or await first_model(session, url)
        semaphore = asyncio.Semaphore(args.max_concurrency) if args.max_concurrency else None
        progress = tqdm(total=len(requests), disable=args.disable_tqdm)
        in_flight = peak = 0

        async def one(req: SampleRequest) -> RequestResult:
            nonlocal in_flight, peak
            payload = build_payload(args.backend, model, req, args)
            if semaphore is not None:
                await semaphore.acquire()
            in_flight += 1
            peak = max(peak, in_flight)
            try:
                return await send_request(session, url + args.endpoint, payload, req, tokenizer)
            finally:
                in_flight -= 1
                if semaphore is not None:
                    semaphore.release()
                progress.update(1)

        if args.profile:
            await _profile_call(session, url, "start_profile")
        start = time.perf_counter()
        tasks = [asyncio.create_task(one(req)) async for req in arrivals(requests, intervals)]
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
        progress.close()
        if args.profile:
            await _profile_call(session, url, "stop_profile")
    result = calculate_metrics(results, duration, parse_percentiles(args.metric_percentiles))
    result.update(
        date=datetime.now().strftime("%Y%m%d-%H%M%S"),
        backend=args.backend,
        endpoint=args.endpoint,
        base_url=url,
        model_id=model,
        tokenizer_id=args.tokenizer,
        num_prompts=len(requests),
        request_rate=args.request_rate if math.isfinite(args.request_rate) else "inf",
        burstiness=args.burstiness,
        max_concurrency=args.max_concurrency,
        max_concurrent_requests=peak,
    )
    print_result(result, parse_percentiles(args.metric_percentiles))
    if args.save_result:
        save_result(result, args)
    return result


# ---- results -------------------------------------------------------------------------------
def _percentile_key(p: float) -> str:
    return f"p{p:g}".replace(".", "_") if p != int(p) else f"p{int(p)}"


def calculate_metrics(
    results: list[RequestResult], duration: float, percentiles: list[float]
) -> dict[str, Any]:
    ok = [r for r in results if r.success]
    values: dict[str, list[float]] = {
        "ttft": [r.ttft for r in ok],
        "tpot": [(r.latency - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1],
        "itl": [gap for r in ok for gap in r.itl],
        "e2el": [r.latency for r in ok],
    }
    total_input = sum(r.prompt_len for r in ok)
    total_output = sum(r.output_tokens for r in ok)
    metrics: dict[str, Any] = {
        "duration": duration,
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "total_input_tokens": total_input,
        "total_output_tokens": total_output,
        "request_throughput": len(ok) / duration,
        "output_throughput": total_output / duration,
        "total_token_throughput": (total_input + total_output) / duration,
    }
    for name, samples in values.items():
        ms = np.asarray(samples or [0.0]) * 1000
        metrics[f"mean_{name}_ms"] = float(np.mean(ms))
        metrics[f"median_{name}_ms"] = float(np.median(ms))
        metrics[f"std_{name}_ms"] = float(np.std(ms))
        for p in percentiles:
            metrics[f"{_percentile_key(p)}_{name}_ms"] = float(np.percentile(ms, p))
    metrics.update(
        input_lens=[r.prompt_len for r in results],
        output_lens=[r.output_tokens for r in results],
        ttfts=[r.ttft for r in results],
        itls=[r.itl for r in results],
        generated_texts=[r.generated_text for r in results],
        errors=[r.error for r in results],
    )
    return metrics


def print_result(m: dict[str, Any], percentiles: list[float]) -> None:
    rows: list[str] = ["{s:{c}^{n}}".format(s=" Serving Benchmark Result ", n=50, c="=")]

    def row(label: str, value: Any) -> None:
        fmt = "{:<40} {:<10.2f}" if isinstance(value, float) else "{:<40} {:<10}"
        rows.append(fmt.format(label, value))

    row("Successful requests:", m["completed"])
    row("Failed requests:", m["failed"])
    if m["max_concurrency"] is not None:
        row("Maximum request concurrency:", m["max_concurrency"])
    if m["request_rate"] != "inf":
        row("Request rate configured (RPS):", float(m["request_rate"]))
    row("Benchmark duration (s):", m["duration"])
    row("Total input tokens:", m["total_input_tokens"])
    row("Total generated tokens:", m["total_output_tokens"])
    row("Request throughput (req/s):", m["request_throughput"])
    row("Output token throughput (tok/s):", m["output_throughput"])
    row("Peak concurrent requests:", m["max_concurrent_requests"])
    row("Total Token throughput (tok/s):", m["total_token_throughput"])
    for name in METRICS:
        title, short = METRIC_TITLES[name]
        rows.append("{s:{c}^{n}}".format(s=title, n=50, c="-"))
        row(f"Mean {short} (ms):", m[f"mean_{name}_ms"])
        row(f"Median {short} (ms):", m[f"median_{name}_ms"])
        for p in percentiles:
            row(f"P{p:g} {short} (ms):", m[f"{_percentile_key(p)}_{name}_ms"])
    rows.append("=" * 50)
    print("\n".join(rows))
    errors = [e for e in m["errors"] if e]
    if errors:
        print(f"{len(errors)} requests failed; first error: {errors[0]}", file=sys.stderr)


def save_result(result: dict[str, Any], args: argparse.Namespace) -> str:
    import os

    name = args.result_filename
    if name is None:
        model = str(result["model_id"]).split("/")[-1]
        concurrency = f"-concurrency{args.max_concurrency}" if args.max_concurrency else ""
        name = f"axon-{result['request_rate']}qps{concurrency}-{model}-{result['date']}.json"
    path = name if os.path.isabs(name) else os.path.join(args.result_dir, name)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(result, f, indent=2)
    return path


if __name__ == "__main__":
    sys.exit(main())
