"""Start-up cost of the llm plugin, and what a prompt imports.

Times fresh ``llm`` processes, interleaved repetition by repetition:

- ``llm --version`` and ``llm models`` with only this plugin loaded and with
  no plugin at all (``LLM_LOAD_PLUGINS=llm-executorch-mlx`` vs
  ``LLM_LOAD_PLUGINS=``, so the difference is this plugin alone whatever else
  is installed), plus ``llm --version`` as installed (``LLM_LOAD_PLUGINS``
  unset: every installed plugin, found through entry points);
- ``llm -m pte:<small> -o max_tokens 1 hi`` on a tiny model registered in a
  throw-away ``LLM_USER_PATH``;
- ``python -c pass``, the interpreter's own floor.

Each figure is the median [min–max] of wall and CPU (user + system) time over
the repetitions; deltas (with − without) are taken within each repetition.
``llm`` itself takes ~2 s to start here and varies by hundreds of ms from run
to run, so a difference of a few ms cannot be resolved that way: the plugin's
own cost is also timed in-process (importing it and running the hooks llm
calls, in an ``llm`` process that loaded no plugin).

Then, untimed, with ``-X importtime``: what ``import llm_executorch_mlx``
costs and pulls in, what the plugin adds to an ``llm`` process (a
``sys.modules`` diff), which heavy modules (torch, executorch, transformers,
mlx, numpy, jinja2, tokenizers, ...) each command imports, with cumulative
import times and the chain that imported them, and which native BLAS the
runtime binds into MLX on the prompt path. It asserts nothing.

Children write and reuse bytecode in a private ``PYTHONPYCACHEPREFIX`` even
where ``PYTHONDONTWRITEBYTECODE`` is set (``--bytecode as-is`` keeps the
environment's setting): without cached bytecode, every prompt recompiles the
runtime's generated flatbuffer readers (~840 KB of source).

The measuring process imports nothing heavy: the model is built by
``startup_fixture.py`` and machine info gathered in child processes.

    python benchmarks/bench_startup.py --reps 3
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import json
import os
import pathlib
import platform
import re
import resource
import shutil
import subprocess
import sys
import tempfile
import time

from harness import cli
from harness.report import fmt, log, row, spread, table, write_json

HERE = pathlib.Path(__file__).resolve().parent
PLUGIN_DIST = "llm-executorch-mlx"
PLUGIN_MODULE = "llm_executorch_mlx"
MODEL_NAME = "startup-tiny"
UNSET = None  # LLM_LOAD_PLUGINS left unset: llm loads every installed plugin
# Modules whose presence on a path is worth a line, heaviest first.
WATCHED = (
    "torch", "executorch", "transformers", "mlx_lm", "safetensors", "huggingface_hub",
    "mlx", "mlx.core", "numpy", "jinja2", "tokenizers", "pytorch_tokenizers", "sentencepiece",
    "tiktoken", "flatbuffers", "llm_executorch_mlx", "llm_executorch_mlx.runtime",
    "llm_executorch_mlx.text", "llm_executorch_mlx.plugin", "llm_executorch_mlx.commands",
    "llm", "llm.cli", "openai", "pydantic", "click", "sqlite_utils", "pluggy", "yaml",
)
HEAVY = ("torch", "executorch", "transformers", "mlx_lm", "mlx", "numpy", "jinja2", "tokenizers",
         "safetensors", "huggingface_hub", "pytorch_tokenizers", "sentencepiece", "tiktoken")
IMPORTTIME_LINE = re.compile(r"^import time:\s*(\d+)\s*\|\s*(\d+)\s*\| ( *)(\S+)\s*$")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description="Start-up time the llm-executorch-mlx plugin adds to llm, and what a "
                    "prompt imports (fresh subprocesses, interleaved).",
    )
    cli.add_reps(p, 15, "timed repetitions of each command")
    p.add_argument("--importtime-reps", type=int, default=3,
                   help="-X importtime runs per command, medians taken (default: 3)")
    p.add_argument("--top", type=int, default=12, help="rows in the import top lists (default: 12)")
    p.add_argument("--llm", type=pathlib.Path,
                   help="the llm executable (default: the one beside this Python, else on PATH)")
    p.add_argument("--pte", type=pathlib.Path, help="prompt this .pte instead of building the tiny model")
    p.add_argument("--tokenizer", type=pathlib.Path, help="its tokenizer (with --pte)")
    cli.add_workdir(p, "the tiny model's files")
    p.add_argument("--bytecode", choices=("cached", "as-is"), default="cached",
                   help="cached (default): children write and reuse bytecode in a private "
                        "PYTHONPYCACHEPREFIX (warmed up before timing), as an installed package has "
                        "it, even where PYTHONDONTWRITEBYTECODE is set; as-is: the environment's setting")
    cli.add_json(p)
    args = p.parse_args(argv)
    if (args.pte is None) != (args.tokenizer is None):
        p.error("--pte and --tokenizer go together")
    if args.reps < 1 or args.importtime_reps < 1:
        p.error("need --reps >= 1 and --importtime-reps >= 1")
    if args.llm is None:
        beside = pathlib.Path(sys.executable).parent / "llm"
        found = beside if beside.exists() else shutil.which("llm")
        if found is None:
            p.error("no llm executable found: pass --llm")
        args.llm = pathlib.Path(found)
    return args


def llm_python(llm: pathlib.Path) -> str:
    """The interpreter llm's script runs under (its shebang), else ours."""
    try:
        first = llm.read_bytes().split(b"\n", 1)[0].decode()
    except (OSError, UnicodeDecodeError):
        return sys.executable
    if first.startswith("#!"):
        exe = first[2:].strip().split()[0]
        if os.access(exe, os.X_OK):
            return exe
    return sys.executable


# -- running ------------------------------------------------------------------


class Runner:
    """Runs commands with a private LLM_USER_PATH and a chosen plugin set."""

    def __init__(self, user_path: str, bytecode: str):
        base = dict(os.environ)
        for key in ("LLM_LOAD_PLUGINS", "PYTHONPROFILEIMPORTTIME"):
            base.pop(key, None)
        base["LLM_USER_PATH"] = user_path
        if bytecode == "cached":
            # Without cached bytecode every run recompiles the modules it
            # imports from source (the generated flatbuffer readers alone are
            # ~840 KB); an installed package has its .pyc files.
            base.pop("PYTHONDONTWRITEBYTECODE", None)
            base["PYTHONPYCACHEPREFIX"] = os.path.join(user_path, "pycache")
        self.base = base

    def env(self, plugins: str | None, **extra) -> dict:
        env = dict(self.base, **extra)
        if plugins is not UNSET:
            env["LLM_LOAD_PLUGINS"] = plugins
        return env

    def run(self, cmd: list[str], plugins: str | None, check: bool = True, **extra):
        done = subprocess.run(cmd, env=self.env(plugins, **extra), capture_output=True, text=True,
                              stdin=subprocess.DEVNULL)
        if check and done.returncode != 0:
            sys.stderr.write(done.stdout + done.stderr)
            sys.exit(f"failed ({done.returncode}): {' '.join(map(str, cmd))}")
        return done

    def timed(self, cmd: list[str], plugins: str | None) -> dict:
        """Wall and CPU (user + system) seconds of one fresh process."""
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        t0 = time.perf_counter()
        done = self.run(cmd, plugins)
        wall = time.perf_counter() - t0
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
        return {"wall": wall, "cpu": cpu, "stdout": done.stdout[-500:]}


def prepare_model(args, runner: Runner, python: str) -> dict:
    """Build (or reuse) the tiny model in a child process and register it."""
    if args.pte is not None:
        model = {"pte": str(args.pte.resolve()), "tokenizer": str(args.tokenizer.resolve())}
    else:
        log("building / reusing the tiny model (child process)")
        done = subprocess.run(
            [python, str(HERE / "startup_fixture.py"), "--workdir", str(args.workdir)],
            stdout=subprocess.PIPE, text=True,
        )
        if done.returncode != 0:
            sys.exit("startup_fixture.py failed")
        model = json.loads(done.stdout.strip().splitlines()[-1])
    runner.run([str(args.llm), "pte", "register", model["pte"], "--tokenizer", model["tokenizer"],
                "--name", MODEL_NAME], PLUGIN_DIST)
    return model


def variants(args, python: str) -> list[dict]:
    """The timed commands: key, label, which plugins load, argv, LLM_LOAD_PLUGINS."""
    llm = str(args.llm)
    prompt = [llm, "-m", f"pte:{MODEL_NAME}", "-o", "max_tokens", "1", "hi"]
    rows = [
        ("python", "python -c pass", "n/a", [python, "-c", "pass"], UNSET),
        ("version-none", "llm --version", "none", [llm, "--version"], ""),
        ("version-ours", "llm --version", "ours only", [llm, "--version"], PLUGIN_DIST),
        ("version-installed", "llm --version", "as installed", [llm, "--version"], UNSET),
        ("models-none", "llm models", "none", [llm, "models"], ""),
        ("models-ours", "llm models", "ours only", [llm, "models"], PLUGIN_DIST),
        ("prompt-ours", " ".join(["llm"] + prompt[1:]), "ours only", prompt, PLUGIN_DIST),
    ]
    return [dict(zip(("key", "label", "plugins", "cmd", "env"), row)) for row in rows]


DELTAS = (
    ("version-ours", "version-none", "llm --version: ours − none (goal ≤ 30 ms)", 0.030),
    ("version-installed", "version-none", "llm --version: as installed − none", None),
    ("models-ours", "models-none", "llm models: ours − none", None),
    ("prompt-ours", "version-ours", "prompt − llm --version (ours): load, 1 token, log", None),
    ("version-none", "python", "llm --version (none) − python -c pass: llm itself", None),
)


def check_plugins(runner: Runner, llm: str) -> dict:
    """Which plugins each setting loads (``llm plugins``), so 'ours only' and
    'none' are known to mean what they say."""
    seen = {}
    for name, setting in (("none", ""), ("ours only", PLUGIN_DIST), ("as installed", UNSET)):
        out = runner.run([llm, "plugins"], setting).stdout
        seen[name] = [p["name"] for p in json.loads(out)]
    if seen["none"] or seen["ours only"] != [PLUGIN_DIST]:
        sys.exit(f"unexpected plugin sets: {seen}")
    return seen


def time_commands(args, runner: Runner, python: str) -> tuple[list[dict], list[dict]]:
    vs = variants(args, python)
    log("warmup: each command once (bytecode caches, llm's log database)")
    for v in vs:
        runner.timed(v["cmd"], v["env"])
    reps = []
    for rep in range(args.reps):
        # rotate the order so no command always follows the same one
        shift = rep % len(vs)
        row = {}
        for v in vs[shift:] + vs[:shift]:
            row[v["key"]] = runner.timed(v["cmd"], v["env"])
        reps.append(row)
        log(f"rep {rep + 1}/{args.reps}: " + ", ".join(f"{k} {r['wall'] * 1e3:.0f} ms" for k, r in row.items()))
    return vs, reps


# -- imports ------------------------------------------------------------------


def parse_importtime(stderr: str) -> list[dict]:
    """``-X importtime`` lines as dicts in print order (children before parents)."""
    out = []
    for line in stderr.splitlines():
        m = IMPORTTIME_LINE.match(line)
        if m:
            out.append({"self_us": int(m[1]), "cum_us": int(m[2]), "depth": len(m[3]) // 2, "name": m[4]})
    return out


def chain(entries: list[dict], i: int) -> list[str]:
    """The modules whose import led to entry ``i``, outermost first."""
    names, depth = [], entries[i]["depth"]
    for e in entries[i + 1:]:
        if e["depth"] < depth:
            names.append(e["name"])
            depth = e["depth"]
            if depth == 0:
                break
    return names[::-1]


def subtree(entries: list[dict], i: int) -> list[dict]:
    """Entry ``i`` and everything imported while it was being imported."""
    depth, out = entries[i]["depth"], [entries[i]]
    for e in reversed(entries[:i]):
        if e["depth"] <= depth:
            break
        out.append(e)
    return out


def importtime_runs(runner: Runner, cmd: list[str], plugins, reps: int) -> list[list[dict]]:
    runs = []
    for _ in range(reps):
        done = runner.run(cmd, plugins, PYTHONPROFILEIMPORTTIME="1")
        runs.append(parse_importtime(done.stderr))
    return runs


def module_table(runs: list[list[dict]]) -> dict:
    """Per watched module: imported?, median cumulative ms, and its chain."""
    out = {}
    for name in WATCHED:
        cums, via, seen = [], None, False
        for entries in runs:
            for i, e in enumerate(entries):
                if e["name"] == name:
                    cums.append(e["cum_us"] / 1e3)
                    via = via or chain(entries, i)
                    break
            # A module imported with importlib.import_module (as llm loads
            # plugins) has no line of its own; its submodules do.
            seen = seen or any(e["name"].startswith(name + ".") for e in entries)
        out[name] = {"imported": bool(cums) or seen, "cum_ms": spread(cums) if cums else None,
                     "via": via or []}
    return out


def top_level(runs: list[list[dict]], n: int) -> list[dict]:
    """The depth-0 imports (including lazy ones made at run time) by median
    cumulative time."""
    times: dict[str, list[float]] = {}
    for entries in runs:
        for e in entries:
            if e["depth"] == 0:
                times.setdefault(e["name"], []).append(e["cum_us"] / 1e3)
    rows = [{"name": k, "cum_ms": spread(v)} for k, v in times.items()]
    return sorted(rows, key=lambda r: -r["cum_ms"]["median"])[:n]


def plugin_import(runner: Runner, python: str, reps: int, n: int) -> dict:
    """``python -X importtime -c 'import llm_executorch_mlx'``: its total and
    its slowest modules by self time."""
    cmd = [python, "-X", "importtime", "-c", f"import {PLUGIN_MODULE}"]
    totals, selfs = [], {}
    for _ in range(reps):
        entries = parse_importtime(runner.run(cmd, UNSET).stderr)
        i = max(j for j, e in enumerate(entries) if e["name"] == PLUGIN_MODULE)
        tree = subtree(entries, i)
        totals.append(entries[i]["cum_us"] / 1e3)
        for e in tree:
            selfs.setdefault(e["name"], []).append(e["self_us"] / 1e3)
    rows = sorted(({"name": k, "self_ms": spread(v)} for k, v in selfs.items()),
                  key=lambda r: -r["self_ms"]["median"])
    return {"total_ms": spread(totals), "modules": len(selfs), "top_self": rows[:n]}


def install_hooks(runner: Runner, python: str, reps: int) -> dict:
    """Modules of this install that ``site`` imports into every process
    (an editable install's finder), with their cumulative ms: a cost the
    with/without deltas cannot see, since it is paid either way."""
    times: dict[str, list[float]] = {}
    for _ in range(reps):
        for e in parse_importtime(runner.run([python, "-X", "importtime", "-c", "pass"], UNSET).stderr):
            if PLUGIN_MODULE in e["name"] and not e["name"].startswith(PLUGIN_MODULE + "."):
                times.setdefault(e["name"], []).append(e["cum_us"] / 1e3)
    return {k: spread(v) for k, v in times.items()}


SYS_MODULES_IN_LLM = r"""
import json, sys, time
import llm.cli  # LLM_LOAD_PLUGINS is empty: llm loads no plugin
base = set(sys.modules)
t0 = time.perf_counter()
import llm_executorch_mlx as plugin
t1 = time.perf_counter()
after_import = set(sys.modules)
plugin.register_commands(llm.cli.cli)
t2 = time.perf_counter()
after_commands = set(sys.modules)
models = []
plugin.register_models(lambda model, async_model=None, aliases=(): models.append(model.model_id))
t3 = time.perf_counter()
after_models = set(sys.modules)
print(json.dumps({
    "import_ms": (t1 - t0) * 1e3, "register_commands_ms": (t2 - t1) * 1e3,
    "register_models_ms": (t3 - t2) * 1e3, "models": models,
    "new_on_import": sorted(after_import - base),
    "new_on_register_commands": sorted(after_commands - after_import),
    "new_on_register_models": sorted(after_models - after_commands),
}))
"""

SYS_MODULES_BARE = r"""
import json, sys
base = set(sys.modules)
import llm_executorch_mlx
print(json.dumps(sorted(set(sys.modules) - base)))
"""


RUNTIME_NATIVE = r"""
import json, time
t0, c0 = time.perf_counter(), time.process_time()
import llm_executorch_mlx.runtime as runtime
t1, c1 = time.perf_counter(), time.process_time()
import mlx.core as mx
a = mx.ones((256, 256))
mx.eval(a @ a)
t2, c2 = time.perf_counter(), time.process_time()
try:
    from llm_executorch_mlx.runtime.cpu import blas
    bound = blas.global_sgemm_library()
except ImportError:
    bound = None
rss, path = {}, None
with open("/proc/self/smaps") as f:
    for line in f:
        first = line.split(None, 1)[0]
        if "-" in first and not first.endswith(":"):
            fields = line.split(None, 5)
            path = fields[5].strip() if len(fields) == 6 else None
        elif first == "Rss:" and path and ".so" in path:
            name = path.rsplit("/", 1)[-1]
            if any(k in name.lower() for k in ("mkl", "blas", "mlx", "iomp", "gomp")):
                rss[name] = rss.get(name, 0) + int(line.split()[1]) * 1024
print(json.dumps({"import_runtime_ms": (t1 - t0) * 1e3, "first_matmul_ms": (t2 - t1) * 1e3,
                  "import_runtime_cpu_ms": (c1 - c0) * 1e3, "first_matmul_cpu_ms": (c2 - c1) * 1e3,
                  "blas": bound, "native_rss": rss}))
"""


def runtime_native(runner: Runner, python: str, reps: int) -> dict:
    """What importing the runtime costs beyond Python modules: the BLAS it
    binds into MLX (a shared library, invisible to -X importtime), and the
    first matmul, which makes the BLAS load its kernels."""
    runs = [json.loads(runner.run([python, "-c", RUNTIME_NATIVE], UNSET).stdout) for _ in range(reps)]
    return {
        "import_runtime_ms": spread([r["import_runtime_ms"] for r in runs]),
        "first_matmul_ms": spread([r["first_matmul_ms"] for r in runs]),
        "import_runtime_cpu_ms": spread([r["import_runtime_cpu_ms"] for r in runs]),
        "first_matmul_cpu_ms": spread([r["first_matmul_cpu_ms"] for r in runs]),
        "blas": runs[0]["blas"],
        "native_rss": runs[0]["native_rss"],
        "runs": runs,
    }


def packages(modules: list[str]) -> list[str]:
    return sorted({m.split(".")[0] for m in modules})


def sys_modules_diff(runner: Runner, python: str, reps: int) -> dict:
    """What the plugin adds: to a bare interpreter, and to an llm process
    that has loaded no plugin (the hooks llm calls, timed in-process)."""
    bare = json.loads(runner.run([python, "-c", SYS_MODULES_BARE], UNSET).stdout)
    in_llm = [json.loads(runner.run([python, "-c", SYS_MODULES_IN_LLM], "").stdout) for _ in range(reps)]
    first = in_llm[0]
    added = first["new_on_import"] + first["new_on_register_commands"] + first["new_on_register_models"]
    return {
        "bare": {"count": len(bare), "packages": packages(bare), "modules": bare,
                 "heavy": [h for h in HEAVY if h in bare]},
        "in_llm": {
            "count": len(added),
            "packages": packages(added),
            "heavy": [h for h in HEAVY if h in added],
            "import_ms": spread([r["import_ms"] for r in in_llm]),
            "register_commands_ms": spread([r["register_commands_ms"] for r in in_llm]),
            "register_models_ms": spread([r["register_models_ms"] for r in in_llm]),
            "version_path_ms": spread([r["import_ms"] + r["register_commands_ms"] for r in in_llm]),
            "models_path_ms": spread([r["import_ms"] + r["register_commands_ms"] + r["register_models_ms"]
                                      for r in in_llm]),
            "models": first["models"],
            "runs": in_llm,
        },
    }


# -- reporting ----------------------------------------------------------------


def ms(values: list[float]) -> dict:
    return spread([v * 1e3 for v in values])


def summarize(vs: list[dict], reps: list[dict]) -> dict:
    out = {"commands": {}, "deltas": {}}
    for v in vs:
        out["commands"][v["key"]] = {
            "wall_ms": ms([r[v["key"]]["wall"] for r in reps]),
            "cpu_ms": ms([r[v["key"]]["cpu"] for r in reps]),
        }
    for a, b, label, goal in DELTAS:
        out["deltas"][f"{a} - {b}"] = {
            "label": label,
            "goal_s": goal,
            "n": len(reps),
            "wall_ms": ms([r[a]["wall"] - r[b]["wall"] for r in reps]),
            "cpu_ms": ms([r[a]["cpu"] - r[b]["cpu"] for r in reps]),
        }
    return out


def native_libs(native: dict) -> str:
    rows = sorted(native["native_rss"].items(), key=lambda kv: -kv[1])
    return ", ".join(f"{name} {rss / 1e6:.1f} MB" for name, rss in rows) or "none"


def verdict(d: dict) -> str:
    """Whether a delta meets its goal, or that the spread is too wide to tell."""
    if d["goal_s"] is None:
        return ""
    goal = d["goal_s"] * 1e3
    w = d["wall_ms"]
    if d["n"] < 5:
        return " — too few repetitions to judge (see the in-process rows)"
    if w["max"] - w["min"] > 4 * goal and not (w["max"] <= goal or w["min"] > goal):
        return f" — unresolved: the spread is {w['max'] - w['min']:.0f} ms (see the in-process rows)"
    return " — met" if w["median"] <= goal else " — not met"


def markdown(args, vs, summary, plugins_seen, imports, paths, prompt_top, diff, native) -> str:
    bytecode = ("bytecode cached (private PYTHONPYCACHEPREFIX, warmed up)" if args.bytecode == "cached"
                else "bytecode as the environment has it")
    lines = [
        f"{args.reps} interleaved repetitions of each command, each a fresh process after one warmup; "
        f"{bytecode}; ms, median [min–max]; CPU = user + system",
        "",
        *table(["command", "plugins loaded", "wall ms", "CPU ms"], [
            [f"`{v['label']}`", v["plugins"], fmt(summary["commands"][v["key"]]["wall_ms"], "{:.0f}"),
             fmt(summary["commands"][v["key"]]["cpu_ms"], "{:.0f}")] for v in vs
        ]),
        "",
    ]
    l = diff["in_llm"]
    deltas = [[f"{d['label']}{verdict(d)}", fmt(d["wall_ms"], "{:+.0f}"), fmt(d["cpu_ms"], "{:+.0f}")]
              for d in summary["deltas"].values()]
    deltas += [
        ["in-process: import + `register_commands` (what `llm --version` runs of ours)",
         fmt(l["version_path_ms"], "{:+.1f}"), ""],
        ["in-process: import + both hooks (what `llm models` runs of ours)", fmt(l["models_path_ms"], "{:+.1f}"), ""],
    ]
    lines += table(["difference (within each repetition)", "wall ms", "CPU ms"], deltas)
    lines += [
        "",
        f"Plugins loaded (`llm plugins`): none = {plugins_seen['none']}, ours only = "
        f"{plugins_seen['ours only']}, as installed = {plugins_seen['as installed']}",
        "",
        f"Modules each command imports (PYTHONPROFILEIMPORTTIME=1, {args.importtime_reps} runs; cumulative "
        "import ms, median [min–max]; – = not imported; importtime itself slows imports):",
        "",
        *table(["module", "`llm --version` (ours)", "`llm models` (ours)", "prompt (ours)", "imported via (prompt)"]),
    ]
    for name in WATCHED:
        cells = [
            fmt(paths[k][name]["cum_ms"], "{:.1f}") if paths[k][name]["cum_ms"]
            else ("yes (untimed)" if paths[k][name]["imported"] else "–")
            for k in ("version-ours", "models-ours", "prompt-ours")
        ]
        if not any(paths[k][name]["imported"] for k in paths):
            continue
        via = " → ".join(paths["prompt-ours"][name]["via"]) or ("(top level)" if paths["prompt-ours"][name]["imported"] else "")
        lines.append(row([name, *cells, via]))
    absent = [n for n in WATCHED if not any(paths[k][n]["imported"] for k in paths)]
    on_prompt = [h for h in HEAVY if paths["prompt-ours"].get(h, {}).get("imported")]
    lines += [
        "",
        f"Not imported by any of them: {', '.join(absent) or 'none'}.",
        f"Heavy modules on the prompt path: {', '.join(on_prompt) or 'none'}; "
        f"torch: {'yes' if paths['prompt-ours']['torch']['imported'] else 'no'}, "
        f"executorch: {'yes' if paths['prompt-ours']['executorch']['imported'] else 'no'}.",
        "",
        f"Native libraries on the prompt path (invisible to -X importtime): `import "
        f"llm_executorch_mlx.runtime` in a bare interpreter (numpy and mlx included) takes "
        f"{fmt(native['import_runtime_ms'], '{:.0f}')} ms wall, {fmt(native['import_runtime_cpu_ms'], '{:.0f}')} ms CPU, and "
        f"binds BLAS `{native['blas']}` into MLX; the first 256×256 matmul then takes "
        f"{fmt(native['first_matmul_ms'], '{:.0f}')} ms wall, {fmt(native['first_matmul_cpu_ms'], '{:.0f}')} ms CPU. "
        f"Resident afterwards: {native_libs(native)}.",
        "",
        "Slowest top-level imports on the prompt path (lazy imports made while running included):",
        "",
        *table(["module", "cumulative ms"], [[r["name"], fmt(r["cum_ms"], "{:.1f}")] for r in prompt_top]),
        "",
        f"`python -X importtime -c 'import {PLUGIN_MODULE}'`: {fmt(imports['total_ms'], '{:.1f}')} ms, "
        f"{imports['modules']} modules; slowest by self time:",
        "",
        *table(["module", "self ms"], [[r["name"], fmt(r["self_ms"], "{:.2f}")] for r in imports["top_self"]]),
    ]
    b, l = diff["bare"], diff["in_llm"]
    if imports["site_hooks"]:
        hooks = ", ".join(f"`{k}` {fmt(v, '{:.1f}')} ms" for k, v in imports["site_hooks"].items())
        lines += [
            "",
            f"Imported by `site` into every Python process of this environment (`python -X importtime "
            f"-c pass`): {hooks}. This is the install's own hook (an editable install's finder), paid "
            "with or without LLM_LOAD_PLUGINS, so the deltas above leave it out; a regular install has none.",
        ]
    lines += [
        "",
        f"`sys.modules` diff: `import {PLUGIN_MODULE}` in a bare interpreter adds {b['count']} modules "
        f"(packages: {', '.join(b['packages'])}; heavy: {', '.join(b['heavy']) or 'none'}). In an llm "
        f"process that loaded no plugin, importing it and running its hooks adds {l['count']} modules "
        f"(packages: {', '.join(l['packages'])}; heavy: {', '.join(l['heavy']) or 'none'}) in "
        f"{fmt(l['import_ms'], '{:.1f}')} ms (import) + {fmt(l['register_commands_ms'], '{:.1f}')} ms "
        f"(register_commands) + {fmt(l['register_models_ms'], '{:.1f}')} ms (register_models, "
        f"{len(l['models'])} model registered).",
    ]
    return "\n".join(lines)


def machine_info(python: str) -> dict:
    """``harness.machine``'s machine info, gathered in a child: it imports mlx."""
    code = ("import json, sys; sys.path.insert(0, %r); from harness import machine; "
            "print(json.dumps(machine.machine_info(machine.bind_blas_and_import_mlx()), default=str))") % str(HERE)
    done = subprocess.run([python, "-c", code], capture_output=True, text=True)
    try:
        info = json.loads(done.stdout)
    except ValueError:
        info = {
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "platform": platform.platform(),
            "python": platform.python_version(),
            "cpu_count": os.cpu_count(),
            "note": "harness.machine.machine_info() failed: " + done.stderr[-300:],
        }
    for dist in ("llm", "pluggy", "click", "pydantic"):
        try:
            info.setdefault("versions", {})[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            pass
    return info


def main(argv=None) -> None:
    args = parse_args(argv)
    python = llm_python(args.llm)
    loadavg_start = os.getloadavg()
    user_path = tempfile.mkdtemp(prefix="bench-startup-")
    try:
        runner = Runner(user_path, args.bytecode)
        plugins_seen = check_plugins(runner, str(args.llm))
        model = prepare_model(args, runner, python)
        vs, reps = time_commands(args, runner, python)
        summary = summarize(vs, reps)
        log("import analysis (-X importtime, sys.modules)")
        by_key = {v["key"]: v for v in vs}
        paths = {
            k: module_table(importtime_runs(runner, by_key[k]["cmd"], by_key[k]["env"], args.importtime_reps))
            for k in ("version-ours", "models-ours")
        }
        prompt_runs = importtime_runs(runner, by_key["prompt-ours"]["cmd"], PLUGIN_DIST, args.importtime_reps)
        paths["prompt-ours"] = module_table(prompt_runs)
        prompt_top = top_level(prompt_runs, args.top)
        imports = plugin_import(runner, python, args.importtime_reps, args.top)
        imports["site_hooks"] = install_hooks(runner, python, args.importtime_reps)
        diff = sys_modules_diff(runner, python, args.importtime_reps)
        native = runtime_native(runner, python, args.importtime_reps)
    finally:
        shutil.rmtree(user_path, ignore_errors=True)
    machine = machine_info(python)
    machine["loadavg_start"] = loadavg_start
    machine["loadavg_end"] = os.getloadavg()
    print(markdown(args, vs, summary, plugins_seen, imports, paths, prompt_top, diff, native))
    if args.json:
        report = {
            "args": vars(args),
            "python": python,
            "model": model,
            "machine": machine,
            "plugins_seen": plugins_seen,
            "variants": vs,
            "reps": reps,
            "summary": summary,
            "import_paths": paths,
            "prompt_top_level": prompt_top,
            "prompt_importtime_runs": prompt_runs,
            "plugin_import": imports,
            "sys_modules": diff,
            "runtime_native": native,
        }
        write_json(args.json, report)


if __name__ == "__main__":
    main()
