"""The decode-step kernels (``runtime/gpu/decode.py``) against MLX's own ops, on a CUDA GPU.

For each kind of block a decode step groups (an RMSNorm and the products
reading it, with or without SwiGLU after; a product and its residual add),
weights dense (fp32, fp16, bf16) or affine-quantized in MLX's layout (4 and 8
bits, groups of 32, 64 and 128, packed by ``mx.quantize``), on odd and
real-model shapes:

- **agreement**: the kernel's outputs against the same block in MLX's ops
  (``decode.MlxOps``: ``mx.fast.rms_norm``, ``matmul`` /
  ``quantized_matmul``, the epilogue's ops, ``mx.fast.rope`` for heads
  rotated), the largest difference relative to the largest output, within
  each dtype's rounding;
- **determinism**: two launches give the same bits;
- **a few rows**: a launch of ``FEW`` rows of ``x`` (a verifying call's)
  agrees with MLX's ops as one row does, and each of its rows has the bits
  a launch of that row alone gives (at its own position where rotated);
  where the GPU has tensor cores, the same launch on them too
  (``LLM_PTE_GPU_TENSOR_CORES=1``, ``tensor_cores.py``: 4-bit weights,
  16-bit x), each row against a one-row launch on them;
  the attention kernel's rows likewise, against one-row launches at
  successive positions and against MLX's SDPA with a causal mask;
- **time** (``--time``): a decode step's four blocks at Llama-3.2-1B's shape,
  each launched ``--iters`` times and evaluated at once (GPU time with the
  host's encoding overlapped), and the bandwidth the weights' bytes imply;
  for one row of x and for ``FEW``, on the route the runtime takes
  (``decode.for_device``: tensor cores where ``LLM_PTE_GPU_TENSOR_CORES=1``).

    python benchmarks/gpu_decode_kernels.py --time     # on the GPU machine, with mlx-cuda
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time

# MLX's CUDA backend multiplies fp32 in TF32 unless told not to (read once,
# at its first use); the reference for the kernels' fp32 sums is fp32
os.environ.setdefault("MLX_ENABLE_TF32", "0")

import mlx.core as mx  # noqa: E402

from llm_executorch_mlx.runtime.gpu import attention  # noqa: E402
from llm_executorch_mlx.runtime.gpu.decode import (  # noqa: E402
    Block, CudaKernels, MlxOps, Rotary, Weight, fits, for_device, tensor_cores_here)

# largest |kernel - MLX| / largest |MLX output|: a few units in the last place of each dtype
TOLERANCE = {mx.float32: 1e-5, mx.float16: 4e-3, mx.bfloat16: 2e-2}
NAMES = {mx.float32: "fp32", mx.float16: "fp16", mx.bfloat16: "bf16"}


def weight(rows: int, k: int, dtype, bits: int, group: int, key) -> Weight:
    w = (mx.random.normal((rows, k), key=key) * 0.02).astype(dtype)
    if not bits:
        return Weight(w)
    wq, scales, biases = mx.quantize(w, group_size=group, bits=bits)
    return Weight(wq, scales, biases, bits, group)


KINDS = ((0, 0), (4, 32), (4, 64), (4, 128), (8, 32), (8, 64), (8, 128))  # (bits, group); 0 bits: dense
REAL, ODD = (2048, (2048, 512, 512)), (1536, (100, 36, 36))  # (K, rows): Llama-3.2-1B's q, k, v; odd rows
LONG = (8192, (300,))  # Llama-3.2-1B's down product's K (a row split between warps), odd rows
# SmolLM2-135M's q, k, v and down product: a K that is no whole number of a tensor-core tile's 128 values
SMALL, SMALL_DOWN = (576, (576, 192, 192)), (1536, (576,))
FEW = 5  # rows of x in a few-row launch: more than some blocks stage at once (several passes)


def cases():
    """``(name, dtype, bits, group, k, rows, norm, epilogue, head size)``:
    every weight kind in bf16 (a GPU's dtype for half-precision files) at a
    real and an odd shape, the real one also split into heads of 64 with
    the first two rotated; fp16 and fp32 at the odd one; every kind in bf16
    at a long K (a product and its add, SwiGLU's pair of rows); a quantized
    product alone (an LM head's kernel, ``ops/quant.py``); 4-bit blocks of
    SmolLM2-135M's shapes in bf16 and fp16, and Llama-3.2-1B's down product
    (the tensor cores' route for several rows)."""
    chosen = [(mx.bfloat16, kind, shape) for kind in KINDS for shape in (REAL, ODD)]
    chosen += [(mx.float16, kind, ODD) for kind in ((0, 0), (4, 32))]
    chosen += [(mx.float32, kind, ODD) for kind in ((0, 0), (8, 128))]
    for dtype, (bits, group), (k, rows) in chosen:
        label = f"{NAMES[dtype]} {f'q{bits}g{group}' if bits else 'dense'} K={k}"
        yield f"{label} norm+{len(rows)}", dtype, bits, group, k, rows, True, "", 0
        if (k, rows) == REAL:
            yield f"{label} norm+{len(rows)}+rope", dtype, bits, group, k, rows, True, "", 64
        yield f"{label} norm+2+swiglu", dtype, bits, group, k, (rows[0],) * 2, True, "swiglu", 0
        yield f"{label} 1+add", dtype, bits, group, k, rows[:1], False, "add", 0
        if bits:  # a product alone: a quantized LM head's kernel
            yield f"{label} 1", dtype, bits, group, k, rows[:1], False, "", 0
    for bits, group in KINDS:
        k, rows = LONG
        label = f"bf16 {f'q{bits}g{group}' if bits else 'dense'} K={k}"
        yield f"{label} 1+add", mx.bfloat16, bits, group, k, rows, False, "add", 0
        yield f"{label} norm+2+swiglu", mx.bfloat16, bits, group, k, rows * 2, True, "swiglu", 0
    yield "bf16 dense K=576 2 products", mx.bfloat16, 0, 0, 576, (192, 192), False, "", 0
    for dtype, group in ((mx.bfloat16, 32), (mx.bfloat16, 64), (mx.float16, 32)):
        label = f"{NAMES[dtype]} q4g{group}"
        (k, rows), (down_k, down_rows) = SMALL, SMALL_DOWN
        yield f"{label} K={k} norm+3+rope", dtype, 4, group, k, rows, True, "", 64
        yield f"{label} K={k} norm+2+swiglu", dtype, 4, group, k, (down_k,) * 2, True, "swiglu", 0
        yield f"{label} K={down_k} 1+add", dtype, 4, group, down_k, down_rows, False, "add", 0
    # Llama-3.2-1B's gate and up, and its down product: on tensor cores, the first a launch of
    # unsplit tiles, the second a block staging fewer rows than FEW at once
    yield "bf16 q4g32 K=2048 norm+2+swiglu 8192", mx.bfloat16, 4, 32, 2048, (8192, 8192), True, "swiglu", 0
    yield "bf16 q4g32 K=8192 1+add", mx.bfloat16, 4, 32, 8192, (2048,), False, "add", 0
    yield "fp16 dense K=576 2 products+rope D=128", mx.float16, 0, 0, 576, (256, 128), False, "", 128


def check(args) -> list[dict]:
    kernels, ops = CudaKernels(False), MlxOps()
    tensor = CudaKernels(True) if tensor_cores_here() else None  # LLM_PTE_GPU_TENSOR_CORES=1's few rows
    results = []
    key = mx.random.key(args.seed)
    for name, dtype, bits, group, k, rows, norm, epilogue, head in cases():
        keys = mx.random.split(key, len(rows) + 4)
        key = keys[0]
        if args.only and not re.search(args.only, name):
            continue
        weights = tuple(weight(n, k, dtype, bits, group, keys[1 + i]) for i, n in enumerate(rows))
        norm_weight = (1 + 0.1 * mx.random.normal((k,), key=keys[-3])).astype(dtype) if norm else None
        # Llama-3's RoPE base; a position far enough on that the angles wrap
        rotary = Rotary(head, 500000.0 ** (mx.arange(0, head, 2) / head), 2) if head else None
        position = mx.array(517, mx.int32) if head else None
        block = Block(weights, (norm_weight, 1e-5) if norm else None, epilogue, rotary)
        assert fits(block), name
        x = mx.random.normal((1, 1, k), key=keys[-2]).astype(dtype)
        residual = mx.random.normal((1, 1, rows[0]), key=keys[-1]).astype(dtype) if epilogue == "add" else None
        ours = kernels.launcher(block)(x, residual, position)
        again = kernels.launcher(block)(x, residual, position)
        reference = ops.launcher(block)(x, residual, position)
        mx.eval(ours, again, reference)
        error = max(float(mx.abs(a.astype(mx.float32) - b.astype(mx.float32)).max()) for a, b in zip(ours, reference))
        scale = max(float(mx.abs(b.astype(mx.float32)).max()) for b in reference)
        same = all(bool(mx.array_equal(a, b)) for a, b in zip(ours, again))
        shapes = all(a.shape == b.shape and a.dtype == b.dtype for a, b in zip(ours, reference))
        ok = shapes and same and error <= TOLERANCE[dtype] * scale
        results.append({"case": name, "relative_error": error / scale, "deterministic": same, "ok": ok})
        print(f"{'ok  ' if ok else 'FAIL'} {name:40s} error/scale {error / scale:.2e}"
              f"{'' if same else '  NOT DETERMINISTIC'}{'' if shapes else '  SHAPES DIFFER'}", flush=True)
        results.append(check_rows(f"{name} x{FEW}", block, kernels, ops, dtype, position, keys[-2]))
        if tensor is not None and tensor.on_tensor_cores(block, dtype):
            results.append(check_rows(f"{name} x{FEW}", block, tensor, ops, dtype, position, keys[-2]))
    if not args.only or re.search(args.only, "attention"):
        results.append(check_attention(args.seed))
    return results


def check_rows(name: str, block: Block, kernels, ops, dtype, position, key) -> dict:
    """``FEW`` rows of x in one launch: against MLX's ops, and row by row
    (bitwise) against one-row launches on the same route."""
    x = mx.random.normal((1, FEW, block.k), key=key).astype(dtype)
    residual = mx.random.normal((1, FEW, block.rows), key=key).astype(dtype) if block.epilogue == "add" else None
    launch = kernels.launcher(block)
    ours = launch(x, residual, position)
    reference = ops.launcher(block)(x, residual, position)
    axis = 2 if block.rotary else 1  # rows of an output in heads: [1, heads, rows, dims]
    mma = kernels.on_tensor_cores(block, dtype)
    alone = [launch(x[:, m:m + 1], None if residual is None else residual[:, m:m + 1],
                    None if position is None else position + m) for m in range(FEW)]
    singles = [mx.concatenate([a[i] for a in alone], axis=axis) for i in range(len(ours))]
    mx.eval(ours, reference, singles)
    error = max(float(mx.abs(a.astype(mx.float32) - b.astype(mx.float32)).max()) for a, b in zip(ours, reference))
    scale = max(float(mx.abs(b.astype(mx.float32)).max()) for b in reference)
    same = all(a.shape == b.shape and bool(mx.array_equal(a, b)) for a, b in zip(ours, singles))
    ok = same and error <= TOLERANCE[dtype] * scale
    print(f"{'ok  ' if ok else 'FAIL'} {name + (' tensor cores' if mma else ''):40s} error/scale {error / scale:.2e}"
          f"{'' if same else '  ROWS DIFFER FROM THEIR LAUNCHES ALONE'}", flush=True)
    return {"case": name, "tensor_cores": mma, "relative_error": error / scale, "rows_as_alone": same, "ok": ok}


def check_attention(seed: int) -> dict:
    """The attention kernel over ``FEW`` query rows after 300 cached keys
    (Llama-3.2-1B's heads, bf16): against one-row launches at positions
    300, 301, ... (bitwise) and MLX's SDPA with a causal mask."""
    heads, kv_heads, d, cached, cap = 32, 8, 64, 300, 512
    keys = mx.random.split(mx.random.key(seed + 1), 5)
    q = mx.random.normal((1, heads, FEW, d), key=keys[0]).astype(mx.bfloat16)
    k, v = (mx.random.normal((1, kv_heads, FEW, d), key=keys[i]).astype(mx.bfloat16) for i in (1, 2))

    def pools():  # fresh buffers each time: the kernel writes them in place
        return [mx.random.normal((1, kv_heads, cap, d), key=keys[i]).astype(mx.bfloat16) for i in (3, 4)]

    at = mx.array([cached], mx.int32)
    kp, vp = pools()
    mx.eval(kp, vp)
    ours = attention.update_and_attend(q, k, v, kp, vp, at, d ** -0.5)
    mx.eval(ours)
    kp1, vp1 = pools()
    mx.eval(kp1, vp1)
    alone = []
    for t in range(FEW):
        row = attention.update_and_attend(q[:, :, t:t + 1], k[:, :, t:t + 1], v[:, :, t:t + 1], kp1, vp1,
                                          mx.array([cached + t], mx.int32), d ** -0.5)
        mx.eval(row)
        alone.append(row)
    kr, vr = pools()
    reference, (kr,), _ = attention.mlx_op(d ** -0.5)(q, k, v, [kr], [vr], cached, None)
    mx.eval(reference, kr)
    same = bool(mx.array_equal(ours, mx.concatenate(alone, axis=2)))
    written = bool(mx.array_equal(kp[:, :, :cached + FEW], kr[:, :, :cached + FEW]))
    error = float(mx.abs(ours.astype(mx.float32) - reference.astype(mx.float32)).max())
    scale = float(mx.abs(reference.astype(mx.float32)).max())
    ok = same and written and error <= TOLERANCE[mx.bfloat16] * scale
    name = f"attention bf16 {heads}/{kv_heads} heads D={d} x{FEW}"
    print(f"{'ok  ' if ok else 'FAIL'} {name:40s} error/scale {error / scale:.2e}"
          f"{'' if same else '  ROWS DIFFER FROM ONE-ROW LAUNCHES'}{'' if written else '  POOL WRITTEN WRONG'}",
          flush=True)
    return {"case": name, "relative_error": error / scale, "rows_as_alone": same, "ok": ok}


def timing(args) -> list[dict]:
    """A 1B decode step's blocks, ``iters`` launches then one evaluation."""
    k, inter, q, kv = 2048, 8192, 2048, 512
    out = []
    for label, bits in (("bf16", 0), ("4-bit g32", 4)):
        keys = mx.random.split(mx.random.key(1), 8)
        mk = lambda rows, kk, i: weight(rows, kk, mx.bfloat16, bits, 32, keys[i])  # noqa: E731
        blocks = {
            "norm+q,k,v": (Block((mk(q, k, 0), mk(kv, k, 1), mk(kv, k, 2)), (mx.ones((k,), mx.bfloat16), 1e-5)), k),
            "norm+q,k,v+rope": (Block((mk(q, k, 0), mk(kv, k, 1), mk(kv, k, 2)), (mx.ones((k,), mx.bfloat16), 1e-5),
                                      "", Rotary(64, 500000.0 ** (mx.arange(0, 64, 2) / 64), 2)), k),
            "o+add": (Block((mk(k, q, 3),), None, "add"), q),
            "norm+gate,up+swiglu": (Block((mk(inter, k, 4), mk(inter, k, 5)), (mx.ones((k,), mx.bfloat16), 1e-5),
                                          "swiglu"), k),
            "down+add": (Block((mk(k, inter, 6),), None, "add"), inter),
        }
        if bits:  # Llama-3's vocabulary: the LM head, the largest product
            blocks["LM head"] = (Block((mk(128256, k, 7),)), k)
        for (name, (block, kk)), rows in ((item, rows) for item in blocks.items() for rows in (1, FEW)):
            x = mx.random.normal((1, rows, kk)).astype(mx.bfloat16)
            residual = (mx.random.normal((1, rows, block.rows)).astype(mx.bfloat16) if block.epilogue == "add"
                        else None)
            position = mx.array(517, mx.int32) if block.rotary else None
            nbytes = sum(w.w.nbytes + (w.scales.nbytes + w.biases.nbytes if w.bits else 0) for w in block.weights)
            name = name if rows == 1 else f"{name} x{rows}"
            row = {"weights": label, "block": name, "bytes": nbytes}
            for engine, runner in (("kernel", for_device()), ("mlx_ops", MlxOps())):
                launch = runner.launcher(block)
                mx.eval(launch(x, residual, position))
                best = float("inf")
                for _ in range(args.reps):
                    mx.synchronize()
                    t0 = time.perf_counter()
                    ys = [launch(x, residual, position) for _ in range(args.iters)]
                    mx.eval(ys)
                    mx.synchronize()
                    best = min(best, (time.perf_counter() - t0) / args.iters)
                row[f"{engine}_us"] = best * 1e6
                row[f"{engine}_gbps"] = nbytes / best / 1e9
            out.append(row)
            print(f"{label:10s} {name:25s} {nbytes / 2**20:7.1f} MiB  kernel {row['kernel_us']:7.1f} us "
                  f"({row['kernel_gbps']:6.0f} GB/s)  MLX ops {row['mlx_ops_us']:7.1f} us "
                  f"({row['mlx_ops_gbps']:6.0f} GB/s)", flush=True)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--time", action="store_true", help="also time a 1B decode step's blocks")
    p.add_argument("--iters", type=int, default=200)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--only", help="check only the cases whose name matches this regex")
    p.add_argument("--json", help="write the results here")
    args = p.parse_args(argv)
    if not mx.cuda.is_available():
        print("gpu_decode_kernels.py needs MLX on a CUDA GPU (mlx[cuda12] or mlx[cuda13])", file=sys.stderr)
        return 2
    if for_device() is None:
        print("gpu_decode_kernels.py checks the decode-step kernels: unset LLM_PTE_GPU_KERNELS=0", file=sys.stderr)
        return 2
    results = {"mlx": mx.__version__, "device": str(mx.default_device()), "checks": check(args)}
    if args.time:
        results["timing"] = timing(args)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(results, fh, indent=1)
    failed = [r["case"] for r in results["checks"] if not r["ok"]]
    print(f"{len(results['checks']) - len(failed)} of {len(results['checks'])} cases agree with MLX's ops")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
