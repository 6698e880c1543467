// Eight-lane float helpers shared by the extension's kernels (attention.cpp,
// gemv.cpp, swiglu.cpp): GCC/Clang vector extensions, AVX or NEON registers;
// sixteen-lane loads where the build has AVX-512.

#pragma once

#include <cstdint>
#include <cstring>
#if defined(__AVX2__)
#include <immintrin.h>
#endif

namespace llm_pte {

typedef float f8 __attribute__((vector_size(32)));
typedef int32_t i8 __attribute__((vector_size(32)));

inline f8 load8(const float* p) {
  f8 x;
  std::memcpy(&x, p, sizeof x);
  return x;
}

// bf16 values (a bf16 cache, bf16 weights under fp32 compute), widened as
// they are read: a bf16 is the top half of an fp32.
typedef uint16_t u16x8 __attribute__((vector_size(16)));

inline f8 load8(const uint16_t* p) {
#if defined(__AVX2__)
  // one widening load: GCC spells the vector conversion below as two
  // half-width ones and an insert, four shuffles a vector where this has one
  // (on AVX2 that bound a bf16 product by the shuffle port, not the FMAs)
  const __m256i bits =
      _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 16);
  f8 x;
  std::memcpy(&x, &bits, sizeof x);
  return x;
#else
  u16x8 h;
  std::memcpy(&h, p, sizeof h);
  const i8 bits = __builtin_convertvector(h, i8) << 16;
  f8 x;
  std::memcpy(&x, &bits, sizeof x);
  return x;
#endif
}

inline float widen(float x) { return x; }

inline float widen(uint16_t h) {
  const uint32_t bits = static_cast<uint32_t>(h) << 16;
  float x;
  std::memcpy(&x, &bits, sizeof x);
  return x;
}

#if defined(__AVX512F__)
// Sixteen lanes, where the build has AVX-512 (gemv.cpp's dense rows).
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }

inline __m512 load16(const uint16_t* p) {  // bf16, widened as load8's
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
#endif

inline void store8(float* p, f8 x) { std::memcpy(p, &x, sizeof x); }

inline f8 splat(float x) { return f8{x, x, x, x, x, x, x, x}; }

inline float sum8(f8 x) {
  return ((x[0] + x[4]) + (x[1] + x[5])) + ((x[2] + x[6]) + (x[3] + x[7]));
}

// The four sums of a[0..3]'s lanes, as one vector's first four lanes:
// pairwise adds of shuffled halves, ~5 instructions for four sums where
// four sum8 take ~28.
inline f8 pair_sums(f8 a, f8 b) {  // [a0+a1, a2+a3, b0+b1, b2+b3, a4+a5, a6+a7, b4+b5, b6+b7]
  return __builtin_shufflevector(a, b, 0, 2, 8, 10, 4, 6, 12, 14) + __builtin_shufflevector(a, b, 1, 3, 9, 11, 5, 7, 13, 15);
}

inline void sums4(const f8* a, float* out) {
  const f8 t = pair_sums(pair_sums(a[0], a[1]), pair_sums(a[2], a[3]));
  const f8 s = t + __builtin_shufflevector(t, t, 4, 5, 6, 7, 0, 1, 2, 3);
  out[0] = s[0], out[1] = s[1], out[2] = s[2], out[3] = s[3];
}

// out[j] = the sum of a[j]'s lanes for j < n: four at a time as sums4.
inline void sums(const f8* a, int n, float* out) {
  int j = 0;
  for (; j + 4 <= n; j += 4) sums4(a + j, out + j);
  for (; j < n; ++j) out[j] = sum8(a[j]);
}

// mask ? a : b lane by lane, mask from a vector comparison (all ones or
// zeros). Spelled with bit operations: Clang has no vector ?: in C++.
inline f8 select8(i8 mask, f8 a, f8 b) {
  i8 x, y;
  std::memcpy(&x, &a, sizeof x);
  std::memcpy(&y, &b, sizeof y);
  const i8 bits = (mask & x) | (~mask & y);
  f8 out;
  std::memcpy(&out, &bits, sizeof out);
  return out;
}

inline f8 max8(f8 a, f8 b) { return select8(a > b, a, b); }
inline f8 min8(f8 a, f8 b) { return select8(a < b, a, b); }

// e^x eight at a time: Cody-Waite reduction to 2^n e^r with |r| <= ln2/2
// and Cephes' degree-6 polynomial, ~1 ulp, for x clamped to [-87, 88] so
// 2^n stays a normal float; then e^x as expf gives it past that range (inf
// above ln(FLT_MAX)) and NaN for NaN, which the clamp would turn finite:
// a softmax or a SiLU of a NaN is NaN, as MLX's. Adding 1.5 * 2^23 rounds
// to the nearest integer.
inline f8 exp8(f8 x) {
  const f8 c = min8(max8(x, splat(-87.0f)), splat(88.0f));
  const f8 round = splat(12582912.0f);
  const f8 n = (c * 1.44269504088896341f + round) - round;
  const f8 r = c - n * 0.693359375f + n * 2.12194440e-4f;
  f8 p = splat(1.9875691500e-4f);
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  const f8 e = p * r * r + r + 1.0f;
  const i8 bits = (__builtin_convertvector(n, i8) + 127) << 23;
  f8 two_n;
  std::memcpy(&two_n, &bits, sizeof two_n);
  const f8 y = select8(x > 88.72283935546875f, splat(__builtin_inff()), e * two_n);
  return select8(x != x, x, y);
}

}  // namespace llm_pte
