// Quantized linear layers (included by cpu_linear.cpp, inside its namespace: it runs on the same
// panels, tiles and row loops as the bf16 kernel).
//
// A quantized weight is w[n][k] = code[n][k] * scale[n][g] + min[n][g], one scale (and min) per
// output column n and ``group`` consecutive inputs (g = k / group). The codes keep the bf16
// layout's panel order, one byte or half a byte each (axon/model/layers/quant.py packs them):
//
//   int8  (kind 0): bytes -127..127, packed[panel][k / 2][block 0..3][column 0..15][k % 2],
//                   stored sign-magnitude and each 64 in unpacking order (bytes_to_bf16)
//   fp8   (kind 2): FP8 E4M3 bytes, the same order
//   uint4 (kind 1): codes 0..15, one step in 64 bytes: bytes 0-31 hold block 0 in their low
//                   nibbles and block 1 in their high nibbles, bytes 32-63 blocks 2 and 3
//
// scales (and mins): [panel][K / group][64 columns], float32 or float16 (where every value is one:
// GGUF's Q8_0, Q4_0 and Q4_1 store theirs so). uint4 weights always have mins.
//
// Every code is exactly a bf16 number (|int8| < 256, E4M3 has 3 mantissa bits), so a call
// turns a panel's codes into a bf16 panel in a thread's buffer, without rounding, and multiplies
// by it on the same tiles (or vdpbf16ps) as the bf16 kernel, one group of inputs at a time:
//
//   y[m][n] = sum over groups g, in order, of  scale[n][g] * (x[m][g's inputs] . code[n][g's inputs])
//                                            + min[n][g] * (sum of x[m][g's inputs])
//
// each group's dot product summed in float32, then added by fused multiply-adds. Every row count
// takes this one path (on tiles where the CPU has AMX), so a row's result never depends on the
// batch. Memory streams only the codes: half (int8, fp8) or a quarter (int4) of bf16's bytes.

enum QuantKind : int64_t { kInt8 = 0, kUInt4 = 1, kFp8E4M3 = 2 };

struct QuantWeight {
  const uint8_t* codes;
  const void* scales;  // float32, or float16 where every value is one (GGUF's Q8_0, Q4_0, Q4_1)
  const void* mins;    // the same type; nullptr: none
  bool half_tables;
  int64_t group;  // inputs per scale: a multiple of 16
  int64_t K2;     // input pairs
  int64_t KG() const { return 2 * K2 / group; }
};

// The decoders below need AVX-512 VBMI (byte permutes) beside AVX-512 BF16: every CPU with
// AMX has it, and AMD Zen 4.
#if defined(__AVX512BF16__) && defined(__AVX512VBMI__)
#define AXON_QUANT_LINEAR 1
#endif

bool quant_linear_supported() {
#if defined(AXON_QUANT_LINEAR)
  return true;
#else
  return false;
#endif
}

#if defined(AXON_QUANT_LINEAR)

#define AXON_QUANT_INLINE inline __attribute__((always_inline))

// Byte codes (int8 and E4M3) are stored sign-magnitude (bit 7 the sign, bits 0-6 the
// magnitude; quant.py turns int8's two's complement into it), so one decoder serves both: the
// magnitude looks up its bf16 bits' high and low bytes in two 128-entry tables (vpermi2b), the
// sign joins the high byte, and unpacking interleaves the bytes into 16-bit lanes. Unpacking
// works within 128-bit lanes, so quant.py stores each 64 codes in the order that puts codes 0-31
// in the first result and 32-63 in the second. Four instructions a 32-code block, against six
// through float32.
struct ByteTables {
  __m512i hi[2], lo[2];  // entries 0-63 and 64-127
};

// bf16 bits of each magnitude m = 0..127: the integer m (int8) or the E4M3 value of code m.
inline ByteTables make_byte_tables(int64_t kind) {
  alignas(64) uint8_t hi[128], lo[128];
  for (int m = 0; m < 128; ++m) {
    float value;
    if (kind == kInt8) {
      value = static_cast<float>(m);
    } else {
      const int e = m >> 3, mant = m & 7;
      value = e == 0 ? mant / 512.0f : std::ldexp(1.0f + mant / 8.0f, e - 7);
    }
    uint32_t bits;
    std::memcpy(&bits, &value, sizeof(bits));
    const uint16_t bf16 = static_cast<uint16_t>(bits >> 16);  // exact: at most 8 significant bits
    hi[m] = static_cast<uint8_t>(bf16 >> 8);
    lo[m] = static_cast<uint8_t>(bf16 & 0xff);
  }
  ByteTables t;
  for (int half = 0; half < 2; ++half) {
    t.hi[half] = _mm512_load_si512(hi + 64 * half);
    t.lo[half] = _mm512_load_si512(lo + 64 * half);
  }
  return t;
}

// 64 stored byte codes -> two blocks of 32 bf16 values.
inline void bytes_to_bf16(const ByteTables& t, const uint8_t* src, __m512i& out0, __m512i& out1) {
  const __m512i v = _mm512_loadu_si512(src);
  const __m512i magnitude = _mm512_and_si512(v, _mm512_set1_epi8(0x7f));
  const __m512i hi_bits = _mm512_permutex2var_epi8(t.hi[0], magnitude, t.hi[1]);
  const __m512i lo = _mm512_permutex2var_epi8(t.lo[0], magnitude, t.lo[1]);
  // (a & b) | c, ternary-logic table 0xEA: the code's sign bit into the high byte
  const __m512i hi = _mm512_ternarylogic_epi32(v, _mm512_set1_epi8(static_cast<char>(0x80)), hi_bits, 0xEA);
  out0 = _mm512_unpacklo_epi8(lo, hi);
  out1 = _mm512_unpackhi_epi8(lo, hi);
}

template <int64_t kind>
constexpr int64_t kCodeStepBytes = kind == kUInt4 ? kGroupCols : 2 * kGroupCols;

// One step of a panel's codes (``step``) -> its 4 blocks of 32 bf16 values (2 inputs x 16 columns).
template <int64_t kind>
AXON_QUANT_INLINE void decode_step(const ByteTables& tables, const uint8_t* step, __m512i (&w)[4]) {
  if constexpr (kind == kUInt4) {
    const __m512i nibble = _mm512_set1_epi16(0x0f), exponent = _mm512_set1_epi16(0x4300);
    for (int pair = 0; pair < 2; ++pair) {
      const __m512i v = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(step + 32 * pair)));
      // (a & b) | c: ternary-logic table 0xEA
      w[2 * pair] = _mm512_ternarylogic_epi32(v, nibble, exponent, 0xEA);
      w[2 * pair + 1] = _mm512_ternarylogic_epi32(_mm512_srli_epi16(v, 4), nibble, exponent, 0xEA);
    }
  } else {
    bytes_to_bf16(tables, step, w[0], w[1]);
    bytes_to_bf16(tables, step + 64, w[2], w[3]);
  }
}

template <int64_t kind>
const ByteTables& byte_tables() {
  static const ByteTables tables = make_byte_tables(kind);
  return tables;
}

// Steps [first, last) of panel g -> out (kStepElems per step, from step ``first``).
template <int64_t kind>
void decode_steps(const QuantWeight& q, int64_t g, int64_t first, int64_t last, const uint8_t* next, uint16_t* out) {
  constexpr int64_t step_bytes = kCodeStepBytes<kind>;
  const ByteTables& tables = byte_tables<kind>();
  const uint8_t* codes = q.codes + g * q.K2 * step_bytes;
  for (int64_t k2 = first; k2 < last; ++k2) {
    const uint8_t* step = codes + k2 * step_bytes;
    if (next != nullptr && (k2 * step_bytes) % 64 == 0) _mm_prefetch(next + k2 * step_bytes, _MM_HINT_T1);
    __m512i w[4];
    decode_step<kind>(tables, step, w);
    uint16_t* dst = out + (k2 - first) * kStepElems;
    for (int b = 0; b < 4; ++b) _mm512_storeu_si512(dst + 32 * b, w[b]);
  }
}

// The sum of each row's inputs in each group, [M][KG], in one order whatever M (for the mins).
void group_sums(const uint16_t* x, int64_t M, int64_t K, int64_t group, float* out) {
  const int64_t KG = K / group;
  at::parallel_for(0, M, 16, [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m) {
      for (int64_t kg = 0; kg < KG; ++kg) {
        __m512 acc = _mm512_setzero_ps();
        for (int64_t k = kg * group; k < (kg + 1) * group; k += 16) {
          acc = _mm512_add_ps(acc, load16(reinterpret_cast<const c10::BFloat16*>(x + m * K + k)));
        }
        out[m * KG + kg] = _mm512_reduce_add_ps(acc);
      }
    }
  });
}

// One group's scales and mins for the panel's 64 columns, as float32. uint4 codes run as
// 128 + code, so their min becomes min - 128 * scale.
struct GroupTables {
  __m512 scale[4], min[4];
  bool has_min;
};

inline __m512 load_table16(const void* table, int64_t index, bool half) {
  if (half) return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(
                   static_cast<const uint16_t*>(table) + index)));
  return _mm512_loadu_ps(static_cast<const float*>(table) + index);
}

template <int64_t kind>
inline GroupTables load_group(const QuantWeight& q, int64_t g, int64_t kg) {
  GroupTables t;
  const int64_t base = (g * q.KG() + kg) * kGroupCols;
  t.has_min = q.mins != nullptr;
  for (int b = 0; b < 4; ++b) {
    t.scale[b] = load_table16(q.scales, base + 16 * b, q.half_tables);
    t.min[b] = t.has_min ? load_table16(q.mins, base + 16 * b, q.half_tables) : _mm512_setzero_ps();
    if constexpr (kind == kUInt4) t.min[b] = _mm512_fnmadd_ps(_mm512_set1_ps(128.0f), t.scale[b], t.min[b]);
  }
  return t;
}

// total += scale * partial (+ min * xsum): one group's 16 columns (block b) of one row.
inline __m512 add_group(__m512 total, __m512 partial, const GroupTables& t, int b, float xsum) {
  total = _mm512_fmadd_ps(partial, t.scale[b], total);
  if (t.has_min) total = _mm512_fmadd_ps(_mm512_set1_ps(xsum), t.min[b], total);
  return total;
}

// Rows m0 .. m0 + MB - 1 times panel g on vdpbf16ps, group by group, into total; step(k2, w)
// gives the panel's step k2 as bf16 (read from a decoded panel, or decoded in registers: the
// same products and sums in the same order, so the same bits).
template <int64_t kind, int MB, typename StepFn>
inline void quant_panel_rows(const uint16_t* x, int64_t ldx, const QuantWeight& q, int64_t g, const float* xsum,
                             StepFn&& step, __m512 (&total)[kRowsPerPass][4]) {
  const int64_t KG = q.KG(), steps = q.group / 2;
  for (int m = 0; m < MB; ++m) {
    for (int b = 0; b < 4; ++b) total[m][b] = _mm512_setzero_ps();
  }
  for (int64_t kg = 0; kg < KG; ++kg) {
    __m512 acc[kRowsPerPass][4];
    for (int m = 0; m < MB; ++m) {
      for (int b = 0; b < 4; ++b) acc[m][b] = _mm512_setzero_ps();
    }
    for (int64_t k2 = kg * steps; k2 < (kg + 1) * steps; ++k2) {
      __m512i w[4];
      step(k2, w);
      step_rows<MB>(x, ldx, w, k2, acc);
    }
    const GroupTables t = load_group<kind>(q, g, kg);
    for (int m = 0; m < MB; ++m) {
      const float xs = t.has_min ? xsum[m * KG + kg] : 0.0f;
      for (int b = 0; b < 4; ++b) total[m][b] = add_group(total[m][b], acc[m][b], t, b, xs);
    }
  }
}

// Up to this many rows a call decodes each step in registers and multiplies at once, writing
// no panel buffer (for one row, writing the decoded panel to L2 and reading it back cost more
// than the bytes the codes save); its accumulators, the step's 4 vectors and the byte tables
// fit the 32 registers.
constexpr int64_t kDirectRows = 4;

// The codes of the thread's next panel after g (its panels end before ``end``), to stream into
// L2 while panel g is decoded; nullptr after its last.
template <int64_t kind>
inline const uint8_t* next_panel_codes(const QuantWeight& q, int64_t g, int64_t end) {
  return g + 1 < end ? q.codes + (g + 1) * q.K2 * kCodeStepBytes<kind> : nullptr;
}

template <int64_t kind, typename out_t>
void run_quant_linear(const uint16_t* x, int64_t M, int64_t K, const QuantWeight& q, const float* xsum, int64_t N,
                      const float* bias, out_t* y) {
  const int64_t groups = (N + kGroupCols - 1) / kGroupCols, KG = q.KG();
  const int64_t grain = std::max<int64_t>(1, groups / (4 * at::get_num_threads()));
  if (M <= kDirectRows) {
    constexpr int64_t step_bytes = kCodeStepBytes<kind>;
    at::parallel_for(0, groups, grain, [&](int64_t begin, int64_t end) {
      const ByteTables& tables = byte_tables<kind>();
      __m512 total[kRowsPerPass][4];
      for (int64_t g = begin; g < end; ++g) {
        const uint8_t* codes = q.codes + g * q.K2 * step_bytes;
        const uint8_t* next = next_panel_codes<kind>(q, g, end);
        const auto decode = [&](int64_t k2, __m512i (&w)[4]) {
          if (next != nullptr && (k2 * step_bytes) % 64 == 0) _mm_prefetch(next + k2 * step_bytes, _MM_HINT_T1);
          decode_step<kind>(tables, codes + k2 * step_bytes, w);
        };
        with_rows<kDirectRows>(M, [&](auto rows) {
          constexpr int MB = decltype(rows)::value;
          quant_panel_rows<kind, MB>(x, K, q, g, xsum, decode, total);
          store_rows<MB>(total, y, N, g * kGroupCols, N, bias);
        });
      }
    });
    return;
  }
  at::parallel_for(0, groups, grain, [&](int64_t begin, int64_t end) {
    std::vector<uint16_t> panel(q.K2 * kStepElems);
    const auto read = [&](int64_t k2, __m512i (&w)[4]) {
      for (int b = 0; b < 4; ++b) w[b] = _mm512_loadu_si512(panel.data() + k2 * kStepElems + 32 * b);
    };
    __m512 total[kRowsPerPass][4];
    for (int64_t chunk = 0; chunk < M; chunk += kRowChunk)
    for (int64_t g = begin; g < end; ++g) {
      decode_steps<kind>(q, g, 0, q.K2, next_panel_codes<kind>(q, g, end), panel.data());
      const int64_t chunk_end = std::min(M, chunk + kRowChunk);
      for (int64_t m0 = chunk; m0 < chunk_end; m0 += kRowsPerPass) {
        const uint16_t* xm = x + m0 * K;
        const float* xs = xsum != nullptr ? xsum + m0 * KG : nullptr;
        out_t* ym = y + m0 * N;
        with_rows(M - m0, [&](auto rows) {
          constexpr int MB = decltype(rows)::value;
          quant_panel_rows<kind, MB>(xm, K, q, g, xs, read, total);
          store_rows<MB>(total, ym, N, g * kGroupCols, N, bias);
        });
      }
    }
  });
}

#if defined(AXON_AMX)

// Tiles for ``inputs`` (16 or 32) inputs per product and ``rows`` (up to 16) rows: 0-3 C (rows x
// 16 float32 columns, one per block of the panel), 4 A (rows x inputs bf16), 5-6 B (inputs / 2
// pairs x 16 columns). Each row of a product is computed on its own, so a decode step's few rows
// run on tiles of their size (a 1-row product is far cheaper than a 16-row one) with the same
// result per row as in a full block.
void configure_quant_tiles(int64_t inputs, int64_t rows) {
  TileConfig cfg;
  for (int t = 0; t < 4; ++t) {
    cfg.colsb[t] = 64;
    cfg.rows[t] = static_cast<uint8_t>(rows);
  }
  cfg.colsb[4] = static_cast<uint16_t>(2 * inputs);
  cfg.rows[4] = static_cast<uint8_t>(rows);
  for (int t = 5; t < 7; ++t) {
    cfg.colsb[t] = 64;
    cfg.rows[t] = static_cast<uint8_t>(inputs / 2);
  }
  load_tile_config(cfg);
}

// Tiles 0-3 (one per 16-column block of a panel; float32 or int32 sums) into c, 64 values a row.
inline void store_block_tiles(void* c) {
  char* p = static_cast<char*>(c);
  constexpr int64_t row_bytes = kGroupCols * 4;
  _tile_stored(0, p, row_bytes);
  _tile_stored(1, p + 64, row_bytes);
  _tile_stored(2, p + 128, row_bytes);
  _tile_stored(3, p + 192, row_bytes);
}

// 16 rows (``rows`` of them real) times panel g on tiles, group by group, into total (16 x 64
// float32). ``panel``: the panel decoded whole (a prefill's row blocks share it); nullptr: each
// product's codes are decoded just before it into ``slice`` (a decode step's one row block: the
// slice stays in L1 and the integer decoding overlaps the tile unit). Either way every output
// element sums the same tile products in the same order.
template <int64_t kind>
void quant_block_tiles(const uint16_t* x, int64_t ldx, int64_t rows, const uint16_t* panel, uint16_t* slice,
                       const uint8_t* next, const QuantWeight& q, int64_t g, int64_t inputs, const float* xsum,
                       float* total) {
  constexpr int64_t kStepBytes = kStepElems * 2;
  const int64_t KG = q.KG(), steps = q.group / 2, tile_steps = inputs / 2;
  alignas(64) float c[kTileRows * kGroupCols];
  std::fill(total, total + kTileRows * kGroupCols, 0.0f);
  for (int64_t kg = 0; kg < KG; ++kg) {
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int64_t k2 = kg * steps; k2 < (kg + 1) * steps; k2 += tile_steps) {
      const uint16_t* step = panel != nullptr ? panel + k2 * kStepElems : slice;
      if (panel == nullptr) decode_steps<kind>(q, g, k2, k2 + tile_steps, next, slice);
      _tile_loadd(4, x + 2 * k2, ldx * 2);
      _tile_loadd(5, step, kStepBytes);
      _tile_dpbf16ps(0, 4, 5);
      _tile_loadd(6, step + 32, kStepBytes);
      _tile_dpbf16ps(1, 4, 6);
      _tile_loadd(5, step + 64, kStepBytes);
      _tile_dpbf16ps(2, 4, 5);
      _tile_loadd(6, step + 96, kStepBytes);
      _tile_dpbf16ps(3, 4, 6);
    }
    store_block_tiles(c);
    const GroupTables tables = load_group<kind>(q, g, kg);
    for (int64_t r = 0; r < rows; ++r) {
      const float xs = tables.has_min ? xsum[r * KG + kg] : 0.0f;
      for (int b = 0; b < 4; ++b) {
        float* t = total + r * kGroupCols + 16 * b;
        _mm512_store_ps(t, add_group(_mm512_load_ps(t), _mm512_load_ps(c + r * kGroupCols + 16 * b), tables, b, xs));
      }
    }
  }
}

template <int64_t kind, typename out_t>
void run_quant_linear_amx(const uint16_t* x, int64_t M, int64_t K, const QuantWeight& q, const float* xsum,
                          int64_t N, const float* bias, out_t* y) {
  const int64_t groups = (N + kGroupCols - 1) / kGroupCols, KG = q.KG();
  const int64_t inputs = q.group % 32 == 0 ? 32 : 16;
  const int64_t full = M / kTileRows * kTileRows;
  const uint16_t* padded = M > kTileRows ? padded_tail_rows(x, M, K) : nullptr;
  const bool whole_panels = M > kTileRows;  // several row blocks share each decoded panel
  const int64_t grain = std::max<int64_t>(1, groups / (4 * at::get_num_threads()));
  at::parallel_for(0, groups, grain, [&](int64_t begin, int64_t end) {
    configure_quant_tiles(inputs, std::min(M, kTileRows));
    std::vector<uint16_t> panel(whole_panels ? q.K2 * kStepElems : 0);
    alignas(64) uint16_t slice[16 * kStepElems];
    alignas(64) float total[kTileRows * kGroupCols];
    for (int64_t chunk = 0; chunk < M; chunk += kRowChunk)
    for (int64_t g = begin; g < end; ++g) {
      const uint8_t* next = next_panel_codes<kind>(q, g, end);
      if (whole_panels) decode_steps<kind>(q, g, 0, q.K2, next, panel.data());
      const int64_t chunk_end = std::min(M, chunk + kRowChunk);
      for (int64_t m0 = chunk; m0 < chunk_end; m0 += kTileRows) {
        const int64_t rows = std::min(kTileRows, M - m0);
        const uint16_t* xm = m0 < full || M < kTileRows ? x + m0 * K : padded;
        quant_block_tiles<kind>(xm, K, rows, whole_panels ? panel.data() : nullptr, slice, next, q, g, inputs,
                                xsum != nullptr ? xsum + m0 * KG : nullptr, total);
        for (int64_t r = 0; r < rows; ++r) {
          __m512 acc[kRowsPerPass][4];
          for (int b = 0; b < 4; ++b) acc[0][b] = _mm512_load_ps(total + r * kGroupCols + 16 * b);
          store_rows<1>(acc, y + (m0 + r) * N, N, g * kGroupCols, N, bias);
        }
      }
    }
    _tile_release();
  });
}

#endif  // AXON_AMX

template <int64_t kind, typename out_t>
void run_quant_linear_on_best_path(const uint16_t* x, int64_t M, int64_t K, const QuantWeight& q,
                                   const float* xsum, int64_t N, const float* bias, out_t* y) {
#if defined(AXON_AMX)
  if (linear_uses_amx()) {
    run_quant_linear_amx<kind, out_t>(x, M, K, q, xsum, N, bias, y);
    return;
  }
#endif
  run_quant_linear<kind, out_t>(x, M, K, q, xsum, N, bias, y);
}

#endif  // AXON_QUANT_LINEAR

// x [..., K] bf16 times a quantized [N, K] weight (layout above) -> [..., N] + bias.
at::Tensor quant_linear(const at::Tensor& x, const at::Tensor& codes, int64_t kind, const at::Tensor& scales,
                        const std::optional<at::Tensor>& mins, int64_t group, int64_t N,
                        const std::optional<at::Tensor>& bias, bool float_out) {
#if defined(AXON_QUANT_LINEAR)
  TORCH_CHECK(x.scalar_type() == at::kBFloat16, "quant_linear takes bfloat16 input, got ", x.scalar_type());
  TORCH_CHECK(kind == kInt8 || kind == kUInt4 || kind == kFp8E4M3, "quant_linear: unknown code kind ", kind);
  const int64_t K = x.size(-1), panels = (N + kGroupCols - 1) / kGroupCols;
  TORCH_CHECK(group >= 16 && group % 16 == 0 && K % group == 0, "quant_linear: group ", group,
              " must be a multiple of 16 that divides the ", K, " inputs");
  const int64_t code_bytes = panels * K * kGroupCols / (kind == kUInt4 ? 2 : 1);
  TORCH_CHECK(codes.is_contiguous() && codes.numel() * codes.element_size() == code_bytes,
              "quant_linear: codes do not match ", N, " outputs of ", K, " inputs");
  const int64_t table = panels * (K / group) * kGroupCols;
  const bool half = scales.scalar_type() == at::kHalf;
  TORCH_CHECK((half || scales.scalar_type() == at::kFloat) && scales.is_contiguous() && scales.numel() == table,
              "quant_linear: scales must be ", table, " contiguous float32 or float16 values");
  const bool has_mins = mins.has_value() && mins->defined();
  TORCH_CHECK(has_mins || kind != kUInt4, "quant_linear: uint4 codes need mins");
  TORCH_CHECK(!has_mins || (mins->scalar_type() == scales.scalar_type() && mins->is_contiguous() &&
                            mins->numel() == table),
              "quant_linear: mins must be ", table, " contiguous values of the scales' type");
  const QuantWeight q{static_cast<const uint8_t*>(codes.data_ptr()), scales.data_ptr(),
                      has_mins ? mins->data_ptr() : nullptr, half, group, K / 2};
  return linear_call(x, N, bias, float_out, [&](const uint16_t* xp, int64_t M, int64_t K, const float* b, auto* y) {
    std::vector<float> xsum(has_mins ? M * (K / group) : 0);
    if (has_mins) group_sums(xp, M, K, group, xsum.data());
    const float* xs = has_mins ? xsum.data() : nullptr;
    using out_t = std::remove_pointer_t<decltype(y)>;
    switch (kind) {
      case kInt8: run_quant_linear_on_best_path<kInt8, out_t>(xp, M, K, q, xs, N, b, y); break;
      case kUInt4: run_quant_linear_on_best_path<kUInt4, out_t>(xp, M, K, q, xs, N, b, y); break;
      default: run_quant_linear_on_best_path<kFp8E4M3, out_t>(xp, M, K, q, xs, N, b, y); break;
    }
  });
#else
  TORCH_CHECK(false, "quant_linear needs a CPU with AVX-512 BF16 and VBMI (see quant_linear_supported())");
#endif
}
