"""ExecuTorch ScalarType codes and their MLX and numpy counterparts."""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from .errors import PteError

# ExecuTorch ScalarType (c10 numbering) -> MLX dtype, for the types MLX has.
SCALAR_TYPES: dict[int, mx.Dtype] = {
    0: mx.uint8,  # Byte
    1: mx.int8,  # Char
    2: mx.int16,  # Short
    3: mx.int32,  # Int
    4: mx.int64,  # Long
    5: mx.float16,  # Half
    6: mx.float32,  # Float
    11: mx.bool_,  # Bool
    15: mx.bfloat16,  # BFloat16
    27: mx.uint16,  # UInt16
    28: mx.uint32,  # UInt32
    29: mx.uint64,  # UInt64
}

SCALAR_TYPE_NAMES = {
    0: "uint8", 1: "int8", 2: "int16", 3: "int32", 4: "int64", 5: "fp16",
    6: "fp32", 7: "fp64", 11: "bool", 15: "bf16", 27: "uint16", 28: "uint32",
    29: "uint64",
}

# The float storage dtypes of the off-graph cache, by the names users type
# (kv_storage.py adds the quantized ones; tests/test_options.py checks that
# together they are the choices of -o kv_storage_dtype in options.py).
KV_DTYPES: dict[str, mx.Dtype] = {
    "bf16": mx.bfloat16,
    "fp16": mx.float16,
    "fp32": mx.float32,
}

# How half-precision programs compute, by the names users type (the choices of
# -o compute_dtype in options.py). MLX's CPU backend runs bf16/fp16 matmuls
# without BLAS (~5 GFLOP/s here, against ~100 for fp32 through OpenBLAS or
# MKL), so on a CPU "auto" widens LLM programs to fp32: weights are converted
# once at load (twice the memory) and every activation computes in fp32. Other
# programs, and every program on a GPU, keep the file's dtypes. docs/design.md
# has the numbers and the rule.
COMPUTE_ROUTES = ("auto", "native", "fp32")
_WIDENED = {mx.float16: mx.float32, mx.bfloat16: mx.float32}


def on_cpu() -> bool:
    """Whether MLX computes on the CPU (the default device at load)."""
    return mx.default_device().type == mx.DeviceType.cpu


def check_compute_route(route: str) -> None:
    if route not in COMPUTE_ROUTES:
        raise PteError(f"unknown compute route {route!r}: use one of {', '.join(COMPUTE_ROUTES)}")


def compute_dtype_map(route: str, llm: bool) -> dict[mx.Dtype, mx.Dtype]:
    """The dtype substitutions a compute route applies to a program; ``llm``:
    the program publishes the LLM metadata (``auto`` widens only those)."""
    check_compute_route(route)
    if route == "auto":
        route = "fp32" if llm and on_cpu() else "native"
    return dict(_WIDENED) if route == "fp32" else {}


# Numpy views for raw buffers; bf16 has no numpy type and is read as uint16.
_NUMPY_VIEW = {
    mx.uint8: np.uint8, mx.int8: np.int8, mx.int16: np.int16,
    mx.int32: np.int32, mx.int64: np.int64, mx.float16: np.float16,
    mx.float32: np.float32, mx.bool_: np.bool_, mx.bfloat16: np.uint16,
    mx.uint16: np.uint16, mx.uint32: np.uint32, mx.uint64: np.uint64,
}


def mlx_dtype(scalar_type: int) -> mx.Dtype:
    """The MLX dtype of an ExecuTorch ScalarType code."""
    try:
        return SCALAR_TYPES[scalar_type]
    except KeyError:
        name = SCALAR_TYPE_NAMES.get(scalar_type, f"ScalarType {scalar_type}")
        raise PteError(f"unsupported tensor dtype {name} in the program") from None


def scalar_type_name(scalar_type: int) -> str:
    return SCALAR_TYPE_NAMES.get(scalar_type, f"ScalarType {scalar_type}")


def kv_dtype_name(dtype: mx.Dtype) -> str | None:
    """The cache name ("bf16", ...) of an MLX float dtype, else None."""
    for name, dt in KV_DTYPES.items():
        if dt == dtype:
            return name
    return None


def array_from_buffer(buffer, shape: tuple[int, ...], dtype: mx.Dtype, part: tuple[slice, ...] = ()) -> mx.array:
    """An MLX array holding a copy of raw little-endian bytes (of ``part`` of them)."""
    view = np.ascontiguousarray(np.frombuffer(buffer, dtype=_NUMPY_VIEW[dtype]).reshape(shape)[part])
    arr = mx.array(view)
    if dtype == mx.bfloat16:
        arr = arr.view(mx.bfloat16)
    return arr
