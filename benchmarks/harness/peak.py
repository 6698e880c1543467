"""This CPU's fp32 and int8 multiply-add peaks, measured, so that a prefill
speed can be read as a share of what the vector units could do.

``peak.c`` is built with the machine's C compiler for ``-march=native`` into
the benchmark's work directory; one copy of each loop runs on every thread
(ctypes lets go of the GIL) and the best of a few passes counts. Without a
compiler that builds it (x86-64 only), or without AVX2, the peaks are
unknown (None), and the report says so.
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import pathlib
import shutil
import subprocess
import time

SOURCE = pathlib.Path(__file__).with_name("peak.c")
ITERS = 1_000_000  # a pass of ~0.05 s on a current core
PASSES = 20  # the best counts: a shared VM's cores are slower now and then


def _library(workdir: pathlib.Path) -> ctypes.CDLL | None:
    compiler = shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    if compiler is None:
        return None
    out = workdir / "peak.so"
    if not out.exists() or out.stat().st_mtime < SOURCE.stat().st_mtime:
        workdir.mkdir(parents=True, exist_ok=True)
        built = subprocess.run([compiler, "-O2", "-march=native", "-shared", "-fPIC", "-o", str(out), str(SOURCE)],
                               capture_output=True)
        if built.returncode != 0:
            return None
    lib = ctypes.CDLL(str(out))
    for name in ("fp32_macs", "int8_macs"):
        fn = getattr(lib, name)
        fn.argtypes = [ctypes.c_long, ctypes.POINTER(ctypes.c_float)]
        fn.restype = ctypes.c_long
    return lib


def _rate(fn, threads: int) -> float | None:
    """Multiply-adds a second of ``fn`` on ``threads`` threads at once."""
    sinks = [ctypes.c_float(1.0) for _ in range(threads)]
    best = 0.0
    with concurrent.futures.ThreadPoolExecutor(threads) as pool:
        for _ in range(PASSES):
            t0 = time.perf_counter()
            done = sum(pool.map(lambda s: fn(ITERS, ctypes.byref(s)), sinks))
            best = max(best, done / (time.perf_counter() - t0))
    return best or None  # 0: the build has neither loop's vectors


def multiply_add_peaks(workdir: pathlib.Path, threads: int) -> dict:
    """``{"fp32": MAC/s, "int8": MAC/s}`` on ``threads`` threads (None where
    unknown): the widest FMA, and the widest u8 x s8 dot product into int32
    (VNNI's, else vpmaddubsw + vpmaddwd)."""
    lib = _library(workdir)
    if lib is None:
        return {"fp32": None, "int8": None}
    return {"fp32": _rate(lib.fp32_macs, threads), "int8": _rate(lib.int8_macs, threads)}
