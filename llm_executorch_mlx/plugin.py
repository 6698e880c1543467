"""The llm Model for registered .pte files: options, execute, usage."""

from __future__ import annotations

import sys
from typing import Optional, Union

import llm
from pydantic import Field, field_validator

from .registry import Entry

KV_DTYPES = ("bf16", "fp16", "fp32")
OVERFLOW = ("truncate", "error")
TEMPLATE_NAMES = ("auto", "llama3", "gemma", "gemma4", "none", "0")
COMPUTE_ROUTES = ("auto", "native", "fp32")  # runtime.dtypes.COMPUTE_ROUTES, without importing mlx
# Options whose value must be one of a few names.
CHOICES = {
    "kv_storage_dtype": KV_DTYPES, "kv_overflow": OVERFLOW, "chat": TEMPLATE_NAMES,
    "compute_dtype": COMPUTE_ROUTES,
}


class PteModel(llm.Model):
    can_stream = True

    class Options(llm.Options):
        max_tokens: Optional[int] = Field(
            None, ge=1, description="Most tokens to generate (default 256; also capped by the room left in the cache)"
        )
        temperature: Optional[float] = Field(
            None, ge=0, description="Sampling temperature; 0 (default) is greedy and reproducible"
        )
        top_p: Optional[float] = Field(None, gt=0, le=1, description="Nucleus sampling: keep the top tokens with this total probability (0 < p <= 1)")
        top_k: Optional[int] = Field(None, ge=0, description="Sample among the k most likely tokens (0 = all)")
        min_p: Optional[float] = Field(None, ge=0, lt=1, description="Drop tokens less likely than min_p times the top token (0 <= p < 1)")
        repetition_penalty: Optional[float] = Field(None, gt=0, description="Penalise tokens seen in the last 64 (1 = off, > 1 discourages repeats)")
        seed: Optional[int] = Field(None, description="Random seed for sampling, for reproducible runs at temperature > 0")
        stop: Optional[Union[str, list[str]]] = Field(
            None, description="Stop when this text appears (a string, or a JSON list of strings); not printed"
        )
        chat: Optional[str] = Field(
            None, description="Chat template: auto (the tokenizer's own), llama3, gemma, gemma4, or none/0 for raw text"
        )
        kv_max_capacity: Optional[int] = Field(
            None, ge=1, description="Tokens the KV cache may hold (default: the model's max context)"
        )
        kv_storage_dtype: Optional[str] = Field(
            None, description="KV cache storage dtype: bf16, fp16 or fp32 (default: the dtype the model computes in)"
        )
        compute_dtype: Optional[str] = Field(
            None, description="How bf16/fp16 models compute: auto (default: fp32 on a CPU, where it is several times faster; the file's dtype on a GPU), native or fp32"
        )
        kv_initial_capacity: Optional[int] = Field(
            None, ge=0, description="Slots each full-attention layer starts with; pools double up to the capacity (default 512)"
        )
        kv_windows: Optional[str] = Field(
            None, description="Attention windows replacing the model's own, repeating over layers: '512' all sliding, '512,0' alternating, '0' all full"
        )
        kv_overflow: Optional[str] = Field(
            None, description="When a conversation outgrows the cache: truncate (default; drop the oldest turns, keep the system prompt) or error"
        )

        @field_validator(*CHOICES)
        @classmethod
        def _one_of(cls, v, info):
            allowed = CHOICES[info.field_name]
            if v is not None and v not in allowed:
                raise ValueError(f"{info.field_name} must be one of {', '.join(allowed)}")
            return v

        @field_validator("kv_windows")
        @classmethod
        def _windows(cls, v):
            if v is not None:
                fields = str(v).split(",")
                if not all(f.strip().isdigit() for f in fields):
                    raise ValueError("kv_windows must be comma-separated non-negative integers, e.g. 512 or 512,0")
            return v

        @field_validator("stop")
        @classmethod
        def _stop(cls, v):
            if isinstance(v, str) and v.startswith("["):
                import json

                try:
                    v = json.loads(v)
                except ValueError:
                    raise ValueError("stop must be a string or a JSON list of strings") from None
            if isinstance(v, list) and not all(isinstance(s, str) and s for s in v):
                raise ValueError("stop must be a string or a JSON list of non-empty strings")
            return v

    def __init__(self, entry: Entry):
        self.entry = entry
        self.model_id = entry.model_id

    def execute(self, prompt, stream, response, conversation):
        from .mlx_backend import MlxBackendError, require

        try:
            require()
        except MlxBackendError as e:
            raise llm.ModelError(str(e)) from None
        from .runtime.errors import PteError
        from .text.conversation import messages_from_llm
        from .text.errors import TextError
        from .text.turn import Turn, TurnOptions

        o = prompt.options
        stop = o.stop if isinstance(o.stop, list) else ([o.stop] if o.stop else [])
        given = {k: v for k, v in o.model_dump().items() if v is not None and k != "stop"}
        given.setdefault("chat", self.entry.chat)
        try:
            turn = Turn(
                self.entry.path,
                self.entry.tokenizer,
                messages_from_llm(prompt.messages),
                TurnOptions(stop=stop, **given),
            )
            _advise_on_blas_once()
            yield from turn
        except (PteError, TextError) as e:
            raise llm.ModelError(str(e)) from None
        r = turn.result
        response.set_usage(input=r.prompt_tokens, output=r.output_tokens, details={"cached": r.cached_tokens})
        response.response_json = r.stats


def _advise_on_blas_once() -> None:
    """Tell a CPU user once (per llm user dir and message) that MLX runs on
    its slow reference BLAS, and how to fix it (runtime/cpu/blas.py)."""
    from .runtime.cpu import blas
    from .runtime.dtypes import on_cpu

    advice = blas.load_fast_blas().advice
    if advice is None or not on_cpu():
        return
    marker = llm.user_dir() / "executorch-mlx-blas-advice.txt"
    try:
        if marker.read_text() == advice:
            return
    except OSError:
        pass
    print(f"note: {advice}", file=sys.stderr)
    marker.write_text(advice)
