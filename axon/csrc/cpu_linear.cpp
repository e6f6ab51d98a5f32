// bfloat16 linear layers on AVX-512 BF16: y = x W^T (+ bias), weights packed once at load.
//
// A decode step multiplies a few rows by every weight of the model, so it is bound by how fast
// the weights stream from memory, and a prefill by the dot-product units. One kernel serves
// both: the packed weight is read exactly once per call, in address order, and each 64-byte
// weight vector feeds up to six rows' dot products (``vdpbf16ps``: 16 float32 lanes, each
// accumulating two bf16 products).
//
// Packed layout, for N output columns and K inputs (K even): columns in groups of 64, each a
// contiguous panel of K / 2 steps; one step holds, for each of the group's four 16-column
// blocks, the 16 columns' two consecutive inputs:
//
//   packed[group][k / 2][block 0..3][column 0..15][k % 2]       (group = n / 64, 64 bytes a block)
//
// so one step is four vectors of 32 bf16 that ``vdpbf16ps`` multiplies by a broadcast pair
// (x[m][k], x[m][k + 1]). Columns past N are zero.
//
// Threads split the column groups; each walks its panels once per chunk of 256 rows, six rows
// at a time (24 accumulators: six rows gave 455 GFLOP/s on 2 Zen 4 cores where four gave 360, the
// weight vectors now feeding 24 products each), so a panel (K * 128 bytes) is re-read from L2, not memory, and
// a chunk's inputs stay in L2 while the panels pass.
//
// On CPUs with AMX (Intel Xeon since Sapphire Rapids) the same packed layout feeds the tile
// unit instead: a panel's 16 steps for one block are exactly a B tile of TDPBF16PS (16 rows of
// 16 columns' input pairs, 256 bytes apart), and 16 rows of x over 32 inputs are an A tile. Every
// row count runs on tiles, a single decode row too (padded to 16 rows: the tile unit is so fast
// that a decode step stays bound by the weight stream), so a row's result never depends on how
// many rows share the call: one kernel, one summation order, batch-invariant by construction.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#if defined(__AVX512BF16__)
#include <immintrin.h>
#endif

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#define AXON_AMX 1
#include <sys/syscall.h>
#include <unistd.h>
#endif

#include <atomic>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <optional>
#include <type_traits>
#include <vector>

#include "cpu_vec.h"

namespace axon_cpu {
namespace {

constexpr int64_t kGroupCols = 64;                  // columns per panel
constexpr int64_t kStepElems = kGroupCols * 2;      // bf16 per step of a panel
constexpr int64_t kRowsPerPass = 6;  // 24 accumulators + 4 weight vectors + 1 broadcast: 29 of 32 registers
constexpr int64_t kRowChunk = 256;  // rows whose inputs stay in L2 while a thread's panels pass

bool linear_supported() {
#if defined(__AVX512BF16__)
  return true;
#else
  return false;
#endif
}

// [N, K] -> the packed layout above, as a flat bf16 tensor.
at::Tensor pack_linear_weight(const at::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kBFloat16,
              "pack_linear_weight takes a 2-D bfloat16 weight, got ", weight.sizes(), " ", weight.scalar_type());
  const int64_t N = weight.size(0), K = weight.size(1);
  TORCH_CHECK(K % 2 == 0, "pack_linear_weight needs an even number of inputs, got ", K);
  const at::Tensor w = weight.contiguous();
  const int64_t groups = (N + kGroupCols - 1) / kGroupCols, K2 = K / 2;
  at::Tensor packed = at::zeros({groups * K2 * kStepElems}, weight.options());
  const uint16_t* src = reinterpret_cast<const uint16_t*>(w.data_ptr<c10::BFloat16>());
  uint16_t* dst = reinterpret_cast<uint16_t*>(packed.data_ptr<c10::BFloat16>());
  at::parallel_for(0, groups, 1, [&](int64_t begin, int64_t end) {
    for (int64_t g = begin; g < end; ++g) {
      for (int64_t c = 0; c < kGroupCols; ++c) {
        const int64_t n = g * kGroupCols + c;
        if (n >= N) break;
        const uint16_t* row = src + n * K;
        uint16_t* out = dst + g * K2 * kStepElems + c * 2;  // block c / 16, column c % 16
        for (int64_t k2 = 0; k2 < K2; ++k2) {
          out[k2 * kStepElems] = row[2 * k2];
          out[k2 * kStepElems + 1] = row[2 * k2 + 1];
        }
      }
    }
  });
  return packed;
}

#if defined(__AVX512BF16__)

// acc[m][b] += rows m < MB of x (ldx apart) at inputs 2 k2, 2 k2 + 1 times one step of a panel
// (w: its 4 blocks of 2 inputs x 16 columns, bf16).
template <int MB>
inline void step_rows(const uint16_t* x, int64_t ldx, const __m512i (&w)[4], int64_t k2,
                      __m512 (&acc)[kRowsPerPass][4]) {
  for (int m = 0; m < MB; ++m) {
    int32_t pair;
    std::memcpy(&pair, x + m * ldx + 2 * k2, sizeof(pair));
    const __m512bh a = (__m512bh)_mm512_set1_epi32(pair);
    for (int b = 0; b < 4; ++b) acc[m][b] = _mm512_dpbf16_ps(acc[m][b], a, (__m512bh)w[b]);
  }
}

// The same, the step read from memory.
template <int MB>
inline void step_rows(const uint16_t* x, int64_t ldx, const uint16_t* step, int64_t k2,
                      __m512 (&acc)[kRowsPerPass][4]) {
  __m512i w[4];
  for (int b = 0; b < 4; ++b) w[b] = _mm512_loadu_si512(step + 32 * b);
  step_rows<MB>(x, ldx, w, k2, acc);
}

// fn(std::integral_constant<int, MB>{}) for MB = rows, 1 .. kMax: the row loops size their
// register blocks at compile time.
template <int kMax = kRowsPerPass, typename Fn>
inline void with_rows(int64_t rows, Fn&& fn) {
  static_assert(kMax >= 1 && kMax <= 6);
  switch (std::min<int64_t>(rows, kMax)) {
    case 6: if constexpr (kMax >= 6) fn(std::integral_constant<int, 6>{}); break;
    case 5: if constexpr (kMax >= 5) fn(std::integral_constant<int, 5>{}); break;
    case 4: if constexpr (kMax >= 4) fn(std::integral_constant<int, 4>{}); break;
    case 3: if constexpr (kMax >= 3) fn(std::integral_constant<int, 3>{}); break;
    case 2: if constexpr (kMax >= 2) fn(std::integral_constant<int, 2>{}); break;
    default: fn(std::integral_constant<int, 1>{}); break;
  }
}

// Rows m0 .. m0 + MB - 1 times one panel: acc[m][b] = 16 columns of block b. ``next`` is the
// thread's next panel (or nullptr): pass ``pass`` of the ``passes`` row passes over this panel
// fetches its share of it into L2, spread over the pass, so memory streams the next panel while
// every pass computes (fetching it all in the first pass left the later passes' compute and the
// memory stream one after the other: 16 rows took as long as one row's read plus 16 rows'
// arithmetic).
template <int MB>
inline void panel_rows(const uint16_t* x, int64_t ldx, const uint16_t* panel, int64_t K2, const uint16_t* next,
                       int64_t pass, int64_t passes, __m512 (&acc)[kRowsPerPass][4]) {
  const int64_t share = (K2 + passes - 1) / passes;  // next-panel steps this pass fetches
  const int64_t first = pass * share, last = std::min(K2, first + share);
  for (int m = 0; m < MB; ++m) {
    for (int b = 0; b < 4; ++b) acc[m][b] = _mm512_setzero_ps();
  }
  for (int64_t k2 = 0; k2 < K2; ++k2) {
    const uint16_t* step = panel + k2 * kStepElems;
    if (next != nullptr && k2 % passes == 0 && first + k2 / passes < last) {
      const char* p = reinterpret_cast<const char*>(next + (first + k2 / passes) * kStepElems);
      for (int line = 0; line < 4; ++line) _mm_prefetch(p + 64 * line, _MM_HINT_T1);
    }
    step_rows<MB>(x, ldx, step, k2, acc);
  }
}

template <typename out_t>
inline void store16(out_t* dst, __m512 v, __mmask16 mask);

template <>
inline void store16<float>(float* dst, __m512 v, __mmask16 mask) {
  _mm512_mask_storeu_ps(dst, mask, v);
}

template <>
inline void store16<c10::BFloat16>(c10::BFloat16* dst, __m512 v, __mmask16 mask) {
  _mm256_mask_storeu_epi16(dst, mask, (__m256i)_mm512_cvtneps_pbh(v));  // round to nearest even
}

template <int MB, typename out_t>
inline void store_rows(__m512 (&acc)[kRowsPerPass][4], out_t* y, int64_t ldy, int64_t col0, int64_t N, const float* bias) {
  for (int b = 0; b < 4; ++b) {
    const int64_t c = col0 + 16 * b;
    if (c >= N) break;
    const __mmask16 mask = N - c >= 16 ? static_cast<__mmask16>(0xffff) : static_cast<__mmask16>((1u << (N - c)) - 1u);
    const __m512 bv = bias != nullptr ? _mm512_maskz_loadu_ps(mask, bias + c) : _mm512_setzero_ps();
    for (int m = 0; m < MB; ++m) store16<out_t>(y + m * ldy + c, _mm512_add_ps(acc[m][b], bv), mask);
  }
}

template <typename out_t>
void run_linear(const uint16_t* x, int64_t M, int64_t K, const uint16_t* packed, int64_t N, const float* bias,
                out_t* y) {
  const int64_t groups = (N + kGroupCols - 1) / kGroupCols, K2 = K / 2;
  // Enough groups per task to keep a thread's weight stream long; every thread gets work.
  const int64_t grain = std::max<int64_t>(1, groups / (4 * at::get_num_threads()));
  at::parallel_for(0, groups, grain, [&](int64_t begin, int64_t end) {
    __m512 acc[kRowsPerPass][4];
    for (int64_t chunk = 0; chunk < M; chunk += kRowChunk)
    for (int64_t g = begin; g < end; ++g) {
      const uint16_t* panel = packed + g * K2 * kStepElems;
      const uint16_t* next = g + 1 < end ? panel + K2 * kStepElems : nullptr;
      const int64_t chunk_end = std::min(M, chunk + kRowChunk);
      const int64_t passes = (chunk_end - chunk + kRowsPerPass - 1) / kRowsPerPass;
      for (int64_t m0 = chunk; m0 < chunk_end; m0 += kRowsPerPass) {
        const uint16_t* xm = x + m0 * K;
        out_t* ym = y + m0 * N;
        const int64_t pass = (m0 - chunk) / kRowsPerPass;
        with_rows(M - m0, [&](auto rows) {
          constexpr int MB = decltype(rows)::value;
          panel_rows<MB>(xm, K, panel, K2, next, pass, passes, acc);
          store_rows<MB>(acc, ym, N, g * kGroupCols, N, bias);
        });
      }
    }
  });
}


#if defined(AXON_AMX)

// Linux hands out the tile registers' state only to processes that ask (arch_prctl), once.
bool request_amx_permission() {
  constexpr int kArchReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
  return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
}

bool amx_available() {
  static const bool ok = request_amx_permission();
  return ok;
}

// Tiles 0-3: C, 16 rows x 16 float32 columns (one per block of the panel); 4: A, 16 rows x 32
// bf16 inputs; 5-7: B, 16 input pairs x 16 columns. All 16 rows of 64 bytes.
struct alignas(64) TileConfig {
  uint8_t palette_id = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// GCC sees only the first byte of the config read by _tile_loadconfig and drops the stores to
// the rest as dead (leaving every tile zero-sized: the next tile instruction faults); the empty
// asm that may read all memory keeps them.
inline void load_tile_config(const TileConfig& cfg) {
  asm volatile("" : : "r"(&cfg) : "memory");
  _tile_loadconfig(&cfg);
}

void configure_tiles() {
  TileConfig cfg;
  for (int t = 0; t < 8; ++t) {
    cfg.colsb[t] = 64;
    cfg.rows[t] = 16;
  }
  load_tile_config(cfg);
}

constexpr int64_t kTileRows = 16;
constexpr int64_t kTileSteps = 16;  // input pairs (32 inputs) per tile product

// 16 rows (x, ldx elements apart) times one panel over the first K2T steps (a multiple of 16)
// into c (16 x 64 float32), one half of the panel (two blocks) at a time: two accumulators, two
// A tiles and four B tiles, so each pass has four independent weight loads in flight (with four
// accumulators and three B tiles every load waited for the product before it). The rest of the
// panel's steps (K2 - K2T < 16) is added with vdpbf16ps after the tiles, for the valid rows
// only: the same order for every row count.
inline void panel_tiles(const uint16_t* x, int64_t ldx, const uint16_t* panel, int64_t K2, int64_t K2T,
                        const uint16_t* next, float* c) {
  constexpr int64_t kStepBytes = kStepElems * 2;
  const int64_t next_lines = next != nullptr ? K2 * kStepBytes / 64 : 0;
  const int64_t iterations = 2 * std::max<int64_t>(1, K2T / kTileSteps);
  const int64_t lines_per_iteration = (next_lines + iterations - 1) / iterations;
  const char* nb = reinterpret_cast<const char*>(next);
  int64_t fetched = 0;
  for (int half = 0; half < 2; ++half) {
    _tile_zero(0);
    _tile_zero(1);
    const uint16_t* base = panel + 64 * half;
    int64_t k2 = 0;
    for (; k2 + 2 * kTileSteps <= K2T; k2 += 2 * kTileSteps) {
      const uint16_t* step = base + k2 * kStepElems;
      const uint16_t* step2 = step + kTileSteps * kStepElems;
      _tile_loadd(2, step, kStepBytes);
      _tile_loadd(3, step + 32, kStepBytes);
      _tile_loadd(6, step2, kStepBytes);
      _tile_loadd(7, step2 + 32, kStepBytes);
      _tile_loadd(4, x + 2 * k2, ldx * 2);
      _tile_loadd(5, x + 2 * (k2 + kTileSteps), ldx * 2);
      // The sums keep panel_tiles_pair's order: step k2's product, then step k2 + 16's.
      _tile_dpbf16ps(0, 4, 2);
      _tile_dpbf16ps(1, 4, 3);
      _tile_dpbf16ps(0, 5, 6);
      _tile_dpbf16ps(1, 5, 7);
      // Stream the thread's next panel into L2 while this one computes.
      for (int64_t i = 0; i < 2 * lines_per_iteration && fetched < next_lines; ++i, ++fetched) {
        _mm_prefetch(nb + 64 * fetched, _MM_HINT_T1);
      }
    }
    if (k2 < K2T) {  // an odd number of tile steps
      const uint16_t* step = base + k2 * kStepElems;
      _tile_loadd(2, step, kStepBytes);
      _tile_loadd(3, step + 32, kStepBytes);
      _tile_loadd(4, x + 2 * k2, ldx * 2);
      _tile_dpbf16ps(0, 4, 2);
      _tile_dpbf16ps(1, 4, 3);
    }
    _tile_stored(0, c + 32 * half, kGroupCols * 4);
    _tile_stored(1, c + 32 * half + 16, kGroupCols * 4);
  }
}

// Two 16-row blocks (x0, x1) times one half of a panel (blocks 2 * half and 2 * half + 1) into
// rows 0-15 and 16-31 of c (32 x 64 float32): each B tile feeds two products, halving the
// panel's reads from L2 per product for prefills and large batches. Every output element sums
// the same tile products in the same order as panel_tiles computes it.
inline void panel_tiles_pair(const uint16_t* x0, const uint16_t* x1, int64_t ldx, const uint16_t* panel, int64_t K2T,
                             int half, float* c) {
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  constexpr int64_t kStepBytes = kStepElems * 2;
  for (int64_t k2 = 0; k2 < K2T; k2 += kTileSteps) {
    const uint16_t* step = panel + k2 * kStepElems + 64 * half;
    _tile_loadd(4, x0 + 2 * k2, ldx * 2);
    _tile_loadd(6, step, kStepBytes);
    _tile_dpbf16ps(0, 4, 6);
    _tile_loadd(7, step + 32, kStepBytes);
    _tile_dpbf16ps(1, 4, 7);
    _tile_loadd(5, x1 + 2 * k2, ldx * 2);
    _tile_dpbf16ps(2, 5, 6);
    _tile_dpbf16ps(3, 5, 7);
  }
  float* ch = c + 32 * half;
  _tile_stored(0, ch, kGroupCols * 4);
  _tile_stored(1, ch + 16, kGroupCols * 4);
  _tile_stored(2, ch + kTileRows * kGroupCols, kGroupCols * 4);
  _tile_stored(3, ch + kTileRows * kGroupCols + 16, kGroupCols * 4);
}

// The rows past the last full 16 of x [M, K], copied into a zero-padded block of 16 rows, once
// per call, in a buffer kept per calling thread (allocating it each call cost a decode step's
// small layers a fifth of their time) and read by the pool's threads. Only its first
// ``tail_dirty`` elements can be non-zero, so a decode step copies its one row and clears nothing.
const uint16_t* padded_tail_rows(const uint16_t* x, int64_t M, int64_t K) {
  const int64_t full = M / kTileRows * kTileRows;
  thread_local std::vector<uint16_t> tail;
  thread_local int64_t tail_dirty = 0;
  if (M > full) {
    if (static_cast<int64_t>(tail.size()) < kTileRows * K) tail.resize(kTileRows * K, 0);
    const int64_t written = (M - full) * K;
    std::memcpy(tail.data(), x + full * K, written * sizeof(uint16_t));
    if (tail_dirty > written) std::memset(tail.data() + written, 0, (tail_dirty - written) * sizeof(uint16_t));
    tail_dirty = written;
  }
  return tail.data();
}

template <typename out_t>
void run_linear_amx(const uint16_t* x, int64_t M, int64_t K, const uint16_t* packed, int64_t N, const float* bias,
                    out_t* y) {
  const int64_t groups = (N + kGroupCols - 1) / kGroupCols, K2 = K / 2;
  const int64_t K2T = K2 / kTileSteps * kTileSteps;
  const int64_t full = M / kTileRows * kTileRows;
  const uint16_t* padded = padded_tail_rows(x, M, K);
  const int64_t grain = std::max<int64_t>(1, groups / (4 * at::get_num_threads()));
  at::parallel_for(0, groups, grain, [&](int64_t begin, int64_t end) {
    configure_tiles();
    alignas(64) float c[2 * kTileRows * kGroupCols];
    for (int64_t chunk = 0; chunk < M; chunk += kRowChunk)
    for (int64_t g = begin; g < end; ++g) {
      const uint16_t* panel = packed + g * K2 * kStepElems;
      const uint16_t* next = g + 1 < end && chunk + kRowChunk >= M ? panel + K2 * kStepElems : nullptr;
      const int64_t chunk_end = std::min(M, chunk + kRowChunk);
      for (int64_t m0 = chunk; m0 < chunk_end;) {
        // Two whole blocks of rows at a time where there are two, else one (padded).
        const bool pair = m0 + 2 * kTileRows <= std::min(full, chunk_end);
        const int64_t rows = pair ? 2 * kTileRows : std::min(kTileRows, M - m0);
        const uint16_t* xm = m0 < full ? x + m0 * K : padded;
        if (pair) {
          panel_tiles_pair(xm, xm + kTileRows * K, K, panel, K2T, 0, c);
          panel_tiles_pair(xm, xm + kTileRows * K, K, panel, K2T, 1, c);
        } else {
          panel_tiles(xm, K, panel, K2, K2T, next, c);
        }
        for (int64_t r = 0; r < rows; ++r) {
          __m512 acc[kRowsPerPass][4];
          for (int b = 0; b < 4; ++b) acc[0][b] = _mm512_load_ps(c + r * kGroupCols + 16 * b);
          for (int64_t k2 = K2T; k2 < K2; ++k2) {  // the inputs past the last whole tile
            int32_t pair_in;
            std::memcpy(&pair_in, xm + r * K + 2 * k2, sizeof(pair_in));
            const __m512bh a = (__m512bh)_mm512_set1_epi32(pair_in);
            const uint16_t* step = panel + k2 * kStepElems;
            for (int b = 0; b < 4; ++b) {
              acc[0][b] = _mm512_dpbf16_ps(acc[0][b], a, (__m512bh)_mm512_loadu_si512(step + 32 * b));
            }
          }
          store_rows<1>(acc, y + (m0 + r) * N, N, g * kGroupCols, N, bias);
        }
        m0 += rows;
      }
    }
    _tile_release();
  });
}

#endif  // AXON_AMX

#endif  // __AVX512BF16__

// Whether packed_linear runs on tiles: on by default where the CPU and the OS allow it; tests
// and benchmarks turn it off to run the AVX-512 path on the same machine.
std::atomic<bool> use_amx{true};

bool linear_amx_available() {
#if defined(AXON_AMX)
  return amx_available();
#else
  return false;
#endif
}

// Sets whether packed_linear may use AMX; returns the previous setting.
bool set_linear_amx(bool enabled) { return use_amx.exchange(enabled); }

bool linear_uses_amx() { return use_amx.load() && linear_amx_available(); }

#if defined(__AVX512BF16__)
// AMX tiles where the CPU has them and they are not turned off, else AVX-512 BF16.
template <typename out_t>
void run_linear_on_best_path(const uint16_t* x, int64_t M, int64_t K, const uint16_t* packed, int64_t N,
                             const float* bias, out_t* y) {
#if defined(AXON_AMX)
  if (linear_uses_amx()) {
    run_linear_amx<out_t>(x, M, K, packed, N, bias, y);
    return;
  }
#endif
  run_linear<out_t>(x, M, K, packed, N, bias, y);
}
#endif

// What every linear op does around its kernel: x [..., K] bf16 (rows made contiguous) ->
// y [..., N] in float32 or bf16, the bias as float32; ``run(x_rows, M, K, bias, y)`` fills y.
template <typename Run>
at::Tensor linear_call(const at::Tensor& x, int64_t N, const std::optional<at::Tensor>& bias, bool float_out,
                       const Run& run) {
  const int64_t K = x.size(-1);
  const at::Tensor rows = x.reshape({-1, K}).contiguous();
  const int64_t M = rows.size(0);
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = N;
  at::Tensor y = at::empty(shape, x.options().dtype(float_out ? at::kFloat : at::kBFloat16));
  if (M == 0) return y;
  at::Tensor bias_f;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->numel() == N, "bias has ", bias->numel(), " values for ", N, " outputs");
    bias_f = bias->to(at::kFloat).contiguous();
  }
  const float* b = bias_f.defined() ? bias_f.data_ptr<float>() : nullptr;
  const uint16_t* xp = reinterpret_cast<const uint16_t*>(rows.data_ptr<c10::BFloat16>());
  if (float_out) {
    run(xp, M, K, b, y.data_ptr<float>());
  } else {
    run(xp, M, K, b, y.data_ptr<c10::BFloat16>());
  }
  return y;
}

// x [..., K] bf16 (rows contiguous), packed from pack_linear_weight of an [N, K] weight
// -> [..., N] in out_dtype (bfloat16 or float32), plus bias (any float dtype) if given.
at::Tensor packed_linear(const at::Tensor& x, const at::Tensor& packed, int64_t N,
                         const std::optional<at::Tensor>& bias, bool float_out) {
#if defined(__AVX512BF16__)
  TORCH_CHECK(x.scalar_type() == at::kBFloat16, "packed_linear takes bfloat16 input, got ", x.scalar_type());
  const int64_t K = x.size(-1);
  TORCH_CHECK(K % 2 == 0 && packed.numel() == (N + kGroupCols - 1) / kGroupCols * K * kGroupCols,
              "packed weight does not match ", N, " outputs of ", K, " inputs");
  const uint16_t* wp = reinterpret_cast<const uint16_t*>(packed.data_ptr<c10::BFloat16>());
  return linear_call(x, N, bias, float_out, [&](const uint16_t* xp, int64_t M, int64_t K, const float* b, auto* y) {
    run_linear_on_best_path(xp, M, K, wp, N, b, y);
  });
#else
  TORCH_CHECK(false, "packed_linear needs a CPU with AVX-512 BF16 (see linear_supported())");
#endif
}

#include "cpu_linear_quant.h"
#include "cpu_linear_w8a8.h"
#include "cpu_moe.h"

}  // namespace

TORCH_LIBRARY_FRAGMENT(axon_cpu, m) {
  m.def("linear_supported() -> bool");
  m.def("quant_linear_supported() -> bool");
  m.def("w8a8_linear_supported() -> bool");
  m.def("linear_amx_available() -> bool");
  m.def("linear_uses_amx() -> bool");
  m.def("set_linear_amx(bool enabled) -> bool");
  m.def("pack_linear_weight(Tensor weight) -> Tensor");
  m.def("packed_linear(Tensor x, Tensor packed, int N, Tensor? bias, bool float_out) -> Tensor");
  m.def(
      "quant_linear(Tensor x, Tensor codes, int kind, Tensor scales, Tensor? mins, int group, int N, Tensor? bias, "
      "bool float_out) -> Tensor");
  m.def(
      "w8a8_linear(Tensor x, Tensor codes, Tensor w_scales, Tensor col_sums, int N, Tensor? bias, bool float_out) "
      "-> Tensor");
  m.def(
      "fused_moe(Tensor x, Tensor router_logits, Tensor w13, Tensor w2, Tensor? w13_bias, Tensor? w2_bias, "
      "int top_k, bool renormalize, int intermediate, int first_expert, int routing, int activation, float alpha, "
      "float limit) -> Tensor");
  m.def(
      "fused_moe_quant(Tensor x, Tensor router_logits, Tensor w13_codes, Tensor w13_scales, Tensor? w13_mins, "
      "Tensor w2_codes, Tensor w2_scales, Tensor? w2_mins, int kind13, int kind2, int group13, int group2, "
      "Tensor? w13_bias, "
      "Tensor? w2_bias, int top_k, bool renormalize, int intermediate, int first_expert, int routing, int activation, "
      "float alpha, float limit) -> Tensor");
}

TORCH_LIBRARY_IMPL(axon_cpu, CatchAll, m) {
  m.impl("linear_supported", &linear_supported);
  m.impl("quant_linear_supported", &quant_linear_supported);
  m.impl("w8a8_linear_supported", &w8a8_linear_supported);
  m.impl("linear_amx_available", &linear_amx_available);
  m.impl("linear_uses_amx", &linear_uses_amx);
  m.impl("set_linear_amx", &set_linear_amx);
}

TORCH_LIBRARY_IMPL(axon_cpu, CPU, m) {
  m.impl("pack_linear_weight", &pack_linear_weight);
  m.impl("packed_linear", &packed_linear);
  m.impl("quant_linear", &quant_linear);
  m.impl("w8a8_linear", &w8a8_linear);
  m.impl("fused_moe", &fused_moe);
  m.impl("fused_moe_quant", &fused_moe_quant);
}

}  // namespace axon_cpu
