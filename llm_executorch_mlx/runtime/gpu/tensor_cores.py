"""Rows of ``x`` against 4-bit weights on tensor cores: a decode block's
products for a call of 1 to ``attention.MOST_ROWS`` rows, where asked
(``decode.TENSOR_CORES_FLAG``).

One row's products are a GEMV, and ``decode.py``'s kernel sums them with
FMAs at the weights' bandwidth. Several rows multiply that arithmetic: the
few-row form of that kernel pays each row's unpacking and FMAs again, so a
call of six rows cost about four one-row launches. Here a warp's
``mma.m16n8k16`` (16-bit inputs, fp32 sums) does the arithmetic of up to
eight rows at once, so such a call costs about one row's launch
(``benchmarks/gpu_mma_products.py`` measures both). One row costs more here
than on the FMA kernel, but it must come here too: a verifying call's rows
must round as one-token steps do.

The operands, for a warp and a k-tile of 128 values:

- A: 16 weight rows (the tile's items: 16 rows, or 8 pairs where an item
  is two rows: SwiGLU's gate and up, a rotated pair). Lane ``(g, t)``
  (``g = lane / 4``, ``t = lane % 4``) loads 16 bytes of its rows ``g`` and
  ``g + 8``: 32 values, the tile's ``t``-th chunk of 32. One ``lop3`` makes
  two 4-bit values ``q`` the exact 16-bit values ``OFFSET + q`` (the
  exponent of ``OFFSET`` with ``q`` in the low mantissa bits).
- B: eight columns, each a (row of x, chunk) pair: column ``g`` is row
  ``g / 4`` of the two rows of x an mma takes, and only the lane whose
  ``t`` is ``g % 4`` gives it values, so each column sums one chunk's
  products. A's k positions are each lane's own chunk, so the four chunks
  of a tile land in four columns, and each gets its group's scale after
  the mma: ``s * sum((OFFSET + q) x) + (b - OFFSET s) * sum(x)``.

x is staged rounded to its own dtype (as MLX's ops hand it to the product)
with each chunk's sum in fp32. Every row of x is summed the same way
whatever the other rows of the call, so each row gets the bits that row
alone gets here (not the bits of ``decode.py``'s FMA kernels, which sum in
another order).
"""

from __future__ import annotations

import mlx.core as mx

from . import attention

DTYPES = (mx.bfloat16, mx.float16)  # the 16-bit types an mma multiplies
WARPS_A_BLOCK = 4  # each its own tile, or its part of a tile split between warps
WEIGHT_BITS = 4

HEADER = r"""
// mma.m16n8k16 with fp32 sums, for each 16-bit type (its PTX name is part
// of the instruction's text); MAGIC is OFFSET's bits in both halves of a
// word, OFFSET the value whose low mantissa bits are q
template <typename T> struct Mma;
#define PTE_MMA(TYPE, PTX, MAGIC_BITS, OFFSET_VALUE) \
  template <> struct Mma<TYPE> { \
    static constexpr uint32_t MAGIC = MAGIC_BITS; \
    static constexpr float OFFSET = OFFSET_VALUE; \
    __device__ static void run(float* c, uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3, uint32_t b0, \
                               uint32_t b1) { \
      asm volatile("mma.sync.aligned.m16n8k16.row.col.f32." PTX "." PTX ".f32 {%0,%1,%2,%3}, " \
                   "{%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};" \
                   : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3]) \
                   : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1)); \
    } \
  };
PTE_MMA(__nv_bfloat16, "bf16", 0x43004300u, 128.f)
PTE_MMA(__half, "f16", 0x64006400u, 1024.f)
#undef PTE_MMA

// the 4-bit values i and i + 4 of a word as two 16-bit OFFSET + q
template <typename T> __device__ __forceinline__ uint32_t offset_pair(uint32_t w, int i) {
  uint32_t r;
  asm("lop3.b32 %0, %1, %2, %3, 0xEA;" : "=r"(r) : "r"(w >> (4 * i)), "r"(0x000F000Fu), "r"(Mma<T>::MAGIC));
  return r;
}

// two floats rounded to T, low then high half of a word
template <typename T> __device__ __forceinline__ uint32_t pack2(float lo, float hi) {
  const T a = static_cast<T>(lo), b = static_cast<T>(hi);
  return uint32_t(*reinterpret_cast<const unsigned short*>(&a))
      | (uint32_t(*reinterpret_cast<const unsigned short*>(&b)) << 16);
}
"""


def tile_items(paired: bool) -> int:
    """A warp's tile of 16 weight rows in items: 8 pairs, or 16 rows."""
    return 8 if paired else 16


def fits(items: list[int], paired: list[bool], bits: int) -> bool:
    """Whether a block the decode kernels take (``decode.fits``: groups of
    32, 64 or 128, K in groups) can run here: 4-bit weights, each output's
    items in whole tiles."""
    return bits == WEIGHT_BITS and all(n % tile_items(p) == 0 for n, p in zip(items, paired))


def shared_bytes(k: int, norm: bool, rows: int) -> int:
    """A bound on a block's shared memory staging ``rows`` rows of x (what
    ``source`` declares, the few bytes of ``declarations`` aside): per row
    its values (2 bytes each), its chunks' sums and its share of the
    tiles' results; the joins of a split tile's parts per pair of rows; a
    norm's sums."""
    return (rows * (k * 2 + k // 32 * 4 + WARPS_A_BLOCK * 16 * 8) + (k // 2 if norm else 0)
            + WARPS_A_BLOCK * 32 * 2 * ((rows + 1) // 2) * 4)


def pass_rows(k: int, norm: bool, limit: int) -> int:
    """Rows of x a block stages at once: as many as ``limit`` bytes of
    shared memory hold, up to ``attention.MOST_ROWS``."""
    rows = attention.MOST_ROWS
    while rows > 1 and shared_bytes(k, norm, rows) > limit:
        rows -= 1
    return rows


def layout(items: list[int], paired: list[bool]) -> tuple[int, int, int]:
    """``(tiles, split, per_block)``: the warps' tiles, the warps a tile is
    split between (its k-tiles dealt out), so that a launch of few tiles
    still has warps enough to keep the weights' loads in flight, and tiles
    a block."""
    tiles = sum(n // tile_items(p) for n, p in zip(items, paired))
    split = 1 if tiles >= 512 else 2 if tiles >= 160 else 4
    return tiles, split, max(1, WARPS_A_BLOCK // split)


def grid(items: list[int], paired: list[bool]) -> tuple[int, int]:
    """``(blocks, threads)`` of a launch."""
    tiles, split, per_block = layout(items, paired)
    return -(-tiles // per_block), per_block * split * 32


def source(k: int, group: int, declarations: list[str], stage: str, pointers: list[str], items: list[int],
           paired: list[bool], staged_rows: int, epilogue: list[str]) -> str:
    """The kernel's body. ``declarations``: lines after the kernel's own
    (``tid`` and ``K`` declared), before its first barrier; ``stage``: a
    ``stage_x`` call up to its lambda (it calls it with each piece of 8
    values of row ``p`` of x, ``u`` the piece's index); ``pointers[i]``:
    the statement setting ``pa``, ``sa``, ``ba`` (and ``pb``, ``sb``,
    ``bb``) to the rows A's rows ``g`` and ``g + 8`` come from for output
    ``i``'s tile whose first item is ``item0``; ``epilogue``: the lines
    writing row ``m`` of x for item ``r`` from ``v`` (a float2: a pair's
    two sums, or a row's in ``.x``)."""
    tiles, split, per_block = layout(items, paired)
    chunks = k // 32
    lines = [
        f"constexpr int K = {k}, P = {staged_rows}, SPLIT = {split}, TB = {per_block}, THREADS = TB * SPLIT * 32;",
        # a lane's loads in flight: U k-tiles of its two rows
        f"constexpr int CHUNKS = {chunks}, KT = (CHUNKS + 3) / 4, NT = (P + 1) / 2, U = 4;",
        "__shared__ __align__(16) uint2 xs[P * K / 4];",
        "__shared__ float xsum[P * CHUNKS];",
        "__shared__ float joins[SPLIT > 1 ? THREADS * 2 * NT : 1];",
        "__shared__ float2 results[TB][16][P];",
        "const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, g = lane >> 2, t = lane & 3;",
        "const int part = warp % SPLIT, tb = warp / SPLIT, tile = blockIdx.x * TB + tb;",
        f"const bool active = tile < {tiles};",
        *declarations,
        "int M = 1;",
        "for (int d = 0; d + 1 < x_ndim; ++d) M *= x_shape[d];",
        "const uint4 *pa = nullptr, *pb = nullptr;",
        "const S *sa = nullptr, *ba = nullptr, *sb = nullptr, *bb = nullptr;",
        "int item0 = 0;",
    ]
    start_tile = start_item = 0
    for i, (count, pair) in enumerate(zip(items, paired)):
        here = count // tile_items(pair)
        lines.append(f"{'if' if i == 0 else 'else if'} (tile < {start_tile + here}) {{ "
                     f"item0 = {start_item} + (tile - {start_tile}) * {tile_items(pair)}; {pointers[i]} }}")
        start_tile, start_item = start_tile + here, start_item + count
    # a pass: its rows of x staged in the order B reads them (values 0 and 4
    # of a piece of 8 in a word, then 1 and 5, ...: as offset_pair pairs the
    # weights), and each chunk's sum
    lines += [
        "for (int m0 = 0; m0 < M; m0 += P) {",
        "const int here = min(P, M - m0);",
        "if (m0) __syncthreads();  // the last pass's reads of xs and joins done",
        "for (int p = 0; p < here; ++p) {",
        "if (p) __syncthreads();",
        stage + "[&](int u, const float* v) {",
        "  xs[p * (K / 4) + u * 2] = make_uint2(pack2<T>(v[0], v[4]), pack2<T>(v[1], v[5]));",
        "  xs[p * (K / 4) + u * 2 + 1] = make_uint2(pack2<T>(v[2], v[6]), pack2<T>(v[3], v[7]));",
        "});",
        "}",
        "__syncthreads();",
        "for (int u = tid; u < here * CHUNKS; u += THREADS) {",
        "  float sum = 0.f;",
        "  #pragma unroll",
        "  for (int j = 0; j < 8; ++j) {",
        "    const uint2 v = xs[u * 8 + j];",
        "    const T* e = reinterpret_cast<const T*>(&v);",
        "    sum += static_cast<float>(e[0]) + static_cast<float>(e[1]) + static_cast<float>(e[2])",
        "        + static_cast<float>(e[3]);",
        "  }",
        "  xsum[u] = sum;",
        "}",
        "__syncthreads();",
        # acc[j][nt]: A's row g + 8 j against the row of x of column 2 t + e
        # of mma nt, this lane's two chunks joined with its neighbour's
        # (t ^ 1: the other two) after the last k-tile
        "float acc[2][NT] = {};",
        "if (active) {",
        "  const bool gives = t == (g & 3);",
        "  uint4 qa[U], qb[U];",
        "  for (int kt0 = part; kt0 < KT; kt0 += SPLIT * U) {",
        "    #pragma unroll",
        "    for (int u = 0; u < U; ++u) {",
        "      const int c = (kt0 + u * SPLIT) * 4 + t;",
        "      const bool in = kt0 + u * SPLIT < KT && c < CHUNKS;",
        # a chunk past K: A's OFFSET against B's zeros
        "      qa[u] = in ? pa[c] : make_uint4(0u, 0u, 0u, 0u);",
        "      qb[u] = in ? pb[c] : make_uint4(0u, 0u, 0u, 0u);",
        "    }",
        "    #pragma unroll",
        "    for (int u = 0; u < U; ++u) {",
        "      const int kt = kt0 + u * SPLIT;",
        "      if (kt >= KT) break;",
        "      const int own = kt * 4 + t;  // the chunk this lane loaded, and gives B of",
        "      const uint32_t wa[4] = {qa[u].x, qa[u].y, qa[u].z, qa[u].w};",
        "      const uint32_t wb[4] = {qb[u].x, qb[u].y, qb[u].z, qb[u].w};",
        "      float c[NT][4] = {};",
        "      #pragma unroll",
        "      for (int wd = 0; wd < 4; ++wd) {",
        "        #pragma unroll",
        "        for (int h = 0; h < 2; ++h) {",
        "          const uint32_t a0 = offset_pair<T>(wa[wd], 2 * h), a2 = offset_pair<T>(wa[wd], 2 * h + 1);",
        "          const uint32_t a1 = offset_pair<T>(wb[wd], 2 * h), a3 = offset_pair<T>(wb[wd], 2 * h + 1);",
        "          #pragma unroll",
        "          for (int nt = 0; nt < NT; ++nt) {",
        "            const int xr = nt * 2 + (g >> 2);",
        "            uint2 b = make_uint2(0u, 0u);",
        "            if (gives && xr < here && own < CHUNKS) b = xs[xr * (K / 4) + (own * 4 + wd) * 2 + h];",
        "            Mma<T>::run(c[nt], a0, a1, a2, a3, b.x, b.y);",
        "          }",
        "        }",
        "      }",
        "      #pragma unroll",
        "      for (int e = 0; e < 2; ++e) {",
        "        const int chunk = kt * 4 + 2 * (t & 1) + e;",
        "        if (chunk >= CHUNKS) continue;",
        f"        const int gi = chunk * 32 / {group};",
        "        const float scale_a = static_cast<float>(sa[gi]), bias_a = static_cast<float>(ba[gi]);",
        "        const float scale_b = static_cast<float>(sb[gi]), bias_b = static_cast<float>(bb[gi]);",
        "        #pragma unroll",
        "        for (int nt = 0; nt < NT; ++nt) {",
        "          const int xr = nt * 2 + (t >> 1);",
        "          if (xr >= here) continue;",
        "          const float xm = xsum[xr * CHUNKS + chunk];",
        "          acc[0][nt] += scale_a * c[nt][e] + (bias_a - Mma<T>::OFFSET * scale_a) * xm;",
        "          acc[1][nt] += scale_b * c[nt][2 + e] + (bias_b - Mma<T>::OFFSET * scale_b) * xm;",
        "        }",
        "      }",
        "    }",
        "  }",
        "}",
        "#pragma unroll",
        "for (int nt = 0; nt < NT; ++nt) {",
        "  acc[0][nt] += __shfl_xor_sync(0xffffffffu, acc[0][nt], 1);",
        "  acc[1][nt] += __shfl_xor_sync(0xffffffffu, acc[1][nt], 1);",
        "}",
        "if (SPLIT > 1) {  // join the parts, in order",
        "  #pragma unroll",
        "  for (int nt = 0; nt < NT; ++nt) {",
        "    joins[(tid * 2) * NT + nt] = acc[0][nt];",
        "    joins[(tid * 2 + 1) * NT + nt] = acc[1][nt];",
        "  }",
        "  __syncthreads();",
        "  if (part == 0) {",
        "    #pragma unroll",
        "    for (int nt = 0; nt < NT; ++nt) {",
        "      float j0 = 0.f, j1 = 0.f;",
        "      for (int q = 0; q < SPLIT; ++q) {",
        "        j0 += joins[((tid + q * 32) * 2) * NT + nt];",
        "        j1 += joins[((tid + q * 32) * 2 + 1) * NT + nt];",
        "      }",
        "      acc[0][nt] = j0;",
        "      acc[1][nt] = j1;",
        "    }",
        "  }",
        "}",
    ]
    # each item's sums to the lane that writes it: a pair's two rows in one
    # float2, else rows g and g + 8 each in their own
    starts = [sum(items[:i]) for i in range(len(items))]
    pair_outputs = [(start, start + n) for start, n, p in zip(starts, items, paired) if p]
    is_pair = " || ".join(f"(item0 >= {a} && item0 < {b})" for a, b in pair_outputs) or "false"
    lines += [
        f"const bool pairs = {is_pair};",
        "if (part == 0 && !(t & 1)) {",
        "  #pragma unroll",
        "  for (int nt = 0; nt < NT; ++nt) {",
        "    const int xr = nt * 2 + (t >> 1);",
        "    if (xr >= here) continue;",
        "    if (pairs) results[tb][g][xr] = make_float2(acc[0][nt], acc[1][nt]);",
        "    else { results[tb][g][xr] = make_float2(acc[0][nt], 0.f); "
        "results[tb][g + 8][xr] = make_float2(acc[1][nt], 0.f); }",
        "  }",
        "}",
        "__syncwarp();",
        "if (active && part == 0 && lane < (pairs ? 8 : 16)) {",
        "const int r = item0 + lane;",
        "for (int p = 0; p < here; ++p) {",
        "const float2 v = results[tb][lane][p];",
        "const int m = m0 + p;",
        *epilogue,
        "}",
        "}",
        "}",
    ]
    return "\n".join(lines)
