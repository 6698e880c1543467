"""Run a packed ExecuTorch MLX op suite through our runtime, on a machine
that has neither torch nor executorch (an NVIDIA GPU with mlx-cuda).

    python PACK/code/executorch_suite_device.py PACK --state DIR --out DIR [--compute auto native] [--workers N] [--budget S]

``PACK`` is what ``scripts/executorch_suite.py --pack`` writes: each case's
``model.pte`` and inputs, and this script with the runtime beside it. Each
case runs with ``load_program(...).load_method("forward").execute(...)`` in
each compute mode, in ``--workers`` processes (MLX compiles its GPU kernels
on the host: the processes share that work). Every result is kept in
``--state`` as it comes, so a run stopped by ``--budget`` seconds resumes
where it stopped. ``--out`` gets ``outcomes.json`` (what each case returned
or raised, and the MLX device) and ``outputs-<compute>.npz`` (the outputs);
``scripts/executorch_suite.py --device-outputs`` compares them with torch
eager where the suite lives.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import subprocess
import sys
import time

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import llm_executorch_mlx.runtime  # noqa: E402,F401  (binds MLX's BLAS on a CPU before mlx is imported)
import executorch_suite as suite  # noqa: E402  (torch-free until compared)


def inputs_of(path: pathlib.Path, dtypes: list[str]) -> list:
    """A case's packed inputs as MLX arrays (bf16 from its bits)."""
    import mlx.core as mx
    import numpy as np

    with np.load(path) as z:
        arrays = [z[f"arr_{k}"] for k in range(len(dtypes))]
    return [mx.array(a).view(mx.bfloat16) if d == "bfloat16" else mx.array(a)
            for a, d in zip(arrays, dtypes)]


def run_shard(pack: pathlib.Path, state: pathlib.Path, computes: list[str],
              shard: int, workers: int, deadline: float) -> None:
    import numpy as np

    manifest = json.loads((pack / "manifest.json").read_text())
    names = sorted(manifest["cases"])[shard::workers]
    for compute in computes:
        (state / compute).mkdir(parents=True, exist_ok=True)
    for name in names:
        entry = manifest["cases"][name]
        for compute in computes:
            done = state / compute / f"{name}.json"
            if done.exists():
                continue
            if time.time() > deadline:
                return
            d = pack / "cases" / name
            case = suite.Exported(entry["id"], d / "model.pte", 0.0, 0.0, False,
                                  entry["kv_cache"], None)
            start = time.perf_counter()
            kind, result = suite.attempt(case, compute, inputs_of(d / "inputs.npz", entry["inputs"]))
            record = {"kind": kind, "s": round(time.perf_counter() - start, 3)}
            if kind == "outputs":
                record["dtypes"] = [dtype for dtype, _ in result]
                np.savez(state / compute / f"{name}.npz", *[a for _, a in result])
            else:
                record["error"] = result
            tmp = done.with_suffix(".tmp")
            tmp.write_text(json.dumps(record))
            tmp.replace(done)


def collect(pack: pathlib.Path, state: pathlib.Path, out: pathlib.Path, computes: list[str]) -> int:
    """Gather the results in ``state`` into ``out``; the number still missing."""
    import mlx.core as mx
    import numpy as np

    from llm_executorch_mlx.runtime.dtypes import compute_dtype_map

    manifest = json.loads((pack / "manifest.json").read_text())
    outcomes = {"mlx": mx.__version__, "device": str(mx.default_device()),
                "auto_widens_llm_programs": bool(compute_dtype_map("auto", llm=True)),
                "digest": manifest["digest"], "results": {}}
    missing = 0
    for compute in computes:
        rows, arrays = {}, {}
        for name, entry in sorted(manifest["cases"].items()):
            done = state / compute / f"{name}.json"
            if not done.exists():
                missing += 1
                continue
            record = json.loads(done.read_text())
            if record["kind"] == "outputs":
                with np.load(state / compute / f"{name}.npz") as z:
                    for k in range(len(record["dtypes"])):
                        arrays[f"{name}.{k}"] = z[f"arr_{k}"]
            rows[entry["id"]] = record | {"name": name}
        outcomes["results"][compute] = rows
        np.savez_compressed(out / f"outputs-{compute}.npz", **arrays)
    (out / "outcomes.json").write_text(json.dumps(outcomes, indent=1))
    return missing


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("pack", type=pathlib.Path)
    parser.add_argument("--state", type=pathlib.Path, required=True)
    parser.add_argument("--out", type=pathlib.Path, required=True)
    parser.add_argument("--compute", nargs="+", default=["auto", "native"])
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--budget", type=float, default=480.0, help="seconds before workers stop starting cases")
    parser.add_argument("--shard", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--deadline", type=float, help=argparse.SUPPRESS)
    args = parser.parse_args()

    if args.shard is not None:
        run_shard(args.pack, args.state, args.compute, args.shard, args.workers, args.deadline)
        return 0
    deadline = time.time() + args.budget
    start = time.perf_counter()
    procs = [
        subprocess.Popen([sys.executable, __file__, str(args.pack), "--state", str(args.state),
                          "--out", str(args.out), "--compute", *args.compute,
                          "--workers", str(args.workers), "--shard", str(i), "--deadline", str(deadline)])
        for i in range(args.workers)
    ]
    codes = [p.wait() for p in procs]
    args.out.mkdir(parents=True, exist_ok=True)
    missing = collect(args.pack, args.state, args.out, args.compute)
    print(f"ran in {time.perf_counter() - start:.1f} s; workers exited {codes}; "
          f"{missing} case runs still to do (run again to resume)")
    return 0 if missing == 0 and not any(codes) else 1


if __name__ == "__main__":
    sys.exit(main())
