"""Thread counts and pinning: vLLM's VLLM_CPU_OMP_THREADS_BIND values, checked and applied."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from axon.platforms.cpu_kernels import load_cpu_kernels
from axon.platforms.cpu_threads import parse_cpu_list, thread_cpus


def test_parse_cpu_list() -> None:
    assert parse_cpu_list("0-3,8") == [0, 1, 2, 3, 8]
    assert parse_cpu_list("5") == [5]
    for bad, match in [
        ("a-b", "not a CPU number"),
        ("3-1", "ascending"),
        ("0,0", "twice"),
        ("", "not a CPU"),
    ]:
        with pytest.raises(ValueError, match=match):
            parse_cpu_list(bad)


def test_thread_cpus(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)
    allowed = sorted(os.sched_getaffinity(0))
    assert thread_cpus("nobind", None) is None
    assert thread_cpus("all", None) == allowed
    auto = thread_cpus(None, None)  # auto: one per physical core
    assert auto and set(auto) <= set(allowed)
    assert thread_cpus("auto", 1) == auto[:1]
    assert thread_cpus(str(allowed[0]), None) == [allowed[0]]
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    assert thread_cpus(None, None) is None  # vLLM's variable is read when the option is unset
    with pytest.raises(ValueError, match="is not one this process may use"):
        thread_cpus(str(max(allowed) + 1), None)
    with pytest.raises(ValueError, match="does not match"):
        thread_cpus(str(allowed[0]), 2)
    with pytest.raises(ValueError, match="more than"):
        thread_cpus("auto", len(allowed) + 1)


def test_bind_threads_pins_all_but_the_caller(kernel_cache_root: str) -> None:
    if not load_cpu_kernels(kernel_cache_root):
        pytest.skip("no C++ compiler")
    # In a child process: pinning is process state this test process should not keep.
    code = f"""
import os, sys, threading, torch
from axon.platforms.cpu_kernels import load_cpu_kernels
from axon.platforms.cpu_threads import configure_cpu_threads
assert load_cpu_kernels({kernel_cache_root!r})
allowed = sorted(os.sched_getaffinity(0))
cpus = allowed[:2] if len(allowed) > 1 else allowed
configure_cpu_threads(cpus, None, True)
assert torch.get_num_threads() == len(cpus)
main = threading.get_native_id()
sets = {{}}
for tid in os.listdir("/proc/self/task"):
    sets[int(tid)] = sorted(os.sched_getaffinity(int(tid)))
assert sets[main] == allowed, sets  # the caller keeps its CPU set
pinned = [s for t, s in sets.items() if t != main and len(s) == 1]
assert sorted(c for s in pinned for c in s) == cpus[1:], (sets, cpus)
print("ok")
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-2000:]
