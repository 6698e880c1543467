"""A decode step's attention over a flat cache layer as one kernel, on a CUDA GPU.

One query row per head (``T`` = 1) against the keys and values already in
the layer's pool (``[1, H_kv, capacity, D]``, the first ``position`` slots
written) and this step's own key and value, passed apart. The kernel also
writes this step's key and value into the pool at ``position``, so the
step's cache write and its attention are one launch instead of two
``slice_update``s, two reads and MLX's SDPA.

The pools are the kernel's inputs, and it writes them in place: MLX's
custom kernels have no in-place outputs, and copying a pool per step would
cost what the kernel saves. That is sound only where nothing else holds the
pool's old contents lazily; the cache owns its pools and reads them after a
step only through later steps' launches, which MLX orders on its stream
behind this one (each reads the residual stream this one's output feeds).

Each block is one query head, and each of its lanes takes every
``WARPS * 32``-th key: the whole dot product over ``D`` and the whole value
row, each row read in 16-byte loads that are all in flight at once, with a
softmax of its own kept online in fp32 (its running max, sum and weighted
values). So no lane waits on another while it reads. A warp then joins its
lanes' sums (rescaled to the warp's max, then summed in halves that each
lane passes on, five shuffles deep) and the block its warps', in a fixed
order, so two runs give the same bits. The query is scaled in fp32 as MLX's
SDPA scales it; probabilities and the weighted sum stay in fp32, and the
output is rounded once to the query's dtype.
"""

from __future__ import annotations

import functools

import mlx.core as mx

WARPS = 8  # warps a block; a lane takes every (WARPS * 32)-th key
DTYPES = (mx.float32, mx.float16, mx.bfloat16)
HEAD_DIMS = (64, 128)

_HEADER = r"""
// One of a warp's five halvings: a lane keeps the upper or lower HALF of
// acc[0, 2 HALF) (lane bit `o` says which), adds its partner's copy of that
// half, and leaves it in acc[0, HALF); returns where its half began.
template <int D, int HALF>
__device__ inline int halve(float (&acc)[D], int lane, int o) {
  const bool upper = lane & o;
  #pragma unroll
  for (int i = 0; i < HALF; ++i) {
    const float mine = upper ? acc[i + HALF] : acc[i], theirs = upper ? acc[i] : acc[i + HALF];
    acc[i] = mine + __shfl_xor_sync(0xffffffffu, theirs, o);
  }
  return upper ? HALF : 0;
}
"""

_SOURCE = r"""
constexpr int WARPS = {warps};
constexpr int E = 16 / sizeof(T);                  // values a 16-byte load brings
constexpr int LOADS = D / E;                       // loads a key's or a value's row takes
constexpr unsigned FULL = 0xffffffffu;
const float NEG_INF = -__int_as_float(0x7f800000);
const int h = blockIdx.x, kvh = h / (H / HKV);
const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
const int n = position[0];                         // keys already in the pool
const size_t cap = kpool_shape[2];
const T* K = kpool + size_t(kvh) * cap * D;
const T* V = vpool + size_t(kvh) * cap * D;
const T* kn = k + kvh * D;
const T* vn = v + kvh * D;

if (h % (H / HKV) == 0 && tid < D) {{              // this step's key and value into the pools
  const_cast<T*>(K)[size_t(n) * D + tid] = kn[tid];
  const_cast<T*>(V)[size_t(n) * D + tid] = vn[tid];
}}

__shared__ float qs[D];
for (int d = tid; d < D; d += blockDim.x) qs[d] = static_cast<float>(q[h * D + d]) * {scale!r}f;
__syncthreads();

// this lane's keys, each read whole (key n, this step's own, from k and v:
// another block may be writing it into the pool)
float m = NEG_INF, l = 0.f, acc[D];
#pragma unroll
for (int i = 0; i < D; ++i) acc[i] = 0.f;
for (int j = tid; j <= n; j += WARPS * 32) {{
  const uint4* kr = reinterpret_cast<const uint4*>(j == n ? kn : K + size_t(j) * D);
  const uint4* vr = reinterpret_cast<const uint4*>(j == n ? vn : V + size_t(j) * D);
  float s = 0.f;
  #pragma unroll
  for (int c = 0; c < LOADS; ++c) {{
    const uint4 packed = kr[c];
    const T* kv = reinterpret_cast<const T*>(&packed);
    #pragma unroll
    for (int e = 0; e < E; ++e) s += qs[c * E + e] * static_cast<float>(kv[e]);
  }}
  const float m_new = fmaxf(m, s);
  const float keep = expf(m - m_new), p = expf(s - m_new);
  l = l * keep + p;
  #pragma unroll
  for (int c = 0; c < LOADS; ++c) {{
    const uint4 packed = vr[c];
    const T* vv = reinterpret_cast<const T*>(&packed);
    #pragma unroll
    for (int e = 0; e < E; ++e) acc[c * E + e] = acc[c * E + e] * keep + p * static_cast<float>(vv[e]);
  }}
  m = m_new;
}}

// the warp's lanes joined: rescaled to the warp's max, then summed in
// halves: at each of five shuffles a lane keeps one half of what it holds
// and adds its partner's copy of that half, so each lane ends with D / 32
// of the sums, from dim `base` on
float top = m;
#pragma unroll
for (int o = 16; o > 0; o >>= 1) top = fmaxf(top, __shfl_xor_sync(FULL, top, o));
const float rescale = m == NEG_INF ? 0.f : expf(m - top);
l *= rescale;
#pragma unroll
for (int o = 16; o > 0; o >>= 1) l += __shfl_xor_sync(FULL, l, o);
#pragma unroll
for (int i = 0; i < D; ++i) acc[i] *= rescale;
int base = halve<D, D / 2>(acc, lane, 16);
base += halve<D, D / 4>(acc, lane, 8);
base += halve<D, D / 8>(acc, lane, 4);
base += halve<D, D / 16>(acc, lane, 2);
base += halve<D, D / 32>(acc, lane, 1);

__shared__ float ms[WARPS], ls[WARPS], accs[WARPS][D];
if (lane == 0) {{ ms[warp] = top; ls[warp] = l; }}
#pragma unroll
for (int i = 0; i < D / 32; ++i) accs[warp][base + i] = acc[i];
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
  out[h * D + tid] = static_cast<T>(y / total);
}}
"""


def takes(q: mx.array, k: mx.array, v: mx.array) -> bool:
    """Whether this step is one the kernel's op takes: one batch, one query
    row, whole groups of query heads per key head (the op itself sends pools
    the kernel cannot read to MLX's ops)."""
    return (q.ndim == k.ndim == 4 and k.shape == v.shape and q.shape[0] == k.shape[0] == 1
            and q.shape[2] == k.shape[2] == 1 and q.shape[3] == k.shape[3] and 0 < k.shape[1]
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
    then SDPA over their first ``position + 1`` keys."""

    def run(q, k, v, K, V, position, position_array):
        (kpool,), (vpool,) = K, V
        kpool[:, :, position:position + 1] = k.astype(kpool.dtype)
        vpool[:, :, position:position + 1] = v.astype(vpool.dtype)
        keys, values = kpool[:, :, :position + 1], vpool[:, :, :position + 1]
        y = mx.fast.scaled_dot_product_attention(q, keys.astype(q.dtype), values.astype(q.dtype), scale=scale)
        return y, [kpool], [vpool]

    return run


@functools.lru_cache(maxsize=None)
def _kernel(heads: int, kv_heads: int, head_dim: int, scale: float):
    source = _SOURCE.format(warps=WARPS, scale=float(scale))
    constants = f"constexpr int H = {heads}, HKV = {kv_heads}, D = {head_dim};\n"
    return mx.fast.cuda_kernel(name=f"pte_decode_attention_{heads}_{kv_heads}_{head_dim}",
                               input_names=["q", "k", "v", "kpool", "vpool", "position"],
                               output_names=["out"], source=source, header=_HEADER + constants)


def update_and_attend(q, k, v, kpool, vpool, position, scale: float) -> mx.array:
    """``[1, H, 1, D]``: the step's query against the pools' first
    ``position`` keys and its own ``k``, ``v`` (``[1, H_kv, 1, D]``), which
    it writes into the pools at ``position`` (an int32 array of one)."""
    heads, kv_heads, head_dim = q.shape[1], k.shape[1], q.shape[3]
    kernel = _kernel(heads, kv_heads, head_dim, float(scale))
    return kernel(inputs=[q, k, v, kpool, vpool, position], template=[("T", q.dtype)],
                  output_shapes=[q.shape], output_dtypes=[q.dtype],
                  grid=(heads * WARPS * 32, 1, 1), threadgroup=(WARPS * 32, 1, 1))[0]

