"""The parity and plugin tests once more, as on a machine without a compiler.

Without a C++ compiler there is no CPU kernel extension (attention runs as
MLX ops, decode products through BLAS, quantized ones through MLX's
``quantized_matmul``), without a C compiler no one-row BLAS route, and MLX
itself fuses no element-wise ops (its JIT calls ``g++``). A child pytest runs
``test_parity.py`` and ``test_plugin.py`` with a PATH that holds every
program of this one except the compilers, and ``--without-compiler``, under
which conftest checks that none is found and no kernel is loaded, and the
tests that name the kernels expect their absence (``llm pte info`` says so).
The exported fixtures are the parent's (the same pytest cache).
"""

import os
import pathlib
import re
import subprocess
import sys

COMPILER = re.compile(r"^(.+-)?(cc|gcc|g\+\+|c\+\+|clang|clang\+\+)(-[\d.]+)?$")
HERE = pathlib.Path(__file__).parent


def path_without_compilers(bin_dir: pathlib.Path) -> str:
    """A one-directory PATH linking every program on PATH but the compilers."""
    bin_dir.mkdir()
    for directory in reversed(os.environ.get("PATH", "").split(os.pathsep)):  # earlier entries win
        if not os.path.isdir(directory):
            continue
        for entry in os.scandir(directory):
            if COMPILER.match(entry.name) or not os.access(entry.path, os.X_OK) or entry.is_dir():
                continue
            link = bin_dir / entry.name
            if link.is_symlink():
                link.unlink()
            link.symlink_to(entry.path)
    return str(bin_dir)


def test_parity_and_plugin_tests_pass_without_a_compiler(tmp_path, request):
    env = {k: v for k, v in os.environ.items() if k not in ("CC", "CXX")}
    env["PATH"] = path_without_compilers(tmp_path / "bin")
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "--without-compiler",
         "--rootdir", str(request.config.rootpath), str(HERE / "test_parity.py"), str(HERE / "test_plugin.py")],
        env=env, capture_output=True, text=True, cwd=request.config.rootpath,
    )
    summary = run.stdout.strip().splitlines()[-1] if run.stdout.strip() else ""
    assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-3000:]
    # every test passed: none failed, errored or was skipped
    assert re.fullmatch(r"\d+ passed(, \d+ warnings?)? in .*", summary), summary
    assert int(summary.split()[0]) >= 50
