"""A program's plan: which route each op takes on this machine, decided once at load.

``Program`` makes one ``Plan`` from the CPU kernels this machine offers
(``cpu.kernels()``, whose limits the built extension states itself) and the
program's options, and hands it to everything that chooses: the weight
layout at load, the op builders and load-time rewrites (``ctx.plan``), the
way a step is submitted. None of them reads a flag, a device or a kernel
limit of its own. ``llm pte info`` prints ``summary()`` of the same object.

Per op, one version per device, plus MLX's own op as the fallback for what
a version does not take:

==============  ==========================  ================================
op              CPU                         GPU
==============  ==========================  ================================
linear layers   the extension's products    MLX (``quantized_matmul``, GEMM)
                up to their rows, BLAS
                above
attention       the extension's kernel      ``mx.fast`` SDPA
quantized KV    the extension's kernel      ``quantized_kv``'s, the
                                            history widened per layer
RMSNorm         the extension's kernel      ``mx.fast.rms_norm``
SwiGLU          the extension's kernel      one compiled MLX kernel
a decode step's the ops above               on CUDA: one kernel for a
norm, products                              norm and the products reading
and epilogues                               it (SwiGLU after; q, k, v in
                                            heads, rotated), one for a
                                            product and its residual add
a decode step's the extension's kernel,     with those: one kernel
cache write     q's and k's RoPE its first  (``gpu/attention.py``)
and attention   step (any step's rows)
==============  ==========================  ================================

On either device a short step (decode) replays the ops between two layers'
attention as one ``mx.compile``d call (``compiles_steps``).

Without the extension (no compiler, ``LLM_PTE_CPU_KERNELS=0``) the CPU runs
``fastmath``'s MLX-op versions, which avoid MLX's slow scalar CPU paths.
"""

from __future__ import annotations

import enum
import math
import os
from dataclasses import dataclass
from types import ModuleType
from typing import TYPE_CHECKING, Callable, NamedTuple

import mlx.core as mx

from . import quantized_kv
from .cpu import CpuKernels, Limits, extension_ops, fastmath
from .gpu import attention, decode
from .steps import ON_BUILD, PLAIN, Steps, helped

if TYPE_CHECKING:
    from .kv_storage import Storage

# Without the extension's products: MLX's quantized_matmul is scalar code on
# the CPU, so above a few rows its dequantize and one BLAS product, whose
# cost the rows share, is faster.
MLX_QMM_ROWS = 4

COMPILED_STEPS_FLAG = "LLM_PTE_COMPILED_STEPS"  # "0": every op of a step built from Python


class Layout(enum.Enum):
    """How a quantized weight is held (``program.py`` converts it at load)."""

    MLX = "mlx"  # MLX's affine layout, as the file stores it
    INTERLEAVED = "interleaved"  # blocks of rows interleaved (cpu/quantized_interleaved.h)
    INT8 = "int8"  # interleaved four bytes a row at a time, read with int8 activations (cpu/quantized_int8.h)


class InOp(NamedTuple):
    """A cache layer's write and attention as one op: ``run(Q, Kn, Vn, K, V,
    position, position_array)`` (K and V each a pool's list of arrays;
    ``position_array`` the position as an int32 array where ``on_device``
    asks for it, else None) returns ``(y, K', V')``, for the steps
    ``takes(Q, Kn, Vn)`` accepts. An ``on_device`` op may be called with no
    host ``position`` (a compiled trace's call: ``interp/compiled_runs.py``);
    it then writes the pools in place or raises ``NeedsHost``."""

    run: Callable
    takes: Callable
    on_device: bool = False  # a GPU's: the position read from an array
    # run also takes ``rope=``: the step's RoPE tables (cos and sin rows,
    # [2, T, D / 2]), applied to Q and Kn first (a layer's q and k RoPE
    # groups as the op's own first step: ops/attention.py)
    rotates: bool = False


@dataclass(frozen=True)
class Plan:
    """Which route each op of a program takes here."""

    cpu: bool  # MLX runs on the CPU
    kernels: CpuKernels | None = None  # what the extension offers; None: nothing
    int8_activations: bool = True  # 4/8-bit products round activations to int8 where the build can
    bf16_activations: bool = True  # bf16 products round activations to bf16 where the build can

    # -- the extension's parts ---------------------------------------------

    @property
    def extension(self) -> ModuleType | None:
        """The loaded extension (its RMSNorm and SwiGLU run), on a CPU."""
        return self.kernels.extension if self.cpu and self.kernels is not None else None

    @property
    def products(self) -> ModuleType | None:
        """The extension, where its products run the linear layers."""
        return self.extension if self.extension is not None and self.kernels.products.on else None

    @property
    def limits(self) -> Limits | None:
        """What the products take, where they run."""
        return self.kernels.limits if self.products is not None else None

    # -- linear layers -----------------------------------------------------

    def dense_rows(self, weight_dtype: mx.Dtype) -> int:
        """Most rows of x the products take against a dense weight: against
        fp32, up to where BLAS's sgemm is faster here (``cpu/crossover.py``);
        against bf16, all they can (BLAS would need it widened first)."""
        if self.products is None:
            return 0
        most = self.limits.dense_rows
        return min(self.kernels.fp32_rows or most, most) if weight_dtype == mx.float32 else most

    @property
    def rounds_to_bf16(self) -> bool:
        """Whether products against bf16 weights round x to bf16 first
        (``gemv``'s ``bf16_x``): the program allows it and the build has
        bf16 dot products."""
        return self.products is not None and self.bf16_activations and self.limits.bf16_dot

    def takes_quantized(self, bits: int, group: int) -> bool:
        """Whether the products take weights of this width and group size."""
        return self.products is not None and bits in self.limits.quantized_bits and group in self.limits.quantized_groups

    def quantized_rows(self, layout: Layout) -> float:
        """Most rows of x the products take against a weight held in
        ``layout``; more rows dequantize it for BLAS. Int8 activations take
        any number: no dequantized copy beats integer dot products."""
        if self.products is None:
            return 0
        return {Layout.MLX: self.limits.quantized_rows, Layout.INTERLEAVED: self.limits.interleaved_rows,
                Layout.INT8: math.inf}[layout]

    def quantized_layout(self, bits: int, group: int, n: int, k: int) -> Layout:
        """The layout a quantized linear weight of ``n`` rows of ``k`` values
        that only the products read is held in: interleaved where this build
        has that layout and the shape fits its blocks, for int8 activations
        where the program and the build allow them at this width."""
        lanes = self.limits.interleave_lanes if self.takes_quantized(bits, group) else 0
        if not lanes or n % lanes or k % max(group, 256 // bits):
            return Layout.MLX
        return Layout.INT8 if self.int8_activations and bits in self.limits.int8_bits else Layout.INTERLEAVED

    def cache_dtype(self, compute: str) -> str:
        """A cache's storage unless asked otherwise, for activations that
        compute in ``compute``: that dtype, but on a CPU fp16 where it is
        fp32 (as a CPU computes quantized and 16-bit files), so that a
        decode step reads half the cache's bytes, each key and value within
        fp16's rounding (docs/design.md, "The cache's storage"). A GPU's
        attention kernel reads pools of the query's dtype."""
        return "fp16" if self.cpu and compute == "fp32" else compute

    @property
    def rows_match_steps(self) -> bool:
        """Whether each row of a call of several tokens gets the logits a
        call of that token alone gets, as close as greedy choices need: on
        the CPU, whose products sum each row in fp32 whatever the rows (in
        another order from some row count on: BLAS, AMX tiles). A GPU's
        decode-step kernels give each row a one-token step's bits (on
        tensor cores too, where asked: ``gpu/decode.py``), but MLX's GEMMs
        take several rows where no decode kernel applies (a bf16 LM head;
        every product without the kernels), so a token decided there may
        differ where the top two logits are within rounding (speculative
        decoding, ``generate.speculate``)."""
        return self.cpu

    @property
    def stores_for_blas(self) -> bool:
        """Whether dense linear weights are stored the way BLAS reads one row
        fastest (``interp/layout.py``): where BLAS runs a decode step's
        products. The extension's read rows as exported."""
        return self.cpu and self.products is None

    def keeps_bf16(self, widened: bool) -> bool:
        """Whether a program whose bf16 computes ``widened`` to fp32 keeps its
        linear weights in bf16: the products widen them as they read them,
        half the memory and half a decode step's reads."""
        return widened and self.products is not None

    # -- the other ops -----------------------------------------------------

    def rms_norm(self, eps: float):
        """``mx.fast.rms_norm``'s signature, as this device runs it."""
        if not self.cpu:
            return mx.fast.rms_norm
        fallback = fastmath.rms_norm(eps)
        return fallback if self.extension is None else extension_ops.rms_norm(self.extension, fallback)

    @property
    def decode_blocks(self):
        """What runs a decode step's norm, products and epilogue as one
        kernel (``interp/decode_blocks.py``): ``gpu/decode.py``'s CUDA
        kernels on a CUDA GPU unless turned off; None elsewhere
        (each node its own op)."""
        return None if self.cpu else decode.for_device()

    def swiglu(self):
        """``silu(gate) * up``, as this device runs it."""
        if not self.cpu:
            return _compiled_swiglu
        if self.extension is None:
            return fastmath.swiglu
        return extension_ops.swiglu(self.extension, fastmath.swiglu)

    def sdpa(self):
        """Attention for an ``SdpaNode`` (keys and values in the queries' dtype)."""
        return fastmath.attention if self.cpu else mx.fast.scaled_dot_product_attention

    def cache_attention(self, window: int = 0, quantized: bool = False):
        """Attention over an off-graph cache layer's keys and values, which
        may be stored in another dtype than the queries (``kv_storage_dtype``)
        or ``quantized`` (either of them a ``QuantizedKV``)."""
        if quantized:
            if not self.cpu:
                return quantized_kv.widened_attention
            if self.extension is None or not self.kernels.attention.on:
                return quantized_kv.attention
            return extension_ops.quantized_attention(self.extension, quantized_kv.attention, window)
        if not self.cpu:
            return in_query_dtype(mx.fast.scaled_dot_product_attention)
        fallback = in_query_dtype(fastmath.attention)
        if self.extension is None or not self.kernels.attention.on:
            return fallback
        return extension_ops.attention(self.extension, fallback, window)

    def update_and_attend(self, scale: float, window: int, storages: tuple[Storage, Storage]) -> InOp | None:
        """A cache layer's write and attention as one op (``SequenceCache.update_in_op``'s),
        or None: for a flat layer (``window`` 0) whose keys and values are
        stored alike: on a CPU both in one float dtype or both quantized; on
        a GPU with the decode-step kernels, both in one float dtype."""
        if window:
            return None
        keys, values = storages
        alike = not keys.quantized and not values.quantized and keys.dtype == values.dtype
        if not self.cpu:
            blocks = self.decode_blocks
            return None if blocks is None or not alike else InOp(blocks.update_and_attend(scale), attention.takes, True)
        if self.extension is None or not self.kernels.attention.on:
            return None
        if keys.quantized and values.quantized:
            return InOp(extension_ops.quantized_update_and_attend(self.extension, scale, keys, values),
                        extension_ops.in_op_takes, rotates=True)
        if not alike:
            return None
        return InOp(extension_ops.update_and_attend(self.extension, scale), extension_ops.in_op_takes, rotates=True)

    @property
    def compiles_steps(self) -> bool:
        """Whether a short step (``compiled_rows``) replays its runs of pure
        ops as compiled calls (``interp/compiled_runs.py``), on any device;
        ``LLM_PTE_COMPILED_STEPS=0``: every op built from Python."""
        return os.environ.get(COMPILED_STEPS_FLAG, "1") != "0"

    @property
    def compiled_rows(self) -> int:
        """The most tokens a step holds for its pure runs to be compiled
        (``compiles_steps``): one, where a speculative try's verifying
        calls, in many lengths, do not pay back each length's recording and
        traces (a CPU: docs/design.md); with a CUDA GPU's decode kernels
        (``decode_blocks``) as many as a verifying call has
        (``gpu.attention.MOST_ROWS``), whose build op by op is most of the
        call there."""
        return 1 if self.decode_blocks is None else attention.MOST_ROWS

    @property
    def steps(self) -> Steps:
        """How a step is submitted: on a GPU as soon as it is built; on a
        CPU with the host thread helping the extension's products, or
        plainly (``steps.py``)."""
        if not self.cpu:
            return ON_BUILD
        return PLAIN if self.products is None else helped(self.products)

    # -- what llm pte info says --------------------------------------------

    def summary(self) -> dict[str, str]:
        """How attention and the linear layers run on a CPU, in words."""
        k = self.kernels
        if k is None:
            return {"attention": "MLX ops", "decode_products": "BLAS", "quantized_products": _mlx_quantized("")}
        facts = {"attention": (f"compiled kernel ({k.attention.why}); a flat layer's cache write and its q and k "
                               "RoPE in the same op" if k.attention.on
                               else f"compiled kernel, {k.attention.why}" if k.attention.needs_build
                               else f"MLX ops ({k.attention.why})")}
        if k.products.needs_build:
            facts["decode_products"] = f"the compiled kernel's products, {k.products.why}"
            facts["quantized_products"] = f"the compiled kernel's, as its build for this CPU allows, {k.products.why}"
            return facts
        if self.products is None:
            facts["decode_products"] = f"BLAS ({k.products.why})"
            facts["quantized_products"] = _mlx_quantized(f" ({k.products.why})")
            return facts
        limits = k.limits
        facts["decode_products"] = "the compiled kernel's products, the host thread helping"
        facts["fp32_chunk_products"] = (
            f"the compiled kernel's products up to {self.dense_rows(mx.float32)} rows, BLAS's sgemm above"
            if k.fp32_rows else "the compiled kernel's products or BLAS's sgemm, as measured on the first prompt")
        facts["bf16_products"] = (
            "activations rounded to bf16, bf16 dot products"
            f"{', on AMX tiles 16 rows at a time' if limits.bf16_tiles else ''} (-o bf16_activations false: fp32)"
            if self.rounds_to_bf16 else "fp32 activations" + (
                " (-o bf16_activations false)" if limits.bf16_dot else " (no bf16 dot products here)"))
        exact = (f"activations within 2^-16 for up to {limits.interleaved_rows} rows (up to {limits.quantized_rows} "
                 "for weights it cannot interleave), dequantized for BLAS above")
        if not limits.int8_bits:
            facts["quantized_products"] = f"the compiled kernel, {exact} (no integer dot products here)"
        elif self.int8_activations:
            facts["quantized_products"] = (
                f"{'/'.join(map(str, limits.int8_bits))}-bit weights: int8 activations and integer dot products "
                f"at every row count{', on AMX tiles 16 rows at a time' if limits.int8_tiles else ''} "
                f"(-o int8_activations false: {exact})")
        else:
            facts["quantized_products"] = f"the compiled kernel, {exact} (-o int8_activations false)"
        return facts


def _mlx_quantized(why: str) -> str:
    return f"MLX's quantized_matmul (up to {MLX_QMM_ROWS} rows), MLX's dequantize + BLAS (more){why}"


def in_query_dtype(sdpa):
    """``sdpa`` over keys and values cast to the queries' dtype, for a cache
    stored in another one."""

    def cast_then_sdpa(Q, K, V, scale, mask):
        if K.dtype != Q.dtype:
            K, V = K.astype(Q.dtype), V.astype(Q.dtype)
        return sdpa(Q, K, V, scale=scale, mask=mask)

    return cast_then_sdpa


# one kernel where the GPU would launch three (sigmoid, two multiplies), as mlx-lm does
_compiled_swiglu = mx.compile(lambda gate, up: gate * mx.sigmoid(gate) * up, shapeless=True)
