"""Run every case of ExecuTorch's MLX op suite through our runtime.

    python scripts/executorch_suite.py [--compute auto native] [--cache DIR] [-k SUBSTRING] [--json OUT]

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
    args = parser.parse_args()

    ids = [i for i in suite.configs() if args.substring in i]
    cache = args.cache / suite.suite_digest()
    start = time.perf_counter()
    n_missing = len(suite.missing(cache, ids))
    suite.export_cases(cache, ids, args.workers)
    print(f"exported {n_missing} of {len(ids)} cases in {time.perf_counter() - start:.1f} s ({cache})")

    results, failed = {}, 0
    for compute in args.compute:
        start = time.perf_counter()
        rows = {i: suite.outcome(suite.exported(cache, i), compute) for i in ids}
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


if __name__ == "__main__":
    sys.exit(main())
