"""A decode step's attention over a flat cache layer as one kernel, on a CUDA GPU.

A few query rows per head (``T`` up to ``MOST_ROWS``: a decode
step's one, a verifying call's few) against the keys and values already
in the layer's pool (``[1, H_kv, capacity, D]``, the first ``position``
slots written) and the call's own keys and values, passed apart; row ``t``
sees those up to its own, ``position + t``. The kernel also writes the
call's keys and values into the pool from ``position`` on, so the cache
write and the attention are one launch instead of two ``slice_update``s,
two reads and MLX's SDPA.

The pools are the kernel's inputs, and it writes them in place: MLX's
custom kernels have no in-place outputs, and copying a pool per step would
cost what the kernel saves. That is sound only where nothing else holds the
pool's old contents lazily; the cache owns its pools and reads them after a
step only through later steps' launches, which MLX orders on its stream
behind this one (each reads the residual stream this one's output feeds).

Each block is one query row of one head, computed as a call of that row
alone would compute it (the same keys in the same order: a row of a
verifying call gets a decode step's bits). A key's row, and its value's,
is read by ``D / 8`` (half precision) or ``D / 4`` (fp32) lanes, 16 bytes each, so a
warp's load brings a few whole rows; each warp takes every few keys, with
``BATCH`` rounds of loads in flight before any is used. The lanes of a key
sum its score with shuffles, and each keeps the softmax of its keys online
in fp32 (running max, sum, and its slice of the weighted values). A warp
then joins its keys' sums (rescaled to the warp's max) and the block its
warps', in a fixed order, so two runs give the same bits. The query is
scaled in fp32 as MLX's SDPA scales it; probabilities and the weighted sum
stay in fp32, and the output is rounded once to the query's dtype.
"""

from __future__ import annotations

import functools

import mlx.core as mx

from ..errors import NeedsHost
from .source import compact

WARPS = 16  # warps a block
BATCH = 8  # rounds of a warp's loads in flight at once
DTYPES = (mx.float32, mx.float16, mx.bfloat16)
# query rows a launch takes: a decode step's one, a verifying call's few
# (speculative decoding) or a short chunk's; the decode-step products
# (decode.py) take as many rows of x. Longer chunks go to MLX's ops.
MOST_ROWS = 8
HEAD_DIMS = (64, 128)

_SOURCE = r"""
constexpr int WARPS = {warps}, BATCH = {batch};
constexpr int E = 16 / sizeof(T);                  // values a 16-byte load brings
constexpr int LANES = D / E;                       // lanes that read one key's row
constexpr int KEYS = 32 / LANES;                   // keys a warp reads at once
constexpr int STRIDE = WARPS * KEYS;               // keys the block reads at once
constexpr unsigned FULL = 0xffffffffu;
const float NEG_INF = -__int_as_float(0x7f800000);
const int M = q_shape[2];                          // query rows
const int h = blockIdx.x % H, t = blockIdx.x / H, kvh = h / (H / HKV);
const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
const int sub = lane % LANES, slot = lane / LANES;  // this lane's 16 bytes of its key's row, and its key
// the position array lies in host memory (MLX keeps arrays of 8 bytes or
// less there): one thread reads it, while the block stages q
__shared__ int position0;
if (tid == 0) position0 = position[0];
__shared__ float qs[D];
for (int d = tid; d < D; d += blockDim.x) qs[d] = static_cast<float>(q[(size_t(h) * M + t) * D + d]) * {scale!r}f;
__syncthreads();
const int first_new = position0;                   // keys already in the pool
const int n = first_new + t;                       // this row's own key, the last it sees
const size_t cap = kpool_shape[2];
const T* K = kpool + size_t(kvh) * cap * D;
const T* V = vpool + size_t(kvh) * cap * D;
const T* kn = k + size_t(kvh) * M * D;             // the call's keys and values: [M, D] a head
const T* vn = v + size_t(kvh) * M * D;

if (h % (H / HKV) == 0 && tid < D) {{              // this row's key and value into the pools
  const_cast<T*>(K)[size_t(n) * D + tid] = kn[size_t(t) * D + tid];
  const_cast<T*>(V)[size_t(n) * D + tid] = vn[size_t(t) * D + tid];
}}
float qv[E];
#pragma unroll
for (int e = 0; e < E; ++e) qv[e] = qs[sub * E + e];

// the call's own keys (first_new on) are read from k and v: other blocks
// may be writing them into the pool. The loop's bounds are the warp's (its lanes
// shuffle together); a lane past the last key computes nothing of use.
float m = NEG_INF, l = 0.f, acc[E];
#pragma unroll
for (int e = 0; e < E; ++e) acc[e] = 0.f;
for (int first = warp * KEYS; first <= n; first += BATCH * STRIDE) {{
  uint4 kb[BATCH], vb[BATCH];
  #pragma unroll
  for (int b = 0; b < BATCH; ++b) {{
    const int j = first + b * STRIDE + slot;
    kb[b] = vb[b] = make_uint4(0, 0, 0, 0);
    if (j <= n) {{
      const bool own = j >= first_new;
      kb[b] = reinterpret_cast<const uint4*>(own ? kn + size_t(j - first_new) * D : K + size_t(j) * D)[sub];
      vb[b] = reinterpret_cast<const uint4*>(own ? vn + size_t(j - first_new) * D : V + size_t(j) * D)[sub];
    }}
  }}
  #pragma unroll
  for (int b = 0; b < BATCH; ++b) {{
    const T* kv = reinterpret_cast<const T*>(&kb[b]);
    float s = 0.f;
    #pragma unroll
    for (int e = 0; e < E; ++e) s += qv[e] * static_cast<float>(kv[e]);
    #pragma unroll
    for (int o = LANES / 2; o > 0; o >>= 1) s += __shfl_xor_sync(FULL, s, o);
    if (first + b * STRIDE + slot <= n) {{
      const float m_new = fmaxf(m, s);
      const float keep = expf(m - m_new), p = expf(s - m_new);
      l = l * keep + p;
      const T* vv = reinterpret_cast<const T*>(&vb[b]);
      #pragma unroll
      for (int e = 0; e < E; ++e) acc[e] = acc[e] * keep + p * static_cast<float>(vv[e]);
      m = m_new;
    }}
  }}
}}

// the warp's keys joined, lanes of one slice of the value together:
// rescaled to the warp's max, then summed
float top = m;
#pragma unroll
for (int o = 16; o >= LANES; o >>= 1) top = fmaxf(top, __shfl_xor_sync(FULL, top, o));
const float rescale = m == NEG_INF ? 0.f : expf(m - top);
l *= rescale;
#pragma unroll
for (int e = 0; e < E; ++e) acc[e] *= rescale;
#pragma unroll
for (int o = 16; o >= LANES; o >>= 1) {{
  l += __shfl_xor_sync(FULL, l, o);
  #pragma unroll
  for (int e = 0; e < E; ++e) acc[e] += __shfl_xor_sync(FULL, acc[e], o);
}}

__shared__ float ms[WARPS], ls[WARPS], accs[WARPS][D];
if (lane == 0) {{ ms[warp] = top; ls[warp] = l; }}
if (slot == 0) {{
  #pragma unroll
  for (int e = 0; e < E; ++e) accs[warp][sub * E + e] = acc[e];
}}
__syncthreads();
if (tid < D) {{
  float most = NEG_INF;
  for (int w = 0; w < WARPS; ++w) most = fmaxf(most, ms[w]);
  float total = 0.f, y = 0.f;
  for (int w = 0; w < WARPS; ++w) {{
    if (ms[w] == NEG_INF) continue;              // a warp that had no keys
    const float c = expf(ms[w] - most);
    total += ls[w] * c;
    y += accs[w][tid] * c;
  }}
  out[(size_t(h) * M + t) * D + tid] = static_cast<T>(y / total);
}}
"""


def takes(q: mx.array, k: mx.array, v: mx.array) -> bool:
    """Whether this call is one the kernel's op takes: one batch, up to
    ``MOST_ROWS`` query rows, whole groups of query heads per key head (the
    op itself sends pools the kernel cannot read to MLX's ops)."""
    return (q.ndim == k.ndim == 4 and k.shape == v.shape and q.shape[0] == k.shape[0] == 1
            and 0 < q.shape[2] == k.shape[2] <= MOST_ROWS and q.shape[3] == k.shape[3] and 0 < k.shape[1]
            and q.shape[1] % k.shape[1] == 0 and q.dtype == k.dtype == v.dtype)


def fits(q: mx.array, pool: mx.array) -> bool:
    """Whether the kernel reads this pool for this query: a head size it
    has, the pool flat in the query's dtype."""
    return q.shape[3] in HEAD_DIMS and q.dtype in DTYPES and pool.dtype == q.dtype and pool.ndim == 4


def kernel_op(scale: float):
    """``Plan.update_and_attend``'s run with the kernel, for pools it reads;
    MLX's ops (``mlx_op``) for the others."""
    fallback = mlx_op(scale)

    def run(q, k, v, K, V, position, position_array):
        if len(K) != 1 or not fits(q, K[0]):
            return fallback(q, k, v, K, V, position, position_array)
        at = mx.array(position, dtype=mx.int32) if position_array is None else position_array
        return update_and_attend(q, k, v, K[0], V[0], at, scale), K, V

    return run


def mlx_op(scale: float):
    """The same op in MLX's ops: the pools written with ``slice_update``,
    then SDPA over their first ``position + T`` keys, each query row seeing
    those up to its own (MLX's causal mask ends at the last key)."""

    def run(q, k, v, K, V, position, position_array):
        if position is None:  # a compiled trace's call (compiled_runs.py): these writes need it on the host
            raise NeedsHost("MLX's ops write the pools at a position on the host")
        (kpool,), (vpool,) = K, V
        end = position + k.shape[2]
        kpool[:, :, position:end] = k.astype(kpool.dtype)
        vpool[:, :, position:end] = v.astype(vpool.dtype)
        keys, values = kpool[:, :, :end], vpool[:, :, :end]
        y = mx.fast.scaled_dot_product_attention(q, keys.astype(q.dtype), values.astype(q.dtype), scale=scale,
                                                 mask="causal" if q.shape[2] > 1 else None)
        return y, [kpool], [vpool]

    return run


@functools.lru_cache(maxsize=None)
def _kernel(heads: int, kv_heads: int, head_dim: int, scale: float):
    source = compact(_SOURCE.format(warps=WARPS, batch=BATCH, scale=float(scale)))
    constants = f"constexpr int H = {heads}, HKV = {kv_heads}, D = {head_dim};\n"
    return mx.fast.cuda_kernel(name=f"pte_decode_attention_{heads}_{kv_heads}_{head_dim}",
                               input_names=["q", "k", "v", "kpool", "vpool", "position"],
                               output_names=["out"], source=source, header=constants)


def update_and_attend(q, k, v, kpool, vpool, position, scale: float) -> mx.array:
    """``[1, H, T, D]``: the call's queries against the pools' first
    ``position`` keys and its own ``k``, ``v`` (``[1, H_kv, T, D]``, row
    ``t`` seeing those up to its own), which it writes into the pools from
    ``position`` on (an int32 array of one)."""
    heads, kv_heads, head_dim = q.shape[1], k.shape[1], q.shape[3]
    kernel = _kernel(heads, kv_heads, head_dim, float(scale))
    return kernel(inputs=[q, k, v, kpool, vpool, position], template=[("T", q.dtype)],
                  output_shapes=[q.shape], output_dtypes=[q.dtype],
                  grid=(heads * q.shape[2] * WARPS * 32, 1, 1), threadgroup=(WARPS * 32, 1, 1))[0]

