"""Run every case of ExecuTorch's MLX op suite through our runtime.

    python scripts/executorch_suite.py [--compute auto native] [--cache DIR] [-k SUBSTRING] [--json OUT]
                                       [--pack DIR | --device-outputs DIR]

Exports the cases missing from the cache (``tests/executorch_suite.py``: in
parallel, keyed by the suite's content; pytest's cache by default, so the
tests and this script share it), runs each in each compute mode, compares
with torch eager at the case's own tolerances, and prints the figures per
mode and every case that fails, with its reason. Exits 1 if any fails.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import shutil
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

import llm_executorch_mlx.runtime  # noqa: E402,F401  (binds MLX's BLAS before mlx is imported)
import executorch_suite as suite  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--compute", nargs="+", default=["auto", "native"])
    parser.add_argument("--cache", type=pathlib.Path,
                        default=ROOT / ".pytest_cache" / "d" / "executorch-suite")
    parser.add_argument("-k", dest="substring", default="", help="only cases whose id contains this")
    parser.add_argument("--workers", type=int, default=None)
    parser.add_argument("--json", type=pathlib.Path, help="write every outcome here")
    parser.add_argument("--pack", type=pathlib.Path, help="write the cases and the runner here, then stop")
    parser.add_argument("--device-outputs", type=pathlib.Path,
                        help="judge the outcomes executorch_suite_device.py wrote here")
    args = parser.parse_args()

    ids = [i for i in suite.configs() if args.substring in i]
    cache = args.cache / suite.suite_digest()
    start = time.perf_counter()
    n_missing = len(suite.missing(cache, ids))
    suite.export_cases(cache, ids, args.workers)
    print(f"exported {n_missing} of {len(ids)} cases in {time.perf_counter() - start:.1f} s ({cache})")
    if args.pack:
        pack(cache, ids, args.pack)
        return 0
    judged = None
    if args.device_outputs:
        judged = device_outcomes(cache, ids, args.device_outputs, args.compute)

    results, failed = {}, 0
    for compute in args.compute:
        start = time.perf_counter()
        if judged is None:
            rows = {i: suite.outcome(suite.exported(cache, i), compute) for i in ids}
        else:
            rows = judged[compute]
        results[compute] = rows
        bad = {i: why for i, (ok, why) in rows.items() if not ok and not suite.known_export_failure(i)}
        known = sum(1 for i in rows if suite.known_export_failure(i))
        compared = sum(  # less the known export failures, Metal refusals, pattern-only runs
            1 for i, (ok, why) in rows.items()
            if not suite.known_export_failure(i) and not why.startswith(("refused, needs Metal", "ran ("))
        )
        failed += len(bad)
        print(f"compute={compute}: {len(ids) - len(bad) - known} of {len(ids)} pass, "
              f"{compared - len(bad)} of {compared} compared with torch eager match, "
              f"{known} do not export, as known ({time.perf_counter() - start:.1f} s)")
        for i, why in bad.items():
            print(f"  FAIL {i}: {why}")
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    return 1 if failed else 0


def pack(cache: pathlib.Path, ids: list[str], out: pathlib.Path) -> None:
    """Each exported case's program and inputs (numpy, bf16 as its bits), and
    the runner with the runtime it imports, into ``out``."""
    import numpy as np
    import torch

    cases = {}
    for case_id in ids:
        case = suite.exported(cache, case_id)
        if case.export_error:
            continue
        name = case.pte.parent.name
        d = out / "cases" / name
        d.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(case.pte, d / "model.pte")
        inputs = case.inputs
        np.savez(d / "inputs.npz", *[
            (x.view(torch.uint16) if x.dtype == torch.bfloat16 else x).numpy() for x in inputs
        ])
        cases[name] = {"id": case_id, "kv_cache": case.kv_cache,
                       "inputs": [str(x.dtype).removeprefix("torch.") for x in inputs]}
    (out / "manifest.json").write_text(json.dumps({"digest": cache.name, "cases": cases}, indent=1))
    code = out / "code"
    shutil.rmtree(code, ignore_errors=True)
    shutil.copytree(ROOT / "llm_executorch_mlx", code / "llm_executorch_mlx",
                    ignore=shutil.ignore_patterns("__pycache__", "*.so"))
    shutil.copy(ROOT / "scripts" / "executorch_suite_device.py", code)
    shutil.copy(ROOT / "tests" / "executorch_suite.py", code)
    size = sum(f.stat().st_size for f in out.rglob("*") if f.is_file())
    print(f"packed {len(cases)} cases and the runner into {out} ({size / 2**20:.1f} MiB)")


def device_outcomes(cache: pathlib.Path, ids: list[str], outputs: pathlib.Path, computes) -> dict:
    """The device's results (``outcomes.json``, ``outputs-<compute>.npz``) judged here."""
    import numpy as np

    record = json.loads((outputs / "outcomes.json").read_text())
    if record["digest"] != cache.name:
        sys.exit(f"{outputs} holds outcomes of suite {record['digest']}, this one is {cache.name}: pack again")
    print(f"device results: mlx {record['mlx']} on {record['device']}; "
          f"compute=auto widens LLM programs there: {record['auto_widens_llm_programs']}")
    judged = {}
    for compute in computes:
        rows = record["results"][compute]
        with np.load(outputs / f"outputs-{compute}.npz") as z:
            judged[compute] = {}
            for i in ids:
                case = suite.exported(cache, i)
                if case.export_error:
                    judged[compute][i] = suite.judge(case, "", None)
                elif i not in rows:
                    judged[compute][i] = (False, "not run on the device")
                else:
                    row = rows[i]
                    result = ([(d, z[f"{row['name']}.{k}"]) for k, d in enumerate(row["dtypes"])]
                              if row["kind"] == "outputs" else row["error"])
                    judged[compute][i] = suite.judge(case, row["kind"], result)
    return judged


if __name__ == "__main__":
    sys.exit(main())
