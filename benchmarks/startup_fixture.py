"""The small model ``bench_startup.py`` prompts, built in a child process.

Reuses ``bench_decode.py``'s tiny random Llama (2 layers, hidden 64, vocab
2048, exported to fp32 with max context 1024 and prefill chunk 128, cached
under the workdir) and the tests' small BPE tokenizer (``tests/models.py``
``make_tokenizer``: 200 ids and a Llama 3 chat template), padded with extra
tokens to the model's 2048 ids, as ``llm pte register`` asks. Prints one
JSON object, ``{"pte": ..., "tokenizer": ...}``, to stdout; progress goes to
stderr.

    python benchmarks/startup_fixture.py --workdir benchmarks/.work

``bench_startup.py`` runs this as a subprocess, so torch, transformers and
executorch never load in the process that times the commands.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys

from harness import cli, models

HERE = pathlib.Path(__file__).resolve().parent
REPO = HERE.parent


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description="Build (or reuse) bench_startup.py's small model.")
    p.add_argument("--workdir", type=pathlib.Path, default=cli.WORKDIR)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)

    # stdout carries the answer only: everything the builders print goes to stderr
    out = os.fdopen(os.dup(sys.stdout.fileno()), "w")
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())

    model_dir, base = models.model_source(args.workdir, "tiny", args.seed)
    pte = models.cached_export(base, model_dir, "fp32", 1024, 128)

    tok_dir = args.workdir / "startup-tokenizer-padded"
    tokenizer = tok_dir / "tokenizer.json"
    if not tokenizer.exists():
        sys.path.insert(0, str(REPO / "tests"))
        from models import make_tokenizer

        vocab = models.SHAPES["tiny"]["vocab_size"]
        make_tokenizer(tok_dir, extra_tokens=vocab - 200)
    json.dump({"pte": str(pte.resolve()), "tokenizer": str(tokenizer.resolve())}, out)
    out.write("\n")
    out.close()


if __name__ == "__main__":
    main()
