"""Which CPU kernels programs run with here: the one place that decides.

``kernels()`` answers for the whole runtime: whether attention runs as the
extension's fused op, whether a decode step's and a short chunk's products
run as its shared GEMV, and which BLAS MLX's other matmuls use. ``Program`` asks it once
when it loads and hands the answer down: the weight layout, the op builders
and a method's step submission all read that object and never ask again.
Each part has its own opt-out: ``LLM_PTE_CPU_ATTENTION=0``,
``LLM_PTE_CPU_GEMV=0``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from types import ModuleType

from ..dtypes import on_cpu
from . import crossover, extension
from .blas import BlasStatus, load_fast_blas

ATTENTION_FLAG = "LLM_PTE_CPU_ATTENTION"
GEMV_FLAG = "LLM_PTE_CPU_GEMV"


@dataclass(frozen=True)
class Use:
    """Whether one part of the extension is in use."""

    on: bool
    why: str  # the built extension's file, or why the part is not in use
    needs_build: bool = False  # off only until the extension is built (``kernels(build=True)``)


@dataclass(frozen=True)
class CpuKernels:
    """The CPU kernels a program loaded with this answer runs."""

    attention: Use  # the extension's fused attention, else MLX ops (fastmath.attention)
    gemv: Use  # the extension's shared few-row product (decode steps, short chunks), else BLAS
    blas: BlasStatus  # the BLAS behind MLX's matmuls
    extension: ModuleType | None = field(default=None, repr=False, compare=False)  # when a part is on
    # most rows of x the GEMV takes against an fp32 weight, BLAS's sgemm taking
    # more (crossover.py: measured once per machine on the first build=True);
    # None until measured
    fp32_gemv_rows: int | None = None


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
    wanted = {flag: os.environ.get(flag, "1") != "0" for flag in (ATTENTION_FLAG, GEMV_FLAG)}
    found = (extension.build() if build else extension.find()) if any(wanted.values()) else None

    def use(flag: str) -> Use:
        if not wanted[flag]:
            return Use(False, f"{flag}=0")
        return Use(found.module is not None, found.why, found.needs_build)

    parts = use(ATTENTION_FLAG), use(GEMV_FLAG)
    module = found.module if any(p.on for p in parts) else None
    rows = crossover.fp32_rows(found.why, module, blas.library, measure=build) if parts[1].on else None
    return CpuKernels(*parts, blas, module, rows)
