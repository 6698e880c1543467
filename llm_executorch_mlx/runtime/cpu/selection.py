"""Which CPU kernels this machine offers programs: the extension's parts, and the BLAS.

``kernels()`` answers for the whole process: whether the extension is loaded
(its RMSNorm and SwiGLU kernels then run), whether its attention and its
products are in use, what its products take (``Limits``, as the built
extension states them) and which BLAS MLX's other matmuls use. A program
turns that answer into its plan once, at load (``runtime/plan.py``), and
nothing else reads it. Each flag switches one thing off:

=========================  ==================================================
``LLM_PTE_CPU_KERNELS=0``  no extension: MLX ops and BLAS only, as on a
                           machine without a C++ compiler
``LLM_PTE_CPU_ATTENTION=0``  the extension's attention (MLX ops instead)
``LLM_PTE_CPU_PRODUCTS=0``   the extension's products (BLAS and MLX's
                           quantized ops instead, weights stored as they read
                           them)
=========================  ==================================================
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from types import ModuleType

from ..dtypes import on_cpu
from . import crossover, extension
from .blas import BlasStatus, load_fast_blas

KERNELS_FLAG = "LLM_PTE_CPU_KERNELS"
ATTENTION_FLAG = "LLM_PTE_CPU_ATTENTION"
PRODUCTS_FLAG = "LLM_PTE_CPU_PRODUCTS"


@dataclass(frozen=True)
class Use:
    """Whether one part of the extension is in use."""

    on: bool
    why: str  # the built extension's file, or why the part is not in use
    needs_build: bool = False  # off only until the extension is built (``kernels(build=True)``)


@dataclass(frozen=True)
class Limits:
    """What the built extension's products take, as its ``limits()`` states
    it (``kernels.h``): the most rows of x for each weight layout, the rows
    an interleaved block holds (0: no interleaved layout in this build), and
    the quantized widths and group sizes."""

    dense_rows: int
    quantized_rows: int
    interleaved_rows: int
    interleave_lanes: int
    quantized_bits: tuple[int, ...]
    quantized_groups: tuple[int, ...]
    int8_bits: tuple[int, ...]
    bf16_dot: bool  # bf16 weights times x rounded to bf16 (``gemv``'s ``bf16_x``)
    int8_tiles: bool  # the int8 products take x's rows 16 at a time on AMX tiles
    bf16_tiles: bool  # the bf16 products (``bf16_x``) take x's rows 16 at a time on AMX tiles


@dataclass(frozen=True)
class CpuKernels:
    """The CPU kernels a program loaded with this answer may run."""

    attention: Use  # the extension's fused attention, else MLX ops (fastmath.attention)
    products: Use  # the extension's products (dense and quantized), else BLAS and MLX's quantized ops
    blas: BlasStatus  # the BLAS behind MLX's matmuls
    extension: ModuleType | None = field(default=None, repr=False, compare=False)  # loaded, unless KERNELS=0
    limits: Limits | None = None  # the products' limits, where they are on
    # most rows of x the products take against an fp32 weight, BLAS's sgemm
    # taking more (crossover.py: measured once per machine on the first
    # build=True); None until measured
    fp32_rows: int | None = None


def kernels(build: bool = False) -> CpuKernels:
    """The CPU kernels in use for programs loaded now.

    Never compiles unless ``build``: without it, an extension that is not
    built yet leaves its parts off with ``needs_build`` set; with it, the
    extension is built first (once per machine, ~30 s, with a notice).
    """
    blas = load_fast_blas()
    if not on_cpu():
        off = Use(False, "MLX runs on the GPU")
        return CpuKernels(off, off, blas)
    if os.environ.get(KERNELS_FLAG, "1") == "0":
        off = Use(False, f"{KERNELS_FLAG}=0")
        return CpuKernels(off, off, blas)
    found = extension.build() if build else extension.find()

    def use(flag: str) -> Use:
        if os.environ.get(flag, "1") == "0":
            return Use(False, f"{flag}=0")
        return Use(found.module is not None, found.why, found.needs_build)

    attention, products = use(ATTENTION_FLAG), use(PRODUCTS_FLAG)
    if not products.on:
        return CpuKernels(attention, products, blas, found.module)
    limits = Limits(**found.module.limits())
    rows = crossover.fp32_rows(found.why, found.module, blas.library, limits.dense_rows, measure=build)
    return CpuKernels(attention, products, blas, found.module, limits, rows)
