"""``axon serve --compile-cache-store``: two "hosts" (two cache roots) and one shared store.
The first server compiles its buckets and publishes them; the second, whose own cache is empty,
compiles nothing: every bucket is a cache hit, and it answers as the first did."""

from __future__ import annotations

import os
import re
from pathlib import Path

from conftest import ServerProcess

BUCKETS = (
    "--no-enforce-eager",
    "--bucket-compile",
    "warmup",
    "--max-num-seqs",
    "4",
    "--num-seqs-buckets",
    "4",
    "--max-num-batched-tokens",
    "32",
    "--num-batched-tokens-buckets",
    "32",
)


def test_a_second_host_serves_warm_from_the_shared_store(
    tiny_model_dir, tmp_path: Path, kernel_cache_root: str
) -> None:
    folder = tiny_model_dir("llama_full_vocab")
    store = tmp_path / "store"
    results = []
    for host in ("host-a", "host-b"):
        root = tmp_path / host
        root.mkdir()
        # The C++ kernels are not under test: both hosts reuse the suite's build.
        (root / "kernels").symlink_to(os.path.join(kernel_cache_root, "kernels"))
        server = ServerProcess(
            folder, *BUCKETS, "--cache-root", str(root), "--compile-cache-store", str(store)
        ).wait_ready(300)
        try:
            reply = server.client().completions.create(
                model=folder, prompt="Once upon a time", max_tokens=8, temperature=0
            )
            compiles = re.findall(
                r"compiled the (\d+)-token bucket in [\d.]+ s \((cache \w+)\)", server.log()
            )
            results.append((reply.choices[0].text, sorted(compiles)))
        finally:
            server.stop()
    (text_a, compiles_a), (text_b, compiles_b) = results
    assert compiles_a == [("32", "cache miss"), ("4", "cache miss")]
    assert compiles_b == [("32", "cache hit"), ("4", "cache hit")]
    assert text_b == text_a
