// 16-lane float32 vectors for the CPU kernels: loads that widen bf16/fp16/fp32, stores that
// round to nearest even (the rounding of c10's scalar conversions, so the vector and scalar
// paths store the same values), masked tails, and e^x for x <= 0.
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Float8_e5m2.h>
#include <c10/util/Half.h>

#include <cstdint>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

// The vector paths of the pointwise kernels need masked 16-bit loads and stores.
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define AXON_AVX512_VEC 1
#endif

namespace axon_cpu {

template <typename T>
inline float widen(T x) {
  return static_cast<float>(x);
}

#if defined(__AVX512F__)

inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const c10::BFloat16* p) {
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}
inline __m512 load16(const c10::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
// FP8 (the KV cache's one-byte forms), exactly. E5M2 is the top byte of a float16.
inline __m512 load16(const c10::Float8_e5m2* p) {
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm512_cvtph_ps(_mm256_slli_epi16(_mm256_cvtepu8_epi16(raw), 8));
}
// E4M3 (s eeee mmm, bias 7, no infinities): a normal code is the float32 with exponent e + 120
// and mantissa m << 20; e == 0 is subnormal, m * 2^-9.
inline __m512 load16(const c10::Float8_e4m3fn* p) {
  const __m512i u = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  const __m512i em = _mm512_and_si512(u, _mm512_set1_epi32(0x7f));
  const __m512i sign = _mm512_slli_epi32(_mm512_and_si512(u, _mm512_set1_epi32(0x80)), 24);
  const __m512 normal = _mm512_castsi512_ps(_mm512_add_epi32(_mm512_slli_epi32(em, 20), _mm512_set1_epi32(120 << 23)));
  const __m512 subnormal = _mm512_mul_ps(_mm512_cvtepi32_ps(em), _mm512_set1_ps(1.0f / 512.0f));
  const __mmask16 small = _mm512_cmplt_epu32_mask(em, _mm512_set1_epi32(8));
  const __m512 magnitude = _mm512_mask_mov_ps(normal, small, subnormal);
  return _mm512_castsi512_ps(_mm512_or_si512(_mm512_castps_si512(magnitude), sign));
}

// e^x for x <= 0: 2^(x log2 e) as 2^n * 2^f, f in [-0.5, 0.5], 2^f by its Taylor series to
// degree 7 (relative error below 2e-8 there); scalef makes 2^n and flushes huge negative n to 0.
inline __m512 exp_nonpositive(__m512 x) {
  const __m512 t = _mm512_mul_ps(x, _mm512_set1_ps(1.4426950408889634f));
  const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_mul_ps(_mm512_sub_ps(t, n), _mm512_set1_ps(0.6931471805599453f));
  __m512 p = _mm512_set1_ps(1.0f / 5040.0f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f / 720.0f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f / 120.0f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f / 24.0f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f / 6.0f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, n);
}

#endif  // __AVX512F__

#if defined(AXON_AVX512_VEC)

// The first `n` (<= 16) elements, widened; the rest zero.
inline __m512 load_n(const float* p, int64_t n) {
  return _mm512_maskz_loadu_ps(static_cast<__mmask16>((1u << n) - 1u), p);
}
inline __m512 load_n(const c10::BFloat16* p, int64_t n) {
  const __m256i raw = _mm256_maskz_loadu_epi16(static_cast<__mmask16>((1u << n) - 1u), p);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}
inline __m512 load_n(const c10::Half* p, int64_t n) {
  return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(static_cast<__mmask16>((1u << n) - 1u), p));
}

// Round to the storage type (nearest even) and store the first `n` lanes.
inline void store_n(float* p, __m512 v, int64_t n) {
  _mm512_mask_storeu_ps(p, static_cast<__mmask16>((1u << n) - 1u), v);
}
inline __m256i to_bf16_bits(__m512 v) {
  __m512i b = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(b, 16), _mm512_set1_epi32(1));
  b = _mm512_add_epi32(b, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff)));
  return _mm512_cvtepi32_epi16(_mm512_srli_epi32(b, 16));
}
inline void store_n(c10::BFloat16* p, __m512 v, int64_t n) {
  _mm256_mask_storeu_epi16(p, static_cast<__mmask16>((1u << n) - 1u), to_bf16_bits(v));
}
inline void store_n(c10::Half* p, __m512 v, int64_t n) {
  _mm256_mask_storeu_epi16(p, static_cast<__mmask16>((1u << n) - 1u),
                           _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}

// v rounded to the storage type and widened back: the value a store then a load would give.
inline __m512 round_to(__m512 v, const float*) { return v; }
inline __m512 round_to(__m512 v, const c10::BFloat16*) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(to_bf16_bits(v)), 16));
}
inline __m512 round_to(__m512 v, const c10::Half*) {
  return _mm512_cvtph_ps(_mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}

#endif  // AXON_AVX512_VEC

}  // namespace axon_cpu
