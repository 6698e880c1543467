"""MLX's CPU matmuls reach an optimized BLAS without LD_PRELOAD.

Each case runs in a fresh interpreter: the BLAS is bound when mlx.core first
loads, which this test process did long ago.
"""

import json
import os
import platform
import subprocess
import sys

# The `cpu` and `test` extras install MKL's wheel on x86-64 Linux; elsewhere
# the runtime leaves MLX's own BLAS alone (Accelerate on macOS).
MKL_EXPECTED = sys.platform.startswith("linux") and platform.machine() == "x86_64"

PROBE = """
import json
import numpy as np
from llm_executorch_mlx.runtime import blas
import mlx.core as mx

a = np.random.default_rng(0).standard_normal((64, 48)).astype(np.float32)
b = np.random.default_rng(1).standard_normal((48, 40)).astype(np.float32)
product = np.array(mx.array(a) @ mx.array(b))
status = blas.load_fast_blas()
print("PROBE " + json.dumps({
    "library": status.library,
    "reason": status.reason,
    "advice": status.advice,
    "global_sgemm": blas.global_sgemm_library(),
    "max_err": float(np.abs(product - a @ b).max()),
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


def test_mkl_from_the_cpu_extra_serves_mlx_matmuls():
    facts, stdout = probe(MKL_VERBOSE="1")
    if not MKL_EXPECTED:
        assert facts["library"] is None and facts["advice"] is None
        return
    assert facts["library"] and "libmkl_rt" in facts["library"]
    assert facts["global_sgemm"] == facts["library"]  # what libmlx binds at load
    assert "SGEMM(" in stdout  # MKL's own log of the call MLX made
    assert facts["max_err"] < 1e-4
    assert facts["advice"] is None


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
