"""What the numbers depend on: the BLAS MLX's CPU matmuls call, the machine,
the package versions and the load.

The runtime binds an optimized BLAS (OpenBLAS or MKL) into MLX when it is
imported before ``mlx.core``; a benchmark calls ``bind_blas_and_import_mlx``
first, so every MLX user in the process (mlx-lm too) calls the same
``cblas_sgemm``.
"""

from __future__ import annotations

import datetime
import importlib.metadata
import os
import platform
import sys

BLAS_ENV = "LLM_PTE_BLAS"  # runtime/cpu/blas.py's ENV_VAR, named here so it is set before the runtime loads


def bind_blas_and_import_mlx(choice: str = "auto") -> dict:
    """Let the runtime bind MLX's BLAS (``choice``: auto, reference or a
    library path), then import ``mlx.core``. Returns what was bound and why."""
    mlx_first = "mlx.core" in sys.modules  # only if something imported it before
    if choice != "auto":
        os.environ[BLAS_ENV] = choice
    from llm_executorch_mlx.runtime.cpu import blas

    assert blas.ENV_VAR == BLAS_ENV, blas.ENV_VAR
    status = blas.load_fast_blas()
    import mlx.core  # noqa: F401 (binds the BLAS for the process)

    return {
        "choice": choice,
        "env": os.environ.get(BLAS_ENV),
        "library": status.library,
        "reason": status.reason,
        "advice": status.advice,
        "global_sgemm_library": blas.global_sgemm_library(),
        "mlx_imported_first": mlx_first,
        "ld_preload": os.environ.get("LD_PRELOAD"),
    }


def blas_note(info: dict) -> str | None:
    """A line for stderr when MLX is left on its reference BLAS, else None."""
    if info["global_sgemm_library"]:
        return None
    line = f"note: no optimized BLAS is bound for MLX ({info['reason']}); ours and mlx-lm run on MLX's slow reference BLAS"
    if info["advice"]:
        line += f". {info['advice']}"
    return line


def cpu_model() -> str | None:
    """The CPU's model name from /proc/cpuinfo, when there is one."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


def machine_info(blas: dict) -> dict:
    """Machine, versions, BLAS (``bind_blas_and_import_mlx``'s answer) and load."""
    import mlx.core as mx

    versions = {}
    for dist in ("mlx", "mlx-lm", "executorch", "torch", "transformers", "mkl", "llm-executorch-mlx"):
        try:
            versions[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            versions[dist] = None
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "cpu_model": cpu_model(),
        "cpu_count": os.cpu_count(),
        "cpus_available": len(os.sched_getaffinity(0)),
        "mlx_device": str(mx.default_device()),
        "versions": versions,
        "blas": blas,
        "ld_preload": os.environ.get("LD_PRELOAD"),
        "loadavg_start": os.getloadavg(),
    }
