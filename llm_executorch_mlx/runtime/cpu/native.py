"""Compile the package's native code once into the user's cache directory.

The one build helper for both native pieces, the sgemm route (C,
``sgemm_route.py``) and the kernel extension (C++, ``extension.py``): where
builds are cached, which compiler is found, and compiling to a temporary name
then renaming, so concurrent builders never see a half-written library. Each
source is compiled on its own, as many at once as the machine has cores, then
linked: one compiler process takes its sources one after another.
"""

from __future__ import annotations

import os
import pathlib
import shutil
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from typing import NamedTuple

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


def _cores() -> int:
    """The cores this process may run on (a container's or taskset's share)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


class Recipe(NamedTuple):
    """How a library is built: ``compile`` (the compiler and its flags) makes an
    object of each of ``sources``; the compiler links them with ``link``."""

    compile: list[str]
    sources: list[str]
    link: list[str]

    def key(self) -> list[str]:
        """What names this build (a cache key's part)."""
        return [*self.compile, *self.sources, *self.link]


def compile_to(recipe: Recipe, target: pathlib.Path, timeout: float, notice: str | None = None) -> None:
    """Build ``target`` beside itself under a temporary name, then rename it;
    ``notice`` goes to stderr first (a slow build says so).

    Raises OSError or subprocess.SubprocessError (CalledProcessError keeps
    the compiler's stderr; the first source's to fail, in ``sources``'
    order); nothing is left behind then.
    """
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        objects = [str(pathlib.Path(tmp) / f"{i}.o") for i in range(len(recipe.sources))]
        if notice:
            print(f"llm-executorch-mlx: {notice}", file=sys.stderr, flush=True)

        def run(command: list[str]) -> None:
            subprocess.run(command, check=True, capture_output=True, timeout=timeout)

        with ThreadPoolExecutor(max_workers=min(len(objects), _cores())) as pool:
            compiled = [pool.submit(run, [*recipe.compile, "-c", source, "-o", obj])
                        for source, obj in zip(recipe.sources, objects)]
        for done in compiled:
            done.result()
        built = pathlib.Path(tmp) / target.name
        run([recipe.compile[0], *objects, *recipe.link, "-o", str(built)])
        os.replace(built, target)
