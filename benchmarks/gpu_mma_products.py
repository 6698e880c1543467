"""A 4-bit product on tensor cores for a few rows of x, against the decode-step kernel, on a CUDA GPU.

The decode-step kernels (``runtime/gpu/decode.py``) multiply in fp32 FMAs,
unpacking every 4-bit value once per row of ``x``: a verifying call of six
rows costs about three one-row launches. Here the same product (MLX's
affine 4-bit layout, groups of 32, bf16 ``x``) runs on ``mma.m16n8k16``
(bf16 in, fp32 sums), where a weight value is unpacked once for up to
eight rows:

- a warp takes 16 weight rows; each lane loads one group (16 bytes, 32
  values) of two of them, so the four lanes that share a row in the mma's
  A operand hold four groups of it; one ``lop3`` turns two 4-bit values
  into two bf16 values ``128 + q`` (exact);
- B's eight columns are (row of x, group): column ``4 * (r % 2) + j`` holds
  row r's values of group j and zeros elsewhere, so each group's dot lands
  in its own column and gets its own scale and bias in fp32 after the
  k-tile: ``s * dot + (b - 128 * s) * sum(x over the group)``;
- ``x`` is staged in shared memory once a block, bf16, its values
  permuted to the order the lanes' pairs take.

Each column sums in the same order whatever the other columns hold, so a
row of a call of several gets the bits a call of that row alone gets.
The script compares both kernels with MLX's ``quantized_matmul`` (fp32),
then ncu times each launch (clocks left alone, caches flushed before
each, so the weights come from DRAM; one kernel at a time, so a launch's
start and finish count): the 1B shape's gate + up, q + k + v and output
products, for 1 to 8 rows. ``down`` (K = 8192) is left out: eight of its
rows of x do not fit a block's 48 KB of shared memory as staged.

    python benchmarks/gpu_mma_products.py            # on the GPU machine: check, then times
    python benchmarks/gpu_mma_products.py --no-time  # the check alone
"""

from __future__ import annotations

import argparse
import collections
import csv
import os
import pathlib
import shutil
import statistics
import subprocess
import sys
import tempfile

HEADER = r"""
// values i and i + 4 of a word as two bf16, 128 + q each (exact: bf16 holds 128..143)
__device__ __forceinline__ uint32_t pair(uint32_t w, int i) {
  uint32_t r;
  asm("lop3.b32 %0, %1, %2, %3, 0xEA;" : "=r"(r) : "r"(w >> (4 * i)), "r"(0x000F000Fu), "r"(0x43004300u));
  return r;
}
__device__ __forceinline__ void mma(float* c, uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3, uint32_t b0,
                                    uint32_t b1) {
  asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
               "{%0,%1,%2,%3};"
               : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3]) : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}
"""

# the 1B shape's 4-bit products: (rows of the weight, K, warps that split K)
SHAPES = {"gate+up": (16384, 2048, 1), "q+k+v": (3072, 2048, 2), "o": (2048, 2048, 4)}
TILES_A_BLOCK = 4  # 16-row tiles a block's warps take, over all splits
UNROLL = 4  # k-tiles (128 values) whose loads a lane has in flight


def tiles_a_block(split: int) -> int:
    """16-row tiles a block takes, ``split`` warps each."""
    return max(1, TILES_A_BLOCK // split)


def source(k: int, n: int, rows: int, split: int) -> str:
    """The kernel's body: ``tiles_a_block(split)`` 16-row tiles a block,
    ``split`` warps a tile, each taking every ``split``-th k-tile."""
    tiles = tiles_a_block(split)
    return f"""
constexpr int K = {k}, N = {n}, P = {rows}, SPLIT = {split}, RT = {tiles}, U = {UNROLL};
constexpr int GROUPS = K / 32, TILES = K / 128, NT = (P + 1) / 2, THREADS = RT * SPLIT * 32;
__shared__ __align__(16) uint2 xs[P * K / 4];  // per row: each word's values as (0,4,1,5) (2,6,3,7)
__shared__ float xsum[P * GROUPS];
__shared__ float joins[SPLIT > 1 ? THREADS * 2 * NT : 1];
const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, g = lane >> 2, t = lane & 3;
const int part = warp % SPLIT, R0 = (blockIdx.x * RT + warp / SPLIT) * 16 + g, R1 = R0 + 8;
const uint4* w4 = reinterpret_cast<const uint4*>(w);
uint4 qa[U], qb[U];
auto load = [&](int tile0) {{  // U k-tiles of the lane's two rows, from tile0 on
  #pragma unroll
  for (int u = 0; u < U; ++u) {{
    const int tile = tile0 + u * SPLIT;
    if (tile < TILES) {{
      qa[u] = w4[size_t(R0) * GROUPS + tile * 4 + t];
      qb[u] = w4[size_t(R1) * GROUPS + tile * 4 + t];
    }}
  }}
}};
load(part);  // the first loads in flight while x is staged
for (int u = tid; u < P * K / 8; u += THREADS) {{
  const uint4 v = reinterpret_cast<const uint4*>(x)[u];
  xs[u * 2] = make_uint2(__byte_perm(v.x, v.z, 0x5410), __byte_perm(v.x, v.z, 0x7632));
  xs[u * 2 + 1] = make_uint2(__byte_perm(v.y, v.w, 0x5410), __byte_perm(v.y, v.w, 0x7632));
}}
for (int u = tid; u < P * GROUPS; u += THREADS) {{
  float sum = 0.f;
  #pragma unroll
  for (int j = 0; j < 4; ++j) {{
    const uint4 v = reinterpret_cast<const uint4*>(x)[u * 4 + j];
    const T* e = reinterpret_cast<const T*>(&v);
    #pragma unroll
    for (int i = 0; i < 8; ++i) sum += static_cast<float>(e[i]);
  }}
  xsum[u] = sum;
}}
__syncthreads();
float acc[2][NT] = {{}};  // rows R0, R1 of y for x rows 2 * nt + t / 2 (half of their groups)
const bool gives = t == (g & 3);  // this lane's group is its B column's
for (int tile0 = part; tile0 < TILES; tile0 += SPLIT * U) {{
  if (tile0 != part) load(tile0);
  #pragma unroll
  for (int u = 0; u < U; ++u) {{
    const int tile = tile0 + u * SPLIT;
    if (tile >= TILES) break;
    const int G = tile * 4 + t;
    const uint32_t wa[4] = {{qa[u].x, qa[u].y, qa[u].z, qa[u].w}}, wb[4] = {{qb[u].x, qb[u].y, qb[u].z, qb[u].w}};
    float c[NT][4] = {{}};
    #pragma unroll
    for (int wd = 0; wd < 4; ++wd) {{
      #pragma unroll
      for (int h = 0; h < 2; ++h) {{
        const uint32_t a0 = pair(wa[wd], 2 * h), a2 = pair(wa[wd], 2 * h + 1);
        const uint32_t a1 = pair(wb[wd], 2 * h), a3 = pair(wb[wd], 2 * h + 1);
        #pragma unroll
        for (int nt = 0; nt < NT; ++nt) {{
          const int xr = nt * 2 + (g >> 2);
          uint2 b = make_uint2(0u, 0u);
          if (gives && xr < P) b = xs[xr * (K / 4) + (G * 4 + wd) * 2 + h];
          mma(c[nt], a0, a1, a2, a3, b.x, b.y);
        }}
      }}
    }}
    // this lane's columns 2t, 2t + 1: x row nt * 2 + t / 2, groups grp, grp + 1
    const int grp = tile * 4 + 2 * (t & 1);
    const __nv_bfloat162 s0 = *reinterpret_cast<const __nv_bfloat162*>(s + size_t(R0) * GROUPS + grp);
    const __nv_bfloat162 b0 = *reinterpret_cast<const __nv_bfloat162*>(b + size_t(R0) * GROUPS + grp);
    const __nv_bfloat162 s1 = *reinterpret_cast<const __nv_bfloat162*>(s + size_t(R1) * GROUPS + grp);
    const __nv_bfloat162 b1 = *reinterpret_cast<const __nv_bfloat162*>(b + size_t(R1) * GROUPS + grp);
    const float sa[2] = {{__low2float(s0), __high2float(s0)}}, ba[2] = {{__low2float(b0), __high2float(b0)}};
    const float sb[2] = {{__low2float(s1), __high2float(s1)}}, bb[2] = {{__low2float(b1), __high2float(b1)}};
    #pragma unroll
    for (int nt = 0; nt < NT; ++nt) {{
      const int xr = nt * 2 + (t >> 1);
      if (xr >= P) continue;
      #pragma unroll
      for (int e = 0; e < 2; ++e) {{
        const float xm = xsum[xr * GROUPS + grp + e];
        acc[0][nt] += sa[e] * c[nt][e] + (ba[e] - 128.f * sa[e]) * xm;
        acc[1][nt] += sb[e] * c[nt][2 + e] + (bb[e] - 128.f * sb[e]) * xm;
      }}
    }}
  }}
}}
#pragma unroll
for (int nt = 0; nt < NT; ++nt) {{  // lanes t and t ^ 1 hold the two halves of a row's groups
  acc[0][nt] += __shfl_xor_sync(0xffffffffu, acc[0][nt], 1);
  acc[1][nt] += __shfl_xor_sync(0xffffffffu, acc[1][nt], 1);
}}
if (SPLIT > 1) {{  // join the warps of a tile, in order
  #pragma unroll
  for (int nt = 0; nt < NT; ++nt) {{
    joins[(tid * 2) * NT + nt] = acc[0][nt];
    joins[(tid * 2 + 1) * NT + nt] = acc[1][nt];
  }}
  __syncthreads();
  if (part != 0) return;
  #pragma unroll
  for (int nt = 0; nt < NT; ++nt) {{
    float j0 = 0.f, j1 = 0.f;
    for (int q = 0; q < SPLIT; ++q) {{
      j0 += joins[((tid + q * 32) * 2) * NT + nt];
      j1 += joins[((tid + q * 32) * 2 + 1) * NT + nt];
    }}
    acc[0][nt] = j0;
    acc[1][nt] = j1;
  }}
}}
if (t & 1) return;
#pragma unroll
for (int nt = 0; nt < NT; ++nt) {{
  const int xr = nt * 2 + (t >> 1);
  if (xr < P) {{
    y[size_t(xr) * N + R0] = static_cast<T>(acc[0][nt]);
    y[size_t(xr) * N + R1] = static_cast<T>(acc[1][nt]);
  }}
}}
"""


_KERNELS = {}


def mma_product(mx, x, w, s, b, split: int):
    """``x @ dequantize(w, s, b).T`` for ``x`` of [rows, K] bf16 (rows <= 8)."""
    rows, k = x.shape
    n = w.shape[0]
    key = (k, n, rows, split)
    if key not in _KERNELS:
        _KERNELS[key] = mx.fast.cuda_kernel(name=f"mma_q4_rows{rows}", input_names=["x", "w", "s", "b"],
                                            output_names=["y"], source=source(*key), header=HEADER)
    threads = tiles_a_block(split) * split * 32
    blocks = n // 16 // tiles_a_block(split)
    return _KERNELS[key](inputs=[x, w, s, b], template=[("T", x.dtype)], output_shapes=[(rows, n)],
                         output_dtypes=[x.dtype], grid=(blocks * threads, 1, 1), threadgroup=(threads, 1, 1))[0]


def run(args) -> None:
    """The check, then (``--launches``) each shape and row count's launches,
    between a marker kernel naming them and one ending them (for the ncu
    summary)."""
    import mlx.core as mx

    from llm_executorch_mlx.runtime.gpu.decode import Block, CudaKernels, Weight

    def mark(label: str) -> None:  # a launch ncu lists by its name, between the timed ones
        kernel = mx.fast.cuda_kernel(name=f"mark_{label}", input_names=["a"], output_names=["o"], source="o[0] = a[0];")
        mx.eval(kernel(inputs=[mx.zeros((1,))], template=[], output_shapes=[(1,)], output_dtypes=[mx.float32],
                       grid=(1, 1, 1), threadgroup=(1, 1, 1))[0])

    key = mx.random.key(0)
    for name, (n, k, split) in SHAPES.items():
        key, k1, k2 = mx.random.split(key, 3)
        w, s, b = mx.quantize((mx.random.normal((n, k), key=k1) * 0.02).astype(mx.bfloat16), group_size=32, bits=4)
        fma = CudaKernels(False).launcher(Block((Weight(w, s, b, 4, 32),)))
        for rows in args.rows:
            x = mx.random.normal((rows, k), key=k2).astype(mx.bfloat16)
            ref = mx.quantized_matmul(x.astype(mx.float32), w, s.astype(mx.float32), b.astype(mx.float32),
                                      True, 32, 4)
            ours, theirs = mma_product(mx, x, w, s, b, split), fma(x.reshape(1, rows, k))[0].reshape(rows, n)
            alone = all(mx.array_equal(ours[i], mma_product(mx, x[i:i + 1], w, s, b, split)[0]).item()
                        for i in range(rows))
            top = mx.abs(ref).max().item()
            err = [(mx.abs(y.astype(mx.float32) - ref).max() / top).item() for y in (ours, theirs)]
            print(f"check {name} rows={rows}: largest difference from quantized_matmul (fp32), relative to the "
                  f"largest output: tensor cores {err[0]:.2e}, decode-step kernel {err[1]:.2e}; each row as "
                  f"its own call: {'the same bits' if alone else 'OTHER BITS'}", flush=True)
            if not args.launches:
                continue
            mark(f"{name.replace('+', '_')}_{rows}")
            for _ in range(args.launches):
                mx.eval(fma(x.reshape(1, rows, k))[0])
                mx.eval(mma_product(mx, x, w, s, b, split))
            mark("end")
            mx.synchronize()


def summarize(text: str) -> None:
    """Median µs a launch by shape and rows: the decode-step kernel, the
    tensor cores, and their ratio."""
    records = csv.DictReader(line for line in text.splitlines() if line.startswith('"'))
    launches = collections.OrderedDict()
    for record in records:
        if record.get("Metric Name") == "gpu__time_duration.sum":
            launches[record["ID"]] = (record["Kernel Name"].split("(")[0],
                                      float(record["Metric Value"].replace(",", "")) / 1e3)
    times, label = collections.defaultdict(lambda: collections.defaultdict(list)), None
    for name, us in launches.values():
        if "mark_end" in name:
            label = None
        elif "mark_" in name:
            label = name.split("mark_")[1].split("_float")[0]
        elif label is not None:
            times[label]["tensor cores" if "mma_q4" in name else "decode-step kernel"].append(us)
    print("| shape | rows of x | decode-step kernel µs | tensor cores µs | kernel ÷ tensor cores |\n"
          "|---|---|---|---|---|")
    for label, by in times.items():
        shape, rows = label.rsplit("_", 1)
        ours, cores = statistics.median(by["decode-step kernel"]), statistics.median(by["tensor cores"])
        print(f"| {shape.replace('_', ' + ')} | {rows} | {ours:.1f} | {cores:.1f} | {ours / cores:.2f} |")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=lambda v: [int(r) for r in v.split(",")], default=[1, 2, 4, 6, 8],
                   help="rows of x (1 to 8; default: 1,2,4,6,8)")
    p.add_argument("--no-time", action="store_true", help="only the check")
    p.add_argument("--ncu", default=shutil.which("ncu") or "ncu", help="the ncu to run (default: on PATH)")
    p.add_argument("--launches", type=int, default=0, help=argparse.SUPPRESS)  # under ncu: launches of each
    args = p.parse_args(argv)
    if args.no_time or args.launches:
        run(args)
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        log = pathlib.Path(tmp) / "ncu.csv"
        cmd = [args.ncu, "--clock-control", "none", "--metrics", "gpu__time_duration.sum", "--csv",
               "--print-units", "base", "--kernel-name", "regex:mark_|mma_q4|pte_decode", "--log-file", str(log),
               sys.executable, __file__, "--launches", "5", "--rows", ",".join(map(str, args.rows))]
        done = subprocess.run(cmd, env=os.environ.copy())
        if done.returncode or not log.exists():
            print(f"ncu exited with {done.returncode}; its log:\n{log.read_text() if log.exists() else '(none)'}")
            return 1
        summarize(log.read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
