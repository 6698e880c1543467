"""Build and bind ``sgemm_route.c``: OpenBLAS for MLX, one-row products via sgemv.

The route is compiled once per source, compiler and architecture with the
machine's C compiler (the one MLX's CPU backend already needs to fuse
element-wise ops) into the user's cache directory (``native.py``). Without a
compiler ``build`` returns None and ``blas.py`` binds a library directly
instead. It is built while the BLAS is bound, at import (``blas.py`` says
why); a C file of 50 lines compiles in a fraction of a second.
"""

from __future__ import annotations

import ctypes
import hashlib
import pathlib
import platform
import subprocess

from . import native

SOURCE = pathlib.Path(__file__).with_name("sgemm_route.c")


def build() -> tuple[pathlib.Path | None, str]:
    """The compiled route (built now if not cached), or None and why not."""
    cc = native.find_compiler(native.C_COMPILERS)
    if cc is None:
        return None, "no C compiler to build the one-row route"
    source = SOURCE.read_bytes()
    # The machine too: a home directory may be shared between architectures.
    key = hashlib.sha256(source + cc.encode() + platform.machine().encode()).hexdigest()[:16]
    target = native.cache_dir() / f"sgemm_route-{key}.so"
    if target.exists():
        return target, "cached"
    try:
        native.compile_to(native.Recipe([cc, "-O2", "-fPIC"], [str(SOURCE)], ["-shared"]), target, timeout=120)
    except (OSError, subprocess.SubprocessError) as exc:
        return None, f"building the one-row route failed ({type(exc).__name__})"
    return target, "built"


class RouteUnusable(Exception):
    """The compiled route itself cannot be opened (e.g. a noexec cache)."""


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
    route.llm_pte_sgemm_route_bind(sgemm, sgemv)
