"""ExecuTorch's own MLX op suite, run through our runtime.

The cases are ``backends/mlx/test/test_ops.py`` as the installed executorch
wheel ships it: each a small module, its inputs and its tolerances. ExecuTorch
runs them with its C++ ``op_test_runner``; here each case is exported with the
MLX partitioner by the suite's own ``generate_test_files`` (``model.pte``,
``input.bin``, eager ``expected_output.bin``) into a cache keyed by the
suite's sources and the exporter's versions, in parallel worker processes.
``run_case`` then executes the ``.pte`` with ``load_program``, and ``judge``
compares its outputs with the suite's own comparison.

``tests/test_executorch_ops.py`` runs a subset under pytest;
``scripts/executorch_suite.py`` runs all of them.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import hashlib
import importlib.metadata
import importlib.util
import io
import json
import logging
import multiprocessing
import os
import pathlib
import sys
import types
import warnings
from dataclasses import dataclass

SUITE = "executorch.backends.mlx.test"
_DONE = "case.json"  # written last: a case directory without it is incomplete


def import_suite():
    """The suite's ``test_utils`` with every case of ``test_ops`` registered.

    ``executorch.extension.llm.modules``'s ``__init__`` imports torchtune for
    an attention module no case uses; the turboquant cases need only its
    ``turboquant`` subpackage, so without torchtune the package is entered
    without running that ``__init__``.
    """
    from llm_executorch_mlx.export import ensure_mlx_export_importable

    ensure_mlx_export_importable()  # a fresh install lacks executorch's generated MLX modules
    name = "executorch.extension.llm.modules"
    if name not in sys.modules and importlib.util.find_spec("torchtune") is None:
        import executorch.extension.llm as llm

        package = types.ModuleType(name)
        package.__path__ = [os.path.join(list(llm.__path__)[0], "modules")]
        sys.modules[name] = package
    from executorch.backends.mlx.test import test_ops, test_utils  # noqa: F401

    return test_utils


def configs() -> dict:
    """Every case, by a unique id: its name, plus ``#k`` for the k-th repeat of a name."""
    seen: dict[str, int] = {}
    out = {}
    for name, config in import_suite().get_all_test_configs():
        k = seen.get(name, 0)
        seen[name] = k + 1
        out[name if k == 0 else f"{name}#{k}"] = config
    return out


def representatives(cases: dict) -> list[str]:
    """One case per op and dtype: the first configuration of each test class
    for each combination of its input dtypes and dtype settings. A third of
    the suite (300 of 895 cases), every op in every dtype it is tested in."""
    import torch

    seen, ids = set(), []
    for case_id, config in cases.items():
        config._set_seed()
        inputs = config.create_test_inputs()
        inputs = (inputs,) if isinstance(inputs, torch.Tensor) else inputs
        key = (
            type(config).name,
            tuple(str(getattr(x, "dtype", type(x).__name__)) for x in inputs),
            tuple(str(getattr(config, a, None)) for a in _DTYPE_SETTINGS),
        )
        if key not in seen:
            seen.add(key)
            ids.append(case_id)
    return ids


_DTYPE_SETTINGS = ("dtype", "out_dtype", "kv_dtype", "target_dtype")


def suite_digest() -> str:
    """What an exported case depends on: the suite's sources and the exporter's versions."""
    h = hashlib.sha256()
    spec = importlib.util.find_spec(SUITE)
    root = pathlib.Path(list(spec.submodule_search_locations)[0])
    for source in ("test_ops.py", "test_utils.py"):
        h.update((root / source).read_bytes())
    for dist in ("executorch", "torch", "transformers"):
        h.update(f"{dist}=={importlib.metadata.version(dist)}".encode())
    return h.hexdigest()[:16]


def _case_dir(cache: pathlib.Path, case_id: str) -> pathlib.Path:
    return cache / case_id.replace("/", "_")


def missing(cache: pathlib.Path, ids) -> list[str]:
    return [i for i in ids if not (_case_dir(cache, i) / _DONE).exists()]


def export_cases(cache: pathlib.Path, ids, workers: int | None = None) -> None:
    """Export the cases of ``ids`` not yet in ``cache``, in worker processes."""
    todo = missing(cache, ids)
    if not todo:
        return
    workers = workers or len(os.sched_getaffinity(0))
    chunks = [todo[i::workers] for i in range(workers)]
    # spawn: a fresh interpreter per worker (no forked MLX or torch threads).
    context = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(len(chunks), mp_context=context) as pool:
        for done in pool.map(_export_chunk, [str(cache)] * len(chunks), chunks):
            pass


def _export_chunk(cache: str, ids: list[str]) -> int:
    import torch

    torch.set_num_threads(1)  # one core per worker
    logging.disable(logging.WARNING)
    warnings.simplefilter("ignore")
    cases = configs()
    for case_id in ids:
        _export_one(pathlib.Path(cache), case_id, cases[case_id])
    return len(ids)


def _export_one(cache: pathlib.Path, case_id: str, config) -> None:
    out = _case_dir(cache, case_id)
    out.mkdir(parents=True, exist_ok=True)
    config.get_test_dir = lambda: out  # the suite writes under its own package otherwise
    record = {
        "rtol": config.rtol, "atol": config.atol,
        "skip_comparison": config.skip_comparison, "kv_cache": config.kv_cache,
        "export_error": None,
    }
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            config.generate_test_files()
    except Exception as e:  # the exporter's own failure, recorded for the test to report
        record["export_error"] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:300]
    tmp = out / (_DONE + ".tmp")
    tmp.write_text(json.dumps(record))
    os.replace(tmp, out / _DONE)


@dataclass
class Exported:
    """One exported case: its program, test inputs, eager outputs and tolerances."""

    case_id: str
    pte: pathlib.Path
    rtol: float
    atol: float
    skip_comparison: bool
    kv_cache: str | None
    export_error: str | None

    @property
    def inputs(self) -> list:
        return import_suite().load_tensors_from_bin(self.pte.parent / "input.bin")

    @property
    def expected(self) -> list:
        return import_suite().load_tensors_from_bin(self.pte.parent / "expected_output.bin")


def exported(cache: pathlib.Path, case_id: str) -> Exported:
    d = _case_dir(cache, case_id)
    record = json.loads((d / _DONE).read_text())
    return Exported(case_id, d / "model.pte", **record)


def run_case(case: Exported, compute: str, inputs=None) -> list:
    """Run the case's ``forward`` through our runtime (on ``inputs``, the
    case's own by default); its outputs as numpy arrays, bf16 as its bits
    (``to_torch`` reads them back), so that MLX's errors surface here."""
    import numpy as np
    from llm_executorch_mlx.runtime import load_program

    program = load_program(case.pte, compute=compute)
    try:
        cache = None if case.kv_cache is None else cache_for(program, case.kv_cache)
        method = program.load_method("forward", cache=cache)
        outputs = method.execute(case.inputs if inputs is None else inputs)
        return [(_dtype_name(x), np.array(_bits(x))) for x in outputs]
    finally:
        program.close()


_KV_DTYPES = {5: "fp16", 6: "fp32", 15: "bf16"}  # ScalarType codes of the spec


def cache_for(program, spec: str):
    """The off-graph cache a case's runner installs: ``spec`` is the suite's
    ``capacity,n_layers,n_kv_heads,head_dim[,kv_dtype]``. The layers come
    from the program (``new_cache``); the spec's must agree."""
    capacity, n_layers, n_kv_heads, head_dim, *dtype = (int(x) for x in spec.split(","))
    cache = program.new_cache(capacity=capacity, dtype=_KV_DTYPES[dtype[0]] if dtype else "fp32")
    got = [(g.n_kv_heads, g.head_dim) for g in cache.layers]
    assert got == [(n_kv_heads, head_dim)] * n_layers, f"cache layers {got}, the case's spec {spec}"
    return cache


def _dtype_name(x) -> str:
    return str(getattr(x, "dtype", type(x).__name__)).removeprefix("mlx.core.")


def _bits(x):
    """An MLX bf16 array as its uint16 bits (numpy has no bf16)."""
    import mlx.core as mx

    if isinstance(x, mx.array) and x.dtype == mx.bfloat16:
        return x.view(mx.uint16)
    return x


def to_torch(output):
    """A ``run_case`` output (its dtype name and numpy array) as a torch tensor
    of that dtype (bf16 through its bits)."""
    import torch

    dtype, array = output
    if dtype == "bfloat16":
        return torch.from_numpy(array.copy()).view(torch.bfloat16)
    return torch.from_numpy(array.copy())


def compare(case: Exported, actual: list) -> tuple[bool, str]:
    """The suite's own comparison at the case's tolerances, after a dtype check
    (the suite's runner compares values only: it casts mismatched dtypes to fp32)."""
    expected = case.expected
    for i, (e, a) in enumerate(zip(expected, actual)):
        if e.dtype != a.dtype:
            return False, f"output {i} has dtype {a.dtype}, torch eager returns {e.dtype}"
    return import_suite().compare_outputs(expected, actual, rtol=case.rtol, atol=case.atol)


# Cases ExecuTorch's exporter fails on here, with the error each fails with:
# the suite's MockModelConfig predates transformers 5, whose StaticCache reads
# config.per_layer_config.
EXPORT_FAILURES = {
    "hf_static_cache": "AttributeError: 'MockModelConfig' object has no attribute 'per_layer_config'",
    "hf_static_cache_slice": "AttributeError: 'MockModelConfig' object has no attribute 'per_layer_config'",
}


def known_export_failure(case_id: str) -> str | None:
    return EXPORT_FAILURES.get(case_id.split("#")[0])


def needs_metal(case: Exported) -> bool:
    """Whether the program runs a Metal kernel (a ``MetalKernelNode`` in any chain)."""
    from llm_executorch_mlx.runtime.pte.container import PteFile
    from llm_executorch_mlx.runtime.pte.graph import decode_graph, node_name

    pte = PteFile(case.pte)
    try:
        graphs = [decode_graph(d.payload) for p in pte.plans.values() for d in p.delegates]
    finally:
        pte.close()
    return any(
        node_name(i) == "MetalKernelNode"
        for g in graphs for chain in g.instructionChains or [] for i in chain.instructions or []
    )


def attempt(case: Exported, compute: str, inputs=None) -> tuple[str, object]:
    """Run the case: ``("outputs", run_case's outputs)``, or ``("refused", our
    error)``, or ``("escaped", what else escaped our runtime)``. Torch-free:
    ``scripts/executorch_suite_device.py`` calls it on a device machine."""
    from llm_executorch_mlx.runtime import PteError

    try:
        return "outputs", run_case(case, compute, inputs)
    except PteError as e:
        return "refused", str(e)
    except Exception as e:  # noqa: BLE001 - what escapes our runtime is the finding
        return "escaped", f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"


def judge(case: Exported, kind: str, result) -> tuple[bool, str]:
    """Whether an ``attempt``'s result passes, and why (or why not).

    A case whose program runs a Metal kernel passes when it is refused with
    our error naming that node; the rest must run and match torch eager.
    """
    if case.export_error:
        return False, f"does not export: {case.export_error}"
    metal = needs_metal(case)
    if kind == "refused":
        if metal and "MetalKernelNode" in result:
            return True, f"refused, needs Metal: {result}"
        return False, f"refused: {result}"
    if kind == "escaped":
        return False, f"escaped {result}"
    if metal:
        return False, "runs a Metal kernel, yet was not refused"
    if case.skip_comparison:
        return True, "ran (pattern-only: the suite compares nothing)"
    return compare(case, [to_torch(x) for x in result])


def outcome(case: Exported, compute: str) -> tuple[bool, str]:
    """Whether the case passes in ``compute`` mode here, and why (or why not)."""
    if case.export_error:
        return judge(case, "", None)
    return judge(case, *attempt(case, compute))
