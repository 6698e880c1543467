// Quantized products as integer dot products, where x86 has them (AVX2,
// AVX-512BW, VNNI): the same products as quantized_rows.h's float kernel,
// which is what other CPUs run.
//
// The float kernel spends a shift, mask, int-to-float convert and FMA on
// every 8 weights, which made decode compute-bound rather than memory-bound.
// Here x is written once per product, per group of the weights, as int16:
// x = d xh with d = max|x| / 32767 over the group, so each value is within
// d / 2 = 2^-16 of the group's largest |x| (llama.cpp rounds x to 8 bits,
// 2^-8; the weights' own 4- or 8-bit steps are 2^-4 and 2^-8 of theirs). A
// group's sums of q * xh are then exact in int32 lanes (pmaddwd, or VNNI's
// vpdpwssd: 16-bit pairs into 32-bit sums), widened once per group:
//   sum_k x_k (s q_k + b) = s d (q . xh) + b sum_k x_k,
// with sum_k x_k in fp32 from x itself. A 4-bit weight vector then costs one
// widening load, one mask and one shift per 2 * lanes values, shared by every
// row of x, and one dot instruction per row and lanes values. (Two int16
// terms, exact to 2^-31, would take twice the dot instructions.)
//
// Lane order: a vector load of L16 bytes widens to L16 int16 lanes, lane j
// byte j. 4 bits: byte j holds values 2j (low nibble) and 2j + 1, so a block
// of 2 * L16 values has its even values in the masked lanes and its odd ones
// in the shifted lanes, and prepare_x lays xh and xl out the same way (L16
// even values, then L16 odd ones); int32 lane i then sums values 4i .. 4i + 3.
// 8 bits: a block is L16 values in order, int32 lane i sums values 2i, 2i + 1.

#pragma once

#if defined(__AVX2__) && defined(__FMA__)
#define LLM_PTE_INTEGER_DOT 1

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "quantized_rows.h"

namespace llm_pte {

#if defined(__AVX512F__) && defined(__AVX512BW__)
typedef __m512i vi;
typedef __m512 vf;
constexpr int kLanes16 = 32;
inline vi widen_u8(const uint8_t* p) { return _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }
inline vi load_i16(const int16_t* p) { return _mm512_loadu_si512(p); }
inline vi low_nibbles(vi q) { return _mm512_and_si512(q, _mm512_set1_epi16(0x0F)); }
inline vi high_nibbles(vi q) { return _mm512_srli_epi16(q, 4); }
#if defined(__AVX512VNNI__)
inline vi dot_pairs(vi acc, vi a, vi b) { return _mm512_dpwssd_epi32(acc, a, b); }
#else
inline vi dot_pairs(vi acc, vi a, vi b) { return _mm512_add_epi32(acc, _mm512_madd_epi16(a, b)); }
#endif
inline vi zero_i() { return _mm512_setzero_si512(); }
inline vi add_i(vi a, vi b) { return _mm512_add_epi32(a, b); }
inline vf zero_f() { return _mm512_setzero_ps(); }
inline vf to_float(vi a) { return _mm512_cvtepi32_ps(a); }
inline vf load_f(const float* p) { return _mm512_loadu_ps(p); }
inline vf splat_f(float a) { return _mm512_set1_ps(a); }
inline vf halves(float lo, float hi) { return _mm512_mask_blend_ps(0xFF00, _mm512_set1_ps(lo), _mm512_set1_ps(hi)); }
inline vf mul_add(vf a, vf b, vf c) { return _mm512_fmadd_ps(a, b, c); }
inline vf mul(vf a, vf b) { return _mm512_mul_ps(a, b); }
inline float total(vf a) { return _mm512_reduce_add_ps(a); }
#else
typedef __m256i vi;
typedef __m256 vf;
constexpr int kLanes16 = 16;
inline vi widen_u8(const uint8_t* p) { return _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
inline vi load_i16(const int16_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
inline vi low_nibbles(vi q) { return _mm256_and_si256(q, _mm256_set1_epi16(0x0F)); }
inline vi high_nibbles(vi q) { return _mm256_srli_epi16(q, 4); }
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
inline vi dot_pairs(vi acc, vi a, vi b) { return _mm256_dpwssd_epi32(acc, a, b); }
#elif defined(__AVXVNNI__)
inline vi dot_pairs(vi acc, vi a, vi b) { return _mm256_dpwssd_avx_epi32(acc, a, b); }
#else
inline vi dot_pairs(vi acc, vi a, vi b) { return _mm256_add_epi32(acc, _mm256_madd_epi16(a, b)); }
#endif
inline vi zero_i() { return _mm256_setzero_si256(); }
inline vi add_i(vi a, vi b) { return _mm256_add_epi32(a, b); }
inline vf zero_f() { return _mm256_setzero_ps(); }
inline vf to_float(vi a) { return _mm256_cvtepi32_ps(a); }
inline vf load_f(const float* p) { return _mm256_loadu_ps(p); }
inline vf splat_f(float a) { return _mm256_set1_ps(a); }
inline vf halves(float lo, float hi) { return _mm256_blend_ps(_mm256_set1_ps(lo), _mm256_set1_ps(hi), 0xF0); }
inline vf mul_add(vf a, vf b, vf c) { return _mm256_fmadd_ps(a, b, c); }
inline vf mul(vf a, vf b) { return _mm256_mul_ps(a, b); }
inline float total(vf a) {
  const __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  const __m128 t = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(t, _mm_movehdup_ps(t)));
}
#endif

constexpr int kLanes32 = kLanes16 / 2;
constexpr int kMaxGroup = 128;  // the largest group the products take (gemv.cpp checks)

// Values one vector load of weights covers.
constexpr int integer_block(int bits) { return bits == 4 ? 2 * kLanes16 : kLanes16; }

// Values whose int32 sums are widened together: a group, or two groups of 32
// when a 4-bit block covers both (AVX-512: 64 values a load).
inline int integer_span(int bits, int group) { return std::max(group, integer_block(bits)); }

// The x side of a product (M rows of K): per row, xh as described above, K
// int16; d per int32 lane of every span, M * (K / span) * kLanes32 floats;
// and the fp32 sums per group, M * (K / group). A group whose largest |x| is
// not finite gets d = NaN, so its products come out NaN as MLX's would
// (quantized_int8.h's prepare_x8 does the same).
template <int BITS>
void prepare_x(const float* x, int64_t x_row, int64_t x_col, int M, int64_t K, int group, int16_t* xq,
               float* xd, float* xsum) {
  constexpr int block = integer_block(BITS);
  const int span = integer_span(BITS, group);
  const int64_t groups = K / group, spans = K / span;
  std::vector<float> d(groups);
  for (int m = 0; m < M; ++m) {
    const float* xm = x + m * x_row;
    int16_t* high = xq + m * K;
    for (int64_t g = 0; g < groups; ++g) {
      // the group's values, 8 lanes at a time (AVX2): |x| max, sum, then
      // each value rounded, placed into its block's lane order after
      alignas(32) float v[kMaxGroup];
      alignas(32) int32_t h[kMaxGroup];
      for (int k = 0; k < group; ++k) v[k] = xm[(g * group + k) * x_col];
      const __m256 sign = _mm256_set1_ps(-0.f);
      __m256 top8 = _mm256_setzero_ps(), sum8 = _mm256_setzero_ps(), bad8 = _mm256_setzero_ps();
      for (int k = 0; k < group; k += 8) {
        const __m256 a = _mm256_load_ps(v + k), size = _mm256_andnot_ps(sign, a);
        top8 = _mm256_max_ps(top8, size);
        bad8 = _mm256_or_ps(bad8, _mm256_cmp_ps(size, size, _CMP_UNORD_Q));  // NaN: max would drop it
        sum8 = _mm256_add_ps(sum8, a);
      }
      alignas(32) float lanes[8];
      _mm256_store_ps(lanes, top8);
      const float top = *std::max_element(lanes, lanes + 8);
      _mm256_store_ps(lanes, sum8);
      xsum[m * groups + g] = ((lanes[0] + lanes[4]) + (lanes[1] + lanes[5])) + ((lanes[2] + lanes[6]) + (lanes[3] + lanes[7]));
      const bool finite = _mm256_movemask_ps(bad8) == 0 && std::isfinite(top);
      d[g] = finite ? top / 32767.f : NAN;
      const float inverse = finite && top > 0.f ? 32767.f / top : 0.f;  // |h| <= 32767
      const __m256 to_high = _mm256_set1_ps(inverse);
      constexpr int nearest = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
      for (int k = 0; k < group; k += 8) {
        const __m256 hk = _mm256_round_ps(_mm256_mul_ps(_mm256_load_ps(v + k), to_high), nearest);
        _mm256_store_si256(reinterpret_cast<__m256i*>(h + k), _mm256_cvtps_epi32(hk));
      }
      for (int k = 0; k < group; ++k) {
        const int64_t at = g * group + k, in_block = at % block;  // where it goes in its block:
        const int64_t slot = BITS == 4 ? at - in_block + (in_block % 2) * kLanes16 + in_block / 2 : at;
        high[slot] = static_cast<int16_t>(h[k]);
      }
    }
    float* dm = xd + m * spans * kLanes32;
    for (int64_t t = 0; t < spans; ++t) {
      for (int i = 0; i < kLanes32; ++i) {
        // groups per span: 1, or 2 with the first half of the lanes in the first
        const int64_t g = t * span / group + (span > group && i >= kLanes32 / 2);
        dm[t * kLanes32 + i] = d[g];
      }
    }
  }
}

// Weight rows read ahead of the one being summed: the hardware prefetcher
// alone leaves this loop waiting on its loads, far below what DRAM serves.
// Asked into L2: lines asked into L1 that far ahead are pushed out of it
// before they are read.
constexpr int kRowsAhead = 4;

inline void prefetch_span(const void* p, int64_t bytes) {
  const char* c = static_cast<const char*>(p);
  for (int64_t at = 0; at < bytes; at += 64) _mm_prefetch(c + at, _MM_HINT_T1);
}

// y[m, n] for weight rows n in [lo, hi) and the M rows of x; r.xq, r.xd and
// r.xsum from prepare_x; K a whole number of spans.
template <int BITS, int M>
void quantized_rows_integer(const QuantizedRows& r, int64_t lo, int64_t hi) {
  constexpr int block = integer_block(BITS);
  const int group = r.group, span = integer_span(BITS, group);
  const int64_t groups = r.K / group, spans = r.K / span, row_bytes = r.K * BITS / 8;
  const int per_span = span / group;  // groups a span covers: 1, or 2 (4 bits, 32, AVX-512)
  const int64_t tail = groups / kLanes32 * kLanes32;
  for (int64_t n = lo; n < hi; ++n) {
    const uint8_t* w = reinterpret_cast<const uint8_t*>(r.w) + n * row_bytes;
    const float *scale = r.scales + n * groups, *bias = r.biases + n * groups;
    if (n + kRowsAhead < hi) {
      prefetch_span(w + kRowsAhead * row_bytes, row_bytes);
      prefetch_span(scale + kRowsAhead * groups, groups * 4);
      prefetch_span(bias + kRowsAhead * groups, groups * 4);
    }
    vf acc[M];
    for (int m = 0; m < M; ++m) acc[m] = zero_f();
    for (int64_t t = 0, g = 0; t < spans; ++t, g += per_span) {
      vi dot[M];
      for (int m = 0; m < M; ++m) dot[m] = zero_i();
      for (int64_t k = t * span; k < (t + 1) * span; k += block) {
        if constexpr (BITS == 4) {
          const vi q = widen_u8(w + k / 2), even = low_nibbles(q), odd = high_nibbles(q);
          for (int m = 0; m < M; ++m) {
            const int16_t* xh = r.xq + m * r.K + k;
            dot[m] = dot_pairs(dot_pairs(dot[m], even, load_i16(xh)), odd, load_i16(xh + kLanes16));
          }
        } else {
          const vi q = widen_u8(w + k);
          for (int m = 0; m < M; ++m) dot[m] = dot_pairs(dot[m], q, load_i16(r.xq + m * r.K + k));
        }
      }
      const vf s = per_span == 2 ? halves(scale[g], scale[g + 1]) : splat_f(scale[g]);
      for (int m = 0; m < M; ++m) {
        acc[m] = mul_add(mul(to_float(dot[m]), load_f(r.xd + (m * spans + t) * kLanes32)), s, acc[m]);
      }
    }
    for (int m = 0; m < M; ++m) {  // + sum_g b_g sum x over group g
      const float* xs = r.xsum + m * groups;
      for (int64_t g = 0; g < tail; g += kLanes32) acc[m] = mul_add(load_f(bias + g), load_f(xs + g), acc[m]);
      float y = total(acc[m]);
      for (int64_t g = tail; g < groups; ++g) y += bias[g] * xs[g];
      r.y[m * r.N + n] = y;
    }
  }
}

}  // namespace llm_pte

#endif  // AVX2 and FMA
