"""A decode step's linear layers as one kernel each, on a CUDA GPU.

A decode step on a GPU is bound by the host: every MLX op costs the host
time to build and to encode whatever the GPU then does with it. One row of
``x`` against a layer's weights is a GEMV, and the ops around it are cheap
element-wise work on that row, so one kernel can take them along. A call
of a few rows (speculative decoding's verifying call, a short chunk) takes
the same kernels, each weight load serving every row, and each row gets
the bits a call of that row alone gets (its sums in the same order), so
a verifying call chooses what one-token steps would. Where asked
(``TENSOR_CORES_FLAG``), 16-bit rows against 4-bit weights go to tensor
cores instead, one row and several alike (``tensor_cores.py``: a few rows
for about one row's time, every row summed in the same order there, which
is not the FMA kernels' order). A block is:

- ``norm``: RMSNorm of ``x`` first (the layer's input norm), each block
  normalising its own copy of ``x`` in shared memory;
- several weights that read the same ``x`` (q, k and v; gate and up), each
  with its own output;
- an epilogue: the residual add after a product, or SwiGLU over the gate
  and up products (one output, ``silu(gate) * up``);
- or, for q, k and v: each output split into heads, and q's and k's heads
  rotated as ``mx.fast.rope`` rotates them (``Rotary``; the same warps sum
  both rows of a rotated pair), so the step's head split and its two RoPE ops
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

from . import attention, tensor_cores
from .source import compact

# 16-byte weight loads a lane has in flight at most, dense and quantized: about
# what ptxas issues before the first multiply (more only as those are used)
MOST_LOADS = {False: 4, True: 2}
MOST_THREADS = 1024  # a block's
# a block's for several rows of x: ptxas is given no bound (MLX declares the
# kernel), and at 256 threads even 255 registers a thread fit an SM
FEW_ROWS_THREADS = 256
# blocks of a launch of several rows, each taking item after item with the
# rows it staged (about two an SM of an H100 or H200)
FEW_ROWS_BLOCKS = 264
# the few-row SwiGLU kernel's blocks an SM holds at once: ptxas caps its
# registers to fit them (``__launch_bounds__``); uncapped, one block an SM is
# all that fits, too few warps to keep the weights' loads in flight. The
# other few-row kernels fit two uncapped, but for the rotated 4-bit q, k, v,
# which a cap makes spill and run slower (docs/design.md)
FEW_ROWS_BLOCKS_AN_SM = 2
# the type names MLX puts in a custom kernel's function name
# (``mlx/backend/cuda/custom_kernel.cpp``: ``template_arguments_hash``)
MLX_TYPE_NAMES = {mx.float32: "float", mx.float16: "float16_t", mx.bfloat16: "bfloat16_t"}
SHARED_BYTES = 48 * 1024  # a block's static shared memory at most
DENSE = (mx.float32, mx.float16, mx.bfloat16)
BITS = (4, 8)
GROUPS = (32, 64, 128)

_COMMON = r"""
// Start a warp's part of a weight row on its way to L2 while the block
// stages x.
template <int BYTES, int SPLIT>
__device__ inline void prefetch_row(const void* row, int lane, int part) {
  const char* p = static_cast<const char*>(row);
  #pragma unroll
  for (int o = (part * 32 + lane) * 128; o < BYTES; o += SPLIT * 32 * 128)
    asm volatile("prefetch.global.L2 [%0];" ::"l"(p + o));
}

template <typename T>
__device__ inline T round_to(float v) { return static_cast<T>(v); }

__device__ inline float warp_sum(float v) {
  #pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

// The sum of UNITS values in shared memory, the same in every lane of every
// warp: an order fixed by UNITS alone, not by the block's threads.
template <int UNITS>
__device__ inline float units_sum(const float* sums, int lane) {
  float t = 0.f;
  for (int u = lane; u < UNITS; u += 32) t += sums[u];
  return warp_sum(t);
}

// A lane's part of NR weight rows' dot products with the first `here` of P
// rows of x: body(i, v, p, acc) adds the lane's i-th chunk, chunk v of the
// row (16-byte chunks part * 32 + lane, then every 32 * SPLIT on), times
// row p of x into acc (that row's NR sums); then each row's sums are joined
// across the warp into out[p]. A row of x is summed in the same order
// whatever P: a row of a few-row call gets one row's bits.
template <int ITER, int SPLIT, int CHUNKS, int NR, int P, typename Body>
__device__ inline void rows_dot(int here, int lane, int part, float2* out, Body body) {
  float acc[P][2] = {};
  #pragma unroll
  for (int i = 0; i < ITER; ++i) {
    const int v = (i * SPLIT + part) * 32 + lane;
    if (v >= CHUNKS) continue;
    #pragma unroll
    for (int p = 0; p < P; ++p) {
      if (p >= here) break;
      body(i, v, p, acc[p]);
    }
  }
  #pragma unroll
  for (int p = 0; p < P; ++p) if (p < here) out[p] = make_float2(warp_sum(acc[p][0]), NR > 1 ? warp_sum(acc[p][1]) : 0.f);
}

// x's K values (T) as the products read them, each value rounded as the
// MLX ops replaced round it: RMSNorm'd if NORM (2: and scaled by norm_w;
// each piece's sum of squares in squares[K / UNIT], summed in a fixed
// order, so any block size gives the same bits). Each thread loads its
// 16-byte pieces of x at once; a piece of UNIT values at a time is handed
// to put(unit, values) (the dense or quantized staging).
template <typename T, int K, int THREADS, int UNIT, int NORM, typename NW, typename Put>
__device__ inline void stage_x(const T* x, const NW* norm_w, float eps, float* squares, int tid, Put put) {
  constexpr int V = 16 / sizeof(T), LOADS = UNIT / V, UNITS = K / UNIT;
  constexpr int ITER = (UNITS + THREADS - 1) / THREADS;
  uint4 xr[ITER][LOADS];
  #pragma unroll
  for (int i = 0; i < ITER; ++i) {
    const int u = tid + i * THREADS;
    #pragma unroll
    for (int l = 0; l < LOADS; ++l) if (u < UNITS) xr[i][l] = reinterpret_cast<const uint4*>(x)[u * LOADS + l];
  }
  float inv = 1.f;
  if (NORM) {
    #pragma unroll
    for (int i = 0; i < ITER; ++i) {
      if (tid + i * THREADS >= UNITS) continue;
      float t = 0.f;
      #pragma unroll
      for (int l = 0; l < LOADS; ++l) {
        const T* xv = reinterpret_cast<const T*>(&xr[i][l]);
        #pragma unroll
        for (int j = 0; j < V; ++j) t += static_cast<float>(xv[j]) * static_cast<float>(xv[j]);
      }
      squares[tid + i * THREADS] = t;
    }
    __syncthreads();
    inv = rsqrtf(units_sum<UNITS>(squares, tid & 31) / K + eps);
  }
  #pragma unroll
  for (int i = 0; i < ITER; ++i) {
    const int u = tid + i * THREADS;
    if (u >= UNITS) continue;
    float values[UNIT];
    #pragma unroll
    for (int l = 0; l < LOADS; ++l) {
      const T* xv = reinterpret_cast<const T*>(&xr[i][l]);
      #pragma unroll
      for (int j = 0; j < V; ++j) {
        float v = static_cast<float>(xv[j]);
        if (NORM) v = static_cast<float>(static_cast<T>(v * inv));
        if (NORM == 2) v *= static_cast<float>(norm_w[u * UNIT + l * V + j]);
        values[l * V + j] = static_cast<float>(static_cast<T>(v));
      }
    }
    put(u, values);
  }
}
"""

_DENSE = r"""
// The dot products of NR rows (w0, and w1 if NR is 2) of a dense weight
// with the first `here` of P rows of x (staged as T, K apart) over one
// warp's part of K, of SPLIT warps a row (rows_dot). Every load of the part
// is issued before the first multiply, so a lane has its whole share of
// the rows in flight at once, and each load serves every row of x.
template <typename T, int K, int SPLIT, int NR, int P>
__device__ inline void dot_dense(const T* w0, const T* w1, const T* xs, int here, int lane, int part, float2* out) {
  constexpr int V = 16 / sizeof(T), CHUNKS = K / V, ITER = (CHUNKS + 32 * SPLIT - 1) / (32 * SPLIT);
  const uint4* wv[2] = {reinterpret_cast<const uint4*>(w0), reinterpret_cast<const uint4*>(w1)};
  uint4 packed[NR][ITER];
  #pragma unroll
  for (int i = 0; i < ITER; ++i) {
    const int v = (i * SPLIT + part) * 32 + lane;
    #pragma unroll
    for (int n = 0; n < NR; ++n) if (v < CHUNKS) packed[n][i] = wv[n][v];
  }
  rows_dot<ITER, SPLIT, CHUNKS, NR, P>(here, lane, part, out, [&](int i, int v, int p, float* acc) {
    const uint4 xp = reinterpret_cast<const uint4*>(xs + p * K)[v];
    const T* xv = reinterpret_cast<const T*>(&xp);
    #pragma unroll
    for (int n = 0; n < NR; ++n) {
      const T* wp = reinterpret_cast<const T*>(&packed[n][i]);
      #pragma unroll
      for (int j = 0; j < V; ++j) acc[n] += static_cast<float>(wp[j]) * static_cast<float>(xv[j]);
    }
  });
}

"""

_QUANTIZED = r"""
// Value j of a word as a float, without an integer conversion or, where
// the value lies low enough, a shift: 2^23 + (v << p) (v's bits OR'd into
// 2^23's mantissa, in place) times 2^-p is 2^(23-p) + v exactly, so one
// fma takes 2^(23-p) off and leaves v. Values above bit 22 come from
// `high`, the word shifted down once for all of them. (j is a constant
// once unrolled: the masks and scales are too.)
template <int BITS>
struct Unpacked {
  static constexpr int IN = 23 / BITS;  // values that lie in place
  uint32_t word, high;
  __device__ explicit Unpacked(uint32_t w) : word(w), high(w >> (IN * BITS)) {}
  __device__ __forceinline__ float value(int j) const {
    const int p = j < IN ? j * BITS : (j - IN) * BITS;
    const float scale = 1.f / static_cast<float>(1u << p);
    const uint32_t mask = ((1u << BITS) - 1u) << p, magic = 0x4B000000u;
    uint32_t f;  // (w & mask) | magic in one lop3 (two immediates would take two)
    asm("lop3.b32 %0, %1, %2, %3, 0xEA;" : "=r"(f) : "r"(j < IN ? word : high), "r"(mask), "r"(magic));
    return fmaf(__uint_as_float(f), scale, -8388608.f * scale);
  }
};

// Each chunk's sum of the staged x (V floats at c * (V + 4)): the V / XV
// consecutive threads whose pieces make a chunk sum theirs, then join by
// shuffles (every lane of a warp at every round, so the shuffles meet).
template <int K, int THREADS, int V, int XV>
__device__ inline void chunk_sums(const float* xs, float* xsum, int tid) {
  constexpr int UNITS = K / XV, G = V / XV;
  #pragma unroll
  for (int base = 0; base < UNITS; base += THREADS) {
    const int u = base + tid;
    float t = 0.f;
    if (u < UNITS) {
      const float* from = xs + u * XV + u * XV / V * 4;
      #pragma unroll
      for (int j = 0; j < XV; ++j) t += from[j];
    }
    #pragma unroll
    for (int o = G / 2; o > 0; o >>= 1) t += __shfl_xor_sync(0xffffffffu, t, o);
    if (u < UNITS && u % G == 0) xsum[u / G] = t;
  }
}

// dot_dense for an affine-quantized weight (MLX's layout: uint32 words, low
// bits first, a scale and a bias a group). x is staged as floats in chunks
// of the V values a lane's 16-byte load brings, each chunk padded by 4
// floats (lanes' chunks then start in different banks), with each chunk's
// sum in xsum: a chunk's part of the dot is scale * (q . x) + bias * sum(x).
// Rows of x lie XS floats and K / V sums apart.
template <typename S, int K, int BITS, int GROUP, int SPLIT, int NR, int P>
__device__ inline void dot_quantized(const uint32_t* w0, const S* s0, const S* b0, const uint32_t* w1,
                                     const S* s1, const S* b1, const float* xs, const float* xsum,
                                     int here, int lane, int part, float2* out) {
  constexpr int V = 128 / BITS, PER = 32 / BITS, CHUNKS = K / V, XS = K + CHUNKS * 4;
  constexpr int ITER = (CHUNKS + 32 * SPLIT - 1) / (32 * SPLIT);
  const uint4* wv[2] = {reinterpret_cast<const uint4*>(w0), reinterpret_cast<const uint4*>(w1)};
  const S* scales[2] = {s0, s1};
  const S* biases[2] = {b0, b1};
  uint4 packed[NR][ITER];
  float scale[NR][ITER], bias[NR][ITER];
  #pragma unroll
  for (int i = 0; i < ITER; ++i) {
    const int v = (i * SPLIT + part) * 32 + lane, g = v * V / GROUP;
    #pragma unroll
    for (int n = 0; n < NR; ++n) {
      if (v < CHUNKS) {
        packed[n][i] = wv[n][v];
        scale[n][i] = static_cast<float>(scales[n][g]);
        bias[n][i] = static_cast<float>(biases[n][g]);
      }
    }
  }
  rows_dot<ITER, SPLIT, CHUNKS, NR, P>(here, lane, part, out, [&](int i, int v, int p, float* acc) {
    const float4* x4 = reinterpret_cast<const float4*>(xs + p * XS + v * (V + 4));
    #pragma unroll
    for (int n = 0; n < NR; ++n) {
      const uint32_t words[4] = {packed[n][i].x, packed[n][i].y, packed[n][i].z, packed[n][i].w};
      float even = 0.f, odd = 0.f;  // two chains of fmas, each in the values' order
      #pragma unroll
      for (int q = 0; q < 4; ++q) {
        const Unpacked<BITS> u(words[q]);
        #pragma unroll
        for (int j = 0; j < PER; j += 4) {
          const float4 xv = x4[(q * PER + j) / 4];
          even = fmaf(u.value(j), xv.x, even);
          odd = fmaf(u.value(j + 1), xv.y, odd);
          even = fmaf(u.value(j + 2), xv.z, even);
          odd = fmaf(u.value(j + 3), xv.w, odd);
        }
      }
      const float qx = even + odd;
      acc[n] += scale[n][i] * qx + bias[n][i] * xsum[p * CHUNKS + v];
    }
  });
}
"""

# a kernel's header as MLX gets it: the shared part and its weights' kind's
_HEADERS = {quantized: compact(_COMMON + (_QUANTIZED if quantized else _DENSE)) for quantized in (False, True)}


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
    """What one kernel computes from each row of ``x``: the products with
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
        any float dtype against quantized ones, whose one row a block's
        shared memory holds."""
        first = self.weights[0]
        split = _signature(self)[-1]
        return tuple(d for d in (DENSE if first.bits else (first.w.dtype,))
                     if _shared_bytes(self, 1, split, d.size) <= SHARED_BYTES)

    def takes(self, x: mx.array) -> bool:
        """Whether the kernel takes this ``x``: up to ``attention.MOST_ROWS``
        rows of ``K`` values (``[..., rows, K]``, one batch), in a dtype it
        computes in (checked at every call: the hot path)."""
        rows = x.size // self.k
        return (x.shape[-1] == self.k and x.dtype in self.x_dtypes
                and (rows == 1 or (rows <= attention.MOST_ROWS and x.shape[-2] == rows)))


class MadeAtFirstCall:
    """A block and its launch, made at the block's first call (when the init
    chain has filled its weights): ``get(f)`` gives ``(block, launch)``, or
    ``(None, None)`` where the kernel cannot run the block (``fits``).
    ``make(f)`` makes the block from the call's frame."""

    def __init__(self, runner, make):
        self.runner, self.make, self.made = runner, make, None

    def get(self, f) -> tuple:
        if self.made is None:
            block = self.make(f)
            self.made = (block, self.runner.launcher(block)) if fits(block) else (None, None)
        return self.made


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
    else:
        if any(w.w.dtype != first.w.dtype or w.w.dtype not in DENSE or w.w.ndim != 2 for w in block.weights):
            return False
        step = 16 // first.w.dtype.size
    if k == 0 or k % step or not block.x_dtypes:
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
    compiled by MLX at first use, one per shape and dtype. With
    ``tensor_cores`` (an sm_80 GPU or later), every launch of 16-bit x
    against 4-bit weights takes them, one row too, so that a row rounds
    alike in a one-token step and in a verifying call (``tensor_cores.py``)."""

    def __init__(self, tensor_cores: bool):
        self.tensor_cores = tensor_cores

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
        signature = _signature(block)
        one, few = _kernel(signature + (0,)), _kernel(signature + (_pass_rows(block, signature[-1]),))
        width = [block.weights[0].rows] if block.epilogue else [w.rows for w in block.weights]
        scale_type = [("S", first.scales.dtype)] if first.bits else []
        mma = self.tensor_cores and _tensor_cores_fit(signature)  # for 16-bit x (tensor_cores.DTYPES)

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
            if mma and x.dtype in tensor_cores.DTYPES:
                kernel, grid, threads = _tensor_core_kernel(signature, x.size == block.k)
            elif x.size == block.k:
                kernel, grid, threads = one
            else:
                kernel, grid, threads = few
            return kernel(inputs=inputs, template=[("T", x.dtype), *scale_type],
                          output_shapes=shapes(x.shape[:-1]), output_dtypes=[x.dtype] * len(width),
                          grid=grid, threadgroup=threads)

        return launch

    def on_tensor_cores(self, block: Block, dtype: mx.Dtype) -> bool:
        """Whether a launch of x in ``dtype`` runs ``block`` on tensor cores
        (``launch`` asks at each call)."""
        return self._on_tensor_cores(_signature(block), dtype)

    def _on_tensor_cores(self, signature: tuple, dtype: mx.Dtype) -> bool:
        return self.tensor_cores and dtype in tensor_cores.DTYPES and _tensor_cores_fit(signature)

    def update_and_attend(self, scale: float):
        """A flat cache layer's write and attention as one kernel (``attention.py``)."""
        return attention.kernel_op(scale)


def _signature(block: Block) -> tuple:
    first = block.weights[0]
    norm = None if block.norm is None else (block.norm[0] is not None, float(block.norm[1]))
    rotary = None if block.rotary is None else (block.rotary.dims, block.rotary.rotated)
    values = 128 // first.bits if first.bits else 16 // first.w.dtype.size  # a lane's 16-byte load
    return (tuple(w.rows for w in block.weights), first.k, first.bits, first.group, norm, block.epilogue, rotary,
            _split(first.k // values, 2 if block.epilogue == "swiglu" or rotary else 1, bool(first.bits)))


def _shared_bytes(block: Block, rows: int, split: int, x_size: int) -> int:
    """A block's shared memory staging ``rows`` rows of x of ``x_size``
    bytes a value (as ``_source`` declares it)."""
    first, k = block.weights[0], block.k
    if first.bits:
        chunks = k * first.bits // 128
        row = (k + chunks * 4 + chunks) * 4  # padded floats and chunk sums (dot_quantized)
    else:
        row = k * x_size
    squares = k * x_size // 16 * 4 if block.norm is not None else 4  # a norm's sums (stage_x)
    joins = _rows_a_block(split, rows > 1) * split * 8  # a row's parts (float2 a warp)
    return rows * (row + joins) + squares


def _pass_rows(block: Block, split: int) -> int:
    """Rows of x a block stages at once for a launch of several: as many
    as shared memory holds, up to ``attention.MOST_ROWS`` (a pass reads the
    weights once for all of them)."""
    rows, x_size = attention.MOST_ROWS, max(dtype.size for dtype in block.x_dtypes)
    while rows > 1 and _shared_bytes(block, rows, split, x_size) > SHARED_BYTES:
        rows -= 1
    return rows


def _split(chunks: int, rows: int, quantized: bool) -> int:
    """Warps an item takes (1 to 8): the fewest that leave each lane at most
    ``MOST_LOADS`` 16-byte loads of the item's ``rows`` rows of ``chunks``
    loads each. A lane's loads are then all in flight at once, and a row's
    bytes in flight grow with the warps it has."""
    split = 1
    while split < 8 and -(-chunks // (32 * split)) * rows > MOST_LOADS[quantized]:
        split *= 2
    return split


def _rows_a_block(split: int, several: bool) -> int:
    """Items a block: 8, fewer where ``split`` warps each would pass the
    block's thread limit (a lower one for ``several`` rows of x)."""
    return max(1, min(8, (FEW_ROWS_THREADS if several else MOST_THREADS) // (32 * split)))


@functools.lru_cache(maxsize=None)
def _kernel(signature: tuple):
    """``(kernel, grid, threadgroup)`` for one block signature and the rows
    of x it stages at once (0: a launch of one row, a decode step's):
    ``_rows_a_block`` work items a block (output rows; a rotated pair of
    rows counts once), ``split`` warps an item."""
    rows, k, bits, group, norm, epilogue, rotary, split, pass_rows = signature
    names, outputs = _names(rows, bits, norm, epilogue, rotary)
    total = rows[0] if epilogue == "swiglu" else sum(_items(rows, rotary))
    source = _source(rows, k, bits, group, norm, epilogue, rotary, split, pass_rows)
    name = f"pte_decode_{'q%d' % bits if bits else 'dense'}_{epilogue or 'plain'}"
    header = _HEADERS[bool(bits)]
    if pass_rows and epilogue == "swiglu":
        bounds, unbound = _launch_bounds(name, bool(bits))
        header, source = header + bounds, unbound + source
    kernel = mx.fast.cuda_kernel(name=name, input_names=names, output_names=outputs, source=compact(source),
                                 header=header)
    per_block = _rows_a_block(split, pass_rows > 0)
    blocks = -(-total // per_block)
    if pass_rows:
        blocks = min(blocks, FEW_ROWS_BLOCKS)
    threads = per_block * split * 32
    return kernel, (blocks * threads, 1, 1), (threads, 1, 1)


def _names(rows, bits, norm, epilogue, rotary) -> tuple[list[str], list[str]]:
    """A block kernel's input and output names, in the order ``launch``
    passes them."""
    names = ["x"] + (["norm_w"] if norm and norm[0] else [])
    for i in range(len(rows)):
        names += [f"w{i}"] if not bits else [f"w{i}", f"s{i}", f"b{i}"]
    if rotary:
        names.append("freqs")
    if epilogue == "add":
        names.append("residual")
    if rotary:
        names.append("position")
    return names, ["out0"] if epilogue else [f"out{i}" for i in range(len(rows))]


def _stage(norm, values: str) -> str:
    """A ``stage_x`` call for row ``p`` of the pass (``m0``) in pieces of
    ``values`` values, up to its lambda: the block's copy of that row of x,
    normalised where ``norm``."""
    has_weight = bool(norm and norm[0])
    return (f"stage_x<T, K, THREADS, {values}, {(2 if has_weight else 1) if norm else 0}>"
            f"(x + size_t(m0 + p) * K, {'norm_w' if has_weight else 'x'}, {float(norm[1]) if norm else 0.0!r}f, "
            "squares, tid, ")


def _pair_row(pair: str, dims: int) -> str:
    """The first row ``a`` of rotated pair ``pair`` (a C expression, in
    parentheses where compound) in heads of ``dims`` rows: the pair is
    ``(a, a + dims / 2)``, as ``mx.fast.rope`` rotates a head's halves."""
    return f"{pair} / {dims // 2} * {dims} + {pair} % {dims // 2}"


def _paired(rows, epilogue, rotary) -> tuple[list[int], list[bool]]:
    """Each output's work items (SwiGLU's: one, its gate and up rows paired)
    and whether an item is a pair of rows."""
    if epilogue == "swiglu":
        return [rows[0]], [True]
    rotated = rotary[1] if rotary else 0
    return _items(rows, rotary), [i < rotated for i in range(len(rows))]


@functools.lru_cache(maxsize=None)
def _tensor_cores_fit(signature: tuple) -> bool:
    """Whether ``tensor_cores.py`` takes a block that ``fits``. Its shared
    memory needs no check: a pass of one 16-bit row there takes less than
    the one row of floats the FMA kernel stages, which ``fits`` bounds."""
    rows, _, bits, _, _, epilogue, rotary, _ = signature
    return tensor_cores.fits(*_paired(rows, epilogue, rotary), bits)


@functools.lru_cache(maxsize=None)
def _tensor_core_kernel(signature: tuple, one_row: bool):
    """``(kernel, grid, threadgroup)`` for a launch on tensor cores
    (``tensor_cores.py``), where ``_tensor_cores_fit``: of one row of x, or
    of several."""
    rows, k, bits, group, norm, epilogue, rotary, _ = signature
    names, outputs = _names(rows, bits, norm, epilogue, rotary)
    items, paired = _paired(rows, epilogue, rotary)
    groups = k // group

    def at(side, w, row):  # A's rows g (side a) or g + 8 (side b): a weight row, its scales and biases
        return (f"p{side} = reinterpret_cast<const uint4*>(w{w} + size_t({row}) * (K / 8)); "
                f"s{side} = s{w} + size_t({row}) * {groups}; b{side} = b{w} + size_t({row}) * {groups};")

    pointers, start = [], 0
    for i, count in enumerate(items):
        first = f"(item0 - {start})"
        if epilogue == "swiglu":
            pointers.append(at("a", 0, f"{first} + g") + " " + at("b", 1, f"{first} + g"))
        elif paired[i]:  # the pair (a, a + half) of a head's rows
            half = rotary[0] // 2
            pointers.append(f"const int pr = {first} + g, a = {_pair_row('pr', rotary[0])}; "
                            + at("a", i, "a") + " " + at("b", i, f"a + {half}"))
        else:
            pointers.append(at("a", i, f"{first} + g") + " " + at("b", i, f"{first} + 8 + g"))
        start += count
    pass_rows = 1 if one_row else tensor_cores.pass_rows(k, norm is not None, SHARED_BYTES)
    lines = [f"__shared__ float squares[{'K * sizeof(T) / 16' if norm else 1}];"]
    if rotary:  # as in _source
        lines += ["__shared__ int position0;", "if (tid == 0) position0 = position[0];"]
    source = tensor_cores.source(k, group, lines, _stage(norm, "8"), pointers, items, paired, pass_rows,
                                 _epilogue(rows, epilogue, rotary, "v"))
    name = f"pte_decode_mma_q{bits}_{epilogue or 'plain'}"
    kernel = mx.fast.cuda_kernel(name=name, input_names=names, output_names=outputs, source=compact(source),
                                 header=_HEADERS[True] + compact(tensor_cores.HEADER))
    blocks, threads = tensor_cores.grid(items, paired)
    return kernel, (blocks * threads, 1, 1), (threads, 1, 1)


def _launch_bounds(name: str, quantized: bool) -> tuple[str, str]:
    """Lines ending a few-row SwiGLU kernel's header that give its function
    ``__launch_bounds__``, and lines starting its body that take them back.
    MLX writes the declaration itself, so each name it may give the function
    (``custom_kernel_`` + name + the template's types: ``T``, and ``S`` where
    quantized) is a macro adding them before it. The macros must end inside
    the body: NVRTC looks the kernel up by a name expression compiled after
    the source (``nvrtcAddNameExpression``), where they would not parse."""
    bounds = f"__launch_bounds__({FEW_ROWS_THREADS}, {FEW_ROWS_BLOCKS_AN_SM})"
    functions = [f"custom_kernel_{name}_{t}" + (f"_{s}" if s else "")
                 for t in MLX_TYPE_NAMES.values() for s in (MLX_TYPE_NAMES.values() if quantized else [None])]
    return ("".join(f"\n#define {f} {bounds} {f}" for f in functions) + "\n",
            "".join(f"#undef {f}\n" for f in functions))


def _items(rows, rotary) -> list[int]:
    """Each output's work items: its rows, or pairs of rows where rotated."""
    rotated = rotary[1] if rotary else 0
    return [n // 2 if i < rotated else n for i, n in enumerate(rows)]


def _source(rows, k, bits, group, norm, epilogue, rotary, split, pass_rows) -> str:
    """The kernel's body: ``_rows_a_block`` work items a block, ``split``
    warps an item, for each row of ``x`` (``M``: one where ``pass_rows`` is
    0, else from its shape). The block stages ``pass_rows`` rows of x at a
    time (``stage_x``), each warp takes its part of its item's products for
    those rows, the parts are joined in a fixed order, and the item's first
    warp writes each row (the epilogue). A row is summed in the same order
    in either kernel."""
    n = len(rows)
    per_block = _rows_a_block(split, pass_rows > 0)
    lines = [
        f"constexpr int K = {k}, SPLIT = {split}, THREADS = {per_block * split * 32}, P = {max(pass_rows, 1)};",
        f"__shared__ float squares[{'K * sizeof(T) / 16' if norm else 1}];",
        "__shared__ float2 parts[P][THREADS / 32];",
        "const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, part = warp % SPLIT;",
    ]
    if rotary:
        # the position array lies in host memory (MLX keeps arrays of 8
        # bytes or less there): one thread a block reads it, at the start,
        # and the barrier after staging x hands it to the epilogue
        # (docs/design.md: why this read still slows the launch is open)
        lines += ["__shared__ int position0;", "if (tid == 0) position0 = position[0];"]
    if pass_rows:  # any rows of x; the block takes item after item
        lines += ["int M = 1;", "for (int d = 0; d + 1 < x_ndim; ++d) M *= x_shape[d];",
                  f"int r = blockIdx.x * {per_block} + warp / SPLIT;"]
    else:
        lines += ["constexpr int M = 1;", f"const int r = blockIdx.x * {per_block} + warp / SPLIT;"]
    lines += _prefetch(rows, k, bits, epilogue, rotary)
    stage = _stage(norm, "V")
    if bits:
        # x as floats in padded chunks, each chunk's sum beside (dot_quantized):
        # staged 16 bytes of x a thread, as for dense weights, then each chunk
        # summed by the threads of its pieces
        lines += [
            f"constexpr int V = {128 // bits}, XV = 16 / sizeof(T), XS = K + K / V * 4;",
            "__shared__ alignas(16) float xs[P * XS];",
            "__shared__ float xsum[P * (K / V)];",
        ]
        staging = [
            stage.replace("THREADS, V,", "THREADS, XV,") + "[&](int u, const float* values) {",
            "  float* to = xs + p * XS + u * XV + u * XV / V * 4;  // a piece lies in one chunk",
            "  #pragma unroll",
            "  for (int j = 0; j < XV; ++j) to[j] = values[j];",
            "});",
        ]
        sums = ["__syncthreads();",
                "for (int p = 0; p < here; ++p) chunk_sums<K, THREADS, V, XV>(xs + p * XS, xsum + p * (K / V), tid);"]
    else:
        lines += [
            "constexpr int V = 16 / sizeof(T);",
            "__shared__ alignas(16) unsigned char staged[P * K * sizeof(T)];",
            "T* xs = reinterpret_cast<T*>(staged);",
        ]
        staging = [
            stage + "[&](int u, const float* values) {",
            "  uint4 packed;",
            "  T* out = reinterpret_cast<T*>(&packed);",
            "  #pragma unroll",
            "  for (int j = 0; j < V; ++j) out[j] = round_to<T>(values[j]);",
            "  reinterpret_cast<uint4*>(xs + p * K)[u] = packed;",
            "});",
        ]
    # a pass: its rows of x staged (squares reused by each row's norm), then
    # for each of the block's items the products, the parts joined and each
    # row written
    lines += [
        "for (int m0 = 0; m0 < M; m0 += P) {",
        "const int here = min(P, M - m0);",
        "if (m0) __syncthreads();  // the last pass's reads of xs and parts done",
        "for (int p = 0; p < here; ++p) {",
        "if (p) __syncthreads();",
        *staging,
        "}",
        *(sums if bits else []),
        "__syncthreads();",
    ]
    items = _items(rows, rotary)
    total = rows[0] if epilogue == "swiglu" else sum(items)
    if pass_rows:
        lines += [f"for (int base = blockIdx.x * {per_block}; base < {total}; base += gridDim.x * {per_block}) {{",
                  "r = base + warp / SPLIT;",
                  f"if (SPLIT > 1 && base != blockIdx.x * {per_block}) __syncthreads();  // parts read"]

    def dot(nr, i, row0, j=None, row1=None):
        j = i if j is None else j
        row1 = row0 if row1 is None else row1
        if bits:
            per_row, groups = k * bits // 32, k // group
            args = ", ".join(f"w{w} + size_t({r}) * {per_row}, s{w} + size_t({r}) * {groups}, "
                             f"b{w} + size_t({r}) * {groups}" for w, r in ((i, row0), (j, row1)))
            return f"dot_quantized<S, K, {bits}, {group}, SPLIT, {nr}, P>({args}, xs, xsum, here, lane, part, acc)"
        return (f"dot_dense<T, K, SPLIT, {nr}, P>(w{i} + size_t({row0}) * K, w{j} + size_t({row1}) * K, xs, here, "
                "lane, part, acc)")

    # the products: acc holds one item's (two rows' where paired), a row of x each
    lines.append("float2 acc[P] = {};")
    rotated = rotary[1] if rotary else 0
    half = rotary[0] // 2 if rotary else 0
    pair_row = f"const int a = {_pair_row('pr', rotary[0])};" if rotary else ""
    if epilogue == "swiglu":
        lines.append(f"if (r < {total}) {dot(2, 0, 'r', 1, 'r')};")
    elif epilogue == "add":
        lines.append(f"if (r < {total}) {dot(1, 0, 'r')};")
    else:
        start = 0
        for i in range(n):
            cond = "if" if i == 0 else "else if"
            if i < rotated:  # a pair of a head's rows (a, a + half)
                lines.append(f"{cond} (r < {start + items[i]}) {{ const int pr = r - {start}; {pair_row} "
                             f"{dot(2, i, 'a', i, f'(a + {half})')}; }}")
            else:
                lines.append(f"{cond} (r < {start + items[i]}) {dot(1, i, f'(r - {start})')};")
            start += items[i]
    lines += [
        "if (SPLIT > 1) {  // join the parts, in order",
        "  if (lane == 0) for (int p = 0; p < here; ++p) parts[p][warp] = acc[p];",
        "  __syncthreads();",
        "  for (int p = 0; p < here; ++p) {",
        "    float2 t = make_float2(0.f, 0.f);",
        "    #pragma unroll",
        "    for (int q = 0; q < SPLIT; ++q) { t.x += parts[p][warp - part + q].x; t.y += parts[p][warp - part + q].y; }",
        "    acc[p] = t;",
        "  }",
        "}",
        f"if (r < {total} && part == 0 && lane == 0) for (int p = 0; p < here; ++p) {{",
        "const int m = m0 + p;",
    ]
    lines += _epilogue(rows, epilogue, rotary, "acc[p]")  # by the item's first lane, for row m of x
    lines += ["}", "}"] + (["}"] if pass_rows else [])
    return "\n".join(lines)


def _epilogue(rows, epilogue, rotary, value: str) -> list[str]:
    """Lines writing row ``m`` of x's outputs for item ``r`` from ``value``
    (a float2 expression: a pair's two sums, or a row's in ``.x``)."""
    n = len(rows)
    items = _items(rows, rotary)
    rotated = rotary[1] if rotary else 0
    half = rotary[0] // 2 if rotary else 0
    pair_row = f"const int a = {_pair_row('pr', rotary[0])};" if rotary else ""
    lines = []
    if epilogue == "swiglu":
        lines += [
            f"const float gate = static_cast<float>(round_to<T>({value}.x));",
            f"const float up = static_cast<float>(round_to<T>({value}.y));",
            "const float s = static_cast<float>(round_to<T>(1.f / (1.f + expf(-gate))));",
            f"out0[size_t(m) * {rows[0]} + r] = round_to<T>(static_cast<float>(round_to<T>(gate * s)) * up);",
        ]
    elif epilogue == "add":
        lines += [
            f"const float y = static_cast<float>(round_to<T>({value}.x));",
            f"const size_t at = size_t(m) * {rows[0]} + r;",
            "out0[at] = round_to<T>(y + static_cast<float>(residual[at]));",
        ]
    else:
        # a row of an output: [.., M, rows] flat, or in heads [.., heads, M, dims]
        dims = rotary[0] if rotary else 0
        at = (f"(size_t({{0}}) / {dims} * M + m) * {dims} + ({{0}}) % {dims}" if rotary
              else "size_t(m) * {1} + ({0})")
        start = 0
        for i in range(n):
            cond = "if" if i == 0 else "else if"
            if i < rotated:
                # rounded as the product's output, then rotated as mx.fast.rope rotates the pair
                lines += [
                    f"{cond} (r < {start + items[i]}) {{",
                    f"  const int pr = r - {start}, j = pr % {half}; {pair_row}",
                    f"  const float x1 = static_cast<float>(round_to<T>({value}.x));",
                    f"  const float x2 = static_cast<float>(round_to<T>({value}.y));",
                    "  const float inv_freq = 1.0 / freqs[j];",
                    "  const float theta = static_cast<float>(position0 + m) * inv_freq;",
                    "  const float c = cos(theta), s = sin(theta);",
                    f"  out{i}[{at.format('a', rows[i])}] = round_to<T>(x1 * c - x2 * s);",
                    f"  out{i}[{at.format(f'a + {half}', rows[i])}] = round_to<T>(x1 * s + x2 * c);",
                    "}",
                ]
            else:
                lines.append(f"{cond} (r < {start + items[i]}) "
                             f"out{i}[{at.format(f'r - {start}', rows[i])}] = round_to<T>({value}.x);")
            start += items[i]
    return lines


PREFETCH_BYTES = 16 * 1024  # most of a row prefetched


def _prefetch(rows, k, bits, epilogue, rotary) -> list[str]:
    """Lines prefetching the warp's part of its item's weight rows (both of
    SwiGLU's, both of a rotated pair's), before the block stages ``x``."""
    row_bytes = k * bits // 8 if bits else None
    per_row = k * bits // 32 if bits else "K"

    def fetch(i, row):
        size = min(row_bytes or k * 2, PREFETCH_BYTES)  # dense: sizeof(T) is 2 or 4; 2 keeps to the row
        return f"prefetch_row<{size}, SPLIT>(w{i} + size_t({row}) * {per_row}, lane, part);"

    if epilogue == "swiglu":
        return [f"if (r < {rows[0]}) {{ {fetch(0, 'r')} {fetch(1, 'r')} }}"]
    lines, start = [], 0
    rotated = rotary[1] if rotary else 0
    for i, n in enumerate(_items(rows, rotary)):
        cond = f"{'if' if i == 0 else 'else if'} (r < {start + n})"
        if i < rotated:  # the pair (a, a + half) of a head's rows, as the products read them
            dims, half = rotary[0], rotary[0] // 2
            lines.append(f"{cond} {{ const int a = {_pair_row(f'(r - {start})', dims)}; "
                         f"{fetch(i, 'a')} {fetch(i, f'(a + {half})')} }}")
        else:
            lines.append(f"{cond} {fetch(i, f'(r - {start})')}")
        start += n
    return lines


TENSOR_CORES_MAJOR = 8  # the compute capability with bf16 mma.m16n8k16 (sm_80)
KERNELS_FLAG = "LLM_PTE_GPU_KERNELS"  # "0": MLX's own ops on a CUDA GPU, not the kernels
# "1": a call of a few rows on tensor cores where the GPU has them; its rows
# then round otherwise than one-token steps, so a greedy speculative reply
# may part from plain decoding where two logits are within that rounding
TENSOR_CORES_FLAG = "LLM_PTE_GPU_TENSOR_CORES"


def for_device():
    """What runs ``Block``s on this GPU: the CUDA kernels where MLX runs on
    a CUDA GPU, unless ``LLM_PTE_GPU_KERNELS=0`` asks for MLX's own ops;
    else None (each node its own MLX op). With them a step is about a third
    of the launches, and the host's work a step shorter than the device's
    (``docs/design.md``, "The GPU route"). Their 4-bit products run on
    tensor cores only where ``LLM_PTE_GPU_TENSOR_CORES=1`` asks. Apple
    GPUs: none (``mx.fast.metal_kernel`` has the same shape; not ported)."""
    if os.environ.get(KERNELS_FLAG) == "0" or not mx.cuda.is_available():
        return None
    return CudaKernels(os.environ.get(TENSOR_CORES_FLAG) == "1" and tensor_cores_here())


def tensor_cores_here() -> bool:
    """Whether the default device is a GPU with the tensor cores
    ``tensor_cores.py`` uses."""
    return mx.device_info().get("compute_capability_major", 0) >= TENSOR_CORES_MAJOR
