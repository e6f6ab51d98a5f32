// Mixture-of-experts MLP on the packed bf16 linear kernel (included by cpu_linear.cpp, whose
// kernels it calls): out = sum over a token's top-k experts e of w_e * down_e(silu(gate_e x) * up_e x).
//
//   x             [T, H] bf16
//   router_logits [T, E] float32 or bf16, turned into k (expert, weight) pairs per token by
//                 ``routing`` (ties: the lower expert id), in float32:
//                   0 softmax over E, the k largest, divided by their sum when ``renormalize``
//                   1 the k largest logits, softmax over just them (GPT-OSS)
//   w13           [L, packed(2I x H)]: the gate rows then the up rows of experts first_expert ..
//                 first_expert + L - 1 (this rank's under expert parallelism; all E without),
//                 packed by pack_linear_weight
//   w2            [L, packed(H x I)]
//   w13_bias, w2_bias  optional float32 [L, 2I], [L, H], added to each expert's GEMM outputs
//   activation    0 silu(gate) * up; 1 GPT-OSS's: gate clamped above at limit, up to
//                 [-limit, limit], gate * sigmoid(alpha * gate) * (up + 1)
//
// A slot routed to an expert outside this rank's range adds nothing here (another rank's
// all-reduce brings it).
// One call does the whole block: the routing, a counting sort of the (token, slot) pairs by
// expert, each expert's gate/up GEMM over just its rows (every weight read once per call, the
// experts nobody picked not at all), silu(gate) * up rounded to bf16, the down GEMM, then for
// each token the weighted sum of its k rows in slot order. Every GEMM row is computed alone
// (cpu_linear.cpp), and the sum of a token's slots runs in one fixed order, so a token's result
// does not depend on the other tokens of the call (batch invariance). Tokens are taken kMoeChunk
// at a time so the intermediate buffers stay bounded for long prefills.
//
// ``fused_moe_quant`` is the same block on quantized experts (int8, uint4 or FP8 E4M3 codes in
// quant_linear's layout, cpu_linear_quant.h; w13's and w2's kinds may differ, as a GGUF file's
// Q4_K gate/up beside Q6_K down), each expert's GEMMs on quant_linear's kernels.

#if defined(__AVX512BF16__) && defined(AXON_AVX512_VEC)

constexpr int64_t kMoeChunk = 1024;  // tokens per pass: buffers of kMoeChunk * k rows

// Expert ids (descending logit, ties to the lower id) and weights of one token's top k.
inline void route_token(const float* logits, int64_t E, int64_t k, bool renormalize, int64_t routing, int32_t* ids,
                        float* weights, float* probs) {
  if (routing == 1) {  // the k largest logits, then a softmax over them
    float* taken = probs;  // 1 once picked (built with -ffast-math: no infinity as a marker)
    for (int64_t e = 0; e < E; ++e) taken[e] = 0.f;
    for (int64_t j = 0; j < k; ++j) {
      int64_t best = -1;
      for (int64_t e = 0; e < E; ++e) {
        if (taken[e] == 0.f && (best < 0 || logits[e] > logits[best])) best = e;
      }
      ids[j] = static_cast<int32_t>(best);
      weights[j] = logits[best];
      taken[best] = 1.f;
    }
    const float top = weights[0];  // the largest
    float sum = 0.f;
    for (int64_t j = 0; j < k; ++j) {
      weights[j] = std::exp(weights[j] - top);
      sum += weights[j];
    }
    for (int64_t j = 0; j < k; ++j) weights[j] /= sum;
    return;
  }
  float max_logit = logits[0];
  for (int64_t e = 1; e < E; ++e) max_logit = std::max(max_logit, logits[e]);
  float sum = 0.f;
  for (int64_t e = 0; e < E; ++e) {
    probs[e] = std::exp(logits[e] - max_logit);
    sum += probs[e];
  }
  for (int64_t e = 0; e < E; ++e) probs[e] /= sum;
  float picked = 0.f;
  for (int64_t j = 0; j < k; ++j) {
    int64_t best = -1;
    for (int64_t e = 0; e < E; ++e) {
      if (probs[e] >= 0.f && (best < 0 || probs[e] > probs[best])) best = e;
    }
    ids[j] = static_cast<int32_t>(best);
    weights[j] = probs[best];
    picked += probs[best];
    probs[best] = -1.f;  // taken
  }
  if (renormalize) {
    for (int64_t j = 0; j < k; ++j) weights[j] /= picked;
  }
}

// What every form of the experts shares: the checks of the routing arguments and the biases.
struct MoeArgs {
  int64_t T, H, E, I, K, L;
  at::Tensor b13, b2;  // float32 biases, or undefined
  const float* b13p() const { return b13.defined() ? b13.data_ptr<float>() : nullptr; }
  const float* b2p() const { return b2.defined() ? b2.data_ptr<float>() : nullptr; }
};

MoeArgs check_moe_args(const at::Tensor& x, const at::Tensor& router_logits, int64_t L,
                       const std::optional<at::Tensor>& w13_bias, const std::optional<at::Tensor>& w2_bias,
                       int64_t top_k, int64_t intermediate, int64_t first_expert, int64_t routing, int64_t activation) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16, "fused_moe takes x as a [tokens, hidden] bfloat16 tensor");
  TORCH_CHECK(router_logits.dim() == 2 && router_logits.size(0) == x.size(0),
              "router_logits must be [tokens, experts] for the tokens of x");
  MoeArgs a{x.size(0), x.size(1), router_logits.size(1), intermediate, top_k, L, {}, {}};
  TORCH_CHECK(a.K >= 1 && a.K <= a.E, "top_k ", a.K, " must be between 1 and the number of experts ", a.E);
  TORCH_CHECK(a.H % 2 == 0 && a.I % 2 == 0, "fused_moe needs an even hidden size and intermediate size");
  TORCH_CHECK(first_expert >= 0 && first_expert + L <= a.E, "experts ", first_expert, " .. ", first_expert + L - 1,
              " are not among the router's ", a.E);
  TORCH_CHECK(routing == 0 || routing == 1, "routing must be 0 (softmax, top-k) or 1 (top-k, softmax), got ", routing);
  TORCH_CHECK(activation == 0 || activation == 1, "activation must be 0 (silu) or 1 (swigluoai), got ", activation);
  const bool has_bias = w13_bias.has_value() && w13_bias->defined();
  TORCH_CHECK(has_bias == (w2_bias.has_value() && w2_bias->defined()), "give both expert biases or neither");
  if (has_bias) {
    a.b13 = w13_bias->to(at::kFloat).contiguous();
    a.b2 = w2_bias->to(at::kFloat).contiguous();
    TORCH_CHECK(a.b13.numel() == L * 2 * a.I && a.b2.numel() == L * a.H, "expert biases must be [", L, ", ",
                2 * a.I, "] and [", L, ", ", a.H, "]");
  }
  return a;
}

// The block, whatever form the experts' weights take: gemm13(e, rows of x, count, out [count, 2I]
// float32) and gemm2(e, rows of the activations, count, out [count, H] float32) multiply local
// expert e's weights (and add its biases).
template <typename Gemm13, typename Gemm2>
at::Tensor run_moe(const at::Tensor& x, const at::Tensor& router_logits, const MoeArgs& a, bool renormalize,
                   int64_t first_expert, int64_t routing, int64_t activation, double alpha, double limit,
                   const Gemm13& gemm13, const Gemm2& gemm2) {
  const int64_t T = a.T, H = a.H, E = a.E, I = a.I, K = a.K, L = a.L;
  const float alpha_f = static_cast<float>(alpha), limit_f = static_cast<float>(limit);
  const at::Tensor xc = x.contiguous();
  const at::Tensor logits = router_logits.to(at::kFloat).contiguous();
  at::Tensor out = at::empty({T, H}, x.options());
  if (T == 0) return out;
  const uint16_t* xp = reinterpret_cast<const uint16_t*>(xc.data_ptr<c10::BFloat16>());
  uint16_t* outp = reinterpret_cast<uint16_t*>(out.data_ptr<c10::BFloat16>());

  const int64_t max_rows = std::min(T, kMoeChunk) * K;
  std::vector<int32_t> ids(std::min(T, kMoeChunk) * K);
  std::vector<float> weights(ids.size());
  std::vector<int64_t> offsets(L + 1), row_of(ids.size());  // row_of[t * K + j]: its sorted row, -1: not here
  std::vector<uint16_t> xs(max_rows * H), act(max_rows * I);
  std::vector<float> h(max_rows * 2 * I), y(max_rows * H);

  for (int64_t t0 = 0; t0 < T; t0 += kMoeChunk) {
    const int64_t n = std::min(kMoeChunk, T - t0);
    const float* lp = logits.data_ptr<float>() + t0 * E;
    at::parallel_for(0, n, 16, [&](int64_t begin, int64_t end) {
      std::vector<float> probs(E);
      for (int64_t t = begin; t < end; ++t) {
        route_token(lp + t * E, E, K, renormalize, routing, ids.data() + t * K, weights.data() + t * K, probs.data());
      }
    });
    // Counting sort of the n * K slots by local expert (stable: tokens in order within an expert).
    std::fill(offsets.begin(), offsets.end(), 0);
    const auto local = [&](int64_t s) { return static_cast<int64_t>(ids[s]) - first_expert; };
    for (int64_t s = 0; s < n * K; ++s) {
      if (local(s) >= 0 && local(s) < L) ++offsets[local(s) + 1];
    }
    for (int64_t e = 0; e < L; ++e) offsets[e + 1] += offsets[e];
    {
      std::vector<int64_t> next(offsets.begin(), offsets.end() - 1);
      for (int64_t s = 0; s < n * K; ++s) row_of[s] = local(s) >= 0 && local(s) < L ? next[local(s)]++ : -1;
    }
    const int64_t rows_here = offsets[L];
    at::parallel_for(0, n * K, 64, [&](int64_t begin, int64_t end) {
      for (int64_t s = begin; s < end; ++s) {
        if (row_of[s] >= 0) std::memcpy(xs.data() + row_of[s] * H, xp + (t0 + s / K) * H, H * sizeof(uint16_t));
      }
    });
    for (int64_t e = 0; e < L; ++e) {
      const int64_t r0 = offsets[e], rows = offsets[e + 1] - r0;
      if (rows > 0) gemm13(e, xs.data() + r0 * H, rows, h.data() + r0 * 2 * I);
    }
    at::parallel_for(0, rows_here, 16, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        const float* gate = h.data() + r * 2 * I;
        const float* up = gate + I;
        c10::BFloat16* a_row = reinterpret_cast<c10::BFloat16*>(act.data()) + r * I;
        for (int64_t i = 0; i < I; i += 16) {
          const int64_t m = std::min<int64_t>(16, I - i);
          __m512 g = load_n(gate + i, m), u = load_n(up + i, m);
          const __m512 one = _mm512_set1_ps(1.0f);
          if (activation == 1) {  // swigluoai
            g = _mm512_min_ps(g, _mm512_set1_ps(limit_f));
            u = _mm512_add_ps(_mm512_max_ps(_mm512_min_ps(u, _mm512_set1_ps(limit_f)), _mm512_set1_ps(-limit_f)), one);
          }
          // sigmoid(z) from e = e^-|z| <= 1 (as silu_and_mul computes it); z = g, or alpha * g
          const __m512 z = activation == 1 ? _mm512_mul_ps(g, _mm512_set1_ps(alpha_f)) : g;
          const __m512 ex = exp_nonpositive(_mm512_sub_ps(_mm512_setzero_ps(), _mm512_abs_ps(z)));
          const __mmask16 neg = _mm512_cmp_ps_mask(z, _mm512_setzero_ps(), _CMP_LT_OQ);
          const __m512 sig = _mm512_div_ps(_mm512_mask_blend_ps(neg, one, ex), _mm512_add_ps(one, ex));
          store_n(a_row + i, _mm512_mul_ps(_mm512_mul_ps(g, sig), u), m);
        }
      }
    });
    for (int64_t e = 0; e < L; ++e) {
      const int64_t r0 = offsets[e], rows = offsets[e + 1] - r0;
      if (rows > 0) gemm2(e, act.data() + r0 * I, rows, y.data() + r0 * H);
    }
    at::parallel_for(0, n, 16, [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) {
        c10::BFloat16* o = reinterpret_cast<c10::BFloat16*>(outp) + (t0 + t) * H;
        for (int64_t c = 0; c < H; c += 16) {
          const int64_t m = std::min<int64_t>(16, H - c);
          __m512 acc = _mm512_setzero_ps();
          for (int64_t j = 0; j < K; ++j) {  // slot order: one summation order per token
            if (row_of[t * K + j] < 0) continue;
            const float* row = y.data() + row_of[t * K + j] * H;
            acc = _mm512_fmadd_ps(_mm512_set1_ps(weights[t * K + j]), load_n(row + c, m), acc);
          }
          store_n(o + c, acc, m);
        }
      }
    });
  }
  return out;
}

at::Tensor fused_moe(const at::Tensor& x, const at::Tensor& router_logits, const at::Tensor& w13,
                     const at::Tensor& w2, const std::optional<at::Tensor>& w13_bias,
                     const std::optional<at::Tensor>& w2_bias, int64_t top_k, bool renormalize, int64_t intermediate,
                     int64_t first_expert, int64_t routing, int64_t activation, double alpha, double limit) {
  const MoeArgs a = check_moe_args(x, router_logits, w13.size(0), w13_bias, w2_bias, top_k, intermediate, first_expert,
                                   routing, activation);
  const int64_t H = a.H, I = a.I, L = a.L;
  const int64_t w13_size = (2 * I + kGroupCols - 1) / kGroupCols * H * kGroupCols;
  const int64_t w2_size = (H + kGroupCols - 1) / kGroupCols * I * kGroupCols;
  TORCH_CHECK(w13.dim() == 2 && w13.size(1) == w13_size && w13.is_contiguous() && w13.scalar_type() == at::kBFloat16,
              "w13 must hold packed [", 2 * I, ", ", H, "] bf16 weights, one row per expert");
  TORCH_CHECK(w2.dim() == 2 && w2.size(0) == L && w2.size(1) == w2_size && w2.is_contiguous() &&
                  w2.scalar_type() == at::kBFloat16,
              "w2 must hold ", L, " packed [", H, ", ", I, "] bf16 weights");
  const uint16_t* w13p = reinterpret_cast<const uint16_t*>(w13.data_ptr<c10::BFloat16>());
  const uint16_t* w2p = reinterpret_cast<const uint16_t*>(w2.data_ptr<c10::BFloat16>());
  const float *b13p = a.b13p(), *b2p = a.b2p();
  return run_moe(
      x, router_logits, a, renormalize, first_expert, routing, activation, alpha, limit,
      [&](int64_t e, const uint16_t* rows, int64_t count, float* out) {
        run_linear_on_best_path<float>(rows, count, H, w13p + e * w13_size, 2 * I, b13p ? b13p + e * 2 * I : nullptr, out);
      },
      [&](int64_t e, const uint16_t* rows, int64_t count, float* out) {
        run_linear_on_best_path<float>(rows, count, I, w2p + e * w2_size, H, b2p ? b2p + e * H : nullptr, out);
      });
}

#if defined(AXON_QUANT_LINEAR)

// One stacked quantized expert weight ([L, ...] codes, scales and optional mins in
// quant_linear's layout, one row per expert), checked against N outputs of K inputs.
struct QuantExperts {
  const uint8_t* codes;
  const uint8_t* scales;
  const uint8_t* mins;
  int64_t code_bytes, table_bytes, group, kind, K, N;
  bool half;

  QuantWeight expert(int64_t e) const {
    return {codes + e * code_bytes, scales + e * table_bytes, mins ? mins + e * table_bytes : nullptr, half, group,
            K / 2};
  }
  // out [count, N] float32 = rows [count, K] times expert e (+ bias).
  void run(int64_t e, const uint16_t* rows, int64_t count, const float* bias, float* out) const {
    std::vector<float> xsum(mins ? count * (K / group) : 0);
    if (mins) group_sums(rows, count, K, group, xsum.data());
    const float* xs = mins ? xsum.data() : nullptr;
    const QuantWeight q = expert(e);
    switch (kind) {
      case kInt8: run_quant_linear_on_best_path<kInt8, float>(rows, count, K, q, xs, N, bias, out); break;
      case kUInt4: run_quant_linear_on_best_path<kUInt4, float>(rows, count, K, q, xs, N, bias, out); break;
      default: run_quant_linear_on_best_path<kFp8E4M3, float>(rows, count, K, q, xs, N, bias, out); break;
    }
  }
};

QuantExperts check_quant_experts(const char* name, const at::Tensor& codes, const at::Tensor& scales,
                                 const std::optional<at::Tensor>& mins, int64_t kind, int64_t group, int64_t L,
                                 int64_t N, int64_t K) {
  TORCH_CHECK(kind == kInt8 || kind == kUInt4 || kind == kFp8E4M3, "fused_moe_quant: unknown code kind ", kind);
  TORCH_CHECK(group >= 16 && group % 16 == 0 && K % group == 0, "fused_moe_quant: ", name, "'s group ", group,
              " must be a multiple of 16 that divides its ", K, " inputs");
  const int64_t panels = (N + kGroupCols - 1) / kGroupCols;
  const int64_t code_bytes = panels * K * kGroupCols / (kind == kUInt4 ? 2 : 1);
  const int64_t table = panels * (K / group) * kGroupCols;
  TORCH_CHECK(codes.dim() == 2 && codes.size(0) == L && codes.is_contiguous() &&
                  codes.size(1) * codes.element_size() == code_bytes,
              "fused_moe_quant: ", name, " codes must be ", L, " rows of ", code_bytes, " bytes (", N, " outputs of ",
              K, " inputs)");
  const bool half = scales.scalar_type() == at::kHalf;
  TORCH_CHECK((half || scales.scalar_type() == at::kFloat) && scales.dim() == 2 && scales.size(0) == L &&
                  scales.size(1) == table && scales.is_contiguous(),
              "fused_moe_quant: ", name, " scales must be [", L, ", ", table, "] float32 or float16");
  const bool has_mins = mins.has_value() && mins->defined();
  TORCH_CHECK(has_mins || kind != kUInt4, "fused_moe_quant: uint4 codes need mins");
  TORCH_CHECK(!has_mins || (mins->scalar_type() == scales.scalar_type() && mins->sizes() == scales.sizes() &&
                            mins->is_contiguous()),
              "fused_moe_quant: ", name, " mins must match its scales");
  return {static_cast<const uint8_t*>(codes.data_ptr()),
          static_cast<const uint8_t*>(scales.data_ptr()),
          has_mins ? static_cast<const uint8_t*>(mins->data_ptr()) : nullptr,
          code_bytes,
          table * static_cast<int64_t>(scales.element_size()),
          group,
          kind,
          K,
          N,
          half};
}

#endif  // AXON_QUANT_LINEAR

// fused_moe on quantized experts: each expert's w13 and w2 in quant_linear's form (its codes,
// scales and mins stacked one row per expert), multiplied by quant_linear's kernels (the same
// per-row order, so still batch-invariant). Everything else is fused_moe's.
at::Tensor fused_moe_quant(const at::Tensor& x, const at::Tensor& router_logits, const at::Tensor& w13_codes,
                           const at::Tensor& w13_scales, const std::optional<at::Tensor>& w13_mins,
                           const at::Tensor& w2_codes, const at::Tensor& w2_scales,
                           const std::optional<at::Tensor>& w2_mins, int64_t kind13, int64_t kind2, int64_t group13,
                           int64_t group2,
                           const std::optional<at::Tensor>& w13_bias, const std::optional<at::Tensor>& w2_bias,
                           int64_t top_k, bool renormalize, int64_t intermediate, int64_t first_expert,
                           int64_t routing, int64_t activation, double alpha, double limit) {
#if defined(AXON_QUANT_LINEAR)
  const MoeArgs a = check_moe_args(x, router_logits, w13_codes.size(0), w13_bias, w2_bias, top_k, intermediate,
                                   first_expert, routing, activation);
  const QuantExperts q13 =
      check_quant_experts("w13", w13_codes, w13_scales, w13_mins, kind13, group13, a.L, 2 * a.I, a.H);
  const QuantExperts q2 = check_quant_experts("w2", w2_codes, w2_scales, w2_mins, kind2, group2, a.L, a.H, a.I);
  const float *b13p = a.b13p(), *b2p = a.b2p();
  const int64_t I = a.I, H = a.H;
  return run_moe(
      x, router_logits, a, renormalize, first_expert, routing, activation, alpha, limit,
      [&](int64_t e, const uint16_t* rows, int64_t count, float* out) {
        q13.run(e, rows, count, b13p ? b13p + e * 2 * I : nullptr, out);
      },
      [&](int64_t e, const uint16_t* rows, int64_t count, float* out) {
        q2.run(e, rows, count, b2p ? b2p + e * H : nullptr, out);
      });
#else
  TORCH_CHECK(false, "fused_moe_quant needs a CPU with AVX-512 BF16 and VBMI (see quant_linear_supported())");
#endif
}

#else

at::Tensor fused_moe(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                     const std::optional<at::Tensor>&, const std::optional<at::Tensor>&, int64_t, bool, int64_t,
                     int64_t, int64_t, int64_t, double, double) {
  TORCH_CHECK(false, "fused_moe needs a CPU with AVX-512 BF16 (see linear_supported())");
}

at::Tensor fused_moe_quant(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                           const std::optional<at::Tensor>&, const at::Tensor&, const at::Tensor&,
                           const std::optional<at::Tensor>&, int64_t, int64_t, int64_t, int64_t,
                           const std::optional<at::Tensor>&, const std::optional<at::Tensor>&, int64_t, bool, int64_t,
                           int64_t, int64_t, int64_t, double, double) {
  TORCH_CHECK(false, "fused_moe_quant needs a CPU with AVX-512 BF16 and VBMI (see quant_linear_supported())");
}

#endif  // __AVX512BF16__ && AXON_AVX512_VEC
