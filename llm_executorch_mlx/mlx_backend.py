"""Which MLX backend this environment has, found without importing mlx.

On Linux the ``mlx`` wheel is only the Python side: the library it loads,
``mlx/lib/libmlx.so``, comes from exactly one backend wheel (``mlx-cpu``,
``mlx-cuda-12`` or ``mlx-cuda-13``, pulled in by ``mlx[cpu]`` and friends).
Without one, ``import mlx.core`` fails with a loader error a user cannot act
on; with two, each overwrote the other's ``libmlx.so`` and uninstalling one
breaks the other. On macOS ``mlx`` brings ``mlx-metal`` itself.

``problem()`` names either case and the command that fixes it; the edge
(commands, the llm model, export) calls ``require()`` before anything imports
``mlx.core``.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import pathlib
import sys

PROJECT = "llm-executorch-mlx"
# Backend wheels, by the extra of ours (and of mlx) that installs each.
BACKENDS = {"mlx-cpu": "cpu", "mlx-cuda-12": "cuda12", "mlx-cuda-13": "cuda13", "mlx-metal": None}
DESCRIPTIONS = {"mlx-cpu": "CPU", "mlx-cuda-12": "CUDA 12", "mlx-cuda-13": "CUDA 13", "mlx-metal": "Metal"}
INSTALL = f"llm install '{PROJECT}[cpu]' (or [cuda13] / [cuda12] for an NVIDIA GPU)"


class MlxBackendError(Exception):
    """MLX cannot load here; the message is one line naming the fix."""


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def installed_backends() -> dict[str, str]:
    """The backend wheels installed here, with their versions."""
    found = {name: _version(name) for name in BACKENDS}
    return {name: v for name, v in found.items() if v is not None}


def _library_present() -> bool:
    spec = importlib.util.find_spec("mlx")
    if spec is None or not spec.submodule_search_locations:
        return False
    folder = pathlib.Path(list(spec.submodule_search_locations)[0]) / "lib"
    return any(folder.glob("libmlx.*"))


def problem() -> str | None:
    """Why MLX cannot run in this environment, with the fix; None when it can."""
    if _version("mlx") is None and importlib.util.find_spec("mlx") is None:
        return f"MLX is not installed: {INSTALL}" if sys.platform != "darwin" else f"MLX is not installed: llm install {PROJECT}"
    backends = installed_backends()
    if sys.platform == "darwin":
        return None
    gpu_and_cpu = [b for b in backends if b != "mlx-metal"]
    if len(gpu_and_cpu) > 1:
        keep = "cuda13" if "mlx-cuda-13" in gpu_and_cpu else "cuda12"
        return (
            f"{' and '.join(gpu_and_cpu)} are both installed and overwrite each other's libmlx.so: "
            f"keep one, e.g. llm uninstall -y {' '.join(gpu_and_cpu)} && llm install '{PROJECT}[{keep}]'"
        )
    if not _library_present():
        return f"MLX has no backend on this machine (no libmlx): {INSTALL}"
    return None


def require() -> None:
    """Raise ``MlxBackendError`` when ``import mlx.core`` would fail here."""
    message = problem()
    if message is not None:
        raise MlxBackendError(message)


def require_for_command() -> None:
    """``require()`` for an `llm pte` command: the one-line error click prints."""
    import click

    try:
        require()
    except MlxBackendError as e:
        raise click.ClickException(str(e)) from None


def describe() -> str:
    """One line for `llm pte info`: mlx's version and its backend wheel."""
    mlx = _version("mlx") or "?"
    backends = installed_backends()
    if not backends:
        return f"mlx {mlx} (no backend wheel: built from source?)"
    return f"mlx {mlx} with " + ", ".join(
        f"{name} {v} ({DESCRIPTIONS[name]})" for name, v in sorted(backends.items())
    )
