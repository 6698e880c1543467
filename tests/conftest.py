import os
import pathlib
import sys

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).parent))

from models import make_fixture  # noqa: E402

WITHOUT_COMPILER = "--without-compiler"


def pytest_addoption(parser):
    parser.addoption(
        WITHOUT_COMPILER, action="store_true",
        help="check the run is one without a C or C++ compiler (test_without_compiler.py runs the "
             "parity and plugin tests so): no CPU kernel extension, no one-row BLAS route",
    )


@pytest.fixture(scope="session")
def compiler(request) -> bool:
    """Whether this run has a compiler, so the CPU kernels (``runtime/cpu``).

    Under ``--without-compiler`` the run must really have none: no compiler
    found, the kernels off for that reason, and none loaded by the end.
    """
    if not request.config.getoption(WITHOUT_COMPILER):
        yield True
        return
    from llm_executorch_mlx.runtime import cpu
    from llm_executorch_mlx.runtime.cpu import extension, native

    assert not {"CC", "CXX"} & set(os.environ)
    assert native.find_compiler(native.C_COMPILERS) is None and native.find_compiler(native.CXX_COMPILERS) is None
    found = cpu.kernels(build=True)
    assert (found.attention, found.products) == (cpu.Use(False, "no C++ compiler"),) * 2 and found.extension is None
    assert "no C compiler" in found.blas.reason or found.blas.library is None
    yield False
    assert extension.find().module is None


@pytest.fixture(scope="session", autouse=True)
def _checked_without_compiler(request):
    if request.config.getoption(WITHOUT_COMPILER):
        request.getfixturevalue("compiler")


@pytest.fixture(scope="session")
def fixture_root(request) -> pathlib.Path:
    """Where exported fixtures live; pytest's cache keeps them between local runs."""
    return pathlib.Path(request.config.cache.mkdir("pte-fixtures"))


@pytest.fixture(scope="session")
def exported(fixture_root):
    """``exported(arch, trained=False, dtype="fp32", qlinear=None, qembedding=None, tied=False)``
    -> (hf dir, .pte)."""
    made = {}

    def get(arch, trained=False, dtype="fp32", qlinear=None, qembedding=None, tied=False):
        key = (arch, trained, dtype, qlinear, qembedding, tied)
        if key not in made:
            made[key] = make_fixture(fixture_root, arch, trained, dtype, qlinear, qembedding=qembedding, tied=tied)
        return made[key]

    return get
