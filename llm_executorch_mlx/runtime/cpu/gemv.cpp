// Few-row products (a decode step's linear layers, a short chunk's) on MLX's
// CPU stream, shared with the host thread (shared_work.cpp).
// A decode step reads every weight once in these products: 538 MB for
// SmolLM-135M in fp32, ~100 MB at 4 bits.
//
// extension.py builds this with attention.cpp into one extension module.

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <string>
#include <stdexcept>
#include <type_traits>
#include <unistd.h>
#include <vector>

#include "dense_amx.h"
#include "kernels.h"
#include "quantized_amx.h"
#include "quantized_dot.h"
#include "quantized_int8.h"
#include "quantized_interleaved.h"
#include "quantized_rows.h"
#include "mlx/backend/common/utils.h"
#include "mlx/ops.h"
#include "mlx/transforms.h"
#include "primitive.h"
#include "shared_work.h"
#include "simd.h"

// vdpbf16ps: products of bf16 weights with x rounded to bf16 (gemv's bf16_x)
#if defined(__AVX512BF16__)
#define LLM_PTE_BF16_DOT 1
#else
#define LLM_PTE_BF16_DOT 0
#endif

namespace llm_pte {
namespace {

// One product, as its SharedJob's task: y for W's rows.
struct Product {
  // a dense product (dense_rows): W fp32, or bf16 under fp32 compute, against
  // x_rows rows of x (contiguous, [x_rows, K]); y is [x_rows, N]
  const float* x;
  const void* w;
  float* y;
  int64_t K, N;
  int64_t w_row, w_col;  // strides of W [N, K] (W^T is the op's [K, N] operand)
  int x_rows;
  QuantizedRows q;  // a quantized product (quantized_rows) of q_rows rows of x
  int q_rows;
#if LLM_PTE_INTEGER_DOT
  Int8Rows i8;  // a quantized product with int8 activations (quantized_int8.h)
#endif
  // a dense product against bf16 weights with x rounded to bf16 (x then
  // holds the rounded values as fp32, for the loops the pairs do not cover)
  const uint16_t* xb = nullptr;
  // and its rows as AMX's B tiles (dense_amx.h), where they take them
  const uint32_t* xt = nullptr;
};

// Most rows of x a quantized product takes: a short chunk's, whose weights are
// read once (a longer chunk dequantizes them for BLAS, as the runtime's plan
// says: runtime/plan.py reads these limits through limits()).
constexpr int kQuantizedRows = 16;
// and of interleaved weights, whose products cost a row of x about half as
// much (quantized_interleaved.h): as many as a dense product takes.
constexpr int kInterleavedQuantizedRows = 128;

// The interleaved and int8 layouts exist only where the build has integer
// dot products (quantized_interleaved.h). Without them an op of those layouts
// is refused as it is made (check_interleaved with the factory's name, then
// require_layout in each op's constructor), and the paths below that only
// such an op would take raise rather than leave its output unwritten.
constexpr const char* kNoInterleavedLayout = "this build has no interleaved layout (no integer dot products)";

[[noreturn]] void refuse_interleaved() { throw std::invalid_argument(kNoInterleavedLayout); }

void require_layout(bool interleaved) {
  if (interleaved && kInterleavedRows == 0) refuse_interleaved();
}

// Most rows of x a dense product takes: a prefill chunk of the exports'
// default size. BLAS's sgemm repacks every weight for each call, so a few-row
// product costs it about what a whole chunk's does, and it reads a bf16
// weight only once widened. Against an fp32 weight, where on the way to 128
// rows sgemm gets ahead depends on the CPU: the runtime measures it
// (crossover.py).
constexpr int kDenseRows = 128;

// Weight rows a pass over R rows of x takes: R * C accumulators, C weight
// vectors and one of x must fit the vector registers, or the loop spills
// accumulators to the stack on every step. With AVX-512's 32, 3 and 4 rows
// of x take 6 weight rows (24 + 6 + 1: fewer loads an FMA than 4 x 4); with
// the 16 of AVX2 and NEON, 3 (12 + 3 + 1, where 4 x 4 spills). Fewer rows of
// x take 4, but one row (a decode step) takes all that fit, 8 (6 with 16
// registers): a pass then reads that many weight rows at once, and more
// reads in flight stream the weights from memory faster.
template <int R>
constexpr int kWeightRows =
#if defined(__AVX512F__)
    R >= 3 ? 6 : R == 2 ? 4 : 8;
#else
    R >= 3 ? 3 : R == 1 ? 6 : 4;
#endif

// The sums of R * C accumulators' lanes, row r's C into y + r * y_row: four at
// a time as sums4 where a row has them. Straight into y: results gathered in
// one array and copied out by rows would load across the stores that wrote
// them whenever C is not a multiple of four, and such a load waits for both.
template <int R, int C>
inline void store_sums(const f8* a, float* y, int64_t y_row) {
  for (int r = 0; r < R; ++r) {
    int i = 0;
    for (; i + 4 <= C; i += 4) sums4(a + r * C + i, y + r * y_row + i);
    for (; i < C; ++i) y[r * y_row + i] = sum8(a[r * C + i]);
  }
}

#if defined(__AVX512F__)
// store_sums for sixteen-lane accumulators: halves added into eight lanes
// first, a few instructions a sum where _mm512_reduce_add_ps takes three
// times as many, a cost a short row pays on every pass.
template <int R, int C>
inline void store_sums16(const __m512 (&a)[R][C], float* y, int64_t y_row) {
  f8 halves[R * C];
  for (int r = 0; r < R; ++r)
    for (int i = 0; i < C; ++i) {
      const __m256 sum = _mm256_add_ps(_mm512_castps512_ps256(a[r][i]),
                                       _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a[r][i]), 1)));
      std::memcpy(&halves[r * C + i], &sum, sizeof sum);
    }
  store_sums<R, C>(halves, y, y_row);
}
#endif

// y[r * y_row + i] = x_r . w_i over [0, k) for R rows of x (row stride K) and
// C weight rows w_i = w + i * w_row, for the returned k (the rest is the
// caller's): sixteen lanes where the build has AVX-512, eight otherwise. A
// bf16 weight widens as it is loaded, once for all R rows: with one row that
// halved the instructions per weight that made a bf16 decode compute-bound.
// `next` (weight rows ahead, at the same stride) is prefetched on the first
// pass over a chunk, into L2: its rows are too short for the hardware
// prefetcher to ramp up, and lines asked into L1 that far ahead are pushed
// out of it before they are read.
template <int R, int C, typename T>
int64_t dot_rows(const float* x, const T* w, int64_t w_row, int64_t K, float* y, int64_t y_row,
                 const T* next = nullptr) {
#if defined(__AVX512F__)
  const int64_t K16 = K / 16 * 16;
  __m512 a[R][C];
  for (int r = 0; r < R; ++r)
    for (int i = 0; i < C; ++i) a[r][i] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K16; k += 16) {
    if (next) {
      for (int i = 0; i < C; ++i) __builtin_prefetch(next + i * w_row + k, 0, 2);
    }
    __m512 v[C];
    for (int i = 0; i < C; ++i) v[i] = load16(w + i * w_row + k);
    for (int r = 0; r < R; ++r) {
      const __m512 xv = _mm512_loadu_ps(x + r * K + k);
      for (int i = 0; i < C; ++i) a[r][i] = _mm512_fmadd_ps(xv, v[i], a[r][i]);
    }
  }
  store_sums16<R, C>(a, y, y_row);
  return K16;
#else
  const int64_t K8 = K / 8 * 8;
  f8 a[R][C] = {};
  for (int64_t k = 0; k < K8; k += 8) {
    if (next) {
      for (int i = 0; i < C; ++i) __builtin_prefetch(next + i * w_row + k, 0, 2);
    }
    f8 v[C];
    for (int i = 0; i < C; ++i) v[i] = load8(w + i * w_row + k);
    for (int r = 0; r < R; ++r) {
      const f8 xv = load8(x + r * K + k);
      for (int i = 0; i < C; ++i) a[r][i] += xv * v[i];
    }
  }
  store_sums<R, C>(&a[0][0], y, y_row);
  return K8;
#endif
}

// How far ahead the first pass over a chunk prefetches weight rows: about
// four fp32 rows, or the same bytes of bf16 rows, in whole steps of C rows.
// A decode step's one-row pass prefetches too: a row's stream, a bf16 one
// above all, is too short for the hardware prefetcher alone to ramp up.
template <typename T, int C>
constexpr int64_t kPrefetchRows = std::max<int64_t>(C, 4 * sizeof(float) / sizeof(T) / C * C);

#if LLM_PTE_BF16_DOT
// dot_rows for bf16 weights and x rounded to bf16 (xb, row stride K): one
// vdpbf16ps multiplies sixteen pairs, twice an FMA's products, and the
// weights need no widening. Products are exact in fp32 and summed there, as
// an FMA's are.
template <int R, int C>
int64_t dot_rows_bf16(const uint16_t* xb, const uint16_t* w, int64_t w_row, int64_t K, float* y, int64_t y_row,
                      const uint16_t* next) {
  const int64_t K32 = K / 32 * 32;
  __m512 a[R][C];
  for (int r = 0; r < R; ++r)
    for (int i = 0; i < C; ++i) a[r][i] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K32; k += 32) {
    if (next) {
      for (int i = 0; i < C; ++i) __builtin_prefetch(next + i * w_row + k, 0, 2);
    }
    __m512bh v[C];
    for (int i = 0; i < C; ++i) v[i] = (__m512bh)_mm512_loadu_si512(w + i * w_row + k);
    for (int r = 0; r < R; ++r) {
      const __m512bh xv = (__m512bh)_mm512_loadu_si512(xb + r * K + k);
      for (int i = 0; i < C; ++i) a[r][i] = _mm512_dpbf16_ps(a[r][i], xv, v[i]);
    }
  }
  store_sums16<R, C>(a, y, y_row);
  return K32;
}
#endif

// x rounded to bf16, to nearest even as torch's conversion does (denormals
// included, which vcvtneps2bf16 would flush): the bf16 values (xb) and the
// same values as fp32 (rounded). NaN stays NaN.
void round_to_bf16(const float* x, int64_t n, uint16_t* xb, float* rounded) {
  int64_t i = 0;
#if LLM_PTE_BF16_DOT
  const __m512i one = _mm512_set1_epi32(1), half = _mm512_set1_epi32(0x7fff), quiet = _mm512_set1_epi32(0x00400000);
  const __m512i magnitude = _mm512_set1_epi32(0x7fffffff), inf = _mm512_set1_epi32(0x7f800000);
  for (; i + 16 <= n; i += 16) {
    const __m512i bits = _mm512_loadu_si512(x + i);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), one);
    __m512i top = _mm512_add_epi32(bits, _mm512_add_epi32(half, lsb));
    const __mmask16 nan = _mm512_cmpgt_epu32_mask(_mm512_and_si512(bits, magnitude), inf);
    top = _mm512_srli_epi32(_mm512_mask_mov_epi32(top, nan, _mm512_or_si512(bits, quiet)), 16);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(xb + i), _mm512_cvtepi32_epi16(top));
    _mm512_storeu_si512(rounded + i, _mm512_slli_epi32(top, 16));
  }
#endif
  for (; i < n; ++i) {
    uint32_t bits;
    std::memcpy(&bits, x + i, sizeof bits);
    const bool nan = (bits & 0x7fffffffu) > 0x7f800000u;
    const uint32_t top = nan ? (bits | 0x00400000u) >> 16 : (bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16;
    xb[i] = uint16_t(top);
    const uint32_t back = top << 16;
    std::memcpy(rounded + i, &back, sizeof back);
  }
}

// y[r, n] = W[n, :] . x[r, :] for rows n in [lo, hi) and R rows of x, C
// weight rows at a time (rows contiguous), then the last few one by one.
template <int R, typename T>
void dense_block(const Product& j, const float* x, float* y, int64_t lo, int64_t hi, bool first_pass) {
  constexpr int C = kWeightRows<R>;
  constexpr int64_t ahead = kPrefetchRows<T, C>;
  const int64_t K = j.K;
  const T* W = static_cast<const T*>(j.w);
  int64_t n = lo;
  for (; n + C <= hi; n += C) {
    const T* w = W + n * j.w_row;
    float* out = y + n;  // row r's C results at out + r * j.N
    const bool fetch = first_pass && n + ahead + C <= j.N;
    const T* next = fetch ? w + ahead * j.w_row : nullptr;
    int64_t done;
#if LLM_PTE_BF16_DOT
    if constexpr (std::is_same_v<T, uint16_t>) {
      done = j.xb ? dot_rows_bf16<R, C>(j.xb + (x - j.x), w, j.w_row, K, out, j.N, next)
                  : dot_rows<R, C>(x, w, j.w_row, K, out, j.N, next);
    } else {
      done = dot_rows<R, C>(x, w, j.w_row, K, out, j.N, next);
    }
#else
    done = dot_rows<R, C>(x, w, j.w_row, K, out, j.N, next);
#endif
    for (int r = 0; r < R; ++r) {
      const float* xr = x + r * K;
      for (int i = 0; i < C; ++i) {
        const T* wi = w + i * j.w_row;
        for (int64_t k = done; k < K; ++k) out[r * j.N + i] += widen(wi[k]) * xr[k];
      }
    }
  }
  const int64_t K8 = K / 8 * 8;
  for (; n < hi; ++n) {
    const T* w = W + n * j.w_row;
    for (int r = 0; r < R; ++r) {
      const float* xr = x + r * K;
      f8 a = {};
      int64_t k = 0;
      for (; k < K8; k += 8) a += load8(xr + k) * load8(w + k);
      float s = sum8(a);
      for (; k < K; ++k) s += widen(w[k]) * xr[k];
      y[r * j.N + n] = s;
    }
  }
}

// Weight rows a chunk of a many-row product holds: whole steps of every
// pass's C (3, 4 or 6).
constexpr int64_t kDenseChunkRows = 24;

// A core's L1 data cache (48 KB on recent Intel cores, 32 KB on AMD's and
// older ones; 32 KB where the system does not say).
inline int64_t l1_data_bytes() {
  static const int64_t bytes = [] {
#if defined(_SC_LEVEL1_DCACHE_SIZE)
    const long size = sysconf(_SC_LEVEL1_DCACHE_SIZE);
    if (size > 0) return int64_t(size);
#endif
    return int64_t(32 * 1024);
  }();
  return bytes;
}

// y = x W^T for W's rows [lo, hi): up to 4 rows of x per pass over those
// weight rows (the accumulators then fit the registers); more rows take more
// passes, which find the rows in cache. A plain strided loop where W's rows
// are not contiguous (layout.py leaves linear weights contiguous when this
// op runs them). T: float, or uint16_t for bf16 weights, widened as they are
// loaded (exactly: a bf16 is the top half of an fp32).
template <typename T>
void dense_product_rows(const Product& j, int64_t lo, int64_t hi) {
#if LLM_PTE_BF16_TILES
  if (j.xt) {
    // every row of x against whole blocks of 16 weight rows on the tiles;
    // the last few weight rows below
    const int64_t tiled = lo + (hi - lo) / kBf16Tile * kBf16Tile;
    bf16_tile_product(static_cast<const uint16_t*>(j.w), j.w_row, j.K, j.xt, j.x_rows, j.y, j.N, lo, tiled);
    Product last = j;
    last.xt = nullptr;
    if (tiled < hi) dense_product_rows<T>(last, tiled, hi);
    return;
  }
#endif
  const T* W = static_cast<const T*>(j.w);
  if (j.w_col != 1) {
    for (int r = 0; r < j.x_rows; ++r) {
      for (int64_t n = lo; n < hi; ++n) {
        float s = 0.f;
        for (int64_t k = 0; k < j.K; ++k) s += widen(W[n * j.w_row + k * j.w_col]) * j.x[r * j.K + k];
        j.y[r * j.N + n] = s;
      }
    }
    return;
  }
  // With bf16 dot products (x rounded to bf16), which multiply twice as
  // fast as FMAs, passes of 4 rows of x go over one pass's weight rows (C)
  // with every such row of x before the next C where those rows and the 4
  // rows of x fit L1 together (a 2048-wide weight's in 48 KB): read over the
  // whole chunk from L2, they held the dot instructions back; where they do
  // not fit, they push each other out of L1 and the chunk's passes are
  // faster. Elsewhere (and the last 1-3 rows of x) a pass
  // takes the chunk, where the widening loads are the bound and fewer, longer
  // passes cost less. Each output is the same sum either way.
  const int fours = j.x_rows / 4 * 4;
  constexpr int64_t panel = kWeightRows<4>;
  const bool in_l1 = j.xb && fours > 4 && (panel + 4) * j.K * int64_t(sizeof(T)) <= l1_data_bytes();
  const int64_t step = in_l1 ? panel : hi - lo;
  for (int64_t n0 = lo; n0 < hi; n0 += step) {
    for (int r = 0; r < fours; r += 4) {
      dense_block<4, T>(j, j.x + r * j.K, j.y + r * j.N, n0, std::min(hi, n0 + step), r == 0);
    }
  }
  const float* x = j.x + fours * j.K;
  float* y = j.y + fours * j.N;
  switch (j.x_rows - fours) {
    case 1: dense_block<1, T>(j, x, y, lo, hi, fours == 0); break;
    case 2: dense_block<2, T>(j, x, y, lo, hi, fours == 0); break;
    case 3: dense_block<3, T>(j, x, y, lo, hi, fours == 0); break;
  }
}

// Products of one x (a decode step's linear layer, or a layer's q, k and v
// and its gate and up together), as one SharedJob's task: its chunks, each
// rows of one product.
struct Products {
  std::vector<Product> each;
  std::vector<std::pair<int, int64_t>> chunks;  // (product, first row)
  std::vector<int64_t> chunk_rows;  // per product

  // A quantized product's N rows in chunks of ~128 KB of packed weights, in
  // whole `unit`s of rows: as the fp32 product's chunks, each a stream long
  // enough for the prefetcher to pick up, and still several for each thread.
  void chunk_weights(int i, int64_t N, int64_t row_bytes, int64_t unit) {
    const int64_t rows = std::max<int64_t>(unit, 131072 / std::max<int64_t>(row_bytes, 1) / unit * unit);
    chunk_rows.push_back(rows);
    for (int64_t first = 0; first < N; first += rows) chunks.emplace_back(i, first);
  }
};

template <typename T>
void dense_chunks(const SharedJob& job, int64_t lo, int64_t hi) {
  const Products& t = *static_cast<const Products*>(job.task);
  for (int64_t c = lo; c < hi; ++c) {
    const auto [i, first] = t.chunks[c];
    dense_product_rows<T>(t.each[i], first, std::min(t.each[i].N, first + t.chunk_rows[i]));
  }
}

// The quantized kernel this build has: integer dot products on x86
// (quantized_dot.h), float FMAs elsewhere (quantized_rows.h).
template <int BITS, int M>
void quantized_rows_here(const QuantizedRows& r, int64_t lo, int64_t hi) {
#if LLM_PTE_INTEGER_DOT
  if (r.interleaved) interleaved_rows<BITS, M>(r, lo, hi);
  else quantized_rows_integer<BITS, M>(r, lo, hi);
#else
  quantized_rows<BITS, M>(r, lo, hi);
#endif
}

// Up to 4 rows of x per pass over a chunk of weight rows (the accumulators
// then fit the registers); more rows take more passes over the same chunk,
// which the first pass left in cache.
template <int BITS>
void quantized_product_rows(const Product& j, int64_t lo, int64_t hi) {
  const int64_t groups = j.q.K / j.q.group;
  for (int m = 0; m < j.q_rows; m += 4) {
    QuantizedRows r = j.q;
    r.xsum += m * groups, r.y += m * r.N;
    if (r.xp) r.xp += m * r.K;
#if LLM_PTE_INTEGER_DOT
    if (r.xq) r.xq += m * r.K, r.xd += m * (r.K / integer_span(r.interleaved ? 8 : BITS, r.group)) * kLanes32;
#endif
    switch (std::min(4, j.q_rows - m)) {
      case 1: quantized_rows_here<BITS, 1>(r, lo, hi); break;
      case 2: quantized_rows_here<BITS, 2>(r, lo, hi); break;
      case 3: quantized_rows_here<BITS, 3>(r, lo, hi); break;
      default: quantized_rows_here<BITS, 4>(r, lo, hi);
    }
  }
}

#if LLM_PTE_INTEGER_DOT
template <int BITS>
void int8_chunks(const SharedJob& job, int64_t lo, int64_t hi) {
  const Products& t = *static_cast<const Products*>(job.task);
  for (int64_t c = lo; c < hi; ++c) {
    const auto [i, first] = t.chunks[c];
    const Int8Rows& r = t.each[i].i8;
    const int64_t last = std::min(r.N, first + t.chunk_rows[i]);
    int8_rows<BITS>(r, first, last, amx_rows<BITS>(r, first, last));  // AMX's whole tiles first, where built
  }
}
#endif

template <int BITS>
void quantized_chunks(const SharedJob& job, int64_t lo, int64_t hi) {
  const Products& t = *static_cast<const Products*>(job.task);
  for (int64_t c = lo; c < hi; ++c) {
    const auto [i, first] = t.chunks[c];
    quantized_product_rows<BITS>(t.each[i], first, std::min(t.each[i].q.N, first + t.chunk_rows[i]));
  }
}

// y += a for a of y's shape (y contiguous, a any strides): a residual that
// the product's own op adds, rounded as the separate add rounds.
void add_into(float* y, const mx::array& a) {
  const float* p = a.data<float>();
  const int64_t n = int64_t(a.size());
  if (a.flags().row_contiguous) {
    for (int64_t e = 0; e < n; ++e) y[e] += p[e];
  } else {
    for (int64_t e = 0; e < n; ++e) y[e] += p[mx::elem_to_loc(e, a)];
  }
}

#if LLM_PTE_INTEGER_DOT
// A quads weight's scales and biases as interleave_quantized(int8=True) made
// them (check_quantized's quads).
QuadScales quad_scales_of(const mx::array& scales, const mx::array& biases) {
  return {scales.data<void>(), biases.size() ? biases.data<void>() : nullptr, scales.dtype() == mx::float16};
}
#endif

// x @ W^T run in chunks shared with the host thread: W fp32 ([K, N] as the
// op's operand), or affine-quantized as MLX stores it (bits > 0: W [N, K]
// packed, with scales and biases). adds: one product, plus its last input
// (of the product's shape) added once the product is done.
class SharedGemv : public CpuPrimitive<SharedGemv, SharedPrimitive> {
 public:
  static constexpr const char* kName = "SharedGemv";
  SharedGemv(mx::Stream stream, int bits = 0, int group = 0, bool helped = true, bool interleaved = false,
             bool int8 = false, bool adds = false, bool bf16_x = false)
      : CpuPrimitive(stream), bits_(bits), group_(group), helped_(helped), interleaved_(interleaved), int8_(int8),
        adds_(adds), bf16_x_(bf16_x) {
    require_layout(interleaved || int8);
  }
  auto params() const { return std::tuple(bits_, group_, helped_, interleaved_, int8_, adds_, bf16_x_); }

  bool adds() const { return adds_; }
  std::shared_ptr<SharedGemv> adding() {
    return std::make_shared<SharedGemv>(stream(), bits_, group_, helped_, interleaved_, int8_, true, bf16_x_);
  }

  // not helped: a long prefill chunk's LM head row, whose graph is better
  // queued whole, the host sleeping, than taking a core from BLAS's threads
  bool shares_work() const override { return helped_; }

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override {
    if (bits_) return eval_quantized(inputs, outputs);
    const auto& x = inputs[0];
    auto& encoder = bind(inputs, outputs);
    const int n = int(outputs.size());
    const int64_t K = x.shape(-1), M = x.size() / K;
    std::vector<Product> each(n);
    std::vector<std::shared_ptr<std::atomic<bool>>> started;
    for (int i = 0; i < n; ++i) {
      const auto& w = inputs[1 + i];
      auto& out = outputs[i];
      const int64_t N = w.shape(1), w_row = w.strides(1), w_col = w.strides(0);
      each[i] = Product{nullptr, w.data<void>(), out.data<float>(), K, N, w_row, w_col, int(M), {}, 0};
      // rows contiguous: the weights are one span, which the host may read ahead
      const int64_t span = w_col == 1 ? ((N - 1) * w_row + K) * int64_t(w.itemsize()) : 0;
      started.push_back(read_ahead_later(w, w.data<void>(), span));
    }
    const bool bf16 = inputs[1].dtype() == mx::bfloat16;
    const float* xp = x.data<float>();
    const int64_t x_col = x.strides().back(), x_row = x.ndim() >= 2 ? x.strides(-2) : K;
    const std::optional<mx::array> addend = adds_ ? std::optional(inputs.back()) : std::nullopt;
    const bool bf16_x = bf16_x_;  // the task may run after this primitive is gone: no member in it
    bool rows_contiguous = true;
    for (const auto& p : each) rows_contiguous = rows_contiguous && p.w_col == 1;
    encoder.dispatch([=]() mutable {
      for (auto& flag : started) flag->store(true, std::memory_order_relaxed);
      std::vector<float> packed;  // x's rows, contiguous
      const float* xs = xp;
      if (x_col != 1 || (M > 1 && x_row != K)) {
        packed.resize(M * K);
        for (int64_t m = 0; m < M; ++m)
          for (int64_t k = 0; k < K; ++k) packed[m * K + k] = xp[m * x_row + k * x_col];
        xs = packed.data();
      }
      // x rounded to bf16, where bf16_x; kept between calls, which would
      // otherwise each zero and fault in a few hundred KB
      thread_local std::vector<uint16_t> xb;
      thread_local std::vector<float> rounded;
      if (bf16_x) {
        if (xb.size() < size_t(M * K)) xb.resize(M * K), rounded.resize(M * K);
        round_to_bf16(xs, M * K, xb.data(), rounded.data());
        xs = rounded.data();
      }
      // x's rows as AMX's tiles of 16, where the build and the CPU have them
      thread_local std::vector<uint32_t> xt;
      const bool tiled = bf16_x && rows_contiguous && bf16_tiles_take(M, K);
#if LLM_PTE_BF16_TILES
      if (tiled) {
        if (xt.size() < size_t(bf16_tile_span(int(M)) * K / 2)) xt.resize(bf16_tile_span(int(M)) * K / 2);
        bf16_tile_x(xb.data(), K, int(M), xt.data());
      }
#endif
      Products task{each, {}, {}};
      // one row of x: ~64k weights (256 KB of fp32) a chunk, whole passes
      // of its C rows: each chunk is a stream the hardware prefetcher must pick
      // up anew, so a chunk is as long as still leaves a few for each thread
      // in a 576-row product. More rows: 24 weight rows a chunk, which each
      // pass over x's rows finds in cache and whose next rows the first pass
      // prefetches; fewer rows a chunk would spend the passes on restarts.
      constexpr int64_t one = kWeightRows<1>;
      // On the tiles: two blocks of 16 weight rows a chunk.
      const int64_t rows = tiled ? 2 * 16 : M > 1 ? kDenseChunkRows : std::max<int64_t>(one, 65536 / std::max<int64_t>(K, 1) / one * one);
      for (int i = 0; i < n; ++i) {
        task.each[i].x = xs;
        task.each[i].xb = bf16_x ? xb.data() : nullptr;
        task.each[i].xt = tiled ? xt.data() : nullptr;
        task.chunk_rows.push_back(rows);
        for (int64_t first = 0; first < each[i].N; first += rows) task.chunks.emplace_back(i, first);
      }
      SharedJob j(bf16 ? dense_chunks<uint16_t> : dense_chunks<float>, &task, int64_t(task.chunks.size()), 1);
      run_shared(j);
      if (addend) add_into(each[0].y, *addend);
    });
  }

  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override {
    std::vector<mx::Shape> shapes;
    for (size_t i = 1; i < inputs.size() - (adds_ ? 1 : 0); i += bits_ ? 3 : 1) {
      auto shape = inputs[0].shape();
      shape.back() = bits_ ? inputs[i].shape(0) : inputs[i].shape(1);
      shapes.push_back(shape);
    }
    return shapes;
  }

 private:
  int bits_, group_;
  bool helped_, interleaved_, int8_, adds_, bf16_x_;

  // A quantized op's operands (inputs: x, then w, scales, biases per
  // product) bound, each output allocated and handed to `describe(i, w,
  // scales, biases, out)`; each weight's read-ahead flag.
  template <typename Describe>
  std::vector<std::shared_ptr<std::atomic<bool>>> bind_quantized(const std::vector<mx::array>& inputs,
                                                                 std::vector<mx::array>& outputs, Describe describe) {
    bind(inputs, outputs);
    std::vector<std::shared_ptr<std::atomic<bool>>> started;
    for (size_t i = 0; i < outputs.size(); ++i) {
      const auto &w = inputs[1 + 3 * i], &scales = inputs[2 + 3 * i], &biases = inputs[3 + 3 * i];
      describe(int(i), w, scales, biases, outputs[i]);
      started.push_back(read_ahead_later(w, w.data<void>(), w.nbytes()));
    }
    return started;
  }

  // x [..., M, K] (M <= kQuantizedRows) against each W [N, K] stored as MLX's
  // affine quantization (inputs: x, then w, scales, biases per product), read
  // as stored (quantized_dot.h, quantized_rows.h); x is prepared once.
  void eval_quantized(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) {
#if LLM_PTE_INTEGER_DOT
    if (int8_) return eval_int8(inputs, outputs);
#else
    if (interleaved_ || int8_) refuse_interleaved();
#endif
    const auto& x = inputs[0];
    const int64_t K = x.shape(-1), M = x.size() / K;
    std::vector<Product> each(outputs.size());
    const auto started = bind_quantized(inputs, outputs, [&](int i, const mx::array& w, const mx::array& scales,
                                                             const mx::array& biases, mx::array& out) {
      each[i].q = {w.data<uint32_t>(), scales.data<float>(), biases.data<float>(), nullptr, nullptr, nullptr,
                   nullptr, out.data<float>(), K, w.shape(0), group_, interleaved_};
      each[i].q_rows = int(M);
    });
    const int n = int(outputs.size());
    auto& encoder = mx::cpu::get_command_encoder(stream());
    const int64_t x_col = x.strides().back(), x_row = x.ndim() >= 2 ? x.strides(-2) : K;
    const float* xp = x.data<float>();
    const int bits = bits_, group = group_;
    const bool interleaved = interleaved_;
    const std::optional<mx::array> addend = adds_ ? std::optional(inputs.back()) : std::nullopt;
    encoder.dispatch([=]() mutable {
      for (auto& flag : started) flag->store(true, std::memory_order_relaxed);
      std::vector<float> sums(M * (K / group));
#if LLM_PTE_INTEGER_DOT
      std::vector<int16_t> rounded(M * K);
      const int x_bits = interleaved ? 8 : bits;  // interleaved weights take x in natural order
      std::vector<float> steps(M * (K / integer_span(x_bits, group)) * kLanes32);
      (x_bits == 4 ? prepare_x<4> : prepare_x<8>)(xp, x_row, x_col, int(M), K, group, rounded.data(), steps.data(),
                                                  sums.data());
      for (auto& p : each) p.q.xsum = sums.data(), p.q.xq = rounded.data(), p.q.xd = steps.data();
#else
      std::vector<float> permuted(M * K);
      permute_x(xp, x_row, x_col, int(M), K, bits, group, permuted.data(), sums.data());
      for (auto& p : each) p.q.xsum = sums.data(), p.q.xp = permuted.data();
#endif
      Products task{each, {}, {}};
      for (int i = 0; i < n; ++i) task.chunk_weights(i, each[i].q.N, K * bits / 8, interleaved ? kInterleavedRows : 4);
      SharedJob j(bits == 4 ? quantized_chunks<4> : quantized_chunks<8>, &task, int64_t(task.chunks.size()), 1);
      run_shared(j);
      if (addend) add_into(each[0].q.y, *addend);
    });
  }

#if LLM_PTE_INTEGER_DOT
  // The same products with x rounded to int8 (quantized_int8.h), weights in
  // the quads layout, any number of rows of x.
  void eval_int8(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) {
    const auto& x = inputs[0];
    const int64_t K = x.shape(-1), M = x.size() / K;
    std::vector<Product> each(outputs.size());
    const auto started = bind_quantized(inputs, outputs, [&](int i, const mx::array& w, const mx::array& scales,
                                                             const mx::array& biases, mx::array& out) {
      each[i].i8 = {reinterpret_cast<const uint8_t*>(w.data<uint32_t>()), quad_scales_of(scales, biases), nullptr,
                    nullptr, nullptr, out.data<float>(), K, w.shape(0), group_, int(M)};
    });
    const int n = int(outputs.size());
    auto& encoder = mx::cpu::get_command_encoder(stream());
    const int64_t x_col = x.strides().back(), x_row = x.ndim() >= 2 ? x.strides(-2) : K;
    const float* xp = x.data<float>();
    const int bits = bits_, group = group_;
    const std::optional<mx::array> addend = adds_ ? std::optional(inputs.back()) : std::nullopt;
    encoder.dispatch([=]() mutable {
      for (auto& flag : started) flag->store(true, std::memory_order_relaxed);
      std::vector<int8_t> rounded(M * K);
      std::vector<float> steps(M * (K / group)), sums(M * (K / group));
      prepare_x8(xp, x_row, x_col, int(M), K, group, rounded.data(), steps.data(), sums.data());
      for (auto& p : each) p.i8.xq = rounded.data(), p.i8.xd = steps.data(), p.i8.xsum = sums.data();
      Products task{each, {}, {}};
      const int64_t unit = (M == 1 ? 1 : kTileBlocks) * kLanes32;  // whole tiles of blocks (int8_rows)
      for (int i = 0; i < n; ++i) task.chunk_weights(i, each[i].i8.N, K * bits / 8, unit);
      SharedJob j(bits == 4 ? int8_chunks<4> : int8_chunks<8>, &task, int64_t(task.chunks.size()), 1);
      run_shared(j);
      if (addend) add_into(each[0].i8.y, *addend);
    });
  }
#endif
};

}  // namespace

std::vector<mx::array> gemvs(const mx::array& x, const std::vector<mx::array>& ws, bool helped, bool bf16_x,
                             mx::StreamOrDevice s) {
  std::string err;
  const int64_t K = x.ndim() ? x.shape(-1) : 0;
  if (x.dtype() != mx::float32) {
    err = "x must be float32";
  } else if (ws.empty()) {
    err = "needs one or more weights";
  } else if (x.ndim() < 1 || K == 0 || x.size() / K > kDenseRows || (x.ndim() > 2 && x.size() != K * x.shape(-2))) {
    err = "needs x [..., M, K] with M <= " + std::to_string(kDenseRows) + " rows in its last two axes, got " +
          text(x.shape());
  }
  for (size_t i = 0; err.empty() && i < ws.size(); ++i) {
    const auto& w = ws[i];
    if (!is_one_of(w.dtype(), {mx::float32, mx::bfloat16}) || w.dtype() != ws[0].dtype()) {
      err = "the weights must be all float32 or all bfloat16";
    } else if (w.ndim() != 2 || w.shape(0) != K) {
      err = "needs each w [K, N] with K " + std::to_string(K) + " (x's last axis), got " + text(w.shape());
    }
  }
  if (err.empty() && bf16_x && !LLM_PTE_BF16_DOT) {
    err = "this build has no bf16 dot products (AVX512_BF16) for bf16_x";
  } else if (err.empty() && bf16_x && ws[0].dtype() != mx::bfloat16) {
    err = "bf16_x rounds x for bfloat16 weights only";
  }
  const auto stream = cpu_stream("gemv", err, s);
  std::vector<mx::Shape> shapes;
  std::vector<mx::array> inputs{x};
  for (const auto& w : ws) {
    auto shape = x.shape();
    shape.back() = w.shape(1);
    shapes.push_back(shape);
    inputs.push_back(w);
  }
  return mx::array::make_arrays(shapes, std::vector<mx::Dtype>(ws.size(), mx::float32),
                                std::make_shared<SharedGemv>(stream, 0, 0, helped, false, false, false, bf16_x),
                                inputs);
}

mx::array gemv(const mx::array& x, const mx::array& w, bool helped, bool bf16_x, mx::StreamOrDevice s) {
  return gemvs(x, {w}, helped, bf16_x, s)[0];
}

std::optional<mx::array> add_to_product(const mx::array& product, const mx::array& addend) {
  if (!product.has_primitive() || product.is_available() || !product.siblings().empty() ||
      product.dtype() != mx::float32 || addend.dtype() != mx::float32 || addend.shape() != product.shape()) {
    return std::nullopt;
  }
  auto* gemv = dynamic_cast<SharedGemv*>(&product.primitive());
  if (gemv == nullptr || gemv->adds()) return std::nullopt;
  auto inputs = product.inputs();
  inputs.push_back(addend);
  return mx::array(product.shape(), mx::float32, gemv->adding(), std::move(inputs));
}

bool takes(const std::vector<int>& allowed, int value) {
  return std::find(allowed.begin(), allowed.end(), value) != allowed.end();
}

// The checks quantized_gemv and dequantize share: "" when w, scales, biases
// are a layout the row loops read. quads: as interleave_quantized(int8=True)
// stores them (QuadScales): scales fp32 or fp16, biases of their dtype or
// none (symmetric).
std::string check_quantized(const mx::array& w, const mx::array& scales, const mx::array& biases, int64_t K,
                            int group_size, int bits, bool quads = false) {
  const bool symmetric = quads && biases.size() == 0;
  if (quads && (w.dtype() != mx::uint32 || !is_one_of(scales.dtype(), {mx::float32, mx::float16}) ||
                (!symmetric && biases.dtype() != scales.dtype()))) {
    return "needs w uint32, scales float32 or float16 and biases of their dtype or none";
  } else if (quads && scales.dtype() == mx::float16 && !kHalfScales) {
    return "this build cannot widen float16 scales (no F16C)";
  } else if (!quads && (w.dtype() != mx::uint32 || scales.dtype() != mx::float32 || biases.dtype() != mx::float32)) {
    return "scales and biases must be float32 and w uint32";
  } else if (!takes(limits().quantized_bits, bits)) {
    return "bits must be 4 or 8, not " + std::to_string(bits);
  } else if (!takes(limits().quantized_groups, group_size)) {
    return "group_size must be 32, 64 or 128, not " + std::to_string(group_size);
  } else if (w.ndim() != 2 || K == 0 || w.shape(1) * 32 / bits != K || K % group_size ||
             K % block_values(bits) || scales.shape() != mx::Shape{w.shape(0), int(K / group_size)} ||
             (!symmetric && biases.shape() != scales.shape())) {
    return "needs x [..., K], w [N, K * bits / 32] and scales, biases [N, K / group_size] with K a multiple of " +
           std::to_string(block_values(bits)) + ", got K " + std::to_string(K) + ", w " + text(w.shape()) +
           ", scales " + text(scales.shape()) + ", biases " + text(biases.shape());
  } else if (!w.flags().row_contiguous || !scales.flags().row_contiguous || !biases.flags().row_contiguous) {
    return "w, scales and biases must be row-contiguous";
  }
  return "";
}

// "" when w (N rows) can be or is interleaved here.
std::string check_interleaved(const mx::array& w) {
  if (kInterleavedRows == 0) return kNoInterleavedLayout;
  if (w.shape(0) % kInterleavedRows) {
    return "interleaved weights need a multiple of " + std::to_string(kInterleavedRows) + " rows, not " +
           std::to_string(w.shape(0));
  }
  return "";
}

std::vector<mx::array> quantized_gemvs(const mx::array& x, const std::vector<mx::array>& ws,
                                       const std::vector<mx::array>& scales, const std::vector<mx::array>& biases,
                                       int group_size, int bits, bool interleaved, bool int8, mx::StreamOrDevice s) {
  std::string err;
  const int64_t K = x.ndim() ? x.shape(-1) : 0;
  const int64_t most = int8          ? std::numeric_limits<int>::max()
                       : interleaved ? kInterleavedQuantizedRows
                                     : kQuantizedRows;
  if (x.dtype() != mx::float32) {
    err = "x must be float32";
  } else if (ws.empty() || scales.size() != ws.size() || biases.size() != ws.size()) {
    err = "needs one or more weights, each with its scales and biases";
  } else if (K == 0 || x.size() / K > most || (x.ndim() > 2 && x.size() / K != x.shape(-2) && x.size() != K)) {
    err = "takes x [..., M, K] with " + (int8 ? std::string("its") : "at most " + std::to_string(most)) +
          " rows in its last two axes, got " + text(x.shape());
  }
  for (size_t i = 0; err.empty() && i < ws.size(); ++i) {
    err = check_quantized(ws[i], scales[i], biases[i], K, group_size, bits, int8);
    if (err.empty() && (interleaved || int8)) err = check_interleaved(ws[i]);
  }
  const auto stream = cpu_stream("quantized_gemv", err, s);
  std::vector<mx::Shape> shapes;
  std::vector<mx::array> inputs{x};
  for (size_t i = 0; i < ws.size(); ++i) {
    auto shape = x.shape();
    shape.back() = ws[i].shape(0);
    shapes.push_back(shape);
    inputs.insert(inputs.end(), {ws[i], scales[i], biases[i]});
  }
  return mx::array::make_arrays(shapes, std::vector<mx::Dtype>(ws.size(), mx::float32),
                                std::make_shared<SharedGemv>(stream, bits, group_size, true, interleaved || int8, int8),
                                inputs);
}

mx::array quantized_gemv(const mx::array& x, const mx::array& w, const mx::array& scales,
                         const mx::array& biases, int group_size, int bits, bool interleaved, bool int8,
                         mx::StreamOrDevice s) {
  return quantized_gemvs(x, {w}, {scales}, {biases}, group_size, bits, interleaved, int8, s)[0];
}

// MLX's affine dequantization (4 or 8 bits, fp32 scales and biases) on the
// CPU, vectorised: what a prefill chunk's quantized products multiply with BLAS.
class Dequantize : public CpuPrimitive<Dequantize> {
 public:
  static constexpr const char* kName = "Dequantize";
  Dequantize(mx::Stream stream, int bits, int group, bool interleaved)
      : CpuPrimitive(stream), bits_(bits), group_(group), interleaved_(interleaved) {
    require_layout(interleaved);
  }
  auto params() const { return std::tuple(bits_, group_, interleaved_); }

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override {
    const auto &w = inputs[0], &scales = inputs[1], &biases = inputs[2];
    auto& encoder = bind(inputs, outputs);
    auto& out = outputs[0];
    const bool interleaved = interleaved_;  // out is then W^T [K, N]
    const int64_t K = interleaved ? out.shape(0) : out.shape(1), N = interleaved ? out.shape(1) : out.shape(0);
    QuantizedRows r{w.data<uint32_t>(), scales.data<float>(), biases.data<float>(), nullptr, nullptr, nullptr, nullptr,
                    nullptr, K, N, group_, interleaved};
    float* wp = out.data<float>();
    const int bits = bits_;
    encoder.dispatch([=]() {
      if (interleaved) {
#if LLM_PTE_INTEGER_DOT
        if (bits == 4) dequantize_interleaved<4>(r, wp, 0, r.N);
        else dequantize_interleaved<8>(r, wp, 0, r.N);
        return;
#else
        refuse_interleaved();
#endif
      }
      if (bits == 4) dequantize_rows<4>(r, wp, 0, r.N);
      else dequantize_rows<8>(r, wp, 0, r.N);
    });
  }

 private:
  int bits_, group_;
  bool interleaved_;
};

mx::array dequantize(const mx::array& w, const mx::array& scales, const mx::array& biases, int group_size,
                     int bits, bool interleaved, mx::StreamOrDevice s) {
  std::string err = check_quantized(w, scales, biases, w.ndim() == 2 ? w.shape(1) * 32 / bits : 0,
                                    group_size, bits);
  if (err.empty() && interleaved) err = check_interleaved(w);
  const auto stream = cpu_stream("dequantize", err, s);
  const int N = w.shape(0), K = int(w.shape(1) * 32 / bits);
  return mx::array(interleaved ? mx::Shape{K, N} : mx::Shape{N, K}, mx::float32,
                   std::make_shared<Dequantize>(stream, bits, group_size, interleaved), {w, scales, biases});
}

namespace {

// Rows of an interleaved quantized table, dequantized: a quantized
// embedding's lookup when the table is also the (interleaved) LM head.
class TakeInterleaved : public CpuPrimitive<TakeInterleaved> {
 public:
  static constexpr const char* kName = "TakeInterleaved";
  TakeInterleaved(mx::Stream stream, int bits, int group, bool int8)
      : CpuPrimitive(stream), bits_(bits), group_(group), int8_(int8) {
    require_layout(true);
  }
  auto params() const { return std::tuple(bits_, group_, int8_); }

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override {
    const auto &w = inputs[0], &scales = inputs[1], &biases = inputs[2], &ids = inputs[3];
    auto& encoder = bind(inputs, outputs);
    auto& out = outputs[0];
    const int64_t K = out.shape(-1), N = w.shape(0), count = ids.size();
    const bool int8 = int8_;
    QuantizedRows r{w.data<uint32_t>(), int8 ? nullptr : scales.data<float>(), int8 ? nullptr : biases.data<float>(),
                    nullptr, nullptr, nullptr, nullptr, nullptr, K, N, group_, true};
#if LLM_PTE_INTEGER_DOT
    const QuadScales quad = int8 ? quad_scales_of(scales, biases) : QuadScales{};
#endif
    const int bits = bits_, group = group_;
    const uint8_t* quads = reinterpret_cast<const uint8_t*>(w.data<uint32_t>());
    const mx::Dtype type = ids.dtype();
    const void* raw = ids.data<void>();
    const auto strides = ids.strides();
    const auto shape = ids.shape();
    float* o = out.data<float>();
    encoder.dispatch([=]() {
      // MLX's take counts a negative index from the end; one past either
      // end (a corrupt input) reads the nearest row, never outside the table
      std::vector<int64_t> rows(count);
      for (int64_t n = 0; n < count; ++n) {
        int64_t at = 0, rest = n;
        for (int d = int(shape.size()) - 1; d >= 0; --d) at += (rest % shape[d]) * strides[d], rest /= shape[d];
        int64_t id = type == mx::int64    ? static_cast<const int64_t*>(raw)[at]
                     : type == mx::uint32 ? int64_t(static_cast<const uint32_t*>(raw)[at])
                                          : int64_t(static_cast<const int32_t*>(raw)[at]);
        if (id < 0) id += N;
        rows[n] = std::clamp<int64_t>(id, 0, N - 1);
      }
#if LLM_PTE_INTEGER_DOT
      if (int8) {
        (bits == 4 ? take_quads<4> : take_quads<8>)(quads, quad, K, group, rows.data(), count, o);
      } else {
        (bits == 4 ? take_interleaved<4> : take_interleaved<8>)(r, rows.data(), count, o);
      }
#else
      refuse_interleaved();
#endif
    });
  }

 private:
  int bits_, group_;
  bool int8_;
};

}  // namespace

mx::array take_interleaved(const mx::array& w, const mx::array& scales, const mx::array& biases,
                           const mx::array& indices, int group_size, int bits, bool int8, mx::StreamOrDevice s) {
  std::string err = check_quantized(w, scales, biases, w.ndim() == 2 ? w.shape(1) * 32 / bits : 0,
                                    group_size, bits, int8);
  if (err.empty()) err = check_interleaved(w);
  if (err.empty() && !is_one_of(indices.dtype(), {mx::int32, mx::int64, mx::uint32}))
    err = "indices must be int32, int64 or uint32";
  if (err.empty() && w.shape(0) == 0) err = "an empty table";
  const auto stream = cpu_stream("take_interleaved", err, s);
  auto shape = indices.shape();
  shape.push_back(int(w.shape(1) * 32 / bits));
  return mx::array(shape, mx::float32, std::make_shared<TakeInterleaved>(stream, bits, group_size, int8),
                   {w, scales, biases, indices});
}

std::vector<mx::array> interleave_quantized(const mx::array& w, const mx::array& scales, const mx::array& biases,
                                            int group_size, int bits, bool weight, bool int8) {
  const int64_t K = w.ndim() == 2 ? w.shape(1) * 32 / bits : 0;
  std::string err = check_quantized(w, scales, biases, K, group_size, bits);
  if (err.empty()) err = check_interleaved(w);
  if (!err.empty()) throw std::invalid_argument("interleave_quantized: " + err);
  mx::eval(std::vector<mx::array>{w, scales, biases});
  const int64_t N = w.shape(0);
  std::vector<uint32_t> wq(weight ? w.size() : 0);
  std::vector<float> s(scales.size()), b(biases.size());
  auto kept = [&] { return weight ? mx::array(wq.begin(), w.shape(), mx::uint32) : w; };
#if LLM_PTE_INTEGER_DOT
  const uint8_t* stored = reinterpret_cast<const uint8_t*>(w.data<uint32_t>());
  uint8_t* out = weight ? reinterpret_cast<uint8_t*>(wq.data()) : nullptr;
  interleave_rows(stored, scales.data<float>(), biases.data<float>(), N, K, group_size, bits, int8 ? nullptr : out,
                  s.data(), b.data());
  if (int8) {
    if (out) interleave_quads(stored, N, K, bits, out);
    const QuadScaleValues q = quad_scales(s.data(), b.data(), int64_t(s.size()), bits);
    auto stored_as = [&](const std::vector<uint16_t>& half, const std::vector<float>& full) {
      return q.half ? mx::array(reinterpret_cast<const mx::float16_t*>(half.data()), scales.shape(), mx::float16)
                    : mx::array(full.begin(), scales.shape(), mx::float32);
    };
    return {kept(), stored_as(q.scales16, q.scales32),
            q.symmetric ? mx::array(b.begin(), mx::Shape{0}, mx::float32) : stored_as(q.biases16, q.biases32)};
  }
#else
  refuse_interleaved();
#endif
  return {kept(), mx::array(s.begin(), scales.shape(), mx::float32), mx::array(b.begin(), biases.shape(), mx::float32)};
}

Limits limits() {
  Limits l;
  l.dense_rows = kDenseRows;
  l.quantized_rows = kQuantizedRows;
  l.interleaved_rows = kInterleavedQuantizedRows;
  l.interleave_lanes = kInterleavedRows;
  l.quantized_bits = {4, 8};
  l.quantized_groups = {32, 64, 128};
#if LLM_PTE_INTEGER_DOT
  l.int8_bits = {4, 8};
#endif
  l.bf16_dot = LLM_PTE_BF16_DOT;
  l.int8_tiles = amx_allowed();  // an AMX build has integer dot products
  l.bf16_tiles = LLM_PTE_BF16_TILES && amx_allowed();
  return l;
}

namespace {

// bf16 values widened to fp32 (exactly: a bf16 is the top half of an fp32),
// sixteen or eight at a time: what a long chunk's products against bf16
// weights multiply with BLAS. MLX's own astype converts one value at a time
// on the CPU, a cost each prefill chunk would pay for every weight.
class WidenBf16 : public CpuPrimitive<WidenBf16> {
 public:
  static constexpr const char* kName = "WidenBf16";
  using CpuPrimitive::CpuPrimitive;

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override {
    const auto& w = inputs[0];
    auto& encoder = bind(inputs, outputs);
    auto& out = outputs[0];
    const uint16_t* src = w.data<uint16_t>();
    float* dst = out.data<float>();
    const int64_t rows = w.shape(0), cols = w.shape(1), row_step = w.strides(0), col_step = w.strides(1);
    encoder.dispatch([=]() {
      if (col_step != 1 || (rows > 1 && row_step != cols)) {  // a strided view: element by element
        for (int64_t r = 0; r < rows; ++r)
          for (int64_t c = 0; c < cols; ++c) dst[r * cols + c] = widen(src[r * row_step + c * col_step]);
        return;
      }
      const int64_t n = rows * cols;
      int64_t i = 0;
#if defined(__AVX512F__)
      // streaming stores: the widened copy is larger than the caches, and BLAS
      // reads it back from memory anyway; writing around the caches saves
      // reading each line before it is overwritten
      for (; i < n && reinterpret_cast<uintptr_t>(dst + i) % 64; ++i) dst[i] = widen(src[i]);
      for (; i + 16 <= n; i += 16) _mm512_stream_ps(dst + i, load16(src + i));
      _mm_sfence();
#endif
      for (; i + 8 <= n; i += 8) store8(dst + i, load8(src + i));
      for (; i < n; ++i) dst[i] = widen(src[i]);
    });
  }
};

}  // namespace

mx::array widen_bf16(const mx::array& w, mx::StreamOrDevice s) {
  std::string err;
  if (w.dtype() != mx::bfloat16 || w.ndim() != 2) err = "w must be a 2-D bfloat16 array";
  const auto stream = cpu_stream("widen_bf16", err, s);
  return mx::array(w.shape(), mx::float32, std::make_shared<WidenBf16>(stream), {w});
}

}  // namespace llm_pte
