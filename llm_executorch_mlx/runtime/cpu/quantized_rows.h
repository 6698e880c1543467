// Dot products of a few fp32 rows x with MLX affine-quantized weight rows,
// read as stored: w = scale * q + bias per group of `group` values along K,
// q packed little-end first into uint32 words (4 bits: 8 values a word,
// 8 bits: 4). gemv.cpp runs these as its quantized products where x86's
// integer dot products are missing (quantized_dot.h has those).
//
// A block is 8 words, one 8-lane vector: lane j holds values vpw*j ..
// vpw*j + vpw - 1 of the block (vpw = 32 / BITS). Shifting the block by
// BITS*s and masking gives, in lane j, value vpw*j + s; so x is permuted
// once per product (`permute_x`) to match, and each row costs one load,
// then a shift, mask, convert and FMA per vpw values, in registers. The
// scale multiplies a block's partial sums, the bias a group's sum of x
// (computed once per product): sum_k x_k (s q_k + b) = s (x . q) + b sum x.

#pragma once

#include <cstdint>
#include <cstring>

#include "simd.h"

namespace llm_pte {

typedef uint32_t u8v __attribute__((vector_size(32)));

struct QuantizedRows {
  const uint32_t* w;  // [N, K * BITS / 32]
  const float *scales, *biases;  // [N, K / group]
  const float* xp;  // M rows of permute_x's output, K apart (the float kernel)
  const float* xsum;  // M rows of K / group sums of x
  const int16_t* xq;  // M rows of x rounded to int16, and their scales (quantized_dot.h)
  const float* xd;
  float* y;  // M rows of N
  int64_t K, N;
  int group;
  bool interleaved = false;  // rows interleaved (quantized_interleaved.h), x prepared as for 8 bits
};

constexpr int block_values(int bits) { return 8 * (32 / bits); }

// x's M rows in the lane order of a block (see above), and their sums per group.
inline void permute_x(const float* x, int64_t x_row, int64_t x_col, int M, int64_t K, int bits, int group,
                      float* xp, float* xsum) {
  const int vpw = 32 / bits, B = block_values(bits);
  for (int m = 0; m < M; ++m) {
    const float* xm = x + m * x_row;
    float* pm = xp + m * K;
    for (int64_t b = 0; b < K; b += B)
      for (int s = 0; s < vpw; ++s)
        for (int j = 0; j < 8; ++j) pm[b + s * 8 + j] = xm[(b + vpw * j + s) * x_col];
    for (int64_t g = 0; g < K / group; ++g) {
      float sum = 0.f;
      for (int k = 0; k < group; ++k) sum += xm[(g * group + k) * x_col];
      xsum[m * (K / group) + g] = sum;
    }
  }
}

// y[m, n] for weight rows n in [lo, hi) and the M rows of x; K is a whole
// number of blocks and of groups.
template <int BITS, int M>
void quantized_rows(const QuantizedRows& r, int64_t lo, int64_t hi) {
  constexpr int vpw = 32 / BITS, B = block_values(BITS);
  constexpr uint32_t mask = (1u << BITS) - 1;
  const int64_t words = r.K / vpw, groups = r.K / r.group;
  for (int64_t n = lo; n < hi; ++n) {
    const uint32_t* w = r.w + n * words;
    const float *scale = r.scales + n * groups, *bias = r.biases + n * groups;
    f8 acc[M] = {};
    for (int64_t b = 0; b < r.K; b += B) {
      u8v v;
      std::memcpy(&v, w + b / vpw, sizeof v);
      f8 part[M] = {};
      for (int s = 0; s < vpw; ++s) {
        const f8 q = __builtin_convertvector((i8)((v >> (BITS * s)) & mask), f8);
        for (int m = 0; m < M; ++m) part[m] += q * load8(r.xp + m * r.K + b + s * 8);
      }
      f8 sc;
      if (B <= r.group) {
        sc = splat(scale[b / r.group]);
      } else {  // 4 bits, group 32: lanes 0-3 are one group, 4-7 the next
        const float s0 = scale[b / r.group], s1 = scale[b / r.group + 1];
        sc = f8{s0, s0, s0, s0, s1, s1, s1, s1};
      }
      for (int m = 0; m < M; ++m) acc[m] += sc * part[m];
    }
    for (int m = 0; m < M; ++m) {
      float total = sum8(acc[m]);
      const float* xs = r.xsum + m * groups;
      for (int64_t g = 0; g < groups; ++g) total += bias[g] * xs[g];
      r.y[m * r.N + n] = total;
    }
  }
}

#if defined(__AVX512F__)
// Sixteen consecutive values of a row widened to int32 lanes: 8 bytes of
// nibbles (4 bits, value 2i in byte i's low half) or 16 bytes (8 bits).
template <int BITS>
inline __m512i widen16(const uint8_t* p) {
  if constexpr (BITS == 8) {
    return _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  } else {
    const __m128i bytes = _mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
    const __m128i low = _mm_and_si128(bytes, _mm_set1_epi16(15)), high = _mm_srli_epi16(bytes, 4);
    const __m256i values = _mm256_set_m128i(_mm_unpackhi_epi16(low, high), _mm_unpacklo_epi16(low, high));
    return _mm512_cvtepu16_epi32(values);
  }
}
#endif

// W's rows [lo, hi) dequantized into w_out [N, K] (fp32, natural order).
// Sixteen values at a time where the build has AVX-512, with streaming
// stores when rows are whole cache lines: a prefill chunk dequantizes every
// weight, far more than the caches hold, for BLAS to read back from memory,
// so writing around the caches saves reading each line before overwriting
// it. Elsewhere one word gives 8 (4 bits) or, with the next, 8 (8 bits)
// consecutive values.
template <int BITS>
void dequantize_rows(const QuantizedRows& r, float* w_out, int64_t lo, int64_t hi) {
  constexpr int vpw = 32 / BITS;
  const int64_t words = r.K / vpw, groups = r.K / r.group;
#if defined(__AVX512F__)
  const bool stream = reinterpret_cast<uintptr_t>(w_out) % 64 == 0;  // rows are whole lines: K % 32 == 0
  for (int64_t n = lo; n < hi; ++n) {
    const uint8_t* w = reinterpret_cast<const uint8_t*>(r.w + n * words);
    const float *scale = r.scales + n * groups, *bias = r.biases + n * groups;
    float* out = w_out + n * r.K;
    for (int64_t k = 0; k < r.K; k += 16) {  // 16 values never straddle a group (group >= 32)
      const int64_t g = k / r.group;
      const __m512 q = _mm512_cvtepi32_ps(widen16<BITS>(w + k * BITS / 8));
      // multiply, then add, as MLX rounds: the empty asm keeps the compiler
      // from contracting them into an FMA, which differs in the last bit
      __m512 v = _mm512_mul_ps(q, _mm512_set1_ps(scale[g]));
      asm("" : "+v"(v));
      v = _mm512_add_ps(v, _mm512_set1_ps(bias[g]));
      if (stream) _mm512_stream_ps(out + k, v);
      else _mm512_storeu_ps(out + k, v);
    }
  }
  if (stream) _mm_sfence();
#else
  constexpr uint32_t mask = (1u << BITS) - 1;
  const u8v shifts = BITS == 4 ? u8v{0, 4, 8, 12, 16, 20, 24, 28} : u8v{0, 8, 16, 24, 0, 8, 16, 24};
  for (int64_t n = lo; n < hi; ++n) {
    const uint32_t* w = r.w + n * words;
    const float *scale = r.scales + n * groups, *bias = r.biases + n * groups;
    float* out = w_out + n * r.K;
    for (int64_t k = 0; k < r.K; k += 8) {
      const uint32_t a = w[k / vpw], b = BITS == 4 ? a : w[k / vpw + 1];
      const u8v v = BITS == 4 ? u8v{a, a, a, a, a, a, a, a} : u8v{a, a, a, a, b, b, b, b};
      const f8 q = __builtin_convertvector((i8)((v >> shifts) & mask), f8);
      const int64_t g = k / r.group;  // 8 values never straddle a group (group >= 32)
      store8(out + k, q * splat(scale[g]) + splat(bias[g]));
    }
  }
#endif
}

}  // namespace llm_pte
