"""Compile the runtime's CUDA kernels with nvcc, on a machine without a GPU.

    python scripts/cuda_kernels_compile.py --mlx-src MLX_CHECKOUT [--nvcc nvcc] [--arch sm_90a]

A GPU is lent for minutes at a time; a kernel that does not compile, or
spills its registers, should not cost one of them. This makes every
kernel ``runtime/gpu/decode.py`` (with ``tensor_cores.py``) and
``runtime/gpu/attention.py`` launch (the decode blocks of ``benchmarks/gpu_decode_kernels.py``'s cases, the
attention kernel in every dtype at head sizes 64 and 128), writes each as
MLX's CUDA backend would hand it to NVRTC (``mx.fast.cuda_kernel``'s
wrapper: ``mlx/backend/cuda/custom_kernel.cpp``, ``build_kernel``), and
compiles it with ``nvcc -cubin`` against the device headers of an MLX
source checkout of the installed version (``MLX_CHECKOUT/mlx/backend/cuda/
device``), printing each kernel's registers and spills. Exit status 1 if
any fails to compile or needs more registers for its block than an SM has
(MLX declares no launch bounds, so ptxas caps only the few-row SwiGLU kernel's, which ``decode.py``
adds through a macro on the function's name, and that must fit ``FEW_ROWS_BLOCKS_AN_SM`` blocks an SM)
or if the kernel's name no longer parses where NVRTC looks it up. Nothing runs: a GPU still checks what they compute
(``gpu_decode_kernels.py``, ``gpu_step_designs.py --check``).
"""

from __future__ import annotations

import argparse
import pathlib
import re
import subprocess
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]

import mlx.core as mx  # noqa: E402

from llm_executorch_mlx.runtime.gpu.decode import FEW_ROWS_BLOCKS_AN_SM, MLX_TYPE_NAMES  # noqa: E402

CUDA_TYPES = {mx.float32: "float", mx.float16: "__half", mx.bfloat16: "__nv_bfloat16",
              mx.int32: "int32_t", mx.uint32: "uint32_t"}
SM_REGISTERS = 65536  # a block's threads share an SM's register file (every arch since sm_50)


class Recorded:
    """Stands in for ``mx.fast.cuda_kernel``: each call records the source
    MLX would compile and returns zeros of the output shapes."""

    sources: list[tuple[str, str]] = []

    def __init__(self, name, input_names, output_names, source, header="", **_):
        self.name, self.inputs, self.outputs, self.source, self.header = name, input_names, output_names, source, header

    def __call__(self, inputs, template, output_shapes, output_dtypes, grid, threadgroup, **_):
        function = "custom_kernel_" + self.name + "".join(f"_{MLX_TYPE_NAMES[t]}" for _, t in template)
        params = []
        for name, array in zip(self.inputs, inputs):
            params.append(f"const {CUDA_TYPES[array.dtype]}* {name}")
            for suffix, kind in (("shape", "Shape"), ("strides", "Strides"), ("ndim", "int")):
                if array.ndim and f"{name}_{suffix}" in self.source:
                    params.append(f"const __grid_constant__ {kind} {name}_{suffix}")
        params += [f"{CUDA_TYPES[d]}* {name}" for name, d in zip(self.outputs, output_dtypes)]
        constants = "".join(f"  using {name} = {CUDA_TYPES[t]};\n" for name, t in template)
        text = ('#include "mlx/backend/cuda/device/utils.cuh"\n#include <cooperative_groups.h>\n'
                f"{self.header}namespace mlx::core::cu {{\nnamespace cg = cooperative_groups;\n"
                f"__global__ void {function}(\n    " + ",\n    ".join(params) + ") {\n"
                f"{constants}{self.source}\n}}\n}}  // namespace mlx::core::cu\n"
                # NVRTC compiles the name MLX looks the kernel up by after the source
                f"static const void* const name_expression = (const void*)&mlx::core::cu::{function};\n")
        Recorded.sources.append((f"{function} grid {grid} block {threadgroup}", text))
        return [mx.zeros(s, d) for s, d in zip(output_shapes, output_dtypes)]


def record_all() -> list[tuple[str, str]]:
    mx.fast.cuda_kernel = Recorded
    import gpu_decode_kernels as cases

    from llm_executorch_mlx.runtime.gpu import attention
    from llm_executorch_mlx.runtime.gpu.decode import Block, CudaKernels, Rotary

    for dtype in (mx.bfloat16, mx.float16, mx.float32):
        for heads, kv_heads, d in ((32, 8, 64), (16, 2, 128)):
            q, k = mx.zeros((1, heads, 1, d), dtype), mx.zeros((1, kv_heads, 1, d), dtype)
            pool = mx.zeros((1, kv_heads, 64, d), dtype)
            attention.update_and_attend(q, k, k, pool, pool, mx.array([3], mx.int32), d ** -0.5)
    key = mx.random.key(0)
    for _, dtype, bits, group, k, rows, norm, epilogue, head in cases.cases():
        weights = tuple(cases.weight(n, k, dtype, bits, group, key) for n in rows)
        rotary = Rotary(head, 500000.0 ** (mx.arange(0, head, 2) / head), 2) if head else None
        block = Block(weights, (mx.ones((k,), dtype), 1e-5) if norm else None, epilogue, rotary)
        # a one-row launch's kernel and a few rows', on FMAs and (where they fit) on tensor cores
        for tensor_cores, rows_x in ((False, 1), (False, cases.FEW), (True, 1), (True, cases.FEW)):
            residual = mx.zeros((1, rows_x, rows[0]), dtype) if epilogue == "add" else None
            CudaKernels(tensor_cores).launcher(block)(mx.zeros((1, rows_x, k), dtype), residual,
                                                      mx.array(5, mx.int32) if head else None)
    return list(dict.fromkeys(Recorded.sources))  # each kernel once


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mlx-src", type=pathlib.Path, required=True,
                   help="an MLX source checkout of the installed version (for its CUDA device headers)")
    p.add_argument("--nvcc", default="nvcc")
    p.add_argument("--arch", default="sm_90a", help="the GPU architecture to compile for (default: sm_90a, Hopper)")
    p.add_argument("--only", help="compile only the kernels whose label (name, grid, block) matches this regex")
    args = p.parse_args(argv)
    if not (args.mlx_src / "mlx/backend/cuda/device/utils.cuh").exists():
        p.error(f"{args.mlx_src} holds no mlx/backend/cuda/device/utils.cuh: give an MLX source checkout")
    failed = 0
    kernels = [(label, text) for label, text in record_all() if not args.only or re.search(args.only, label)]
    with tempfile.TemporaryDirectory() as tmp:
        for i, (label, text) in enumerate(kernels):
            source = pathlib.Path(tmp) / f"kernel{i}.cu"
            source.write_text(text)
            done = subprocess.run([args.nvcc, f"-arch={args.arch}", "-std=c++17", "-cubin", "-Xptxas", "-v",
                                   f"-I{args.mlx_src}", "-o", str(source.with_suffix(".cubin")), str(source)],
                                  capture_output=True, text=True)
            if done.returncode:
                failed += 1
                print(f"FAIL {label}\n{done.stderr[-3000:]}")
                continue
            usage = " ".join(re.sub(r"^ptxas info\s*: ", "", line) for line in done.stderr.splitlines()
                             if "Used" in line or "spill" in line)
            # a block whose threads need more registers than an SM has would
            # fail at launch; a kernel given launch bounds (``decode.
            # _launch_bounds``, through a macro on the name MLX gives the
            # function) must fit that many blocks, or the macro missed it
            threads, registers = int(re.search(r"block \((\d+)", label)[1]), int(re.search(r"Used (\d+) reg", usage)[1])
            blocks = FEW_ROWS_BLOCKS_AN_SM if f"#define {label.split()[0]} __launch_bounds__" in text else 1
            if blocks * threads * registers > SM_REGISTERS:
                failed += 1
                print(f"FAIL {label}: {usage} ({blocks} x {threads} threads x {registers} registers > {SM_REGISTERS})")
                continue
            print(f"ok   {label}: {usage}")
    print(f"{len(kernels) - failed} of {len(kernels)} kernels compile and fit an SM's registers")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
