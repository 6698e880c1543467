// Quantized products with int8 activations (the int8_activations option):
// x rounded to int8 per group of the weights, as llama.cpp's Q8_0 rounds it,
// and multiplied with the stored 4- or 8-bit values by integer dot products
// of four byte pairs into each int32 lane (VNNI's vpdpbusd; vpmaddubsw and
// vpmaddwd where VNNI is missing, below). Each dot instruction does twice
// the multiply-adds of the int16 route (quantized_dot.h), and the
// product is tiled as a GEMM: a tile of weight rows is unpacked once for
// several rows of x, so a prefill chunk is bound by the dot instructions,
// not by unpacking, converting and loads.
//
// Accuracy: x ~= d xq with d = max|x| / 127 over the group, each value within
// d / 2 of its own (2^-8 of the group's largest |x|), and the product is
// the dequantized weights' with that rounded x, the weights' sums exact in
// int32:
//   sum_k d xq_k (s q_k + b) = s d (q . xq) + b d sum_k xq_k.
// The bias term takes the rounded x too: with x's own sum there the error
// would be sum_k (w_k - b) e_k, the weights shifted by their group's
// minimum, ~2-3x larger than sum_k w_k e_k. docs/design.md ("int8 activations")
// states the contract the tests hold it to.
//
// Layout ("quads"), per block of kLanes32 weight rows, chunks of one vector
// (4 * kLanes32 bytes) in order of k; in each chunk, bytes 4i .. 4i + 3 are
// row i's (int32 lane i is row i):
//   8 bits: values 4c .. 4c + 3;
//   4 bits: low nibbles values 8c .. 8c + 3, high nibbles 8c + 4 .. 8c + 7.
// Scales and biases as quantized_interleaved.h lays them out (per block and
// group, the block's rows' kLanes32 values), stored as small as they stay
// what they were (QuadScales, below).

#pragma once

#include "quantized_interleaved.h"

#if LLM_PTE_INTEGER_DOT

#include <cmath>
#include <vector>

namespace llm_pte {

// Values of one row a chunk holds.
constexpr int quad_values(int bits) { return bits == 8 ? 4 : 8; }

// Whether this build widens fp16 scales in one instruction (F16C, which
// every AVX-512 build has too).
#if defined(__F16C__)
#define LLM_PTE_HALF_SCALES 1
constexpr bool kHalfScales = true;
#else
constexpr bool kHalfScales = false;
#endif

// A quads weight's scales and biases. A decode step streams them with the
// weights: in fp32 they are a third of a 4-bit weight's bytes, so they are
// stored as small as the file allows (quad_scales):
// - no biases where every group is symmetric, b = -2^(bits-1) s exactly (as
//   torchao's symmetric weights and GGUF's Q4_0 and Q8_0 are): w = s (q -
//   2^(bits-1)), b derived from s, bit for bit;
// - fp16 where every scale and bias is 0 or within fp16's normal range
//   (each then within 2^-11 of itself, the int8 route's accuracy contract in
//   docs/design.md) and the build widens fp16 in one instruction; else fp32.
struct QuadScales {
  const void* scales = nullptr;
  const void* biases = nullptr;  // null: symmetric
  bool half = false;
};

inline vf load_half(const uint16_t* p) {
#if LLM_PTE_HALF_SCALES && defined(__AVX512F__) && defined(__AVX512BW__)
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
#elif LLM_PTE_HALF_SCALES
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
#else
  (void)p;
  return zero_f();  // never: quad_scales keeps fp32 without F16C
#endif
}

inline vf load_scales(const void* p, bool half, int64_t at) {
  return half ? load_half(static_cast<const uint16_t*>(p) + at) : load_f(static_cast<const float*>(p) + at);
}

inline float scale_value(const void* p, bool half, int64_t at) {
  if (!half) return static_cast<const float*>(p)[at];
#if LLM_PTE_HALF_SCALES
  return _cvtsh_ss(static_cast<const uint16_t*>(p)[at]);
#else
  return 0.f;  // never, as load_half
#endif
}

// The kLanes32 scales at `at` (one block's group), and their biases.
inline vf group_scales(const QuadScales& q, int64_t at) { return load_scales(q.scales, q.half, at); }
inline vf group_biases(const QuadScales& q, int64_t at, vf s, int bits) {
  return q.biases ? load_scales(q.biases, q.half, at) : mul(s, splat_f(-float(1 << (bits - 1))));
}

// interleave_rows' scales and biases (n values each) as QuadScales stores
// them: {scales, biases} as fp16 bits or fp32, biases empty where symmetric.
struct QuadScaleValues {
  std::vector<uint16_t> scales16, biases16;
  std::vector<float> scales32, biases32;
  bool half = false, symmetric = false;
};

inline QuadScaleValues quad_scales(const float* scales, const float* biases, int64_t n, int bits) {
  QuadScaleValues out;
  const float zero = -float(1 << (bits - 1));
  out.symmetric = true;
  for (int64_t i = 0; i < n && out.symmetric; ++i) out.symmetric = biases[i] == zero * scales[i];
  auto fits = [](float v) {
    const float size = std::fabs(v);
    return v == 0.f || (size >= 0x1p-14f && size <= 65504.f);  // finite, normal in fp16
  };
  out.half = kHalfScales;
  for (int64_t i = 0; i < n && out.half; ++i) out.half = fits(scales[i]) && (out.symmetric || fits(biases[i]));
  auto keep = [&](const float* from, std::vector<uint16_t>& to16, std::vector<float>& to32) {
    if (!out.half) return to32.assign(from, from + n);
    to16.resize(n);
#if LLM_PTE_HALF_SCALES
    for (int64_t i = 0; i < n; ++i) to16[i] = _cvtss_sh(from[i], _MM_FROUND_TO_NEAREST_INT);
#endif
  };
  keep(scales, out.scales16, out.scales32);
  if (!out.symmetric) keep(biases, out.biases16, out.biases32);
  return out;
}

// MLX's layout (w [N, K * bits / 8] bytes) into the quads, the same size; N a
// multiple of kLanes32. Scales and biases: interleave_rows.
inline void interleave_quads(const uint8_t* w, int64_t N, int64_t K, int bits, uint8_t* out) {
  constexpr int L = kLanes32;
  const int64_t row_bytes = K * bits / 8;
  const int per = quad_values(bits);
  for (int64_t block = 0; block < N / L; ++block) {
    for (int64_t k = 0; k < K; k += per, out += 4 * L) {
      for (int i = 0; i < L; ++i) {
        const uint8_t* row = w + (block * L + i) * row_bytes;
        for (int e = 0; e < 4; ++e) {
          out[4 * i + e] = static_cast<uint8_t>(
              bits == 8 ? value_at(row, k + e, 8) : value_at(row, k + e, 4) | value_at(row, k + 4 + e, 4) << 4);
        }
      }
    }
  }
}

// The x side: per row, K int8 values; per row and group, the step d and the
// sum of the rounded x (d sum xq). A group whose largest |x| is not finite
// gets d = NaN, so its products come out NaN as MLX's would.
inline void prepare_x8(const float* x, int64_t x_row, int64_t x_col, int M, int64_t K, int group, int8_t* xq,
                       float* xd, float* xsum) {
  const int64_t groups = K / group;
  for (int m = 0; m < M; ++m) {
    const float* xm = x + m * x_row;
    for (int64_t g = 0; g < groups; ++g) {
      alignas(32) float v[kMaxGroup];
      for (int k = 0; k < group; ++k) v[k] = xm[(g * group + k) * x_col];
      const __m256 sign = _mm256_set1_ps(-0.f);
      __m256 top8 = _mm256_setzero_ps(), bad8 = _mm256_setzero_ps();
      for (int k = 0; k < group; k += 8) {
        const __m256 size = _mm256_andnot_ps(sign, _mm256_load_ps(v + k));
        top8 = _mm256_max_ps(top8, size);
        bad8 = _mm256_or_ps(bad8, _mm256_cmp_ps(size, size, _CMP_UNORD_Q));  // NaN: max would drop it
      }
      alignas(32) float lanes[8];
      _mm256_store_ps(lanes, top8);
      const float top = *std::max_element(lanes, lanes + 8);
      const bool finite = _mm256_movemask_ps(bad8) == 0 && std::isfinite(top);
      const float d = finite ? top / 127.f : NAN;
      const float inverse = finite && top > 0.f ? 127.f / top : 0.f;  // |xq| <= 127
      const __m256 to_int = _mm256_set1_ps(inverse);
      int8_t* out = xq + m * K + g * group;
      __m256i total = _mm256_setzero_si256();
      for (int k = 0; k < group; k += 8) {
        const __m256i i32 = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_load_ps(v + k), to_int));  // to nearest
        total = _mm256_add_epi32(total, i32);
        const __m128i i16 = _mm_packs_epi32(_mm256_castsi256_si128(i32), _mm256_extracti128_si256(i32, 1));
        _mm_storel_epi64(reinterpret_cast<__m128i*>(out + k), _mm_packs_epi16(i16, i16));
      }
      alignas(32) int32_t sums[8];
      _mm256_store_si256(reinterpret_cast<__m256i*>(sums), total);
      int32_t sum = 0;
      for (int32_t part : sums) sum += part;
      xd[m * groups + g] = d;
      xsum[m * groups + g] = d * static_cast<float>(sum);
    }
  }
}

// The x side of a product and its weight, for the tiles below.
struct Int8Rows {
  const uint8_t* w;  // quads
  QuadScales scales;
  const int8_t* xq;  // M rows of K
  const float *xd, *xsum;  // M rows of K / group: d, d sum xq
  float* y;  // M rows of N
  int64_t K, N;
  int group, M;
};

#if defined(__AVX512F__) && defined(__AVX512BW__)
inline vi load_vi(const uint8_t* p) { return _mm512_loadu_si512(p); }
inline vi low4(vi q) { return _mm512_and_si512(q, _mm512_set1_epi8(0x0F)); }
inline vi high4(vi q) { return _mm512_and_si512(_mm512_srli_epi16(q, 4), _mm512_set1_epi8(0x0F)); }
#if defined(__AVX512VNNI__)
#define LLM_PTE_VNNI 1
inline vi dot_quads(vi acc, vi u, vi s) { return _mm512_dpbusd_epi32(acc, u, s); }
#endif
#else
inline vi load_vi(const uint8_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
inline vi low4(vi q) { return _mm256_and_si256(q, _mm256_set1_epi8(0x0F)); }
inline vi high4(vi q) { return _mm256_and_si256(_mm256_srli_epi16(q, 4), _mm256_set1_epi8(0x0F)); }
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define LLM_PTE_VNNI 1
inline vi dot_quads(vi acc, vi u, vi s) { return _mm256_dpbusd_epi32(acc, u, s); }
#elif defined(__AVXVNNI__)
#define LLM_PTE_VNNI 1
inline vi dot_quads(vi acc, vi u, vi s) { return _mm256_dpbusd_avx_epi32(acc, u, s); }
#endif
#endif

// How far ahead of its reads a tile's first pass over its weights asks for
// them: each block is a stream of its own, too many at once for the
// hardware prefetcher to keep up with (as interleaved_rows' kPrefetchAhead),
// into L2, two pages on: a decode step's one row then streams its weights
// faster than from one page on into L1.
constexpr int64_t kInt8Ahead = 8192;

// Without VNNI, vpmaddubsw multiplies u8 by s8 bytes and sums each pair in
// an int16 lane, vpmaddwd widens those to int32:
// - 4-bit weights: a pair is at most 2 * 15 * 127, so eight (32 values) fit
//   an int16 lane and are widened once where VNNI's sums would be, a third
//   of the instructions per dot;
// - 8-bit weights: a pair of u8 q * s8 x would saturate (2 * 255 * 127), so
//   each weight is offset to w' = q - 128 (an xor of its top bit) and its
//   sign moved onto x: |w'| sign(x, w') = w' x, pairs within 2 * 128 * 127.
//   The offset's 128 d sum(xq) comes back through the group's bias
//   (int8_tile). With VNNI, q as stored.
#if defined(__AVX512F__) && defined(__AVX512BW__)
inline vi pair_products(vi u, vi s) { return _mm512_maddubs_epi16(u, s); }
inline vi add_pairs(vi a, vi b) { return _mm512_add_epi16(a, b); }
inline vi widen_pairs(vi acc, vi pairs) {
  return _mm512_add_epi32(acc, _mm512_madd_epi16(pairs, _mm512_set1_epi16(1)));
}
inline vi signed_like(vi x, vi w) {  // -x where w < 0 (AVX-512 has no vpsignb; where w is 0, |w| is)
  return _mm512_mask_sub_epi8(x, _mm512_movepi8_mask(w), _mm512_setzero_si512(), x);
}
inline vi offset_bytes(vi q) { return _mm512_xor_si512(q, _mm512_set1_epi8(char(0x80))); }
inline vi byte_sizes(vi w) { return _mm512_abs_epi8(w); }
#else
inline vi pair_products(vi u, vi s) { return _mm256_maddubs_epi16(u, s); }
inline vi add_pairs(vi a, vi b) { return _mm256_add_epi16(a, b); }
inline vi widen_pairs(vi acc, vi pairs) {
  return _mm256_add_epi32(acc, _mm256_madd_epi16(pairs, _mm256_set1_epi16(1)));
}
inline vi signed_like(vi x, vi w) { return _mm256_sign_epi8(x, w); }
inline vi offset_bytes(vi q) { return _mm256_xor_si256(q, _mm256_set1_epi8(char(0x80))); }
inline vi byte_sizes(vi w) { return _mm256_abs_epi8(w); }
#endif

// An 8-bit chunk's dot: q as stored with VNNI, else w' = offset_bytes(q) and
// its sizes |w'| (both made once a chunk, for every row of x).
#if LLM_PTE_VNNI
constexpr bool kOffsetBytes = false;
inline vi dot_bytes(vi acc, vi q, vi, vi x) { return dot_quads(acc, q, x); }
#else
constexpr bool kOffsetBytes = true;
inline vi dot_bytes(vi acc, vi w, vi size, vi x) { return widen_pairs(acc, pair_products(size, signed_like(x, w))); }
#endif

// y for MR rows of x from m0 and NB blocks of weight rows from `block`: MR *
// NB * S int32 sums a group, each one dependency chain (enough chains to
// keep the dot instructions' pipes busy: S > 1 splits a row's sums where MR
// * NB alone are too few), converted and scaled once a group. int32 sums
// are exact, so how they are split changes no result. `fetch`: the first
// pass over these blocks, which prefetches them.
template <int BITS, int MR, int NB, int S = 1>
void int8_tile(const Int8Rows& r, int64_t block, int m0, bool fetch) {
  constexpr int L = kLanes32, per = quad_values(BITS);
  constexpr int kRunChunks = 32 / per;  // a run of 32 values; every group (32, 64, 128) is whole runs
  const int64_t K = r.K, groups = K / r.group, block_bytes = K * BITS / 8 * L;
  const int runs = r.group / 32;
  const int8_t* x = r.xq + int64_t(m0) * K;
  vf acc[MR][NB];
  for (int m = 0; m < MR; ++m)
    for (int b = 0; b < NB; ++b) acc[m][b] = zero_f();
  const uint8_t* w = r.w + block * block_bytes;
  for (int64_t g = 0; g < groups; ++g) {
    vi dot[MR][NB][S];
    for (int m = 0; m < MR; ++m)
      for (int b = 0; b < NB; ++b)
        for (int a = 0; a < S; ++a) dot[m][b][a] = zero_i();
    for (int run = 0; run < runs; ++run) {
      // The run's chunks, rows and blocks unrolled, so that each sum is a register of its own and the
      // chunk's place in the run is known where it is compiled (a loop over them compiles to branches).
      [[maybe_unused]] vi pairs[MR][NB];  // 4 bits without VNNI: the run's 32 values in int16 lanes
#pragma GCC unroll 8
      for (int c = 0; c < kRunChunks; ++c) {
        const int64_t k = g * r.group + run * 32 + c * per;
#pragma GCC unroll 4
        for (int b = 0; b < NB; ++b) {
          const uint8_t* chunk = w + b * block_bytes + (k / per) * 4 * L;
          if (fetch) _mm_prefetch(reinterpret_cast<const char*>(chunk) + kInt8Ahead, _MM_HINT_T1);  // never faults
          const vi q = load_vi(chunk);
          if constexpr (BITS == 8) {
            const vi w8 = kOffsetBytes ? offset_bytes(q) : q, size = kOffsetBytes ? byte_sizes(w8) : q;
#pragma GCC unroll 8
            for (int m = 0; m < MR; ++m) {
              vi& sum = dot[m][b][c % S];
              sum = dot_bytes(sum, w8, size, four_bytes_everywhere(x + m * K + k));
            }
          } else {
            const vi low = low4(q), high = high4(q);
#pragma GCC unroll 8
            for (int m = 0; m < MR; ++m) {
#if LLM_PTE_VNNI
              vi &even = dot[m][b][2 * c % S], &odd = dot[m][b][(2 * c + 1) % S];
              even = dot_quads(even, low, four_bytes_everywhere(x + m * K + k));
              odd = dot_quads(odd, high, four_bytes_everywhere(x + m * K + k + 4));
#else
              const vi two = add_pairs(pair_products(low, four_bytes_everywhere(x + m * K + k)),
                                       pair_products(high, four_bytes_everywhere(x + m * K + k + 4)));
              pairs[m][b] = c ? add_pairs(pairs[m][b], two) : two;
              if (c == kRunChunks - 1) dot[m][b][0] = widen_pairs(dot[m][b][0], pairs[m][b]);
#endif
            }
          }
        }
      }
    }
    for (int b = 0; b < NB; ++b) {
      const int64_t at = ((block + b) * groups + g) * L;
      const vf s = group_scales(r.scales, at), stored_bias = group_biases(r.scales, at, s, BITS);
      // offset 8-bit weights sum w' = q - 128: the missing 128 s d sum(xq) joins b d sum(xq)
      const vf bias = BITS == 8 && kOffsetBytes ? mul_add(s, splat_f(128.f), stored_bias) : stored_bias;
      for (int m = 0; m < MR; ++m) {
        const int64_t xg = (m0 + m) * groups + g;
        vi total = dot[m][b][0];
        for (int a = 1; a < S; ++a) total = add_i(total, dot[m][b][a]);
        acc[m][b] = mul_add(mul(to_float(total), splat_f(r.xd[xg])), s, acc[m][b]);
        acc[m][b] = mul_add(bias, splat_f(r.xsum[xg]), acc[m][b]);
      }
    }
  }
  for (int m = 0; m < MR; ++m)
    for (int b = 0; b < NB; ++b) store_f(r.y + (m0 + m) * r.N + (block + b) * L, acc[m][b]);
}

// Blocks of weight rows a tile takes, and rows of x: as many sums as keep
// the pipes busy while the registers hold them, the weights and a few more
// (32 vector registers with AVX-512, 16 with AVX2). The last rows of x take
// one tile of up to kLastRows where a tile of kTileRows would leave a row
// or two: such a tile has too few sums to keep the pipes busy, and costs
// about what a full one does (a verifying call's 6 rows, a short chunk's).
// kTileRows stays 4: a 4-bit tile of 6 rows spills registers.
#if defined(__AVX512F__) && defined(__AVX512BW__)
constexpr int kTileBlocks = 2, kTileRows = 4, kLastRows = 6;
#else
constexpr int kTileBlocks = 1, kTileRows = 4, kLastRows = 4;
#endif

// y for the weight rows of blocks [lo, hi) / kLanes32 and the rows of x
// from `first`: for each tile of blocks, the rows of x kTileRows at a time,
// the last up to kLastRows (the blocks' weights stay in cache across them;
// x is small enough to).
template <int BITS>
void int8_rows(const Int8Rows& r, int64_t lo, int64_t hi, int first = 0) {
  constexpr int L = kLanes32;
  int64_t block = lo / L;
  const int64_t end = hi / L;
  auto rows_of_x = [&]<int NB>() {
    int m = first;
    for (; r.M - m > kLastRows; m += kTileRows) int8_tile<BITS, kTileRows, NB>(r, block, m, m == first);
    switch (r.M - m) {  // one row of x (a decode step) takes more blocks at once below
      case 1: int8_tile<BITS, 1, NB>(r, block, m, m == first); break;
      case 2: int8_tile<BITS, 2, NB>(r, block, m, m == first); break;
      case 3: int8_tile<BITS, 3, NB>(r, block, m, m == first); break;
      case 4: int8_tile<BITS, 4, NB>(r, block, m, m == first); break;
      case 5: if constexpr (kLastRows >= 5) int8_tile<BITS, 5, NB>(r, block, m, m == first); break;
      case 6: if constexpr (kLastRows >= 6) int8_tile<BITS, 6, NB>(r, block, m, m == first); break;
    }
  };
  if (first == r.M) return;
  if (r.M == 1) {  // a decode step: one block at a time, its sums split
    for (; block < end; ++block) int8_tile<BITS, 1, 1, 4>(r, block, 0, true);
  }
  for (; block + kTileBlocks <= end; block += kTileBlocks) rows_of_x.template operator()<kTileBlocks>();
  for (; block < end; ++block) rows_of_x.template operator()<1>();
}

// Rows `ids` (each in [0, N)) of a quads weight, dequantized into out
// [count, K]: a quantized embedding's lookup when its table is also the LM
// head's weight. Multiply, then add, as MLX rounds.
template <int BITS>
void take_quads(const uint8_t* w, const QuadScales& scales, int64_t K, int group, const int64_t* ids, int64_t count,
                float* out) {
  constexpr int L = kLanes32, per = quad_values(BITS);
  const int64_t groups = K / group, block_bytes = K * BITS / 8 * L;
  for (int64_t row = 0; row < count; ++row) {
    const int64_t block = ids[row] / L, i = ids[row] % L;
    const uint8_t* chunk = w + block * block_bytes + 4 * i;
    float* o = out + row * K;
    for (int64_t k = 0; k < K; ++k) {
      const uint8_t byte = chunk[k / per * 4 * L + (k % per) % 4];
      const int q = BITS == 8 ? byte : (k % per < 4 ? byte & 0x0F : byte >> 4);
      const int64_t at = (block * groups + k / group) * L + i;
      const float s = scale_value(scales.scales, scales.half, at);
      const float b = scales.biases ? scale_value(scales.biases, scales.half, at) : -float(1 << (BITS - 1)) * s;
      float v = s * static_cast<float>(q);
      asm("" : "+v"(v));  // no FMA contraction: MLX rounds the product first
      o[k] = v + b;
    }
  }
}

}  // namespace llm_pte

#else

namespace llm_pte {
constexpr bool kHalfScales = false;  // no quads layout without integer dot products
}

#endif  // LLM_PTE_INTEGER_DOT
