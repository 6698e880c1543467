"""Figures over repetitions, and the markdown they are printed as.

Every benchmark reports a figure as ``median [min–max]`` over its
repetitions; a ratio between two engines is taken within each repetition,
then summarized the same way, so a slow patch of a shared machine hits both
sides of it.
"""

from __future__ import annotations

import statistics
import sys


def log(message: str) -> None:
    """Progress and notes go to stderr: stdout is the report's."""
    print(message, file=sys.stderr, flush=True)


def spread(values) -> dict:
    """Median, min and max of a list of numbers."""
    values = list(values)
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def ratio_spread(numerators, denominators) -> dict:
    """``spread`` of the ratios of paired figures, one pair per repetition."""
    return spread([a / b for a, b in zip(numerators, denominators)])


def fmt(s: dict | None, pattern: str = "{:.1f}", collapse: bool = False) -> str:
    """``median [min–max]`` in one number format, "–" for no figure; with
    ``collapse``, one number where the repetitions agree."""
    if s is None:
        return "–"
    median = pattern.format(s["median"])
    if collapse and s["min"] == s["max"]:
        return median
    return f"{median} [{pattern.format(s['min'])}–{pattern.format(s['max'])}]"


def row(cells) -> str:
    """One markdown table row; an empty cell is written ``| |``."""
    return "|" + "|".join(f" {c} " if c != "" else " " for c in cells) + "|"


def table(header, rows=()) -> list[str]:
    """A markdown table's lines: the header, its rule, then ``rows``."""
    return [row(header), "|" + "---|" * len(header)] + [row(r) for r in rows]


def summarize_runs(reps: list[dict], names: list[str]) -> dict:
    """Each engine's prefill and decode figures, each per-repetition ratio
    (ours / every other engine) and the tokens shared with ours, from
    ``timing.rep_entry`` records."""
    def series(engine, key):
        return [r[engine][key] for r in reps]

    out = {}
    for key in ("prefill_tps", "decode_tps"):
        out[key] = {name: spread(series(name, key)) for name in names}
        out[key]["ratio"] = {
            name: ratio_spread(series("ours", key), series(name, key)) for name in names if name != "ours"
        }
    out["same_tokens"] = {
        name: spread([r["same_tokens"][name] for r in reps]) for name in names if name != "ours"
    }
    return out


def write_json(path, raw: dict) -> None:
    """Every raw number of a run, for ``--json``."""
    import json

    path.write_text(json.dumps(raw, indent=2, default=str) + "\n")
    log(f"wrote {path}")
