"""One rank of a forward split as ``LLM_PTE_PARALLEL`` says, for
test_distributed.py, or the whole program
when started alone: three turns through the text layer's session and decode
loop (a cold prompt longer than a prefill chunk; the next turn, which the
cache holds; a turn that parts from it early, so the cache rewinds or, past a
sliding window's floor, resets), printed as one JSON line with the bytes of
weights the rank's forward reads.

    python split_rank.py MODEL.pte [LAYERS]   (LAYERS: "1,2", layers per rank)
"""

import json
import os
import sys

from llm_executorch_mlx import distributed
from llm_executorch_mlx.runtime import load_program  # first: binds the BLAS before mlx.core loads

import mlx.core as mx  # noqa: E402  (isort: skip)
from llm_executorch_mlx.text.generate import Timings, generate_tokens
from llm_executorch_mlx.text.session import CachePolicy, Session


def greedy(row, history):
    return mx.argmax(row)


def main(path: str, layers: list[int] | None) -> None:
    program = load_program(path)
    group = distributed.group()
    if group is not None:
        if layers:
            os.environ[distributed.LAYERS] = ",".join(map(str, layers))
        program = distributed.share(program, group)
    session = Session(program, CachePolicy(capacity=128, dtype="fp32"))
    chunk = session.cache.max_write or program.metadata.prefill_chunk
    first = [(7 * i + 3) % 200 for i in range(40)]
    done = {"paths": [], "replies": [], "lengths": []}
    prompts = [lambda: first, lambda: session.tokens + [5, 6, 7], lambda: first[:30] + [11, 12, 13]]
    for make in prompts:
        prompt = make()
        path, cached = session.reuse(prompt)
        reply = [s.token for s in generate_tokens(session.forward, session.cache, prompt, cached, chunk, greedy, 16,
                                                  Timings())]
        session.tokens = (prompt + reply)[: session.cache.length]
        done["paths"].append(path)
        done["replies"].append(reply)
        done["lengths"].append(session.cache.length)
    done["read_bytes"] = program.read_bytes()
    print(json.dumps(done), flush=True)


if __name__ == "__main__":
    main(sys.argv[1], [int(n) for n in sys.argv[2].split(",")] if len(sys.argv) > 2 else None)
