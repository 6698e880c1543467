"""Build and load the CPU kernel extension: CPU attention, the shared GEMV (fp32 and quantized), SwiGLU and RMSNorm as MLX ops.

MLX's Python API cannot add a CPU kernel to its lazy graph; a C++ extension
can. One module, ``cpu_kernels``, holds both parts: ``attention.cpp`` (fused
attention) and ``gemv.cpp`` (few-row products), with ``shared_work.cpp``
(the helped submission of a step: the host thread runs chunks of both
parts' decode work), ``swiglu.cpp`` (an element-wise kernel either part
brings) and ``rms_norm.cpp`` (the norm before each of them), bound by ``module.cpp``. It is compiled
once per source, compiler, MLX (version and install), nanobind, Python and
CPU into the user's cache directory (``native.py``), with nanobind's own
sources (the ``cpu`` extra installs nanobind) and MLX's headers from its
wheel, then checked against MLX's ops on small cases.

``find()`` only loads a build already in the cache; ``build()`` compiles it
first when it is missing (~30 s, once, with a notice on stderr). A compiler
that refuses a vector flag of this CPU's (one older than the CPU) builds
with the next narrower vectors (``_vector_tiers``), and that refusal is
remembered beside the build. Anything missing or wrong (no C++ compiler, no nanobind, a nanobind whose ABI differs
from the one MLX was built with, a failed build or check) leaves no module,
and the caller runs MLX ops and BLAS instead. Which part is used where is
``selection.py``'s decision.
"""

from __future__ import annotations

import hashlib
import importlib.machinery
import importlib.metadata
import importlib.util
import os
import pathlib
import platform
import subprocess
import sys
import sysconfig
from dataclasses import dataclass, field
from types import ModuleType

import mlx.core as mx

from ..quantized_kv import rotate
from . import native

HERE = pathlib.Path(__file__).parent
SOURCES = tuple(HERE / name for name in ("attention.cpp", "gemv.cpp", "swiglu.cpp", "rms_norm.cpp", "shared_work.cpp", "module.cpp"))
HEADERS = tuple(HERE / name for name in ("kernels.h", "primitive.h", "shared_work.h", "simd.h", "quantized_rows.h", "quantized_dot.h",
                                        "quantized_interleaved.h", "quantized_int8.h", "quantized_amx.h",
                                        "amx.h", "dense_amx.h"))
MODULE = "cpu_kernels"
VECTORS_FLAG = "LLM_PTE_CPU_VECTORS"
NOT_BUILT = "built on the first prompt (~30 s, once)"


@dataclass(frozen=True)
class Extension:
    """The loaded extension module, or why there is none."""

    module: ModuleType | None = field(repr=False)
    why: str  # the built file, or why it is not loaded
    needs_build: bool = False  # absent only because it has not been built yet


_settled: Extension | None = None  # once loaded or failed, the answer for this process


def find() -> Extension:
    """The extension if it is built already; never compiles."""
    return _load(build=False)


def build() -> Extension:
    """The extension, compiled first if it is not built yet."""
    return _load(build=True)


def _load(build: bool) -> Extension:
    global _settled
    if _settled is None:
        found = _look(build)
        if not found.needs_build:
            _settled = found
        return found
    return _settled


def _look(build: bool) -> Extension:
    plan = _plan()
    if isinstance(plan, str):
        return Extension(None, plan)
    recipe, target, failed, refused_marker, flags = plan
    if not target.exists() and failed.exists():  # a compile error: not retried every command
        return Extension(None, f"{failed.read_text()} (remove {failed} to retry)")
    if not target.exists() and not build:
        return Extension(None, NOT_BUILT, needs_build=True)
    try:
        if not target.exists():
            try:
                native.compile_to(recipe, target, timeout=300,
                                  notice="building the CPU kernels (attention, gemv; once, ~30 s)")
            except subprocess.CalledProcessError as exc:
                stderr = exc.stderr.decode(errors="replace").strip()
                why = f"building it failed: {stderr[-300:]}"
                refused = [flag for flag in flags if flag in stderr]
                if exc.returncode > 0 and refused:
                    # a compiler older than the CPU: the next narrower vectors
                    refused_marker.write_text(f"the compiler refused {' '.join(refused)}")
                    return _look(build)
                if exc.returncode > 0 and "No space left" not in why:
                    failed.write_text(why)  # a compile error, not a passing condition
                return Extension(None, why)
        module = _import(target)
        if not _agrees_with_mlx(module):
            return Extension(None, "the built extension disagrees with MLX")
    except (OSError, ImportError, subprocess.SubprocessError) as exc:
        return Extension(None, f"building or loading it failed ({type(exc).__name__}: {exc})")
    except (TypeError, RuntimeError, ValueError) as exc:
        # a nanobind ABI other than MLX's: its ops do not accept mlx arrays
        return Extension(None, f"it does not work with this MLX ({type(exc).__name__}: {exc})")
    return Extension(module, str(target))


def _vector_tiers() -> list[list[str]]:
    """The vector flags to build with, widest first: ``_vector_flags`` as
    this CPU and ``LLM_PTE_CPU_VECTORS`` allow, then each narrower cap down
    to the compiler's default target. A compiler that refuses a tier's flag
    (one older than the CPU: GCC before 11 knows no AMX) gets the next."""
    cap = os.environ.get(VECTORS_FLAG, "native")
    caps = CAPS[CAPS.index(cap):] if cap in CAPS else CAPS
    tiers = []
    for narrower in caps:
        flags = _vector_flags(narrower)
        if flags not in tiers:
            tiers.append(flags)
    return tiers


CAPS = ("native", "avx512_vnni", "avx512", "avx2", "portable")  # LLM_PTE_CPU_VECTORS, widest first


def _vector_flags(cap: str) -> list[str]:
    """The x86 vector extensions this CPU has that the kernels use: AVX2, FMA
    and F16C (the exp and dot loops vectorise 8 wide, the quantized products
    use integer dot products, an fp16 cache widens in one instruction),
    AVX-512BW (those 16 wide), VNNI and BF16 (bf16 products with
    ``vdpbf16ps``), and AMX (the int8 and bf16 products 16 rows of x at a
    time, where Linux lends the tiles); other machines get the compiler's
    default target. ``cap`` (``LLM_PTE_CPU_VECTORS``'s values) caps them:
    ``avx512_vnni`` (AVX-512 with VNNI and BF16, no AMX), ``avx512``
    (AVX-512 without VNNI or BF16), ``avx2`` (AVX2, FMA and F16C only) or
    ``portable`` (the default target: the kernels other CPUs run), which
    the tests use to run every variant here."""
    if platform.machine() not in ("x86_64", "AMD64") or cap == "portable":
        return []
    try:
        flags = set(pathlib.Path("/proc/cpuinfo").read_text().split())
    except OSError:
        return []
    if not {"avx2", "fma"} <= flags:
        return []
    wanted = ["-mavx2", "-mfma"] + (["-mf16c"] if "f16c" in flags else [])
    if cap == "avx2":
        return wanted
    if {"avx512f", "avx512bw", "avx512vl"} <= flags:
        wanted += ["-mavx512f", "-mavx512bw", "-mavx512vl"]
        if "avx512_vnni" in flags and cap != "avx512":
            wanted.append("-mavx512vnni")
        if "avx512_bf16" in flags and cap != "avx512":
            wanted.append("-mavx512bf16")
        if {"amx_tile", "amx_int8", "avx512_vnni"} <= flags and cap not in ("avx512", "avx512_vnni"):
            wanted += ["-mamx-tile", "-mamx-int8"] + (["-mamx-bf16"] if {"amx_bf16", "avx512_bf16"} <= flags else [])
    elif "avx_vnni" in flags and cap != "avx512":
        wanted.append("-mavxvnni")
    return wanted


def _recipe(cxx: str, nanobind, flags: list[str]) -> native.Recipe:
    """How to build it with these vector flags: nanobind's own sources
    third, after the two longest of ours (``native.compile_to`` compiles
    several at once, in this order)."""
    nb_root = pathlib.Path(nanobind.__file__).parent
    mlx_root = pathlib.Path(mx.__file__).parent
    command = [
        cxx, "-std=c++20", "-O3", "-fPIC", "-fvisibility=hidden", "-fopenmp-simd",
        *flags, "-DNB_DOMAIN=mlx", "-DNDEBUG",
        f"-I{nanobind.include_dir()}", f"-I{nb_root / 'ext' / 'robin_map' / 'include'}",
        f"-I{sysconfig.get_paths()['include']}", f"-I{mlx_root / 'include'}",
    ]
    ours = list(map(str, SOURCES))
    sources = [*ours[:2], str(nb_root / "src" / "nb_combined.cpp"), *ours[2:]]
    link = ["-shared", f"-L{mlx_root / 'lib'}", "-lmlx", f"-Wl,-rpath,{mlx_root / 'lib'}"]
    if sys.platform == "darwin":
        link.append("-Wl,-undefined,dynamic_lookup")  # Python's symbols come from the interpreter
    return native.Recipe(command, sources, link)


def _plan():
    """``(recipe, library, failure marker, refused-flags marker, vector
    flags)`` for this machine: the widest vectors whose flags the compiler
    has not refused; or why there is no extension to build here."""
    cxx = native.find_compiler(native.CXX_COMPILERS)
    try:
        import nanobind
    except ImportError:
        nanobind = None
    if cxx is None or nanobind is None:
        return "no C++ compiler" if cxx is None else "nanobind is not installed"
    sources = [f.read_bytes() for f in SOURCES + HEADERS]
    for flags in _vector_tiers():
        recipe = _recipe(cxx, nanobind, flags)
        # The recipe names MLX's directory (the library links that libmlx),
        # the include paths and flags; the versions cover what the paths do not.
        key = hashlib.sha256(b"\0".join(
            part.encode() if isinstance(part, str) else part
            for part in (*sources, *recipe.key(), mx.__version__, importlib.metadata.version("nanobind"),
                         platform.machine())
        )).hexdigest()[:16]
        target = native.cache_dir() / f"{MODULE}-{key}{sysconfig.get_config_var('EXT_SUFFIX')}"
        failed, refused = (target.with_name(f"{MODULE}-{key}.{why}") for why in ("failed", "refused"))
        if target.exists() or not refused.exists():
            return recipe, target, failed, refused, flags
    return "the compiler refused every vector flag, the default target's none among them"


def _import(path: pathlib.Path) -> ModuleType:
    loader = importlib.machinery.ExtensionFileLoader(MODULE, str(path))
    spec = importlib.util.spec_from_file_location(MODULE, path, loader=loader)
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module


def _agrees_with_mlx(module: ModuleType) -> bool:
    """Both parts against MLX's own ops. Attention: grouped-query cases with
    strided keys, two queries (the kernel's row loops), 67 (its tiled path,
    a partial block), and 67 with a window of five; two queries over 8-bit
    keys and 4-bit values, stored as they are and rotated. GEMV: one row
    against a row-major weight; two rows against 4- and 8-bit weights.
    RMSNorm: three rows of a width that is not a whole vector."""
    pool = mx.random.normal((2, 1, 2, 80, 16), key=mx.random.key(1))
    k, v = pool[0][:, :, :72], pool[1][:, :, :72]
    for T, window in ((2, 0), (67, 0), (67, 5)):
        q = mx.random.normal((1, 4, T, 16), key=mx.random.key(T))
        ours = module.attention(q, k, v, 0.25, True, window=window, stream=mx.cpu)
        last = mx.arange(72 - T, 72)[:, None]
        mask = mx.arange(72)[None] <= last
        if window:
            mask = mask & (mx.arange(72)[None] > last - window)
        with mx.stream(mx.cpu):
            scores = mx.where(mask, (q * 0.25) @ mx.repeat(k, 2, axis=1).swapaxes(-1, -2), -mx.inf)
            reference = mx.softmax(scores, axis=-1) @ mx.repeat(v, 2, axis=1)
            if not mx.allclose(ours, reference, atol=1e-5, rtol=1e-5):
                return False
    # over a quantized cache: 8-bit keys, 4-bit values, two queries; rotated,
    # the same rows read as stored rotated (queries and output rotated too)
    q = mx.random.normal((1, 2, 2, 32), key=mx.random.key(8))
    kv = [mx.quantize(mx.random.normal((1, 1, 40, 32), key=mx.random.key(9 + bits)), group_size=32, bits=bits)
          for bits in (8, 4)]
    kv = [(data, scales.astype(mx.float16), biases.astype(mx.float16)) for data, scales, biases in kv]
    for rotated in (False, True):
        ours = module.quantized_attention(q, *kv[0], *kv[1], 0.25, True, 8, 4, 32, rotated=rotated, stream=mx.cpu)
        with mx.stream(mx.cpu):
            k, v = (mx.repeat(mx.dequantize(data, scales.astype(mx.float32), biases.astype(mx.float32), 32, bits), 2,
                              axis=1) for (data, scales, biases), bits in zip(kv, (8, 4)))
            turn = (lambda x: rotate(x, 32)) if rotated else (lambda x: x)
            reference = turn(mx.fast.scaled_dot_product_attention(turn(q), k, v, scale=0.25, mask="causal"))
            if not mx.allclose(ours, reference, atol=1e-5, rtol=1e-5):
                return False
    x, w = mx.random.normal((1, 1, 24), key=mx.random.key(2)), mx.random.normal((40, 24), key=mx.random.key(3))
    with mx.stream(mx.cpu):
        if not mx.allclose(module.gemv(x, w.T, stream=mx.cpu), x @ w.T, atol=1e-4, rtol=1e-5).item():
            return False
        x, w = mx.random.normal((1, 2, 64), key=mx.random.key(4)), mx.random.normal((8, 64), key=mx.random.key(5))
        for bits in (4, 8):
            q, scales, biases = mx.quantize(w, group_size=32, bits=bits)
            ours = module.quantized_gemv(x, q, scales, biases, 32, bits, stream=mx.cpu)
            # x86 rounds x to int16 per group: within max|x| sum_k |w_k| / 65534
            bound = mx.abs(x).max() * mx.abs(mx.dequantize(q, scales, biases, 32, bits)).sum(axis=1).max() / 65534
            if not mx.allclose(ours, mx.quantized_matmul(x, q, scales, biases, True, 32, bits),
                               atol=1e-4 + bound.item()).item():
                return False
        x, w = mx.random.normal((3, 20), key=mx.random.key(6)), mx.random.normal((20,), key=mx.random.key(7))
        return mx.allclose(module.rms_norm(x, w, 1e-5, stream=mx.cpu), mx.fast.rms_norm(x, w, 1e-5),
                           atol=1e-6, rtol=1e-5).item()
