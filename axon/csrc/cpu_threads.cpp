// Pinning torch's intra-op threads to CPUs (vLLM's VLLM_CPU_OMP_THREADS_BIND).
//
// The calling thread's intra-op threads become one per CPU of the list, thread i pinned to
// cpus[i], except thread 0, the caller itself: it keeps its CPU set, because every process it
// starts later inherits that set (a server's subprocesses, a user's own), and with the other
// threads pinned elsewhere the OS keeps it on cpus[0] anyway. The pool keeps its threads
// between parallel regions, so the pinning holds for every later op from the same caller. A thread that the OS may move between cores loses
// its L1/L2 contents with each move and, when two land on one core, stalls every parallel
// region until the slower one catches up.

#include <ATen/Parallel.h>
#include <torch/library.h>

#include <pthread.h>
#include <sched.h>

#include <atomic>
#include <cstdint>
#include <vector>

namespace axon_cpu {
namespace {

// Returns how many threads were pinned (all but the caller, or an error is raised).
int64_t bind_threads(std::vector<int64_t> cpus) {
  const int64_t n = static_cast<int64_t>(cpus.size());
  TORCH_CHECK(n > 0, "bind_threads needs at least one CPU");
  at::set_num_threads(static_cast<int>(n));
  std::atomic<int64_t> pinned{0}, failed_cpu{-1};
  // One item per thread: torch's OpenMP parallel_for gives thread t the chunk [t, t + 1).
  at::parallel_for(0, n, 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int tid = at::get_thread_num();
      if (tid == 0) continue;
      const int64_t cpu = cpus[tid];
      cpu_set_t set;
      CPU_ZERO(&set);
      CPU_SET(static_cast<int>(cpu), &set);
      if (pthread_setaffinity_np(pthread_self(), sizeof(set), &set) == 0) {
        pinned.fetch_add(1);
      } else {
        failed_cpu.store(cpu);
      }
    }
  });
  TORCH_CHECK(failed_cpu.load() < 0, "could not pin a thread to CPU ", failed_cpu.load());
  return pinned.load();
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(axon_cpu, m) { m.def("bind_threads(int[] cpus) -> int"); }

TORCH_LIBRARY_IMPL(axon_cpu, CatchAll, m) { m.impl("bind_threads", &bind_threads); }

}  // namespace axon_cpu
