// The int8-activation products (quantized_int8.h) on Intel's AMX tiles, for
// x's rows sixteen at a time (the build's LLM_PTE_CPU_VECTORS=amx, opt-in:
// docs/design.md): one tile instruction multiplies 16 rows of x by 16 weight
// rows over 32 values, the work of 128 VNNI dot instructions, so a prefill
// chunk is bound by converting and scaling the int32 sums, not by the dot
// products. Rows of x past the last whole 16 stay on int8_tile.
//
// The quads layout is already what a tile multiplies: a B tile holds, per row,
// four consecutive k of 16 columns (bytes 4n .. 4n + 3 are column n's), and a
// quads chunk holds four k of a block's 16 weight rows the same way. Each
// block is copied once into tile bytes for every tile of x (tile_bytes:
// 4-bit chunks split into their nibbles, symmetric weights made signed). x's
// int8 rows load as A tiles as prepare_x8 wrote them.
//
// Each group's sums are exact in int32 whatever the tile shapes, so a result
// differs from int8_tile's only in the rounding of the fp32 accumulation,
// done in the same order (sum * d, then * s, then + b d sum xq).

#pragma once

#include "amx.h"
#include "quantized_int8.h"

#if LLM_PTE_INTEGER_DOT && defined(__AMX_TILE__) && defined(__AMX_INT8__) && defined(__AVX512F__)

#include <algorithm>
#include <vector>

namespace llm_pte {

constexpr int kAmxRows = 16;  // rows of x in a tile, and weight rows (columns) of a B tile
// Fewest rows of x the tiles take: with one tile of x the tile work cannot
// overlap the scaling, and the VNNI tiles are as fast (bench_rows.py).
constexpr int kAmxMinRows = 2 * kAmxRows;
static_assert(kLanes32 == kAmxRows, "a block of quads is one B tile wide");

// Tiles 0 and 1: x, 16 rows of a span of k (a group's values, at most 64);
// 2 and 3: the weights of two blocks over that span; 4-5 and 6-7: sums, 16
// rows of x by 16 weight rows in int32, for x's even and odd tiles: while
// one tile's sums are scaled on the vector units, the next is multiplied.
// A group's weight tiles stay loaded for every tile of x.
inline TileShapes int8_tile_shapes(int span) {
  TileShapes shapes;
  for (int t : {0, 1}) shapes.set(t, span, kAmxRows);
  for (int t : {2, 3}) shapes.set(t, 64, span / 4);
  for (int t : {4, 5, 6, 7}) shapes.set(t, 64, kAmxRows);
  return shapes;
}

// GCC's tile intrinsics name their tiles in the assembly text, so each
// tile's number is spelled out. Sums tile C takes x tile (C - 4) / 2 and
// weights tile 2 + C % 2.
template <int C>
void zero_sums() {
  if constexpr (C == 4) _tile_zero(4);
  else if constexpr (C == 5) _tile_zero(5);
  else if constexpr (C == 6) _tile_zero(6);
  else _tile_zero(7);
}

template <int C>
void store_sums(int32_t* out) {
  if constexpr (C == 4) _tile_stored(4, out, 64);
  else if constexpr (C == 5) _tile_stored(5, out, 64);
  else if constexpr (C == 6) _tile_stored(6, out, 64);
  else _tile_stored(7, out, 64);
}

template <int A>
void load_x(const int8_t* x, int64_t stride) {
  if constexpr (A == 0) _tile_loadd(0, x, stride);
  else _tile_loadd(1, x, stride);
}

template <int B>
void load_weights(const uint8_t* w) {
  if constexpr (B == 2) _tile_loadd(2, w, 64);
  else _tile_loadd(3, w, 64);
}

// sums C += x . weights (x signed; the weights signed where SIGNED)
template <bool SIGNED, int C>
void dot_tiles() {
  if constexpr (SIGNED && C == 4) _tile_dpbssd(4, 0, 2);
  else if constexpr (SIGNED && C == 5) _tile_dpbssd(5, 0, 3);
  else if constexpr (SIGNED && C == 6) _tile_dpbssd(6, 1, 2);
  else if constexpr (SIGNED) _tile_dpbssd(7, 1, 3);
  else if constexpr (C == 4) _tile_dpbsud(4, 0, 2);
  else if constexpr (C == 5) _tile_dpbsud(5, 0, 3);
  else if constexpr (C == 6) _tile_dpbsud(6, 1, 2);
  else _tile_dpbsud(7, 1, 3);
}

// A block's quads as tile bytes, 8 rows of 64 per 32 values (a 4-bit chunk
// c's low nibbles are values 8c .. 8c + 3, row 2c, its high nibbles row
// 2c + 1). Symmetric weights become signed, q - 2^(bits-1), so the sums hold
// the bias (b = -2^(bits-1) s) and need no second product with x's sums.
template <int BITS>
void tile_bytes(const uint8_t* w, int64_t K, bool symmetric, uint8_t* out) {
  const __m512i nibble = _mm512_set1_epi8(0x0F), zero = _mm512_set1_epi8(symmetric ? (BITS == 8 ? char(0x80) : 8) : 0);
  for (int64_t c = 0; c < K / quad_values(BITS); ++c, w += 64) {
    const __m512i q = _mm512_loadu_si512(w);
    if constexpr (BITS == 8) {
      _mm512_storeu_si512(out, _mm512_xor_si512(q, zero)), out += 64;  // q - 128 as a signed byte
    } else {
      _mm512_storeu_si512(out, _mm512_sub_epi8(_mm512_and_si512(q, nibble), zero));
      _mm512_storeu_si512(out + 64, _mm512_sub_epi8(_mm512_and_si512(_mm512_srli_epi16(q, 4), nibble), zero));
      out += 128;
    }
  }
}

// y for x's first `rows` rows (whole tiles) and NB blocks of weight rows
// from `block`; `b[j]`: block j's tile bytes (signed where SIGNED:
// symmetric weights); `acc`: rows * NB * 16 floats of scratch.
template <int BITS, int NB, bool SIGNED>
void amx_blocks(const Int8Rows& r, int64_t block, int rows, const uint8_t* const* b, float* acc) {
  const int64_t K = r.K, groups = K / r.group, span = std::min(r.group, 64), spans = r.group / span;
  const int tiles = rows / kAmxRows, width = NB * kLanes32;
  alignas(64) int32_t sums[2][NB][kAmxRows][kAmxRows];
  std::fill(acc, acc + int64_t(rows) * width, 0.f);
  auto weights = [&](int64_t k) {
    load_weights<2>(b[0] + k * kAmxRows);
    if constexpr (NB > 1) load_weights<3>(b[NB - 1] + k * kAmxRows);
  };
  auto multiply = [&]<int C>(int t, int64_t g) {
    zero_sums<C>();
    if constexpr (NB > 1) zero_sums<C + 1>();
    for (int64_t s = 0; s < spans; ++s) {
      const int64_t k = g * r.group + s * span;
      if (spans > 1) weights(k);
      load_x<(C - 4) / 2>(r.xq + int64_t(t) * kAmxRows * K + k, K);
      dot_tiles<SIGNED, C>();
      if constexpr (NB > 1) dot_tiles<SIGNED, C + 1>();
    }
  };
  // A tile's sums are read back a step after they are stored: a vector load
  // right behind a tile store waits for the store to reach the cache.
  auto store = [&]<int C>() {
    store_sums<C>(sums[(C - 4) / 2][0][0]);
    if constexpr (NB > 1) store_sums<C + 1>(sums[(C - 4) / 2][NB - 1][0]);
  };
  auto scale = [&](int64_t item) {
    const int64_t g = item / tiles, t = item % tiles;
    for (int j = 0; j < NB; ++j) {
      const int64_t at = ((block + j) * groups + g) * kLanes32;
      const vf s = group_scales(r.scales, at);
      [[maybe_unused]] const vf bias = SIGNED ? s : group_biases(r.scales, at, s, BITS);
      for (int row = 0; row < kAmxRows; ++row) {
        const int64_t m = t * kAmxRows + row, xg = m * groups + g;
        float* a = acc + m * width + j * kLanes32;
        const vi total = _mm512_load_si512(sums[item % 2][j][row]);
        vf v = mul_add(mul(to_float(total), splat_f(r.xd[xg])), s, _mm512_loadu_ps(a));
        if constexpr (!SIGNED) v = mul_add(bias, splat_f(r.xsum[xg]), v);
        _mm512_storeu_ps(a, v);
      }
    }
  };
  // item i: group i / tiles, tile of x i % tiles, in sums tiles 4-5 (even i)
  // or 6-7 (odd); while item i's sums are stored, i + 1 is multiplied and
  // i - 1 scaled
  const int64_t items = groups * tiles;
  auto start = [&](int64_t i) {
    if (spans == 1 && i % tiles == 0) weights(i / tiles * r.group);
    i % 2 ? multiply.template operator()<6>(int(i % tiles), i / tiles)
          : multiply.template operator()<4>(int(i % tiles), i / tiles);
  };
  start(0);
  for (int64_t i = 0; i < items; ++i) {
    if (i + 1 < items) start(i + 1);
    i % 2 ? store.template operator()<6>() : store.template operator()<4>();
    if (i > 0) scale(i - 1);
  }
  scale(items - 1);
  for (int m = 0; m < rows; ++m) std::copy_n(acc + int64_t(m) * width, width, r.y + m * r.N + block * kLanes32);
}

// y for the weight rows [lo, hi) (whole blocks) and x's rows in whole tiles;
// returns how many rows of x it took (0: fewer than kAmxMinRows, or no
// tiles here), the rest being int8_rows' from there.
template <int BITS>
int amx_rows(const Int8Rows& r, int64_t lo, int64_t hi) {
  const int rows = r.M / kAmxRows * kAmxRows;
  if (rows < kAmxMinRows || !amx_allowed()) return 0;
  const TileShapes shapes = int8_tile_shapes(std::min(r.group, 64));
  _tile_loadconfig(&shapes);
  const int64_t block_bytes = r.K * BITS / 8 * kLanes32, tile_block = r.K * kLanes32;
  const bool symmetric = r.scales.biases == nullptr;
  thread_local std::vector<uint8_t> bytes;
  thread_local std::vector<float> acc;
  bytes.resize(2 * tile_block);
  acc.resize(int64_t(rows) * 2 * kLanes32);
  for (int64_t block = lo / kLanes32; block < hi / kLanes32; block += 2) {
    const int nb = std::min<int64_t>(2, hi / kLanes32 - block);
    const uint8_t* b[2];
    for (int j = 0; j < nb; ++j) {
      tile_bytes<BITS>(r.w + (block + j) * block_bytes, r.K, symmetric, bytes.data() + j * tile_block);
      b[j] = bytes.data() + j * tile_block;
    }
    if (symmetric) nb == 2 ? amx_blocks<BITS, 2, true>(r, block, rows, b, acc.data())
                           : amx_blocks<BITS, 1, true>(r, block, rows, b, acc.data());
    else nb == 2 ? amx_blocks<BITS, 2, false>(r, block, rows, b, acc.data())
                 : amx_blocks<BITS, 1, false>(r, block, rows, b, acc.data());
  }
  _tile_release();  // the tile state is 8 KB more for every context switch to save
  return rows;
}

}  // namespace llm_pte

#else

namespace llm_pte {
#if LLM_PTE_INTEGER_DOT
template <int BITS>
int amx_rows(const Int8Rows&, int64_t, int64_t) {
  return 0;  // every row on int8_rows
}
#endif
}  // namespace llm_pte

#endif
