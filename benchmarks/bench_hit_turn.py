"""A chat held in one process: each hit turn's time to first token against the
bare prefill of its new tokens, and what saving and loading its state cost.

MODEL (a .pte with its tokenizer beside it) is registered in a throwaway
``LLM_USER_PATH`` and asked an n-turn conversation through llm's Python API
(``model.prompt`` with the history), greedy, ``--max-tokens`` per reply. Each
turn runs ``--reps`` times from the same start (the session rewound to what
it held before the turn, the saved states removed, so each is a ``hit``);
per turn, the fastest:

- TTFT: from ``model.prompt`` to the first text on the host, all of
  it (llm's own work, rendering the history and splicing the generated ids
  back in, tokenizing, the prefill, the first token, detokenizing it);
- prefill: the plugin's own ``time_to_first_token_s`` (its prefill's start
  to the first token), so TTFT - prefill is what comes before the prefill;
- bare: a second cache of the same program, holding the same ids the
  turn's cache held (prefilled untimed), fed the turn's new ids by
  ``generate_tokens`` to the first token, min of ``--reps``;
- save: ``disk_save_s`` of that run, the state written after the reply; load: reading
  that state back into a new cache (``StateStore.load``), min of ``--reps``.

    python benchmarks/bench_hit_turn.py MODEL.pte [--turns 8] [--max-tokens 48] [--windows 128,0]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time

from harness import cli
from harness.conversation import MESSAGES, register_pte
from harness.report import table


def bare_prefill(program, policy, prompt: list[int], held: int, reps: int) -> float:
    """Seconds to the first token of feeding ``prompt[held:]`` to a cache holding ``prompt[:held]``."""
    import mlx.core as mx

    from llm_executorch_mlx.text.generate import Timings, generate_tokens, prefill
    from llm_executorch_mlx.text.session import Session

    best = float("inf")
    session = Session(program, policy)
    chunk = session.cache.max_write or program.metadata.prefill_chunk
    for _ in range(reps):
        session.cache.clear()
        if held:
            prefill(session.forward, session.cache, prompt[:held], 0, chunk)
            mx.eval(session.cache.state)
        timings = Timings()
        next(generate_tokens(session.forward, session.cache, prompt, held, chunk,
                             lambda logits, _: mx.argmax(logits), 1, timings))
        best = min(best, timings.first_token_seconds)
    return best


def load_time(store, state, program, policy, reps: int) -> float:
    from llm_executorch_mlx.text.session import Session

    session, best = Session(program, policy), float("inf")
    for _ in range(reps):
        session.cache.clear()
        t0 = time.perf_counter()
        assert store.load(state, len(state.ids) - 1, session.cache)
        best = min(best, time.perf_counter() - t0)
    return best


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    cli.add_pte_and_tokenizer(ap)
    ap.add_argument("--turns", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--windows", help="the kv_windows option (ring layers), e.g. 128,0")
    ap.add_argument("--reps", type=int, default=3, help="runs of each turn, bare prefills and loads, the min kept")
    args = ap.parse_args()
    user_dir = tempfile.mkdtemp(prefix="bench-hit-")
    os.environ["LLM_USER_PATH"] = user_dir
    model_id = register_pte(args.pte, cli.tokenizer_of(args), "bench")

    import llm

    from llm_executorch_mlx.plugin import saved_states_dir
    from llm_executorch_mlx.text import store
    from llm_executorch_mlx.text.saved_states import StateStore

    options = {"max_tokens": args.max_tokens, **({"kv_windows": args.windows} if args.windows else {})}
    model = llm.get_model(model_id)
    history, rows, held = [], [], 0
    for i in range(args.turns):
        text = MESSAGES[i % len(MESSAGES)]
        best = None
        for _ in range(args.reps):
            # the same turn again, from what the session held before it; its
            # own saved state removed, so the turn continues the session (hit)
            shutil.rmtree(saved_states_dir(), ignore_errors=True)
            if not held:
                store.POOL.clear()
            else:
                (_, session), = store.POOL._sessions.values()
                assert session.cache.rewind(held)
                del session.tokens[held:]
            t0 = time.perf_counter()
            response = model.prompt(text, messages=history, **options)
            ttft = None
            for _ in response:
                ttft = ttft or time.perf_counter() - t0
            if best is None or ttft < best[0]:
                best = (ttft, response.response_json)
            reply = response.text()
        ttft, j = best
        (key, session), = store.POOL._sessions.values()
        held = len(session.tokens)
        program = store._programs[key]
        prompt = session.tokens[: j["prompt_tokens"]]
        disk = StateStore(saved_states_dir(), 1 << 40, print)
        (state,) = disk.all()
        rows.append({
            "turn": i + 1, "path": j["cache_path"], "prompt": j["prompt_tokens"], "new": j["prefilled_tokens"],
            "ttft_s": ttft, "prefill_s": j["time_to_first_token_s"],
            "bare_s": bare_prefill(program, session.policy, prompt, j["cached_tokens"], args.reps),
            "state_tokens": len(state.ids), "state_mb": state.size / 2**20, "save_s": j["disk_save_s"],
            "load_s": load_time(disk, state, program, session.policy, args.reps),
        })
        history += [llm.user(text), llm.assistant(reply)]
    print(f"{args.pte.name}, windows {args.windows or 'the model''s'}, {args.max_tokens}-token replies")
    print("\n".join(table(
        ["turn", "path", "prompt", "new", "TTFT s", "its prefill s", "bare prefill s", "TTFT ÷ bare",
         "state tokens · MB", "save s", "load s"],
        [[r["turn"], r["path"], r["prompt"], r["new"], f"{r['ttft_s']:.3f}", f"{r['prefill_s']:.3f}",
          f"{r['bare_s']:.3f}", f"{r['ttft_s'] / r['bare_s']:.2f}", f"{r['state_tokens']} · {r['state_mb']:.1f}",
          f"{r['save_s']:.3f}", f"{r['load_s']:.3f}"] for r in rows],
    )))
    print(json.dumps(rows), file=sys.stderr)


if __name__ == "__main__":
    main()
