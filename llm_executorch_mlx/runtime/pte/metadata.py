"""What an LLM .pte publishes about itself, read and cross-checked at load.

Two vocabularies of constant methods exist: the MLX exporter's
(``get_max_ctx_len``, ``get_prefill_chunk_size``, ``get_n_caches``,
``get_kv_heads``, ``get_head_dims``, ``get_windows``) and ExecuTorch's LLM
runner's (``get_max_seq_len``, ``get_max_context_len``, ``get_vocab_size``,
``get_bos_id``, ``get_eos_ids``, ``use_kv_cache``, ``enable_dynamic_shape``,
``get_activation_dtype``, ...). Whatever is present is read; what is missing
is derived from the forward method (vocab from the logits shape, chunk from
the token input's bound, activation dtype from the graph).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..dtypes import SCALAR_TYPE_NAMES
from ..errors import PteError

LOGITS_MODES = ("full", "last", "selected")
MAX_GEOMETRY = 1 << 16  # layers, KV heads or head dims beyond any real model's
MAX_POSITIONS = (1 << 31) - 1  # MLX shapes and the graph's positions are int32

_DTYPE_ALIASES = {
    "bf16": "bf16", "bfloat16": "bf16", "torch.bfloat16": "bf16",
    "fp16": "fp16", "float16": "fp16", "half": "fp16", "torch.float16": "fp16",
    "fp32": "fp32", "float32": "fp32", "float": "fp32", "torch.float32": "fp32",
}


@dataclass
class ModelMetadata:
    """Model facts, under our names; ``raw`` keeps every constant method's value."""

    max_context: int | None = None
    prefill_chunk: int | None = None
    vocab_size: int | None = None
    bos_id: int | None = None
    eos_ids: list[int] = field(default_factory=list)
    n_caches: int = 0
    kv_heads: list[int] = field(default_factory=list)
    head_dims: list[int] = field(default_factory=list)
    windows: list[int] = field(default_factory=list)
    activation_dtype: str | None = None  # "bf16" | "fp16" | "fp32"
    logits_mode: str = "full"
    use_kv_cache: bool | None = None
    enable_dynamic_shape: bool | None = None
    raw: dict = field(default_factory=dict)

    @property
    def has_offgraph_cache(self) -> bool:
        return self.n_caches > 0

    def as_dict(self) -> dict:
        """Every fact under both vocabularies' names, for display and scripts."""
        d = {
            "max_context": self.max_context,
            "prefill_chunk": self.prefill_chunk,
            "vocab_size": self.vocab_size,
            "bos_id": self.bos_id,
            "eos_ids": self.eos_ids,
            "n_caches": self.n_caches,
            "kv_heads": self.kv_heads,
            "head_dims": self.head_dims,
            "windows": self.windows,
            "activation_dtype": self.activation_dtype,
            "logits_mode": self.logits_mode,
            # ExecuTorch LLM runner names
            "get_max_context_len": self.max_context,
            "get_max_ctx_len": self.max_context,
            "get_max_seq_len": self.prefill_chunk,
            "get_prefill_chunk_size": self.prefill_chunk,
            "get_vocab_size": self.vocab_size,
            "get_bos_id": self.bos_id,
            "get_eos_ids": self.eos_ids,
            "get_n_caches": self.n_caches,
            "get_kv_heads": self.kv_heads,
            "get_head_dims": self.head_dims,
            "get_windows": self.windows,
            "get_activation_dtype": self.activation_dtype,
            "use_kv_cache": self.use_kv_cache,
            "enable_dynamic_shape": self.enable_dynamic_shape,
        }
        return d


def _int(raw: dict, *names: str) -> int | None:
    for name in names:
        if name in raw and raw[name] is not None:
            value = raw[name]
            if isinstance(value, list) and len(value) == 1:
                value = value[0]
            if isinstance(value, bool) or not isinstance(value, int):
                raise PteError(f"constant method {name} returns {value!r}, expected an int")
            return value
    return None


def _int_list(raw: dict, name: str) -> list[int] | None:
    if name not in raw:
        return None
    value = raw[name]
    if isinstance(value, int) and not isinstance(value, bool):
        return [value]
    if isinstance(value, list) and all(isinstance(v, int) for v in value):
        return list(value)
    raise PteError(f"constant method {name} returns {value!r}, expected a list of ints")


def _dtype_name(value) -> str:
    if isinstance(value, int) and not isinstance(value, bool):
        value = SCALAR_TYPE_NAMES.get(value, str(value))
    name = _DTYPE_ALIASES.get(str(value).lower())
    if name is None:
        raise PteError(
            f"get_activation_dtype says {value!r}; expected bf16, fp16 or fp32"
        )
    return name


def read_metadata(raw: dict, forward) -> ModelMetadata:
    """Build and validate metadata from constant-method values and forward's ABI.

    Args:
        raw: constant method name -> its value (ints, lists, strings).
        forward: a ``ForwardSignature`` (input count, token bound, logits shape
            and dtype, graph activation dtype), or None when there is no forward.
    """
    md = ModelMetadata(raw=dict(raw))
    md.max_context = _int(raw, "get_max_ctx_len", "get_max_context_len")
    md.prefill_chunk = _int(raw, "get_prefill_chunk_size", "get_max_seq_len")
    if md.max_context is None:
        md.max_context = _int(raw, "get_max_seq_len")
    md.vocab_size = _int(raw, "get_vocab_size")
    md.bos_id = _int(raw, "get_bos_id")
    eos = _int_list(raw, "get_eos_ids")
    if eos is None:
        eos = _int_list(raw, "get_eos_id")
    md.eos_ids = eos or []
    for flag in ("use_kv_cache", "enable_dynamic_shape"):
        if flag in raw:
            setattr(md, flag, bool(raw[flag]))

    md.n_caches = _int(raw, "get_n_caches") or 0
    if not 0 <= md.n_caches <= MAX_GEOMETRY:
        raise PteError(f"get_n_caches publishes {md.n_caches}; expected 0..{MAX_GEOMETRY} layers: corrupt file?")
    if md.n_caches:
        md.kv_heads = _per_layer(raw, "get_kv_heads", md.n_caches)
        md.head_dims = _per_layer(raw, "get_head_dims", md.n_caches)
        windows = _int_list(raw, "get_windows")
        md.windows = _per_layer(raw, "get_windows", md.n_caches) if windows is not None else [0] * md.n_caches
        for name, values, lo in (("get_kv_heads", md.kv_heads, 1), ("get_head_dims", md.head_dims, 1), ("get_windows", md.windows, 0)):
            if any(v < lo for v in values):
                raise PteError(f"{name} publishes {values}; each entry must be >= {lo}")
            if name != "get_windows" and any(v > MAX_GEOMETRY for v in values):
                raise PteError(f"{name} publishes {values}; no model has more than {MAX_GEOMETRY}: corrupt file?")
    elif any(k in raw for k in ("get_kv_heads", "get_head_dims", "get_windows")):
        raise PteError("cache geometry is published without get_n_caches; re-export with --use-offgraph-cache")

    if "get_activation_dtype" in raw:
        md.activation_dtype = _dtype_name(raw["get_activation_dtype"])
    if "get_logits_to_keep_mode" in raw:
        mode = raw["get_logits_to_keep_mode"]
        mode = LOGITS_MODES[mode] if isinstance(mode, int) and 0 <= mode < 3 else str(mode).lower()
        if mode not in LOGITS_MODES:
            raise PteError(f"get_logits_to_keep_mode says {raw['get_logits_to_keep_mode']!r}; expected one of {LOGITS_MODES}")
        md.logits_mode = mode

    if forward is not None:
        _check_forward(md, forward)
    if md.max_context is not None and not 0 < md.max_context <= MAX_POSITIONS:
        raise PteError(f"get_max_ctx_len publishes {md.max_context}; it must be 1..{MAX_POSITIONS}")
    if md.prefill_chunk is not None and not 0 < md.prefill_chunk <= MAX_POSITIONS:
        raise PteError(f"the prefill chunk is {md.prefill_chunk}; it must be 1..{MAX_POSITIONS}")
    if any(w > MAX_POSITIONS for w in md.windows):
        raise PteError(f"get_windows publishes {md.windows}; a window is at most {MAX_POSITIONS} positions")
    return md


def _per_layer(raw: dict, name: str, n: int) -> list[int]:
    values = _int_list(raw, name)
    if values is None:
        raise PteError(f"the file publishes get_n_caches={n} but no {name}; re-export with --use-offgraph-cache")
    if len(values) == 1 and n > 1:
        values = values * n
    if len(values) != n:
        raise PteError(f"{name} has {len(values)} entries for get_n_caches={n}")
    return values


@dataclass
class ForwardSignature:
    """The parts of forward's ABI an LLM runner relies on."""

    n_inputs: int
    token_bound: int | None  # upper bound of the token axis (None = unbounded)
    logits_shape: tuple[int, ...]  # upper-bound sizes
    logits_dtype: str  # SCALAR_TYPE_NAMES name
    graph_dtype: str | None  # the attention compute dtype seen in the graph


def _check_forward(md: ModelMetadata, sig: ForwardSignature) -> None:
    if "get_logits_to_keep_mode" not in md.raw and sig.n_inputs == 3:
        md.logits_mode = "selected"
    expected = 3 if md.logits_mode == "selected" else 2
    if sig.n_inputs != expected:
        raise PteError(
            f"forward takes {sig.n_inputs} inputs, but its logits mode "
            f"'{md.logits_mode}' needs {expected} (tokens, positions"
            f"{', row to keep' if expected == 3 else ''})"
        )
    if len(sig.logits_shape) < 2 or sig.logits_shape[-1] <= 0:
        raise PteError(f"forward's logits have shape {sig.logits_shape}; expected [..., vocab]")
    if sig.logits_dtype not in ("fp32", "fp16", "bf16", "uint16"):
        raise PteError(f"forward's logits are {sig.logits_dtype}; a sampler needs fp32, fp16, bf16 or uint16")
    vocab = sig.logits_shape[-1]
    if md.vocab_size is not None and md.vocab_size != vocab:
        raise PteError(
            f"get_vocab_size says {md.vocab_size} but forward's logits have {vocab} columns"
        )
    md.vocab_size = vocab
    if md.prefill_chunk is None:
        md.prefill_chunk = sig.token_bound
    elif sig.token_bound is not None and md.prefill_chunk > sig.token_bound:
        raise PteError(
            f"the prefill chunk is {md.prefill_chunk} but forward accepts at most "
            f"{sig.token_bound} tokens per call"
        )
    if md.activation_dtype is None and sig.graph_dtype is not None:
        md.activation_dtype = sig.graph_dtype
    if md.max_context is not None and md.prefill_chunk is not None and md.prefill_chunk > md.max_context:
        raise PteError(
            f"the prefill chunk ({md.prefill_chunk}) is larger than the max context ({md.max_context})"
        )
