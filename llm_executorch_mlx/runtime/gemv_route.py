"""Build and bind ``gemv_route.c``: OpenBLAS for MLX, one-row products via sgemv.

The shim is compiled once per source, compiler and architecture with the
machine's C compiler (the one MLX's CPU backend already needs to fuse element-wise ops)
into the user's cache directory. Without a compiler ``build`` returns None
and ``blas.py`` binds a library directly instead.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import pathlib
import platform
import shutil
import subprocess
import tempfile

SOURCE = pathlib.Path(__file__).with_name("gemv_route.c")


def cache_dir() -> pathlib.Path:
    base = os.environ.get("XDG_CACHE_HOME") or pathlib.Path.home() / ".cache"
    return pathlib.Path(base) / "llm-executorch-mlx"


def compiler() -> str | None:
    for name in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if name and shutil.which(name):
            return shutil.which(name)
    return None


def build() -> tuple[pathlib.Path | None, str]:
    """The compiled shim (built now if not cached), or None and why not."""
    cc = compiler()
    if cc is None:
        return None, "no C compiler to build the one-row route"
    source = SOURCE.read_bytes()
    # The machine too: a home directory may be shared between architectures.
    key = hashlib.sha256(source + cc.encode() + platform.machine().encode()).hexdigest()[:16]
    target = cache_dir() / f"gemv_route-{key}.so"
    if target.exists():
        return target, "cached"
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        # Compiled beside the target and renamed: concurrent builders never
        # see a half-written library.
        with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
            built = pathlib.Path(tmp) / target.name
            subprocess.run(
                [cc, "-O2", "-shared", "-fPIC", "-o", str(built), str(SOURCE)],
                check=True, capture_output=True, timeout=120,
            )
            os.replace(built, target)
    except (OSError, subprocess.SubprocessError) as exc:
        return None, f"building the one-row route failed ({type(exc).__name__})"
    return target, "built"


class RouteUnusable(Exception):
    """The compiled shim itself cannot be opened (e.g. a noexec cache)."""


def bind(shim: pathlib.Path, library: str, prefix: str) -> None:
    """Open ``shim`` globally and hand it ``library``'s sgemm and sgemv.

    Raises OSError or AttributeError when ``library`` cannot be opened or
    lacks the two functions, RouteUnusable when the shim cannot be opened;
    nothing is bound then.
    """
    blas = ctypes.CDLL(library)
    sgemm = ctypes.cast(getattr(blas, prefix + "cblas_sgemm"), ctypes.c_void_p)
    sgemv = ctypes.cast(getattr(blas, prefix + "cblas_sgemv"), ctypes.c_void_p)
    try:
        route = ctypes.CDLL(str(shim), mode=ctypes.RTLD_GLOBAL)
    except OSError as exc:
        raise RouteUnusable(str(exc)) from None
    route.llm_pte_gemv_route_bind(sgemm, sgemv)
