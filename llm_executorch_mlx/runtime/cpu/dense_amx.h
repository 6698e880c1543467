// bf16 products (gemv's bf16_x) on Intel's AMX tiles, x's rows sixteen at a
// time, in the builds with AMX: one tdpbf16ps
// multiplies 16 weight rows by 16 rows of x over 32 values, the work of 32
// vdpbf16ps, and sums in fp32 over all of K in the tile, so nothing is
// scaled on the vector units between tiles (as the int8 tiles' groups are).
//
// The weights are the A tiles, read as stored (16 rows of 64 bytes at the
// weight's row stride); x is the B tile, which holds per row two
// consecutive k of 16 rows of x, so x is laid out once per product in that
// order, its last tile padded with zero rows (bf16_tile_x). A tile of sums is then 16 weight rows
// by 16 rows of x, y transposed, and is turned as it is written out.
//
// Each product is the bf16-rounded x times the bf16 weight, exact in fp32,
// summed in fp32 as dot_rows_bf16's are; only the order of the sums differs.

#pragma once

#include <cstdint>

#include "amx.h"

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#define LLM_PTE_BF16_TILES 1

#include <immintrin.h>

#include <algorithm>

namespace llm_pte {

constexpr int kBf16Tile = 16;  // rows of x a B tile holds, and weight rows an A tile holds
constexpr int kBf16TileK = 32;  // k a tile multiplies over (64 bytes of bf16)

// Fewest rows of x the tiles take: a tile of x padded with zero rows still
// reads each weight once, where the vector route's passes over few rows
// are slower from 8 rows on.
constexpr int kBf16TileMinRows = 8;

// Whether the tiles take x's M rows (K wide), all of them, the last tile
// padded: where there are enough, the tiles are lent and K is whole tiles;
// otherwise the vector units take them.
inline bool bf16_tiles_take(int64_t M, int64_t K) {
  return M >= kBf16TileMinRows && K % kBf16TileK == 0 && amx_allowed();
}

// Rows of x as laid out for the tiles: whole tiles.
inline int bf16_tile_span(int rows) { return (rows + kBf16Tile - 1) / kBf16Tile * kBf16Tile; }

// x's `rows` rows of bf16 (row stride K) as B tiles, zero rows after them up
// to the span: pair p of row m (values 2p, 2p + 1) at xt[p * span + m], so
// the tile of rows t..t+15 over k0..k0+31 starts at xt + k0 / 2 * span + t
// with a row stride of span pairs.
inline void bf16_tile_x(const uint16_t* xb, int64_t K, int rows, uint32_t* xt) {
  const auto* pairs = reinterpret_cast<const uint32_t*>(xb);
  const int span = bf16_tile_span(rows);
  for (int64_t p = 0; p < K / 2; ++p)
    for (int m = 0; m < span; ++m) xt[p * span + m] = m < rows ? pairs[m * (K / 2) + p] : 0;
}

// Tiles 0-1: two blocks of 16 weight rows; 2-3: two tiles of x; 4-7 their
// sums (4: weights 0 by x 2, 5: 0 by 3, 6: 1 by 2, 7: 1 by 3); each 16 rows of
// 64 bytes.
inline TileShapes bf16_tile_shapes() {
  TileShapes shapes;
  for (int t = 0; t < 8; ++t) shapes.set(t, 64, kBf16Tile);
  return shapes;
}

// One tile of sums ([weight row][row of x]) into y (row stride N) as y's
// [row of x][weight row], for its first `rows` rows of x (the rest padding).
inline void store_turned(const float* sums, float* y, int64_t N, int rows) {
  const __m512i column = _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                                            _mm512_set1_epi32(kBf16Tile));
  for (int m = 0; m < std::min(rows, kBf16Tile); ++m) _mm512_storeu_ps(y + m * N, _mm512_i32gather_ps(column, sums + m, 4));
}

// y for NW blocks of 16 weight rows from w and NX tiles of x from tile x0
// (GCC's tile intrinsics take the tile numbers as literals, hence the
// spelled-out cases).
template <int NW, int NX>
void bf16_tiles(const uint16_t* w, int64_t w_row, int64_t K, const uint32_t* xt, int rows, int x0, float* y,
                int64_t N) {
  _tile_zero(4);
  if constexpr (NX > 1) _tile_zero(5);
  if constexpr (NW > 1) _tile_zero(6);
  if constexpr (NW > 1 && NX > 1) _tile_zero(7);
  const int span = bf16_tile_span(rows);
  const int64_t w_stride = w_row * 2, x_stride = int64_t(span) * 4;
  for (int64_t k = 0; k < K; k += kBf16TileK) {
    const uint32_t* x = xt + k / 2 * span + x0;
    _tile_loadd(0, w + k, w_stride);
    if constexpr (NW > 1) _tile_loadd(1, w + kBf16Tile * w_row + k, w_stride);
    _tile_loadd(2, x, x_stride);
    if constexpr (NX > 1) _tile_loadd(3, x + kBf16Tile, x_stride);
    _tile_dpbf16ps(4, 0, 2);
    if constexpr (NX > 1) _tile_dpbf16ps(5, 0, 3);
    if constexpr (NW > 1) _tile_dpbf16ps(6, 1, 2);
    if constexpr (NW > 1 && NX > 1) _tile_dpbf16ps(7, 1, 3);
  }
  alignas(64) float sums[kBf16Tile * kBf16Tile];
  float* out = y + int64_t(x0) * N;
  _tile_stored(4, sums, 64);
  const int first = rows - x0, second = rows - x0 - kBf16Tile;  // rows of x in each tile (at most 16 taken)
  store_turned(sums, out, N, first);
  if constexpr (NX > 1) {
    _tile_stored(5, sums, 64);
    store_turned(sums, out + kBf16Tile * N, N, second);
  }
  if constexpr (NW > 1) {
    _tile_stored(6, sums, 64);
    store_turned(sums, out + kBf16Tile, N, first);
  }
  if constexpr (NW > 1 && NX > 1) {
    _tile_stored(7, sums, 64);
    store_turned(sums, out + kBf16Tile * N + kBf16Tile, N, second);
  }
}

// y[m, n] = x_m . W_n for the weight rows [lo, hi) (whole blocks of 16) and
// x's `rows` rows (laid out by bf16_tile_x): 32 weight rows by
// 32 rows of x at a time, the weight rows' tiles read again from cache for
// every two tiles of x.
inline void bf16_tile_product(const uint16_t* W, int64_t w_row, int64_t K, const uint32_t* xt, int rows, float* y,
                              int64_t N, int64_t lo, int64_t hi) {
  const TileShapes shapes = bf16_tile_shapes();
  _tile_loadconfig(&shapes);
  for (int64_t n = lo; n < hi; n += 2 * kBf16Tile) {
    const uint16_t* w = W + n * w_row;
    const bool two = n + 2 * kBf16Tile <= hi;
    const int span = bf16_tile_span(rows);
    for (int t = 0; t < span; t += 2 * kBf16Tile) {
      const bool pair = t + 2 * kBf16Tile <= span;
      if (two) pair ? bf16_tiles<2, 2>(w, w_row, K, xt, rows, t, y + n, N)
                    : bf16_tiles<2, 1>(w, w_row, K, xt, rows, t, y + n, N);
      else pair ? bf16_tiles<1, 2>(w, w_row, K, xt, rows, t, y + n, N)
                : bf16_tiles<1, 1>(w, w_row, K, xt, rows, t, y + n, N);
    }
  }
  _tile_release();  // the tile state is 8 KB more for every context switch to save
}

}  // namespace llm_pte

#else
#define LLM_PTE_BF16_TILES 0

namespace llm_pte {
inline bool bf16_tiles_take(int64_t, int64_t) { return false; }  // no bf16 tiles in this build
}  // namespace llm_pte

#endif
