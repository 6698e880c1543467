// Fused attention on MLX's CPU stream: one MLX op, fp32 queries over fp32,
// bf16 or fp16 keys and values (a half-precision cache is widened as it is
// read), or over a quantized cache in MLX's affine layout (4 or 8 bits,
// dequantized in registers as it is read); and a flat cache layer's whole
// step, its keys and values written into the pools and attended, as one op
// (UpdateAndAttend; QuantizedUpdateAndAttend, which quantizes them as
// mx.quantize does).
//
// MLX's CPU backend runs attention as ~10 ops (its fast SDPA falls back to
// them) with a BLAS call per kv head for each product and a scalar exp: for
// a decode step's few scores, many times the work itself. This primitive
// does the whole thing as one op, with a polynomial exp eight lanes wide:
// - up to 63 queries a head (a decode step, a chat turn's short chunk): the
//   query heads of a kv head score its keys together, four keys at a time,
//   each key widened once for them all, and accumulate the values in
//   registers, in parts of 128 keys that the host thread helps with
//   (shared_work.cpp), merged as flash-decoding does;
// - from 64 queries a head (a prefill chunk): GEMM-style register tiles over
//   K packed into panels, then over V (below).
// Causal or not, optionally a sliding window; any strides (the cache hands
// over slices of its pools); a quantized cache's groups optionally stored
// rotated (rotate_groups). The loops read keys and values through a
// storage type (DenseRows, QuantizedRows) that says how a row is stored.
// extension.py builds it into the CPU kernel
// extension (nanobind, in MLX's type domain) once per machine and checks it
// against MLX before use.

#include <algorithm>
#include <array>
#include <bit>
#if defined(__F16C__) || defined(__AVX2__)
#include <immintrin.h>
#endif
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <stdexcept>
#include <vector>

#include "kernels.h"
#include "mlx/ops.h"
#include "primitive.h"
#include "shared_work.h"
#include "simd.h"

namespace llm_pte {
namespace {

using llm_pte::load8;  // simd.h's, for fp32 and bf16, overloaded below for fp16
using llm_pte::widen;

// fp16 keys and values (a cache stored in fp16), widened by F16C where the
// build has it (every AVX2 CPU), else with integer operations only: move
// exponent and mantissa into fp32's fields and rebias the exponent, then fix
// the two exponents that do not rebias: all ones (inf, NaN) and zero (zeros
// and subnormals, renormalised by subtracting 2^-14 in fp32).
struct Half {
  uint16_t bits;
};

constexpr int32_t kHalfExponent = 0x7c00 << 13;  // fp16's exponent field, moved to fp32's place
constexpr int32_t kRebias = (127 - 15) << 23;
constexpr int32_t kInfRebias = (128 - 16) << 23;
constexpr int32_t kTwoToMinus14 = 113 << 23;

inline f8 as_f8(i8 bits) {
  f8 x;
  std::memcpy(&x, &bits, sizeof x);
  return x;
}

inline i8 as_i8(f8 x) {
  i8 bits;
  std::memcpy(&bits, &x, sizeof bits);
  return bits;
}

inline f8 load8(const Half* p) {
#if defined(__F16C__)
  return std::bit_cast<f8>(_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
#endif
  u16x8 raw;
  std::memcpy(&raw, p, sizeof raw);
  const i8 h = __builtin_convertvector(raw, i8);
  i8 bits = (h & 0x7fff) << 13;
  const i8 exponent = bits & kHalfExponent;
  const i8 all_ones = exponent == kHalfExponent, zero = exponent == 0;  // -1 where true
  bits += kRebias + (all_ones & kInfRebias) + (zero & (1 << 23));
  const f8 x = as_f8(bits) - as_f8(zero & kTwoToMinus14);  // minus 0.0 where not zero
  return as_f8(as_i8(x) | ((h & 0x8000) << 16));
}

inline float widen(Half half) {  // load8's steps on one value
#if defined(__F16C__)
  return _cvtsh_ss(half.bits);
#endif
  const int32_t h = half.bits;
  int32_t bits = (h & 0x7fff) << 13;
  const int32_t exponent = bits & kHalfExponent;
  const int32_t all_ones = -(exponent == kHalfExponent), zero = -(exponent == 0);
  bits += kRebias + (all_ones & kInfRebias) + (zero & (1 << 23));
  const float x = std::bit_cast<float>(bits) - std::bit_cast<float>(zero & kTwoToMinus14);
  return std::bit_cast<float>(std::bit_cast<int32_t>(x) | ((h & 0x8000) << 16));
}

// row[j] = e^(row[j] - max) for j < n, and 0 up to n rounded up to 8 (the
// row has room for them); returns their sum, and the max in `top_out`.
inline float softmax_numerators(float* row, int n, float* top_out = nullptr) {
  const int n8 = (n + 7) / 8 * 8;
  std::fill(row + n, row + n8, -INFINITY);
  f8 m = splat(-INFINITY);
  for (int j = 0; j < n8; j += 8) m = max8(m, load8(row + j));
  const float top = std::max(std::max(std::max(m[0], m[1]), std::max(m[2], m[3])),
                             std::max(std::max(m[4], m[5]), std::max(m[6], m[7])));
  if (top_out) *top_out = top;
  const i8 lane = {0, 1, 2, 3, 4, 5, 6, 7};
  f8 sum = {};
  for (int j = 0; j < n8; j += 8) {
    f8 e = exp8(load8(row + j) - top);
    e = select8(lane < n - j, e, f8{});  // past the row's end
    store8(row + j, e);
    sum += e;
  }
  return sum8(sum);
}

// Each group of n values of x[0 .. D) (n a power of two from 8, dividing D)
// times the orthonormal Walsh-Hadamard matrix of size n, Sylvester's order
// (H_2n = [[H, H], [H, -H]] / sqrt 2), in place: log2(n) passes of
// butterflies, the first three within each vector of eight. A quantized
// cache stores its groups rotated so, as llama.cpp does: a few channels of K
// and V carry outliers, which the rotation spreads over the whole group,
// shrinking its quantization step. The matrix is symmetric and its own
// inverse, so queries rotated as the keys are score the same, and the output
// of rotated values, rotated again, is the output of the values.
inline f8 butterflies8(f8 x) {  // values 1, 2 and 4 apart: (a, b) -> (a + b, a - b)
  x = __builtin_shufflevector(x, x, 0, 0, 2, 2, 4, 4, 6, 6) +
      f8{1, -1, 1, -1, 1, -1, 1, -1} * __builtin_shufflevector(x, x, 1, 1, 3, 3, 5, 5, 7, 7);
  x = __builtin_shufflevector(x, x, 0, 1, 0, 1, 4, 5, 4, 5) +
      f8{1, 1, -1, -1, 1, 1, -1, -1} * __builtin_shufflevector(x, x, 2, 3, 2, 3, 6, 7, 6, 7);
  return __builtin_shufflevector(x, x, 0, 1, 2, 3, 0, 1, 2, 3) +
         f8{1, 1, 1, 1, -1, -1, -1, -1} * __builtin_shufflevector(x, x, 4, 5, 6, 7, 4, 5, 6, 7);
}

inline void rotate_groups(float* x, int D, int n) {
  const f8 norm = splat(1.0f / std::sqrt(float(n)));
  for (float* group = x; group < x + D; group += n) {
    for (int i = 0; i < n; i += 8) store8(group + i, butterflies8(load8(group + i)));
    for (int half = 8; half < n; half *= 2)
      for (int i = 0; i < n; i += 2 * half)
        for (int j = i; j < i + half; j += 8) {
          const f8 a = load8(group + j), b = load8(group + j + half);
          store8(group + j, a + b), store8(group + j + half, a - b);
        }
    for (int i = 0; i < n; i += 8) store8(group + i, load8(group + i) * norm);
  }
}

struct Geometry {
  int B, Hq, Hkv, T, S, D;
  bool causal;
  int window;  // > 0: a query sees only the last `window` of its keys
  float scale;
  mx::Strides q;  // in elements
  int rotation = 0;  // > 0: K and V stored with each group of this size rotated (rotate_groups)

  // Query t sees keys [first_key(t), end_key(t)).
  int end_key(int t) const { return causal ? S - T + t + 1 : S; }
  int first_key(int t) const { return window > 0 ? std::max(0, end_key(t) - window) : 0; }

  // dst = query (b, head, t) times the scale, rotated as the keys are.
  void query_row(const float* queries, int b, int head, int t, float* dst) const {
    const float* src = queries + b * q[0] + head * q[1] + t * q[2];
    for (int d = 0; d < D; ++d) dst[d] = src[d * q[3]] * scale;
    if (rotation) rotate_groups(dst, D, rotation);
  }
  // An output row of rotated values, rotated back.
  void unrotate_output(float* row) const {
    if (rotation) rotate_groups(row, D, rotation);
  }
};

// ---- How keys and values are stored, as the loops below read them.
//
// A store describes a [B, Hkv, S, D] array of rows: head(b, h) is one kv
// head's, from(j) the rows from row j on. span(j, d) reads row j's values
// eight at a time (span.load(e) for e a multiple of 8) in the group of
// group(D) values that holds value d (a quantized row's group shares a
// scale and bias, widened once for its loads); value(j, d) reads one value
// at any strides. vectorised(D): whether the spans apply (rows of whole
// vectors, contiguous along D), else the loops go value by value.

using Strides4 = std::array<int64_t, 4>;

inline Strides4 strides4(const mx::array& a) { return {a.strides(0), a.strides(1), a.strides(2), a.strides(3)}; }

// fp32, bf16 (as its bits) or fp16 rows, widened as they are read: one group.
template <typename T>
struct DenseRows {
  const T* p;
  Strides4 stride;  // in elements

  struct Span {
    const T* row;
    f8 load(int d) const { return load8(row + d); }
  };

  DenseRows head(int b, int h) const { return {p + b * stride[0] + h * stride[1], stride}; }
  DenseRows from(int j) const { return {p + j * stride[2], stride}; }
  bool vectorised(int D) const { return D % 8 == 0 && stride[3] == 1; }
  int group(int D) const { return D; }
  Span span(int j, int) const { return {p + j * stride[2]}; }
  float value(int j, int d) const { return widen(p[j * stride[2] + d * stride[3]]); }
};

typedef uint8_t u8x8 __attribute__((vector_size(8)));
typedef uint32_t u32x8 __attribute__((vector_size(32)));

// Values d .. d + 7 of a row of BITS-bit values packed little end first
// into words (MLX's layout), d a multiple of 8, as floats: two words' bytes
// or one word's nibbles.
template <int BITS>
inline f8 unpack8(const uint32_t* row, int d) {
  if constexpr (BITS == 8) {
    const uint8_t* p = reinterpret_cast<const uint8_t*>(row) + d;
#if defined(__AVX2__)
    // one widening load: GCC spells the conversion below as eight scalar
    // byte extracts and inserts
    const __m256i bytes = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
    return std::bit_cast<f8>(_mm256_cvtepi32_ps(bytes));
#else
    u8x8 bytes;
    std::memcpy(&bytes, p, sizeof bytes);
    return __builtin_convertvector(__builtin_convertvector(bytes, i8), f8);
#endif
  } else {
    const uint32_t w = row[d / 8];
    const u32x8 nibbles = (u32x8{w, w, w, w, w, w, w, w} >> u32x8{0, 4, 8, 12, 16, 20, 24, 28}) & 15u;
    return __builtin_convertvector((i8)nibbles, f8);
  }
}

// MLX's affine quantization along D (what mx.quantize makes of [B, Hkv, S,
// D] keys or values): rows of uint32 words of BITS-bit values q, and fp16
// scales and biases per group of `group_size` values (32, 64 or 128,
// dividing D); a value is q * scale + bias, computed in fp32.
template <int BITS>
struct QuantizedRows {
  static constexpr int kPerWord = 32 / BITS;
  const uint32_t* q;
  const Half *scales, *biases;
  Strides4 q_stride, s_stride, b_stride;  // in words, in halves
  int group_size;

  struct Span {
    const uint32_t* row;
    f8 scale, bias;
    f8 load(int d) const { return unpack8<BITS>(row, d) * scale + bias; }
  };

  QuantizedRows head(int b, int h) const {
    return {q + b * q_stride[0] + h * q_stride[1], scales + b * s_stride[0] + h * s_stride[1],
            biases + b * b_stride[0] + h * b_stride[1], q_stride, s_stride, b_stride, group_size};
  }
  QuantizedRows from(int j) const {
    return {q + j * q_stride[2], scales + j * s_stride[2], biases + j * b_stride[2],
            q_stride, s_stride, b_stride, group_size};
  }
  bool vectorised(int) const { return q_stride[3] == 1; }  // D is a multiple of 32: whole vectors
  int group(int) const { return group_size; }
  Span span(int j, int d) const {
    const int g = d / group_size;
    return {q + j * q_stride[2], splat(widen(scales[j * s_stride[2] + g * s_stride[3]])),
            splat(widen(biases[j * b_stride[2] + g * b_stride[3]]))};
  }
  float value(int j, int d) const {
    const uint32_t word = q[j * q_stride[2] + d / kPerWord * q_stride[3]];
    const float x = float(word >> (BITS * (d % kPerWord)) & ((1u << BITS) - 1));
    const int g = d / group_size;
    return x * widen(scales[j * s_stride[2] + g * s_stride[3]]) + widen(biases[j * b_stride[2] + g * b_stride[3]]);
  }
};

// s[r * s_row + j] = q_r . k_j for R query rows (D apart) over keys j < n
// (a vectorised store): four keys at a time, each widened once for all R
// rows (the query heads sharing a kv head).
template <int R, typename Keys>
void scores_of_rows(const float* q, const Keys& k, int n, int D, float* s, int s_row) {
  const int G = k.group(D);
  int j = 0;
  for (; j + 4 <= n; j += 4) {
    f8 a[R][4] = {};
    for (int d0 = 0; d0 < D; d0 += G) {
      const auto row0 = k.span(j, d0), row1 = k.span(j + 1, d0), row2 = k.span(j + 2, d0), row3 = k.span(j + 3, d0);
      for (int d = d0; d < d0 + G; d += 8) {
        const f8 k0 = row0.load(d), k1 = row1.load(d), k2 = row2.load(d), k3 = row3.load(d);
#pragma GCC unroll 4
        for (int r = 0; r < R; ++r) {
          const f8 x = load8(q + r * D + d);
          a[r][0] += x * k0, a[r][1] += x * k1, a[r][2] += x * k2, a[r][3] += x * k3;
        }
      }
    }
    for (int r = 0; r < R; ++r) sums4(a[r], s + r * s_row + j);
  }
  for (; j < n; ++j) {
    f8 a[R] = {};
    for (int d0 = 0; d0 < D; d0 += G) {
      const auto row = k.span(j, d0);
      for (int d = d0; d < d0 + G; d += 8) {
        const f8 kj = row.load(d);
        for (int r = 0; r < R; ++r) a[r] += load8(q + r * D + d) * kj;
      }
    }
    for (int r = 0; r < R; ++r) s[r * s_row + j] = sum8(a[r]);
  }
}

// out[r * out_row + c] = sum_j p[r * p_row + j] v_j[c] for R rows over
// j < n (a vectorised store): 32 columns at a time (one group: groups are
// 32 values or more), each value widened once for all R rows, then 8 at a
// time.
template <int R, typename Values>
void weighted_values(const float* p, int p_row, const Values& v, int n, int D, float* out, int out_row) {
  int c = 0;
  for (; c + 32 <= D; c += 32) {
    f8 a[R][4] = {};
    for (int j = 0; j < n; ++j) {
      const auto vj = v.span(j, c);
      const f8 v0 = vj.load(c), v1 = vj.load(c + 8), v2 = vj.load(c + 16), v3 = vj.load(c + 24);
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r) {
        const f8 pj = splat(p[r * p_row + j]);
        a[r][0] += pj * v0, a[r][1] += pj * v1, a[r][2] += pj * v2, a[r][3] += pj * v3;
      }
    }
    for (int r = 0; r < R; ++r) {
      float* o = out + r * out_row + c;
      store8(o, a[r][0]), store8(o + 8, a[r][1]), store8(o + 16, a[r][2]), store8(o + 24, a[r][3]);
    }
  }
  for (; c < D; c += 8) {
    for (int r = 0; r < R; ++r) {
      f8 a = {};
      for (int j = 0; j < n; ++j) a += splat(p[r * p_row + j]) * v.span(j, c).load(c);
      store8(out + r * out_row + c, a);
    }
  }
}

// A few queries (a decode step) in parts that the host thread helps with:
// a part is one kv head's rep * T query rows over one block of kKeysPerPart
// keys, so each key and value is read once, by one thread, and stays in its
// cache for the rows that share it; the rep rows of one query position (the
// query heads of the kv head) go through the keys together, up to four at a
// time. Each row's part leaves its softmax unnormalised (max, sum of
// e^(s - max), sum of e^(s - max) v); the parts of a row then merge by
// rescaling to their common max, as flash-decoding does.
constexpr int kKeysPerPart = 128;
constexpr int kRowsTogether = 4;

template <typename Keys, typename Values>
struct PartsTask {
  const float* rows;  // the query rows as query_row makes them, [B, T, Hq, D]
  Keys k;
  Values v;
  Geometry g;
  int parts;  // per kv head
  float* partial;  // per (b, query head, t, part): max, sum, then D sums
};

// R rows' part: their slots are `slot_row` apart (consecutive query heads).
template <int R, typename Keys, typename Values>
void attend_rows(const float* qrows, const Keys& kr, const Values& vr, const Geometry& g, int n, float* scores,
                 float* slot, int slot_row) {
  const int s_row = kKeysPerPart + 8, D = g.D;
  scores_of_rows<R>(qrows, kr, n, D, scores, s_row);
  for (int r = 0; r < R; ++r) {
    float* row_slot = slot + r * slot_row;
    row_slot[1] = softmax_numerators(scores + r * s_row, n, &row_slot[0]);
  }
  weighted_values<R>(scores, s_row, vr, n, D, slot + 2, slot_row);
}

template <typename Keys, typename Values>
void attend_parts(const SharedJob& job, int64_t lo, int64_t hi) {
  const auto& task = *static_cast<const PartsTask<Keys, Values>*>(job.task);
  const Geometry& g = task.g;
  const int rep = g.Hq / g.Hkv, D = g.D, parts = task.parts;
  const bool fast = task.k.vectorised(D) && task.v.vectorised(D);
  thread_local std::vector<float> scores;  // this thread's, reused
  scores.resize(kRowsTogether * (kKeysPerPart + 8));
  const int slot_row = g.T * parts * (D + 2);  // between consecutive heads' slots of one t and part
  for (int64_t unit = lo; unit < hi; ++unit) {
    const int b = int(unit / (int64_t(g.Hkv) * parts)), h = int(unit / parts % g.Hkv), part = int(unit % parts);
    const Keys kh = task.k.head(b, h);
    const Values vh = task.v.head(b, h);
    for (int t = 0; t < g.T; ++t) {
      const int j0 = std::max(g.first_key(t), part * kKeysPerPart);
      const int n = std::min(g.end_key(t), (part + 1) * kKeysPerPart) - j0;
      for (int first = 0; first < rep; first += kRowsTogether) {
        const int R = std::min(kRowsTogether, rep - first);
        float* slots[kRowsTogether];
        for (int r = 0; r < R; ++r) {
          const int head = h * rep + first + r;
          slots[r] = task.partial + ((int64_t(b * g.Hq + head) * g.T + t) * parts + part) * (D + 2);
        }
        if (n <= 0) {  // none of these rows' keys: a part the merge skips
          for (int r = 0; r < R; ++r) slots[r][0] = -INFINITY, slots[r][1] = 0.0f;
          continue;
        }
        const Keys kr = kh.from(j0);
        const Values vr = vh.from(j0);
        const float* qrows = task.rows + ((int64_t(b) * g.T + t) * g.Hq + h * rep + first) * D;
        if (fast) {
          switch (R) {
            case 1: attend_rows<1>(qrows, kr, vr, g, n, scores.data(), slots[0], slot_row); break;
            case 2: attend_rows<2>(qrows, kr, vr, g, n, scores.data(), slots[0], slot_row); break;
            case 3: attend_rows<3>(qrows, kr, vr, g, n, scores.data(), slots[0], slot_row); break;
            default: attend_rows<4>(qrows, kr, vr, g, n, scores.data(), slots[0], slot_row);
          }
          continue;
        }
        for (int r = 0; r < R; ++r) {  // any strides: one row at a time
          const float* qrow = qrows + r * D;
          float* row_scores = scores.data();
          for (int j = 0; j < n; ++j) {
            float s = 0.0f;
            for (int d = 0; d < D; ++d) s += qrow[d] * kr.value(j, d);
            row_scores[j] = s;
          }
          slots[r][1] = softmax_numerators(row_scores, n, &slots[r][0]);
          float* acc = slots[r] + 2;
          std::fill(acc, acc + D, 0.0f);
          for (int j = 0; j < n; ++j)
            for (int d = 0; d < D; ++d) acc[d] += row_scores[j] * vr.value(j, d);
        }
      }
    }
  }
}

// out from the parts attend_parts left: each row's parts rescaled to their
// common max, summed, and divided by the summed denominators (then rotated
// back, over rotated values).
inline void merge_parts(const Geometry& g, int parts, const float* partial, float* out) {
  const int D = g.D;
  for (int64_t row = 0; row < int64_t(g.B) * g.Hq * g.T; ++row) {
    const float* first = partial + row * parts * (D + 2);
    float top = -INFINITY;
    for (int p = 0; p < parts; ++p) top = std::max(top, first[p * (D + 2)]);
    float* o = out + row * D;
    std::fill(o, o + D, 0.0f);
    float sum = 0.0f;
    for (int p = 0; p < parts; ++p) {
      const float* part = first + p * (D + 2);
      if (part[1] == 0.0f) continue;  // no keys of this row in it
      const float weight = std::exp(part[0] - top);
      sum += weight * part[1];
      for (int d = 0; d < D; ++d) o[d] += weight * part[2 + d];
    }
    const float inv = 1.0f / sum;
    for (int d = 0; d < D; ++d) o[d] *= inv;
    g.unrotate_output(o);
  }
}

// ---- Many queries (a prefill chunk): register-tiled products.
//
// Per kv head the rep*T query rows form one [rows, D] x [D, S] product, then
// one [rows, S] x [S, D]. K is packed into 16-key panels once per kv head.
// Each query head's T rows go in blocks of kRows consecutive queries; a
// block's scores are computed kRows x 16 keys at a time (each step: two
// panel loads, a broadcast per row, 2*kRows FMAs, as a GEMM micro-kernel
// does), normalised exactly (max, exp, sum over the whole row), then
// multiplied into V 16 columns at a time. A block works on the keys from
// its first row's first (a window) to its last row's last (causal). Shared
// with the host only where it helps with the chunk anyway: beside BLAS's
// products a second thread would take a core from BLAS's own threads
// (attend_tiles).

constexpr int kRows = 6;
constexpr int kPanel = 16;
// From this many queries a head the tiled path is the faster: packing K
// costs what the rows of a few dozen queries do, and the row path is shared
// with the host.
constexpr int kTiledMinQueries = 64;

// s[r][c] = q[r] . k_c for the R rows and the panel's 16 keys.
template <int R>
void score_panel(const float* q, int D, const float* panel, float* s, int64_t s_stride) {
  f8 a[R][2] = {};
  for (int d = 0; d < D; ++d) {
    const f8 k0 = load8(panel + d * kPanel), k1 = load8(panel + d * kPanel + 8);
    for (int r = 0; r < R; ++r) {
      const f8 x = splat(q[r * D + d]);
      a[r][0] += x * k0;
      a[r][1] += x * k1;
    }
  }
  for (int r = 0; r < R; ++r) {
    std::memcpy(s + r * s_stride, &a[r][0], sizeof(f8));
    std::memcpy(s + r * s_stride + 8, &a[r][1], sizeof(f8));
  }
}

// o[r][c0:c0+16] = sum_{j<n} p[r][j] v_j[c0:c0+16] for the R rows.
template <int R, typename KV>
void weigh_values(const float* p, int64_t p_stride, const KV* v, int64_t v_stride, int n,
                  float* o, int64_t o_stride) {
  f8 a[R][2] = {};
  for (int j = 0; j < n; ++j) {
    const f8 v0 = load8(v + j * v_stride), v1 = load8(v + j * v_stride + 8);
    for (int r = 0; r < R; ++r) {
      const f8 w = splat(p[r * p_stride + j]);
      a[r][0] += w * v0;
      a[r][1] += w * v1;
    }
  }
  for (int r = 0; r < R; ++r) {
    std::memcpy(o + r * o_stride, &a[r][0], sizeof(f8));
    std::memcpy(o + r * o_stride + 8, &a[r][1], sizeof(f8));
  }
}

// Rows r < R see keys [lo[r], hi[r]); the block works on keys from the
// first panel any of them needs to the last key any of them sees.
template <int R, typename KV>
void attend_block(const float* q, const float* panels, const KV* v, int64_t v_stride,
                  const int* lo, const int* hi, int D, float* s, int64_t s_stride, float* o) {
  const int j0 = *std::min_element(lo, lo + R) / kPanel * kPanel;
  const int n = *std::max_element(hi, hi + R) - j0;
  float inv[R];
  for (int j = 0; j < n; j += kPanel)
    score_panel<R>(q, D, panels + static_cast<int64_t>(j0 + j) * D, s + j, s_stride);
  for (int r = 0; r < R; ++r) {
    float* row = s + r * s_stride;
    const int first = lo[r] - j0, count = hi[r] - lo[r];
    std::fill(row, row + first, 0.0f);
    inv[r] = 1.0f / softmax_numerators(row + first, count);
    for (int j = first + (count + 7) / 8 * 8; j < n; ++j) row[j] = 0.0f;  // keys of later rows
  }
  for (int c = 0; c < D; c += kPanel)
    weigh_values<R, KV>(s, s_stride, v + j0 * v_stride + c, v_stride, n, o + c, D);
  for (int r = 0; r < R; ++r)
    for (int d = 0; d < D; d += 8) store8(o + r * D + d, load8(o + r * D + d) * inv[r]);
}

// A prefill chunk's attention as a shared job: a unit is one query head's
// share of its row blocks (kTiledSplit shares a head), so the host thread,
// when it is helping with the chunk's products (ours, not BLAS's: a
// quantized or bf16 chunk), takes units too. Units go kv head by kv head,
// a chunk of the job being one share of each of a kv head's query heads,
// so a chunk packs its kv head's K into panels (and widens quantized V,
// tile_values) once. Each output row is one thread's, computed in a fixed
// order: the same bits whoever ran it.
constexpr int kTiledSplit = 2;

template <typename Keys, typename Values>
struct TiledTask {
  const float* q;
  Keys k;
  Values v;
  float* out;
  Geometry g;
};

// One kv head's values as the tiles read them (rows of D contiguous values):
// fp32, bf16 or fp16 as stored; quantized ones widened into `wide` [S, D],
// since each value is read by every block of rows.
template <typename T>
DenseRows<T> tile_values(const DenseRows<T>& v, int, int, std::vector<float>&) {
  return v;
}

template <int BITS>
DenseRows<float> tile_values(const QuantizedRows<BITS>& v, int S, int D, std::vector<float>& wide) {
  wide.resize(static_cast<size_t>(S) * D);
  for (int j = 0; j < S; ++j)
    for (int d0 = 0; d0 < D; d0 += v.group_size) {
      const auto span = v.span(j, d0);
      for (int d = d0; d < d0 + v.group_size; d += 8) store8(&wide[static_cast<size_t>(j) * D + d], span.load(d));
    }
  return {wide.data(), {0, 0, D, 1}};
}

template <typename Keys, typename Values>
void attend_tiles(const SharedJob& job, int64_t lo, int64_t hi) {
  const auto& task = *static_cast<const TiledTask<Keys, Values>*>(job.task);
  const Geometry& g = task.g;
  const float* q = task.q;
  const int rep = g.Hq / g.Hkv, D = g.D, S = g.S;
  const int S_pad = (S + kPanel - 1) / kPanel * kPanel;
  // a row's exp writes up to 7 keys past its last (softmax_numerators)
  const int s_stride = S_pad + 8;
  thread_local std::vector<float> panels, qs, o, scores, wide;  // this thread's, reused
  panels.resize(static_cast<size_t>(S_pad) * D), qs.resize(kRows * D), o.resize(kRows * D);
  scores.resize(kRows * static_cast<size_t>(s_stride));
  int lo_key[kRows], hi_key[kRows];
  const int blocks = (g.T + kRows - 1) / kRows;
  int64_t packed = -1;  // the (batch, kv head) whose K the panels hold, and whose V vh reads
  decltype(tile_values(task.v, S, D, wide)) vh{};
  for (int64_t unit = lo; unit < hi; ++unit) {
    // unit = ((b * Hkv + h) * kTiledSplit + share) * rep + r, query head h * rep + r
    const int r_head = int(unit % rep), share = int(unit / rep % kTiledSplit);
    const int h = int(unit / rep / kTiledSplit % g.Hkv), b = int(unit / rep / kTiledSplit / g.Hkv);
    const int head = h * rep + r_head;
    if (b * int64_t(g.Hkv) + h != packed) {
      // this kv head's K as panels [S_pad / 16][D][16], zero past S
      const Keys kh = task.k.head(b, h);
      for (int j = 0; j < S_pad; ++j)
        for (int d = 0; d < D; ++d)
          panels[(static_cast<size_t>(j) / kPanel * D + d) * kPanel + j % kPanel] = j < S ? kh.value(j, d) : 0.0f;
      vh = tile_values(task.v.head(b, h), S, D, wide);
      packed = b * int64_t(g.Hkv) + h;
    }
    for (int block = share * blocks / kTiledSplit; block < (share + 1) * blocks / kTiledSplit; ++block) {
      const int t0 = block * kRows, R = std::min(kRows, g.T - t0);
      for (int r = 0; r < R; ++r) {
        g.query_row(q, b, head, t0 + r, qs.data() + r * D);
        lo_key[r] = g.first_key(t0 + r), hi_key[r] = g.end_key(t0 + r);
      }
      using V = std::remove_const_t<std::remove_pointer_t<decltype(vh.p)>>;
      auto run_block = attend_block<1, V>;
      switch (R) {
        case 6: run_block = attend_block<6, V>; break;
        case 5: run_block = attend_block<5, V>; break;
        case 4: run_block = attend_block<4, V>; break;
        case 3: run_block = attend_block<3, V>; break;
        case 2: run_block = attend_block<2, V>; break;
      }
      run_block(qs.data(), panels.data(), vh.p, vh.stride[2], lo_key, hi_key, D, scores.data(), s_stride, o.data());
      for (int r = 0; r < R; ++r) g.unrotate_output(o.data() + r * D);
      float* dst = task.out + ((static_cast<size_t>(b) * g.Hq + head) * g.T + t0) * D;
      std::memcpy(dst, o.data(), static_cast<size_t>(R) * D * sizeof(float));
    }
  }
}

// The attention itself, run as the op's task on the stream thread: a
// prefill chunk's tiles on this thread, a decode step's parts shared.
template <typename Keys, typename Values>
void attend(const float* q, const Keys& k, const Values& v, float* out, const Geometry& g) {
  if (g.T >= kTiledMinQueries && g.D % kPanel == 0 && k.vectorised(g.D) && v.vectorised(g.D)) {
    TiledTask<Keys, Values> task{q, k, v, out, g};
    SharedJob job(attend_tiles<Keys, Values>, &task, int64_t(g.B) * g.Hq * kTiledSplit, g.Hq / g.Hkv);
    if (host_helps()) {
      run_shared(job);
    } else {
      attend_tiles<Keys, Values>(job, 0, job.items);  // BLAS's threads may still hold the other core
    }
    return;
  }
  // the query rows made once here, not once per part that reads them
  std::vector<float> rows(int64_t(g.B) * g.T * g.Hq * g.D);
  for (int b = 0; b < g.B; ++b)
    for (int t = 0; t < g.T; ++t)
      for (int head = 0; head < g.Hq; ++head)
        g.query_row(q, b, head, t, rows.data() + ((int64_t(b) * g.T + t) * g.Hq + head) * g.D);
  const int parts = (g.S + kKeysPerPart - 1) / kKeysPerPart;
  std::vector<float> partial(int64_t(g.B) * g.Hq * g.T * parts * (g.D + 2));
  PartsTask<Keys, Values> task{rows.data(), k, v, g, parts, partial.data()};
  SharedJob job(attend_parts<Keys, Values>, &task, int64_t(g.B) * g.Hkv * parts, 1);
  run_shared(job);
  merge_parts(g, parts, partial.data(), out);
}

// f(T*) with the pointer type of `a`'s dtype: fp32, bf16 (as its bits) or fp16.
template <typename F>
void with_kv_type(const mx::array& a, F f) {
  if (a.dtype() == mx::bfloat16) {
    f(static_cast<uint16_t*>(nullptr));
  } else if (a.dtype() == mx::float16) {
    f(static_cast<Half*>(nullptr));
  } else {
    f(static_cast<float*>(nullptr));
  }
}

template <typename T>
DenseRows<T> dense_rows(const mx::array& a) {
  return {static_cast<const T*>(a.data<void>()), strides4(a)};
}

class FusedAttention : public CpuPrimitive<FusedAttention, SharedPrimitive> {
 public:
  static constexpr const char* kName = "FusedAttention";
  FusedAttention(mx::Stream stream, float scale, bool causal, int window, bool few_queries)
      : CpuPrimitive(stream), scale_(scale), causal_(causal), window_(window), few_queries_(few_queries) {}
  auto params() const { return std::tuple(scale_, causal_, window_, few_queries_); }

  // A few queries (a decode step) go row by row, shared with the host; a
  // prefill chunk's tiles are shared only where the host helps anyway
  // (attend_tiles), so they do not make a graph worth helping with.
  bool shares_work() const override { return few_queries_; }

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override {
    const auto &q = inputs[0], &k = inputs[1], &v = inputs[2];
    auto& encoder = bind(inputs, outputs);
    auto& out = outputs[0];
    auto started = read_ahead_later(k, nullptr, 0);  // nothing to read ahead: a step still has it to help with
    Geometry g{q.shape(0), q.shape(1), k.shape(1), q.shape(2), k.shape(2), q.shape(3),
               causal_,    window_,    scale_,     q.strides()};
    with_kv_type(k, [&](auto* type) {
      using T = std::remove_const_t<std::remove_pointer_t<decltype(type)>>;
      encoder.dispatch([q = q.data<float>(), k = dense_rows<T>(k), v = dense_rows<T>(v), o = out.data<float>(), g,
                        started]() {
        started->store(true, std::memory_order_relaxed);
        attend(q, k, v, o, g);
      });
    });
  }

  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override {
    return {inputs[0].shape()};
  }

 private:
  float scale_;
  bool causal_;
  int window_;
  bool few_queries_;
};

template <int BITS>
QuantizedRows<BITS> quantized_rows(const mx::array& q, const mx::array& scales, const mx::array& biases,
                                   int group_size) {
  return {q.data<uint32_t>(), static_cast<const Half*>(scales.data<void>()),
          static_cast<const Half*>(biases.data<void>()), strides4(q), strides4(scales), strides4(biases), group_size};
}

// f(k_bits, v_bits) with each width as a std::integral_constant: 4 or 8.
template <typename F>
void with_bits(int k_bits, int v_bits, F f) {
  const auto with_v = [&](auto k) {
    if (v_bits == 8) f(k, std::integral_constant<int, 8>{});
    else f(k, std::integral_constant<int, 4>{});
  };
  if (k_bits == 8) with_v(std::integral_constant<int, 8>{});
  else with_v(std::integral_constant<int, 4>{});
}

// FusedAttention over a quantized cache: inputs q, then K's words, scales
// and biases, then V's; rotated: K's and V's groups stored rotated.
class QuantizedAttention : public CpuPrimitive<QuantizedAttention, SharedPrimitive> {
 public:
  static constexpr const char* kName = "QuantizedAttention";
  QuantizedAttention(mx::Stream stream, float scale, bool causal, int window, bool few_queries, int k_bits,
                     int v_bits, int group_size, bool rotated)
      : CpuPrimitive(stream), scale_(scale), causal_(causal), window_(window), few_queries_(few_queries),
        k_bits_(k_bits), v_bits_(v_bits), group_size_(group_size), rotated_(rotated) {}
  auto params() const {
    return std::tuple(scale_, causal_, window_, few_queries_, k_bits_, v_bits_, group_size_, rotated_);
  }

  bool shares_work() const override { return few_queries_; }  // as FusedAttention's

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override {
    const auto& q = inputs[0];
    auto& encoder = bind(inputs, outputs);
    auto& out = outputs[0];
    auto started = read_ahead_later(inputs[1], nullptr, 0);  // as FusedAttention's
    Geometry g{q.shape(0), q.shape(1), inputs[1].shape(1), q.shape(2), inputs[1].shape(2), q.shape(3),
               causal_,    window_,    scale_,             q.strides(),        rotated_ ? group_size_ : 0};
    with_bits(k_bits_, v_bits_, [&](auto k_bits, auto v_bits) {
      const auto k = quantized_rows<decltype(k_bits)::value>(inputs[1], inputs[2], inputs[3], group_size_);
      const auto v = quantized_rows<decltype(v_bits)::value>(inputs[4], inputs[5], inputs[6], group_size_);
      encoder.dispatch([q = q.data<float>(), k, v, o = out.data<float>(), g, started]() {
        started->store(true, std::memory_order_relaxed);
        attend(q, k, v, o, g);
      });
    });
  }

  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override {
    return {inputs[0].shape()};
  }

 private:
  float scale_;
  bool causal_;
  int window_;
  bool few_queries_;
  int k_bits_, v_bits_, group_size_;
  bool rotated_;
};

// fp32 key or value rows in a pool's storage dtype, rounded as MLX's astype
// rounds them (to nearest, ties to even).
inline void store(float* dst, float x) { *dst = x; }
inline void store(uint16_t* dst, float x) {
  const mx::bfloat16_t b(x);
  std::memcpy(dst, &b, sizeof *dst);
}
inline void store(Half* dst, float x) {
  const mx::float16_t h(x);
  std::memcpy(dst, &h, sizeof *dst);
}

// The buffers of the N pools a step op writes (outputs 1 .. N, from inputs
// 3 .. 3 + N): each input pool's own where MLX's rule would donate it, else
// a new one the task copies the pool into (PoolCopy). Returns whether each
// must be copied.
//
// Why: MLX donates an input's buffer where nothing else holds the input
// (is_donatable), as its slice_update does; that makes a decode step's write
// a few rows, not a copy of the pool. But each output of an op holds its own
// copy of the inputs (array::make_arrays), which MLX drops only after eval,
// so a pool would never qualify: the other outputs' copies are dropped here
// first. Only where MLX handed over the evaluated output's own inputs (they
// keep the input buffers alive until the task has run) and no tracer
// (mx.compile, a transform) keeps the graph. Then is_donatable decides:
// whatever else holds a pool (the caller, a saved state's slice, an op
// queued to read it) has it copied, slower but never written under its
// reader. Should MLX come to hold the inputs otherwise, the pools are
// copied; test_cpu_attention.py's in-place tests notice that.
template <size_t N>
std::array<bool, N> take_pools(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) {
  const bool own = std::any_of(outputs.begin(), outputs.end(), [&](auto& o) { return &o.inputs() == &inputs; });
  if (own && !outputs[0].is_tracer()) {
    for (auto& o : outputs)
      if (&o.inputs() != &inputs) o.inputs().clear();
  }
  std::array<bool, N> copy;
  for (size_t i = 0; i < N; ++i) {
    const auto& pool = inputs[3 + i];
    auto& out = outputs[1 + i];
    copy[i] = !(pool.is_donatable() && pool.flags().row_contiguous);
    if (copy[i]) out.set_data(mx::allocator::malloc(out.nbytes()));
    else out.copy_shared_buffer(pool);
  }
  return copy;
}

// out = pool, element by element, for a pool some other array still holds
// (a saved state's lazy slice) or one with strides of its own.
void copy_pool(const char* src, const mx::Strides& strides, const mx::Shape& shape, size_t size, char* dst) {
  for (int a = 0; a < shape[0]; ++a)
    for (int h = 0; h < shape[1]; ++h)
      for (int s = 0; s < shape[2]; ++s)
        for (int d = 0; d < shape[3]; ++d)
          std::memcpy(dst + (((int64_t(a) * shape[1] + h) * shape[2] + s) * shape[3] + d) * size,
                      src + (a * strides[0] + h * strides[1] + s * strides[2] + d * strides[3]) * size, size);
}

// The copy of one input pool into its output's new buffer that take_pools
// asked for, for the task to run first; none where the buffer was donated.
struct PoolCopy {
  const char* src = nullptr;
  mx::Strides strides;
  mx::Shape shape;
  size_t size = 0;
  char* dst = nullptr;

  PoolCopy(const mx::array& pool, mx::array& out, bool copy)
      : src(copy ? pool.data<char>() : nullptr), strides(pool.strides()), shape(pool.shape()),
        size(pool.itemsize()), dst(out.data<char>()) {}
  void run() const {
    if (src) copy_pool(src, strides, shape, size, dst);
  }
};

// A step's rows x [1, H, T, D] (fp32, any strides) with the rotary embedding
// applied as transformers' rotate_half does it, into y (contiguous): row t's
// pairs (j, j + D/2) turned by cos[t][j] and sin[t][j] of `tables` (cos
// [T, D/2] then sin [T, D/2]), each product rounded before the sum (x * cos
// + rotate_half(x) * sin, where rotate_half(x) = [-x2, x1]): no FMA
// contraction, which would round the sum once.
#if defined(__GNUC__) && !defined(__clang__)
__attribute__((optimize("fp-contract=off")))
#endif
void rope_rows(const float* x, const mx::Strides& xs, int H, int T, int D, const float* tables, float* y) {
  const int half = D / 2;
  const float* cos = tables;
  const float* sin = tables + int64_t(T) * half;
  for (int h = 0; h < H; ++h)
    for (int t = 0; t < T; ++t) {
      const float* row = x + h * xs[1] + t * xs[2];
      float* out = y + (int64_t(h) * T + t) * D;
      const float *c = cos + int64_t(t) * half, *s = sin + int64_t(t) * half;
      for (int j = 0; j < half; ++j) {
        const float x1 = row[j * xs[3]], x2 = row[(j + half) * xs[3]];
        const float a = x1 * c[j], b = x2 * s[j], e = x2 * c[j], f = x1 * s[j];
        out[j] = a - b, out[j + half] = e + f;
      }
    }
}

// Where a step op rotates its queries and keys (a `rope` input): their rows
// rotated once as the task starts, read from there (contiguous).
struct RotatedRows {
  std::vector<float> q, k;

  RotatedRows(const float* tables, const float*& qp, mx::Strides& qs, int Hq, const float*& kp, mx::Strides& ks,
              int Hkv, int T, int D) {
    if (!tables) return;
    q.resize(int64_t(Hq) * T * D), k.resize(int64_t(Hkv) * T * D);
    rope_rows(qp, qs, Hq, T, D, tables, q.data());
    rope_rows(kp, ks, Hkv, T, D, tables, k.data());
    qp = q.data(), kp = k.data();
    qs = {int64_t(Hq) * T * D, int64_t(T) * D, D, 1};
    ks = {int64_t(Hkv) * T * D, int64_t(T) * D, D, 1};
  }
};

// A step op's eval_cpu up to its task: the output's buffer, the N pools'
// (take_pools), the encoder with every input and output bound. Returns the
// copies the task runs first.
template <size_t N>
std::array<PoolCopy, N> bind_step(mx::Stream stream, const std::vector<mx::array>& inputs,
                                  std::vector<mx::array>& outputs) {
  outputs[0].set_data(mx::allocator::malloc(outputs[0].nbytes()));
  const auto copy = take_pools<N>(inputs, outputs);
  auto& encoder = mx::cpu::get_command_encoder(stream);
  for (const auto& a : inputs) encoder.set_input_array(a);
  for (auto& a : outputs) encoder.set_output_array(a);
  return [&]<size_t... i>(std::index_sequence<i...>) {
    return std::array<PoolCopy, N>{PoolCopy(inputs[3 + i], outputs[1 + i], copy[i])...};
  }(std::make_index_sequence<N>{});
}

// A flat cache layer's step as one op: the step's keys and values written
// into the layer's pools at `position` (outputs 1 and 2, the input pools'
// buffers where nothing else holds them), then the queries attend to the
// pools' first position + T slots, causally when T > 1. The cache hands on
// the output pools as the layer's, so the next step's op reads them: the
// dependency MLX schedules by, as with slice_update.
class UpdateAndAttend : public CpuPrimitive<UpdateAndAttend, SharedPrimitive> {
 public:
  static constexpr const char* kName = "UpdateAndAttend";
  UpdateAndAttend(mx::Stream stream, float scale, int position, bool few_queries, bool rotary)
      : CpuPrimitive(stream), scale_(scale), position_(position), few_queries_(few_queries), rotary_(rotary) {}
  auto params() const { return std::tuple(scale_, position_, few_queries_, rotary_); }

  bool shares_work() const override { return few_queries_; }  // as FusedAttention's

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override {
    const auto &q = inputs[0], &k = inputs[1], &v = inputs[2], &kp = inputs[3];
    auto &out = outputs[0], &kout = outputs[1], &vout = outputs[2];
    const auto copies = bind_step<2>(stream(), inputs, outputs);
    auto& encoder = mx::cpu::get_command_encoder(stream());
    auto started = read_ahead_later(out, nullptr, 0);  // out: holding a pool would keep it from donation
    const int T = q.shape(2);
    const Geometry g{q.shape(0), q.shape(1), kp.shape(1), T, position_ + T, q.shape(3), T > 1, 0, scale_, q.strides()};
    const Strides4 k_stride = strides4(kout), v_stride = strides4(vout);
    const float* tables = rotary_ ? inputs[5].data<float>() : nullptr;
    with_kv_type(kp, [&](auto* type) {
      using KV = std::remove_const_t<std::remove_pointer_t<decltype(type)>>;
      encoder.dispatch([=, q = q.data<float>(), k = k.data<float>(), v = v.data<float>(), ks = k.strides(),
                        vs = v.strides(), kd = kout.data<KV>(), vd = vout.data<KV>(), o = out.data<float>(),
                        position = position_, g = g]() mutable {
        started->store(true, std::memory_order_relaxed);
        for (const auto& c : copies) c.run();
        const RotatedRows rope(tables, q, g.q, g.Hq, k, ks, g.Hkv, g.T, g.D);
        for (int h = 0; h < g.Hkv; ++h)
          for (int t = 0; t < g.T; ++t)
            for (int d = 0; d < g.D; ++d) {
              store(kd + h * k_stride[1] + (position + t) * k_stride[2] + d, k[h * ks[1] + t * ks[2] + d * ks[3]]);
              store(vd + h * v_stride[1] + (position + t) * v_stride[2] + d, v[h * vs[1] + t * vs[2] + d * vs[3]]);
            }
        attend(q, DenseRows<KV>{kd, k_stride}, DenseRows<KV>{vd, v_stride}, o, g);
      });
    });
  }

  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override {
    return {inputs[0].shape(), inputs[3].shape(), inputs[4].shape()};
  }

 private:
  float scale_;
  int position_;
  bool few_queries_;
  bool rotary_;  // a sixth input: the step's RoPE tables (rope_rows), applied to q and k first
};

// rotate_groups's transform of one group of n values, in double: a step's
// keys and values are rotated so before they are stored, and in double each
// value comes out as the exact rotation rounded once, to fp32 by the caller
// (numpy's float64 product, rounded so, gives the same bits). fp32
// butterflies round each of log2(n) passes, which changes the fp16 value
// stored for about one value in 1,500 (as MLX's fp32 product of
// quantized_kv.rotate does). A step's few rows make it cheap.
inline void rotate_group_exactly(double* x, int n) {
  for (int half = 1; half < n; half *= 2)
    for (int i = 0; i < n; i += 2 * half)
      for (int j = i; j < i + half; ++j) {
        const double a = x[j], b = x[j + half];
        x[j] = a + b, x[j + half] = a - b;
      }
  const double norm = 1.0 / std::sqrt(double(n));
  for (int i = 0; i < n; ++i) x[i] *= norm;
}

// One row of D fp16 values (held as floats) as mx.quantize(row, group_size,
// BITS) stores it, bit for bit: MLX's affine quantization as its CPU op
// computes it (fast::Quantize), each step in fp32 as there. Per group, the
// end of the larger magnitude (`edge`) is the bias, stored exactly, and the
// step is the range over 2^BITS - 1, negative where the edge is the max,
// refitted so that the edge is a whole number of steps from zero (where it
// is not 0 steps); each value is then rounded to its nearest step (ties to
// even) and clamped to [0, 2^BITS - 1]; scale and bias are stored in fp16.
template <int BITS>
void quantize_row(const float* row, int D, int group_size, uint32_t* words, Half* scales, Half* biases) {
  constexpr int kPerWord = 32 / BITS;
  const float n_bins = (1 << BITS) - 1, eps = 1e-7f;
  for (int g = 0; g < D / group_size; ++g) {
    const float* w = row + g * group_size;
    float w_min = INFINITY, w_max = -INFINITY;
    for (int j = 0; j < group_size; ++j) w_max = std::max(w_max, w[j]), w_min = std::min(w_min, w[j]);
    const bool min_edge = std::abs(w_min) > std::abs(w_max);
    float scale = std::max((w_max - w_min) / n_bins, eps);
    scale = min_edge ? scale : -scale;
    const float edge = min_edge ? w_min : w_max;
    const float q0 = std::rint(edge / scale);
    float bias = 0.0f;
    if (q0 != 0.0f) scale = edge / q0, bias = edge;
    for (int j = 0; j < group_size; j += kPerWord) {
      uint64_t word = 0;  // as MLX packs it
      for (int e = 0; e < kPerWord; ++e) {
        const float q = std::min(std::max(std::rint((w[j + e] - bias) / scale), 0.0f), n_bins);
        word |= static_cast<uint64_t>(q) << (e * BITS);
      }
      words[(g * group_size + j) / kPerWord] = uint32_t(word);
    }
    store(scales + g, scale), store(biases + g, bias);
  }
}

// Where a step's rows of one quantized pool go: the words, scales and
// biases of the op's output (row-contiguous: donated only so, else new).
struct QuantizedPool {
  uint32_t* words;
  Half *scales, *biases;
  Strides4 words_stride, groups_stride;  // the scales' and biases' (one shape)

  QuantizedPool(mx::array& words, mx::array& scales, mx::array& biases)
      : words(words.data<uint32_t>()), scales(static_cast<Half*>(scales.data<void>())),
        biases(static_cast<Half*>(biases.data<void>())), words_stride(strides4(words)),
        groups_stride(strides4(scales)) {}
};

// The T rows of x [1, Hkv, T, D] (fp32, any strides) rotated (where asked),
// rounded to fp16 and quantized into rows position .. position + T of the
// pool: mx.quantize(rotate(x).astype(float16)) there.
template <int BITS>
void quantize_step(const float* x, const mx::Strides& xs, const QuantizedPool& pool, int position, int Hkv, int T,
                   int D, int group_size, bool rotated) {
  std::vector<double> exact(D);
  std::vector<float> row(D);
  for (int h = 0; h < Hkv; ++h)
    for (int t = 0; t < T; ++t) {
      for (int d = 0; d < D; ++d) exact[d] = x[h * xs[1] + t * xs[2] + d * xs[3]];
      if (rotated)
        for (int d = 0; d < D; d += group_size) rotate_group_exactly(exact.data() + d, group_size);
      for (int d = 0; d < D; ++d) row[d] = float(mx::float16_t(float(exact[d])));
      const int64_t at = position + t;
      const int64_t groups = h * pool.groups_stride[1] + at * pool.groups_stride[2];
      quantize_row<BITS>(row.data(), D, group_size, pool.words + h * pool.words_stride[1] + at * pool.words_stride[2],
                         pool.scales + groups, pool.biases + groups);
    }
}

// UpdateAndAttend over a quantized cache: inputs q, k, v, then K's words,
// scales and biases, then V's (outputs 1 .. 6 the same, written); the step's
// rows quantized as quantize_step makes them, the attention QuantizedAttention's
// over the pools' first position + T rows.
class QuantizedUpdateAndAttend : public CpuPrimitive<QuantizedUpdateAndAttend, SharedPrimitive> {
 public:
  static constexpr const char* kName = "QuantizedUpdateAndAttend";
  QuantizedUpdateAndAttend(mx::Stream stream, float scale, int position, bool few_queries, int k_bits, int v_bits,
                           int group_size, bool rotated, bool rotary)
      : CpuPrimitive(stream), scale_(scale), position_(position), few_queries_(few_queries), k_bits_(k_bits),
        v_bits_(v_bits), group_size_(group_size), rotated_(rotated), rotary_(rotary) {}
  auto params() const {
    return std::tuple(scale_, position_, few_queries_, k_bits_, v_bits_, group_size_, rotated_, rotary_);
  }

  bool shares_work() const override { return few_queries_; }  // as FusedAttention's

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override {
    const auto &q = inputs[0], &k = inputs[1], &v = inputs[2];
    auto& out = outputs[0];
    const auto copies = bind_step<6>(stream(), inputs, outputs);
    auto& encoder = mx::cpu::get_command_encoder(stream());
    auto started = read_ahead_later(out, nullptr, 0);  // as UpdateAndAttend's
    const int T = q.shape(2), group = group_size_;
    const Geometry g{q.shape(0), q.shape(1), k.shape(1), T,           position_ + T,
                     q.shape(3), T > 1,      0,          scale_,      q.strides(),
                     rotated_ ? group : 0};
    const QuantizedPool kp(outputs[1], outputs[2], outputs[3]), vp(outputs[4], outputs[5], outputs[6]);
    const float* tables = rotary_ ? inputs[9].data<float>() : nullptr;
    with_bits(k_bits_, v_bits_, [&](auto k_bits, auto v_bits) {
      constexpr int KB = decltype(k_bits)::value, VB = decltype(v_bits)::value;
      const auto kr = quantized_rows<KB>(outputs[1], outputs[2], outputs[3], group);
      const auto vr = quantized_rows<VB>(outputs[4], outputs[5], outputs[6], group);
      encoder.dispatch([=, q = q.data<float>(), k = k.data<float>(), v = v.data<float>(), ks = k.strides(),
                        vs = v.strides(), o = out.data<float>(), position = position_, rotated = rotated_,
                        g = g]() mutable {
        started->store(true, std::memory_order_relaxed);
        for (const auto& c : copies) c.run();
        const RotatedRows rope(tables, q, g.q, g.Hq, k, ks, g.Hkv, g.T, g.D);
        quantize_step<KB>(k, ks, kp, position, g.Hkv, g.T, g.D, group, rotated);
        quantize_step<VB>(v, vs, vp, position, g.Hkv, g.T, g.D, group, rotated);
        attend(q, kr, vr, o, g);
      });
    });
  }

  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override {
    std::vector<mx::Shape> shapes{inputs[0].shape()};
    for (int i = 3; i < 9; ++i) shapes.push_back(inputs[i].shape());
    return shapes;
  }

 private:
  float scale_;
  int position_;
  bool few_queries_;
  int k_bits_, v_bits_, group_size_;
  bool rotated_;
  bool rotary_;  // a tenth input: the step's RoPE tables, as UpdateAndAttend's
};

}  // namespace

mx::array attention(const mx::array& q, const mx::array& k, const mx::array& v, float scale,
                    bool causal, int window, mx::StreamOrDevice s) {
  std::string err;
  if (q.ndim() != 4 || k.ndim() != 4 || v.ndim() != 4) {
    err = "q, k and v must be 4-D, got " + text(q.shape()) + ", " + text(k.shape()) + ", " + text(v.shape());
  } else if (q.dtype() != mx::float32 || k.dtype() != v.dtype() ||
             !is_one_of(k.dtype(), {mx::float32, mx::bfloat16, mx::float16})) {
    err = "q must be float32, k and v both float32, bfloat16 or float16";
  } else if (k.shape() != v.shape() || k.shape(0) != q.shape(0) || k.shape(3) != q.shape(3) ||
             k.shape(1) == 0 || q.shape(1) % k.shape(1) != 0) {
    err = "incompatible shapes q " + text(q.shape()) + ", k " + text(k.shape()) + ", v " + text(v.shape());
  } else if (k.shape(2) == 0) {
    err = "no keys to attend to";
  } else if (causal && q.shape(2) > k.shape(2)) {
    err = "causal attention with more queries than keys";
  } else if (window < 0) {
    err = "window must be 0 (none) or positive, got " + std::to_string(window);
  }
  const auto stream = cpu_stream("attention", err, s);
  return mx::array(q.shape(), mx::float32,
                   std::make_shared<FusedAttention>(stream, scale, causal, window, q.shape(2) < kTiledMinQueries),
                   {q, k, v});
}

// "" when one of K or V (words, scales, biases) is MLX's affine
// quantization of [B, Hkv, S, D] rows at `bits` bits in groups of
// `group_size`, else why not.
std::string check_quantized(const char* name, const mx::array& words, const mx::array& scales,
                            const mx::array& biases, int bits, int group_size, const mx::Shape& rows) {
  const std::string of = std::string(" (") + name + ")";
  if (words.ndim() != 4 || scales.ndim() != 4 || biases.ndim() != 4) {
    return "the words, scales and biases must be 4-D" + of;
  } else if (words.dtype() != mx::uint32 || scales.dtype() != mx::float16 || biases.dtype() != mx::float16) {
    return "the words must be uint32, the scales and biases float16" + of;
  } else if (bits != 4 && bits != 8) {
    return "bits must be 4 or 8, not " + std::to_string(bits) + of;
  }
  mx::Shape packed = rows, grouped = rows;
  packed[3] = rows[3] * bits / 32, grouped[3] = rows[3] / group_size;
  if (words.shape() != packed || scales.shape() != grouped || biases.shape() != grouped) {
    return "needs words " + text(packed) + " and scales, biases " + text(grouped) + ", got " + text(words.shape()) +
           ", " + text(scales.shape()) + ", " + text(biases.shape()) + of;
  }
  return "";
}

mx::array quantized_attention(const mx::array& q, const mx::array& k, const mx::array& k_scales,
                              const mx::array& k_biases, const mx::array& v, const mx::array& v_scales,
                              const mx::array& v_biases, float scale, bool causal, int k_bits, int v_bits,
                              int group_size, int window, bool rotated, mx::StreamOrDevice s) {
  std::string err;
  if (q.ndim() != 4 || q.dtype() != mx::float32 || k.ndim() != 4) {
    err = "q must be 4-D float32, k 4-D";
  } else if (group_size != 32 && group_size != 64 && group_size != 128) {
    err = "group_size must be 32, 64 or 128, not " + std::to_string(group_size);
  } else if (q.shape(3) % group_size != 0) {
    err = "head size " + std::to_string(q.shape(3)) + " is not a multiple of group_size " + std::to_string(group_size);
  } else if (k.shape(0) != q.shape(0) || k.shape(1) == 0 || q.shape(1) % k.shape(1) != 0) {
    err = "incompatible shapes q " + text(q.shape()) + ", k " + text(k.shape());
  } else if (k.shape(2) == 0) {
    err = "no keys to attend to";
  } else if (causal && q.shape(2) > k.shape(2)) {
    err = "causal attention with more queries than keys";
  } else if (window < 0) {
    err = "window must be 0 (none) or positive, got " + std::to_string(window);
  } else {
    const mx::Shape rows{k.shape(0), k.shape(1), k.shape(2), q.shape(3)};
    err = check_quantized("k", k, k_scales, k_biases, k_bits, group_size, rows);
    if (err.empty()) err = check_quantized("v", v, v_scales, v_biases, v_bits, group_size, rows);
  }
  const auto stream = cpu_stream("quantized_attention", err, s);
  return mx::array(q.shape(), mx::float32,
                   std::make_shared<QuantizedAttention>(stream, scale, causal, window, q.shape(2) < kTiledMinQueries,
                                                        k_bits, v_bits, group_size, rotated),
                   {q, k, k_scales, k_biases, v, v_scales, v_biases});
}

// "" where `rope` is none or the RoPE tables of q's T rows (rope_rows), else why not.
std::string check_rope(const std::optional<mx::array>& rope, const mx::array& q) {
  if (!rope) return "";
  const mx::Shape tables{2, q.shape(2), q.shape(3) / 2};
  if (q.shape(3) % 2 != 0) return "a rotary embedding needs an even head size, not " + std::to_string(q.shape(3));
  if (rope->dtype() != mx::float32 || rope->shape() != tables || !rope->flags().row_contiguous)
    return "the RoPE tables must be contiguous float32 " + text(tables) + ", got " + text(rope->shape());
  return "";
}

// q, k, v, the pools, and the RoPE tables where given.
std::vector<mx::array> step_inputs(std::vector<mx::array> inputs, const std::optional<mx::array>& rope) {
  if (rope) inputs.push_back(*rope);
  return inputs;
}

std::vector<mx::array> update_and_attend(const mx::array& q, const mx::array& k, const mx::array& v,
                                         const mx::array& k_pool, const mx::array& v_pool, int position, float scale,
                                         const std::optional<mx::array>& rope, mx::StreamOrDevice s) {
  std::string err;
  if (q.ndim() != 4 || k.ndim() != 4 || v.ndim() != 4 || k_pool.ndim() != 4 || v_pool.ndim() != 4) {
    err = "q, k, v and the pools must be 4-D";
  } else if (q.dtype() != mx::float32 || k.dtype() != mx::float32 || v.dtype() != mx::float32 ||
             k_pool.dtype() != v_pool.dtype() ||
             !is_one_of(k_pool.dtype(), {mx::float32, mx::bfloat16, mx::float16})) {
    err = "q, k and v must be float32, the pools both float32, bfloat16 or float16";
  } else if (q.shape(0) != 1 || k.shape() != v.shape() || k_pool.shape() != v_pool.shape() ||
             k.shape(0) != 1 || k_pool.shape(0) != 1 || k.shape(1) != k_pool.shape(1) ||
             k.shape(3) != k_pool.shape(3) || q.shape(3) != k.shape(3) || q.shape(2) != k.shape(2) ||
             k.shape(1) == 0 || q.shape(1) % k.shape(1) != 0 || q.shape(2) == 0) {
    err = "incompatible shapes q " + text(q.shape()) + ", k " + text(k.shape()) + ", v " + text(v.shape()) +
          ", pools " + text(k_pool.shape()) + ", " + text(v_pool.shape());
  } else if (position < 0 || int64_t(position) + q.shape(2) > k_pool.shape(2)) {
    err = "writing " + std::to_string(q.shape(2)) + " positions at " + std::to_string(position) + " overruns a pool of " +
          std::to_string(k_pool.shape(2));
  } else {
    err = check_rope(rope, q);
  }
  const auto stream = cpu_stream("update_and_attend", err, s);
  return mx::array::make_arrays(
      {q.shape(), k_pool.shape(), v_pool.shape()}, {mx::float32, k_pool.dtype(), v_pool.dtype()},
      std::make_shared<UpdateAndAttend>(stream, scale, position, q.shape(2) < kTiledMinQueries, rope.has_value()),
      step_inputs({q, k, v, k_pool, v_pool}, rope));
}

std::vector<mx::array> quantized_update_and_attend(const mx::array& q, const mx::array& k, const mx::array& v,
                                                   const mx::array& k_words, const mx::array& k_scales,
                                                   const mx::array& k_biases, const mx::array& v_words,
                                                   const mx::array& v_scales, const mx::array& v_biases, int position,
                                                   float scale, int k_bits, int v_bits, int group_size, bool rotated,
                                                   const std::optional<mx::array>& rope, mx::StreamOrDevice s) {
  std::string err;
  if (q.ndim() != 4 || k.ndim() != 4 || v.ndim() != 4) {
    err = "q, k and v must be 4-D";
  } else if (q.dtype() != mx::float32 || k.dtype() != mx::float32 || v.dtype() != mx::float32) {
    err = "q, k and v must be float32";
  } else if (group_size != 32 && group_size != 64 && group_size != 128) {
    err = "group_size must be 32, 64 or 128, not " + std::to_string(group_size);
  } else if (q.shape(0) != 1 || k.shape() != v.shape() || k.shape(0) != 1 || q.shape(3) != k.shape(3) ||
             q.shape(2) != k.shape(2) || k.shape(1) == 0 || q.shape(1) % k.shape(1) != 0 || q.shape(2) == 0) {
    err = "incompatible shapes q " + text(q.shape()) + ", k " + text(k.shape()) + ", v " + text(v.shape());
  } else if (q.shape(3) % group_size != 0) {
    err = "head size " + std::to_string(q.shape(3)) + " is not a multiple of group_size " + std::to_string(group_size);
  } else if (k_words.ndim() != 4) {
    err = "the pools must be 4-D";
  } else {
    const mx::Shape rows{1, k.shape(1), k_words.shape(2), k.shape(3)};
    err = check_quantized("k pool", k_words, k_scales, k_biases, k_bits, group_size, rows);
    if (err.empty()) err = check_quantized("v pool", v_words, v_scales, v_biases, v_bits, group_size, rows);
    if (err.empty() && (position < 0 || int64_t(position) + q.shape(2) > rows[2])) {
      err = "writing " + std::to_string(q.shape(2)) + " positions at " + std::to_string(position) +
            " overruns a pool of " + std::to_string(rows[2]);
    }
    if (err.empty()) err = check_rope(rope, q);
  }
  const auto stream = cpu_stream("quantized_update_and_attend", err, s);
  std::vector<mx::Shape> shapes{q.shape()};
  std::vector<mx::Dtype> dtypes{mx::float32};
  const std::vector<mx::array> pools{k_words, k_scales, k_biases, v_words, v_scales, v_biases};
  for (const auto& p : pools) shapes.push_back(p.shape()), dtypes.push_back(p.dtype());
  std::vector<mx::array> inputs{q, k, v};
  inputs.insert(inputs.end(), pools.begin(), pools.end());
  return mx::array::make_arrays(std::move(shapes), std::move(dtypes),
                                std::make_shared<QuantizedUpdateAndAttend>(stream, scale, position,
                                                                           q.shape(2) < kTiledMinQueries, k_bits,
                                                                           v_bits, group_size, rotated,
                                                                           rope.has_value()),
                                step_inputs(std::move(inputs), rope));
}

}  // namespace llm_pte
