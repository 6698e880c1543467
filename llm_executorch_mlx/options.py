"""The options a prompt takes (``-o name value``), each declared once.

An option's name, type, default, allowed values and description live here
and nowhere else: plugin.py makes llm's Options class from them (so ``llm
models --options`` shows these descriptions), the text layer takes its
defaults from them (``TurnOptions``, ``Sampler``, the chat template names),
and ``Option.check`` is the one test of a value, used by llm's validation and
by the ``Sampler`` alike. Cheap to import: neither llm nor mlx.

The runtime keeps its own tables for the dtype and compute-route names, since
it maps them to MLX dtypes (``runtime/dtypes.py``); tests/test_options.py
checks that they name the same values as the choices here.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

REPETITION_CONTEXT = 64  # ids the repetition penalty looks back over


@dataclass(frozen=True)
class Option:
    name: str
    type: Any  # what llm's Options class parses the value to
    default: Any  # None: decided when the turn runs, as the description says
    description: str  # what ``llm models --options`` shows; "{default}" is replaced by the default
    choices: tuple[str, ...] = ()  # the allowed values, when it takes one of a few names
    aliases: dict[str, str] = field(default_factory=dict)  # another spelling -> the choice it means
    rule: str = ""  # what a valid value is, said after "<name> must be"; choices make their own
    valid: Callable[[Any], bool] | None = None  # the rule as a test (for options without choices)
    parse: Callable[[Any], Any] | None = None  # turns what was typed into the value, before the test

    @property
    def help(self) -> str:
        return self.description.format(default=self.default)

    def check(self, value):
        """``value`` if it is allowed (parsed, where the option parses), else a
        ValueError saying what a valid value is."""
        if value is None and self.default is None:
            return None  # not given: decided when the turn runs
        if self.parse is not None:
            value = self.parse(value)
        if self.choices:
            if value not in self.choices and value not in self.aliases:
                spelled = "".join(f" ({alias} for {choice})" for alias, choice in self.aliases.items())
                raise ValueError(f"{self.name} must be one of {', '.join(self.choices)}{spelled}, got {value!r}")
        elif not self.valid(value):
            raise ValueError(f"{self.name} must be {self.rule}, got {value!r}")
        return value


def _integer(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _windows(value) -> bool:
    return all(f.strip().isdigit() for f in str(value).split(","))


def _stop_strings(value):
    # llm passes "-o stop" as typed: a JSON list arrives as one string.
    if isinstance(value, str) and value.startswith("["):
        try:
            return json.loads(value)
        except ValueError:
            raise ValueError("stop must be a string or a JSON list of strings") from None
    return value


def _stop_valid(value) -> bool:
    if isinstance(value, str):
        return True
    return isinstance(value, (list, tuple)) and all(isinstance(s, str) and s for s in value)


_DECLARED = (
    Option("max_tokens", int, 256,
           "Most tokens to generate (default {default}; also capped by the room left in the cache)",
           rule=">= 1", valid=lambda v: _integer(v) and v >= 1),
    Option("temperature", float, 0.0,
           "Sampling temperature; {default:g} (default) is greedy and reproducible",
           rule=">= 0 (0 is greedy)", valid=lambda v: _number(v) and v >= 0),
    Option("top_p", float, 1.0,
           "Nucleus sampling: keep the top tokens with this total probability (0 < p <= 1)",
           rule="in (0, 1] (1 disables)", valid=lambda v: _number(v) and 0 < v <= 1),
    Option("top_k", int, 0,
           "Sample among the k most likely tokens ({default} = all)",
           rule="an integer >= 0 (0 disables)", valid=lambda v: _integer(v) and v >= 0),
    Option("min_p", float, 0.0,
           "Drop tokens less likely than min_p times the top token (0 <= p <= 1)",
           rule="in [0, 1] (0 disables)", valid=lambda v: _number(v) and 0 <= v <= 1),
    Option("repetition_penalty", float, 1.0,
           f"Penalise tokens seen in the last {REPETITION_CONTEXT} ({{default:g}} = off, > 1 discourages repeats)",
           rule="> 0 (1 disables)", valid=lambda v: _number(v) and v > 0),
    Option("seed", int, None,
           "Random seed for sampling, for reproducible runs at temperature > 0",
           rule="an integer in [0, 2**64) or None", valid=lambda v: _integer(v) and 0 <= v < 2**64),
    Option("draft", str, "none",
           "Speculative decoding: none (default); ngram, which proposes the tokens that followed the "
           "reply's last few earlier in the conversation (prompt lookup); or a registered model's name, "
           "a smaller model of the same tokenizer, which proposes its own greedy continuation. The "
           "proposals are checked in one step, so the output is what decoding without them gives. "
           "ngram pays where the reply copies from the prompt, a draft model where it guesses well",
           rule="none, ngram or a registered model's name",
           valid=lambda v: isinstance(v, str) and bool(v.strip())),
    Option("draft_tokens", int, 5,
           "Most tokens a draft proposes a step (default {default}; also capped by the model's chunk)",
           rule="between 1 and 32", valid=lambda v: _integer(v) and 1 <= v <= 32),
    Option("stop", str | list[str], (),
           "Stop when this text appears (a string, or a JSON list of strings); not printed",
           rule="a string or a JSON list of non-empty strings", valid=_stop_valid, parse=_stop_strings),
    Option("chat", str, "auto",
           "Chat template: auto (the tokenizer's own), llama3, gemma, gemma4, or none/0 for raw text",
           choices=("auto", "llama3", "gemma", "gemma4", "none"), aliases={"0": "none"}),
    Option("reasoning", bool, None,
           "Whether a reasoning model thinks before it answers (its <think> text streams as reasoning): "
           "true or false sets its chat template's enable_thinking (default: the template's own)",
           rule="true or false", valid=lambda v: isinstance(v, bool)),
    Option("tool_choice", str, "auto",
           "With tools: auto (default; the model decides), required (the reply is a call of one of "
           "them) or a tool's name (a call of that one); a forced reply is constrained to the call's "
           "syntax and the tool's schema, the reply after the tool's result is not",
           rule="auto, required or a tool's name", valid=lambda v: isinstance(v, str) and bool(v.strip())),
    Option("kv_max_capacity", int, None,
           "Tokens the KV cache may hold (default: the model's max context)",
           rule=">= 1", valid=lambda v: _integer(v) and v >= 1),
    Option("kv_storage_dtype", str, None,
           "KV cache storage dtype: bf16, fp16, fp32, or int8/int4 (quantized in groups along each head, "
           "about 0.53x/0.28x of fp16's bytes; the accuracy in docs/design.md) (default: the dtype the "
           "model computes in; on a CPU fp16 where that is fp32); the keys', and the values' unless kv_value_dtype "
           "says otherwise",
           choices=("bf16", "fp16", "fp32", "int8", "int4")),
    Option("kv_value_dtype", str, None,
           "The values' storage dtype, when it differs from the keys' (kv_storage_dtype): bf16, fp16, "
           "fp32, int8 or int4; e.g. int8 keys with int4 values",
           choices=("bf16", "fp16", "fp32", "int8", "int4")),
    Option("compute_dtype", str, "auto",
           "How bf16/fp16 models compute: auto (default: fp32 on a CPU, where it is several times "
           "faster; the file's dtype on a GPU), native or fp32",
           choices=("auto", "native", "fp32")),
    Option("int8_activations", bool, True,
           "4/8-bit models on an x86 CPU: round activations to int8 per group (as llama.cpp's Q8_0) "
           "for integer products, about twice the prompt speed (default {default}); false keeps them "
           "within 2^-16 of their own value",
           rule="true or false", valid=lambda v: isinstance(v, bool)),
    Option("bf16_activations", bool, True,
           "bf16 models on a CPU with AVX512_BF16: round activations to bf16 (as llama.cpp does) for "
           "bf16 dot products, about twice the prompt speed (default {default}); false keeps them in fp32",
           rule="true or false", valid=lambda v: isinstance(v, bool)),
    Option("kv_initial_capacity", int, None,
           "Slots each full-attention layer starts with; pools double up to the capacity (default 512)",
           rule=">= 0", valid=lambda v: _integer(v) and v >= 0),
    Option("kv_windows", str, None,
           "Attention windows replacing the model's own, repeating over layers: "
           "'512' all sliding, '512,0' alternating, '0' all full",
           rule="comma-separated non-negative integers, e.g. 512 or 512,0", valid=_windows),
    Option("kv_disk_mb", float, 256,
           "MB of KV cache states kept on disk, so a new process (llm -c, a repeated system prompt) "
           "starts warm; least recently used dropped first (default {default}; 0 = off)",
           rule=">= 0 (0 turns it off)", valid=lambda v: _number(v) and v >= 0),
    Option("kv_overflow", str, "truncate",
           "When a conversation outgrows the cache: truncate (default; drop the oldest turns, "
           "keep the system prompt) or error",
           choices=("truncate", "error")),
)

OPTIONS: dict[str, Option] = {o.name: o for o in _DECLARED}  # in the order llm shows them
DEFAULTS: dict[str, Any] = {o.name: o.default for o in _DECLARED}
