"""The engines the benchmarks time side by side on the same weights.

- ``Ours``: our runtime through ``generate_tokens``, the decode loop the
  ``llm`` plugin runs, with its greedy ``Sampler``;
- ``MlxLm``: mlx-lm's ``generate_step`` on the Hugging Face weights;
- ``LlamaCpp``: llama.cpp through llama-cpp-python, greedy on the host;
- ``IkLlamaBench``: ik_llama.cpp, a fork of llama.cpp tuned for CPUs,
  through its own ``llama-bench`` built from source (no Python binding).

Each has ``run(prompt, new_tokens)``: a greedy generation from an empty
cache, timed by ``timing.timed``; and ``short(history, chunk)``: a few new
tokens fed after a history already in the cache (untimed), timed to the
first token, as a chat turn's new message is. Each also says what one decode
step reads: ``step_weight_bytes`` and ``kv_bytes_per_token``.
"""

from __future__ import annotations

import contextlib
import json
import os
import pathlib
import sys
from dataclasses import asdict

import numpy as np

from .models import kv_bytes_per_token, model_shape
from .timing import Run, timed

# llama.cpp's cache types (``--kv``; "K/V" for two): GGML type, our storage of
# the same width (kv_storage.py), bytes a value takes in it
LLAMA_KV_TYPES = {"f32": (0, "fp32", 4), "f16": (1, "fp16", 2), "q8_0": (8, "int8", 34 / 32),
                  "q4_0": (2, "int4", 18 / 32)}


def kv_pair(kv: str) -> tuple[str, str]:
    """The key and value types of an ``LLAMA_KV_TYPES`` name or of "K/V"."""
    keys, _, values = kv.partition("/")
    return keys, values or keys


def mlx_dtype(name: str):
    """The MLX dtype of "fp32", "bf16" or "fp16"."""
    import mlx.core as mx

    return {"fp32": mx.float32, "bf16": mx.bfloat16, "fp16": mx.float16}[name]


class Ours:
    """Our runtime through ``generate_tokens``, as the plugin drives it, on
    one compute route (``load_program(compute=...)``), a fresh off-graph cache
    per run in ``kv_dtype`` (default: the plugin's, the dtype activations
    compute in)."""

    def __init__(self, pte: pathlib.Path, compute: str = "auto", name: str = "ours",
                 int8_activations: bool = True, kv_dtype: str | None = None, bf16_activations: bool = True,
                 kv_value_dtype: str | None = None, gpu_kernels: bool = True, compiled_steps: bool = True):
        from llm_executorch_mlx.runtime import load_program
        from llm_executorch_mlx.text.sampling import Sampler

        self.name = name
        self.route = compute
        # chosen when a method is loaded: a CUDA GPU's decode-step kernels
        # (runtime/gpu/decode.py), short steps' compiled runs (interp/compiled_runs.py)
        self.flags = {"LLM_PTE_GPU_KERNELS": "1" if gpu_kernels else "0",
                      "LLM_PTE_COMPILED_STEPS": "1" if compiled_steps else "0"}
        self.program = load_program(pte, compute=compute, int8_activations=int8_activations,
                                    bf16_activations=bf16_activations)
        self.program.prepare_cpu_kernels()  # as the plugin does before a generation
        self.compute_dtype = self.program.compute_dtype
        self.sampler = Sampler(temperature=0.0)
        self.last_timings = None
        self._session = None  # (cache, forward) of the short case's conversation
        self.kv_dtype, self.kv_value_dtype = kv_dtype, kv_value_dtype
        cache = self.new_cache()
        self.kv_dtype = cache.dtype
        self.weight_bytes = self.program.weight_bytes()  # as held after the compute route
        # A quantized file's scales are held twice (as stored, and in the
        # layout of the CPU's products) but a step reads the second copy only.
        self.program.load_method("forward", cache=cache)
        self.step_weight_bytes = self.program.read_bytes("forward")
        self.kv_bytes_per_token = cache.bytes_per_token()

    @property
    def compute(self) -> str:
        stored = self.program.metadata.activation_dtype
        if self.compute_dtype != stored:
            return f"{self.compute_dtype} ({self.route}: widened from {stored})"
        return f"{stored} ({'native' if self.route == 'native' else 'as stored'})"

    def new_cache(self):
        """A cache of the program's whole context."""
        return self.program.new_cache(capacity=self.program.metadata.max_context, dtype=self.kv_dtype,
                                      value_dtype=self.kv_value_dtype)

    def info(self) -> dict:
        kernels = self.program.cpu_kernels
        return {
            "cpu_attention_kernel": "in use" if kernels.attention.on else kernels.attention.why,
            "cpu_products": "in use" if kernels.products.on else kernels.products.why,
            "compute_route": self.route,
            "compute_dtype": self.compute_dtype,
            "stored_dtype": self.program.metadata.activation_dtype,
            "weight_bytes_as_stored": self.step_weight_bytes,
        }

    def _greedy(self, logits, history):
        return self.sampler.sample(logits)

    def run(self, prompt: list[int], new_tokens: int) -> Run:
        import mlx.core as mx
        from llm_executorch_mlx.text.generate import Timings, generate_tokens

        cache = self.new_cache()
        with _flags(self.flags):
            forward = self.program.load_method("forward", cache=cache)
        self.last_timings = Timings()
        steps = generate_tokens(
            forward, cache, prompt, 0, self.program.metadata.prefill_chunk, self._greedy, new_tokens,
            self.last_timings,
        )
        run = timed((step.token for step in steps), len(prompt), mx.default_stream(mx.default_device()))
        run.plugin_timings = asdict(self.last_timings)
        return run

    def short(self, history: list[int], chunk: list[int]) -> Run:
        """As a chat turn in a conversation the plugin holds: its session's
        cache and loaded method are kept from turn to turn (llama.cpp's
        context is, too); the cache is cleared and the history fed untimed."""
        import mlx.core as mx
        from llm_executorch_mlx.text.generate import Timings, generate_tokens

        meta = self.program.metadata
        if self._session is None:
            cache = self.new_cache()
            with _flags(self.flags):
                self._session = cache, self.program.load_method("forward", cache=cache)
        cache, forward = self._session
        cache.clear()
        for _ in generate_tokens(forward, cache, history, 0, meta.prefill_chunk, self._greedy, 1, Timings()):
            pass  # one token: the history is fed, the token it yields is not
        steps = generate_tokens(forward, cache, history + chunk, len(history), meta.prefill_chunk, self._greedy,
                                2, Timings())
        return timed((s.token for s in steps), len(chunk), mx.default_stream(mx.default_device()))


@contextlib.contextmanager
def _flags(values: dict[str, str]):
    """The runtime's environment flags set to ``values`` while a method is loaded."""
    before = {name: os.environ.get(name) for name in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for name, value in before.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def load_mlx_lm(model_dir: pathlib.Path, dtype: str):
    """mlx-lm's model of ``model_dir``, its weights cast to ``dtype`` (an
    mlx-lm quantized checkpoint, as ``gpu_model.py`` writes, keeps its packed
    weights; its scales and biases are cast)."""
    import mlx.core as mx
    from mlx_lm.utils import load_model

    model, _ = load_model(model_dir)
    model.set_dtype(mlx_dtype(dtype))
    mx.eval(model.parameters())
    return model


class MlxLm:
    """mlx-lm's ``generate_step`` on the Hugging Face weights cast to
    ``dtype``, with our prefill chunk as its prefill step and a fresh prompt
    cache per run; with ``bits``, quantized by mlx-lm's ``quantize_model`` in
    groups of ``group_size``."""

    name = "mlx-lm"

    def __init__(self, model_dir: pathlib.Path, dtype: str, prefill_chunk: int, bits: int | None = None,
                 group_size: int | None = None):
        import mlx.core as mx
        from mlx.utils import tree_flatten

        self.model = load_mlx_lm(model_dir, dtype)
        if bits:
            from mlx_lm.utils import quantize_model

            with contextlib.redirect_stdout(sys.stderr):  # its bits-per-weight line; stdout is the report's
                self.model, _ = quantize_model(self.model, {}, group_size, bits)
            mx.eval(self.model.parameters())
        self.prefill_chunk = prefill_chunk
        quant = json.loads((model_dir / "config.json").read_text()).get("quantization")  # a quantized checkpoint
        self.compute = dtype if quant is None else f"{dtype}, {quant['bits']}-bit weights (group {quant['group_size']})"
        self.kv_dtype = dtype  # its KVCache stores keys/values as the model computes them
        self.weight_bytes = sum(v.nbytes for _, v in tree_flatten(self.model.parameters()))
        self.step_weight_bytes = self.weight_bytes
        self.kv_bytes_per_token = kv_bytes_per_token(model_shape(model_dir), dtype)

    def info(self) -> dict:
        return {}

    def run(self, prompt: list[int], new_tokens: int) -> Run:
        import mlx.core as mx
        from mlx_lm.generate import generate_step, generation_stream

        steps = generate_step(
            mx.array(prompt), self.model, max_tokens=new_tokens, prefill_step_size=self.prefill_chunk,
        )
        return timed((token for token, _ in steps), len(prompt), generation_stream)

    def short(self, history: list[int], chunk: list[int]) -> Run:
        import mlx.core as mx
        from mlx_lm.generate import generate_step, generation_stream
        from mlx_lm.models.cache import make_prompt_cache

        cache = make_prompt_cache(self.model)
        mx.eval(self.model(mx.array(history)[None], cache=cache))
        mx.eval([c.state for c in cache])
        steps = generate_step(mx.array(chunk), self.model, max_tokens=2, prefill_step_size=self.prefill_chunk,
                              prompt_cache=cache)
        return timed((token for token, _ in steps), len(chunk), generation_stream)


@contextlib.contextmanager
def llama_model_params(**fields):
    """Set fields of the model params llama-cpp-python's ``Llama`` starts from
    (its constructor does not take ``use_extra_bufts``)."""
    import llama_cpp.llama_cpp as low

    default = low.llama_model_default_params

    def patched():
        params = default()
        for name, value in fields.items():
            setattr(params, name, value)
        return params

    low.llama_model_default_params = patched
    try:
        yield
    finally:
        low.llama_model_default_params = default


class LlamaCpp:
    """llama.cpp through llama-cpp-python's ``Llama.eval`` (batches of
    ``n_batch`` = ``n_ubatch`` = ``chunk``), greedy: the argmax of the last
    logits row. ``kv`` is a key of ``LLAMA_KV_TYPES`` or "K/V" of two;
    ``extra_bufts`` False runs it without its extra buffer types (repacked
    weights); ``flash_attn`` runs its flash attention, which a quantized
    value cache needs."""

    def __init__(self, gguf: pathlib.Path, ftype: str, ctx: int, chunk: int, threads: int, kv: str,
                 extra_bufts: bool, model_dir: pathlib.Path, flash_attn: bool = False):
        import llama_cpp

        self._logits_ith = llama_cpp.llama_get_logits_ith
        self.name = f"llama.cpp {ftype}"
        keys, values = (LLAMA_KV_TYPES[t] for t in kv_pair(kv))
        with llama_model_params(use_extra_bufts=extra_bufts):
            self.llm = llama_cpp.Llama(
                model_path=str(gguf), n_ctx=ctx, n_batch=chunk, n_ubatch=chunk, n_threads=threads,
                n_threads_batch=threads, type_k=keys[0], type_v=values[0], flash_attn=flash_attn, verbose=False,
            )
        self.n_vocab = self.llm.n_vocab()
        self.weight_bytes = llama_cpp.llama_model_size(self.llm.model)
        self.step_weight_bytes = self.weight_bytes  # a GGUF holds a tied embedding once
        shape = model_shape(model_dir)
        self.kv_bytes_per_token = round(kv_bytes_per_token(shape, "fp32") * (keys[2] + values[2]) / 8)

    def tokens(self, ids: list[int], new_tokens: int):
        """Feed ``ids`` after what the context holds, then yield greedy tokens."""
        self.llm.eval(ids)
        for produced in range(1, new_tokens + 1):
            row = np.ctypeslib.as_array(self._logits_ith(self.llm.ctx, -1), shape=(self.n_vocab,))
            token = int(row.argmax())
            yield token
            if produced < new_tokens:
                self.llm.eval([token])

    def run(self, prompt: list[int], new_tokens: int) -> Run:
        self.llm.reset()  # the next eval drops the cache past position 0
        return timed(self.tokens(prompt, new_tokens), len(prompt))

    def short(self, history: list[int], chunk: list[int]) -> Run:
        self.llm.reset()
        self.llm.eval(history)
        return timed(self.tokens(chunk, 2), len(chunk))


class IkLlamaBench:
    """ik_llama.cpp's ``llama-bench`` (``binary``, built from its source) on
    ``gguf``, its weights repacked at load for its CPU kernels (``-rtr 1``),
    one repetition a call: ``run`` is its prompt test (``-p``, prefill from an
    empty cache) and its ``-gp`` test (``new_tokens`` generated after a prompt
    of the same length), its flash attention on (its default) and an f16 KV
    cache. It feeds its own token ids and returns none, so its greedy tokens
    are not compared, and it has no prompt after a history: ``short`` is
    not measured (NaN)."""

    def __init__(self, binary: pathlib.Path, gguf: pathlib.Path, ftype: str, chunk: int, threads: int,
                 model_dir: pathlib.Path):
        self.name = f"ik_llama.cpp {ftype}"
        self.command = [str(binary), "-m", str(gguf), "-t", str(threads), "-b", str(chunk), "-ub", str(chunk),
                        "-rtr", "1", "-r", "1", "-n", "0", "-o", "json"]
        self.weight_bytes = self.step_weight_bytes = gguf.stat().st_size
        self.kv_bytes_per_token = round(kv_bytes_per_token(model_shape(model_dir), "fp32") / 2)  # f16

    def run(self, prompt: list[int], new_tokens: int) -> Run:
        import subprocess

        n = len(prompt)
        done = subprocess.run([*self.command, "-p", str(n), "-gp", f"{n},{new_tokens}"], capture_output=True,
                              text=True)
        if done.returncode != 0:
            raise RuntimeError(f"{self.command[0]} failed: {done.stderr[-1000:]}")
        tests = json.loads(done.stdout)
        prefill = next(t["avg_ts"] for t in tests if t["n_gen"] == 0)
        decode = next(t["avg_ts"] for t in tests if t["n_gen"] == new_tokens)
        return Run(prefill, decode, [])

    def short(self, history: list[int], chunk: list[int]) -> Run:
        return Run(float("nan"), float("nan"), [])
