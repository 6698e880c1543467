"""A decode step's linear layers as one kernel each, on a CUDA GPU.

A decode step on a GPU is bound by the host: every MLX op costs the host
time to build and to encode whatever the GPU then does with it. One row of
``x`` against a layer's weights is a GEMV, and the ops around it are cheap
element-wise work on that row, so one kernel can take them along:

- ``norm``: RMSNorm of ``x`` first (the layer's input norm), each block
  normalising its own copy of ``x`` in shared memory;
- several weights that read the same ``x`` (q, k and v; gate and up), each
  with its own output;
- an epilogue: the residual add after a product, or SwiGLU over the gate
  and up products (one output, ``silu(gate) * up``);
- or, for q, k and v: each output split into heads, and q's and k's heads
  rotated as ``mx.fast.rope`` rotates them (``Rotary``; a warp sums the two
  rows of a rotated pair), so the step's head split and its two RoPE ops
  are this kernel too.

Weights are dense (``x``'s dtype) or MLX's affine 4/8-bit layout as the file
stores it (``uint32`` words, low bits first; scales and biases per group).
Rounding follows the MLX ops replaced: the norm as ``mx.fast.rms_norm``
rounds it, each product summed in fp32 and rounded to ``x``'s dtype, then
each epilogue op rounded as MLX's would be.

``MlxOps`` is the same contract written with MLX's own ops: what the rewrite
(``interp/decode_blocks.py``) runs where no kernel applies in tests, and the
reference the device check (``benchmarks/gpu_decode_kernels.py``) compares
the kernel with.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import mlx.core as mx

from . import attention

WARPS = 8  # warps a block: one output row each
SHARED_BYTES = 46 * 1024  # most a block stages of x (the static shared-memory limit is 48 KiB)
DENSE = (mx.float32, mx.float16, mx.bfloat16)
BITS = (4, 8)
GROUPS = (32, 64, 128)

_HEADER = r"""
__device__ inline float warp_sum(float v) {
  #pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

// One row of a dense weight against x (K values in shared memory).
template <typename T, int K>
__device__ inline float dot_dense(const T* w, const T* xs, int lane) {
  constexpr int V = 16 / sizeof(T);  // values a 16-byte load brings
  const uint4* wv = reinterpret_cast<const uint4*>(w);
  float acc = 0.f;
  #pragma unroll 4
  for (int v = lane; v < K / V; v += 32) {
    uint4 packed = wv[v];
    const T* wp = reinterpret_cast<const T*>(&packed);
    #pragma unroll
    for (int j = 0; j < V; ++j) acc += static_cast<float>(wp[j]) * static_cast<float>(xs[v * V + j]);
  }
  return warp_sum(acc);
}

// An affine-quantized value as a float without an integer conversion:
// 2^23 + q has q in its low mantissa bits.
template <int BITS>
__device__ inline float unpack(uint32_t word, int j) {
  return __uint_as_float(0x4B000000u | ((word >> (BITS * j)) & ((1u << BITS) - 1u))) - 8388608.f;
}

// One row of an affine-quantized weight (MLX's layout) against x, staged as
// floats in chunks of the V values a lane's 16-byte load brings, each chunk
// padded by 4 floats (lanes' chunks then start in different banks), with
// each chunk's sum in xsum.
template <typename S, int K, int BITS, int GROUP>
__device__ inline float dot_quantized(const uint32_t* w, const S* scales, const S* biases, const float* xs,
                                      const float* xsum, int lane) {
  constexpr int V = 128 / BITS, PER = 32 / BITS;
  const uint4* wv = reinterpret_cast<const uint4*>(w);
  float acc = 0.f;
  #pragma unroll 2
  for (int v = lane; v < K / V; v += 32) {
    const uint4 packed = wv[v];
    const uint32_t words[4] = {packed.x, packed.y, packed.z, packed.w};
    const float4* x4 = reinterpret_cast<const float4*>(xs + v * (V + 4));
    float qx = 0.f;
    #pragma unroll
    for (int i = 0; i < 4; ++i) {
      #pragma unroll
      for (int j = 0; j < PER; j += 4) {
        const float4 xv = x4[(i * PER + j) / 4];
        qx += unpack<BITS>(words[i], j) * xv.x + unpack<BITS>(words[i], j + 1) * xv.y
            + unpack<BITS>(words[i], j + 2) * xv.z + unpack<BITS>(words[i], j + 3) * xv.w;
      }
    }
    const int g = v * V / GROUP;
    acc += static_cast<float>(scales[g]) * qx + static_cast<float>(biases[g]) * xsum[v];
  }
  return warp_sum(acc);
}

// Two rows of a weight against x at once (a rotated pair of rows): both
// rows' loads in flight together, then each row's sum.
template <typename T, int K>
__device__ inline float2 dot_dense_pair(const T* w0, const T* w1, const T* xs, int lane) {
  constexpr int V = 16 / sizeof(T);
  const uint4* wv0 = reinterpret_cast<const uint4*>(w0);
  const uint4* wv1 = reinterpret_cast<const uint4*>(w1);
  float acc0 = 0.f, acc1 = 0.f;
  #pragma unroll 4
  for (int v = lane; v < K / V; v += 32) {
    uint4 packed0 = wv0[v], packed1 = wv1[v];
    const T* wp0 = reinterpret_cast<const T*>(&packed0);
    const T* wp1 = reinterpret_cast<const T*>(&packed1);
    #pragma unroll
    for (int j = 0; j < V; ++j) {
      const float x = static_cast<float>(xs[v * V + j]);
      acc0 += static_cast<float>(wp0[j]) * x;
      acc1 += static_cast<float>(wp1[j]) * x;
    }
  }
  return make_float2(warp_sum(acc0), warp_sum(acc1));
}

template <typename S, int K, int BITS, int GROUP>
__device__ inline float2 dot_quantized_pair(const uint32_t* w0, const S* scales0, const S* biases0,
                                            const uint32_t* w1, const S* scales1, const S* biases1,
                                            const float* xs, const float* xsum, int lane) {
  constexpr int V = 128 / BITS, PER = 32 / BITS;
  const uint4* wv0 = reinterpret_cast<const uint4*>(w0);
  const uint4* wv1 = reinterpret_cast<const uint4*>(w1);
  float acc0 = 0.f, acc1 = 0.f;
  #pragma unroll 2
  for (int v = lane; v < K / V; v += 32) {
    const uint4 packed0 = wv0[v], packed1 = wv1[v];
    const uint32_t words0[4] = {packed0.x, packed0.y, packed0.z, packed0.w};
    const uint32_t words1[4] = {packed1.x, packed1.y, packed1.z, packed1.w};
    const float4* x4 = reinterpret_cast<const float4*>(xs + v * (V + 4));
    float qx0 = 0.f, qx1 = 0.f;
    #pragma unroll
    for (int i = 0; i < 4; ++i) {
      #pragma unroll
      for (int j = 0; j < PER; j += 4) {
        const float4 xv = x4[(i * PER + j) / 4];
        qx0 += unpack<BITS>(words0[i], j) * xv.x + unpack<BITS>(words0[i], j + 1) * xv.y
             + unpack<BITS>(words0[i], j + 2) * xv.z + unpack<BITS>(words0[i], j + 3) * xv.w;
        qx1 += unpack<BITS>(words1[i], j) * xv.x + unpack<BITS>(words1[i], j + 1) * xv.y
             + unpack<BITS>(words1[i], j + 2) * xv.z + unpack<BITS>(words1[i], j + 3) * xv.w;
      }
    }
    const int g = v * V / GROUP;
    acc0 += static_cast<float>(scales0[g]) * qx0 + static_cast<float>(biases0[g]) * xsum[v];
    acc1 += static_cast<float>(scales1[g]) * qx1 + static_cast<float>(biases1[g]) * xsum[v];
  }
  return make_float2(warp_sum(acc0), warp_sum(acc1));
}

// Start a warp's weight row on its way to L2 while the block stages x.
template <int BYTES>
__device__ inline void prefetch_row(const void* row, int lane) {
  const char* p = static_cast<const char*>(row);
  #pragma unroll
  for (int o = lane * 128; o < BYTES; o += 32 * 128) asm volatile("prefetch.global.L2 [%0];" ::"l"(p + o));
}

template <typename T>
__device__ inline T round_to(float v) { return static_cast<T>(v); }
"""


@dataclass(frozen=True)
class Weight:
    """One linear layer's weight, ``[N, K]`` as the layer multiplies it:
    dense (``scales`` None) or affine-quantized in MLX's layout."""

    w: mx.array
    scales: mx.array | None = None
    biases: mx.array | None = None
    bits: int = 0
    group: int = 0

    @property
    def rows(self) -> int:
        return self.w.shape[0]

    @property
    def k(self) -> int:
        return self.w.shape[1] * 32 // self.bits if self.bits else self.w.shape[1]


@dataclass(frozen=True)
class Rotary:
    """RoPE after the products: every output split into heads of ``dims``
    values (``[B, rows / dims, 1, dims]``), the first ``rotated`` of them
    rotated as ``mx.fast.rope`` rotates a head (rotate-half, its ``freqs``,
    ``1 / inv_freq`` in fp32, at the step's position)."""

    dims: int
    freqs: mx.array
    rotated: int


@dataclass(frozen=True)
class Block:
    """What one kernel computes from one row of ``x``: the products with
    ``weights`` (all of one kind, ``K`` columns), after RMSNorm with
    ``norm`` (its weight and eps) if given, then ``epilogue``: "" (each
    product its own output), "add" (the one product plus a residual) or
    "swiglu" (``silu(first) * second``, one output); with ``rotary``
    (no epilogue), each output in heads, the first ones rotated."""

    weights: tuple[Weight, ...]
    norm: tuple[mx.array | None, float] | None = None
    epilogue: str = ""
    rotary: Rotary | None = None

    @property
    def rows(self) -> int:
        """The rows of the first output."""
        return self.weights[0].rows

    @functools.cached_property
    def k(self) -> int:
        return self.weights[0].k

    @functools.cached_property
    def x_dtypes(self) -> tuple:
        """The dtypes of ``x`` the kernel takes: the dense weights' own, or
        any float dtype against quantized ones."""
        first = self.weights[0]
        return DENSE if first.bits else (first.w.dtype,)

    def takes(self, x: mx.array) -> bool:
        """Whether the kernel takes this ``x``: one row of ``K`` values, in
        a dtype it computes in (checked at every call: the hot path)."""
        return x.size == self.k and x.dtype in self.x_dtypes


def fits(block: Block) -> bool:
    """Whether the kernel can run ``block`` at all (shapes, dtypes, layout);
    checked once at load."""
    first = block.weights[0]
    k = first.k
    if any(w.k != k or w.bits != first.bits or w.group != first.group for w in block.weights):
        return False
    if first.bits:
        quantized = all(w.scales is not None and w.biases is not None and w.scales.dtype in DENSE
                        and w.biases.dtype == w.scales.dtype and w.w.dtype == mx.uint32 for w in block.weights)
        if not quantized or first.bits not in BITS or first.group not in GROUPS or k % first.group:
            return False
        step = 128 // first.bits
        staged = (k + k // step * 4 + k // step) * 4  # padded floats and chunk sums (dot_quantized)
    else:
        if any(w.w.dtype != first.w.dtype or w.w.dtype not in DENSE or w.w.ndim != 2 for w in block.weights):
            return False
        step = 16 // first.w.dtype.size
        staged = k * 4  # in x's dtype, fp32 at most
    if k == 0 or k % step or staged > SHARED_BYTES:
        return False
    if block.norm is not None and block.norm[0] is not None and block.norm[0].shape != (k,):
        return False  # the kernel reads K of its values
    rotary = block.rotary
    if rotary is not None:
        half = rotary.dims // 2
        if (block.epilogue or rotary.dims % 2 or not 0 < rotary.rotated <= len(block.weights)
                or rotary.freqs.dtype != mx.float32 or rotary.freqs.shape != (half,)
                or any(w.rows % rotary.dims for w in block.weights)):
            return False
    if block.epilogue == "swiglu":
        return len(block.weights) == 2 and block.weights[0].rows == block.weights[1].rows
    if block.epilogue == "add":
        return len(block.weights) == 1
    return 1 <= len(block.weights) <= 3


class MlxOps:
    """``Block``s with MLX's own ops (the contract, op by op)."""

    def launcher(self, block: Block):
        """``launch(x, residual=None) -> outputs`` for ``block``."""

        def launch(x, residual=None, position=None):
            if block.norm is not None:
                weight, eps = block.norm
                x = mx.fast.rms_norm(x, weight, eps)
            ys = [_product(x, w) for w in block.weights]
            if block.epilogue == "add":
                return [ys[0] + residual]
            if block.epilogue == "swiglu":
                gate, up = ys
                return [gate * mx.sigmoid(gate) * up]
            rotary = block.rotary
            if rotary is None:
                return ys
            d = rotary.dims
            heads = [y.reshape(*y.shape[:-1], y.shape[-1] // d, d).swapaxes(-2, -3) for y in ys]
            return [mx.fast.rope(y, d, traditional=False, base=None, scale=1.0, offset=position, freqs=rotary.freqs)
                    if i < rotary.rotated else y for i, y in enumerate(heads)]

        return launch

    def update_and_attend(self, scale: float):
        """A flat cache layer's write and attention, in MLX's ops."""
        return attention.mlx_op(scale)


def _product(x, w: Weight):
    if w.bits:
        return mx.quantized_matmul(x, w.w, w.scales, w.biases, True, w.group, w.bits)
    return x @ w.w.T


class CudaKernels:
    """``Block``s as one custom CUDA kernel each (``mx.fast.cuda_kernel``),
    compiled by MLX at first use, one per shape and dtype."""

    def launcher(self, block: Block):
        """``launch(x, residual=None) -> outputs`` for ``block``: all but
        ``x`` and the residual resolved here, once."""
        first = block.weights[0]
        weights = []
        if block.norm is not None and block.norm[0] is not None:
            weights.append(block.norm[0])
        for w in block.weights:
            weights += [w.w] if not w.bits else [w.w, w.scales, w.biases]
        rotary = block.rotary
        if rotary is not None:
            weights.append(rotary.freqs)
        kernel, rows = _kernel(_signature(block))
        width = [block.weights[0].rows] if block.epilogue else [w.rows for w in block.weights]
        grid, threads = (-(-rows // WARPS) * WARPS * 32, 1, 1), (WARPS * 32, 1, 1)
        scale_type = [("S", first.scales.dtype)] if first.bits else []

        def shapes(lead):
            if rotary is None:
                return [(*lead, n) for n in width]
            return [(*lead[:-1], n // rotary.dims, lead[-1], rotary.dims) for n in width]

        def launch(x, residual=None, position=None):
            inputs = [x, *weights]
            if residual is not None:
                inputs.append(residual)
            if position is not None:
                inputs.append(position)
            return kernel(inputs=inputs, template=[("T", x.dtype), *scale_type],
                          output_shapes=shapes(x.shape[:-1]), output_dtypes=[x.dtype] * len(width),
                          grid=grid, threadgroup=threads)

        return launch

    def update_and_attend(self, scale: float):
        """A flat cache layer's write and attention as one kernel (``attention.py``)."""
        return attention.kernel_op(scale)


def _signature(block: Block) -> tuple:
    first = block.weights[0]
    norm = None if block.norm is None else (block.norm[0] is not None, float(block.norm[1]))
    rotary = None if block.rotary is None else (block.rotary.dims, block.rotary.rotated)
    return (tuple(w.rows for w in block.weights), first.k, first.bits, first.group, norm, block.epilogue, rotary)


@functools.lru_cache(maxsize=None)
def _kernel(signature: tuple):
    """The kernel object for one block signature, and the warps' work items
    (output rows; a rotated pair of rows counts once)."""
    rows, k, bits, group, norm, epilogue, rotary = signature
    names = ["x"] + (["norm_w"] if norm and norm[0] else [])
    for i in range(len(rows)):
        names += [f"w{i}"] if not bits else [f"w{i}", f"s{i}", f"b{i}"]
    if rotary:
        names.append("freqs")
    if epilogue == "add":
        names.append("residual")
    if rotary:
        names.append("position")
    outputs = ["out0"] if epilogue else [f"out{i}" for i in range(len(rows))]
    total = rows[0] if epilogue == "swiglu" else sum(_items(rows, rotary))
    source = _source(rows, k, bits, group, norm, epilogue, rotary)
    kernel = mx.fast.cuda_kernel(name=f"pte_decode_{'q%d' % bits if bits else 'dense'}_{epilogue or 'plain'}",
                                 input_names=names, output_names=outputs, source=source, header=_HEADER)
    return kernel, total


def _items(rows, rotary) -> list[int]:
    """Each output's work items: its rows, or pairs of rows where rotated."""
    rotated = rotary[1] if rotary else 0
    return [n // 2 if i < rotated else n for i, n in enumerate(rows)]


def _source(rows, k, bits, group, norm, epilogue, rotary) -> str:
    n = len(rows)
    # x as the products read it: in T for dense weights; for quantized ones as
    # floats in padded chunks, with each chunk's sum (dot_quantized)
    chunk = 128 // bits if bits else 0
    lines = [
        f"constexpr int K = {k};",
        f"constexpr int WARPS = {WARPS};",
        "__shared__ float partial[WARPS];",
        "const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;",
        "const int r = blockIdx.x * WARPS + warp;",
    ]
    lines += _prefetch(rows, k, bits, group, epilogue, rotary)
    if bits:
        lines += [
            f"constexpr int V = {chunk};",
            "__shared__ alignas(16) float xs[K + K / V * 4];",
            "__shared__ float xsum[K / V];",
            "#define STAGE(k, value) xs[(k) + (k) / V * 4] = static_cast<float>(round_to<T>(value))",
        ]
    else:
        lines += [
            "__shared__ alignas(16) unsigned char staged[K * sizeof(T)];",
            "T* xs = reinterpret_cast<T*>(staged);",
            "#define STAGE(k, value) xs[k] = round_to<T>(value)",
        ]
    if norm is not None:
        has_weight, eps = norm
        scaled = "static_cast<float>(norm_w[k]) * " if has_weight else ""
        lines += [
            "float squares = 0.f;",
            "for (int k = tid; k < K; k += blockDim.x) { const float v = static_cast<float>(x[k]); squares += v * v; }",
            "squares = warp_sum(squares);",
            "if (lane == 0) partial[warp] = squares;",
            "__syncthreads();",
            "if (warp == 0) { float t = lane < WARPS ? partial[lane] : 0.f; t = warp_sum(t);"
            " if (lane == 0) partial[0] = t; }",
            "__syncthreads();",
            f"const float inv = rsqrtf(partial[0] / K + {eps!r}f);",
            "for (int k = tid; k < K; k += blockDim.x)",
            f"  STAGE(k, {scaled}static_cast<float>(round_to<T>(static_cast<float>(x[k]) * inv)));",
        ]
    else:
        lines.append("for (int k = tid; k < K; k += blockDim.x) STAGE(k, static_cast<float>(x[k]));")
    lines.append("__syncthreads();")
    if bits:
        lines += [
            "for (int c = tid; c < K / V; c += blockDim.x) {",
            "  float t = 0.f;",
            "  for (int j = 0; j < V; ++j) t += xs[c * (V + 4) + j];",
            "  xsum[c] = t;",
            "}",
            "__syncthreads();",
        ]
    items = _items(rows, rotary)
    total = rows[0] if epilogue == "swiglu" else sum(items)
    lines.append(f"if (r >= {total}) return;")

    def dot(i, row):
        if bits:
            per_row, groups = k * bits // 32, k // group
            return (f"dot_quantized<S, K, {bits}, {group}>(w{i} + size_t({row}) * {per_row}, "
                    f"s{i} + size_t({row}) * {groups}, b{i} + size_t({row}) * {groups}, xs, xsum, lane)")
        return f"dot_dense<T, K>(w{i} + size_t({row}) * K, xs, lane)"

    def dot_pair(i, row0, row1):
        if bits:
            per_row, groups = k * bits // 32, k // group
            rows = ", ".join(f"w{i} + size_t({r}) * {per_row}, s{i} + size_t({r}) * {groups}, "
                             f"b{i} + size_t({r}) * {groups}" for r in (row0, row1))
            return f"dot_quantized_pair<S, K, {bits}, {group}>({rows}, xs, xsum, lane)"
        return f"dot_dense_pair<T, K>(w{i} + size_t({row0}) * K, w{i} + size_t({row1}) * K, xs, lane)"

    if epilogue == "swiglu":
        lines += [
            f"const float gate = static_cast<float>(round_to<T>({dot(0, 'r')}));",
            f"const float up = static_cast<float>(round_to<T>({dot(1, 'r')}));",
            "const float s = static_cast<float>(round_to<T>(1.f / (1.f + expf(-gate))));",
            "if (lane == 0) out0[r] = round_to<T>(static_cast<float>(round_to<T>(gate * s)) * up);",
        ]
    elif epilogue == "add":
        lines += [
            f"const float y = static_cast<float>(round_to<T>({dot(0, 'r')}));",
            "if (lane == 0) out0[r] = round_to<T>(y + static_cast<float>(residual[r]));",
        ]
    else:
        start = 0
        rotated = rotary[1] if rotary else 0
        for i in range(n):
            cond = "if" if i == 0 else "else if"
            if i < rotated:
                # one pair of a head's rows (j, j + half): rounded as the
                # product's output, then rotated as mx.fast.rope rotates them
                half = rotary[0] // 2
                lines += [
                    f"{cond} (r < {start + items[i]}) {{",
                    f"  const int p = r - {start}, j = p % {half}, a = p / {half} * {rotary[0]} + j;",
                    f"  const float2 pair = {dot_pair(i, 'a', f'(a + {half})')};",
                    "  const float x1 = static_cast<float>(round_to<T>(pair.x));",
                    "  const float x2 = static_cast<float>(round_to<T>(pair.y));",
                    "  if (lane == 0) {",
                    "    const float inv_freq = 1.0 / freqs[j];",
                    "    const float theta = static_cast<float>(position[0]) * inv_freq;",
                    "    const float c = cos(theta), s = sin(theta);",
                    f"    out{i}[a] = round_to<T>(x1 * c - x2 * s);",
                    f"    out{i}[a + {half}] = round_to<T>(x1 * s + x2 * c);",
                    "  }",
                    "}",
                ]
            else:
                lines += [
                    f"{cond} (r < {start + items[i]}) {{",
                    f"  const float y = {dot(i, f'(r - {start})')};",
                    f"  if (lane == 0) out{i}[r - {start}] = round_to<T>(y);",
                    "}",
                ]
            start += items[i]
    return "\n".join(lines)


PREFETCH_BYTES = 16 * 1024  # most of a row prefetched


def _prefetch(rows, k, bits, group, epilogue, rotary) -> list[str]:
    """Lines prefetching warp ``r``'s weight rows (both of SwiGLU's, both
    of a rotated pair's), before the block stages ``x``."""
    row_bytes = k * bits // 8 if bits else None
    per_row = k * bits // 32 if bits else "K"

    def fetch(i, row):
        size = min(row_bytes or k * 2, PREFETCH_BYTES)  # dense: sizeof(T) is 2 or 4; 2 keeps to the row
        return f"prefetch_row<{size}>(w{i} + size_t({row}) * {per_row}, lane);"

    if epilogue == "swiglu":
        return [f"if (r < {rows[0]}) {{ {fetch(0, 'r')} {fetch(1, 'r')} }}"]
    lines, start = [], 0
    rotated = rotary[1] if rotary else 0
    for i, n in enumerate(_items(rows, rotary)):
        cond = f"{'if' if i == 0 else 'else if'} (r < {start + n})"
        if i < rotated:  # the pair (a, a + half) of a head's rows, as the products read them
            dims, half = rotary[0], rotary[0] // 2
            lines.append(f"{cond} {{ const int a = (r - {start}) / {half} * {dims} + (r - {start}) % {half}; "
                         f"{fetch(i, 'a')} {fetch(i, f'(a + {half})')} }}")
        else:
            lines.append(f"{cond} {fetch(i, f'(r - {start})')}")
        start += n
    return lines


KERNELS_FLAG = "LLM_PTE_GPU_KERNELS"  # "0": MLX's own ops on a CUDA GPU, not the kernels


def for_device():
    """What runs ``Block``s on this GPU: the CUDA kernels where MLX runs on
    a CUDA GPU, unless ``LLM_PTE_GPU_KERNELS=0`` asks for MLX's own ops;
    else None (each node its own MLX op). With them a step is about a third
    of the launches, and the host's work a step shorter than the device's
    (``docs/design.md``, "The GPU route"). Apple GPUs: none
    (``mx.fast.metal_kernel`` has the same shape; not ported)."""
    if os.environ.get(KERNELS_FLAG) == "0" or not mx.cuda.is_available():
        return None
    return CudaKernels()
