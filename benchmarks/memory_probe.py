"""One memory measurement in a fresh process, for ``bench_memory.py``.

Runs one engine on one model (prompt prefill, then greedy decode) and prints
one JSON object to stdout: a snapshot of process and MLX memory after each
stage. Run by ``bench_memory.py`` in its own subprocess per measurement, so
no two runs' peaks mix; it can also be run by hand:

    python benchmarks/memory_probe.py ours --pte model.pte --prompt-len 512 --new-tokens 128
    python benchmarks/memory_probe.py mlx-lm --model-dir hf --dtype bf16 --prefill-chunk 128

Stages: ``start`` (engine modules imported, nothing loaded), ``load`` (ours:
``load_program`` + ``new_cache`` + ``load_method("forward")``; mlx-lm:
``load_model`` + ``set_dtype`` + evaluated parameters + an empty prompt cache),
``prefill`` (the first new token is on the host and the device is idle: the
prompt is in the cache, and so is the first decode step the loop queued before
yielding), ``decode`` (every new token drained and the device idle). Ours adds
``closed``: the same process after ``program.close()`` unmaps the .pte, to show
how much of the RSS was the mapped file.

Each snapshot's MLX peak and RSS high-water mark cover that stage only: both
are reset after each snapshot (``mx.reset_peak_memory()``, and writing 5 to
``/proc/self/clear_refs``, which resets VmHWM to the current RSS).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys
import time

from harness.models import random_prompt

STATUS_KEYS = ("VmRSS", "VmHWM", "RssAnon", "RssFile", "RssShmem")


def proc_status() -> dict:
    """Process memory from /proc/self/status, in bytes."""
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in STATUS_KEYS:
                out[key] = int(value.split()[0]) * 1024
    return out


def mapped_rss(path: str | None) -> int | None:
    """Resident bytes of every mapping of ``path`` (from /proc/self/smaps)."""
    if path is None:
        return None
    path = os.path.realpath(path)
    total, inside = 0, False
    with open("/proc/self/smaps") as f:
        for line in f:
            first = line.split(None, 1)[0]
            if "-" in first and not first.endswith(":"):  # a mapping's header line
                fields = line.split(None, 5)
                inside = len(fields) == 6 and fields[5].strip() == path
            elif inside and first == "Rss:":
                total += int(line.split()[1]) * 1024
    return total


def reset_hwm() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


class Recorder:
    """Snapshots after each stage; resets the stage peaks after each."""

    def __init__(self, mapped_path: str | None = None):
        import mlx.core as mx

        self.mx = mx
        self.mapped_path = mapped_path
        self.stages = []
        self.t = time.perf_counter()
        self.hwm_reset = reset_hwm()
        mx.reset_peak_memory()

    def snap(self, stage: str, **extra) -> dict:
        mx = self.mx
        mx.synchronize()
        now = time.perf_counter()
        snap = {
            "stage": stage,
            "seconds": now - self.t,
            **proc_status(),
            "pte_mapped_rss": mapped_rss(self.mapped_path),
            "mlx_active": mx.get_active_memory(),
            "mlx_peak": mx.get_peak_memory(),  # since the previous snapshot
            "mlx_cache": mx.get_cache_memory(),
            **extra,
        }
        self.stages.append(snap)
        mx.reset_peak_memory()
        reset_hwm()
        self.t = time.perf_counter()
        return snap


def run_ours(args) -> dict:
    from llm_executorch_mlx.runtime import load_program
    from llm_executorch_mlx.runtime.cpu import blas
    from llm_executorch_mlx.text.generate import Timings, generate_tokens
    from llm_executorch_mlx.text.sampling import Sampler

    rec = Recorder(mapped_path=str(args.pte))
    rec.snap("start")

    program = load_program(args.pte, compute=args.compute)
    program.prepare_cpu_kernels()  # as the plugin does before a generation
    meta = program.metadata
    # As the plugin's Turn builds it: capacity = max context, the model's
    # activation dtype, the default initial capacity (flat pools grow by
    # doubling).
    kv_dtype = args.kv_dtype or meta.activation_dtype or "bf16"
    cache = program.new_cache(capacity=meta.max_context, dtype=kv_dtype)
    forward = program.load_method("forward", cache=cache)

    def kv(c) -> dict:
        return {"kv_tokens": c.length, "kv_bytes_in_use": c.bytes_in_use(), "kv_bytes_allocated": c.nbytes}

    rec.snap("load", **kv(cache))
    sampler = Sampler(temperature=0.0)
    prompt = random_prompt(args.seed, meta.vocab_size, args.prompt_len)
    steps = generate_tokens(
        forward, cache, prompt, 0, meta.prefill_chunk,
        lambda logits, history: sampler.sample(logits), args.new_tokens, Timings(),
    )
    tokens = [next(steps).token]
    rec.snap("prefill", **kv(cache))
    tokens += [s.token for s in steps]
    rec.snap("decode", **kv(cache))

    closed = {"close_error": None}
    try:
        program.close()
    except Exception as e:  # a view still exported from the map would stop it
        closed["close_error"] = f"{type(e).__name__}: {e}"
    rec.snap("closed", **kv(cache), **closed)

    return {
        "engine": "ours",
        "blas": blas.global_sgemm_library(),
        "dtype": meta.activation_dtype,
        "kv_dtype": cache.dtype,
        "compute_dtype": program.compute_dtype,
        "weight_bytes": program.weight_bytes(),
        "weight_bytes_stored": program.weight_bytes(as_stored=True),
        "kv_bytes_per_token": cache.bytes_per_token(),
        "prefill_chunk": meta.prefill_chunk,
        "max_context": meta.max_context,
        "vocab_size": meta.vocab_size,
        "n_layers": meta.n_caches,
        "kv_heads": list(meta.kv_heads),
        "head_dims": list(meta.head_dims),
        "tokens": tokens,
        "hwm_reset": rec.hwm_reset,
        "stages": rec.stages,
    }


def run_mlx_lm(args) -> dict:
    from harness import machine
    from harness.engines import load_mlx_lm
    from harness.models import model_shape

    # bound before mlx.core loads, so both engines use the same BLAS
    blas = machine.bind_blas_and_import_mlx()["global_sgemm_library"]
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm.generate import generate_step, generation_stream
    from mlx_lm.models.cache import make_prompt_cache

    rec = Recorder()
    rec.snap("start")

    model_dir = pathlib.Path(args.model_dir)
    model = load_mlx_lm(model_dir, args.dtype)
    cache = make_prompt_cache(model)

    def kv(caches) -> dict:
        tokens = caches[0].offset if caches else 0
        in_use = sum(
            tokens * 2 * c.keys.shape[1] * c.keys.shape[3] * c.keys.dtype.size
            for c in caches if c.keys is not None
        )
        return {"kv_tokens": tokens, "kv_bytes_in_use": in_use,
                "kv_bytes_allocated": sum(c.nbytes for c in caches)}

    rec.snap("load", **kv(cache))
    weight_bytes = sum(v.nbytes for _, v in tree_flatten(model.parameters()))
    prompt = random_prompt(args.seed, model_shape(model_dir)["vocab"], args.prompt_len)
    steps = generate_step(
        mx.array(prompt), model, max_tokens=args.new_tokens,
        prefill_step_size=args.prefill_chunk, prompt_cache=cache,
    )
    tokens = [next(steps)[0]]
    mx.synchronize(generation_stream)
    rec.snap("prefill", **kv(cache))
    tokens += [t for t, _ in steps]
    mx.synchronize(generation_stream)
    rec.snap("decode", **kv(cache))
    return {
        "engine": "mlx-lm",
        "blas": blas,
        "dtype": args.dtype,
        "compute_dtype": args.dtype,
        "kv_dtype": args.dtype,
        "weight_bytes": weight_bytes,
        "weight_bytes_stored": weight_bytes,
        "tokens": [int(t) for t in tokens],
        "hwm_reset": rec.hwm_reset,
        "stages": rec.stages,
    }


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description="One memory measurement (see bench_memory.py).")
    p.add_argument("engine", choices=["ours", "mlx-lm"])
    p.add_argument("--pte", help="the .pte to run (ours)")
    p.add_argument("--model-dir", help="Hugging Face model dir (mlx-lm)")
    p.add_argument("--dtype", default="fp32", help="dtype to cast to (mlx-lm)")
    p.add_argument("--prefill-chunk", type=int, default=128, help="prefill step size (mlx-lm)")
    p.add_argument("--compute", default="auto", help="compute route for load_program (ours; default: auto)")
    p.add_argument("--kv-dtype", help="KV storage dtype (ours; default: the model's activation dtype, as the plugin)")
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if args.engine == "ours" and not args.pte:
        p.error("ours needs --pte")
    if args.engine == "mlx-lm" and not args.model_dir:
        p.error("mlx-lm needs --model-dir")
    result = run_ours(args) if args.engine == "ours" else run_mlx_lm(args)
    result["modules"] = {
        name: name in sys.modules for name in ("torch", "executorch", "transformers")
    }
    json.dump(result, sys.stdout)
    sys.stdout.write("\n")


if __name__ == "__main__":
    main()
