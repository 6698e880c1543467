"""A Linux environment whose MLX cannot load: every command that needs MLX
stops with one line naming the install that fixes it, before any traceback.

The broken environments are made the way pip makes them, in a folder put
first on PYTHONPATH of a child `llm`: a bare ``mlx`` package (the Python
side only, as the ``mlx`` wheel alone installs on Linux, whose ``mlx.core``
then fails to find ``libmlx.so``), and a second backend's dist-info beside
the installed ``mlx-cpu``. This is Linux behaviour (the suite's platform):
on macOS plain ``mlx`` brings its Metal backend.
"""

import importlib.metadata
import os
import subprocess
import sys

import pytest

from llm_executorch_mlx import mlx_backend

COMMANDS = [
    ["pte", "register", "m.pte", "--tokenizer", "tokenizer.json"],
    ["pte", "info", "m.pte"],
    ["pte", "export", "somewhere", "-o", "m.pte"],
    ["pte", "demo"],
    ["-m", "pte:m", "hello"],
]


def bare_mlx(site):
    """The ``mlx`` wheel without a backend: its extension cannot load libmlx."""
    pkg = site / "mlx"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "core.py").write_text(
        "raise ImportError('libmlx.so: cannot open shared object file: No such file or directory')\n"
    )


def second_backend(site, name="mlx_cuda_13", version="0.32.4"):
    info = site / f"{name}-{version}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name.replace('_', '-')}\nVersion: {version}\n")


def run_llm(site, user_dir, args):
    env = dict(os.environ, PYTHONPATH=str(site), LLM_USER_PATH=str(user_dir))
    return subprocess.run([sys.executable, "-m", "llm", *args], capture_output=True, text=True, env=env,
                          cwd=user_dir, timeout=120)


@pytest.fixture
def user_dir(tmp_path):
    d = tmp_path / "llm"
    d.mkdir()
    return d


def test_the_installed_environment_has_one_working_backend():
    assert mlx_backend.problem() is None
    assert mlx_backend.installed_backends() == {"mlx-cpu": importlib.metadata.version("mlx-cpu")}


def test_without_a_backend_each_command_names_the_cpu_and_cuda_extras(tmp_path, user_dir):
    site = tmp_path / "site"
    bare_mlx(site)
    (user_dir / "executorch-mlx.json").write_text(  # so that `llm -m pte:m` reaches our model
        '{"models": {"m": {"path": "m.pte", "tokenizer": "tokenizer.json"}}}'
    )
    for args in COMMANDS:
        r = run_llm(site, user_dir, args)
        assert r.returncode == 1, (args, r.stdout, r.stderr)
        lines = r.stderr.strip().splitlines()
        assert lines == [
            "Error: MLX has no backend on this machine (no libmlx): "
            "llm install 'llm-executorch-mlx[cpu]' (or [cuda13] / [cuda12] for an NVIDIA GPU)"
        ], (args, r.stderr)


def test_two_backends_are_refused_with_how_to_keep_one(tmp_path, user_dir):
    site = tmp_path / "site"
    second_backend(site)
    r = run_llm(site, user_dir, ["pte", "info", "m.pte"])
    assert r.returncode == 1
    assert r.stderr.strip().splitlines() == [
        "Error: mlx-cpu and mlx-cuda-13 are both installed and overwrite each other's libmlx.so: "
        "keep one, e.g. llm uninstall -y mlx-cpu mlx-cuda-13 && llm install 'llm-executorch-mlx[cuda13]'"
    ]


def test_the_extras_pull_one_backend_each():
    """Our cpu/cuda12/cuda13 extras are mlx's own, one backend wheel each,
    and no other extra of ours adds a second one."""
    requires = importlib.metadata.requires("llm-executorch-mlx")
    mlx_requirements = {r for r in requires if r.startswith("mlx[")}
    assert mlx_requirements == {
        "mlx[cpu]; extra == \"cpu\"", "mlx[cuda12]; extra == \"cuda12\"", "mlx[cuda13]; extra == \"cuda13\"",
        "mlx[cpu]; extra == \"test\"",
    }
    assert any(r.startswith("mlx") and "extra" not in r for r in requires)  # the Python side, always
