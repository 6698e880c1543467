"""An n-turn conversation where every turn is a separate `llm -c` process:
time to first token per turn with the saved cache states on and off.

Each turn runs ``llm -c MESSAGE`` (the first ``llm -m MODEL``) in a new
process, in a throwaway ``LLM_USER_PATH`` where MODEL (a registered-ready
.pte with its tokenizer beside it) is registered. With states on
(``kv_disk_mb`` default) a turn loads the previous process's state and
prefills its own tokens; off (``-o kv_disk_mb 0``), as llm-mlx does, it
re-prefills the whole history. Per turn it reports, from ``llm logs``:
prompt tokens, tokens loaded or cached, tokens prefilled, the time to
first token (from the prefill's start), the load time before it, the save
time after the reply, and the process's wall time.

    python benchmarks/bench_continue.py MODEL.pte [--turns 8] [--max-tokens 48]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

from harness import cli
from harness.conversation import MESSAGES, register_pte
from harness.report import table


def llm(args: list[str], env: dict) -> float:
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-m", "llm", *args], env=env, check=True, capture_output=True, text=True)
    return time.perf_counter() - t0


def conversation(model: str, turns: int, max_tokens: int, disk: bool, env: dict) -> list[dict]:
    extra = ["-o", "max_tokens", str(max_tokens)] + ([] if disk else ["-o", "kv_disk_mb", "0"])
    rows = []
    for i in range(turns):
        wall = llm((["-m", model] if i == 0 else ["-c"]) + [MESSAGES[i % len(MESSAGES)], *extra], env)
        logged = json.loads(subprocess.run([sys.executable, "-m", "llm", "logs", "-n", "1", "--json"], env=env,
                                           check=True, capture_output=True, text=True).stdout)[0]
        j = logged["response_json"]
        rows.append({"turn": i + 1, "path": j["cache_path"], "prompt": j["prompt_tokens"],
                     "cached": j["cached_tokens"], "prefilled": j["prefilled_tokens"],
                     "ttft_s": j["time_to_first_token_s"], "load_s": j.get("disk_load_s") or 0.0,
                     "save_s": j.get("disk_save_s") or 0.0, "wall_s": round(wall, 2)})
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    cli.add_pte_and_tokenizer(ap)
    ap.add_argument("--turns", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=48)
    args = ap.parse_args()
    results = {}
    for disk in (False, True):
        with tempfile.TemporaryDirectory() as user_dir:
            env = dict(os.environ, LLM_USER_PATH=user_dir)
            model = register_pte(args.pte, cli.tokenizer_of(args), "bench", env)
            results[disk] = conversation(model, args.turns, args.max_tokens, disk, env)
    rows = []
    for off, on in zip(results[False], results[True]):
        ratio = (on["load_s"] + on["ttft_s"]) / off["ttft_s"] if off["ttft_s"] else float("nan")
        rows.append([on["turn"], on["prompt"], f"{off['prefilled']} · {off['ttft_s']:.3f}",
                     f"{on['path']} · {on['cached']} · {on['prefilled']} · {on['load_s']:.3f} · {on['ttft_s']:.3f} · "
                     f"{on['save_s']:.3f}", f"{ratio:.2f}"])
    print("\n".join(table(["turn", "prompt", "off: prefilled · TTFT s",
                           "on: path · loaded · prefilled · load s · TTFT s · save s", "on (load + TTFT) ÷ off TTFT"],
                          rows)))
    print(json.dumps(results, indent=1), file=sys.stderr)


if __name__ == "__main__":
    main()
