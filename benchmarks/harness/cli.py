"""The command-line flags several benchmarks share, and their checks."""

from __future__ import annotations

import argparse
import pathlib

from .models import DTYPES, SHAPES

WORKDIR = pathlib.Path(__file__).resolve().parent.parent / ".work"


def add_model_arguments(p: argparse.ArgumentParser, max_ctx_len: int = 1024) -> None:
    """Which random model to build (or which model to reuse) and how to export it."""
    p.add_argument("--shape", choices=sorted(SHAPES), default="smollm-135m",
                   help="random model shape to build (default: smollm-135m)")
    p.add_argument("--seed", type=int, default=0, help="weight and input seed (default: 0)")
    p.add_argument("--model-dir", type=pathlib.Path,
                   help="reuse this Hugging Face model dir instead of building one")
    add_workdir(p, "built models and exports")
    p.add_argument("--max-ctx-len", type=int, default=max_ctx_len,
                   help=f"export max context (default: {max_ctx_len})")
    p.add_argument("--prefill-chunk", type=int, default=128, help="export prefill chunk (default: 128)")


def add_workdir(p: argparse.ArgumentParser, what: str) -> None:
    p.add_argument("--workdir", type=pathlib.Path, default=WORKDIR,
                   help=f"where {what} are cached (default: benchmarks/.work)")


def add_ptes_by_dtype(p: argparse.ArgumentParser) -> None:
    """``--pte`` (repeatable) and ``--dtypes``: files to reuse, dtypes to run."""
    p.add_argument("--pte", type=pathlib.Path, action="append", default=[],
                   help="reuse this .pte exported from --model-dir (repeatable; its dtype "
                        "is read from the file); requested dtypes without one are exported")
    p.add_argument("--dtypes", default="fp32,bf16",
                   help=f"comma-separated dtypes among {','.join(DTYPES)} (default: fp32,bf16)")


def add_generation_arguments(p: argparse.ArgumentParser, prompt: str = "random prompt ids") -> None:
    p.add_argument("--prompt-len", type=int, default=512, help=f"{prompt} (default: 512)")
    p.add_argument("--new-tokens", type=int, default=128, help="greedy tokens to generate (default: 128)")


def add_reps(p: argparse.ArgumentParser, default: int, what: str = "timed repetitions per engine") -> None:
    p.add_argument("--reps", type=int, default=default, help=f"{what} (default: {default})")


def add_json(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", type=pathlib.Path, help="also write every raw number here")


def add_pte_and_tokenizer(p: argparse.ArgumentParser) -> None:
    """A registered-ready .pte, its tokenizer beside it unless named."""
    p.add_argument("pte", type=pathlib.Path)
    p.add_argument("--tokenizer", type=pathlib.Path, help="default: tokenizer.json beside the .pte")


def tokenizer_of(args: argparse.Namespace) -> pathlib.Path:
    return args.tokenizer or args.pte.parent / "tokenizer.json"


def choices(p: argparse.ArgumentParser, flag: str, value: str, allowed, empty_ok: bool = False) -> list[str]:
    """The comma-separated ``value`` of ``flag`` as a list, each among ``allowed``."""
    chosen = [v.strip() for v in value.split(",") if v.strip()]
    unknown = [v for v in chosen if v not in allowed]
    if unknown or not (chosen or empty_ok):
        p.error(f"{flag}: unknown {unknown}; choose among {', '.join(allowed)}")
    return chosen


def check_generation(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if args.new_tokens < 2 or args.prompt_len < 1 or args.reps < 1:
        p.error("need --new-tokens >= 2, --prompt-len >= 1 and --reps >= 1")


def check_pte_needs_model_dir(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if args.pte and args.model_dir is None:
        p.error("--pte needs --model-dir: the other engines run the Hugging Face weights the .pte came from")
