"""What a decode step costs on this GPU when a layer is made of fewer launches.

A decode step on a GPU is bound by the host's work per op (``step_profile.py``).
This builds a Llama-3.2-1B-shaped step (random weights, a 512-token cache)
directly in MLX, in several designs, and decodes with each the way the
runtime does (step t+1 queued before step t's token is read):

- ``mlx ops``: a layer in MLX's own ops (the runtime's default route):
  norm, three products, head layouts, two RoPEs, the cache writes, SDPA
  over the written keys, the output product and add, norm, gate and up,
  SwiGLU, down and add;
- ``kernels``: the products with their norms and epilogues as the
  decode-step kernels (``runtime/gpu/decode.py``, four a layer), attention
  as above;
- ``kernels + attention``: the same with the cache writes and attention as
  one kernel (``runtime/gpu/attention.py``), RoPE still MLX's;
- ``kernels, heads, RoPE + attention``: the q, k, v kernel writing rotated
  heads (``decode.Rotary``) and the attention kernel: the runtime's route
  on a CUDA GPU, six launches a layer;
- ``one launch a layer``: one custom kernel reading the layer's weights
  (a stand-in computing nothing useful): the floor of the host's share.

Each design prints its step time and tokens/s, median of ``--reps`` runs of
``--steps`` steps, and the copy-bandwidth ceiling of the weights read.

    python benchmarks/gpu_step_designs.py --bits 0 4      # on the GPU machine, with mlx-cuda
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
import time

import mlx.core as mx

from llm_executorch_mlx.runtime.gpu import attention
import gpu_decode_kernels
from llm_executorch_mlx.runtime.gpu.decode import Block, CudaKernels, MlxOps, Rotary, Weight

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, INTER, LAYERS, VOCAB = 2048, 32, 8, 64, 8192, 16, 128256
EPS, BASE, CONTEXT, CAPACITY = 1e-5, 500000.0, 512, 2048


def weight(rows, k, bits, key) -> Weight:
    return gpu_decode_kernels.weight(rows, k, mx.bfloat16, bits, 32, key)


def product(x, w: Weight):
    return MlxOps().launcher(Block((w,)))(x)[0]


@mx.compile
def swiglu(g, u):
    return g * mx.sigmoid(g) * u


class Layer:
    def __init__(self, bits, key):
        keys = mx.random.split(key, 8)
        shapes = ((HEADS * HEAD_DIM, HIDDEN), (KV_HEADS * HEAD_DIM, HIDDEN), (KV_HEADS * HEAD_DIM, HIDDEN),
                  (HIDDEN, HEADS * HEAD_DIM), (INTER, HIDDEN), (INTER, HIDDEN), (HIDDEN, INTER))
        self.q, self.k, self.v, self.o, self.gate, self.up, self.down = (
            weight(n, k, bits, keys[i]) for i, (n, k) in enumerate(shapes))
        self.norms = (mx.ones((HIDDEN,), mx.bfloat16), mx.ones((HIDDEN,), mx.bfloat16))
        pool = (1, KV_HEADS, CAPACITY, HEAD_DIM)
        self.kpool = (mx.random.normal(pool, key=keys[7]) * 0.5).astype(mx.bfloat16)
        self.vpool = mx.random.normal(pool, key=keys[6]).astype(mx.bfloat16)
        if not mx.cuda.is_available():
            return
        kernels = CudaKernels(False)  # a decode step: one row, never on tensor cores
        self.qkv = kernels.launcher(Block((self.q, self.k, self.v), (self.norms[0], EPS)))
        freqs = BASE ** (mx.arange(0, HEAD_DIM, 2) / HEAD_DIM)
        self.heads_rope = kernels.launcher(Block((self.q, self.k, self.v), (self.norms[0], EPS), "",
                                                 Rotary(HEAD_DIM, freqs, 2)))
        self.out = kernels.launcher(Block((self.o,), None, "add"))
        self.mlp = kernels.launcher(Block((self.gate, self.up), (self.norms[1], EPS), "swiglu"))
        self.back = kernels.launcher(Block((self.down,), None, "add"))

    @property
    def arrays(self):
        return [a for w in (self.q, self.k, self.v, self.o, self.gate, self.up, self.down)
                for a in (w.w, w.scales, w.biases) if a is not None]

    def nbytes(self):
        return sum(a.nbytes for a in self.arrays)

    def heads(self, q, k, v):
        return (q.reshape(1, 1, HEADS, HEAD_DIM).transpose(0, 2, 1, 3),
                k.reshape(1, 1, KV_HEADS, HEAD_DIM).transpose(0, 2, 1, 3),
                v.reshape(1, 1, KV_HEADS, HEAD_DIM).transpose(0, 2, 1, 3))

    def rope(self, q, k, offset):
        return (mx.fast.rope(q, HEAD_DIM, traditional=False, base=BASE, scale=1.0, offset=offset),
                mx.fast.rope(k, HEAD_DIM, traditional=False, base=BASE, scale=1.0, offset=offset))

    def mlx_attention(self, q, k, v, pos):
        self.kpool[:, :, pos:pos + 1, :] = k
        self.vpool[:, :, pos:pos + 1, :] = v
        y = mx.fast.scaled_dot_product_attention(q, self.kpool[:, :, :pos + 1], self.vpool[:, :, :pos + 1],
                                                 scale=HEAD_DIM ** -0.5)
        return y.transpose(0, 2, 1, 3).reshape(1, 1, HIDDEN)

    def mlx_ops(self, x, pos, offset):
        h = mx.fast.rms_norm(x, self.norms[0], EPS)
        q, k, v = self.heads(product(h, self.q), product(h, self.k), product(h, self.v))
        q, k = self.rope(q, k, offset)
        x = x + product(self.mlx_attention(q, k, v, pos), self.o)
        h = mx.fast.rms_norm(x, self.norms[1], EPS)
        return x + product(swiglu(product(h, self.gate), product(h, self.up)), self.down)

    def kernels(self, x, pos, offset):
        q, k, v = self.heads(*self.qkv(x))
        q, k = self.rope(q, k, offset)
        x = self.out(self.mlx_attention(q, k, v, pos), x)[0]
        return self.back(self.mlp(x)[0], x)[0]

    def kernels_attention(self, x, pos, offset, fused=False):
        if fused:
            q, k, v = self.heads_rope(x, position=offset)
        else:
            q, k, v = self.heads(*self.qkv(x))
            q, k = self.rope(q, k, offset)
        y = attention.update_and_attend(q, k, v, self.kpool, self.vpool, offset, HEAD_DIM ** -0.5)
        x = self.out(y.reshape(1, 1, HIDDEN), x)[0]
        return self.back(self.mlp(x)[0], x)[0]


@functools.cache
def read_all():
    return mx.fast.cuda_kernel(
    name="pte_step_design_read_all", input_names=["x", "a", "b", "c", "d", "e", "f", "g"], output_names=["out"],
    source="""
    const size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x, n = size_t(gridDim.x) * blockDim.x;
    float t = 0.f;
    const uint4* parts[7] = {(const uint4*)a, (const uint4*)b, (const uint4*)c, (const uint4*)d,
                             (const uint4*)e, (const uint4*)f, (const uint4*)g};
    const size_t sizes[7] = {a_shape[0] * size_t(a_shape[1]), b_shape[0] * size_t(b_shape[1]),
                             c_shape[0] * size_t(c_shape[1]), d_shape[0] * size_t(d_shape[1]),
                             e_shape[0] * size_t(e_shape[1]), f_shape[0] * size_t(f_shape[1]),
                             g_shape[0] * size_t(g_shape[1])};
    for (int p = 0; p < 7; ++p)
      for (size_t j = i; j < sizes[p] * ELEM / 16; j += n) { uint4 w = parts[p][j]; t += (float)(w.x ^ w.w); }
    if (i < 2048) out[i] = static_cast<T>(static_cast<float>(x[i]) + t * 1e-30f);
    """)


def one_launch(layer: Layer, x):
    return read_all()(inputs=[x, *(w.w for w in (layer.q, layer.k, layer.v, layer.o, layer.gate, layer.up,
                                                 layer.down))],
                     template=[("T", x.dtype), ("ELEM", layer.q.w.dtype.size)],
                     output_shapes=[x.shape], output_dtypes=[x.dtype], grid=(132 * 4 * 256, 1, 1),
                     threadgroup=(256, 1, 1))[0]


def decode(layers, embed, design, steps) -> tuple[float, float]:
    """(seconds a step, seconds of host building a step), over ``steps`` steps."""
    tok = mx.array([1], mx.uint32)
    pending, build = None, 0.0
    start = time.perf_counter()
    for s in range(steps):
        pos = CONTEXT + s
        offset = mx.array([pos], mx.int32)
        t0 = time.perf_counter()
        x = embed[tok][None]
        for layer in layers:
            if design == "one launch a layer":
                x = one_launch(layer, x)
            elif design == "mlx ops":
                x = layer.mlx_ops(x, pos, offset)
            elif design == "kernels":
                x = layer.kernels(x, pos, offset)
            else:
                x = layer.kernels_attention(x, pos, offset, fused=design != "kernels + attention")
        h = mx.fast.rms_norm(x, layers[0].norms[0], EPS)
        tok = mx.argmax(h[0] @ embed.T, axis=-1).astype(mx.uint32)
        build += time.perf_counter() - t0
        mx.async_eval(tok)
        if pending is not None:
            pending.item()
        pending = tok
    pending.item()
    return (time.perf_counter() - start) / steps, build / steps


DESIGNS = ("mlx ops", "kernels", "kernels + attention", "kernels, heads, RoPE + attention", "one launch a layer")


def copy_bandwidth() -> float:
    a = mx.zeros((512 * 1024 * 1024,), mx.float32)
    mx.eval(a)
    best = float("inf")
    for _ in range(10):
        mx.synchronize()
        t0 = time.perf_counter()
        b = a + 1
        mx.eval(b)
        best = min(best, time.perf_counter() - t0)
        del b
    return 2 * a.nbytes / best


def check_attention() -> None:
    """The attention kernel against MLX's SDPA, and the pools it wrote."""
    print("| dtype | heads | D | position | max diff / max | pools written | same bits twice |\n|---|---|---|---|---|---|---|")
    for dtype in (mx.bfloat16, mx.float16, mx.float32):
        for heads, kv_heads, d in ((32, 8, 64), (16, 2, 128), (4, 4, 64)):
            for position in (0, 1, 31, 32, 33, 255, 600):
                keys = mx.random.split(mx.random.key(position), 5)
                q = mx.random.normal((1, heads, 1, d), key=keys[0]).astype(dtype)
                k = mx.random.normal((1, kv_heads, 1, d), key=keys[1]).astype(dtype)
                v = mx.random.normal((1, kv_heads, 1, d), key=keys[2]).astype(dtype)
                kpool = mx.random.normal((1, kv_heads, 1024, d), key=keys[3]).astype(dtype)
                vpool = mx.random.normal((1, kv_heads, 1024, d), key=keys[4]).astype(dtype)
                mx.eval(q, k, v, kpool, vpool)
                # MLX's ops on copies of the pools (they write them too)
                ref, _, _ = attention.mlx_op(d ** -0.5)(q, k, v, [kpool + 0], [vpool + 0], position, None)
                mx.eval(ref)
                at = mx.array([position], mx.int32)
                y = attention.update_and_attend(q, k, v, kpool, vpool, at, d ** -0.5)
                y2 = attention.update_and_attend(q, k, v, kpool, vpool, at, d ** -0.5)
                mx.eval(y, y2)
                written = bool(mx.array_equal(kpool[:, :, position:position + 1], k)
                               and mx.array_equal(vpool[:, :, position:position + 1], v))
                diff = (mx.abs(y.astype(mx.float32) - ref.astype(mx.float32)).max()
                        / mx.abs(ref.astype(mx.float32)).max()).item()
                print(f"| {dtype} | {heads}/{kv_heads} | {d} | {position} | {diff:.2e} | {written} "
                      f"| {bool(mx.array_equal(y, y2))} |", flush=True)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--bits", type=int, nargs="+", default=[0, 4], help="0: bf16 weights; 4, 8: MLX affine, groups of 32")
    p.add_argument("--steps", type=int, default=128)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--designs", nargs="+", default=list(DESIGNS))
    p.add_argument("--check", action="store_true", help="first check the attention kernel against MLX's SDPA")
    args = p.parse_args(argv)
    if args.check:
        check_attention()
    bandwidth = copy_bandwidth()
    print(f"# {mx.default_device()}, copy bandwidth {bandwidth / 1e9:.0f} GB/s\n")
    print("| weights | design | step ms | build ms | tok/s | % of the copy ceiling |\n|---|---|---|---|---|---|")
    for bits in args.bits:
        keys = mx.random.split(mx.random.key(0), LAYERS + 1)
        layers = [Layer(bits, keys[i]) for i in range(LAYERS)]
        embed = (mx.random.normal((VOCAB, HIDDEN), key=keys[-1]) * 0.02).astype(mx.bfloat16)
        mx.eval(embed, *[a for layer in layers for a in (*layer.arrays, layer.kpool, layer.vpool)])
        ceiling = bandwidth / (sum(layer.nbytes() for layer in layers) + embed.nbytes)
        for design in args.designs:
            decode(layers, embed, design, 8)  # compiles what the design launches
            runs = [decode(layers, embed, design, args.steps) for _ in range(args.reps)]
            step = statistics.median(r[0] for r in runs)
            build = statistics.median(r[1] for r in runs)
            label = f"{bits}-bit, group 32" if bits else "bf16"
            print(f"| {label} | {design} | {step * 1e3:.2f} | {build * 1e3:.2f} | {1 / step:.0f} "
                  f"| {100 / step / ceiling:.0f}% |", flush=True)
        del layers, embed
    return 0


if __name__ == "__main__":
    sys.exit(main())
