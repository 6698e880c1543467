"""Give MLX's CPU matmuls an optimized BLAS when the machine has one.

The Linux ``mlx-cpu`` wheel links the slow reference BLAS (scalar loops, a
few percent of an optimized GEMM's speed). MLX
calls only ``cblas_sgemm``/``cblas_dgemm``/``cblas_cgemm``, as plain
unversioned symbols that the dynamic linker binds when ``mlx.core`` loads. A
library opened with ``RTLD_GLOBAL`` before that joins the global lookup scope,
which is searched before libmlx's own dependencies, so its ``cblas_sgemm``
wins: the effect of ``LD_PRELOAD`` without restarting the process.

Where a C compiler can build ``sgemm_route.c``, the library goes behind it:
MLX sends one-row products through sgemm, and OpenBLAS's sgemm is slow at
them, so the route hands those to the library's sgemv. Which library depends
on the CPU's maker: MKL's kernels are Intel's own and take slower paths on
other CPUs, where OpenBLAS is faster; on Intel's, MKL's sgemm is ahead
(``benchmarks/bench_formats.py --formats fp32`` shows either). So an Intel
CPU gets MKL (the `cpu` extra's wheel) first, any other OpenBLAS.

This runs at import (``runtime/cpu/__init__.py`` calls it before anything
imports mlx.core), so that on every path into the package's MLX code libmlx
binds the library as it loads. A program that imported ``mlx.core`` first
(a Python user's script) has libmlx bound to the reference BLAS already: the
library is chosen the same way, then libmlx's imports are pointed at it
(``got.py``); where that cannot be done, a RuntimeWarning says so once.

``LLM_PTE_BLAS`` overrides the search: a library path (put behind the route
too, when it can be built), or ``reference`` to keep the wheel's own BLAS.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import glob
import importlib.metadata
import importlib.util
import os
import pathlib
import sys
import warnings
from dataclasses import dataclass

from . import got, sgemm_route

ENV_VAR = "LLM_PTE_BLAS"
# OpenBLAS's threads spin for 2^n cycles after a product before they sleep
# (n = 28 by default: ~0.1 s). After a prefill that is a core taken from the
# decode step's host-helped products for a whole short turn. 2^22 cycles
# (~1.5 ms) still spans the gap between a prefill's products, so the prefill
# keeps its speed, and ends the stall; a value already set is kept
# (``benchmarks/bench_hit_turn.py`` measures the turn).
THREAD_TIMEOUT_VAR, THREAD_TIMEOUT = "OPENBLAS_THREAD_TIMEOUT", "22"
# MKL's OpenMP threads do the same for KMP_BLOCKTIME ms (200 by default); 1 ms
# ends the stall and keeps the prefill's speed.
BLOCKTIME_VAR, BLOCKTIME = "KMP_BLOCKTIME", "1"
REBOUND = ("cblas_sgemm", "cblas_dgemm", "cblas_cgemm")  # what MLX's CPU backend calls
KEEP_REFERENCE = "reference"

# OpenBLAS builds for the one-row route (sgemm_route.py), best first, with the
# prefix of their symbols: the system's, then the scipy-openblas32 wheel (the
# `cpu` extra installs it), whose symbols are prefixed.
SYSTEM_OPENBLAS = (
    "/usr/lib/*-linux-gnu/openblas-pthread/libopenblas.so.0",
    "/usr/lib/*-linux-gnu/openblas-openmp/libopenblas.so.0",
    "/usr/lib64/libopenblasp.so.0",
    "/usr/lib64/libopenblas.so.0",
)
PIP_OPENBLAS = ("scipy_openblas32", "scipy_")
SYMBOL_PREFIXES = ("", "scipy_")

# Where distributions put an optimized BLAS to bind directly, best first. MKL comes from the
# `mkl` wheel (the `cpu` extra installs it on x86-64 Linux); the system paths
# are Debian/Ubuntu's and Fedora's OpenBLAS and BLIS packages.
SYSTEM_LIBRARIES = (
    "/usr/lib/*-linux-gnu/openblas-pthread/libblas.so.3",
    "/usr/lib/*-linux-gnu/openblas-openmp/libblas.so.3",
    "/usr/lib/*-linux-gnu/blis-pthread/libblas.so.3",
    "/usr/lib/*-linux-gnu/blis-openmp/libblas.so.3",
    "/usr/lib64/libopenblasp.so.0",
    "/usr/lib64/libopenblas.so.0",
)

HINT = (
    "MLX is using its slow reference BLAS on this CPU (about 4x slower "
    "prompts and 3x slower fp32 decoding). Fix: pip install scipy-openblas32 "
    "with a C compiler (cc) on PATH, pip install mkl (x86-64), or "
    "apt-get install libopenblas0-pthread (Debian/Ubuntu); it is picked up "
    f"automatically, or name a BLAS library with {ENV_VAR}=/path/libblas.so."
)


@dataclass(frozen=True)
class BlasStatus:
    """Which BLAS MLX's CPU matmuls use in this process."""

    library: str | None  # the optimized library bound, None when none is
    reason: str  # one line: how it was chosen, or why none was
    advice: str | None = None  # what to tell a CPU user when the slow BLAS is left


_status: BlasStatus | None = None


def load_fast_blas() -> BlasStatus:
    """Open the best optimized BLAS found, before ``mlx.core`` is imported.

    Idempotent; returns what was decided the first time.
    """
    global _status
    if _status is None:
        _status = _decide()
    return _status


def _decide() -> BlasStatus:
    if not sys.platform.startswith("linux"):
        return BlasStatus(None, "not Linux: MLX brings its own BLAS (Accelerate on macOS)")
    choice = os.environ.get(ENV_VAR, "").strip()
    if choice == KEEP_REFERENCE:
        return BlasStatus(None, f"{ENV_VAR}={KEEP_REFERENCE}")
    if _bundled_reference_blas() is None:
        return BlasStatus(None, "this MLX build does not link the reference BLAS")
    bound = global_sgemm_library()
    if bound is not None:
        return BlasStatus(bound, "already loaded (LD_PRELOAD or the host program)")
    late = "mlx.core" in sys.modules  # libmlx is bound to its reference BLAS already
    os.environ.setdefault(THREAD_TIMEOUT_VAR, THREAD_TIMEOUT)  # read as OpenBLAS loads, below
    os.environ.setdefault(BLOCKTIME_VAR, BLOCKTIME)  # read as MKL's OpenMP starts its threads
    status = _select(choice)
    if late and status.library is not None:
        status = _rebind_loaded_mlx(status)
    return status


def _select(choice: str) -> BlasStatus:
    """Open the chosen or best library in the global scope (behind the
    one-row route where it can be built)."""
    if choice:
        return _bind_chosen(choice)
    routed, route_note = _route(routed_libraries(cpu_vendor()), "found")
    if routed is not None:
        return routed
    for path in _candidates():
        try:
            ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
        except OSError:
            continue
        return BlasStatus(path, f"found{route_note}")
    return BlasStatus(None, f"no optimized BLAS found{route_note}", HINT)


def _rebind_loaded_mlx(status: BlasStatus) -> BlasStatus:
    """mlx.core loaded before the runtime: point libmlx's BLAS imports at what
    the global scope now defines (``got.py``). Where that fails, say so once,
    loudly: MLX's matmuls stay several times slower."""
    process = ctypes.CDLL(None)
    addresses = {}
    for name in REBOUND:
        try:
            addresses[name] = ctypes.cast(getattr(process, name), ctypes.c_void_p).value
        except AttributeError:  # the route defines cblas_sgemm only
            continue
    try:
        written = got.rebind(str(_libmlx()), addresses)
    except (got.GotError, OSError, ValueError) as exc:
        reason = f"mlx.core was imported before the runtime, and its BLAS could not be rebound ({exc})"
        advice = f"{reason}; MLX uses its slow reference BLAS: import llm_executorch_mlx.runtime before mlx.core"
        warnings.warn(advice, RuntimeWarning, stacklevel=4)
        return BlasStatus(None, reason, advice)
    if written == 0:
        return _refused("mlx.core was imported before the runtime, and libmlx imports no BLAS to rebind")
    return BlasStatus(status.library, f"{status.reason}; rebound in libmlx, which mlx.core had loaded first")


def _libmlx() -> pathlib.Path:
    spec = importlib.util.find_spec("mlx")
    for location in spec.submodule_search_locations or []:
        for path in sorted(pathlib.Path(location, "lib").glob("libmlx.so*")):
            return path
    raise got.GotError("libmlx.so not found beside mlx")


def _bind_chosen(path: str) -> BlasStatus:
    """``LLM_PTE_BLAS=path``: behind the one-row route when it can be built,
    else bound directly (which a library with prefixed symbols cannot be)."""
    try:
        library = ctypes.CDLL(path)
    except OSError as exc:
        return _refused(f"{ENV_VAR}={path} could not be opened: {exc}")
    prefix = next((p for p in SYMBOL_PREFIXES if hasattr(library, p + "cblas_sgemm")), None)
    if prefix is None:
        return _refused(f"{ENV_VAR}={path} has no cblas_sgemm")
    routed, route_note = _route([(path, prefix)], ENV_VAR)
    if routed is not None:
        return routed
    if prefix:
        return _refused(
            f"{ENV_VAR}={path} names its functions {prefix}cblas_*, which MLX can "
            f"reach only through the one-row route{route_note}"
        )
    ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
    return BlasStatus(path, f"{ENV_VAR}{route_note}")


def _refused(reason: str) -> BlasStatus:
    return BlasStatus(None, reason, f"{reason}; MLX uses its slow reference BLAS")


def _route(libraries: list[tuple[str, str]], how_found: str) -> tuple[BlasStatus | None, str]:
    """Bind the first of ``libraries`` (path, symbol prefix) that opens behind
    the one-row route; else None and a note on why not."""
    if not libraries:
        return None, ""
    try:
        shim, how = sgemm_route.build()
    except Exception as exc:  # best effort at import time (no home, no access): never fatal
        return None, f" (the one-row route could not be built: {type(exc).__name__}: {exc})"
    if shim is None:
        return None, f" ({how})"
    for path, prefix in libraries:
        try:
            sgemm_route.bind(shim, path, prefix)
        except sgemm_route.RouteUnusable as exc:
            return None, f" (the one-row route could not be opened: {exc})"
        except (OSError, AttributeError):
            continue
        return BlasStatus(path, f"{how_found}; one-row products through its sgemv ({how} route)"), ""
    return None, " (no library could be opened for the one-row route)"


def cpu_vendor() -> str:
    """The CPU's maker as /proc/cpuinfo names it (``GenuineIntel``,
    ``AuthenticAMD``), or "" where it says none (Arm, not Linux)."""
    try:
        text = pathlib.Path("/proc/cpuinfo").read_text()
    except OSError:
        return ""
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "vendor_id":
            return value.strip()
    return ""


def routed_libraries(vendor: str) -> list[tuple[str, str]]:
    """The libraries to try behind the one-row route, best first for this
    CPU maker (the module's docstring says why), with their symbol prefixes."""
    mkl = [(path, "") for path in _mkl_from_pip()] if vendor == "GenuineIntel" else []
    return mkl + _openblas_libraries()


def _openblas_libraries() -> list[tuple[str, str]]:
    found = [(path, "") for pattern in SYSTEM_OPENBLAS for path in sorted(glob.glob(pattern))]
    module, prefix = PIP_OPENBLAS
    spec = importlib.util.find_spec(module)
    if spec is not None and spec.submodule_search_locations:
        for location in spec.submodule_search_locations:
            found += [(str(p), prefix) for p in sorted(pathlib.Path(location, "lib").glob("libscipy_openblas*.so*"))]
    return found


class _DlInfo(ctypes.Structure):
    _fields_ = [
        ("dli_fname", ctypes.c_char_p),
        ("dli_fbase", ctypes.c_void_p),
        ("dli_sname", ctypes.c_char_p),
        ("dli_saddr", ctypes.c_void_p),
    ]


def global_sgemm_library() -> str | None:
    """The file whose ``cblas_sgemm`` the global scope resolves to, if any.

    That is the definition libmlx binds when it loads; the wheel's reference
    BLAS is a local dependency of libmlx, so it is never found here.
    """
    process = ctypes.CDLL(None)
    try:
        sgemm = process.cblas_sgemm
    except AttributeError:
        return None
    info = _DlInfo()
    if not process.dladdr(ctypes.cast(sgemm, ctypes.c_void_p), ctypes.byref(info)):
        return None
    return os.fsdecode(info.dli_fname)


def _candidates() -> list[str]:
    found = _mkl_from_pip()
    for pattern in SYSTEM_LIBRARIES:
        found += sorted(glob.glob(pattern))
    openblas = ctypes.util.find_library("openblas")
    if openblas:
        found.append(openblas)
    return found


def _mkl_from_pip() -> list[str]:
    try:
        files = importlib.metadata.files("mkl") or []
    except importlib.metadata.PackageNotFoundError:
        return []
    return [str(f.locate().resolve()) for f in files if f.name.startswith("libmkl_rt.so")]


def _bundled_reference_blas() -> pathlib.Path | None:
    """The reference libblas that the mlx-cpu wheel ships beside mlx, if any."""
    spec = importlib.util.find_spec("mlx")
    if spec is None or not spec.submodule_search_locations:
        return None
    for location in spec.submodule_search_locations:  # mlx is a namespace package
        libs = sorted(pathlib.Path(location).parent.glob("mlx*.libs/libblas*.so*"))
        if libs:
            return libs[0]
    return None
