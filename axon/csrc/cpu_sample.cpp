// Greedy sampling's argmax over a step's logits, vectorized and parallel over rows.
//
// torch's CPU argmax is a scalar loop: 16 rows of a 32,000-token vocabulary took ~380 us on 2
// cores, as long as the rest of a small model's sampling; this takes ~20 us. Ties resolve to
// the first index, as torch.argmax does. (NaN logits have no defined answer here: the library is
// built with -ffast-math.)

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>

#include "cpu_vec.h"

namespace axon_cpu {
namespace {

template <typename T>
int64_t argmax_row(const T* x, int64_t n) {
  float best = widen(x[0]);
  for (int64_t i = 1; i < n; ++i) best = std::max(best, widen(x[i]));  // vectorizes: a max reduction
  for (int64_t i = 0; i < n; ++i) {
    if (widen(x[i]) == best) return i;
  }
  return 0;
}

// [rows, vocab] float32 or bfloat16 -> [rows] int64 (bfloat16 rows are read as they are: widening
// is exact, so the answer is the one their float32 copy would give, without making the copy).
template <typename T>
void argmax_rows_of(const at::Tensor& logits, at::Tensor& out) {
  const int64_t rows = logits.size(0), n = logits.size(1), stride = logits.stride(0);
  const T* x = logits.data_ptr<T>();
  int64_t* o = out.data_ptr<int64_t>();
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) o[r] = argmax_row(x + r * stride, n);
  });
}

at::Tensor argmax_rows(const at::Tensor& logits) {
  const auto dtype = logits.scalar_type();
  TORCH_CHECK(logits.dim() == 2 && (dtype == at::kFloat || dtype == at::kBFloat16) && logits.stride(1) == 1,
              "argmax_rows takes a float32 or bfloat16 [rows, vocab] tensor with contiguous rows");
  TORCH_CHECK(logits.size(1) > 0, "argmax_rows of an empty vocabulary");
  at::Tensor out = at::empty({logits.size(0)}, logits.options().dtype(at::kLong));
  if (dtype == at::kFloat) {
    argmax_rows_of<float>(logits, out);
  } else {
    argmax_rows_of<c10::BFloat16>(logits, out);
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(axon_cpu, m) { m.def("argmax_rows(Tensor logits) -> Tensor"); }

TORCH_LIBRARY_IMPL(axon_cpu, CPU, m) { m.impl("argmax_rows", &argmax_rows); }

}  // namespace axon_cpu
