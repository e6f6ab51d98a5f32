"""What the Responses and Messages APIs add over chat completions, per request, on one server.

    python -m benchmarks.api_overhead [--rounds 5] [--num-prompts 64]

One ``axon serve`` of the bundled SmolLM2-135M-Instruct (eager, ``--max-model-len 512``) is
loaded by ``axon bench serve`` one request at a time (``--max-concurrency 1``), so a request's
end-to-end latency is the server's time for it plus the client's: ``--num-prompts`` random
prompts of ``--input-len`` tokens, one output token each (EOS ignored), so the model's share is
small and the API's share shows. Each round runs the three endpoint types in turn (chat,
responses, messages) on the same prompts; the table has each type's median over rounds of the
mean end-to-end latency and time to first token, and its difference from chat (the target:
under 1 ms). The load generator shares the CPUs with the server, alike for every type.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

if __package__ in (None, ""):  # run as a file: make the repo root (axon, benchmarks) importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.common import cpu_summary, markdown_table, running_server, serve_command, smollm2_folder

TYPES = ("chat", "responses", "messages")
SERVER_FLAGS = [
    "--max-model-len",
    "512",
    "--enforce-eager",
    "--disable-log-stats",
    "--disable-uvicorn-access-log",
]


def bench(port: int, endpoint_type: str, args: argparse.Namespace) -> dict:
    with tempfile.TemporaryDirectory() as out:
        cmd = [sys.executable, "-m", "axon.entrypoints.cli", "bench", "serve", "--port", str(port)]
        cmd += ["--endpoint-type", endpoint_type, "--num-prompts", str(args.num_prompts)]
        cmd += [
            "--random-input-len",
            str(args.input_len),
            "--random-output-len",
            "1",
            "--max-concurrency",
            "1",
        ]
        cmd += [
            "--ignore-eos",
            "--disable-tqdm",
            "--save-result",
            "--result-dir",
            out,
            "--result-filename",
            "r.json",
        ]
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, timeout=600)
        with open(os.path.join(out, "r.json")) as f:
            result = json.load(f)
    if result["failed"]:
        raise RuntimeError(f"{endpoint_type}: {result['failed']} requests failed: {result['errors'][:3]}")
    return result


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=32)
    args = parser.parse_args()
    print(cpu_summary())
    folder = smollm2_folder()
    log = tempfile.mktemp(prefix="api-overhead-", suffix=".log")
    e2el: dict[str, list[float]] = {t: [] for t in TYPES}
    ttft: dict[str, list[float]] = {t: [] for t in TYPES}
    with running_server(
        lambda port: serve_command("axon", folder, port, SERVER_FLAGS, ""), dict(os.environ), log, 300
    ) as server:
        for t in TYPES:  # warm-up: every path once
            bench(server.port, t, argparse.Namespace(num_prompts=4, input_len=args.input_len))
        for r in range(args.rounds):
            for t in TYPES:
                result = bench(server.port, t, args)
                e2el[t].append(result["mean_e2el_ms"])
                ttft[t].append(result["mean_ttft_ms"])
            line = ", ".join(f"{t} {e2el[t][-1]:.2f}" for t in TYPES)
            print(f"round {r}: mean E2EL ms: {line}", flush=True)
    base = statistics.median(e2el["chat"])
    rows = []
    for t in TYPES:
        med = statistics.median(e2el[t])
        rows.append(
            [
                t,
                f"{med:.2f}",
                f"{statistics.median(ttft[t]):.2f}",
                "-" if t == "chat" else f"{med - base:+.2f}",
                "-" if t == "chat" else ("met" if med - base < 1.0 else "missed"),
            ]
        )
    print(
        markdown_table(
            ["endpoint", "E2EL ms (median of rounds)", "TTFT ms", "vs chat (ms)", "under 1 ms"], rows
        )
    )


if __name__ == "__main__":
    main()
