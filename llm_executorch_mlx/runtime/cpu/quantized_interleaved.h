// Quantized weights with kLanes32 rows interleaved, where x86 has integer
// dot products (quantized_dot.h): the layout a short chunk's products run
// fastest from, made once at load (program.py) for weights only these
// products read.
//
// In MLX's layout a group of one row is a vector of its own: its int32 sums
// spread over every lane, so each group and row of x pays a convert, a
// multiply and an FMA for one vector of dot products (group 32, 8 bits),
// three times the dot work. Here int32 lane i belongs to weight row i of a
// block of kLanes32 rows, so a group's dot products for all of the block's
// rows end in one vector: the same convert, multiply and FMA now cover
// kLanes32 rows, and x enters each dot instruction as one broadcast pair of
// int16 values. x is prepared as for 8-bit weights (prepare_x<8>: int16 in
// natural order, one step d per group).
//
// Layout, per block of kLanes32 rows and group g, chunks of 2 * kLanes32
// bytes in order of k; in chunk j, bytes 2i and 2i + 1 are row i's:
//   8 bits: values 2j and 2j + 1 of the group;
//   4 bits: low nibbles values 4j and 4j + 1, high nibbles 4j + 2 and 4j + 3.
// A chunk widened to int16 lanes (then masked or shifted, 4 bits) puts row
// i's pair in lanes 2i, 2i + 1: one dot instruction adds it into int32 lane i.
// Scales and biases: per block and group, the block's rows' kLanes32 values.

#pragma once

#include "quantized_dot.h"

#if LLM_PTE_INTEGER_DOT

namespace llm_pte {

// Rows a block holds (one int32 lane each).
constexpr int kInterleavedRows = kLanes32;

inline int64_t value_at(const uint8_t* row, int64_t k, int bits) {
  return bits == 8 ? row[k] : (row[k / 2] >> (4 * (k & 1))) & 0x0F;
}

// MLX's layout (w [N, K * bits / 8] bytes, scales and biases [N, K / group])
// into the interleaved one, the same sizes; N a multiple of kInterleavedRows.
// w_out null: the scales and biases only.
inline void interleave_rows(const uint8_t* w, const float* scales, const float* biases, int64_t N, int64_t K,
                            int group, int bits, uint8_t* w_out, float* scales_out, float* biases_out) {
  constexpr int L = kInterleavedRows;
  const int64_t groups = K / group, row_bytes = K * bits / 8;
  const int per_chunk = bits == 8 ? 2 : 4;  // values of a row a chunk holds
  uint8_t* out = w_out;
  for (int64_t block = 0; block < N / L; ++block) {
    for (int64_t g = 0; g < groups; ++g) {
      for (int64_t j = 0; j < group / per_chunk; ++j) {
        const int64_t k = g * group + j * per_chunk;
        for (int i = 0; i < L; ++i) {
          const uint8_t* row = w + (block * L + i) * row_bytes;
          for (int e = 0; out && e < 2; ++e) {
            out[2 * i + e] = static_cast<uint8_t>(
                bits == 8 ? value_at(row, k + e, 8) : value_at(row, k + e, 4) | value_at(row, k + 2 + e, 4) << 4);
          }
        }
        if (out) out += 2 * L;
      }
      for (int i = 0; i < L; ++i) {
        scales_out[(block * groups + g) * L + i] = scales[(block * L + i) * groups + g];
        biases_out[(block * groups + g) * L + i] = biases[(block * L + i) * groups + g];
      }
    }
  }
}

// The four bytes at p (an int16 pair; four int8 values) in every int32 lane
inline vi four_bytes_everywhere(const void* p) {
  int32_t v;
  std::memcpy(&v, p, sizeof v);
#if defined(__AVX512F__) && defined(__AVX512BW__)
  return _mm512_set1_epi32(v);
#else
  return _mm256_set1_epi32(v);
#endif
}

inline void store_f(float* p, vf a) {
#if defined(__AVX512F__) && defined(__AVX512BW__)
  _mm512_storeu_ps(p, a);
#else
  _mm256_storeu_ps(p, a);
#endif
}

// y[m, n] for the rows n of blocks [lo, hi) / kInterleavedRows and the M rows
// of x (r.xq, r.xd, r.xsum from prepare_x<8>); lo and hi multiples of
// kInterleavedRows.
template <int BITS, int M>
void interleaved_rows(const QuantizedRows& r, int64_t lo, int64_t hi) {
  constexpr int L = kInterleavedRows;
  const int group = r.group;
  const int64_t groups = r.K / group, block_bytes = r.K * BITS / 8 * L;
  const int chunks = BITS == 8 ? group / 2 : group / 4;
  // A dot instruction waits ~5 cycles for the last one into its register, so
  // one chain of sums per row of x (a decode step has one row) would run at
  // that latency, not at the loads' pace: the group's sums are split over
  // kSums registers per row, added once a group. int32 sums are exact, so
  // the split changes no result. kStep chunks fill the kSums once (two dots
  // a chunk at 4 bits); a group's chunks (8 to 64) are a multiple of it.
  constexpr int kSums = M >= 4 ? 1 : 4 / M;
  constexpr int kStep = BITS == 8 ? kSums : (kSums + 1) / 2;
  // Each group asks for the weights kPrefetchAhead bytes on, a group's worth
  // of lines at a time: a whole next block asked for at once fills the
  // core's miss buffers, and the loop then stalls on its own prefetches.
  constexpr int64_t kPrefetchAhead = 4096;
  const uint8_t* base = reinterpret_cast<const uint8_t*>(r.w);
  const int64_t end = hi / L * block_bytes;  // this call's rows end there
  for (int64_t block = lo / L; block < hi / L; ++block) {
    const uint8_t* w = base + block * block_bytes;
    const float *scale = r.scales + block * groups * L, *bias = r.biases + block * groups * L;
    vf acc[M];
    for (int m = 0; m < M; ++m) acc[m] = zero_f();
    for (int64_t g = 0; g < groups; ++g) {
      vi dot[M][kSums];
      for (int m = 0; m < M; ++m)
        for (int a = 0; a < kSums; ++a) dot[m][a] = zero_i();
      const int64_t k0 = g * group;
      if (w - base + kPrefetchAhead + chunks * 2 * L <= end) prefetch_span(w + kPrefetchAhead, chunks * 2 * L);
      for (int j = 0; j < chunks; j += kStep) {
        for (int c = 0; c < kStep; ++c, w += 2 * L) {
          const vi q = widen_u8(w);
          if constexpr (BITS == 8) {
            for (int m = 0; m < M; ++m) {
              vi& sum = dot[m][c % kSums];
              sum = dot_pairs(sum, q, four_bytes_everywhere(r.xq + m * r.K + k0 + 2 * (j + c)));
            }
          } else {
            const vi low = low_nibbles(q), high = high_nibbles(q);
            for (int m = 0; m < M; ++m) {
              const int16_t* x = r.xq + m * r.K + k0 + 4 * (j + c);
              vi &even = dot[m][2 * c % kSums], &odd = dot[m][(2 * c + 1) % kSums];
              even = dot_pairs(even, low, four_bytes_everywhere(x));
              odd = dot_pairs(odd, high, four_bytes_everywhere(x + 2));
            }
          }
        }
      }
      const vf s = load_f(scale + g * L), b = load_f(bias + g * L);
      for (int m = 0; m < M; ++m) {
        vi total = dot[m][0];
        for (int a = 1; a < kSums; ++a) total = add_i(total, dot[m][a]);
        // prepare_x<8> repeats each group's step over its span's lanes
        const float d = r.xd[(m * groups + g) * kLanes32], sum = r.xsum[m * groups + g];
        acc[m] = mul_add(to_float(total), mul(s, splat_f(d)), acc[m]);
        acc[m] = mul_add(b, splat_f(sum), acc[m]);
      }
    }
    for (int m = 0; m < M; ++m) store_f(r.y + m * r.N + block * L, acc[m]);
  }
}

// Rows `ids` (each in [0, N)) of the interleaved weight, dequantized into
// out [count, K]: what a quantized embedding looks up when its table is also
// the LM head's weight, stored interleaved for the head's products. Multiply,
// then add, as MLX rounds.
template <int BITS>
void take_interleaved(const QuantizedRows& r, const int64_t* ids, int64_t count, float* out) {
  constexpr int L = kInterleavedRows, per_chunk = BITS == 8 ? 2 : 4;
  const int group = r.group;
  const int64_t groups = r.K / group, block_bytes = r.K * BITS / 8 * L;
  const uint8_t* base = reinterpret_cast<const uint8_t*>(r.w);
  for (int64_t row = 0; row < count; ++row) {
    const int64_t block = ids[row] / L, i = ids[row] % L;
    const uint8_t* w = base + block * block_bytes + 2 * i;  // row i's pair in its block's first chunk
    float* o = out + row * r.K;
    for (int64_t g = 0; g < groups; ++g) {
      float s = r.scales[(block * groups + g) * L + i];
      const float b = r.biases[(block * groups + g) * L + i];
      for (int64_t k = 0; k < group; ++k) {
        const uint8_t byte = w[(g * group + k) / per_chunk * 2 * L + (k % per_chunk) % 2];
        const int q = BITS == 8 ? byte : (k % per_chunk < 2 ? byte & 0x0F : byte >> 4);
        float v = s * static_cast<float>(q);
        asm("" : "+v"(v));  // no FMA contraction: MLX rounds the product first
        o[g * group + k] = v + b;
      }
    }
  }
}

// The interleaved weight dequantized into w_t [K, N] (W^T, fp32, row n of W
// in column n): a block's kLanes32 rows are one vector of a row of W^T, so
// a chunk is two (8 bits) or four (4 bits) vector stores. Rows of W^T are
// written one after another, across every block, with streaming stores
// where they are whole cache lines (as dequantize_rows, for BLAS to read
// back). Multiply, then add, as MLX and dequantize_rows round.
template <int BITS>
void dequantize_interleaved(const QuantizedRows& r, float* w_t, int64_t lo, int64_t hi) {
  constexpr int L = kInterleavedRows;
  const int group = r.group;
  const int64_t groups = r.K / group, block_bytes = r.K * BITS / 8 * L;
  const int chunks = BITS == 8 ? group / 2 : group / 4;
  const uint8_t* base = reinterpret_cast<const uint8_t*>(r.w);
  const bool stream = reinterpret_cast<uintptr_t>(w_t) % 64 == 0 && (r.N * sizeof(float)) % 64 == 0 && L == 16;
  auto put = [&](vi lanes, int64_t k, int64_t column, vf s, vf b) {
    // lanes: int32 lane i = row i's value k (low 16 bits) and k + 1 (high)
#if defined(__AVX512F__) && defined(__AVX512BW__)
    const vi first = _mm512_and_si512(lanes, _mm512_set1_epi32(0xFFFF)), second = _mm512_srli_epi32(lanes, 16);
#else
    const vi first = _mm256_and_si256(lanes, _mm256_set1_epi32(0xFFFF)), second = _mm256_srli_epi32(lanes, 16);
#endif
    vf a = mul(to_float(first), s), c = mul(to_float(second), s);
    asm("" : "+v"(a), "+v"(c));  // no FMA contraction: MLX rounds the product first
    a = a + b, c = c + b;
    float *p = w_t + k * r.N + column, *q = p + r.N;
#if defined(__AVX512F__) && defined(__AVX512BW__)
    if (stream) {
      _mm512_stream_ps(p, a), _mm512_stream_ps(q, c);
      return;
    }
#endif
    store_f(p, a), store_f(q, c);
  };
  for (int64_t g = 0; g < groups; ++g) {
    for (int j = 0; j < chunks; ++j) {
      for (int64_t block = lo / L; block < hi / L; ++block) {
        const uint8_t* w = base + block * block_bytes + (g * chunks + j) * 2 * L;
        const vf s = load_f(r.scales + (block * groups + g) * L), b = load_f(r.biases + (block * groups + g) * L);
        const vi q = widen_u8(w);
        if constexpr (BITS == 8) {
          put(q, g * group + 2 * j, block * L, s, b);
        } else {
          put(low_nibbles(q), g * group + 4 * j, block * L, s, b);
          put(high_nibbles(q), g * group + 4 * j + 2, block * L, s, b);
        }
      }
    }
  }
#if defined(__AVX512F__)
  if (stream) _mm_sfence();
#endif
}

}  // namespace llm_pte

#else

namespace llm_pte {
constexpr int kInterleavedRows = 0;  // no interleaved layout without integer dot products
}

#endif  // LLM_PTE_INTEGER_DOT
