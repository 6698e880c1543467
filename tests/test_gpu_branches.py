"""The runtime's GPU branches, run on MLX's CPU device, against transformers.

Where MLX computes is read once per decision from ``dtypes.on_cpu()``; off
the CPU the runtime takes other paths: ``mx.fast.scaled_dot_product_attention``
for the cache's attention (``interp/ops/attention.py``), ``mx.fast.rms_norm``
(``ops/nn.py``), ``mx.fast.rope`` for the fused rotate-half RoPE and the
compiled ``_swiglu`` (``interp/fusion.py``), MLX's ``quantized_matmul`` for
every quantized product (``ops/quant.py``), no CPU kernels
(``cpu/selection.py``), and half-precision files computing in their own dtype
(``compute="auto"`` is ``native``, ``dtypes.py``). Here ``on_cpu`` answers
False in every module that reads it, MLX still runs on the CPU, and the CPU
branches raise if reached; so these check our side of those paths (which
ops, their arguments, masks, dtypes and casts) whole, through a model and
through the plugin.

A CUDA GPU also groups a decode step's linear layers with the ops around
them into one kernel each (``interp/decode_blocks.py``); here the groups run
as ``decode.MlxOps`` (the kernels' contract in MLX's ops), which checks the
grouping: which nodes a group takes, which outputs it writes where, and that
a prefill chunk takes each node's own route. The kernels themselves are
checked against ``MlxOps`` on a GPU: ``benchmarks/gpu_decode_kernels.py``.

What truly needs CUDA or Metal and is not run here: MLX's GPU kernels
behind those same calls (its fused attention, RoPE and norm kernels, whose
rounding differs from the CPU fallbacks run here), MLX's GPU scheduling
(command buffers, CUDA graphs), Metal-only nodes (``MetalKernelNode``) and
GPU memory. The device run for those is ``benchmarks/gpu_model.py`` with
``bench_decode.py`` (benchmarks/README.md, "The GPU table"): a real-sized
model on a GPU against mlx-lm on the same weights, its speed and how many
greedy tokens the two share.
"""

import collections
import sys

import llm
import mlx.core as mx
import models
import pytest
import torch
from click.testing import CliRunner
from llm.cli import cli
from models import make_tokenizer
from test_parity import (BF16_REL_TOL, NEW_TOKENS, PROMPT_LEN, Q4_REL_TOL, assert_close_where_decisive, greedy,
                         prompt_for, reference_logits)

from llm_executorch_mlx.runtime import dtypes, load_program
from llm_executorch_mlx.runtime import plan as plan_module
from llm_executorch_mlx.runtime import steps as steps_module
from llm_executorch_mlx.runtime.cpu import extension_ops, fastmath
from llm_executorch_mlx.runtime.gpu import attention, decode
from llm_executorch_mlx.runtime.interp import compiled_runs, fusion
from llm_executorch_mlx.text import generate, store


def cpu_branch(name):
    def reached(*args, **kwargs):
        raise AssertionError(f"the CPU branch {name} ran")

    return reached


@pytest.fixture
def calls(monkeypatch):
    """Every module of the package sees a GPU; counts of the GPU calls made.
    Programs and sessions the plugin loaded meanwhile hold a GPU's choices:
    none outlives the test."""
    forget_loaded_programs()
    monkeypatch.setenv("LLM_PTE_COMPILED_STEPS", "0")  # counted: the calls each step makes from Python
    yield from _seeing_a_gpu(monkeypatch)
    forget_loaded_programs()


def forget_loaded_programs():
    store.POOL.clear()
    store._programs.clear()
    store.REPLIES.clear()


def _seeing_a_gpu(monkeypatch):
    real, off_cpu = dtypes.on_cpu, lambda: False  # noqa: E731
    for name, module in list(sys.modules.items()):
        if name.startswith("llm_executorch_mlx") and getattr(module, "on_cpu", None) is real:
            monkeypatch.setattr(module, "on_cpu", off_cpu)  # dtypes and every module that imported it
    for name in ("attention", "rms_norm", "swiglu"):
        monkeypatch.setattr(fastmath, name, cpu_branch(f"fastmath.{name}"))
    for name in ("attention", "rms_norm", "swiglu", "update_and_attend", "quantized_attention",
                 "quantized_update_and_attend"):
        monkeypatch.setattr(extension_ops, name, cpu_branch(f"extension_ops.{name}"))
    monkeypatch.setattr(fusion, "_RopeTables", cpu_branch("_RopeTables"))
    counts = {}

    def counted(owner, attr, key):
        real = getattr(owner, attr)

        def call(*args, **kwargs):
            counts[key] = counts.get(key, 0) + 1
            return real(*args, **kwargs)

        monkeypatch.setattr(owner, attr, call)

    counted(mx.fast, "scaled_dot_product_attention", "sdpa")
    counted(mx.fast, "rms_norm", "rms_norm")
    counted(mx.fast, "rope", "rope")
    counted(plan_module, "_compiled_swiglu", "swiglu")
    counted(mx, "quantized_matmul", "quantized_matmul")
    yield counts


def forward_calls(program):
    chunk = program.metadata.prefill_chunk
    return -(-PROMPT_LEN // chunk) + NEW_TOKENS


@pytest.mark.parametrize("arch", ["llama", "qwen3", "gemma3"])
def test_fp32_logits_match_transformers(exported, calls, arch):
    model_dir, pte = exported(arch)
    program = load_program(pte)
    assert program.compute_dtype == "fp32"
    assert not program.prepare_cpu_kernels().attention.on and not program.cpu_kernels.products.on
    tokens, ours = greedy(pte, prompt_for(), NEW_TOKENS, kv_dtype="fp32")
    ref = reference_logits(model_dir, tokens[:-1])
    scale = abs(ref).max()
    err = abs(ours[:-1] - ref).max()
    assert err <= 1e-4 * scale, f"max abs error {err} vs logit scale {scale}"
    assert tokens[PROMPT_LEN:] == ref[PROMPT_LEN - 1 :].argmax(-1).tolist()
    n, layers = forward_calls(program), program.metadata.n_caches
    assert calls["sdpa"] == n * layers and calls["rope"] == 2 * n * layers
    assert calls["rms_norm"] >= n * (2 * layers + 1)  # before attention and MLP, and the last
    assert calls.get("swiglu", 0) == (0 if arch == "gemma3" else n * layers)  # gemma gates with gelu


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_bf16_files_compute_in_bf16_and_match_transformers_bf16(exported, calls, arch):
    """A GPU's default route for a half-precision file: its own dtype, and a
    cache stored in it."""
    model_dir, pte = exported(arch, trained=True, dtype="bf16")
    program = load_program(pte, compute="auto")
    assert program.compute_dtype == "bf16"
    assert program.new_cache(capacity=8).dtype == "bf16"
    tokens, ours = greedy(pte, prompt_for(1), NEW_TOKENS, compute="auto")
    ref = reference_logits(model_dir, tokens[:-1], dtype=torch.bfloat16)
    assert_close_where_decisive(tokens, ours[:-1], ref, BF16_REL_TOL)
    assert calls["sdpa"] and calls["rms_norm"] and calls["rope"]


def test_4bit_linears_run_as_mlx_quantized_matmul_and_match_torchao(exported, calls):
    model_dir, pte = exported("llama", trained=True, dtype="fp32", qlinear="4w")
    tokens, ours = greedy(pte, prompt_for(2), NEW_TOKENS, kv_dtype="fp32")
    ref = reference_logits(model_dir, tokens[:-1], quantize="4w")
    assert_close_where_decisive(tokens, ours[:-1], ref, Q4_REL_TOL)
    assert calls["quantized_matmul"] >= 7 * 2 * NEW_TOKENS  # q, k, v, o, gate, up, down per layer


def test_the_plugin_answers_as_transformers_does(exported, calls, tmp_path, monkeypatch):
    monkeypatch.setenv("LLM_USER_PATH", str(tmp_path / "llm"))
    model_dir, pte = exported("llama")
    tok = make_tokenizer(tmp_path / "tok")
    runner = CliRunner()
    r = runner.invoke(cli, ["pte", "register", str(pte), "--tokenizer", str(tok), "--name", "tiny"],
                      catch_exceptions=False)
    assert r.exit_code == 0, r.output
    info = runner.invoke(cli, ["pte", "info", "tiny"], catch_exceptions=False).output
    assert "attention:" not in info and "BLAS" not in info  # no CPU kernels are described off the CPU
    prompt = "Why is the sky blue?"
    _, expected = models.hf_greedy(tok.parent, model_dir, [{"role": "user", "content": prompt}], 12)
    r = runner.invoke(cli, ["-m", "pte:tiny", prompt, "-o", "max_tokens", "12", "--no-log"], catch_exceptions=False)
    assert r.exit_code == 0, r.output
    assert r.stdout.rstrip("\n") == expected
    conversation = llm.get_model("pte:tiny").conversation()
    conversation.prompt(prompt, max_tokens=6).text()
    second = conversation.prompt("Tell me a story", max_tokens=6)
    second.text()
    assert second.response_json["cache_path"] == "hit"
    assert calls["sdpa"] and calls["swiglu"]


def test_a_cuda_gpu_runs_the_decode_kernels_unless_turned_off(monkeypatch):
    """A CUDA GPU runs the decode kernels, their few-row products on tensor
    cores only where asked and the GPU has them (their rows round otherwise
    than one-token steps)."""
    for flag in (decode.KERNELS_FLAG, decode.TENSOR_CORES_FLAG):
        monkeypatch.delenv(flag, raising=False)
    monkeypatch.setattr(mx.cuda, "is_available", lambda: False)
    assert decode.for_device() is None  # no CUDA GPU: MLX's own ops
    monkeypatch.setattr(mx.cuda, "is_available", lambda: True)
    monkeypatch.setattr(decode, "tensor_cores_here", lambda: True)
    assert isinstance(decode.for_device(), decode.CudaKernels) and not decode.for_device().tensor_cores
    monkeypatch.setenv(decode.TENSOR_CORES_FLAG, "1")
    assert decode.for_device().tensor_cores
    monkeypatch.setattr(decode, "tensor_cores_here", lambda: False)  # before sm_80
    assert not decode.for_device().tensor_cores
    monkeypatch.setenv(decode.KERNELS_FLAG, "0")
    assert decode.for_device() is None


def _greedy_queued_on_build(exported, monkeypatch, submit, wait, around):
    """Greedy tokens from a prompt of two chunks with a GPU's step queue
    (``ON_BUILD``) made of ``submit`` and ``wait``, each forward call passed
    through ``around(execute, inputs, last_position_only)``; they must be
    transformers' greedy tokens. Returns the program and the prompt's length."""
    model_dir, pte = exported("llama")
    monkeypatch.setattr(plan_module, "ON_BUILD", steps_module.Steps(submit, wait, True))
    program = load_program(pte)
    cache = program.new_cache(capacity=128, dtype="fp32")
    forward = program.load_method("forward", cache=cache)
    execute = forward.execute
    forward.execute = lambda inputs, last_position_only=False: around(execute, inputs, last_position_only)
    prompt = prompt_for()
    steps = generate.generate_tokens(forward, cache, prompt, 0, program.metadata.prefill_chunk,
                                     lambda logits, history: mx.argmax(logits, axis=-1), NEW_TOKENS, generate.Timings())
    tokens = [s.token for s in steps]
    ref = reference_logits(model_dir, prompt + tokens[:-1])
    assert tokens == ref[len(prompt) - 1:].argmax(-1).tolist()
    return program, len(prompt)


def test_a_decode_step_is_queued_before_the_token_it_feeds_on_is_read(exported, calls, monkeypatch):
    """On a GPU queuing only hands the device work: each decode step is
    queued as soon as it is built, so the device computes it while the host
    reads the token before it and samples; the tokens are those of reading
    first (the transformers greedy reply)."""
    events = []
    real = plan_module.ON_BUILD

    def submit(*arrays):
        events.append("submit")
        real.submit(*arrays)

    def wait(array):
        events.append("wait")
        real.wait(array)

    def around(execute, inputs, last_position_only):
        events.append("decode" if isinstance(inputs[0], mx.array) else "prefill")
        return execute(inputs, last_position_only)

    _greedy_queued_on_build(exported, monkeypatch, submit, wait, around)
    decodes = [i for i, e in enumerate(events) if e == "decode"]
    assert len(decodes) == NEW_TOKENS - 1
    # the first decode step feeds a token already read; each later one is
    # queued before the wait for the token it feeds on
    assert all(events[i + 1:i + 3] == ["submit", "wait"] for i in decodes[1:])


def test_a_call_of_several_tokens_is_handed_to_the_device_as_it_is_built(exported, calls, monkeypatch):
    """On a GPU a call of several tokens built op by op (a prompt's chunk, a
    speculative try's verifying call) queues what it has built every few
    layers (up to a layer's attention), so the device computes the first
    layers while the host builds the rest; the greedy tokens stay
    transformers'."""
    submitted, during = [], []
    real = plan_module.ON_BUILD

    def submit(*arrays):
        submitted.append(arrays)
        real.submit(*arrays)

    def around(execute, inputs, last_position_only):
        before = len(submitted)
        out = execute(inputs, last_position_only)
        during.append((mx.array(inputs[0]).size, len(submitted) - before, submitted[before:]))
        return out

    monkeypatch.setattr(compiled_runs, "SUBMIT_EVERY", 1)
    program, prompt_len = _greedy_queued_on_build(exported, monkeypatch, submit, real.wait, around)
    layers, chunk = program.metadata.n_caches, program.metadata.prefill_chunk
    several = [(size, n, arrays) for size, n, arrays in during if size > 1]
    assert [size for size, _, _ in several] == [chunk, prompt_len - chunk]  # the prompt's two chunks
    assert all(n == layers for _, n, _ in several)  # one a layer: its attention's output
    assert all(len(a) == 1 for _, _, arrays in several for a in arrays)
    assert all(n == 0 for size, n, _ in during if size == 1)  # a one-token step is queued whole


@pytest.fixture
def blocks(monkeypatch):
    """A CUDA GPU's decode blocks, run by MLX's ops here: how many of each
    kind (weights, normed, epilogue, bits) the calls launched."""
    launched = collections.Counter()

    class Counting(decode.MlxOps):
        def launcher(self, block):
            inner = super().launcher(block)
            kind = (len(block.weights), block.norm is not None, block.epilogue, block.weights[0].bits,
                    block.rotary and block.rotary.rotated)

            def launch(x, residual=None, position=None):
                launched[kind] += 1
                launched["rows", x.size // block.k] += 1
                return inner(x, residual, position)

            return launch

        def update_and_attend(self, scale):
            inner = super().update_and_attend(scale)

            def run(*args):
                out = inner(*args)  # counted once it ran: a trace's try may refuse (NeedsHost)
                launched["attention"] += 1
                return out

            return run

    monkeypatch.setattr(decode, "for_device", Counting)
    return launched


@pytest.mark.parametrize("dtype,qlinear,bits", [("bf16", None, 0), ("fp32", "4w", 4)])
def test_decode_blocks_take_each_layer_in_four_and_match_transformers(exported, calls, blocks, dtype, qlinear, bits):
    """Per layer and decode step: the input norm with q, k, v, split into
    heads and rotated; the cache write with attention; the output product
    with its residual add; the second norm with gate, up and SwiGLU; the
    down product with its add. A prompt's chunk of a few rows (up to
    ``MOST_ROWS``: its last 8 tokens here) takes the same kernels; longer
    chunks run node by node. A quantized LM head takes the product kernel
    wherever those calls do (MLX's ``quantized_matmul`` reads the weights at
    a fraction of the bandwidth for one row, once a row for several)."""
    model_dir, pte = exported("llama", trained=True, dtype=dtype, qlinear=qlinear)
    tokens, ours = greedy(pte, prompt_for(3), NEW_TOKENS, compute="auto")
    ref = reference_logits(model_dir, tokens[:-1], dtype=torch.bfloat16 if dtype == "bf16" else torch.float32,
                           quantize=qlinear)
    assert_close_where_decisive(tokens, ours[:-1], ref, BF16_REL_TOL if dtype == "bf16" else Q4_REL_TOL)
    meta = load_program(pte).metadata
    layers, chunk = meta.n_caches, meta.prefill_chunk
    chunks = [min(chunk, PROMPT_LEN - start) for start in range(0, PROMPT_LEN, chunk)]
    short = sum(rows <= attention.MOST_ROWS for rows in chunks)
    assert short == 1 and len(chunks) == 2  # the case this test is for: one long chunk, one short
    calls_taken = NEW_TOKENS + short
    # q, k and v leave the kernel in heads, q and k rotated, but in the first
    # layer: the export makes its RoPE tables' views after that layer's norm
    kinds = {kind: n for kind, n in blocks.items() if kind[0] != "rows"}
    assert kinds == {(3, True, "", bits, 2): calls_taken * (layers - 1), (3, True, "", bits, None): calls_taken,
                     (1, False, "add", bits, None): 2 * calls_taken * layers,
                     (2, True, "swiglu", bits, None): calls_taken * layers, "attention": calls_taken * layers,
                     **({(1, False, "", bits, None): calls_taken} if bits else {})}
    # the short chunk's rows in one launch a block (and the LM head)
    assert blocks["rows", chunks[-1]] == 4 * layers + (1 if bits else 0)
    assert calls.get("swiglu", 0) == (len(chunks) - short) * layers


@pytest.fixture
def compiled_steps(monkeypatch):
    """A GPU seen as ``calls`` does, with decode steps' runs compiled (the default)."""
    forget_loaded_programs()
    yield from _seeing_a_gpu(monkeypatch)
    forget_loaded_programs()


def test_compiled_steps_replay_the_blocks_and_build_a_cache_op_that_needs_the_host_from_python(
        exported, compiled_steps, blocks):
    """A compiled decode step replays the blocks from its trace; a cache op
    that cannot be traced (MLX's ops here, writing the pools at a position
    on the host; the CUDA kernel joins the trace) is built from Python at
    every step, and the reply stays transformers' greedy one."""
    model_dir, pte = exported("llama", trained=True, dtype="bf16")
    tokens, ours = greedy(pte, prompt_for(3), NEW_TOKENS, compute="auto")
    ref = reference_logits(model_dir, tokens[:-1], dtype=torch.bfloat16)
    assert_close_where_decisive(tokens, ours[:-1], ref, BF16_REL_TOL)
    layers = load_program(pte).metadata.n_caches
    calls_taken = NEW_TOKENS + 1  # and the prompt's short chunk, as in the test above
    assert blocks["attention"] == calls_taken * layers
    launched = sum(n for kind, n in blocks.items() if kind != "attention" and kind[0] != "rows")
    assert launched < 4 * calls_taken * layers  # replayed steps launch none from Python


def _greedy_reply_with_prompt_lookup(exported, tmp_path, monkeypatch, prompt: str, tokens: int):
    """The tiny Llama registered as ``pte:tiny`` answers ``prompt`` with
    prompt lookup, some proposals kept, as transformers' greedy reply;
    its .pte."""
    monkeypatch.setenv("LLM_USER_PATH", str(tmp_path / "llm"))
    model_dir, pte = exported("llama")
    tok = make_tokenizer(tmp_path / "tok")
    r = CliRunner().invoke(cli, ["pte", "register", str(pte), "--tokenizer", str(tok), "--name", "tiny"],
                           catch_exceptions=False)
    assert r.exit_code == 0, r.output
    prompt = prompt.rstrip(", ")
    _, expected = models.hf_greedy(tok.parent, model_dir, [{"role": "user", "content": prompt}], tokens)
    reply = llm.get_model("pte:tiny").conversation().prompt(prompt, max_tokens=tokens, draft="ngram",
                                                             draft_tokens=4)
    assert reply.text() == expected
    assert reply.response_json["accepted_tokens"] > 0
    return pte


def test_a_speculative_reply_verifies_its_proposals_in_the_decode_blocks(exported, calls, blocks, tmp_path,
                                                                        monkeypatch):
    """Prompt lookup on a GPU: a call verifying proposals takes the decode
    blocks with its few rows, as a step takes them with one, and the reply
    is transformers' greedy one."""
    pte = _greedy_reply_with_prompt_lookup(exported, tmp_path, monkeypatch, "the cat sat on the mat, " * 2, 30)
    verifying = sum(n for kind, n in blocks.items() if kind[0] == "rows" and 1 < kind[1] <= 5)
    # four blocks a layer a call; more calls than a prompt's short last chunk
    assert verifying >= 2 * 4 * load_program(pte).metadata.n_caches


def test_a_speculative_reply_on_a_gpu_replays_its_verifying_calls_compiled(exported, compiled_steps, blocks,
                                                                            tmp_path, monkeypatch):
    """On a GPU a verifying call's build is most of it, so calls of a few
    rows are compiled as decode steps are: a length that came twice replays
    its pure runs from their trace (the cache op, MLX's here, built from
    Python between them; ``gpu_build_on_cpu.py --rows`` traces the CUDA
    kernel's), and the reply is transformers' greedy one."""
    made, record = [], compiled_runs.CompiledChain.record.__func__
    monkeypatch.setattr(compiled_runs.CompiledChain, "record",
                        classmethod(lambda cls, *args: made.append(record(cls, *args)) or made[-1]))
    _greedy_reply_with_prompt_lookup(exported, tmp_path, monkeypatch, "the cat sat on the mat, " * 3, 40)
    verifying = [chain for chain in made if chain.rows > 1]
    assert verifying and all(not run.off for chain in verifying for run in chain.runs.values())
    assert any(run.trace is not None for chain in verifying for run in chain.runs.values())  # replayed


def test_the_decode_kernels_refuse_blocks_they_cannot_read():
    """What ``decode.fits`` refuses runs as each node's own MLX op: weights
    of mixed kinds or widths, a norm weight of another length, a ``K`` the
    16-byte loads cannot step through, a group size MLX's kernels lack, an
    ``x`` too long for shared memory."""
    def dense(n, k, dtype=mx.bfloat16):
        return decode.Weight(mx.zeros((n, k), dtype))

    def q4(n, k, group=32):
        w, s, b = mx.quantize(mx.zeros((n, k)), group_size=group, bits=4)
        return decode.Weight(w, s, b, 4, group)

    norm = (mx.ones((64,)), 1e-5)
    assert decode.fits(decode.Block((dense(8, 64), dense(4, 64)), norm))
    assert decode.fits(decode.Block((q4(8, 64), q4(8, 64)), norm, "swiglu"))
    assert not decode.fits(decode.Block((dense(8, 64), q4(8, 64)), norm))  # mixed kinds
    assert not decode.fits(decode.Block((dense(8, 64), dense(8, 64, mx.float16)), norm))  # mixed dtypes
    assert not decode.fits(decode.Block((dense(8, 64),), (mx.ones((32,)), 1e-5)))  # norm of another length
    assert not decode.fits(decode.Block((dense(8, 60),), None))  # 60 bf16 values: not 16-byte steps
    assert not decode.fits(decode.Block((dense(8, 64), dense(6, 64)), None, "swiglu"))  # gate and up differ
    assert not decode.fits(decode.Block((dense(8, 64), dense(8, 64)), None, "add"))  # add takes one product
    assert not decode.fits(decode.Block((dense(8, 16384, mx.float32),), None))  # x past shared memory
    w, s, b = mx.quantize(mx.zeros((8, 64)), group_size=64, bits=3)
    assert not decode.fits(decode.Block((decode.Weight(w, s, b, 3, 64),), None))  # 3-bit words


def test_asked_for_tensor_cores_every_16bit_launch_against_4bit_weights_takes_them(monkeypatch):
    """Asked for tensor cores, every launch of bf16 or fp16 x, one row (a
    decode step's) and several (a verifying call's), runs 4-bit blocks of
    SmolLM2-135M's and Llama-3.2-1B's shapes on them, so each row rounds
    alike whatever the call; fp32 x, 8-bit weights, output rows the 16-row
    tiles do not divide, and a GPU without them take the FMA kernels."""
    def q(n, k, bits=4, group=32):
        w, s, b = mx.quantize(mx.zeros((n, k)), group_size=group, bits=bits)
        return decode.Weight(w, s, b, bits, group)

    def blocks(hidden, q_rows, kv_rows, inner, head, bits=4, group=32):
        norm = (mx.ones((hidden,)), 1e-5)
        rotary = decode.Rotary(head, mx.ones((head // 2,)), 2)
        return [decode.Block((q(q_rows, hidden, bits, group), q(kv_rows, hidden, bits, group),
                              q(kv_rows, hidden, bits, group)), norm, "", rotary),
                decode.Block((q(hidden, q_rows, bits, group),), None, "add"),
                decode.Block((q(inner, hidden, bits, group), q(inner, hidden, bits, group)), norm, "swiglu"),
                decode.Block((q(hidden, inner, bits, group),), None, "add")]

    def kernel(route):  # a kernel that answers which route launched it
        return lambda inputs, output_shapes, output_dtypes, **_: [route], None, None

    monkeypatch.setattr(decode, "_kernel", lambda signature: kernel("few" if signature[-1] else "one"))
    monkeypatch.setattr(decode, "_tensor_core_kernel",
                        lambda signature, one_row: kernel("tensor cores, one row" if one_row else "tensor cores"))

    def routes(kernels, block):
        position = mx.array(5, mx.int32) if block.rotary else None
        launch = kernels.launcher(block)
        return [launch(mx.zeros((1, rows, block.k), dtype), mx.zeros((1, rows, block.rows), dtype)
                       if block.epilogue == "add" else None, position)[0]
                for rows, dtype in ((1, mx.bfloat16), (6, mx.bfloat16), (6, mx.float16), (6, mx.float32))]

    smollm2, llama_1b = blocks(576, 576, 192, 1536, 64), blocks(2048, 2048, 512, 8192, 64, group=64)
    for block in smollm2 + llama_1b:
        assert decode.fits(block)
        assert routes(decode.CudaKernels(True), block) == ["tensor cores, one row", "tensor cores", "tensor cores",
                                                            "few"]
        assert routes(decode.CudaKernels(False), block) == ["one", "few", "few", "few"]
    for block in blocks(576, 576, 192, 1536, 64, bits=8) + [decode.Block((q(100, 576),), None, "add")]:
        assert routes(decode.CudaKernels(True), block) == ["one", "few", "few", "few"]
