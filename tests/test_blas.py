"""MLX's CPU matmuls reach an optimized BLAS without LD_PRELOAD.

Each case runs in a fresh interpreter: the BLAS is bound when mlx.core first
loads, which this test process did long ago. MKL_VERBOSE=1 makes MKL log
every call it receives, which shows what MLX's calls turned into.
"""

import json
import os
import pathlib
import platform
import subprocess
import sys

import pytest

# The `cpu` and `test` extras install scipy-openblas32's wheel on Linux and
# MKL's on x86-64 Linux; elsewhere the runtime leaves MLX's own BLAS alone
# (Accelerate on macOS).
OPENBLAS_WHEEL = sys.platform.startswith("linux")
MKL_WHEEL = OPENBLAS_WHEEL and platform.machine() == "x86_64"
# An Intel CPU gets MKL behind the route, any other OpenBLAS (blas.py says why).
INTEL = pathlib.Path("/proc/cpuinfo").exists() and "GenuineIntel" in pathlib.Path("/proc/cpuinfo").read_text()
DEFAULT_LIBRARY = "libmkl_rt" if INTEL and MKL_WHEEL else "openblas"
CPU_PACKAGE = pathlib.Path(__file__).parents[1] / "llm_executorch_mlx" / "runtime" / "cpu"
# sgemm_route.py and the native.py it uses, loaded without the package (whose
# import binds a BLAS): the folder (argv[1]) as a bare package named cpu.
LOAD_ROUTE = """
import importlib, sys, types
package = types.ModuleType("cpu"); package.__path__ = [sys.argv[1]]; sys.modules["cpu"] = package
route = importlib.import_module("cpu.sgemm_route")
"""

PROBE = """
import json
import numpy as np
from llm_executorch_mlx.runtime.cpu import blas
import mlx.core as mx

a = np.random.default_rng(0).standard_normal((64, 48)).astype(np.float32)
b = np.random.default_rng(1).standard_normal((48, 40)).astype(np.float32)
product = np.array(mx.array(a) @ mx.array(b))
row = np.array(mx.array(a[:1]) @ mx.array(b))
status = blas.load_fast_blas()
import os
print("PROBE " + json.dumps({
    "thread_timeout": os.environ.get("OPENBLAS_THREAD_TIMEOUT"),
    "blocktime": os.environ.get("KMP_BLOCKTIME"),
    "library": status.library,
    "reason": status.reason,
    "advice": status.advice,
    "global_sgemm": blas.global_sgemm_library(),
    "max_err": max(float(np.abs(product - a @ b).max()), float(np.abs(row - a[:1] @ b).max())),
}))
"""


def probe(**env):
    result = subprocess.run(
        [sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=120,
        env={**os.environ, **env},
    )
    assert result.returncode == 0, result.stderr
    line = next(x for x in result.stdout.splitlines() if x.startswith("PROBE "))
    return json.loads(line[len("PROBE "):]), result.stdout


def test_the_cpu_makers_library_behind_the_one_row_route_is_the_default(tmp_path):
    facts, stdout = probe(MKL_VERBOSE="1", XDG_CACHE_HOME=str(tmp_path))  # built afresh
    if not OPENBLAS_WHEEL:
        pytest.fail("this check needs scipy-openblas32's wheel (Linux)")
    assert DEFAULT_LIBRARY in facts["library"]  # MKL's wheel, or the system's or scipy-openblas32's OpenBLAS
    assert facts["reason"] == "found; one-row products through its sgemv (built route)"
    assert pathlib.Path(facts["global_sgemm"]).parent == tmp_path / "llm-executorch-mlx"  # what libmlx binds
    calls = [line.split()[1].split("(")[0] for line in stdout.splitlines() if "GEMM(" in line or "GEMV(" in line]
    if DEFAULT_LIBRARY == "libmkl_rt":  # MKL's own log: the 64-row product, then the one-row one
        assert calls == ["SGEMM", "SGEMV"]
    else:
        assert calls == []  # MKL is not used
    assert facts["max_err"] < 1e-4
    assert facts["advice"] is None


def test_an_intel_cpu_tries_mkl_first_and_others_openblas_only():
    from llm_executorch_mlx.runtime.cpu import blas

    openblas = blas._openblas_libraries()
    mkl = [(path, "") for path in blas._mkl_from_pip()]
    if not (openblas and mkl):
        pytest.fail("this check needs scipy-openblas32's and mkl's wheels (x86-64 Linux)")
    assert blas.routed_libraries("GenuineIntel") == mkl + openblas
    assert blas.routed_libraries("AuthenticAMD") == openblas
    assert blas.routed_libraries("") == openblas  # Arm: /proc/cpuinfo names no vendor


def test_blas_threads_stop_spinning_soon_unless_told_otherwise():
    """OpenBLAS and MKL's OpenMP read their threads' spin time as they load:
    ours (2^22 cycles, 1 ms) unless the user set one
    (benchmarks/bench_formats.py's short case shows why: spinning threads
    took a core from the next chat turn)."""
    env = {k: v for k, v in os.environ.items() if k not in ("OPENBLAS_THREAD_TIMEOUT", "KMP_BLOCKTIME")}
    done = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=120, env=env)
    facts = json.loads(done.stdout.split("PROBE ", 1)[1])
    assert (facts["thread_timeout"], facts["blocktime"]) == ("22", "1")
    facts, _ = probe(OPENBLAS_THREAD_TIMEOUT="10", KMP_BLOCKTIME="50")
    assert (facts["thread_timeout"], facts["blocktime"]) == ("10", "50")


def test_without_a_c_compiler_mkl_serves_mlx_matmuls():
    facts, stdout = probe(MKL_VERBOSE="1", PATH="/nonexistent", CC="")
    if not MKL_WHEEL:
        pytest.fail("this check needs mkl's wheel (x86-64 Linux)")
    assert "libmkl_rt" in facts["library"] and "no C compiler" in facts["reason"]
    assert facts["global_sgemm"] == facts["library"]
    assert "SGEMM(" in stdout  # MKL's own log of the calls MLX made
    assert facts["max_err"] < 1e-4


def pip_openblas() -> str:
    import importlib.util

    spec = importlib.util.find_spec("scipy_openblas32")
    location = pathlib.Path(next(iter(spec.submodule_search_locations)))
    return str(next((location / "lib").glob("libscipy_openblas*.so*")))


def test_a_named_library_goes_behind_the_route_prefixed_symbols_too():
    if not OPENBLAS_WHEEL:
        pytest.fail("this check needs scipy-openblas32's wheel (Linux)")
    library = pip_openblas()  # its functions are scipy_cblas_*
    facts, _ = probe(LLM_PTE_BLAS=library)
    assert facts["library"] == library and "one-row products through its sgemv" in facts["reason"]
    assert pathlib.Path(facts["global_sgemm"]).name.startswith("sgemm_route-")
    assert facts["max_err"] < 1e-4


def test_a_named_prefixed_library_without_a_compiler_is_refused_with_advice():
    if not OPENBLAS_WHEEL:
        pytest.fail("this check needs scipy-openblas32's wheel (Linux)")
    facts, _ = probe(LLM_PTE_BLAS=pip_openblas(), PATH="/nonexistent", CC="")
    assert facts["library"] is None and facts["global_sgemm"] is None
    assert "only through the one-row route (no C compiler" in facts["advice"]
    assert "reference BLAS" in facts["advice"]
    assert facts["max_err"] < 1e-4


def test_a_failed_route_build_falls_back_to_binding_directly(tmp_path):
    facts, _ = probe(CC="/bin/false", XDG_CACHE_HOME=str(tmp_path))
    if not OPENBLAS_WHEEL:
        pytest.fail("this check needs scipy-openblas32's wheel (Linux)")
    assert "building the one-row route failed" in facts["reason"]
    assert facts["global_sgemm"] == facts["library"]  # bound directly (MKL where its wheel is)
    assert facts["max_err"] < 1e-4
    assert not list(tmp_path.rglob("*.so"))  # no half-built library left behind


# Binds the route to MKL, whose log names each call it receives, and runs
# every form of one-row product MLX may send (both operand layouts, a strided
# row or column, a transposed operand, addmm's alpha and beta) and one that is
# not: results against numpy, calls from MKL's log.
ROUTE_PROBE = LOAD_ROUTE + """
import json
shim, how = route.build()
route.bind(shim, sys.argv[2], "")
import numpy as np
import mlx.core as mx
rng = np.random.default_rng(0)
def r(*shape): return rng.standard_normal(shape).astype(np.float32)
W, Wt, X, V, U, c, x = r(40, 48), r(48, 40), r(48, 5), r(48, 7), r(3, 48), r(1, 40), r(1, 48)
cases = [
    (lambda: mx.array(x) @ mx.array(W).T, x @ W.T),
    (lambda: mx.array(x) @ mx.array(Wt), x @ Wt),
    (lambda: mx.array(X)[:, 2:3].T @ mx.array(W).T, X[:, 2:3].T @ W.T),
    (lambda: mx.array(W) @ mx.array(V)[:, 3:4], W @ V[:, 3:4]),
    (lambda: mx.array(W) @ mx.array(U)[1:2].T, W @ U[1:2].T),
    (lambda: mx.array(Wt).T @ mx.array(V)[:, 3:4], Wt.T @ V[:, 3:4]),
    (lambda: mx.addmm(mx.array(c), mx.array(x), mx.array(W).T, alpha=0.5, beta=2.0), 2.0 * c + 0.5 * x @ W.T),
    (lambda: mx.array(X).T @ mx.array(V), X.T @ V),
]
errors = []
for f, expected in cases:
    print("CASE", flush=True)
    errors.append(float(np.abs(np.array(f()) - expected).max()))
print("PROBE " + json.dumps(errors))
"""


def test_the_route_sends_one_row_products_to_sgemv_and_the_rest_to_sgemm():
    if not MKL_WHEEL:
        pytest.fail("this check needs MKL's wheel (x86-64 Linux) to log the calls")
    import importlib.metadata

    mkl = next(str(f.locate()) for f in importlib.metadata.files("mkl") if f.name.startswith("libmkl_rt.so"))
    result = subprocess.run(
        [sys.executable, "-c", ROUTE_PROBE, str(CPU_PACKAGE), mkl], capture_output=True, text=True,
        timeout=120, env={**os.environ, "MKL_VERBOSE": "1"},
    )
    assert result.returncode == 0, result.stderr
    errors = json.loads(next(x for x in result.stdout.splitlines() if x.startswith("PROBE "))[6:])
    assert max(errors) < 1e-4
    calls = [
        [line.split()[1].split("(")[0] for line in case.splitlines() if "GEMM(" in line or "GEMV(" in line]
        for case in result.stdout.split("CASE")[1:]
    ]
    assert calls == [["SGEMV"]] * 7 + [["SGEMM"]]


def test_reference_keeps_the_wheels_blas():
    facts, stdout = probe(LLM_PTE_BLAS="reference", MKL_VERBOSE="1")
    assert facts["library"] is None and facts["global_sgemm"] is None
    assert "SGEMM(" not in stdout
    assert facts["max_err"] < 1e-4


def test_unopenable_library_is_reported_not_fatal(tmp_path):
    missing = tmp_path / "libnothere.so"
    facts, _ = probe(LLM_PTE_BLAS=str(missing))
    assert facts["library"] is None
    assert str(missing) in facts["advice"] and "reference BLAS" in facts["advice"]
    assert facts["max_err"] < 1e-4


# Calls the route's cblas_sgemm directly (no MLX), bound to scipy-openblas32
# as on a fresh machine: one-row products both ways round, with every
# transpose, padded leading dimensions (so a wrong stride reads the padding),
# beta 0 over a C of NaNs (which must not leak) and beta 0.5; and a product
# of several rows, forwarded to sgemm. Padding columns of C must stay as
# they were.
SHIM_PROBE = LOAD_ROUTE + """
import json, ctypes
import numpy as np
shim, _ = route.build()
route.bind(shim, sys.argv[2], sys.argv[3])
sgemm = ctypes.CDLL(str(shim)).cblas_sgemm
sgemm.argtypes = [ctypes.c_int] * 6 + [ctypes.c_float, ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p,
                                       ctypes.c_int, ctypes.c_float, ctypes.c_void_p, ctypes.c_int]
rng = np.random.default_rng(0)
errors = {}
for M, N, K in [(1, 40, 48), (40, 1, 48), (5, 7, 48)]:
    for ta in (111, 112):
        for tb in (111, 112):
            for beta in (0.0, 0.5):
                a_shape = (M, K) if ta == 111 else (K, M)
                b_shape = (K, N) if tb == 111 else (N, K)
                lda, ldb, ldc = a_shape[1] + 3, b_shape[1] + 5, N + 2  # padded rows
                A = rng.standard_normal((a_shape[0], lda)).astype(np.float32)
                B = rng.standard_normal((b_shape[0], ldb)).astype(np.float32)
                C = np.full((M, ldc), np.nan if beta == 0 else 1.0, np.float32)
                before = C.copy()
                opA = A[:, : a_shape[1]].astype(np.float64)
                opB = B[:, : b_shape[1]].astype(np.float64)
                opA, opB = (opA if ta == 111 else opA.T), (opB if tb == 111 else opB.T)
                want = 0.5 * opA @ opB + (beta * before[:, :N] if beta else 0)
                sgemm(101, ta, tb, M, N, K, 0.5, A.ctypes.data, lda, B.ctypes.data, ldb, beta, C.ctypes.data, ldc)
                err = float(np.abs(C[:, :N] - want).max())
                untouched = bool(np.array_equal(C[:, N:], before[:, N:], equal_nan=True))
                errors[f"M{M} N{N} ta{ta} tb{tb} beta{beta}"] = err if untouched else -1.0
print("PROBE " + json.dumps(errors))
"""


def test_the_route_maps_every_cblas_argument_onto_sgemv_and_sgemm(tmp_path):
    if not OPENBLAS_WHEEL:
        pytest.fail("this check needs scipy-openblas32's wheel (Linux)")
    result = subprocess.run(
        [sys.executable, "-c", SHIM_PROBE, str(CPU_PACKAGE), pip_openblas(), "scipy_"],
        capture_output=True, text=True, timeout=120, env={**os.environ, "XDG_CACHE_HOME": str(tmp_path)},
    )
    assert result.returncode == 0, result.stderr
    errors = json.loads(next(x for x in result.stdout.splitlines() if x.startswith("PROBE "))[6:])
    assert len(errors) == 24
    bad = {case: err for case, err in errors.items() if not 0 <= err < 1e-4}  # -1: padding written
    assert not bad


LATE_PROBE = """
import ctypes, json
import numpy as np
import mlx.core as mx  # first: libmlx binds the wheel's reference BLAS as it loads
from llm_executorch_mlx.runtime.cpu import blas, got

a = np.random.default_rng(0).standard_normal((64, 48)).astype(np.float32)
b = np.random.default_rng(1).standard_normal((48, 40)).astype(np.float32)
product = np.array(mx.array(a) @ mx.array(b))
status = blas.load_fast_blas()
sgemm = ctypes.cast(ctypes.CDLL(None).cblas_sgemm, ctypes.c_void_p).value
import os
print("PROBE " + json.dumps({
    "thread_timeout": os.environ.get("OPENBLAS_THREAD_TIMEOUT"),
    "library": status.library,
    "reason": status.reason,
    "libmlx_calls_global_sgemm": got.bound_to(str(blas._libmlx()), "cblas_sgemm") == [sgemm],
    "max_err": float(np.abs(product - a @ b).max()),
}))
"""


def late_probe(**env):
    result = subprocess.run([sys.executable, "-c", LATE_PROBE], capture_output=True, text=True, timeout=120,
                            env={**os.environ, **env})
    assert result.returncode == 0, result.stderr
    line = next(x for x in result.stdout.splitlines() if x.startswith("PROBE "))
    return json.loads(line[len("PROBE "):]), result.stdout, result.stderr


def test_importing_mlx_first_still_gets_the_route():
    """A script that imports mlx.core before the runtime: libmlx's BLAS
    import is pointed at the one-row route afterwards."""
    if not OPENBLAS_WHEEL:
        pytest.fail("this check needs scipy-openblas32's wheel (Linux)")
    facts, _, stderr = late_probe()
    assert DEFAULT_LIBRARY in facts["library"]
    assert facts["reason"].endswith("rebound in libmlx, which mlx.core had loaded first")
    assert facts["libmlx_calls_global_sgemm"] and "RuntimeWarning" not in stderr
    assert facts["max_err"] < 1e-4


def test_importing_mlx_first_reaches_mkl_too():
    """Without a compiler MKL is bound directly: its own log shows MLX's
    products arriving after the late rebinding."""
    if not MKL_WHEEL:
        pytest.fail("this check needs mkl's wheel (x86-64 Linux)")
    facts, stdout, _ = late_probe(MKL_VERBOSE="1", PATH="/nonexistent", CC="")
    assert "libmkl_rt" in facts["library"] and facts["libmlx_calls_global_sgemm"]
    assert "SGEMM(" in stdout
    assert facts["max_err"] < 1e-4
