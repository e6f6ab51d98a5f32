// W8A8 linear layers (included by cpu_linear.cpp, after cpu_linear_quant.h): int8 weights with
// one scale per output column, and each call's activations quantized to int8 per row (dynamic,
// per token: scale = the row's amax / 127, rounded to nearest even), multiplied in int32 on
// AMX-INT8 tiles (TDPBSSD) where the CPU has them, else on AVX-512 VNNI (VPDPBUSD):
//
//   y[m][n] = float(sum_k xq[m][k] * w[n][k]) * (x_scale[m] * w_scale[n]) + bias[n]
//
// An int32 sum is exact, so its order does not matter: every row's result is the same whatever
// the batch, on either unit. Nothing is decoded: the tiles read the codes as they are.
//
// Codes: int8 [panel of 64 columns][K / 4][block 0..3][column 0..15][k % 4] (quant.py packs
// them): 16 consecutive quads of one block are a B tile of TDPBSSD (16 rows of 16 columns' 4
// inputs, 256 bytes apart). K is a multiple of 64 (one tile product).

#if defined(AXON_QUANT_LINEAR) && defined(__AVX512VNNI__)
#define AXON_W8A8 1
#endif

bool w8a8_linear_supported() {
#if defined(AXON_W8A8)
  return true;
#else
  return false;
#endif
}

#if defined(AXON_W8A8)

constexpr int64_t kQuadStepBytes = 4 * kGroupCols;  // one quad of inputs for the panel's 64 columns

// Rows of x [M, K] bf16 -> int8 [M, K] and a scale per row.
void quantize_rows(const uint16_t* x, int64_t M, int64_t K, int8_t* xq, float* scales) {
  at::parallel_for(0, M, 8, [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m) {
      const c10::BFloat16* row = reinterpret_cast<const c10::BFloat16*>(x + m * K);
      __m512 amax = _mm512_setzero_ps();
      for (int64_t k = 0; k < K; k += 16) amax = _mm512_max_ps(amax, _mm512_abs_ps(load16(row + k)));
      const float peak = _mm512_reduce_max_ps(amax);
      // True divisions (-ffast-math would turn peak / 127 into peak * (1 / 127), another
      // number): the scale quant.py's quantize_activations computes.
      const float scale = peak > 0.0f ? _mm_cvtss_f32(_mm_div_ss(_mm_set_ss(peak), _mm_set_ss(127.0f))) : 1.0f;
      const __m512 inv = _mm512_set1_ps(_mm_cvtss_f32(_mm_div_ss(_mm_set_ss(1.0f), _mm_set_ss(scale))));
      for (int64_t k = 0; k < K; k += 16) {
        const __m512 v = _mm512_mul_ps(load16(row + k), inv);
        const __m512i q = _mm512_max_epi32(_mm512_min_epi32(_mm512_cvtps_epi32(v), _mm512_set1_epi32(127)),
                                           _mm512_set1_epi32(-127));  // nearest even
        _mm_storeu_si128(reinterpret_cast<__m128i*>(xq + m * K + k), _mm512_cvtepi32_epi8(q));
      }
      scales[m] = scale;
    }
  });
}

template <typename out_t>
inline void store_scaled(const int32_t* acc, int64_t count, float x_scale, const float* w_scale, const float* bias,
                         out_t* y) {
  for (int64_t c = 0; c < count; c += 16) {
    const int64_t n = std::min<int64_t>(16, count - c);
    const __mmask16 mask = n == 16 ? static_cast<__mmask16>(0xffff) : static_cast<__mmask16>((1u << n) - 1u);
    const __m512 v = _mm512_cvtepi32_ps(_mm512_maskz_loadu_epi32(mask, acc + c));
    __m512 out = _mm512_mul_ps(v, _mm512_mul_ps(_mm512_set1_ps(x_scale), _mm512_maskz_loadu_ps(mask, w_scale + c)));
    if (bias != nullptr) out = _mm512_add_ps(out, _mm512_maskz_loadu_ps(mask, bias + c));
    store16<out_t>(y + c, out, mask);
  }
}

// AVX-512 VNNI: VPDPBUSD multiplies unsigned by signed bytes, so each activation goes in as
// xq + 128 and the column's 128 * sum(w) comes back out (``col_sums``).
template <typename out_t>
void run_w8a8_vnni(const int8_t* xq, const float* x_scales, int64_t M, int64_t K, const int8_t* codes,
                   const float* w_scales, const int32_t* col_sums, int64_t N, const float* bias, out_t* y) {
  const int64_t panels = (N + kGroupCols - 1) / kGroupCols, K4 = K / 4;
  at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
    alignas(64) int32_t acc_out[kGroupCols];
    for (int64_t g = begin; g < end; ++g) {
      const int8_t* panel = codes + g * K4 * kQuadStepBytes;
      const int64_t cols = std::min(kGroupCols, N - g * kGroupCols);
      for (int64_t m = 0; m < M; ++m) {
        __m512i acc[4];
        for (int b = 0; b < 4; ++b) acc[b] = _mm512_setzero_si512();
        const int8_t* row = xq + m * K;
        for (int64_t k4 = 0; k4 < K4; ++k4) {
          uint32_t quad;
          std::memcpy(&quad, row + 4 * k4, sizeof(quad));
          const __m512i a = _mm512_set1_epi32(static_cast<int32_t>(quad ^ 0x80808080u));  // + 128 per byte
          const int8_t* step = panel + k4 * kQuadStepBytes;
          for (int b = 0; b < 4; ++b) acc[b] = _mm512_dpbusd_epi32(acc[b], a, _mm512_loadu_si512(step + 64 * b));
        }
        for (int b = 0; b < 4; ++b) {
          const __m512i fix = _mm512_slli_epi32(_mm512_loadu_si512(col_sums + g * kGroupCols + 16 * b), 7);
          _mm512_store_si512(acc_out + 16 * b, _mm512_sub_epi32(acc[b], fix));
        }
        store_scaled(acc_out, cols, x_scales[m], w_scales + g * kGroupCols, bias != nullptr ? bias + g * kGroupCols : nullptr,
                     y + m * N + g * kGroupCols);
      }
    }
  });
}

#if defined(AXON_AMX) && defined(__AMX_INT8__)

// Tiles 0-3: C (rows x 16 int32), 4: A (rows x 64 int8), 5-6: B (16 quads x 16 columns).
void configure_w8a8_tiles(int64_t rows) {
  TileConfig cfg;
  for (int t = 0; t < 5; ++t) {
    cfg.colsb[t] = 64;
    cfg.rows[t] = static_cast<uint8_t>(rows);
  }
  for (int t = 5; t < 7; ++t) {
    cfg.colsb[t] = 64;
    cfg.rows[t] = 16;
  }
  load_tile_config(cfg);
}

template <typename out_t>
void run_w8a8_amx(const int8_t* xq, const float* x_scales, int64_t M, int64_t K, const int8_t* codes,
                  const float* w_scales, int64_t N, const float* bias, out_t* y) {
  const int64_t panels = (N + kGroupCols - 1) / kGroupCols, K4 = K / 4;
  const int64_t grain = std::max<int64_t>(1, panels / (4 * at::get_num_threads()));
  at::parallel_for(0, panels, grain, [&](int64_t begin, int64_t end) {
    int64_t configured = -1;
    alignas(64) int32_t c[kTileRows * kGroupCols];
    for (int64_t g = begin; g < end; ++g) {
      const int8_t* panel = codes + g * K4 * kQuadStepBytes;
      const int64_t cols = std::min(kGroupCols, N - g * kGroupCols);
      if (g + 1 < end) {  // the thread's next panel into L2 while this one computes
        const char* next = reinterpret_cast<const char*>(panel + K4 * kQuadStepBytes);
        for (int64_t off = 0; off < K4 * kQuadStepBytes; off += 64) _mm_prefetch(next + off, _MM_HINT_T1);
      }
      for (int64_t m0 = 0; m0 < M; m0 += kTileRows) {
        const int64_t rows = std::min(kTileRows, M - m0);
        if (rows != configured) {  // a full block, or the last rows (each row is its own sum)
          configure_w8a8_tiles(rows);
          configured = rows;
        }
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
        for (int64_t k4 = 0; k4 < K4; k4 += 16) {
          const int8_t* step = panel + k4 * kQuadStepBytes;
          _tile_loadd(4, xq + m0 * K + 4 * k4, K);
          _tile_loadd(5, step, kQuadStepBytes);
          _tile_dpbssd(0, 4, 5);
          _tile_loadd(6, step + 64, kQuadStepBytes);
          _tile_dpbssd(1, 4, 6);
          _tile_loadd(5, step + 128, kQuadStepBytes);
          _tile_dpbssd(2, 4, 5);
          _tile_loadd(6, step + 192, kQuadStepBytes);
          _tile_dpbssd(3, 4, 6);
        }
        store_block_tiles(c);
        for (int64_t r = 0; r < rows; ++r) {
          store_scaled(c + r * kGroupCols, cols, x_scales[m0 + r], w_scales + g * kGroupCols,
                       bias != nullptr ? bias + g * kGroupCols : nullptr, y + (m0 + r) * N + g * kGroupCols);
        }
      }
    }
    _tile_release();
  });
}

bool w8a8_uses_amx() { return linear_uses_amx(); }
#else
bool w8a8_uses_amx() { return false; }
#endif

#endif  // AXON_W8A8

// x [..., K] bf16 times int8 codes [N, K] (layout above, K a multiple of 64) with float32
// w_scales [N] and col_sums [N] (each column's sum of codes, for the VNNI path) -> [..., N].
at::Tensor w8a8_linear(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& w_scales,
                       const at::Tensor& col_sums, int64_t N, const std::optional<at::Tensor>& bias, bool float_out) {
#if defined(AXON_W8A8)
  TORCH_CHECK(x.scalar_type() == at::kBFloat16, "w8a8_linear takes bfloat16 input, got ", x.scalar_type());
  const int64_t K = x.size(-1), panels = (N + kGroupCols - 1) / kGroupCols;
  TORCH_CHECK(K % 64 == 0, "w8a8_linear needs a multiple of 64 inputs, got ", K);
  TORCH_CHECK(codes.is_contiguous() && codes.numel() * codes.element_size() == panels * kGroupCols * K,
              "w8a8_linear: codes do not match ", N, " outputs of ", K, " inputs");
  TORCH_CHECK(w_scales.scalar_type() == at::kFloat && w_scales.numel() == panels * kGroupCols &&
                  col_sums.scalar_type() == at::kInt && col_sums.numel() == panels * kGroupCols,
              "w8a8_linear: w_scales (float32) and col_sums (int32) need one value per padded column");
  const int8_t* wp = static_cast<const int8_t*>(codes.data_ptr());
  return linear_call(x, N, bias, float_out, [&](const uint16_t* xp, int64_t M, int64_t K, const float* b, auto* y) {
    std::vector<int8_t> xq(M * K);
    std::vector<float> x_scales(M);
    quantize_rows(xp, M, K, xq.data(), x_scales.data());
#if defined(AXON_AMX) && defined(__AMX_INT8__)
    if (w8a8_uses_amx()) {
      run_w8a8_amx(xq.data(), x_scales.data(), M, K, wp, w_scales.data_ptr<float>(), N, b, y);
      return;
    }
#endif
    run_w8a8_vnni(xq.data(), x_scales.data(), M, K, wp, w_scales.data_ptr<float>(), col_sums.data_ptr<int32_t>(), N,
                  b, y);
  });
#else
  TORCH_CHECK(false, "w8a8_linear needs a CPU with AVX-512 BF16, VBMI and VNNI (see w8a8_linear_supported())");
#endif
}
