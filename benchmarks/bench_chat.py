"""Time to first token over a multi-turn chat: ours vs full re-prefill vs
mlx-lm with a reused prompt cache.

An 8-turn chat (by default) on a seeded random-weight Llama, built and
exported as ``bench_decode.py`` does (max context 2048). Each user message
is 150 words (= tokens) of seeded pseudo-text; each reply is 64 greedy
tokens. Per turn, interleaved in one process, three engines answer the same
conversation:

- ours: the ``llm`` plugin through llm's Python API (``llm.get_model``,
  ``model.conversation()``, ``conversation.prompt``); its cache stays in the
  plugin's session pool between turns. Sent to forward = the plugin's
  ``prefilled_tokens`` (``response_json``), with its ``cache_path``.
- re-prefill, the llm-mlx way: mlx-lm's chat template over the whole history,
  ``generate_step`` on a fresh cache each turn. Sent = the whole prompt.
- mlx-lm cached: the same, but one ``make_prompt_cache`` kept across turns;
  each turn the cache is trimmed to the longest prefix it shares with the
  prompt and only the rest is fed. Sent = that rest.

All engines compute in one dtype: the one ours computes the .pte in
(``--compute``, the plugin's ``compute_dtype`` option; its default widens
a bf16 .pte to fp32 on a CPU), with mlx-lm's weights cast to it by
``model.set_dtype``. ``--compute native`` keeps bf16 everywhere.

TTFT is, for every engine, the time from handing over the messages to the
first new token on the host: it includes rendering and tokenizing the
history (and, for ours, llm's own overhead and detokenizing the token).

One conversation for all. Our replies are the assistant messages of the
shared history: the plugin splices the ids it generated back in when the
history holds exactly the text it produced, so only ours can be the author
without missing its cache (given another engine's reply, it would re-feed
the reply from its first differing token). The mlx-lm engines still generate
64 greedy tokens of their own each turn; afterwards, untimed, the cached
engine's cache is rewound past its own reply and fed ours, so it holds what
it would have held had it written that reply, as a real chat's cache would.

The random model has no tokenizer, so one is built: a word-level
tokenizer.json of made-up words, one per model id (so every id the
random weights emit has text), with a Llama 3 chat template. Its text and
ids map one to one, so all engines see the same ids; the report checks that
each turn's prompt length agrees. The .pte is registered for llm in a
throwaway ``LLM_USER_PATH``.

One warmup chat (2 turns, short replies) of every engine is discarded; each
of ``--reps`` runs is a new conversation with its own text, since repeating
one would find the plugin's cache of the last run. Replies that stop early
(the random model emitting <|eot_id|>) are reported.

    python benchmarks/bench_chat.py --shape tiny
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import pathlib
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field

from harness import cli, machine, models
from harness.conversation import register_pte
from harness.engines import load_mlx_lm
from harness.report import fmt, log, spread, table, write_json
from harness.timing import common_prefix, settle

MODEL_NAME = "chat-bench"
SPECIALS = ["<unk>", "<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
ROLES = ["system", "user", "assistant"]
LLAMA3_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + message['content'] | trim + '<|eot_id|>' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}"
)
ENGINES = ("ours", "re-prefill", "mlx-lm cached")
GOALS = {"re-prefill": 0.15, "mlx-lm cached": 1.1}  # most ours/engine TTFT at the last turn


def parse_args(argv=None) -> argparse.Namespace:
    """The command line, checked."""
    p = argparse.ArgumentParser(
        description="Per-turn tokens sent to forward and time to first token over a chat: "
                    "llm-executorch-mlx vs full re-prefill vs mlx-lm with a reused prompt cache.",
    )
    cli.add_model_arguments(p, max_ctx_len=2048)
    p.add_argument("--pte", type=pathlib.Path,
                   help="reuse this .pte exported from --model-dir (its dtype must be --dtype)")
    p.add_argument("--dtype", choices=["fp32", "bf16"], default="bf16", help=".pte dtype (default: bf16)")
    p.add_argument("--compute", choices=["auto", "native", "fp32"], default="auto",
                   help="ours' compute_dtype option (default: auto, the plugin's: fp32 on a CPU); "
                        "mlx-lm is cast to the dtype ours then computes in")
    p.add_argument("--turns", type=int, default=8, help="user turns (default: 8)")
    p.add_argument("--user-tokens", type=int, default=150, help="words (= tokens) per user message (default: 150)")
    p.add_argument("--reply-tokens", type=int, default=64, help="greedy tokens per reply (default: 64)")
    cli.add_reps(p, 1, "whole chats to time")
    cli.add_json(p)
    args = p.parse_args(argv)
    cli.check_pte_needs_model_dir(p, args)
    if min(args.turns, args.user_tokens, args.reply_tokens, args.reps) < 1:
        p.error("--turns, --user-tokens, --reply-tokens and --reps must be at least 1")
    return args


# -- artifacts ----------------------------------------------------------------


def prepare_pte(args) -> tuple[pathlib.Path, pathlib.Path]:
    """The HF model dir and the .pte, cached under ``--workdir`` with
    bench_decode's names, so the two scripts share what they build."""
    model_dir, base = models.model_source(args.workdir, args.shape, args.seed, args.model_dir)
    pte = args.pte or models.cached_export(base, model_dir, args.dtype, args.max_ctx_len, args.prefill_chunk)
    return model_dir, pte


def pseudo_words(n: int) -> list[str]:
    """``n`` distinct lowercase words of consonant-vowel syllables, shortest first."""
    syllables = [c + v for c in "bdfghklmnprstvz" for v in "aeiou"]
    words = []
    for length in itertools.count(1):
        for combo in itertools.product(syllables, repeat=length):
            if len(words) == n:
                return words
            words.append("".join(combo))


def write_tokenizer(directory: pathlib.Path, vocab_size: int) -> pathlib.Path:
    """A word-level tokenizer.json with exactly ``vocab_size`` tokens, and a
    tokenizer_config.json with a Llama 3 chat template; returns the former.

    Words split on whitespace and decode joined by one space, so any id
    sequence decodes to text that encodes back to the same ids.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    names = SPECIALS + ROLES
    vocab = {w: i for i, w in enumerate(names + pseudo_words(vocab_size - len(names)))}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)
    tok.add_special_tokens(SPECIALS)
    directory.mkdir(parents=True, exist_ok=True)
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "<|begin_of_text|>",
        "eos_token": "<|eot_id|>",
        "chat_template": LLAMA3_TEMPLATE,
        "tokenizer_class": "PreTrainedTokenizerFast",
    }))
    return directory / "tokenizer.json"


def user_messages(vocab_words: list[str], n_turns: int, n_words: int, seed: int, stream: int) -> list[str]:
    """``n_turns`` messages of ``n_words`` pseudo-words each, one seeded stream per chat."""
    import numpy as np

    rng = np.random.default_rng([seed, stream])
    return [" ".join(vocab_words[i] for i in rng.integers(0, len(vocab_words), n_words)) for _ in range(n_turns)]


def longest_context(tokenizer, texts: list[str], reply_tokens: int) -> int:
    """Tokens the last turn needs: its prompt, after replies of ``reply_tokens``
    words, plus the reply it generates."""
    reply = " ".join(["ba"] * reply_tokens)
    messages = []
    for text in texts:
        messages += [{"role": "user", "content": text}, {"role": "assistant", "content": reply}]
    return len(tokenizer.apply_chat_template(messages[:-1], add_generation_prompt=True)) + reply_tokens


# -- engines ------------------------------------------------------------------


@dataclass
class TurnRun:
    """One engine's answer to one turn."""

    prompt_tokens: int  # the whole conversation as ids
    sent: int  # ids fed to forward before the first new token
    ttft_s: float  # messages in hand -> first new token on the host
    generated: int  # new tokens (ours: before any stop token)
    tokens: list[int] = field(default_factory=list)  # mlx-lm: its own new tokens
    text: str = ""  # ours: the reply as llm records it
    stats: dict = field(default_factory=dict)  # ours: the plugin's response_json


class OursChat:
    """The plugin, through llm's conversation API."""

    name = "ours"

    def __init__(self, model_id: str, compute: str):
        import llm

        self.model = llm.get_model(model_id)
        self.options = {"temperature": 0, "compute_dtype": compute}
        self.conversation = None

    def start(self) -> None:
        """Begin a new conversation."""
        self.conversation = self.model.conversation()

    def turn(self, messages: list[dict], max_tokens: int) -> TurnRun:
        """Prompt with the last (user) message; llm supplies the history, whose
        assistant messages are this engine's own replies."""
        import mlx.core as mx

        t0 = time.perf_counter()
        response = self.conversation.prompt(messages[-1]["content"], max_tokens=max_tokens, **self.options)
        chunks, ttft = [], None
        for chunk in response:
            if ttft is None:
                ttft = time.perf_counter() - t0
            chunks.append(chunk)
        mx.synchronize()
        stats = response.response_json
        return TurnRun(
            prompt_tokens=stats["prompt_tokens"], sent=stats["prefilled_tokens"],
            ttft_s=ttft if ttft is not None else time.perf_counter() - t0,
            generated=stats["generated_tokens"], text="".join(chunks), stats=stats,
        )


class MlxLmChat:
    """mlx-lm's ``generate_step`` over the whole history rendered by its own
    tokenizer wrapper; with ``reuse``, one prompt cache kept across turns."""

    def __init__(self, model, tokenizer, prefill_chunk: int, reuse: bool):
        self.model = model
        self.tokenizer = tokenizer
        self.prefill_chunk = prefill_chunk
        self.reuse = reuse
        self.name = "mlx-lm cached" if reuse else "re-prefill"
        self.cache, self.held, self.prompt = None, [], []

    def start(self) -> None:
        """Begin a new conversation: an empty cache."""
        from mlx_lm.models.cache import make_prompt_cache

        self.cache, self.held = make_prompt_cache(self.model), []

    def turn(self, messages: list[dict], max_tokens: int) -> TurnRun:
        """Render, reuse what the cache holds (if reusing), generate greedily."""
        import mlx.core as mx
        from mlx_lm.generate import generate_step, generation_stream

        t0 = time.perf_counter()
        self.prompt = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        if not self.reuse:
            self.start()
        start = self._keep(min(common_prefix(self.held, self.prompt), len(self.prompt) - 1))
        steps = generate_step(
            mx.array(self.prompt[start:]), self.model, prompt_cache=self.cache,
            max_tokens=max_tokens, prefill_step_size=self.prefill_chunk,
        )
        tokens, ttft = [], None
        for token, _ in steps:
            if ttft is None:
                ttft = time.perf_counter() - t0
            tokens.append(token)
        mx.synchronize(generation_stream)
        self.held = (self.prompt + tokens)[: self.cache[0].offset]
        return TurnRun(len(self.prompt), len(self.prompt) - start, ttft, len(tokens), tokens=tokens)

    def reply_ids(self, reply: str) -> list[int]:
        """The ids of a reply as the chat template writes it (trimmed)."""
        return self.tokenizer.encode(reply.strip(), add_special_tokens=False)

    def adopt(self, reply_ids: list[int]) -> None:
        """Untimed: make the cache hold the last prompt then ``reply_ids``, as
        if this engine had generated them."""
        import mlx.core as mx

        target = self.prompt + reply_ids
        n = self._keep(common_prefix(self.held, target))
        if n < len(target):
            self.model(mx.array([target[n:]]), cache=self.cache)
            mx.eval([c.state for c in self.cache])
        self.held = target

    def _keep(self, n: int) -> int:
        """Trim the cache to its first ``n`` ids; returns ``n``."""
        from mlx_lm.models.cache import trim_prompt_cache

        trim_prompt_cache(self.cache, len(self.held) - n)
        del self.held[n:]
        return n


# -- the chat -----------------------------------------------------------------


def chat(ours: OursChat, reprefill: MlxLmChat, cached: MlxLmChat, texts: list[str],
         reply_tokens: int) -> list[dict]:
    """One conversation, the engines interleaved per turn; a record per turn."""
    for engine in (ours, reprefill, cached):
        engine.start()
    messages, records, context = [], [], 0
    for number, text in enumerate(texts, 1):
        messages.append({"role": "user", "content": text})
        runs = {}
        for engine in (ours, reprefill, cached):
            settle()
            runs[engine.name] = engine.turn(messages, reply_tokens)
        reply = runs["ours"].text
        messages.append({"role": "assistant", "content": reply})
        reply_ids = cached.reply_ids(reply)
        cached.adopt(reply_ids)
        records.append(turn_record(number, runs, context, reply_ids))
        stopped = runs["ours"].stats["finish_reason"] == "stop"
        context = runs["ours"].prompt_tokens + runs["ours"].generated + stopped
    return records


def turn_record(number: int, runs: dict[str, TurnRun], context: int, reply_ids: list[int]) -> dict:
    """The raw numbers of one turn. ``context``: ids of the conversation as of
    the previous turn's end (its prompt, reply and stop token, if any)."""
    ours = runs["ours"]
    record = {
        "turn": number,
        "new_tokens": ours.prompt_tokens - context,
        "ours_ttft_ratio": {name: ours.ttft_s / runs[name].ttft_s for name in ENGINES[1:]},
        "tokens_equal_to_ours": {name: common_prefix(runs[name].tokens, reply_ids) for name in ENGINES[1:]},
    }
    for name, run in runs.items():
        record[name] = {k: v for k, v in asdict(run).items() if k not in ("tokens", "text")}
    return record


def run_all(args, model_id: str, model_dir: pathlib.Path, tokenizer_dir: pathlib.Path, pte_meta,
            compute_dtype: str) -> list[list[dict]]:
    """Warm up, then time ``args.reps`` chats; their turn records."""
    from mlx_lm.tokenizer_utils import load as load_tokenizer

    tokenizer = load_tokenizer(tokenizer_dir)
    words = pseudo_words(pte_meta.vocab_size)[len(SPECIALS + ROLES):]
    needed = longest_context(tokenizer, user_messages(words, args.turns, args.user_tokens, args.seed, 1),
                             args.reply_tokens)
    if (pte_meta.max_context or 0) < needed:
        sys.exit(f"the .pte holds {pte_meta.max_context} tokens; the chat needs {needed}: "
                 f"leave out --pte, or export with --max-ctx-len {needed} or more")
    ours = OursChat(model_id, args.compute)
    model = load_mlx_lm(model_dir, compute_dtype)
    reprefill = MlxLmChat(model, tokenizer, pte_meta.prefill_chunk, reuse=False)
    cached = MlxLmChat(model, tokenizer, pte_meta.prefill_chunk, reuse=True)
    log("warmup chat (2 turns, 4-token replies)")
    chat(ours, reprefill, cached, user_messages(words, 2, args.user_tokens, args.seed, 0), 4)
    reps = []
    for rep in range(1, args.reps + 1):
        texts = user_messages(words, args.turns, args.user_tokens, args.seed, rep)
        reps.append(chat(ours, reprefill, cached, texts, args.reply_tokens))
        for r in reps[-1]:
            log(f"rep {rep} turn {r['turn']}: prompt {r['ours']['prompt_tokens']}, TTFT "
                + ", ".join(f"{name} {r[name]['ttft_s']:.3f}s (sent {r[name]['sent']})" for name in ENGINES))
    return reps


# -- reporting ----------------------------------------------------------------


def summarize(reps: list[list[dict]]) -> list[dict]:
    """Per turn, every figure as median/min/max over the repetitions."""
    rows = []
    for turn in zip(*reps):
        row = {"turn": turn[0]["turn"], "new_tokens": spread([t["new_tokens"] for t in turn])}
        for name in ENGINES:
            row[name] = {key: spread([t[name][key] for t in turn]) for key in ("prompt_tokens", "sent", "ttft_s")}
        row["ours"]["cache_path"] = sorted({t["ours"]["stats"]["cache_path"] for t in turn})
        row["ours_ttft_ratio"] = {name: spread([t["ours_ttft_ratio"][name] for t in turn]) for name in ENGINES[1:]}
        rows.append(row)
    return rows


def markdown(rows: list[dict], args, compute_dtype: str) -> str:
    """The per-turn table and the goals of the last turn."""
    def cell(s: dict, pattern: str) -> str:
        return fmt(s, pattern, collapse=True)

    header = ["turn", "prompt tokens", "new tokens", "ours sent", "ours cache path", "ours TTFT"]
    header += [f"{name} {what}" for name in ENGINES[1:] for what in ("sent", "TTFT")]
    header += [f"ours/{name} TTFT" for name in ENGINES[1:]]
    cells = [
        [r["turn"], cell(r["ours"]["prompt_tokens"], "{:.0f}"), cell(r["new_tokens"], "{:.0f}"),
         cell(r["ours"]["sent"], "{:.0f}"), "/".join(r["ours"]["cache_path"]), cell(r["ours"]["ttft_s"], "{:.3f}")]
        + [cell(r[name][key], pattern) for name in ENGINES[1:] for key, pattern in (("sent", "{:.0f}"),
                                                                                      ("ttft_s", "{:.3f}"))]
        + [cell(r["ours_ttft_ratio"][name], "{:.2f}") for name in ENGINES[1:]]
        for r in rows
    ]
    lines = [
        f"{args.turns} turns of {args.user_tokens}-word user messages and {args.reply_tokens}-token greedy "
        f"replies; {args.dtype} .pte, all engines computing in {compute_dtype} (compute_dtype {args.compute}); "
        f"{args.reps} chat(s) after 1 warmup chat; TTFT in seconds"
        + (", median [min–max]" if args.reps > 1 else ""),
        "",
        *table(header, cells),
    ]
    return "\n".join(lines + ["", goals(rows[-1])])


def goals(last: dict) -> str:
    """The issue's goals at the last turn, on the medians."""
    sent, new = last["ours"]["sent"]["median"], last["new_tokens"]["median"]
    paths = "/".join(last["ours"]["cache_path"])
    parts = [
        f"ours sent {sent:.0f} for {new:.0f} new tokens via {paths} "
        f"({'ok' if sent <= new + 1 and paths == 'hit' else 'MISSED'}: goal = the new tokens, "
        "+1 for the last reply token, which is fed on the next turn)"
    ]
    for name, most in GOALS.items():
        ratio = last["ours_ttft_ratio"][name]["median"]
        parts.append(f"TTFT ours/{name} {ratio:.3f} ({'ok' if ratio <= most else 'MISSED'}: goal ≤ {most})")
    return f"Goals at turn {last['turn']}: " + "; ".join(parts)


def notes(reps: list[list[dict]]) -> list[str]:
    """Anything that makes a turn unlike the others: early stops, engines
    whose prompts differ in length, ours missing its cache."""
    out = []
    for rep, records in enumerate(reps, 1):
        for r in records:
            where = f"rep {rep} turn {r['turn']}"
            stats = r["ours"]["stats"]
            if stats["finish_reason"] != "length":
                out.append(f"{where}: ours' reply ended after {stats['generated_tokens']} tokens "
                           f"({stats['finish_reason']})")
            lengths = {r[name]["prompt_tokens"] for name in ENGINES}
            if len(lengths) > 1:
                out.append(f"{where}: prompt lengths differ between engines: {sorted(lengths)}")
            if r["turn"] > 1 and stats["cache_path"] != "hit":
                out.append(f"{where}: ours' cache path was {stats['cache_path']}")
    return out


def main(argv=None) -> None:
    args = parse_args(argv)

    blas = machine.bind_blas_and_import_mlx("auto")  # the runtime's BLAS, before mlx.core loads
    if note := machine.blas_note(blas):
        log(note)
    from llm_executorch_mlx.runtime import load_program

    model_dir, pte = prepare_pte(args)
    program = load_program(pte, compute=args.compute)
    meta, compute_dtype = program.metadata, program.compute_dtype
    del program
    if meta.activation_dtype != args.dtype:
        sys.exit(f"{pte} is {meta.activation_dtype}, not --dtype {args.dtype}")
    info = machine.machine_info(blas)
    with tempfile.TemporaryDirectory(prefix="bench-chat-") as tmp:
        os.environ["LLM_USER_PATH"] = tmp
        tokenizer_dir = pathlib.Path(tmp) / "tokenizer"
        model_id = register_pte(pte, write_tokenizer(tokenizer_dir, meta.vocab_size), MODEL_NAME)
        reps = run_all(args, model_id, model_dir, tokenizer_dir, meta, compute_dtype)
    info["loadavg_end"] = os.getloadavg()
    rows = summarize(reps)
    print(markdown(rows, args, compute_dtype))
    remarks = notes(reps)
    if remarks:
        print("\nNotes:\n" + "\n".join(f"- {note}" for note in remarks))
    if args.json:
        report = {"args": vars(args), "model_dir": model_dir, "pte": pte, "compute_dtype": compute_dtype,
                  "machine": info, "reps": reps, "summary": rows}
        write_json(args.json, report)


if __name__ == "__main__":
    main()
