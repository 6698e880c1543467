"""Build and load ``attention_kernel.cpp``: CPU attention as one MLX op.

MLX's Python API cannot add a CPU kernel to its lazy graph; a C++ extension
can. The extension is compiled once per source, compiler, MLX (version and
install), nanobind, Python and CPU into the user's cache directory, with
nanobind's own sources (the ``cpu`` extra installs nanobind) and MLX's
headers from its wheel, then checked against MLX's ops on small cases.
Anything missing or wrong (no C++ compiler, no nanobind, a nanobind whose
ABI differs from the one MLX was built with, a failed build or check)
leaves ``load()`` returning None, and attention keeps running as MLX ops.
``LLM_PTE_ATTENTION_KERNEL=0`` opts out.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.machinery
import importlib.metadata
import importlib.util
import os
import pathlib
import platform
import shutil
import subprocess
import sys
import sysconfig
import tempfile

import mlx.core as mx

from .gemv_route import cache_dir

SOURCE = pathlib.Path(__file__).with_name("attention_kernel.cpp")
ENV_VAR = "LLM_PTE_ATTENTION_KERNEL"
MODULE = "attention_kernel"

# Why the kernel is not in use, when it is not (benchmarks record it).
unavailable_reason: str | None = None


def compiler() -> str | None:
    for name in (os.environ.get("CXX"), "c++", "g++", "clang++"):
        if name and shutil.which(name):
            return shutil.which(name)
    return None


def _vector_flags() -> list[str]:
    """AVX2 and FMA where this x86 CPU has them (the exp and dot loops
    vectorise 8 wide); other machines get the compiler's default target."""
    if platform.machine() not in ("x86_64", "AMD64"):
        return []
    try:
        flags = set(pathlib.Path("/proc/cpuinfo").read_text().split())
    except OSError:
        return []
    return ["-mavx2", "-mfma"] if {"avx2", "fma"} <= flags else []


def _command(cxx: str, nanobind) -> list[str]:
    """The compile command, less its output path."""
    nb_root = pathlib.Path(nanobind.__file__).parent
    mlx_root = pathlib.Path(mx.__file__).parent
    command = [
        cxx, "-std=c++20", "-O3", "-fPIC", "-shared", "-fvisibility=hidden", "-fopenmp-simd",
        *_vector_flags(), "-DNB_DOMAIN=mlx", "-DNDEBUG",
        f"-I{nanobind.include_dir()}", f"-I{nb_root / 'ext' / 'robin_map' / 'include'}",
        f"-I{sysconfig.get_paths()['include']}", f"-I{mlx_root / 'include'}",
        str(SOURCE), str(nb_root / "src" / "nb_combined.cpp"),
        f"-L{mlx_root / 'lib'}", "-lmlx", f"-Wl,-rpath,{mlx_root / 'lib'}",
    ]
    if sys.platform == "darwin":
        command.append("-Wl,-undefined,dynamic_lookup")  # Python's symbols come from the interpreter
    return command


def _build(command: list[str], target: pathlib.Path) -> None:
    # Built beside the target and renamed: concurrent builders never see a
    # half-written library.
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        built = pathlib.Path(tmp) / target.name
        print("llm-executorch-mlx: building the CPU attention kernel (once, ~30 s)",
              file=sys.stderr, flush=True)
        subprocess.run([*command, "-o", str(built)], check=True, capture_output=True, timeout=300)
        os.replace(built, target)


def _import(path: pathlib.Path):
    loader = importlib.machinery.ExtensionFileLoader(MODULE, str(path))
    spec = importlib.util.spec_from_file_location(MODULE, path, loader=loader)
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module


def _agrees_with_mlx(module) -> bool:
    """Grouped-query cases with strided keys against MLX's own ops: two
    queries (the kernel's row loops), thirteen (its tiled path, a partial
    block), and thirteen with a window of five."""
    pool = mx.random.normal((2, 1, 2, 24, 16), key=mx.random.key(1))
    k, v = pool[0][:, :, :20], pool[1][:, :, :20]
    for T, window in ((2, 0), (13, 0), (13, 5)):
        q = mx.random.normal((1, 4, T, 16), key=mx.random.key(T))
        ours = module.attention(q, k, v, 0.25, True, window=window, stream=mx.cpu)
        last = mx.arange(20 - T, 20)[:, None]
        mask = mx.arange(20)[None] <= last
        if window:
            mask = mask & (mx.arange(20)[None] > last - window)
        with mx.stream(mx.cpu):
            scores = mx.where(mask, (q * 0.25) @ mx.repeat(k, 2, axis=1).swapaxes(-1, -2), -mx.inf)
            reference = mx.softmax(scores, axis=-1) @ mx.repeat(v, 2, axis=1)
            if not mx.allclose(ours, reference, atol=1e-5, rtol=1e-5):
                return False
    return True


def _plan():
    """``(command, library, failure marker)`` for this machine, or why there
    is no kernel to build here."""
    if os.environ.get(ENV_VAR, "1") == "0":
        return f"{ENV_VAR}=0"
    cxx = compiler()
    try:
        import nanobind
    except ImportError:
        nanobind = None
    if cxx is None or nanobind is None:
        return "no C++ compiler" if cxx is None else "nanobind is not installed"
    command = _command(cxx, nanobind)
    # The command names MLX's directory (the library links that libmlx), the
    # include paths and flags; the versions cover what the paths do not.
    key = hashlib.sha256(b"\0".join(
        part.encode() if isinstance(part, str) else part
        for part in (SOURCE.read_bytes(), *command, mx.__version__, importlib.metadata.version("nanobind"),
                     platform.machine())
    )).hexdigest()[:16]
    target = cache_dir() / f"attention_kernel-{key}{sysconfig.get_config_var('EXT_SUFFIX')}"
    return command, target, target.with_name(f"attention_kernel-{key}.failed")


def state() -> str:
    """One line on how CPU attention runs here, without building anything."""
    plan = _plan()
    if isinstance(plan, str):
        return f"MLX ops ({plan})"
    _, target, failed = plan
    if target.exists():
        return f"compiled kernel ({target})"
    if failed.exists():
        return f"MLX ops (building the kernel failed; remove {failed} to retry)"
    return "compiled kernel, built on the first prompt (~30 s, once)"


def shared_gemv():
    """The extension's one-row product (``gemv``), or None without it."""
    kernel = load()
    return None if kernel is None else kernel.gemv


@functools.cache
def load():
    """The compiled extension module (built now if not cached), or None."""
    global unavailable_reason
    plan = _plan()
    if isinstance(plan, str):
        unavailable_reason = plan
        return None
    command, target, failed = plan
    if not target.exists() and failed.exists():  # a compile error: not retried every command
        unavailable_reason = f"{failed.read_text()} (remove {failed} to retry)"
        return None
    try:
        if not target.exists():
            target.parent.mkdir(parents=True, exist_ok=True)
            try:
                _build(command, target)
            except subprocess.CalledProcessError as exc:
                unavailable_reason = f"building it failed: {exc.stderr.decode(errors='replace').strip()[-300:]}"
                if exc.returncode > 0 and "No space left" not in unavailable_reason:
                    failed.write_text(unavailable_reason)  # a compile error, not a passing condition
                return None
        module = _import(target)
        if not _agrees_with_mlx(module):
            unavailable_reason = "the built kernel disagrees with MLX"
            return None
    except (OSError, ImportError, subprocess.SubprocessError) as exc:
        unavailable_reason = f"building or loading it failed ({type(exc).__name__}: {exc})"
        return None
    except (TypeError, RuntimeError, ValueError) as exc:
        # a nanobind ABI other than MLX's: its op does not accept mlx arrays
        unavailable_reason = f"it does not work with this MLX ({type(exc).__name__}: {exc})"
        return None
    return module
