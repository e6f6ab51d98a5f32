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

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#if defined(__AVX512BF16__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <optional>

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
    __m512bh w[4];
    for (int b = 0; b < 4; ++b) w[b] = (__m512bh)_mm512_loadu_si512(step + 32 * b);
    for (int m = 0; m < MB; ++m) {
      int32_t pair;
      std::memcpy(&pair, x + m * ldx + 2 * k2, sizeof(pair));
      const __m512bh a = (__m512bh)_mm512_set1_epi32(pair);
      for (int b = 0; b < 4; ++b) acc[m][b] = _mm512_dpbf16_ps(acc[m][b], a, w[b]);
    }
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
        switch (std::min<int64_t>(kRowsPerPass, M - m0)) {
          case 6: panel_rows<6>(xm, K, panel, K2, next, pass, passes, acc); store_rows<6>(acc, ym, N, g * kGroupCols, N, bias); break;
          case 5: panel_rows<5>(xm, K, panel, K2, next, pass, passes, acc); store_rows<5>(acc, ym, N, g * kGroupCols, N, bias); break;
          case 4: panel_rows<4>(xm, K, panel, K2, next, pass, passes, acc); store_rows<4>(acc, ym, N, g * kGroupCols, N, bias); break;
          case 3: panel_rows<3>(xm, K, panel, K2, next, pass, passes, acc); store_rows<3>(acc, ym, N, g * kGroupCols, N, bias); break;
          case 2: panel_rows<2>(xm, K, panel, K2, next, pass, passes, acc); store_rows<2>(acc, ym, N, g * kGroupCols, N, bias); break;
          default: panel_rows<1>(xm, K, panel, K2, next, pass, passes, acc); store_rows<1>(acc, ym, N, g * kGroupCols, N, bias); break;
        }
      }
    }
  });
}

#endif  // __AVX512BF16__

// x [..., K] bf16 (rows contiguous), packed from pack_linear_weight of an [N, K] weight
// -> [..., N] in out_dtype (bfloat16 or float32), plus bias (any float dtype) if given.
at::Tensor packed_linear(const at::Tensor& x, const at::Tensor& packed, int64_t N,
                         const std::optional<at::Tensor>& bias, bool float_out) {
#if defined(__AVX512BF16__)
  TORCH_CHECK(x.scalar_type() == at::kBFloat16, "packed_linear takes bfloat16 input, got ", x.scalar_type());
  const int64_t K = x.size(-1);
  TORCH_CHECK(K % 2 == 0 && packed.numel() == (N + kGroupCols - 1) / kGroupCols * K * kGroupCols,
              "packed weight does not match ", N, " outputs of ", K, " inputs");
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
  const uint16_t* wp = reinterpret_cast<const uint16_t*>(packed.data_ptr<c10::BFloat16>());
  if (float_out) {
    run_linear<float>(xp, M, K, wp, N, b, y.data_ptr<float>());
  } else {
    run_linear<c10::BFloat16>(xp, M, K, wp, N, b, y.data_ptr<c10::BFloat16>());
  }
  return y;
#else
  TORCH_CHECK(false, "packed_linear needs a CPU with AVX-512 BF16 (see linear_supported())");
#endif
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(axon_cpu, m) {
  m.def("linear_supported() -> bool");
  m.def("pack_linear_weight(Tensor weight) -> Tensor");
  m.def("packed_linear(Tensor x, Tensor packed, int N, Tensor? bias, bool float_out) -> Tensor");
}

TORCH_LIBRARY_IMPL(axon_cpu, CatchAll, m) { m.impl("linear_supported", &linear_supported); }

TORCH_LIBRARY_IMPL(axon_cpu, CPU, m) {
  m.impl("pack_linear_weight", &pack_linear_weight);
  m.impl("packed_linear", &packed_linear);
}

}  // namespace axon_cpu
