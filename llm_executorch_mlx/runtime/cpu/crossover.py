"""Where BLAS's sgemm overtakes the extension's dense products, measured once
per machine.

A prefill chunk's products against fp32 weights (up to the extension's
``dense_rows``) can run as the extension's row loops (``gemv.cpp``, shared with the host thread) or as
BLAS's sgemm. Which is faster depends on the CPU and the BLAS (``benchmarks/bench_rows.py``
shows it), so the first explicit use (``kernels(build=True)``, after the build) times
both on a few SmolLM2-sized weights at all and half those rows, the way a chunk
runs them, and keeps the answer in the cache directory, keyed by the
extension's file and the BLAS library: the most rows the extension takes
against an fp32 weight. Remove the file to measure again.
"""

from __future__ import annotations

import hashlib
import json
import os
import time

from . import native

FEWEST_ROWS = 32  # at most this many rows stay the extension's: one read of the weights beats sgemm's packing
# BLAS takes rows from the extension only where it is clearly faster: the extension gives each row of a
# chunk the same bits whatever rows share the chunk, so a prompt continued from a kept cache computes as a
# cold one; sgemm's do not, and a timing within noise of a tie would make that a coin flip per machine.
BLAS_MARGIN = 1.1
_measured: dict[str, int] = {}


def fp32_rows(extension_file: str, module, blas_library: str | None, most: int, measure: bool) -> int | None:
    """Most rows of x the dense products should take against an fp32 weight
    here, of the ``most`` they take: all of them without an optimized BLAS
    (the reference one is far slower); None until measured (only where
    ``measure``)."""
    if blas_library is None:
        return most
    key = hashlib.sha256(f"{extension_file}\0{blas_library}\0{BLAS_MARGIN}".encode()).hexdigest()[:16]
    if key in _measured:
        return _measured[key]
    path = native.cache_dir() / f"dense-rows-{key}.json"
    try:
        rows = int(json.loads(path.read_text())["rows"])
    except (OSError, ValueError, KeyError, TypeError):
        if not measure:
            return None
        rows, times = _measure(module, most)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")  # another process may be measuring too
        tmp.write_text(json.dumps({"rows": rows, "ms": times, "extension": extension_file, "blas": blas_library}))
        tmp.replace(path)
    _measured[key] = rows = min(max(rows, FEWEST_ROWS), most)
    return rows


def _measure(module, most: int) -> tuple[int, dict]:
    """(rows, the times): ``most`` where BLAS is not ``BLAS_MARGIN`` times as
    fast as ours at that many rows, else half where it is not there, else
    ``FEWEST_ROWS``. Each time is the
    best of three passes over eight [1536, 576] weights (28 MB), submitted
    with the host helping as a chunk is."""
    import mlx.core as mx

    weights = [mx.random.normal((1536, 576), key=mx.random.key(i)).T for i in range(8)]
    mx.eval(weights)

    def best(product, x) -> float:
        times = []
        for _ in range(4):  # the first warms
            start = time.perf_counter()
            outs = [product(x, w) for w in weights]
            module.submit_helping(outs)
            module.wait_helping(outs[-1])
            mx.eval(outs)
            times.append(time.perf_counter() - start)
        return 1000 * min(times[1:])

    times = {}
    for rows in (most, most // 2):
        x = mx.random.normal((1, rows, 576), key=mx.random.key(rows))
        mx.eval(x)
        ours, blas = best(module.gemv, x), best(mx.matmul, x)
        times[str(rows)] = {"ours": round(ours, 3), "blas": round(blas, 3)}
        if ours <= blas * BLAS_MARGIN:
            return rows, times
    return FEWEST_ROWS, times
