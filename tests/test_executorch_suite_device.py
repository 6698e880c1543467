"""The op suite's route for a GPU machine (docs/gpu.md), run on this CPU:
cases packed with their inputs, run by the torch-free runner in its own
process, then judged here against torch eager as a plain run is."""

from __future__ import annotations

import importlib.util
import pathlib
import subprocess
import sys

import executorch_suite as suite

ROOT = pathlib.Path(__file__).resolve().parent.parent
# a bf16 output, an off-graph cache, a Metal kernel (refused), int64 indices
CASES = ["sin_16_bfloat16", "update_and_attend", "metal_kernel_1024", "gather_mm_e4_i64_o128_sorted"]


def _script():
    spec = importlib.util.spec_from_file_location("executorch_suite_script", ROOT / "scripts" / "executorch_suite.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_packed_cases_run_by_the_device_runner_match_torch_eager(request, tmp_path):
    cache = pathlib.Path(request.config.cache.mkdir("executorch-suite")) / suite.suite_digest()
    ids = [i for i in CASES if i in suite.configs()]
    assert ids == CASES
    suite.export_cases(cache, ids)
    script = _script()
    script.pack(cache, ids, tmp_path / "pack")
    out = tmp_path / "out"
    subprocess.run(
        [sys.executable, str(tmp_path / "pack" / "code" / "executorch_suite_device.py"), str(tmp_path / "pack"),
         "--state", str(tmp_path / "state"), "--out", str(out), "--workers", "1", "--compute", "native", "auto"],
        check=True, env={"PATH": "/usr/bin:/bin", "HOME": str(tmp_path)},
    )
    judged = script.device_outcomes(cache, ids, out, ["native", "auto"])
    for compute, rows in judged.items():
        for case_id, (passed, why) in rows.items():
            assert passed, f"{compute} {case_id}: {why}"
    assert judged["native"]["metal_kernel_1024"][1].startswith("refused, needs Metal")
