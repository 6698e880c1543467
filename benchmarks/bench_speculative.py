"""Speculative decoding (``-o draft ngram``, ``-o draft MODEL``) against
plain decoding, on the plugin's own turn (template, sampler, cache), greedy.

Two prompts: a copy-heavy one (a pasted paragraph to rewrite with one
change) and a free-form one. Per repetition each prompt runs without a
draft, with prompt lookup and, given ``--draft``, with that draft model, in
an order that alternates, each from cold caches; the table gives decode
tok/s, its ratio to plain decoding per repetition (``median [min–max]``),
how many proposals were taken, and whether the replies were the same.

``--acceptance 1,0.8`` adds rows at a fixed acceptance by construction,
for models whose replies the drafts cannot guess (random weights): the
drafter (the draft model, else prompt lookup) runs as it would, but what
it proposes is replaced by the plain reply's own next tokens, each replaced
by another with probability 1 - A. It measures what verifying several
tokens a step gains at that rate, the draft's own cost included.

    python benchmarks/bench_speculative.py MODEL.pte [--tokenizer tokenizer.json] [--draft DRAFT.pte]
        [--reps 3] [--max-tokens 128] [--acceptance 1,0.8,0.5]
"""

from __future__ import annotations

import argparse
import pathlib

from harness import cli
from harness.machine import bind_blas_and_import_mlx, machine_info
from harness.report import fmt, log, ratio_spread, spread, table, write_json

PARAGRAPH = (
    "The sky above the quiet harbor was a deep blue that evening, and the fishing boats rocked gently "
    "against the old wooden pier while gulls circled overhead, calling to one another as the last light "
    "faded behind the hills. Down on the shore, a few children were still building a castle of wet sand, "
    "shaping its towers with their hands and decorating its walls with shells they had gathered that "
    "morning, while their parents watched from a bench near the lighthouse."
)
PROMPTS = {
    "copy": f"Rewrite this paragraph exactly, changing only the word \"blue\" to \"green\":\n\n{PARAGRAPH}",
    "free": "Write a short story about a lighthouse keeper who finds a message in a bottle.",
}


class FixedAcceptance:
    """A drafter proposing ``reply``, the plain reply's ids, each proposal
    replaced by another id with probability 1 - ``rate`` (greedy
    verification then keeps each with that probability), after running
    ``drafter``, whose proposals it drops, for its cost."""

    def __init__(self, drafter, reply: list[int], rate: float, seed: int):
        import random

        self.drafter, self.start, self.reply, self.rate = drafter, len(drafter.ids), reply, rate
        self.random = random.Random(seed)

    @property
    def ids(self) -> list[int]:
        return self.drafter.ids

    @property
    def free(self) -> bool:
        return self.drafter.free

    def extend(self, ids: list[int]) -> None:
        self.drafter.extend(ids)

    def follow(self) -> None:
        self.drafter.follow()

    def behind(self) -> int:
        return self.drafter.behind()

    def propose(self, most: int) -> list[int]:
        self.drafter.propose(most)
        at = len(self.ids) - self.start
        return [t if self.random.random() < self.rate else t + 1 for t in self.reply[at:at + most]]


def turn(pte, tokenizer, prompt: str, draft: str, max_tokens: int, draft_tokens: int, draft_pte=None,
         wrap=None) -> tuple[str, dict, list[int]]:
    """The reply's text, stats and ids; ``draft``: none, ngram, or a name
    for ``draft_pte``; each drafter made passed through ``wrap``, where given."""
    from llm_executorch_mlx.text import store, turn as turn_module
    from llm_executorch_mlx.text.turn import Turn, TurnOptions

    store.POOL.clear()
    store.DRAFTS.clear()
    store.REPLIES.clear()
    made = {name: getattr(turn_module, name) for name in ("NgramDrafter", "ModelDrafter")}
    if wrap is not None:
        for name, make in made.items():
            setattr(turn_module, name, lambda *a, make=make, **k: wrap(make(*a, **k)))
    try:
        t = Turn(str(pte), str(tokenizer), [{"role": "user", "content": prompt}],
                 TurnOptions(draft=draft, draft_tokens=draft_tokens, max_tokens=max_tokens, kv_disk_mb=0),
                 draft_model=None if draft in ("none", "ngram") else (str(draft_pte), str(tokenizer)))
        text = "".join(t)
    finally:
        for name, make in made.items():
            setattr(turn_module, name, make)
    (session,) = [s for _, s in store.POOL._sessions.values()]
    return text, t.result.stats, session.tokens[t.result.prompt_tokens:]


def record(text: str, stats: dict) -> dict:
    return {"text": text, **{k: stats[k] for k in (
        "decode_tokens_per_s", "generated_tokens", "drafted_tokens", "accepted_tokens")}}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    cli.add_pte_and_tokenizer(ap)
    ap.add_argument("--draft", type=pathlib.Path, help="a draft model's .pte (of the same tokenizer) to time too")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--draft-tokens", type=int, default=5)
    ap.add_argument("--acceptance", default="", help="fixed acceptance rates to add, comma-separated (e.g. 1,0.8)")
    cli.add_reps(ap, 3, "timed repetitions of each prompt and route")
    cli.add_json(ap)
    args = ap.parse_args()
    rates = [float(r) for r in args.acceptance.split(",") if r.strip()]
    info = machine_info(bind_blas_and_import_mlx())
    tokenizer = cli.tokenizer_of(args)
    from llm_executorch_mlx.text.sidecar import read_sidecar

    if read_sidecar(tokenizer.parent).chat_template is None:
        ap.error(f"no chat template beside {tokenizer} (tokenizer_config.json or chat_template.jinja): "
                 "the prompts would reach the model without their chat markup")
    model = f"{args.draft.parent.name}/{args.draft.stem}" if args.draft else None  # the draft model's route
    drafts = ["none", "ngram"] + ([model] if model else [])
    for draft in drafts:  # load, build the kernels (a verifying call's too: copying proposes), warm
        turn(args.pte, tokenizer, PROMPTS["copy"], draft, 32, args.draft_tokens, args.draft)
    if rates:  # the fixed rates' verifying calls too (a model of random weights copies nothing)
        _, _, reply = turn(args.pte, tokenizer, PROMPTS["copy"], "none", 32, args.draft_tokens)
        for rate in rates:
            turn(args.pte, tokenizer, PROMPTS["copy"], model or "ngram", 32, args.draft_tokens, args.draft,
                 lambda drafter, rate=rate: FixedAcceptance(drafter, reply, rate, 0))
    raw = {"machine": info, "pte": str(args.pte), "draft": str(args.draft), "reps": []}
    for rep in range(args.reps):
        runs = {}
        for name, prompt in PROMPTS.items():
            order = drafts if rep % 2 == 0 else drafts[::-1]
            for draft in order:
                text, stats, ids = turn(args.pte, tokenizer, prompt, draft, args.max_tokens, args.draft_tokens,
                                        args.draft)
                if draft == "none":
                    reply = ids
                runs[name, draft] = record(text, stats)
                log(f"rep {rep} {name} {draft}: {stats['decode_tokens_per_s']} tok/s, "
                    f"{stats['accepted_tokens']}/{stats['drafted_tokens']} taken")
            for rate in rates:
                fixed = lambda drafter, rate=rate: FixedAcceptance(drafter, reply, rate, rep)  # noqa: E731
                text, stats, _ = turn(args.pte, tokenizer, prompt, model or "ngram", args.max_tokens,
                                      args.draft_tokens, args.draft, fixed)
                runs[name, f"at {rate:g}"] = record(text, stats)
                log(f"rep {rep} {name} at {rate:g}: {stats['decode_tokens_per_s']} tok/s")
        raw["reps"].append({f"{k[0]} {k[1]}": v for k, v in runs.items()})
    print(f"{info['cpu_model']} ({info['cpus_available']} cores, {info['mlx_device']}); {args.pte.name}"
          f"{f', draft {model}' if model else ''}; {args.max_tokens} tokens greedy, "
          f"--draft-tokens {args.draft_tokens}, {args.reps} repetitions\n")
    rows = []
    for name in PROMPTS:
        plain = [r[f"{name} none"]["decode_tokens_per_s"] for r in raw["reps"]]
        for route in drafts[1:] + [f"at {rate:g}" for rate in rates]:
            drafted = [r[f"{name} {route}"]["decode_tokens_per_s"] for r in raw["reps"]]
            taken = sum(r[f"{name} {route}"]["accepted_tokens"] for r in raw["reps"])
            proposed = sum(r[f"{name} {route}"]["drafted_tokens"] for r in raw["reps"])
            same = all(r[f"{name} none"]["text"] == r[f"{name} {route}"]["text"] for r in raw["reps"])
            rows.append([name, route, fmt(spread(plain)), fmt(spread(drafted)),
                         fmt(ratio_spread(drafted, plain), "{:.2f}"), f"{taken}/{proposed}", "yes" if same else "no"])
    print("\n".join(table(["prompt", "draft", "decode tok/s plain", "decode tok/s drafted", "drafted / plain",
                           "proposals taken", "same reply"], rows)))
    if args.json:
        write_json(args.json, raw)


if __name__ == "__main__":
    main()
