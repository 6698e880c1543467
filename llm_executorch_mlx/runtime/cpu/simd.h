// Eight-lane float helpers shared by the extension's two parts (attention.cpp,
// gemv.cpp): GCC/Clang vector extensions, AVX or NEON registers; sixteen-lane
// loads where the build has AVX-512.

#pragma once

#include <cstdint>
#include <cstring>
#if defined(__AVX512F__)
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
  u16x8 h;
  std::memcpy(&h, p, sizeof h);
  const i8 bits = __builtin_convertvector(h, i8) << 16;
  f8 x;
  std::memcpy(&x, &bits, sizeof x);
  return x;
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

}  // namespace llm_pte
