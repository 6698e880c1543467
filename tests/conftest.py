import pathlib
import sys

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).parent))

from models import make_fixture  # noqa: E402


@pytest.fixture(scope="session")
def fixture_root(request) -> pathlib.Path:
    """Where exported fixtures live; pytest's cache keeps them between local runs."""
    return pathlib.Path(request.config.cache.mkdir("pte-fixtures"))


@pytest.fixture(scope="session")
def exported(fixture_root):
    """``exported(arch, trained=False, dtype="fp32", qlinear=None)`` -> (hf dir, .pte)."""
    made = {}

    def get(arch, trained=False, dtype="fp32", qlinear=None):
        key = (arch, trained, dtype, qlinear)
        if key not in made:
            made[key] = make_fixture(fixture_root, arch, trained, dtype, qlinear)
        return made[key]

    return get
