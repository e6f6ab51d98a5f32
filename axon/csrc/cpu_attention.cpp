// Paged attention for the CPU: reads K/V blocks in place through the block table.
//
// One call attends every request of a step, whatever its query count (decodes, fresh prefills,
// prefills over a cached prefix), so a step needs no grouping, no gather and no mask:
//
//   q        [num_tokens, H, D]            rows past num_actual_tokens are padding: zeros out
//   cache    [num_blocks, block_size, KVH, D]
//   table    [num_reqs, max_blocks] int64  block ids; 0 (the null block) past a request's end
//   qsl      [num_reqs + 1] int32          query rows of request r: qsl[r] .. qsl[r + 1]
//   seq_lens [num_reqs] int32              keys of request r: its cached and new tokens
//
// Query i of a request with n queries and L keys sits at position L - n + i and may read keys
// 0 .. L - n + i (bottom-right causal; covers a cached prefix and a plain decode alike).
//
// ``encoder_attention`` runs the same kernels without a cache or a mask: each sequence of a flat
// [tokens, heads, head_dim] step attends to all of its own tokens (bidirectional, BERT), its
// keys read in place from the step's k and v (a "cache" of one-token blocks).
//
// Work items are (request, KV head, chunk of queries), or for decodes when there are enough of
// them (request, every KV head): whole tokens, one contiguous run each. The G query heads
// sharing a KV head are rows of one item, so each key and value is widened to float32 once for
// all of them. Accumulation is float32 for every input dtype. Two strategies:
//
//   many rows (every row by default)    a row's 16 scores per tile of keys (counted from key
//       0) are dot products (partial sums over d mod 16, then one fixed reduction network),
//       its softmax and its weighted values sums in key order: the same operations in the
//       same order for a row whatever else its item or step holds. So a token's numbers are
//       the same alone or batched, after a prefix-cache hit, in a chunked prefill or
//       recomputed after preemption (batch invariance). The AVX-512 code scores every key of
//       the item first, then takes each row's softmax whole and sums the values: K and then V
//       stream by block after block, two tiles prefetched ahead, and decode-size items read
//       them in place (no widened copy); the plain loops keep flash attention's online softmax.
//   few rows (opt-out: AXON_BATCH_INVARIANT=0, set_batch_invariant(false))  for items of up
//       to 16 rows: every score of the item, softmax over whole rows, then the weighted sum of
//       values, a score's dot product reduced per key. A row's result then depends on whether
//       its request was a decode or a segment of a prefill; kept as the measure of what
//       invariance costs (benchmarks/batch_invariance.py), which is now nothing.
//
// Both exist twice: with AVX-512 intrinsics for head dims that are multiples of 16 (the head
// dim a template parameter, so every loop over it unrolls), and as plain loops for any other
// machine or head dim. ``set_generic(true)`` forces the plain loops (the tests run both).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/arange.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/full.h>
#include <ATen/ops/zeros_like.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Float8_e5m2.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <limits>
#include <tuple>

#include "cpu_vec.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <utility>
#include <vector>

namespace axon_cpu {
namespace {

#define AXON_INLINE inline __attribute__((always_inline))

// Built with -ffast-math (so that plain loops vectorize std::exp): no infinities, so "no score
// yet" is a finite number far below any real score.
constexpr float kNoScore = -1e30f;
constexpr int64_t kTile = 16;         // keys per tile of the many-rows path
constexpr int64_t kQueryChunk = 32;   // queries per work item: bounds the row buffers
constexpr int64_t kFewRows = 16;      // up to this many rows per item: the few-rows path
constexpr int64_t kInPlaceRows = 4;   // up to this many rows per KV head: keys read from the cache in place
constexpr int64_t kMaxHeadDim = 512;

std::atomic<bool> g_force_generic{false};
std::atomic<bool> g_batch_invariant{true};

// What one work item reads and writes, resolved from the step's metadata: queries
// q_begin .. q_end of one request, for KV heads kv_head .. kv_head + num_item_heads.
template <typename scalar_t, typename cache_t>
struct Item {
  const scalar_t* q;
  scalar_t* out;
  const cache_t* k_cache;
  const cache_t* v_cache;
  const int64_t* table;  // this request's block-table row
  int64_t num_heads, group, head_dim, block_size, token_stride, block_stride;
  int64_t kv_head, num_item_heads, first_token, first_pos, q_begin, q_end;  // first_pos: query 0's position
  float scale;
  int64_t all_keys;  // > 0: not causal, every query reads keys 0 .. all_keys - 1
  int64_t window;      // > 0: a query at position p reads keys p - window + 1 .. p only
  const float* sinks;  // [num_heads] logits that join each row's softmax denominator; nullptr: none
  // Decode context parallelism: the cache holds one rank's share of each sequence, key j being
  // position j * dcp_world + dcp_rank (world 1: key j is position j).
  int64_t dcp_world, dcp_rank;
  float* lse;  // [tokens, num_heads]: each row's log-sum-exp of its scaled scores; nullptr: none

  int64_t rows_per_head() const { return (q_end - q_begin) * group; }
  int64_t rows() const { return num_item_heads * rows_per_head(); }
  // Rows are ordered [KV head][query][query head of the group].
  int64_t row_query(int64_t r) const { return q_begin + r % rows_per_head() / group; }
  int64_t row_offset(int64_t r) const {
    const int64_t head = (kv_head + r / rows_per_head()) * group + r % group;
    return ((first_token + row_query(r)) * num_heads + head) * head_dim;
  }
  // The last key a query at position pos reads (-1: none, a rank without a key that early).
  int64_t last_local_key(int64_t pos) const {
    if (dcp_world == 1) return pos;
    return pos >= dcp_rank ? (pos - dcp_rank) / dcp_world : -1;
  }
  int64_t last_key(int64_t r) const { return all_keys > 0 ? all_keys - 1 : last_local_key(first_pos + row_query(r)); }
  int64_t first_key(int64_t r) const {
    return window > 0 ? std::max<int64_t>(0, first_pos + row_query(r) - window + 1) : 0;
  }
  // The first key any row of the item reads (its first query's), rounded down to a whole tile.
  int64_t first_tile_key(int64_t tile) const {
    return window > 0 ? std::max<int64_t>(0, first_pos + q_begin - window + 1) / tile * tile : 0;
  }
  bool has_sink() const { return sinks != nullptr; }
  float sink(int64_t r) const { return sinks[(kv_head + r / rows_per_head()) * group + r % group]; }
  int64_t num_keys() const {  // the most any row reads
    return all_keys > 0 ? all_keys : last_local_key(first_pos + q_end - 1) + 1;
  }
  int64_t lse_index(int64_t r) const { return row_offset(r) / head_dim; }
  // Offset of key j of the item's first KV head (the next heads follow, head_dim apart).
  int64_t key_offset(int64_t j) const {
    return table[j / block_size] * block_stride + (j % block_size) * token_stride + kv_head * head_dim;
  }

  // Prefetch what the item reads of block b (its KV heads of every token): the blocks of a
  // request lie anywhere in memory, so without it each block starts with a string of misses.
  void prefetch_block(const cache_t* cache, int64_t b) const {
    const char* base = reinterpret_cast<const char*>(cache + table[b] * block_stride + kv_head * head_dim);
    const int64_t bytes = num_item_heads * head_dim * static_cast<int64_t>(sizeof(cache_t));
    const int64_t stride = token_stride * static_cast<int64_t>(sizeof(cache_t));
    for (int64_t t = 0; t < block_size; ++t) {
      for (int64_t off = 0; off < bytes; off += 64) __builtin_prefetch(base + t * stride + off, 0, 2);
    }
  }

  // fn(j, row) for keys j = 0 .. n - 1 of ``cache`` (row: key j's first KV head of the item),
  // block by block (no division per key), the next block prefetched while one is read.
  template <typename Fn>
  void for_each_key(int64_t n, const cache_t* cache, Fn&& fn) const {
    const int64_t num_blocks = (n + block_size - 1) / block_size;
    for (int64_t b = 0; b < std::min<int64_t>(num_blocks, 2); ++b) prefetch_block(cache, b);
    for (int64_t b = 0, j = 0; j < n; ++b) {
      if (b + 2 < num_blocks) prefetch_block(cache, b + 2);
      const cache_t* row = cache + table[b] * block_stride + kv_head * head_dim;
      const int64_t end = std::min(n, j + block_size);
      for (; j < end; ++j, row += token_stride) fn(j, row);
    }
  }
};

// The plain loops' many-rows working set (online softmax), carved out of one per-thread buffer.
struct OnlineSoftmaxScratch {
  float* qf;       // [rows, D], scaled
  float* acc;      // [rows, D]
  float* row_max;  // [rows]
  float* row_sum;  // [rows]
  float* kt;       // [D, kTile]: the K tile, transposed
  float* vt;       // [kTile, D]
  OnlineSoftmaxScratch(std::vector<float>& buffer, int64_t rows, int64_t D) {
    buffer.resize(static_cast<size_t>(rows * D * 2 + rows * 2 + kTile * D * 2 + 16));
    qf = buffer.data();
    acc = qf + rows * D;
    row_max = acc + rows * D;
    row_sum = row_max + rows;
    kt = row_sum + rows;
    vt = kt + D * kTile;
  }
};

template <typename scalar_t, typename cache_t>
void load_rows(const Item<scalar_t, cache_t>& it, float* qf, float* acc) {
  const int64_t D = it.head_dim;
  for (int64_t r = 0; r < it.rows(); ++r) {
    const scalar_t* src = it.q + it.row_offset(r);
    for (int64_t d = 0; d < D; ++d) qf[r * D + d] = widen(src[d]) * it.scale;
    std::fill(acc + r * D, acc + (r + 1) * D, 0.0f);
  }
}

// Each row's output (its weighted values over its sum) and, where the item asks, its log-sum-exp
// from its maximum score (row_max) and its sum; a row without keys: zeros and kNoScore.
template <typename scalar_t, typename cache_t>
void store_rows(const Item<scalar_t, cache_t>& it, const float* acc, const float* row_sum,
                const float* row_max = nullptr) {
  const int64_t D = it.head_dim;
  for (int64_t r = 0; r < it.rows(); ++r) {
    scalar_t* dst = it.out + it.row_offset(r);
    const float inv = row_sum[r] > 0.0f ? 1.0f / row_sum[r] : 0.0f;
    for (int64_t d = 0; d < D; ++d) dst[d] = static_cast<scalar_t>(acc[r * D + d] * inv);
    if (it.lse != nullptr) it.lse[it.lse_index(r)] = row_sum[r] > 0.0f ? row_max[r] + std::log(row_sum[r]) : kNoScore;
  }
}

// Softmax of each row's first valid scores in place (the rest zeroed); returns row sums.
template <typename scalar_t, typename cache_t>
void softmax_rows(const Item<scalar_t, cache_t>& it, float* scores, int64_t num_keys, float* row_sum);

// ---------------------------------------------------------------------------------------------
// Plain loops: any machine, any head dim.

template <typename scalar_t, typename cache_t>
void few_rows_generic(const Item<scalar_t, cache_t>& it, std::vector<float>& scratch) {
  const int64_t D = it.head_dim, rows = it.rows(), n = it.num_keys();
  scratch.resize(static_cast<size_t>(rows * D * 2 + rows * n + rows + D));
  float* qf = scratch.data();         // [rows, D], scaled
  float* acc = qf + rows * D;         // [rows, D]
  float* scores = acc + rows * D;     // [rows, n]
  float* row_sum = scores + rows * n; // [rows]
  float* f = row_sum + rows;          // [D]: one key or value, widened
  load_rows(it, qf, acc);
  const int64_t per_head = it.rows_per_head();
  it.for_each_key(n, it.k_cache, [&](int64_t j, const cache_t* k) {
    for (int64_t h = 0; h < it.num_item_heads; ++h) {
      for (int64_t d = 0; d < D; ++d) f[d] = widen(k[h * D + d]);
      for (int64_t r = h * per_head; r < (h + 1) * per_head; ++r) {
        float s = 0.0f;
        for (int64_t d = 0; d < D; ++d) s += qf[r * D + d] * f[d];
        scores[r * n + j] = s;
      }
    }
  });
  softmax_rows(it, scores, n, row_sum);
  it.for_each_key(n, it.v_cache, [&](int64_t j, const cache_t* v) {
    for (int64_t h = 0; h < it.num_item_heads; ++h) {
      for (int64_t d = 0; d < D; ++d) f[d] = widen(v[h * D + d]);
      for (int64_t r = h * per_head; r < (h + 1) * per_head; ++r) {
        const float p = scores[r * n + j];
        for (int64_t d = 0; d < D; ++d) acc[r * D + d] += p * f[d];
      }
    }
  });
  store_rows(it, acc, row_sum);
}

template <typename scalar_t, typename cache_t>
void many_rows_generic(const Item<scalar_t, cache_t>& it, std::vector<float>& scratch) {
  const int64_t D = it.head_dim, rows = it.rows(), n = it.num_keys(), per_head = it.rows_per_head();
  const OnlineSoftmaxScratch sc(scratch, rows, D);
  float *qf = sc.qf, *acc = sc.acc, *row_max = sc.row_max, *row_sum = sc.row_sum, *kt = sc.kt, *vt = sc.vt;
  load_rows(it, qf, acc);
  std::fill(row_max, row_max + rows, kNoScore);
  std::fill(row_sum, row_sum + rows, 0.0f);
  float scores[kTile];
  for (int64_t j0 = 0; j0 < n; j0 += kTile) {
    const int64_t count = std::min(kTile, n - j0);
    for (int64_t h = 0; h < it.num_item_heads; ++h) {
      std::fill(kt, kt + D * kTile, 0.0f);
      for (int64_t t = 0; t < count; ++t) {
        const int64_t off = it.key_offset(j0 + t) + h * D;
        for (int64_t d = 0; d < D; ++d) kt[d * kTile + t] = widen(it.k_cache[off + d]);
        for (int64_t d = 0; d < D; ++d) vt[t * D + d] = widen(it.v_cache[off + d]);
      }
      for (int64_t r = h * per_head; r < (h + 1) * per_head; ++r) {
        const int64_t valid = std::min(count, it.last_key(r) - j0 + 1);
        const int64_t lo = std::max<int64_t>(0, it.first_key(r) - j0);  // keys before it: out of the window
        if (valid <= lo) continue;
        for (int64_t t = 0; t < kTile; ++t) scores[t] = 0.0f;
        for (int64_t d = 0; d < D; ++d) {
          const float qd = qf[r * D + d];
          for (int64_t t = 0; t < kTile; ++t) scores[t] += qd * kt[d * kTile + t];
        }
        float tile_max = kNoScore;
        for (int64_t t = lo; t < valid; ++t) tile_max = std::max(tile_max, scores[t]);
        const float new_max = std::max(row_max[r], tile_max);
        const float correction = std::exp(row_max[r] - new_max);
        float tile_sum = 0.0f;
        for (int64_t t = lo; t < valid; ++t) {
          scores[t] = std::exp(scores[t] - new_max);
          tile_sum += scores[t];
        }
        row_max[r] = new_max;
        row_sum[r] = row_sum[r] * correction + tile_sum;
        float* ar = acc + r * D;
        for (int64_t d = 0; d < D; ++d) ar[d] *= correction;
        for (int64_t t = lo; t < valid; ++t) {
          for (int64_t d = 0; d < D; ++d) ar[d] += scores[t] * vt[t * D + d];
        }
      }
    }
  }
  if (it.has_sink()) {  // the sink joins the denominator last
    for (int64_t r = 0; r < rows; ++r) {
      const float new_max = std::max(row_max[r], it.sink(r));
      const float correction = std::exp(row_max[r] - new_max);
      row_sum[r] = row_sum[r] * correction + std::exp(it.sink(r) - new_max);
      for (int64_t d = 0; d < D; ++d) acc[r * D + d] *= correction;
      row_max[r] = new_max;
    }
  }
  store_rows(it, acc, row_sum, row_max);
}

template <typename scalar_t, typename cache_t>
void softmax_rows(const Item<scalar_t, cache_t>& it, float* scores, int64_t num_keys, float* row_sum) {
  for (int64_t r = 0; r < it.rows(); ++r) {
    float* s = scores + r * num_keys;
    const int64_t valid = it.last_key(r) + 1;
    float m = kNoScore;
    for (int64_t j = 0; j < valid; ++j) m = std::max(m, s[j]);
    float sum = 0.0f;
    for (int64_t j = 0; j < valid; ++j) {
      s[j] = std::exp(s[j] - m);
      sum += s[j];
    }
    for (int64_t j = valid; j < num_keys; ++j) s[j] = 0.0f;
    row_sum[r] = sum;
  }
}

// ---------------------------------------------------------------------------------------------
// AVX-512, head dim D a multiple of 16 (NV vectors).

#if defined(__AVX512F__)

template <int D, typename scalar_t, typename cache_t>
void few_rows_avx512(const Item<scalar_t, cache_t>& it, std::vector<float>& scratch) {
  constexpr int NV = D / 16;
  const int64_t rows = it.rows(), n = it.num_keys();
  const int64_t n_pad = (n + 15) / 16 * 16;  // score rows padded to whole vectors
  scratch.resize(static_cast<size_t>(rows * D * 2 + rows * n_pad + rows));
  float* qf = scratch.data();             // [rows, D], scaled
  float* acc = qf + rows * D;             // [rows, D]
  float* scores = acc + rows * D;         // [rows, n_pad]
  float* row_sum = scores + rows * n_pad; // [rows]
  load_rows(it, qf, acc);
  const int64_t per_head = it.rows_per_head();
  it.for_each_key(n, it.k_cache, [&](int64_t j, const cache_t* k) {
    for (int64_t h = 0; h < it.num_item_heads; ++h) {
      __m512 kv[NV];
      for (int i = 0; i < NV; ++i) kv[i] = load16(k + h * D + 16 * i);
      for (int64_t r = h * per_head; r < (h + 1) * per_head; ++r) {
        const float* qr = qf + r * D;
        __m512 s = _mm512_mul_ps(_mm512_loadu_ps(qr), kv[0]);
        for (int i = 1; i < NV; ++i) s = _mm512_fmadd_ps(_mm512_loadu_ps(qr + 16 * i), kv[i], s);
        scores[r * n_pad + j] = _mm512_reduce_add_ps(s);
      }
    }
  });
  for (int64_t r = 0; r < rows; ++r) {
    float* s = scores + r * n_pad;
    const int64_t valid = it.last_key(r) + 1;
    std::fill(s + valid, s + n_pad, kNoScore);
    __m512 m = _mm512_set1_ps(kNoScore);
    for (int64_t j = 0; j < n_pad; j += 16) m = _mm512_max_ps(m, _mm512_loadu_ps(s + j));
    const __m512 row_max = _mm512_set1_ps(_mm512_reduce_max_ps(m));
    __m512 sum = _mm512_setzero_ps();
    for (int64_t j = 0; j < n_pad; j += 16) {
      const __m512 p = exp_nonpositive(_mm512_sub_ps(_mm512_loadu_ps(s + j), row_max));
      _mm512_storeu_ps(s + j, p);
      sum = _mm512_add_ps(sum, p);
    }
    row_sum[r] = _mm512_reduce_add_ps(sum);
  }
  it.for_each_key(n, it.v_cache, [&](int64_t j, const cache_t* v) {
    for (int64_t h = 0; h < it.num_item_heads; ++h) {
      __m512 vv[NV];
      for (int i = 0; i < NV; ++i) vv[i] = load16(v + h * D + 16 * i);
      for (int64_t r = h * per_head; r < (h + 1) * per_head; ++r) {
        const __m512 p = _mm512_set1_ps(scores[r * n_pad + j]);
        float* ar = acc + r * D;
        for (int i = 0; i < NV; ++i) {
          _mm512_storeu_ps(ar + 16 * i, _mm512_fmadd_ps(p, vv[i], _mm512_loadu_ps(ar + 16 * i)));
        }
      }
    }
  });
  store_rows(it, acc, row_sum);
}

// One row's scores against a tile of 16 keys: lane t of the result is q . k_t, where key(t, i)
// is the i-th 16 floats of key t (read from a widened tile, or widened from the cache in place:
// the same numbers). Each dot product is accumulated as 16 partial sums (lane = d mod 16,
// chunks in order) and the 16 partial vectors are then reduced by one fixed network (pairs of
// lanes, quads, then 128-bit lanes): the same operations in the same order for every row,
// whatever else the call holds, and no transposed copy of K.
template <int D, typename KeyFn>
AXON_INLINE __m512 row_scores(const float* q, KeyFn&& key) {
  constexpr int NV = D / 16;
  __m512 qv[NV];
  for (int i = 0; i < NV; ++i) qv[i] = _mm512_loadu_ps(q + 16 * i);
  const auto dot = [&](int t) {
    __m512 acc = _mm512_mul_ps(qv[0], key(t, 0));
    for (int i = 1; i < NV; ++i) acc = _mm512_fmadd_ps(qv[i], key(t, i), acc);
    return acc;
  };
  // w[i], lane L: [k_2i's lanes 4L+0 and 4L+2, k_2i+1's, k_2i's 4L+1 and 4L+3, k_2i+1's], summed.
  // Unrolled whole, so the 16 dot products' FMA chains interleave (one pair at a time waits on
  // the FMA latency: a third of the throughput).
  __m512 w[8];
#pragma GCC unroll 8
  for (int i = 0; i < 8; ++i) {
    const __m512 a = dot(2 * i), b = dot(2 * i + 1);
    w[i] = _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b));
  }
  // x[i], lane L: keys 4i .. 4i + 3, each summed over its 128-bit lane L.
  __m512 x[4];
  for (int i = 0; i < 4; ++i) {
    x[i] = _mm512_add_ps(_mm512_shuffle_ps(w[2 * i], w[2 * i + 1], 0x44), _mm512_shuffle_ps(w[2 * i], w[2 * i + 1], 0xEE));
  }
  const __m512 p0 = _mm512_add_ps(_mm512_shuffle_f32x4(x[0], x[1], 0x44), _mm512_shuffle_f32x4(x[0], x[1], 0xEE));
  const __m512 p1 = _mm512_add_ps(_mm512_shuffle_f32x4(x[2], x[3], 0x44), _mm512_shuffle_f32x4(x[2], x[3], 0xEE));
  return _mm512_add_ps(_mm512_shuffle_f32x4(p0, p1, 0x88), _mm512_shuffle_f32x4(p0, p1, 0xDD));
}

// Where keys j0 .. j0 + 15 of ``cache`` start (the item's first KV head); keys past n point at
// key j0, whose lanes the callers never use.
template <typename scalar_t, typename cache_t>
AXON_INLINE void tile_keys(const Item<scalar_t, cache_t>& it, const cache_t* cache, int64_t j0, int64_t n,
                           const cache_t** keys) {
  for (int64_t t = 0; t < kTile; ++t) keys[t] = cache + it.key_offset(j0 + t < n ? j0 + t : j0);
}

// Prefetches (into L2) what the item reads of keys j .. j + 15 of ``cache``.
template <typename scalar_t, typename cache_t>
AXON_INLINE void prefetch_tile(const Item<scalar_t, cache_t>& it, const cache_t* cache, int64_t j, int64_t n) {
  const int64_t bytes = it.num_item_heads * it.head_dim * static_cast<int64_t>(sizeof(cache_t));
  for (int64_t t = j; t < std::min(n, j + kTile); ++t) {
    const char* line = reinterpret_cast<const char*>(cache + it.key_offset(t));
    for (int64_t off = 0; off < bytes; off += 64) __builtin_prefetch(line + off, 0, 2);
  }
}

// fn(j0, keys) for the tiles of 16 keys of ``cache`` up to n, in order (keys: tile_keys'), each
// tile prefetched two ahead so that it arrives (often a block of its own, anywhere in memory)
// while the one before it is used. With a ``tile`` buffer, each tile is first widened into it
// for every KV head of the item: [head][16][D], a token's heads read as one contiguous run.
template <int D, typename scalar_t, typename cache_t, typename Fn>
AXON_INLINE void for_each_tile(const Item<scalar_t, cache_t>& it, const cache_t* cache, int64_t n, float* tile,
                               Fn&& fn) {
  constexpr int NV = D / 16;
  const cache_t* keys[kTile];
  const int64_t begin = it.first_tile_key(kTile);  // tiles before it lie outside every row's window
  prefetch_tile(it, cache, begin, n);
  prefetch_tile(it, cache, begin + kTile, n);
  for (int64_t j0 = begin; j0 < n; j0 += kTile) {
    prefetch_tile(it, cache, j0 + 2 * kTile, n);
    tile_keys(it, cache, j0, n, keys);
    for (int64_t t = 0; tile != nullptr && t < kTile; ++t) {
      for (int64_t h = 0; h < it.num_item_heads; ++h) {
        float* dst = tile + (h * kTile + t) * D;
        for (int i = 0; i < NV; ++i) _mm512_store_ps(dst + 16 * i, load16(keys[t] + h * D + 16 * i));
      }
    }
    fn(j0, keys);
  }
}

// Keys u_begin .. u_end - 1 of a tile's values, weighted, added to R rows' sums (acc[r], D floats
// each) with p[r][u] the row's weight of key u: each row's sum in key order, one FMA chain per
// 16 floats, as one row alone would compute it. R rows at once give R times the independent
// chains (a chain waits on its FMA's latency) and share each value's load.
template <int D, int R, typename ValueFn>
AXON_INLINE void weigh_values(float* const* acc, const float* const* p, int64_t u_begin, int64_t u_end,
                              ValueFn&& value) {
  constexpr int NV = D / 16;
  __m512 a[R][NV];
  for (int r = 0; r < R; ++r) {
    for (int i = 0; i < NV; ++i) a[r][i] = _mm512_loadu_ps(acc[r] + 16 * i);
  }
  for (int64_t u = u_begin; u < u_end; ++u) {
    __m512 vu[NV];
    for (int i = 0; i < NV; ++i) vu[i] = value(u, i);
    for (int r = 0; r < R; ++r) {
      const __m512 pu = _mm512_set1_ps(p[r][u]);
      for (int i = 0; i < NV; ++i) a[r][i] = _mm512_fmadd_ps(pu, vu[i], a[r][i]);
    }
  }
  for (int r = 0; r < R; ++r) {
    for (int i = 0; i < NV; ++i) _mm512_storeu_ps(acc[r] + 16 * i, a[r][i]);
  }
}

// Rows weighed together by weigh_values: as many as the registers hold (accumulators and one
// key's values).
template <int D>
constexpr int kValueRows = D <= 64 ? 4 : (D <= 128 ? 2 : 1);

// Every row's scores against every key it reads, softmax over the whole row, then the values
// weighted in key order. A row's numbers come from its own query and keys only: its scores by
// row_scores' fixed network, its maximum exactly, its sum in lane j mod 16 for key j then one
// fixed reduction, its values in key order; so they are the same whatever else the item or the
// step holds (batch invariance). K and then V are read once per item, block after block. An
// item with few rows per KV head (a decode) reads the cache in place; one with many (a prefill
// chunk) widens each tile once for all of them (the same numbers: widening is exact).
template <int D, bool kWiden, typename scalar_t, typename cache_t>
void many_rows_avx512(const Item<scalar_t, cache_t>& it, std::vector<float>& scratch) {
  constexpr int NV = D / 16;
  const int64_t rows = it.rows(), n = it.num_keys(), per_head = it.rows_per_head(), heads = it.num_item_heads;
  const int64_t n_pad = (n + kTile - 1) / kTile * kTile;
  const int64_t tile_size = kWiden ? heads * kTile * D : 0;
  scratch.resize(static_cast<size_t>(rows * D * 2 + rows * n_pad + 2 * rows + tile_size + 16));
  float* qf = reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(scratch.data()) + 63) & ~uintptr_t{63});
  float* tile = kWiden ? qf + rows * D : nullptr;  // [heads, kTile, D], 64-byte aligned
  float* acc = qf + rows * D + tile_size;          // [rows, D]
  float* scores = acc + rows * D;                  // [rows, n_pad]
  float* row_sum = scores + rows * n_pad;          // [rows]
  float* row_maxes = row_sum + rows;               // [rows]
  load_rows(it, qf, acc);
  // What row_scores and the value sums read: float i (of 16) of key t of KV head h.
  const auto widened = [&](const cache_t* const* keys, int64_t h, int t, int i) {
    if constexpr (kWiden) return _mm512_load_ps(tile + (h * kTile + t) * D + 16 * i);
    return load16(keys[t] + h * D + 16 * i);
  };
  for_each_tile<D>(it, it.k_cache, n, tile, [&](int64_t j0, const cache_t* const* keys) {
    for (int64_t r = 0; r < rows; ++r) {
      if (it.last_key(r) < j0 || it.first_key(r) >= j0 + kTile) continue;  // the row reads none of the tile
      const int64_t h = r / per_head;
      const __m512 sc = row_scores<D>(qf + r * D, [&](int t, int i) { return widened(keys, h, t, i); });
      _mm512_storeu_ps(scores + r * n_pad + j0, sc);
    }
  });
  for (int64_t r = 0; r < rows; ++r) {
    float* s = scores + r * n_pad;
    const int64_t valid = it.last_key(r) + 1, end = (valid + kTile - 1) / kTile * kTile;
    const int64_t first = it.first_key(r), begin = first / kTile * kTile;  // the row's window, whole tiles
    std::fill(s + begin, s + first, kNoScore);
    std::fill(s + valid, s + end, kNoScore);
    __m512 m = _mm512_set1_ps(kNoScore);
    for (int64_t j = begin; j < end; j += kTile) m = _mm512_max_ps(m, _mm512_loadu_ps(s + j));
    float max_score = _mm512_reduce_max_ps(m);
    if (it.has_sink()) max_score = std::max(max_score, it.sink(r));
    const __m512 row_max = _mm512_set1_ps(max_score);
    __m512 sum = _mm512_setzero_ps();
    for (int64_t j = begin; j < end; j += kTile) {
      const __m512 p = exp_nonpositive(_mm512_sub_ps(_mm512_loadu_ps(s + j), row_max));
      _mm512_storeu_ps(s + j, p);
      sum = _mm512_add_ps(sum, p);
    }
    row_sum[r] = _mm512_reduce_add_ps(sum);
    if (it.has_sink()) row_sum[r] += std::exp(it.sink(r) - max_score);  // after the keys: one order
    row_maxes[r] = max_score;
  }
  constexpr int RV = kValueRows<D>;
  for_each_tile<D>(it, it.v_cache, n, tile, [&](int64_t j0, const cache_t* const* keys) {
    // Up to RV rows of one KV head that read the tile, weighed together over the keys all of
    // them read, then each over the rest of its own.
    for (int64_t r = 0; r < rows;) {
      float* accs[RV];
      const float* ps[RV];
      int64_t valids[RV];
      int count = 0;
      int64_t h = -1, common = kTile;
      for (; r < rows && count < RV; ++r) {
        const int64_t valid = std::min(kTile, it.last_key(r) - j0 + 1);
        if (valid <= 0 || it.first_key(r) >= j0 + kTile) continue;  // keys before first_key weigh 0
        if (count > 0 && r / per_head != h) break;
        h = r / per_head;
        accs[count] = acc + r * D;
        ps[count] = scores + r * n_pad + j0;
        valids[count++] = valid;
        common = std::min(common, valid);
      }
      if (count == 0) continue;
      const auto value = [&](int64_t u, int i) { return widened(keys, h, u, i); };
      switch (count) {
        case 4: weigh_values<D, kValueRows<D> >= 4 ? 4 : 1>(accs, ps, 0, common, value); break;
        case 3: weigh_values<D, kValueRows<D> >= 3 ? 3 : 1>(accs, ps, 0, common, value); break;
        case 2: weigh_values<D, kValueRows<D> >= 2 ? 2 : 1>(accs, ps, 0, common, value); break;
        default: weigh_values<D, 1>(accs, ps, 0, common, value); break;
      }
      for (int c = 0; c < count; ++c) {
        if (valids[c] > common) weigh_values<D, 1>(accs + c, ps + c, common, valids[c], value);
      }
    }
  });
  store_rows(it, acc, row_sum, row_maxes);
}

template <int D, typename scalar_t, typename cache_t>
void many_rows_avx512(const Item<scalar_t, cache_t>& it, std::vector<float>& scratch) {
  if (it.rows_per_head() <= kInPlaceRows) {
    many_rows_avx512<D, false>(it, scratch);
  } else {
    many_rows_avx512<D, true>(it, scratch);
  }
}

#endif  // __AVX512F__

template <typename scalar_t, typename cache_t>
using ItemFn = void (*)(const Item<scalar_t, cache_t>&, std::vector<float>&);

// The (few rows, many rows) pair for this head dim and machine.
template <typename scalar_t, typename cache_t>
std::pair<ItemFn<scalar_t, cache_t>, ItemFn<scalar_t, cache_t>> kernels_for(int64_t head_dim) {
#if defined(__AVX512F__)
  if (!g_force_generic.load()) {
    switch (head_dim) {
#define AXON_HEAD_DIM(D) \
  case D:                \
    return {&few_rows_avx512<D, scalar_t, cache_t>, &many_rows_avx512<D, scalar_t, cache_t>};
      AXON_HEAD_DIM(32)
      AXON_HEAD_DIM(64)
      AXON_HEAD_DIM(80)
      AXON_HEAD_DIM(96)
      AXON_HEAD_DIM(128)
      AXON_HEAD_DIM(256)
#undef AXON_HEAD_DIM
      default:
        break;
    }
  }
#endif
  return {&few_rows_generic<scalar_t, cache_t>, &many_rows_generic<scalar_t, cache_t>};
}

template <typename scalar_t, typename cache_t>
void run_attention(const at::Tensor& q, at::Tensor& out, const at::Tensor& k_cache,
                   const at::Tensor& v_cache, const at::Tensor& block_table,
                   const at::Tensor& query_start_loc, const at::Tensor& seq_lens, double scale,
                   bool causal = true, int64_t window = 0, const float* sinks = nullptr,
                   int64_t dcp_world = 1, int64_t dcp_rank = 0, float* lse = nullptr) {
  // Not causal (encoder_attention): block_table is one int64 row 0 .. T - 1 over one-token
  // blocks, and request r's row starts at its first token.
  const int64_t num_reqs = seq_lens.size(0);
  const int64_t num_heads = q.size(1), head_dim = q.size(2);
  const int64_t num_kv_heads = k_cache.size(2), block_size = k_cache.size(1);
  const int64_t group = num_heads / num_kv_heads, token_stride = num_kv_heads * head_dim;
  const int32_t* qsl = query_start_loc.data_ptr<int32_t>();
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  const int64_t* table = block_table.data_ptr<int64_t>();
  // Few-row requests (decodes, short segments) read whole tokens (every KV head at once: one
  // contiguous run per token) when there are enough of them to keep every thread busy; else,
  // and for prefill chunks, one item per KV head.
  // Batch-invariant by default: every item on the many-rows path (see the top of this file).
  const bool invariant = g_batch_invariant.load();
  const int64_t threads = at::get_num_threads();
  int64_t num_few = 0;
  for (int64_t r = 0; r < num_reqs; ++r) num_few += (qsl[r + 1] - qsl[r]) * group <= kFewRows;
  const bool whole_tokens = num_few >= 2 * threads;
  std::vector<Item<scalar_t, cache_t>> items;
  auto add = [&](int64_t r, int64_t h, int64_t num_h, int64_t q0, int64_t q1) {
    const int64_t n = qsl[r + 1] - qsl[r];
    items.push_back({q.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(), k_cache.data_ptr<cache_t>(),
                     v_cache.data_ptr<cache_t>(), causal ? table + r * block_table.stride(0) : table + qsl[r],
                     num_heads, group, head_dim, block_size, token_stride, block_size * token_stride, h, num_h,
                     qsl[r], lens[r] - n, q0, q1, static_cast<float>(scale), causal ? 0 : int64_t{lens[r]},
                     causal ? window : 0, sinks, dcp_world, dcp_rank, lse});
  };
  for (int64_t r = 0; r < num_reqs; ++r) {
    const int64_t n = qsl[r + 1] - qsl[r];
    if (n == 0) continue;
    if (n * group <= kFewRows && whole_tokens) {
      add(r, 0, num_kv_heads, 0, n);
      continue;
    }
    for (int64_t h = 0; h < num_kv_heads; ++h) {
      for (int64_t b = 0; b < n; b += kQueryChunk) add(r, h, 1, b, std::min(n, b + kQueryChunk));
    }
  }
  const auto [few_rows, many_rows] = kernels_for<scalar_t, cache_t>(head_dim);
  at::parallel_for(0, static_cast<int64_t>(items.size()), 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scratch;
    for (int64_t i = begin; i < end; ++i) {
      // The few-rows kernels have no window, sinks or log-sum-exp: such items take the many-rows path.
      const bool few = !invariant && items[i].rows_per_head() <= kFewRows && window <= 0 && sinks == nullptr &&
                       lse == nullptr;
      (few ? few_rows : many_rows)(items[i], scratch);
    }
  });
}

void check_metadata(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                    const at::Tensor& block_table, const at::Tensor& query_start_loc,
                    const at::Tensor& seq_lens, int64_t num_actual_tokens, int64_t dcp_world = 1,
                    int64_t dcp_rank = 0) {
  TORCH_CHECK(dcp_world >= 1 && 0 <= dcp_rank && dcp_rank < dcp_world, "dcp_rank ", dcp_rank,
              " is not a rank of a context-parallel group of ", dcp_world);
  TORCH_CHECK(q.dim() == 3 && q.is_contiguous(), "q must be a contiguous [tokens, heads, head_dim] tensor");
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.is_contiguous() && v_cache.is_contiguous(),
              "caches must be contiguous [blocks, block_size, kv_heads, head_dim] tensors");
  TORCH_CHECK(k_cache.sizes() == v_cache.sizes() && k_cache.scalar_type() == v_cache.scalar_type(),
              "k_cache and v_cache differ in shape or dtype");
  TORCH_CHECK(k_cache.size(3) == q.size(2), "head_dim of q (", q.size(2), ") and cache (", k_cache.size(3),
              ") differ");
  TORCH_CHECK(q.size(2) <= kMaxHeadDim, "head_dim ", q.size(2), " exceeds ", kMaxHeadDim);
  TORCH_CHECK(q.size(1) % k_cache.size(2) == 0, q.size(1), " heads are not a multiple of ", k_cache.size(2),
              " KV heads");
  TORCH_CHECK(block_table.scalar_type() == at::kLong && block_table.dim() == 2 && block_table.stride(1) == 1,
              "block_table must be an int64 [num_reqs, max_blocks] tensor with unit column stride");
  TORCH_CHECK(query_start_loc.scalar_type() == at::kInt && seq_lens.scalar_type() == at::kInt &&
                  query_start_loc.is_contiguous() && seq_lens.is_contiguous(),
              "query_start_loc and seq_lens must be contiguous int32 tensors");
  const int64_t num_reqs = seq_lens.size(0);
  TORCH_CHECK(query_start_loc.size(0) == num_reqs + 1, "query_start_loc has ", query_start_loc.size(0),
              " entries for ", num_reqs, " requests");
  TORCH_CHECK(block_table.size(0) >= num_reqs, "block_table has fewer rows than requests");
  const int32_t* qsl = query_start_loc.data_ptr<int32_t>();
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  TORCH_CHECK(qsl[0] == 0 && qsl[num_reqs] <= num_actual_tokens && num_actual_tokens <= q.size(0),
              "query_start_loc must run from 0 to at most num_actual_tokens <= q rows");
  const int64_t block_size = k_cache.size(1);
  for (int64_t r = 0; r < num_reqs; ++r) {
    const int64_t n = qsl[r + 1] - qsl[r];
    TORCH_CHECK(n >= 0 && lens[r] >= n, "request ", r, " has ", n, " queries but ", lens[r], " keys");
    // This rank's keys of the request: positions dcp_rank, dcp_rank + dcp_world, ... below lens[r].
    const int64_t keys = lens[r] > dcp_rank ? (lens[r] - 1 - dcp_rank) / dcp_world + 1 : 0;
    TORCH_CHECK((keys + block_size - 1) / block_size <= block_table.size(1), "request ", r, " reads ", keys,
                " keys; its block_table row has ", block_table.size(1), " blocks");
  }
}

at::Tensor attend(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                  const at::Tensor& block_table, const at::Tensor& query_start_loc, const at::Tensor& seq_lens,
                  int64_t num_actual_tokens, double scale, int64_t window = 0, const float* sinks = nullptr) {
  at::Tensor out = at::empty_like(q);
  if (num_actual_tokens < q.size(0)) out.narrow(0, num_actual_tokens, q.size(0) - num_actual_tokens).zero_();
  const auto qt = q.scalar_type();
  const auto ct = k_cache.scalar_type();
#define AXON_ATTN_CASE(QT, QC, CT, CC)                                                               \
  if (qt == QT && ct == CT) {                                                                         \
    run_attention<QC, CC>(q, out, k_cache, v_cache, block_table, query_start_loc, seq_lens, scale, true, window, \
                          sinks);                                                                        \
    return out;                                                                                       \
  }
  AXON_ATTN_CASE(at::kFloat, float, at::kFloat, float)
  AXON_ATTN_CASE(at::kBFloat16, c10::BFloat16, at::kBFloat16, c10::BFloat16)
  AXON_ATTN_CASE(at::kHalf, c10::Half, at::kHalf, c10::Half)
  AXON_ATTN_CASE(at::kFloat, float, at::kFloat8_e4m3fn, c10::Float8_e4m3fn)
  AXON_ATTN_CASE(at::kBFloat16, c10::BFloat16, at::kFloat8_e4m3fn, c10::Float8_e4m3fn)
  AXON_ATTN_CASE(at::kFloat, float, at::kFloat8_e5m2, c10::Float8_e5m2)
  AXON_ATTN_CASE(at::kBFloat16, c10::BFloat16, at::kFloat8_e5m2, c10::Float8_e5m2)
#undef AXON_ATTN_CASE
  TORCH_CHECK(false, "paged_attention: unsupported dtypes q ", qt, ", cache ", ct);
}

// q [T, H, D], k, v [T, KVH, D]: sequence r is rows query_start_loc[r] .. query_start_loc[r + 1]
// (int32, from 0 to at most T; rows past its end are padding: zeros out); each of its queries
// attends to every key of its own sequence.
at::Tensor encoder_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                             const at::Tensor& query_start_loc, double scale) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && k.sizes() == v.sizes() && k.size(0) == q.size(0) &&
                  k.size(2) == q.size(2) && q.size(1) % k.size(1) == 0,
              "encoder_attention takes q [T, H, D] and k, v [T, KVH, D] with H a multiple of KVH; got ",
              q.sizes(), ", ", k.sizes(), ", ", v.sizes());
  TORCH_CHECK(q.size(2) <= kMaxHeadDim, "head_dim ", q.size(2), " exceeds ", kMaxHeadDim);
  TORCH_CHECK(q.scalar_type() == k.scalar_type() && k.scalar_type() == v.scalar_type(),
              "q, k and v must share a dtype");
  TORCH_CHECK(query_start_loc.scalar_type() == at::kInt && query_start_loc.dim() == 1 &&
                  query_start_loc.is_contiguous() && query_start_loc.size(0) >= 1,
              "query_start_loc must be a contiguous int32 vector");
  const int64_t T = q.size(0), num_reqs = query_start_loc.size(0) - 1;
  const int32_t* qsl = query_start_loc.data_ptr<int32_t>();
  TORCH_CHECK(qsl[0] == 0 && qsl[num_reqs] <= T, "query_start_loc must run from 0 to at most ", T);
  at::Tensor lens = at::empty({num_reqs}, query_start_loc.options());
  for (int64_t r = 0; r < num_reqs; ++r) {
    TORCH_CHECK(qsl[r + 1] >= qsl[r], "query_start_loc must not decrease");
    lens.data_ptr<int32_t>()[r] = qsl[r + 1] - qsl[r];
  }
  const at::Tensor qc = q.contiguous();
  const at::Tensor kc = k.contiguous().view({T, 1, k.size(1), k.size(2)});
  const at::Tensor vc = v.contiguous().view({T, 1, k.size(1), k.size(2)});
  const at::Tensor tokens = at::arange(std::max<int64_t>(T, 1), query_start_loc.options().dtype(at::kLong));
  at::Tensor out = at::empty_like(qc);
  const int64_t n = qsl[num_reqs];
  if (n < T) out.narrow(0, n, T - n).zero_();
  const auto qt = qc.scalar_type();
#define AXON_ENC_CASE(QT, QC)                                                      \
  if (qt == QT) {                                                                   \
    run_attention<QC, QC>(qc, out, kc, vc, tokens, query_start_loc, lens, scale, false); \
    return out;                                                                     \
  }
  AXON_ENC_CASE(at::kFloat, float)
  AXON_ENC_CASE(at::kBFloat16, c10::BFloat16)
  AXON_ENC_CASE(at::kHalf, c10::Half)
#undef AXON_ENC_CASE
  TORCH_CHECK(false, "encoder_attention: unsupported dtype ", qt);
}

// A layer's sinks as the kernels read them: float32, one per query head; nullptr for none.
const float* sinks_of(const at::Tensor& sinks, int64_t num_heads) {
  if (!sinks.defined() || sinks.numel() == 0) return nullptr;
  TORCH_CHECK(sinks.scalar_type() == at::kFloat && sinks.is_contiguous() && sinks.numel() == num_heads,
              "sinks must be a contiguous float32 tensor with one logit per query head (", num_heads, ")");
  return sinks.data_ptr<float>();
}

at::Tensor paged_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                           const at::Tensor& block_table, const at::Tensor& query_start_loc,
                           const at::Tensor& seq_lens, int64_t num_actual_tokens, double scale, int64_t window,
                           const std::optional<at::Tensor>& sinks) {
  check_metadata(q, k_cache, v_cache, block_table, query_start_loc, seq_lens, num_actual_tokens);
  TORCH_CHECK(window >= 0, "window must be 0 (none) or positive, got ", window);
  return attend(q, k_cache, v_cache, block_table, query_start_loc, seq_lens, num_actual_tokens, scale, window,
                sinks_of(sinks.value_or(at::Tensor()), q.size(1)));
}

// Attention over this rank's share of each sequence (decode context parallelism): key j of the
// cache is position j * dcp_world + dcp_rank, queries sit at their positions as in
// paged_attention (seq_lens counts every position). Returns the rows' outputs and their
// log-sum-exps [tokens, heads] float32 (kNoScore for a row that reads no key here, and for
// padding), from which the ranks' partial results merge exactly.
std::tuple<at::Tensor, at::Tensor> paged_attention_partial(
    const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& block_table,
    const at::Tensor& query_start_loc, const at::Tensor& seq_lens, int64_t num_actual_tokens, double scale,
    int64_t dcp_world, int64_t dcp_rank) {
  check_metadata(q, k_cache, v_cache, block_table, query_start_loc, seq_lens, num_actual_tokens, dcp_world,
                 dcp_rank);
  at::Tensor out = at::zeros_like(q);
  at::Tensor lse = at::full({q.size(0), q.size(1)}, kNoScore, q.options().dtype(at::kFloat));
  const auto qt = q.scalar_type();
  const auto ct = k_cache.scalar_type();
#define AXON_PARTIAL_CASE(QT, QC)                                                                            \
  if (qt == QT && ct == QT) {                                                                                 \
    run_attention<QC, QC>(q, out, k_cache, v_cache, block_table, query_start_loc, seq_lens, scale, true, 0, \
                          nullptr, dcp_world, dcp_rank, lse.data_ptr<float>());                               \
    return {out, lse};                                                                                        \
  }
  AXON_PARTIAL_CASE(at::kFloat, float)
  AXON_PARTIAL_CASE(at::kBFloat16, c10::BFloat16)
  AXON_PARTIAL_CASE(at::kHalf, c10::Half)
#undef AXON_PARTIAL_CASE
  TORCH_CHECK(false, "paged_attention_partial: unsupported dtypes q ", qt, ", cache ", ct);
}

// The largest finite value of a cache type: an FP8 cache saturates there (a plain conversion
// would make a larger value NaN).
template <typename cache_t>
constexpr float kCacheMax = std::numeric_limits<float>::max();
template <>
constexpr float kCacheMax<c10::Float8_e4m3fn> = 448.0f;
template <>
constexpr float kCacheMax<c10::Float8_e5m2> = 57344.0f;

template <typename src_t, typename cache_t>
void write_rows(const at::Tensor& src, at::Tensor& cache, const int64_t* slots, int64_t n, float inv_scale) {
  const int64_t width = src.size(1) * src.size(2);
  const src_t* s = src.data_ptr<src_t>();
  cache_t* c = cache.data_ptr<cache_t>();
  const int64_t src_stride = src.stride(0);
  constexpr float limit = kCacheMax<cache_t>;
  for (int64_t t = 0; t < n; ++t) {
    if (slots[t] < 0) continue;
    const src_t* row = s + t * src_stride;
    cache_t* dst = c + slots[t] * width;
    if constexpr (sizeof(cache_t) == 1) {
      for (int64_t i = 0; i < width; ++i) {
        dst[i] = static_cast<cache_t>(std::clamp(static_cast<float>(row[i]) * inv_scale, -limit, limit));
      }
    } else {
      for (int64_t i = 0; i < width; ++i) dst[i] = static_cast<cache_t>(row[i]);
    }
  }
}

// cache[slot_mapping[t]] = k[t] (and v) for every t with slot_mapping[t] >= 0; an FP8 cache
// holds k / k_scale (and v / v_scale), saturated.
void write_kv(const at::Tensor& k, const at::Tensor& v, at::Tensor k_cache, at::Tensor v_cache,
              const at::Tensor& slot_mapping, float k_scale = 1.0f, float v_scale = 1.0f) {
  TORCH_CHECK(k.dim() == 3 && v.dim() == 3 && k.stride(2) == 1 && v.stride(2) == 1 &&
                  k.stride(1) == k.size(2) && v.stride(1) == v.size(2),
              "k and v must be [tokens, kv_heads, head_dim] with contiguous rows");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "caches must be contiguous");
  TORCH_CHECK(k.sizes() == v.sizes() && k.scalar_type() == v.scalar_type(), "k and v differ");
  TORCH_CHECK(k.size(1) == k_cache.size(2) && k.size(2) == k_cache.size(3), "k does not match the cache");
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.is_contiguous(),
              "slot_mapping must be a contiguous int64 tensor");
  const int64_t n = std::min(slot_mapping.size(0), k.size(0));
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  const int64_t num_slots = k_cache.size(0) * k_cache.size(1);
  for (int64_t t = 0; t < n; ++t) {
    TORCH_CHECK(slots[t] < num_slots, "slot ", slots[t], " is past the cache's ", num_slots, " slots");
  }
  const auto st = k.scalar_type();
  const auto ct = k_cache.scalar_type();
#define AXON_WRITE_CASE(ST, SC, CT, CC)                      \
  if (st == ST && ct == CT) {                                \
    write_rows<SC, CC>(k, k_cache, slots, n, 1.0f / k_scale); \
    write_rows<SC, CC>(v, v_cache, slots, n, 1.0f / v_scale); \
    return;                                                  \
  }
  AXON_WRITE_CASE(at::kFloat, float, at::kFloat, float)
  AXON_WRITE_CASE(at::kBFloat16, c10::BFloat16, at::kBFloat16, c10::BFloat16)
  AXON_WRITE_CASE(at::kHalf, c10::Half, at::kHalf, c10::Half)
  AXON_WRITE_CASE(at::kFloat, float, at::kFloat8_e4m3fn, c10::Float8_e4m3fn)
  AXON_WRITE_CASE(at::kBFloat16, c10::BFloat16, at::kFloat8_e4m3fn, c10::Float8_e4m3fn)
  AXON_WRITE_CASE(at::kFloat, float, at::kFloat8_e5m2, c10::Float8_e5m2)
  AXON_WRITE_CASE(at::kBFloat16, c10::BFloat16, at::kFloat8_e5m2, c10::Float8_e5m2)
#undef AXON_WRITE_CASE
  TORCH_CHECK(false, "write_kv: unsupported dtypes k ", st, ", cache ", ct);
}

void write_kv_op(const at::Tensor& k, const at::Tensor& v, at::Tensor k_cache, at::Tensor v_cache,
                 const at::Tensor& slot_mapping) {
  write_kv(k, v, std::move(k_cache), std::move(v_cache), slot_mapping);
}

// Partial attentions over disjoint key sets merged into the attention over their union:
// out[t, h] = sum_p exp(lse[p, t, h] - m) outs[p, t, h] / sum_p exp(lse[p, t, h] - m), m the
// largest, parts in order, float32. outs [P, T, H, D] and lses [P, T, H] may be strided views
// (a rank's heads of every rank's gathered partials); a row without keys anywhere comes out 0.
template <typename scalar_t>
void merge_rows(const at::Tensor& outs, const at::Tensor& lses, at::Tensor& out) {
  const int64_t P = outs.size(0), T = outs.size(1), H = outs.size(2), D = outs.size(3);
  const scalar_t* o = outs.data_ptr<scalar_t>();
  const float* l = lses.data_ptr<float>();
  scalar_t* dst = out.data_ptr<scalar_t>();
  const auto os = outs.strides();
  const auto ls = lses.strides();
  at::parallel_for(0, T * H, 64, [&](int64_t begin, int64_t end) {
    std::vector<float> acc(D), w(P);
    for (int64_t i = begin; i < end; ++i) {
      const int64_t t = i / H, h = i % H;
      float m = kNoScore;
      for (int64_t p = 0; p < P; ++p) m = std::max(m, l[p * ls[0] + t * ls[1] + h * ls[2]]);
      float total = 0.0f;
      for (int64_t p = 0; p < P; ++p) total += (w[p] = std::exp(l[p * ls[0] + t * ls[1] + h * ls[2]] - m));
      std::fill(acc.begin(), acc.end(), 0.0f);
      for (int64_t p = 0; p < P; ++p) {
        const scalar_t* row = o + p * os[0] + t * os[1] + h * os[2];
        for (int64_t d = 0; d < D; ++d) acc[d] += w[p] * static_cast<float>(row[d]);
      }
      for (int64_t d = 0; d < D; ++d) dst[(t * H + h) * D + d] = static_cast<scalar_t>(acc[d] / total);
    }
  });
}

at::Tensor merge_attention_partials(const at::Tensor& outs, const at::Tensor& lses) {
  TORCH_CHECK(outs.dim() == 4 && lses.dim() == 3 && outs.sizes().slice(0, 3) == lses.sizes(),
              "merge_attention_partials takes outs [parts, tokens, heads, head_dim] and lses [parts, tokens, heads]");
  TORCH_CHECK(outs.stride(3) == 1, "each partial output row must be contiguous");
  TORCH_CHECK(lses.scalar_type() == at::kFloat, "lses must be float32");
  at::Tensor out = at::empty({outs.size(1), outs.size(2), outs.size(3)}, outs.options());
  const auto st = outs.scalar_type();
  if (st == at::kFloat) {
    merge_rows<float>(outs, lses, out);
  } else if (st == at::kBFloat16) {
    merge_rows<c10::BFloat16>(outs, lses, out);
  } else if (st == at::kHalf) {
    merge_rows<c10::Half>(outs, lses, out);
  } else {
    TORCH_CHECK(false, "merge_attention_partials: unsupported dtype ", st);
  }
  return out;
}

void set_generic(bool generic) { g_force_generic.store(generic); }
void set_batch_invariant(bool invariant) { g_batch_invariant.store(invariant); }

// The step a model's attention layers run in: set once per forward by the model runner, read
// by every layer's ``attention`` call. Per thread, so a forward on one thread never sees another
// thread's step. Compiled graphs call ``attention`` like any other op: its arguments are this
// layer's q, k and v and constants, so the step's ragged metadata never enters a graph.
struct AttentionStep {
  std::vector<at::Tensor> k_caches, v_caches;  // per layer
  at::Tensor slot_mapping, block_table, query_start_loc, seq_lens;
  at::Tensor kv_scales;  // FP8 caches: float32 [layers, 2] (k_scale, v_scale); 0: set at the first write
  int64_t num_actual_tokens = -1;  // -1: no step is set
  std::vector<int64_t> windows;     // per layer (0: full attention); empty: none anywhere
  std::vector<at::Tensor> sinks;    // per layer, float32 [num_heads] or empty; empty list: none
  // The KV cache's window group (the scheduler's second group of blocks): the slots and table
  // of layers with a window; undefined: every layer reads slot_mapping and block_table.
  at::Tensor window_slot_mapping, window_block_table;
};
thread_local AttentionStep t_step;

void set_attention_step(at::TensorList k_caches, at::TensorList v_caches, const at::Tensor& slot_mapping,
                        const at::Tensor& block_table, const at::Tensor& query_start_loc,
                        const at::Tensor& seq_lens, int64_t num_actual_tokens,
                        const std::optional<at::Tensor>& kv_scales, at::IntArrayRef windows, at::TensorList sinks,
                        const std::optional<at::Tensor>& window_slot_mapping,
                        const std::optional<at::Tensor>& window_block_table) {
  TORCH_CHECK(windows.empty() || windows.size() == k_caches.size(), "one window per layer, or none");
  TORCH_CHECK(sinks.empty() || sinks.size() == k_caches.size(), "one sinks tensor per layer, or none");
  TORCH_CHECK(!k_caches.empty() && k_caches.size() == v_caches.size(), "one k and one v cache per layer");
  const bool fp8 = k_caches[0].element_size() == 1;
  TORCH_CHECK(!fp8 || (kv_scales.has_value() && kv_scales->scalar_type() == at::kFloat &&
                       kv_scales->is_contiguous() && kv_scales->numel() == 2 * static_cast<int64_t>(k_caches.size())),
              "an FP8 KV cache needs kv_scales: float32 [layers, 2]");
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.is_contiguous() && slot_mapping.dim() == 1,
              "slot_mapping must be a contiguous int64 vector");
  const bool window_group = window_slot_mapping.has_value() && window_slot_mapping->defined();
  TORCH_CHECK(window_group == (window_block_table.has_value() && window_block_table->defined()),
              "give the window group's slot mapping and block table, or neither");
  const int64_t num_slots = k_caches[0].size(0) * k_caches[0].size(1);
  for (const at::Tensor* mapping : {&slot_mapping, window_group ? &*window_slot_mapping : nullptr}) {
    if (mapping == nullptr) continue;
    TORCH_CHECK(mapping->scalar_type() == at::kLong && mapping->is_contiguous() && mapping->dim() == 1 &&
                    mapping->size(0) == slot_mapping.size(0),
                "slot mappings must be contiguous int64 vectors of one length");
    const int64_t* slots = mapping->data_ptr<int64_t>();
    for (int64_t t = 0; t < mapping->size(0); ++t) {
      TORCH_CHECK(slots[t] < num_slots, "slot ", slots[t], " is past the cache's ", num_slots, " slots");
    }
  }
  for (size_t i = 0; i < k_caches.size(); ++i) {
    TORCH_CHECK(k_caches[i].sizes() == k_caches[0].sizes() && v_caches[i].sizes() == k_caches[0].sizes(),
                "every layer's caches must have one shape");
  }
  // Checked here once for the step; q's shape is checked per layer.
  const at::Tensor q_like = at::empty({num_actual_tokens, k_caches[0].size(2), k_caches[0].size(3)},
                                      k_caches[0].options());
  check_metadata(q_like, k_caches[0], v_caches[0], block_table, query_start_loc, seq_lens, num_actual_tokens);
  if (window_group) {
    TORCH_CHECK(window_block_table->sizes() == block_table.sizes(), "the window group's block table must have the "
                "full group's shape");
    check_metadata(q_like, k_caches[0], v_caches[0], *window_block_table, query_start_loc, seq_lens,
                   num_actual_tokens);
  }
  t_step = AttentionStep{k_caches.vec(),  v_caches.vec(), slot_mapping, block_table, query_start_loc, seq_lens,
                         fp8 ? *kv_scales : at::Tensor(), num_actual_tokens, windows.vec(), sinks.vec(),
                         window_group ? *window_slot_mapping : at::Tensor(),
                         window_group ? *window_block_table : at::Tensor()};
}

void clear_attention_step() { t_step = AttentionStep{}; }

// One layer of the step: write this step's k, v at their slots, then attend (padding rows 0).
at::Tensor attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, int64_t layer, double scale) {
  const AttentionStep& step = t_step;
  TORCH_CHECK(step.num_actual_tokens >= 0, "axon_cpu::attention called with no step set");
  TORCH_CHECK(layer >= 0 && layer < static_cast<int64_t>(step.k_caches.size()), "layer ", layer,
              " of a step with ", step.k_caches.size(), " layers");
  if (step.num_actual_tokens == 0) return at::zeros_like(q);  // a compile-time forward: padding only
  const at::Tensor& k_cache = step.k_caches[layer];
  const at::Tensor& v_cache = step.v_caches[layer];
  TORCH_CHECK(q.dim() == 3 && q.size(0) >= step.num_actual_tokens && q.size(2) == k_cache.size(3) &&
                  q.size(1) % k_cache.size(2) == 0,
              "q of shape ", q.sizes(), " does not fit the step's caches ", k_cache.sizes());
  const int64_t window = step.windows.empty() ? 0 : step.windows[layer];
  const float* sinks = step.sinks.empty() ? nullptr : sinks_of(step.sinks[layer], q.size(1));
  // A sliding-window layer reads and writes the window group's blocks, when there is one.
  const bool in_window_group = window > 0 && step.window_block_table.defined();
  const at::Tensor& slot_mapping = in_window_group ? step.window_slot_mapping : step.slot_mapping;
  const at::Tensor& block_table = in_window_group ? step.window_block_table : step.block_table;
  if (!step.kv_scales.defined()) {
    write_kv(k, v, k_cache, v_cache, slot_mapping);
    return attend(q.contiguous(), k_cache, v_cache, block_table, step.query_start_loc, step.seq_lens,
                  step.num_actual_tokens, scale, window, sinks);
  }
  // FP8: the cache holds k / k_scale and v / v_scale, so scores take k_scale into the softmax
  // scale and the output v_scale. A scale of 0 is calculated from this first write, as vLLM's
  // --calculate-kv-scales does: amax / 200 for keys, amax / 100 for values (headroom for
  // larger values later; past it they saturate).
  float* scales = step.kv_scales.data_ptr<float>() + 2 * layer;
  const int64_t n = step.num_actual_tokens;
  if (scales[0] <= 0.0f) scales[0] = std::max(k.narrow(0, 0, n).abs().max().item<float>() / 200.0f, 1e-6f);
  if (scales[1] <= 0.0f) scales[1] = std::max(v.narrow(0, 0, n).abs().max().item<float>() / 100.0f, 1e-6f);
  write_kv(k, v, k_cache, v_cache, slot_mapping, scales[0], scales[1]);
  at::Tensor out = attend(q.contiguous(), k_cache, v_cache, block_table, step.query_start_loc,
                          step.seq_lens, n, scale * scales[0], window, sinks);
  if (scales[1] != 1.0f) out.mul_(scales[1]);
  return out;
}

}  // namespace

TORCH_LIBRARY(axon_cpu, m) {
  m.def(
      "paged_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_table, "
      "Tensor query_start_loc, Tensor seq_lens, int num_actual_tokens, float scale, int window=0, "
      "Tensor? sinks=None) -> Tensor");
  m.def(
      "paged_attention_partial(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_table, "
      "Tensor query_start_loc, Tensor seq_lens, int num_actual_tokens, float scale, int dcp_world, "
      "int dcp_rank) -> (Tensor, Tensor)");
  m.def("merge_attention_partials(Tensor outs, Tensor lses) -> Tensor");
  m.def("write_kv(Tensor k, Tensor v, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor slot_mapping) -> ()");
  m.def("encoder_attention(Tensor q, Tensor k, Tensor v, Tensor query_start_loc, float scale) -> Tensor");
  m.def("set_generic(bool generic) -> ()");
  m.def("set_batch_invariant(bool invariant) -> ()");
  m.def(
      "set_attention_step(Tensor[] k_caches, Tensor[] v_caches, Tensor slot_mapping, Tensor block_table, "
      "Tensor query_start_loc, Tensor seq_lens, int num_actual_tokens, Tensor? kv_scales=None, "
      "int[] windows, Tensor[] sinks, Tensor? window_slot_mapping=None, Tensor? window_block_table=None) -> ()");
  m.def("clear_attention_step() -> ()");
  m.def("attention(Tensor q, Tensor k, Tensor v, int layer, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(axon_cpu, CPU, m) {
  m.impl("paged_attention", &paged_attention);
  m.impl("paged_attention_partial", &paged_attention_partial);
  m.impl("merge_attention_partials", &merge_attention_partials);
  m.impl("write_kv", &write_kv_op);
  m.impl("encoder_attention", &encoder_attention);
  m.impl("set_attention_step", &set_attention_step);
  m.impl("attention", &attention);
}

TORCH_LIBRARY_IMPL(axon_cpu, CatchAll, m) {
  m.impl("set_generic", &set_generic);
  m.impl("set_batch_invariant", &set_batch_invariant);
  m.impl("clear_attention_step", &clear_attention_step);
}

}  // namespace axon_cpu
