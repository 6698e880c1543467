"""Compile the package's native code once into the user's cache directory.

The one build helper for both native pieces, the sgemm route (C,
``sgemm_route.py``) and the kernel extension (C++, ``extension.py``): where
builds are cached, which compiler is found, and compiling to a temporary name
then renaming, so concurrent builders never see a half-written library.
"""

from __future__ import annotations

import os
import pathlib
import shutil
import subprocess
import sys
import tempfile

C_COMPILERS = ("CC", ("cc", "gcc", "clang"))
CXX_COMPILERS = ("CXX", ("c++", "g++", "clang++"))


def cache_dir() -> pathlib.Path:
    base = os.environ.get("XDG_CACHE_HOME") or pathlib.Path.home() / ".cache"
    return pathlib.Path(base) / "llm-executorch-mlx"


def find_compiler(kind: tuple[str, tuple[str, ...]]) -> str | None:
    """The first of ``C_COMPILERS`` or ``CXX_COMPILERS`` on PATH (its
    environment variable first), as a full path."""
    env_var, names = kind
    for name in (os.environ.get(env_var), *names):
        if name and shutil.which(name):
            return shutil.which(name)
    return None


def compile_to(command: list[str], target: pathlib.Path, timeout: float, notice: str | None = None) -> None:
    """Run ``command -o <temporary>`` beside ``target``, then rename it to
    ``target``; ``notice`` goes to stderr first (a slow build says so).

    Raises OSError or subprocess.SubprocessError (CalledProcessError keeps
    the compiler's stderr); nothing is left behind then.
    """
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        built = pathlib.Path(tmp) / target.name
        if notice:
            print(f"llm-executorch-mlx: {notice}", file=sys.stderr, flush=True)
        subprocess.run([*command, "-o", str(built)], check=True, capture_output=True, timeout=timeout)
        os.replace(built, target)
