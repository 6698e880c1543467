"""ExecuTorch's own MLX op suite through our runtime, in both compute modes.

Each case is exported with the MLX partitioner by the suite's own code and
compared with torch eager at the case's own tolerances
(``executorch_suite.py``). This runs one case per op and dtype
(``representatives``); ``scripts/executorch_suite.py`` runs every case.
"""

from __future__ import annotations

import pathlib

import pytest

import executorch_suite as suite

CASES = suite.configs()
IDS = suite.representatives(CASES)
NOT_EXPORTED = [i for i in IDS if suite.known_export_failure(i)]
COMPARED = [i for i in IDS if i not in NOT_EXPORTED]


@pytest.fixture(scope="session")
def suite_cache(request) -> pathlib.Path:
    """The exported cases, made once per suite version (pytest's cache keeps them)."""
    cache = pathlib.Path(request.config.cache.mkdir("executorch-suite")) / suite.suite_digest()
    suite.export_cases(cache, IDS)
    return cache


@pytest.mark.parametrize("compute", ["native", "auto"])
@pytest.mark.parametrize("case_id", COMPARED)
def test_executorch_case_matches_torch_eager(suite_cache, case_id, compute):
    passed, why = suite.outcome(suite.exported(suite_cache, case_id), compute)
    assert passed, why


@pytest.mark.parametrize("case_id", NOT_EXPORTED)
def test_executorch_case_still_fails_to_export_as_known(suite_cache, case_id):
    """When ExecuTorch exports it again, it belongs in the comparison above."""
    assert suite.exported(suite_cache, case_id).export_error == suite.known_export_failure(case_id)
