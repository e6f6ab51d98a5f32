// The pointwise layers of a decoder on the CPU, fused: RMSNorm (with the residual add before
// it), rotary embedding (neox style) and SiLU-and-multiply.
//
// Eager steps and compiled graphs both call these ops (a compiled graph sees each as one opaque
// op), so a token's hidden states do not depend on whether its step ran in a graph: Inductor's
// own code for a norm reduces in another order than torch's eager kernels, and keeps float32
// intermediates where eager rounds each op's output. Every output element is computed by code
// that depends only on its own row, never on how many rows the call has, so a request's
// numbers do not depend on its batch either. Arithmetic is float32; each output is rounded once
// to the storage dtype (nearest even), except where noted to match Hugging Face.
//
//   rms_norm(x [.., H], w [H], eps)                     w * round(x * rsqrt(mean(x^2) + eps))
//   add_rms_norm(x, residual, w, eps) -> (normed, sum)  sum = round(x + residual); normed of sum
//   silu_and_mul(gate_up [.., 2I]) -> [.., I]           silu(gate) * up
//   rotary_neox(positions [T], q [T, H, D], k [T, KVH, D], cos [P, D], sin [P, D]) -> (q', k')
//
// The norms round the normalized row before the weight multiplies it, as Hugging Face's
// RMSNorm does (``weight * h.to(dtype)``). Each exists with AVX-512 (any width: masked tails) and
// as plain loops, chosen when the library is built, by the CPU's flags.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>
#include <tuple>

#include "cpu_vec.h"

namespace axon_cpu {
namespace {

// Rows per parallel task: pointwise rows are short, so small batches run on one thread.
constexpr int64_t kRowGrain = 16;

template <typename T>
inline float rounded(float x) {
  return static_cast<float>(static_cast<T>(x));
}

// --- RMSNorm -------------------------------------------------------------------------------

// One row: out = w * round(x * inv_rms). When `sum_out` is given, x is first replaced by
// round(x + residual), stored there.
template <typename scalar_t, typename weight_t>
void norm_row(const scalar_t* x, const scalar_t* residual, scalar_t* sum_out, const weight_t* w, scalar_t* out,
              int64_t H, float eps) {
  const scalar_t* src = x;
  if (sum_out != nullptr) {
#if defined(AXON_AVX512_VEC)
    for (int64_t i = 0; i < H; i += 16) {
      const int64_t n = std::min<int64_t>(16, H - i);
      store_n(sum_out + i, _mm512_add_ps(load_n(x + i, n), load_n(residual + i, n)), n);
    }
#else
    for (int64_t i = 0; i < H; ++i) sum_out[i] = static_cast<scalar_t>(widen(x[i]) + widen(residual[i]));
#endif
    src = sum_out;
  }
#if defined(AXON_AVX512_VEC)
  __m512 acc = _mm512_setzero_ps();
  for (int64_t i = 0; i < H; i += 16) {
    const __m512 v = load_n(src + i, std::min<int64_t>(16, H - i));
    acc = _mm512_fmadd_ps(v, v, acc);
  }
  const float inv = 1.0f / std::sqrt(_mm512_reduce_add_ps(acc) / static_cast<float>(H) + eps);
  const __m512 vinv = _mm512_set1_ps(inv);
  for (int64_t i = 0; i < H; i += 16) {
    const int64_t n = std::min<int64_t>(16, H - i);
    const __m512 h = round_to(_mm512_mul_ps(load_n(src + i, n), vinv), out);
    store_n(out + i, _mm512_mul_ps(load_n(w + i, n), h), n);
  }
#else
  // 16 partial sums, lane i % 16, then added pairwise: the order of the vector path's reduce.
  float part[16] = {};
  for (int64_t i = 0; i < H; ++i) part[i % 16] += widen(src[i]) * widen(src[i]);
  for (int width = 8; width >= 1; width /= 2) {
    for (int j = 0; j < width; ++j) part[j] += part[j + width];
  }
  const float inv = 1.0f / std::sqrt(part[0] / static_cast<float>(H) + eps);
  for (int64_t i = 0; i < H; ++i) {
    out[i] = static_cast<scalar_t>(widen(w[i]) * rounded<scalar_t>(widen(src[i]) * inv));
  }
#endif
}

void check_rows(const at::Tensor& x, const at::Tensor& w, const char* op) {
  TORCH_CHECK(x.dim() >= 1 && x.stride(-1) == 1, op, ": the last dim of x must be contiguous");
  TORCH_CHECK(w.dim() == 1 && w.is_contiguous() && w.size(0) == x.size(-1), op, ": weight of ", w.sizes(),
              " for rows of ", x.size(-1));
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kHalf,
              op, ": x must be float32, bfloat16 or float16, got ", x.scalar_type());
  TORCH_CHECK(w.scalar_type() == x.scalar_type() || w.scalar_type() == at::kFloat, op, ": weight dtype ",
              w.scalar_type(), " must be x's (", x.scalar_type(), ") or float32");
}

#define AXON_DISPATCH_FLOATS(TYPE, NAME, ...)                                     \
  [&] {                                                                           \
    switch (TYPE) {                                                               \
      case at::kFloat: { using NAME = float; return __VA_ARGS__(); }              \
      case at::kBFloat16: { using NAME = c10::BFloat16; return __VA_ARGS__(); }   \
      case at::kHalf: { using NAME = c10::Half; return __VA_ARGS__(); }           \
      default: TORCH_CHECK(false, "unsupported dtype ", TYPE);                    \
    }                                                                             \
  }()

// x (and residual) as [rows, H] with a row stride; out and sum contiguous [rows, H].
void run_norm(const at::Tensor& x2, const at::Tensor* res2, at::Tensor* sum2, const at::Tensor& w, at::Tensor& out2,
              double eps) {
  const int64_t rows = x2.size(0), H = x2.size(1);
  AXON_DISPATCH_FLOATS(x2.scalar_type(), scalar_t, [&] {
    const auto body = [&](const auto* wp) {
      const scalar_t* xp = x2.data_ptr<scalar_t>();
      const scalar_t* rp = res2 ? res2->data_ptr<scalar_t>() : nullptr;
      scalar_t* sp = sum2 ? sum2->data_ptr<scalar_t>() : nullptr;
      scalar_t* op = out2.data_ptr<scalar_t>();
      const int64_t xs = x2.stride(0), rs = res2 ? res2->stride(0) : 0;
      at::parallel_for(0, rows, kRowGrain, [&](int64_t begin, int64_t end) {
        for (int64_t r = begin; r < end; ++r) {
          norm_row(xp + r * xs, rp ? rp + r * rs : nullptr, sp ? sp + r * H : nullptr, wp, op + r * H, H,
                   static_cast<float>(eps));
        }
      });
    };
    if (w.scalar_type() == at::kFloat) {
      body(w.data_ptr<float>());
    } else {
      body(w.data_ptr<scalar_t>());
    }
  });
}

// Rows of x as a 2-D [rows, H] view (no copy when the leading dims collapse to one stride).
at::Tensor as_rows(const at::Tensor& x) {
  const int64_t H = x.size(-1);
  at::Tensor r = x.dim() == 2 ? x : x.reshape({-1, H});
  return r.stride(-1) == 1 ? r : r.contiguous();
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& w, double eps) {
  check_rows(x, w, "rms_norm");
  const at::Tensor x2 = as_rows(x);
  at::Tensor out = at::empty(x.sizes(), x.options().memory_format(at::MemoryFormat::Contiguous));
  at::Tensor out2 = out.view({-1, x.size(-1)});
  run_norm(x2, nullptr, nullptr, w, out2, eps);
  return out;
}

std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x, const at::Tensor& residual,
                                                const at::Tensor& w, double eps) {
  check_rows(x, w, "add_rms_norm");
  TORCH_CHECK(residual.sizes() == x.sizes() && residual.scalar_type() == x.scalar_type(),
              "add_rms_norm: residual ", residual.sizes(), " ", residual.scalar_type(), " differs from x ",
              x.sizes(), " ", x.scalar_type());
  const at::Tensor x2 = as_rows(x), r2 = as_rows(residual);
  at::Tensor out = at::empty(x.sizes(), x.options().memory_format(at::MemoryFormat::Contiguous));
  at::Tensor sum = at::empty(x.sizes(), x.options().memory_format(at::MemoryFormat::Contiguous));
  at::Tensor out2 = out.view({-1, x.size(-1)}), sum2 = sum.view({-1, x.size(-1)});
  run_norm(x2, &r2, &sum2, w, out2, eps);
  return {out, sum};
}

// --- SiLU and multiply ---------------------------------------------------------------------

template <typename scalar_t>
void silu_mul_row(const scalar_t* gate, const scalar_t* up, scalar_t* out, int64_t I) {
#if defined(AXON_AVX512_VEC)
  const __m512 one = _mm512_set1_ps(1.0f);
  for (int64_t i = 0; i < I; i += 16) {
    const int64_t n = std::min<int64_t>(16, I - i);
    const __m512 g = load_n(gate + i, n);
    // sigmoid(g) from e = e^-|g| <= 1: 1 / (1 + e) for g >= 0, e / (1 + e) below.
    const __m512 e = exp_nonpositive(_mm512_sub_ps(_mm512_setzero_ps(), _mm512_abs_ps(g)));
    const __mmask16 neg = _mm512_cmp_ps_mask(g, _mm512_setzero_ps(), _CMP_LT_OQ);
    const __m512 sig = _mm512_div_ps(_mm512_mask_blend_ps(neg, one, e), _mm512_add_ps(one, e));
    store_n(out + i, _mm512_mul_ps(_mm512_mul_ps(g, sig), load_n(up + i, n)), n);
  }
#else
  for (int64_t i = 0; i < I; ++i) {
    const float g = widen(gate[i]);
    const float e = std::exp(-std::fabs(g));
    const float sig = (g < 0.0f ? e : 1.0f) / (1.0f + e);
    out[i] = static_cast<scalar_t>(g * sig * widen(up[i]));
  }
#endif
}

at::Tensor silu_and_mul(const at::Tensor& gate_up) {
  TORCH_CHECK(gate_up.dim() >= 1 && gate_up.size(-1) % 2 == 0, "silu_and_mul: the last dim (",
              gate_up.size(-1), ") must hold gate and up halves");
  const at::Tensor x2 = as_rows(gate_up);
  const int64_t rows = x2.size(0), I = x2.size(1) / 2;
  std::vector<int64_t> shape(gate_up.sizes().begin(), gate_up.sizes().end());
  shape.back() = I;
  at::Tensor out = at::empty(shape, gate_up.options().memory_format(at::MemoryFormat::Contiguous));
  AXON_DISPATCH_FLOATS(gate_up.scalar_type(), scalar_t, [&] {
    const scalar_t* xp = x2.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    const int64_t xs = x2.stride(0);
    at::parallel_for(0, rows, kRowGrain, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) silu_mul_row(xp + r * xs, xp + r * xs + I, op + r * I, I);
    });
  });
  return out;
}

// --- Rotary embedding, neox style ----------------------------------------------------------

// One head: out[i] = x[i] cos[i] - x[i + h] sin[i], out[i + h] = x[i + h] cos[i] + x[i] sin[i]
// (h = D / 2; the tables hold each frequency twice, as Hugging Face's do).
template <typename scalar_t>
void rotate_head(const scalar_t* x, scalar_t* out, const float* cos, const float* sin, int64_t D) {
  const int64_t half = D / 2;
#if defined(AXON_AVX512_VEC)
  for (int64_t i = 0; i < half; i += 16) {
    const int64_t n = std::min<int64_t>(16, half - i);
    const __m512 a = load_n(x + i, n), b = load_n(x + half + i, n);
    const __m512 c = load_n(cos + i, n), s = load_n(sin + i, n);
    store_n(out + i, _mm512_sub_ps(_mm512_mul_ps(a, c), _mm512_mul_ps(b, s)), n);
    store_n(out + half + i, _mm512_add_ps(_mm512_mul_ps(b, c), _mm512_mul_ps(a, s)), n);
  }
#else
  for (int64_t i = 0; i < half; ++i) {
    const float a = widen(x[i]), b = widen(x[half + i]);
    // Written as two products then one add, as the vector path does; volatile keeps -ffast-math
    // from contracting them into a fused multiply-add there and not here.
    volatile float ac = a * cos[i], bs = b * sin[i], bc = b * cos[i], as = a * sin[i];
    out[i] = static_cast<scalar_t>(ac - bs);
    out[half + i] = static_cast<scalar_t>(bc + as);
  }
#endif
}

std::tuple<at::Tensor, at::Tensor> rotary_neox(const at::Tensor& positions, const at::Tensor& q, const at::Tensor& k,
                                               const at::Tensor& cos, const at::Tensor& sin) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && q.size(0) == k.size(0) && q.size(2) == k.size(2),
              "rotary_neox: q [T, H, D] and k [T, KVH, D] expected, got ", q.sizes(), " and ", k.sizes());
  TORCH_CHECK(q.stride(2) == 1 && k.stride(2) == 1 && q.stride(1) == q.size(2) && k.stride(1) == k.size(2),
              "rotary_neox: each token's heads of q and k must be contiguous");
  TORCH_CHECK(q.scalar_type() == k.scalar_type(), "rotary_neox: q and k dtypes differ");
  const int64_t T = q.size(0), H = q.size(1), KVH = k.size(1), D = q.size(2);
  TORCH_CHECK(D % 2 == 0, "rotary_neox: head_dim ", D, " is odd");
  TORCH_CHECK(cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat && cos.is_contiguous() &&
                  sin.is_contiguous() && cos.dim() == 2 && cos.size(1) == D && sin.sizes() == cos.sizes(),
              "rotary_neox: cos and sin must be contiguous float32 [positions, ", D, "] tables");
  TORCH_CHECK(positions.dim() == 1 && positions.size(0) == T && positions.scalar_type() == at::kLong,
              "rotary_neox: positions must be int64 [", T, "]");
  const at::Tensor pos = positions.contiguous();
  const int64_t* pp = pos.data_ptr<int64_t>();
  const int64_t max_pos = cos.size(0);
  for (int64_t t = 0; t < T; ++t) {
    TORCH_CHECK(pp[t] >= 0 && pp[t] < max_pos, "rotary_neox: position ", pp[t], " outside the table of ", max_pos);
  }
  at::Tensor q_out = at::empty({T, H, D}, q.options()), k_out = at::empty({T, KVH, D}, k.options());
  AXON_DISPATCH_FLOATS(q.scalar_type(), scalar_t, [&] {
    const scalar_t *qp = q.data_ptr<scalar_t>(), *kp = k.data_ptr<scalar_t>();
    scalar_t *qo = q_out.data_ptr<scalar_t>(), *ko = k_out.data_ptr<scalar_t>();
    const float *cp = cos.data_ptr<float>(), *sp = sin.data_ptr<float>();
    const int64_t qs = q.stride(0), ks = k.stride(0);
    at::parallel_for(0, T, kRowGrain, [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) {
        const float *c = cp + pp[t] * D, *s = sp + pp[t] * D;
        for (int64_t h = 0; h < H; ++h) rotate_head(qp + t * qs + h * D, qo + (t * H + h) * D, c, s, D);
        for (int64_t h = 0; h < KVH; ++h) rotate_head(kp + t * ks + h * D, ko + (t * KVH + h) * D, c, s, D);
      }
    });
  });
  return {q_out, k_out};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(axon_cpu, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("add_rms_norm(Tensor x, Tensor residual, Tensor weight, float eps) -> (Tensor, Tensor)");
  m.def("silu_and_mul(Tensor gate_up) -> Tensor");
  m.def("rotary_neox(Tensor positions, Tensor q, Tensor k, Tensor cos, Tensor sin) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(axon_cpu, CPU, m) {
  m.impl("rms_norm", &rms_norm);
  m.impl("add_rms_norm", &add_rms_norm);
  m.impl("silu_and_mul", &silu_and_mul);
  m.impl("rotary_neox", &rotary_neox);
}

}  // namespace axon_cpu
