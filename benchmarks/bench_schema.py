"""What a schema costs per token: the constrained-decoding mask against a decode step.

Runs the plugin's decode loop (``generate_tokens``, greedy) on MODEL for one
chat prompt, once free and once under a JSON schema (``Constraint``,
timed around each of its calls), several rounds each, and reports per token:
the host time of the mask (the token taken into the grammar, the next mask
computed and handed to MLX), and the decode step of both runs.

With ``--tool-choice`` the constraint is a forced call of one of TOOLS
(``-o tool_choice required``) instead, the prompt rendered with the tools by
the tokenizer's own template, which must render tools (a Qwen2.5 template
beside the tokenizer, say).

    python benchmarks/bench_schema.py MODEL.pte [--tokenizer FILE] [--reps 3] [--max-tokens 64] [--tool-choice]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from harness import cli

SCHEMA = {  # what `llm --schema 'name, age int, bio'` sends
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}, "bio": {"type": "string"}},
    "required": ["name", "age", "bio"],
}
PROMPT = "Invent a dog."
TOOLS = [  # what `llm -T llm_time --functions 'def weather(city: str, unit: str): ...'` offers
    {"type": "function", "function": {"name": "llm_time", "description": "Returns the current time",
                                      "parameters": {"type": "object", "properties": {}}}},
    {"type": "function", "function": {"name": "weather", "description": "The weather in a city", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"]}}},
]
TOOL_PROMPT = "What is the weather in Paris, in celsius?"


class Timed:
    """A ``Constraint`` whose calls are timed."""

    def __init__(self, constraint):
        self.constraint, self.seconds = constraint, []

    def apply(self, logits):
        t0 = time.perf_counter()
        out = self.constraint.apply(logits)
        self.seconds.append(time.perf_counter() - t0)
        return out

    def advance(self, token):
        t0 = time.perf_counter()
        self.constraint.advance(token)
        self.seconds.append(time.perf_counter() - t0)


def run(program, tokenizer, prompt, max_tokens, stops, constraint=None):
    """(tokens, decode seconds per token) of one greedy reply."""
    from llm_executorch_mlx.text.generate import Timings, generate_tokens
    from llm_executorch_mlx.text.sampling import Sampler

    cache = program.new_cache(capacity=len(prompt) + max_tokens + 1, dtype=program.compute_dtype or "fp32")
    forward = program.load_method("forward", cache=cache)
    timings = Timings()
    tokens = []
    for step in generate_tokens(forward, cache, prompt, 0, program.metadata.prefill_chunk, Sampler().sample_next,
                                max_tokens, timings, constraint):
        tokens.append(step.token)
        if step.token in stops.ids:
            break
    return tokens, timings.decode_seconds / max(1, timings.decode_tokens)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    cli.add_pte_and_tokenizer(ap)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--tool-choice", action="store_true", help="a forced call of TOOLS instead of the schema")
    args = ap.parse_args()

    from llm_executorch_mlx.runtime import load_program
    from llm_executorch_mlx.text import load_tokenizer, resolve_template
    from llm_executorch_mlx.text.constrained import Constraint
    from llm_executorch_mlx.text.conversation import encode_conversation
    from llm_executorch_mlx.text.stops import stop_tokens
    from llm_executorch_mlx.text.reply_parts import split_reply
    from llm_executorch_mlx.text.tool_calls import tool_format

    program = load_program(args.pte)
    program.prepare_cpu_kernels()
    tokenizer = load_tokenizer(cli.tokenizer_of(args))
    template = resolve_template("auto", tokenizer)
    call = None
    if args.tool_choice:
        call = (tool_format(template.source), TOOLS)
        template = template.bound(tools=TOOLS)
    question = TOOL_PROMPT if args.tool_choice else PROMPT
    prompt = encode_conversation([{"role": "user", "content": question}], template, tokenizer, {})
    stops = stop_tokens(program.metadata.eos_ids, tokenizer, template.turn_end)
    n_vocab = program.metadata.vocab_size or tokenizer.vocab_size

    def constraint():
        return Constraint(None if call else SCHEMA, tokenizer, n_vocab, stops.ids, call=call)

    t0 = time.perf_counter()
    constraint()
    print(f"token table and grammar, first time: {time.perf_counter() - t0:.3f} s")
    run(program, tokenizer, prompt, 8, stops)  # warm-up
    free, bound, masks = [], [], []
    for _ in range(args.reps):
        free.append(run(program, tokenizer, prompt, args.max_tokens, stops)[1])
        timed = Timed(constraint())
        tokens, per_token = run(program, tokenizer, prompt, args.max_tokens, stops, timed)
        bound.append(per_token)
        # two calls per token (advance, apply); the first apply builds the lexer
        calls = timed.seconds[1:]
        masks.append(sum(calls) / max(1, len(tokens) - 1))
    text = tokenizer.decode([t for t in tokens if t not in stops.ids])
    if call:
        assert len(split_reply(text, None, False, call[0]).calls) == 1, text
    else:
        json.loads(text)
    print(f"reply under the {'forced call' if call else 'schema'}: {text}")
    ms = lambda xs: f"{statistics.median(xs) * 1e3:.3f} ms (range {min(xs) * 1e3:.3f}-{max(xs) * 1e3:.3f})"
    print(f"decode step, free:        {ms(free)}")
    print(f"decode step, constrained: {ms(bound)}")
    print(f"mask per token (host):    {ms(masks)}")
    print(f"mask / free decode step:  {statistics.median(masks) / statistics.median(free):.2%}")


if __name__ == "__main__":
    main()
