"""Prefill and decode speed of our runtime against mlx-lm and ExecuTorch's
XNNPACK path, on the same weights.

Builds (or reuses) a seeded random-weight Llama as a Hugging Face directory,
exports it with ``export_hf_model`` once per dtype (and, for the XNNPACK peer,
with ExecuTorch's ``export_llama``), then times, in one process and
interleaved (ours, [ours-native,] mlx-lm, xnnpack, ours, ...):

- ours: ``generate_tokens``, the decode loop the ``llm`` plugin runs, with the
  plugin's greedy ``Sampler``, the default compute route (a bf16/fp16 file
  computes in fp32 on a CPU) and a fresh off-graph cache per repetition;
- ours-native (bf16/fp16 files only): the same with ``compute="native"``,
  i.e. in the file's dtype;
- mlx-lm: ``mlx_lm.generate.generate_step`` on the same weights cast with
  ``model.set_dtype``, a fresh prompt cache per repetition, the same prefill
  chunk;
- xnnpack: ExecuTorch's own CPU path, an XNNPACK ``.pte`` with a static
  in-graph KV cache run through ``executorch.runtime`` (see
  ``xnnpack_peer.py``), the same prefill chunk, argmax on the host.

The runtime binds an optimized BLAS (OpenBLAS or MKL) into MLX when it is
imported before ``mlx.core``; this script imports it first, so ours and mlx-lm
use the same BLAS. ``--blas reference`` keeps MLX's slow reference BLAS.

All engines are timed by the same code: prefill is prompt tokens / time to the
first token, decode is (new tokens - 1) / time from the first token to the
last. A decode ceiling per engine comes from MLX's measured copy bandwidth and
the bytes one decode step of that engine reads (its weights as held + its KV
cache at the mean context, in its cache's dtype).

    python benchmarks/bench_decode.py --shape tiny --reps 2
"""

from __future__ import annotations

import argparse
import concurrent.futures
import datetime
import gc
import hashlib
import importlib.metadata
import json
import multiprocessing
import os
import pathlib
import platform
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from typing import Iterator

import numpy as np

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))  # xnnpack_peer, also in the spawned export children

import xnnpack_peer  # noqa: E402 (imports neither torch nor executorch until used)

# mlx.core, imported by ``bind_blas_and_import_mlx`` once the runtime has
# chosen MLX's BLAS: the first import of mlx.core binds it for the process.
mx = None

BLAS_ENV = "LLM_PTE_BLAS"  # runtime/blas.py's ENV_VAR, named here so it is set before the runtime loads

# Llama shapes (transformers ``LlamaConfig`` fields) for the random models.
SHAPES = {
    "smollm-135m": dict(
        vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
        num_attention_heads=9, num_key_value_heads=3,
    ),
    "tiny": dict(
        vocab_size=2048, hidden_size=64, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2,
    ),
}
DTYPES = ("fp32", "bf16", "fp16")
DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
ENGINES = ("ours", "ours-native", "mlx-lm", "xnnpack")
# Seconds between two engines' runs, so thread pools that spin after their work
# (OpenMP's 200 ms block time under MKL, XNNPACK's pthreadpool) have gone quiet
# before the next engine's clock starts.
SETTLE_S = 0.3


def add_model_arguments(p: argparse.ArgumentParser, max_ctx_len: int = 1024) -> None:
    """The options every model-based benchmark shares: which random model to
    build (or reuse) and how to export it."""
    p.add_argument("--shape", choices=sorted(SHAPES), default="smollm-135m",
                   help="random model shape to build (default: smollm-135m)")
    p.add_argument("--seed", type=int, default=0, help="weight and input seed (default: 0)")
    p.add_argument("--model-dir", type=pathlib.Path,
                   help="reuse this Hugging Face model dir instead of building one")
    p.add_argument("--workdir", type=pathlib.Path, default=HERE / ".work",
                   help="where built models and exports are cached (default: benchmarks/.work)")
    p.add_argument("--max-ctx-len", type=int, default=max_ctx_len,
                   help=f"export max context (default: {max_ctx_len})")
    p.add_argument("--prefill-chunk", type=int, default=128, help="export prefill chunk (default: 128)")


def parse_args(argv=None) -> argparse.Namespace:
    """The command line, checked; ``dtypes`` and ``engines`` become lists."""
    p = argparse.ArgumentParser(
        description="Prefill/decode tokens/s of llm-executorch-mlx vs mlx-lm and ExecuTorch's "
                    "XNNPACK path on one random Llama.",
    )
    add_model_arguments(p)
    p.add_argument("--pte", type=pathlib.Path, action="append", default=[],
                   help="reuse this .pte exported from --model-dir (repeatable; its dtype "
                        "is read from the file); requested dtypes without one are exported")
    p.add_argument("--dtypes", default="fp32,bf16",
                   help="comma-separated dtypes among fp32,bf16,fp16 (default: fp32,bf16)")
    p.add_argument("--engines", default=",".join(ENGINES),
                   help="comma-separated engines among ours,ours-native,mlx-lm,xnnpack "
                        f"(default: all; ours is always run; ours-native only for bf16/fp16; "
                        f"xnnpack only for {'/'.join(xnnpack_peer.XNNPACK_DTYPES)})")
    p.add_argument("--blas", default="auto",
                   help="BLAS for MLX's CPU matmuls: auto (the runtime's choice: "
                        f"{BLAS_ENV}, else OpenBLAS behind its one-row route, else MKL, else OpenBLAS/BLIS), "
                        "reference (MLX's own, slow), "
                        f"or a library path; sets {BLAS_ENV} for the run (default: auto)")
    p.add_argument("--prompt-len", type=int, default=512, help="random prompt ids (default: 512)")
    p.add_argument("--new-tokens", type=int, default=128, help="greedy tokens to generate (default: 128)")
    p.add_argument("--reps", type=int, default=3, help="timed repetitions per engine (default: 3)")
    p.add_argument("--json", type=pathlib.Path, help="also write every raw number here")
    args = p.parse_args(argv)
    args.dtypes = [d.strip() for d in args.dtypes.split(",") if d.strip()]
    unknown = [d for d in args.dtypes if d not in DTYPES]
    if unknown or not args.dtypes:
        p.error(f"--dtypes: unknown {unknown}; choose among {', '.join(DTYPES)}")
    args.engines = [e.strip() for e in args.engines.split(",") if e.strip()]
    unknown = [e for e in args.engines if e not in ENGINES]
    if unknown:
        p.error(f"--engines: unknown {unknown}; choose among {', '.join(ENGINES)}")
    args.engines = [e for e in ENGINES if e in args.engines or e == "ours"]
    if args.pte and args.model_dir is None:
        p.error("--pte needs --model-dir: the other engines run the Hugging Face weights the .pte came from")
    if args.new_tokens < 2 or args.prompt_len < 1 or args.reps < 1:
        p.error("need --new-tokens >= 2, --prompt-len >= 1 and --reps >= 1")
    return args


# -- BLAS and machine ---------------------------------------------------------


def bind_blas_and_import_mlx(choice: str) -> dict:
    """Let the runtime bind MLX's BLAS, then import ``mlx.core``.

    Importing ``llm_executorch_mlx.runtime`` runs ``blas.load_fast_blas()``
    before anything of MLX loads; every MLX user in this process (mlx-lm too)
    then calls the same ``cblas_sgemm``. Returns what was bound and why.
    """
    global mx
    mlx_first = "mlx.core" in sys.modules  # only if something imported it before main()
    if choice != "auto":
        os.environ[BLAS_ENV] = choice
    from llm_executorch_mlx.runtime.cpu import blas

    assert blas.ENV_VAR == BLAS_ENV, blas.ENV_VAR
    status = blas.load_fast_blas()
    import mlx.core

    mx = mlx.core
    return {
        "choice": choice,
        "env": os.environ.get(BLAS_ENV),
        "library": status.library,
        "reason": status.reason,
        "advice": status.advice,
        "global_sgemm_library": blas.global_sgemm_library(),
        "mlx_imported_first": mlx_first,
        "ld_preload": os.environ.get("LD_PRELOAD"),
    }


def blas_note(info: dict) -> str | None:
    """A line for stderr when MLX is left on its reference BLAS, else None."""
    if info["global_sgemm_library"]:
        return None
    line = f"note: no optimized BLAS is bound for MLX ({info['reason']}); ours and mlx-lm run on MLX's slow reference BLAS"
    if info["advice"]:
        line += f". {info['advice']}"
    return line


def cpu_model() -> str | None:
    """The CPU's model name from /proc/cpuinfo, when there is one."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


def machine_info(blas: dict) -> dict:
    """What the numbers depend on: machine, versions, BLAS, load."""
    versions = {}
    for dist in ("mlx", "mlx-lm", "executorch", "torch", "transformers", "mkl", "llm-executorch-mlx"):
        try:
            versions[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            versions[dist] = None
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "cpu_model": cpu_model(),
        "cpu_count": os.cpu_count(),
        "cpus_available": len(os.sched_getaffinity(0)),
        "mlx_device": str(mx.default_device()),
        "versions": versions,
        "blas": blas,
        "ld_preload": os.environ.get("LD_PRELOAD"),
        "loadavg_start": os.getloadavg(),
    }


def measure_bandwidth(mib: int = 256, trials: int = 10) -> dict:
    """Best copy bandwidth MLX reaches, in bytes read + written per second.

    Each trial computes ``x = x + 1`` over ``mib`` MiB of fp32, split into one
    array per available CPU, each on its own MLX stream so the cores work in
    parallel. The input is dropped before evaluation so MLX writes into its
    buffer in place: a fresh output buffer would time page faults, not memory.
    On a GPU one stream and 8x the bytes, so one kernel, not launches, is timed.
    """
    on_gpu = mx.default_device().type == mx.DeviceType.gpu
    mib = mib * 8 if on_gpu else mib
    n_streams = 1 if on_gpu else max(1, len(os.sched_getaffinity(0)))
    streams = [mx.new_stream(mx.default_device()) for _ in range(n_streams)]
    xs = [mx.zeros((mib * 2**20 // 4 // n_streams,), mx.float32) for _ in streams]
    mx.eval(xs)
    moved = 2 * sum(x.nbytes for x in xs)
    samples = []
    for _ in range(trials):
        t0 = time.perf_counter()
        ys = []
        for stream in streams:
            with mx.stream(stream):
                ys.append(xs.pop(0) + 1)
        mx.eval(ys)
        samples.append(moved / (time.perf_counter() - t0))
        xs = ys
    return {"bytes_per_s": max(samples), "samples": samples, "mib": mib, "streams": n_streams}


# -- artifacts ----------------------------------------------------------------


def build_random_model(shape: str, seed: int, out: pathlib.Path) -> None:
    """Save a seeded random-weight Llama of ``shape`` as a Hugging Face dir."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        **SHAPES[shape], max_position_embeddings=2048, tie_word_embeddings=True,
        rope_theta=10000.0,
    )
    tmp = out.with_name(out.name + ".tmp")
    LlamaForCausalLM(config).save_pretrained(tmp)
    os.replace(tmp, out)


def export_pte(model_dir: pathlib.Path, out: pathlib.Path, dtype: str, max_ctx_len: int, chunk: int,
               quantize: str | None = None, group_size: int | None = None) -> None:
    """Export ``model_dir`` to ``out`` with our ``export_hf_model``; ``quantize``
    ("4w", "8w") quantizes the linears and the embedding."""
    from llm_executorch_mlx.export import export_hf_model

    tmp = out.with_name(out.stem + ".tmp.pte")
    export_hf_model(model_dir, tmp, dtype=dtype, qlinear=quantize, qembedding=quantize, group_size=group_size,
                    max_ctx_len=max_ctx_len, prefill_chunk=chunk)
    os.replace(tmp, out)


def in_child(fn, *args) -> None:
    """Run ``fn(*args)`` in a fresh process, so building and exporting (torch
    thread pools, executorch, gigabytes of scratch memory) leave nothing behind
    in the process being timed."""
    ctx = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(1, mp_context=ctx) as pool:
        pool.submit(_to_stderr, fn, *args).result()


def _to_stderr(fn, *args) -> None:
    """Call ``fn(*args)`` with stdout sent to stderr: stdout is the report's."""
    sys.stdout.flush()
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())
    fn(*args)


def pte_info(path: pathlib.Path) -> tuple[str, int, int]:
    """The activation dtype a .pte publishes (or its graph shows), its max
    context and prefill chunk."""
    from llm_executorch_mlx.runtime import load_program

    meta = load_program(path, compute="native").metadata
    return meta.activation_dtype, meta.max_context, meta.prefill_chunk


@dataclass
class Artifacts:
    model_dir: pathlib.Path
    ptes: dict  # dtype -> our .pte
    xnnpack: dict  # dtype -> XNNPACK .pte, for the dtypes that have one
    xnnpack_skipped: dict  # dtype -> why it has none


def prepare_artifacts(args) -> Artifacts:
    """The HF model dir, one .pte per requested dtype and, when the xnnpack
    engine is asked for, one XNNPACK .pte per dtype it handles; built when
    missing.

    Exports of a ``--model-dir`` are cached under a name taken from its path,
    so they are never mistaken for the random model's. An XNNPACK export has
    the context and chunk of the .pte it is compared with.
    """
    model_dir = args.model_dir
    if model_dir is not None:
        resolved = model_dir.resolve()
        digest = hashlib.sha1(str(resolved).encode()).hexdigest()[:8]
        base = args.workdir / f"{resolved.name}-{digest}"
    else:
        base = args.workdir / f"{args.shape}-seed{args.seed}"
        model_dir = base / "hf"
        if not (model_dir / "config.json").exists():
            base.mkdir(parents=True, exist_ok=True)
            log(f"building random {args.shape} model in {model_dir}")
            in_child(build_random_model, args.shape, args.seed, model_dir)
    ptes = {}
    for path in args.pte:
        dtype = pte_info(path)[0]
        if dtype not in args.dtypes:
            sys.exit(f"--pte {path} is {dtype}, which --dtypes ({','.join(args.dtypes)}) does not ask for")
        ptes[dtype] = path
    for dtype in args.dtypes:
        if dtype in ptes:
            continue
        ptes[dtype] = base / f"{dtype}-ctx{args.max_ctx_len}-chunk{args.prefill_chunk}.pte"
        if not ptes[dtype].exists():
            base.mkdir(parents=True, exist_ok=True)
            log(f"exporting {dtype} to {ptes[dtype]}")
            in_child(export_pte, model_dir, ptes[dtype], dtype, args.max_ctx_len, args.prefill_chunk)
    xnnpack, skipped = {}, {}
    if "xnnpack" in args.engines:
        for dtype in args.dtypes:
            if dtype not in xnnpack_peer.XNNPACK_DTYPES:
                skipped[dtype] = f"the XNNPACK peer is exported in {'/'.join(xnnpack_peer.XNNPACK_DTYPES)} only"
                continue
            _, ctx, chunk = pte_info(ptes[dtype])
            path = base / f"xnnpack-{dtype}-ctx{ctx}-chunk{chunk}.pte"
            if not path.exists():
                base.mkdir(parents=True, exist_ok=True)
                log(f"exporting the XNNPACK peer ({dtype}) to {path} with executorch's export_llama")
                try:
                    in_child(xnnpack_peer.export_xnnpack, model_dir, path, dtype, ctx, chunk)
                except Exception as exc:  # reported in the tables, the other engines still run
                    skipped[dtype] = f"export failed: {type(exc).__name__}: {exc}"
                    log(f"XNNPACK {dtype}: {skipped[dtype]}")
                    continue
            xnnpack[dtype] = path
    return Artifacts(model_dir, ptes, xnnpack, skipped)


def llama_shape(model_dir: pathlib.Path) -> dict:
    """The fields of a Hugging Face Llama config.json the byte counts need."""
    config = json.loads((model_dir / "config.json").read_text())
    heads = config["num_attention_heads"]
    return {
        "layers": config["num_hidden_layers"],
        "kv_heads": config.get("num_key_value_heads", heads),
        "head_dim": config.get("head_dim") or config["hidden_size"] // heads,
    }


# -- engines and timing -------------------------------------------------------


@dataclass
class Run:
    """One generation: its throughputs and the tokens it produced."""

    prefill_tps: float
    decode_tps: float
    tokens: list[int]


def timed(token_stream: Iterator[int], prompt_len: int, stream=None) -> Run:
    """Drain a token generator, timing its first and last token.

    Waits for ``stream`` (an MLX stream the generator computes on, if any)
    afterwards, so work it queued past its last token cannot spill into the
    next measurement.
    """
    tokens = []
    t0 = time.perf_counter()
    for token in token_stream:
        now = time.perf_counter()
        if not tokens:
            t_first = now
        tokens.append(token)
    if stream is not None:
        mx.synchronize(stream)
    return Run(prompt_len / (t_first - t0), (len(tokens) - 1) / (now - t_first), tokens)


class Ours:
    """Our runtime through ``generate_tokens``, as the plugin drives it, on
    one compute route (``load_program(compute=...)``)."""

    def __init__(self, pte: pathlib.Path, compute: str = "auto", name: str = "ours", int8_activations: bool = True):
        from llm_executorch_mlx.runtime import load_program
        from llm_executorch_mlx.text.sampling import Sampler

        self.name = name
        self.route = compute
        self.program = load_program(pte, compute=compute, int8_activations=int8_activations)
        self.program.prepare_cpu_kernels()  # as the plugin does before a generation
        self.compute_dtype = self.program.compute_dtype
        self.sampler = Sampler(temperature=0.0)
        self.last_timings = None
        cache = self.new_cache(self.program.metadata.max_context)
        self.kv_dtype = cache.dtype
        self.weight_bytes = self.program.weight_bytes()  # as held after the compute route
        self.kv_bytes_per_token = cache.bytes_per_token()

    @property
    def compute(self) -> str:
        stored = self.program.metadata.activation_dtype
        if self.compute_dtype != stored:
            return f"{self.compute_dtype} ({self.route}: widened from {stored})"
        return f"{stored} ({'native' if self.route == 'native' else 'as stored'})"

    def new_cache(self, capacity: int):
        """A cache like the plugin's default: the dtype activations compute in."""
        return self.program.new_cache(capacity=capacity)

    def info(self) -> dict:
        kernels = self.program.cpu_kernels
        return {
            "cpu_attention_kernel": "in use" if kernels.attention.on else kernels.attention.why,
            "cpu_gemv": "in use" if kernels.gemv.on else kernels.gemv.why,
            "compute_route": self.route,
            "compute_dtype": self.compute_dtype,
            "stored_dtype": self.program.metadata.activation_dtype,
            "weight_bytes_as_stored": self.program.weight_bytes(as_stored=True),
        }

    def run(self, prompt: list[int], new_tokens: int) -> Run:
        from llm_executorch_mlx.text.generate import Timings, generate_tokens

        cache = self.new_cache(self.program.metadata.max_context)
        forward = self.program.load_method("forward", cache=cache)
        self.last_timings = Timings()
        steps = generate_tokens(
            forward, cache, prompt, 0, self.program.metadata.prefill_chunk,
            lambda logits, history: self.sampler.sample(logits), new_tokens, self.last_timings,
        )
        stream = mx.default_stream(mx.default_device())
        run = timed((step.token for step in steps), len(prompt), stream)
        run.plugin_timings = asdict(self.last_timings)
        return run


class MlxLm:
    """mlx-lm's ``generate_step`` on the Hugging Face weights, cast to ``dtype``
    (an mlx-lm quantized checkpoint, as ``gpu_model.py`` writes, keeps its
    packed weights; its scales and biases are cast)."""

    name = "mlx-lm"

    def __init__(self, model_dir: pathlib.Path, dtype: str, prefill_chunk: int):
        from mlx.utils import tree_flatten
        from mlx_lm.utils import load_model

        self.model, _ = load_model(model_dir)
        self.model.set_dtype({"fp32": mx.float32, "bf16": mx.bfloat16, "fp16": mx.float16}[dtype])
        mx.eval(self.model.parameters())
        self.prefill_chunk = prefill_chunk
        quant = json.loads((model_dir / "config.json").read_text()).get("quantization")  # a quantized checkpoint
        self.compute = dtype if quant is None else f"{dtype}, {quant['bits']}-bit weights (group {quant['group_size']})"
        self.kv_dtype = dtype  # its KVCache stores keys/values as the model computes them
        self.weight_bytes = sum(v.nbytes for _, v in tree_flatten(self.model.parameters()))
        shape = llama_shape(model_dir)
        self.kv_bytes_per_token = 2 * shape["layers"] * shape["kv_heads"] * shape["head_dim"] * DTYPE_BYTES[dtype]

    def info(self) -> dict:
        return {}

    def run(self, prompt: list[int], new_tokens: int) -> Run:
        from mlx_lm.generate import generate_step, generation_stream

        steps = generate_step(
            mx.array(prompt), self.model, max_tokens=new_tokens, prefill_step_size=self.prefill_chunk,
        )
        return timed((token for token, _ in steps), len(prompt), generation_stream)


class Xnnpack:
    """ExecuTorch's XNNPACK ``.pte`` (static in-graph cache) through
    ``executorch.runtime``; see ``xnnpack_peer.py``."""

    name = "xnnpack"

    def __init__(self, pte: pathlib.Path, model_dir: pathlib.Path, dtype: str, prefill_chunk: int):
        self.peer = xnnpack_peer.XnnpackPeer(pte, prefill_chunk)
        self.compute = dtype
        self.kv_dtype = dtype
        # A step reads every linear weight and the (untied) output projection,
        # but only one row of the input embedding table.
        self.weight_bytes = xnnpack_peer.step_weight_bytes(model_dir, DTYPE_BYTES[dtype])
        shape = llama_shape(model_dir)
        self.kv_bytes_per_token = 2 * shape["layers"] * shape["kv_heads"] * shape["head_dim"] * DTYPE_BYTES[dtype]

    def info(self) -> dict:
        return {
            "pte": str(self.peer.pte),
            "pte_bytes": self.peer.pte.stat().st_size,
            "delegates": self.peer.backends,
            "threads": self.peer.threads,
        }

    def run(self, prompt: list[int], new_tokens: int) -> Run:
        return timed(self.peer.generate(prompt, new_tokens), len(prompt))


def common_prefix(a: list[int], b: list[int]) -> int:
    """How many leading ids two token lists share."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def make_engines(dtype: str, art: Artifacts, args, meta) -> list:
    """The engines for one dtype, in the order they take turns."""
    engines = [Ours(art.ptes[dtype], "auto")]
    if "ours-native" in args.engines and dtype != "fp32":
        engines.append(Ours(art.ptes[dtype], "native", name="ours-native"))
    if "mlx-lm" in args.engines:
        engines.append(MlxLm(art.model_dir, dtype, meta.prefill_chunk))
    if dtype in art.xnnpack:
        engines.append(Xnnpack(art.xnnpack[dtype], art.model_dir, dtype, meta.prefill_chunk))
    return engines


def bench_dtype(dtype: str, art: Artifacts, args, bandwidth: float) -> dict:
    """Warm up, then time every engine interleaved; return raw numbers."""
    pte = art.ptes[dtype]
    from llm_executorch_mlx.runtime import load_program

    meta = load_program(pte, compute="native").metadata
    needed = args.prompt_len + args.new_tokens
    if (meta.max_context or 0) < needed:
        sys.exit(f"{pte} holds {meta.max_context} tokens; the run needs {needed}")
    if meta.activation_dtype != dtype:
        sys.exit(f"{pte} is {meta.activation_dtype}, expected {dtype}")
    engines = make_engines(dtype, art, args, meta)
    names = [e.name for e in engines]
    prompt = np.random.default_rng(args.seed).integers(0, meta.vocab_size, args.prompt_len).tolist()

    def one(engine) -> Run:
        settle()
        return engine.run(prompt, args.new_tokens)

    for engine in engines:  # warmup, excluded
        run = one(engine)
        log(f"{dtype} warmup {engine.name}: prefill {run.prefill_tps:.1f} tok/s, decode {run.decode_tps:.2f} tok/s")
    reps = []
    for rep in range(args.reps):
        runs = {}
        for engine in engines:
            runs[engine.name] = one(engine)
            log(f"{dtype} rep {rep + 1}/{args.reps} {engine.name}: prefill "
                f"{runs[engine.name].prefill_tps:.1f} tok/s, decode {runs[engine.name].decode_tps:.2f} tok/s")
        reps.append(rep_entry(runs))

    mean_context = args.prompt_len + args.new_tokens / 2
    engine_info = {}
    for engine in engines:
        kv_bytes = engine.kv_bytes_per_token * mean_context
        engine_info[engine.name] = {
            "compute": engine.compute,
            "kv_dtype": engine.kv_dtype,
            "weight_bytes": engine.weight_bytes,
            "kv_bytes_per_token": engine.kv_bytes_per_token,
            "kv_bytes_at_mean_context": kv_bytes,
            "ceiling_decode_tps": bandwidth / (engine.weight_bytes + kv_bytes),
            **engine.info(),
        }
    return {
        "dtype": dtype,
        "pte": pte,
        "xnnpack_pte": art.xnnpack.get(dtype),
        "xnnpack_skipped": art.xnnpack_skipped.get(dtype),
        "prefill_chunk": meta.prefill_chunk,
        "mean_context": mean_context,
        "engines": engine_info,
        "reps": reps,
        "summary": summarize_dtype(reps, names, engine_info),
    }


def settle() -> None:
    """Free what the last run left and let its thread pools go quiet, so the
    next engine's clock starts on an idle machine."""
    mx.clear_cache()
    gc.collect()
    time.sleep(SETTLE_S)


def rep_entry(runs: dict) -> dict:
    """One repetition's raw numbers: every engine's run, and how many leading
    tokens each shares with ours."""
    entry = {name: asdict(run) | extra(run) for name, run in runs.items()}
    entry["same_tokens"] = {
        name: common_prefix(runs["ours"].tokens, run.tokens) for name, run in runs.items() if name != "ours"
    }
    return entry


def extra(run: Run) -> dict:
    """Per-engine extras a ``Run`` carries (ours: the plugin's own Timings)."""
    timings = getattr(run, "plugin_timings", None)
    return {"plugin_timings": timings} if timings is not None else {}


# -- reporting ----------------------------------------------------------------


def spread(values: list[float]) -> dict:
    """Median, min and max of a list of numbers."""
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def summarize_runs(reps: list[dict], names: list[str]) -> dict:
    """Each engine's prefill and decode figures, each per-repetition ratio
    (ours / every other engine) and the tokens shared with ours, as
    median [min-max]."""
    def series(engine, key):
        return [r[engine][key] for r in reps]

    out = {}
    for key in ("prefill_tps", "decode_tps"):
        out[key] = {name: spread(series(name, key)) for name in names}
        out[key]["ratio"] = {
            name: spread([a / b for a, b in zip(series("ours", key), series(name, key))])
            for name in names if name != "ours"
        }
    out["same_tokens"] = {
        name: spread([r["same_tokens"][name] for r in reps]) for name in names if name != "ours"
    }
    return out


def summarize_dtype(reps: list[dict], names: list[str], engines: dict) -> dict:
    """``summarize_runs`` plus each engine's decode as a fraction of its ceiling."""
    out = summarize_runs(reps, names)
    out["ceiling_fraction"] = {
        name: spread([r[name]["decode_tps"] / engines[name]["ceiling_decode_tps"] for r in reps])
        for name in names
    }
    return out


def fmt(s: dict, pattern: str = "{:.1f}") -> str:
    """``median [min–max]`` with one number format."""
    return f"{pattern.format(s['median'])} [{pattern.format(s['min'])}–{pattern.format(s['max'])}]"


def markdown(results: list[dict], bandwidth: dict, args, machine: dict) -> str:
    """The report: throughput per engine, ratios, ceilings, token agreement."""
    blas = machine["blas"]["global_sgemm_library"] or "MLX's reference BLAS"
    lines = [
        f"prompt {args.prompt_len} random ids, {args.new_tokens} greedy tokens, "
        f"{args.reps} interleaved reps after 1 warmup each; median [min–max]; "
        f"MLX BLAS: {blas}",
        "",
        "| dtype | engine | computes in | prefill tok/s | decode tok/s | decode % of its ceiling |",
        "|---|---|---|---|---|---|",
    ]
    for r in results:
        s = r["summary"]
        for name, info in r["engines"].items():
            lines.append(
                f"| {r['dtype']} | {name} | {info['compute']} | {fmt(s['prefill_tps'][name])} | "
                f"{fmt(s['decode_tps'][name], '{:.2f}')} | "
                f"{fmt({k: 100 * v for k, v in s['ceiling_fraction'][name].items()}, '{:.0f}%')} |"
            )
        for name, ratio in s["prefill_tps"]["ratio"].items():
            lines.append(
                f"| {r['dtype']} | ours/{name} | | {fmt(ratio, '{:.2f}')} | "
                f"{fmt(s['decode_tps']['ratio'][name], '{:.2f}')} | |"
            )
        if r["xnnpack_skipped"] and "xnnpack" in args.engines:
            lines.append(f"| {r['dtype']} | xnnpack | not run: {r['xnnpack_skipped']} | | | |")
    lines += [
        "",
        f"Copy bandwidth (MLX, {bandwidth['streams']} streams, best of {len(bandwidth['samples'])}): "
        f"{bandwidth['bytes_per_s'] / 1e9:.1f} GB/s",
        "",
        "| dtype | engine | weights read MB | KV MB at mean context | decode ceiling tok/s | tokens equal to ours |",
        "|---|---|---|---|---|---|",
    ]
    for r in results:
        for name, info in r["engines"].items():
            same = (
                f"{fmt(r['summary']['same_tokens'][name], '{:.0f}')} of {args.new_tokens}"
                if name != "ours" else ""
            )
            lines.append(
                f"| {r['dtype']} | {name} | {info['weight_bytes'] / 1e6:.1f} | "
                f"{info['kv_bytes_at_mean_context'] / 1e6:.1f} ({info['kv_dtype']}, ctx {r['mean_context']:g}) | "
                f"{info['ceiling_decode_tps']:.1f} | {same} |"
            )
    return "\n".join(lines)


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def main(argv=None) -> None:
    args = parse_args(argv)
    blas = bind_blas_and_import_mlx(args.blas)  # before anything else imports mlx.core
    note = blas_note(blas)
    log(note or f"MLX BLAS: {blas['global_sgemm_library']} ({blas['reason']})")
    art = prepare_artifacts(args)
    machine = machine_info(blas)
    bandwidth = measure_bandwidth()
    log(f"copy bandwidth: {bandwidth['bytes_per_s'] / 1e9:.1f} GB/s")
    results = []
    for dtype in args.dtypes:
        results.append(bench_dtype(dtype, art, args, bandwidth["bytes_per_s"]))
        gc.collect()  # the engines of one dtype go before the next dtype's load
    machine["loadavg_end"] = os.getloadavg()
    print(markdown(results, bandwidth, args, machine))
    if args.json:
        report = {
            "args": vars(args),
            "model_dir": art.model_dir,
            "machine": machine,
            "bandwidth": bandwidth,
            "results": results,
        }
        args.json.write_text(json.dumps(report, indent=2, default=str) + "\n")
        log(f"wrote {args.json}")


if __name__ == "__main__":
    main()
