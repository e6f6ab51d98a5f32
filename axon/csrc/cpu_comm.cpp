// Collectives between the tensor-parallel ranks of one host, through shared memory.
//
// gloo's all-reduce between two processes on one host took 1.4 ms for a 16 x 576 tensor (TCP
// over loopback, a copy through the kernel each way): two per layer would cost SmolLM2's
// 30 layers 84 ms a step, seven times the step itself. Here every rank writes its tensor into
// its own slot of a shared segment, marks its sequence number, waits until every rank has
// marked the same number, then reads every slot itself: one copy in, one pass out, and no
// system call unless a rank has to wait long.
//
// Segment layout (created and sized by the executor, mapped by each rank):
//   world flags, one cache line each (the last sequence number the rank has written)
//   2 buffers x world slots x slot_bytes
// Step s writes buffer s % 2. A rank writing buffer b at step s has passed step s-1's barrier,
// so every rank has finished step s-2, the last one that read buffer b: two buffers need one
// barrier per step. A tensor larger than a slot goes through in slot-sized chunks, each a step.
//
// All-reduce sums the slots in rank order in float32 on every rank, so every rank gets the same
// bits (the ranks then sample the same tokens), and a result does not depend on which rank
// finished first.

#include <ATen/ATen.h>
#include <torch/library.h>

#include <fcntl.h>
#include <sched.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>
#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <deque>
#include <string>

namespace axon_cpu {
namespace {

// Pauses before a waiting rank yields its core (then it yields between checks). Ranks on cores
// of their own meet within this: yielding after 64 pauses made a [16, 576] all-reduce 28 us
// instead of 9 on a loaded 2-core host. Ranks that share cores (nobind, more ranks than cores)
// pay this spin whenever the peer they wait for is descheduled.
constexpr int kSpinsBeforeYield = 4096;

struct alignas(64) Flag {
  std::atomic<uint64_t> seq;
  char pad[64 - sizeof(std::atomic<uint64_t>)];
};

struct Comm {
  char* base = nullptr;
  size_t size = 0;
  int64_t rank = 0, world = 1, slot_bytes = 0;
  uint64_t seq = 0;

  Flag* flags() const { return reinterpret_cast<Flag*>(base); }
  char* slot(uint64_t step, int64_t r) const {
    const size_t header = static_cast<size_t>(world) * sizeof(Flag);
    return base + header + ((step % 2) * world + r) * slot_bytes;
  }
  // Marks this rank's arrival at the next step and waits for every other rank's.
  uint64_t arrive_and_wait() {
    const uint64_t step = ++seq;
    flags()[rank].seq.store(step, std::memory_order_release);
    for (int64_t r = 0; r < world; ++r) {
      int spins = 0;
      while (flags()[r].seq.load(std::memory_order_acquire) < step) {
        // Spin while the peer is about to arrive; yield the core if it is not (an
        // oversubscribed host would otherwise spin away the peer's time).
        if (++spins < kSpinsBeforeYield) {
          _mm_pause();
        } else {
          sched_yield();
        }
      }
    }
    return step;
  }
};

std::deque<Comm> comms;  // handles are indices; a deque keeps references stable

int64_t segment_bytes(int64_t world, int64_t slot_bytes) {
  return world * static_cast<int64_t>(sizeof(Flag)) + 2 * world * slot_bytes;
}

// Maps the segment at path (a zero-filled file under /dev/shm) for
// this rank; returns the handle the collectives take. (parallel_state.shm_segment_bytes computes
// the same size for the executor.)
int64_t shm_comm_open(const std::string& path, int64_t rank, int64_t world, int64_t slot_bytes) {
  TORCH_CHECK(world >= 1 && rank >= 0 && rank < world, "shm_comm_open: rank ", rank, " of world ", world);
  TORCH_CHECK(slot_bytes > 0 && slot_bytes % 64 == 0, "shm_comm_open: slot_bytes must be a positive multiple of 64");
  const int fd = ::open(path.c_str(), O_RDWR);
  TORCH_CHECK(fd >= 0, "shm_comm_open: cannot open ", path);
  struct stat st;
  const bool sized = fstat(fd, &st) == 0 && st.st_size == segment_bytes(world, slot_bytes);
  if (!sized) ::close(fd);
  TORCH_CHECK(sized, "shm_comm_open: ", path, " is not ", segment_bytes(world, slot_bytes), " bytes");
  void* base = mmap(nullptr, st.st_size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  ::close(fd);
  TORCH_CHECK(base != MAP_FAILED, "shm_comm_open: mmap of ", path, " failed");
  Comm c;
  c.base = static_cast<char*>(base);
  c.size = st.st_size;
  c.rank = rank;
  c.world = world;
  c.slot_bytes = slot_bytes;
  comms.push_back(c);
  return static_cast<int64_t>(comms.size()) - 1;
}

Comm& get(int64_t handle) {
  TORCH_CHECK(handle >= 0 && handle < static_cast<int64_t>(comms.size()) && comms[handle].base,
              "no shared-memory communicator ", handle, " in this process");
  return comms[handle];
}

inline float load_float(const float* p, int64_t i) { return p[i]; }
inline float load_float(const uint16_t* p, int64_t i) {  // bfloat16 bits
  uint32_t bits = static_cast<uint32_t>(p[i]) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}
inline void store_float(float* p, int64_t i, float v) { p[i] = v; }
inline void store_float(uint16_t* p, int64_t i, float v) {  // round to nearest even
  uint32_t bits;
  std::memcpy(&bits, &v, 4);
  bits += 0x7FFF + ((bits >> 16) & 1);
  p[i] = static_cast<uint16_t>(bits >> 16);
}

template <typename T>
void reduce_chunk(const Comm& c, uint64_t step, T* out, int64_t n) {
  constexpr int64_t kBlock = 256;
  float acc[kBlock];
  for (int64_t i0 = 0; i0 < n; i0 += kBlock) {
    const int64_t len = std::min(kBlock, n - i0);
    const T* first = reinterpret_cast<const T*>(c.slot(step, 0)) + i0;
    for (int64_t j = 0; j < len; ++j) acc[j] = load_float(first, j);
    for (int64_t r = 1; r < c.world; ++r) {
      const T* src = reinterpret_cast<const T*>(c.slot(step, r)) + i0;
      for (int64_t j = 0; j < len; ++j) acc[j] += load_float(src, j);
    }
    for (int64_t j = 0; j < len; ++j) store_float(out + i0, j, acc[j]);
  }
}

// The sum over ranks of x (float32 or bfloat16), the same bits on every rank.
at::Tensor shm_all_reduce(const at::Tensor& x, int64_t handle) {
  Comm& c = get(handle);
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16,
              "shm_all_reduce takes float32 or bfloat16, got ", x.scalar_type());
  const at::Tensor in = x.contiguous();
  at::Tensor out = at::empty_like(in);
  const int64_t elem = in.element_size(), n = in.numel();
  const int64_t chunk = c.slot_bytes / elem;
  const char* src = static_cast<const char*>(in.data_ptr());
  char* dst = static_cast<char*>(out.data_ptr());
  for (int64_t off = 0; off < n; off += chunk) {
    const int64_t len = std::min(chunk, n - off);
    std::memcpy(c.slot(c.seq + 1, c.rank), src + off * elem, len * elem);
    const uint64_t step = c.arrive_and_wait();
    if (x.scalar_type() == at::kFloat) {
      reduce_chunk(c, step, reinterpret_cast<float*>(dst) + off, len);
    } else {
      reduce_chunk(c, step, reinterpret_cast<uint16_t*>(dst) + off, len);
    }
  }
  return out;
}

// Every rank's x, stacked: [world, *x.shape] (x has the same shape on every rank; world is
// given so that a compiled graph knows the output's shape).
at::Tensor shm_all_gather(const at::Tensor& x, int64_t handle, int64_t world) {
  Comm& c = get(handle);
  TORCH_CHECK(world == c.world, "shm_all_gather: communicator ", handle, " has ", c.world, " ranks, not ", world);
  const at::Tensor in = x.contiguous();
  std::vector<int64_t> shape{c.world};
  for (int64_t d : in.sizes()) shape.push_back(d);
  at::Tensor out = at::empty(shape, in.options());
  const int64_t bytes = in.numel() * in.element_size();
  const char* src = static_cast<const char*>(in.data_ptr());
  char* dst = static_cast<char*>(out.data_ptr());
  for (int64_t off = 0; off < bytes; off += c.slot_bytes) {
    const int64_t len = std::min(c.slot_bytes, bytes - off);
    std::memcpy(c.slot(c.seq + 1, c.rank), src + off, len);
    const uint64_t step = c.arrive_and_wait();
    for (int64_t r = 0; r < c.world; ++r) std::memcpy(dst + r * bytes + off, c.slot(step, r), len);
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(axon_cpu, m) {
  m.def("shm_comm_open(str path, int rank, int world, int slot_bytes) -> int");
  m.def("shm_all_reduce(Tensor x, int handle) -> Tensor");
  m.def("shm_all_gather(Tensor x, int handle, int world) -> Tensor");
}

TORCH_LIBRARY_IMPL(axon_cpu, CatchAll, m) {
  m.impl("shm_comm_open", &shm_comm_open);
}

TORCH_LIBRARY_IMPL(axon_cpu, CPU, m) {
  m.impl("shm_all_reduce", &shm_all_reduce);
  m.impl("shm_all_gather", &shm_all_gather);
}

}  // namespace axon_cpu
