"""Exported models run through our runtime match transformers eager.

A chunked prefill of a prompt longer than the chunk (and than gemma3's
sliding window), then greedy decode steps; the reference is the same Hugging
Face model run eagerly over the whole sequence with our tokens, so every
prefill and decode position is compared.
"""

import numpy as np
import pytest
import torch
import transformers

from llm_executorch_mlx.runtime import load_program
from llm_executorch_mlx.runtime.dtypes import mlx_dtype
from llm_executorch_mlx.runtime.interp.layout import matmul_weights, weights_read_only_by_matmuls_and_gathers
from llm_executorch_mlx.runtime.pte.graph import node_name

PROMPT_LEN, NEW_TOKENS = 40, 20


def greedy(pte, prompt, new_tokens, kv_dtype=None, compute="auto", int8_activations=True, bf16_activations=True,
           kv_value_dtype=None):
    import mlx.core as mx

    program = load_program(pte, compute=compute, int8_activations=int8_activations,
                           bf16_activations=bf16_activations)
    program.prepare_cpu_kernels()  # as a generation does: the CPU kernels, built if need be
    # the exact cache where the program computes in fp32, unless a test asks
    # for another: these tests hold the compute to transformers; the default
    # fp16 cache is held to it apart (test_default_cache_...)
    exact = "fp32" if program.compute_dtype == "fp32" else None
    cache = program.new_cache(capacity=128, dtype=kv_dtype or exact, value_dtype=kv_value_dtype)
    forward = program.load_method("forward", cache=cache)
    chunk = program.metadata.prefill_chunk
    rows = []
    for start in range(0, len(prompt), chunk):
        ids = np.array([prompt[start : start + chunk]], dtype=np.int64)
        pos = np.arange(start, start + ids.shape[1], dtype=np.int64)
        rows.append(np.array(forward.execute([ids, pos])[0].astype(mx.float32))[0])
    tokens = list(prompt)
    for _ in range(new_tokens):
        nxt = int(rows[-1][-1].argmax())
        tokens.append(nxt)
        pos = np.array([len(tokens) - 1], dtype=np.int64)
        rows.append(np.array(forward.execute([np.array([[nxt]]), pos])[0].astype(mx.float32))[0])
    assert cache.length == len(tokens)
    # every layer's query and key RoPE ran as one op (fusion.py), or in the
    # op that writes the cache and attends (ops/attention.py); llama and
    # qwen3 gate their MLPs with silu, gemma with gelu. A GPU's decode blocks
    # take both in (test_gpu_branches counts them there).
    if "DecodeBlock" not in forward.op_names:
        ropes = forward.op_names.count("RopeFused") + 2 * forward.op_names.count("RotatedUpdateAndAttend")
        assert ropes == 2 * program.metadata.n_caches
        if "gemma" not in str(pte):
            assert forward.op_names.count("SwiGLUFused") == program.metadata.n_caches
    return tokens, np.concatenate(rows)[: len(tokens)]


def round_linear_inputs_to_int8(model, group: int = 32) -> None:
    """Every linear layer of ``model`` multiplies its input rounded to int8 per
    group of ``group`` values, as llama.cpp's Q8_0 rounds it: d = max|x| / 127,
    x -> d round(x / d), ties to even. What the int8_activations route
    computes with the quantized weights (runtime/cpu/quantized_int8.h)."""

    def rounded(module, args):
        x = args[0]
        g = x.unflatten(-1, (-1, group))
        top = g.abs().amax(-1, keepdim=True)
        inverse = torch.where(top > 0, 127 / top, torch.zeros_like(top))
        return (torch.round(g * inverse) * (top / 127)).flatten(-2), *args[1:]

    for module in model.modules():
        if isinstance(module, torch.nn.Linear):
            module.register_forward_pre_hook(rounded)


def round_quantized_scales_to_fp16(model) -> None:
    """Each quantized weight's scales rounded to fp16 (torch's rounding) where
    every one of them is 0 or within fp16's normal range, as the int8 layout
    stores them (runtime/cpu/quantized_int8.h's QuadScales); a tied table's
    lookups read those scales too."""
    for module in model.modules():
        weight = getattr(module, "weight", None)
        scale = getattr(weight, "scale", None)
        if scale is None:
            continue
        size = scale.abs()
        if bool(((size == 0) | ((size >= 2.0**-14) & (size <= 65504))).all()):
            scale.copy_(scale.half().float())


def round_linear_inputs_to_bf16(model) -> None:
    """Every linear layer of ``model`` multiplies its input rounded to bf16
    (torch's conversion: to nearest, ties to even), summed in the layer's
    dtype: what the bf16_activations route computes with bf16 weights
    (runtime/cpu/gemv.cpp's bf16_x)."""
    for module in model.modules():
        if isinstance(module, torch.nn.Linear):
            module.register_forward_pre_hook(lambda m, args: (args[0].to(torch.bfloat16).to(args[0].dtype),
                                                              *args[1:]))


def reference_logits(model_dir, tokens, dtype=torch.float32, quantize=None, compute_dtype=None,
                     int8_activations=False, bf16_activations=False):
    """Eager logits of the model stored as ``dtype``, computed in
    ``compute_dtype`` (default: the same); int8_activations: each linear's
    input rounded as ``round_linear_inputs_to_int8`` does; bf16_activations:
    as ``round_linear_inputs_to_bf16`` does."""
    model = transformers.AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=dtype, attn_implementation="eager"
    )
    if compute_dtype is not None:
        model = model.to(compute_dtype)
    if quantize:
        from executorch.backends.mlx.llm.quantization import quantize_model_

        quantize_model_(model, qlinear_config=quantize, qlinear_group_size=32,
                        qembedding_config=None, qembedding_group_size=None,
                        tie_word_embeddings=False)
    if int8_activations:
        round_linear_inputs_to_int8(model)
        round_quantized_scales_to_fp16(model)
    if bf16_activations:
        round_linear_inputs_to_bf16(model)
    model.eval()
    with torch.no_grad():
        out = model(input_ids=torch.tensor([tokens])).logits[0]
    return out.float().numpy()


def prompt_for(seed=0):
    return np.random.default_rng(seed).integers(0, 256, PROMPT_LEN).tolist()


@pytest.mark.parametrize("arch", ["llama", "qwen3", "gemma3"])
def test_fp32_logits_match_transformers(exported, arch):
    model_dir, pte = exported(arch)
    tokens, ours = greedy(pte, prompt_for(), NEW_TOKENS, kv_dtype="fp32")
    ref = reference_logits(model_dir, tokens[:-1])
    ours = ours[:-1]
    scale = np.abs(ref).max()
    err = np.abs(ours - ref).max()
    assert err <= 1e-4 * scale, f"max abs error {err} vs logit scale {scale}"
    # greedy tokens are the reference's argmax at every decode position
    assert tokens[PROMPT_LEN:] == ref[PROMPT_LEN - 1 :].argmax(-1).tolist()
    assert_products_grouped(load_program(pte))


# A quantized cache against transformers' exact attention: on the trained
# fixture (head size 32: one group of 32 a head and token) 8-bit keys and
# values keep the logits within 1% of their scale, 4-bit values within 10%;
# a wrong packing, scale or offset would be off by the scale itself. The real
# model's perplexity and greedy agreement are docs/design.md's contract.
@pytest.mark.parametrize("keys, values, tol", [("int8", "int8", 1e-2), ("int8", "int4", 1e-1)])
def test_quantized_cache_logits_stay_within_its_contract(exported, keys, values, tol):
    model_dir, pte = exported("gemma3", trained=True, dtype="bf16")
    tokens, ours = greedy(pte, prompt_for(), NEW_TOKENS, kv_dtype=keys, kv_value_dtype=values,
                          bf16_activations=False)
    ref = reference_logits(model_dir, tokens[:-1], dtype=torch.bfloat16, compute_dtype=torch.float32)
    assert_close_where_decisive(tokens, ours[:-1], ref, tol)


# The default cache of a program computing in fp32 (a CPU's route) stores
# keys and values in fp16: each within 2^-11 of itself, which moved the
# fixture's logits by ~2e-4 of their scale; 1e-3 leaves room for other
# prompts, where a wrong cast (bf16's 2^-8) or a misplaced cell would not.
FP16_KV_TOL = 1e-3


def test_default_cache_of_fp32_compute_is_fp16_within_its_contract(exported):
    model_dir, pte = exported("gemma3", trained=True, dtype="bf16")
    from llm_executorch_mlx.runtime.plan import Plan

    assert load_program(pte, compute="fp32").kv_dtype == "fp16"
    assert load_program(pte, compute="native").kv_dtype == "bf16"  # the compute's own
    assert Plan(cpu=False).cache_dtype("fp32") == "fp32"  # a GPU's attention kernel reads the query's dtype
    tokens, ours = greedy(pte, prompt_for(), NEW_TOKENS, kv_dtype="fp16", compute="fp32", bf16_activations=False)
    ref = reference_logits(model_dir, tokens[:-1], dtype=torch.bfloat16, compute_dtype=torch.float32)
    assert_close_where_decisive(tokens, ours[:-1], ref, FP16_KV_TOL)


def assert_products_grouped(program):
    """With the extension's products, each layer's q, k, v and its gate, up ran
    as one op each (grouping.py); without it (the flag, or no compiler) none did."""
    grouped = program.prepare_cpu_kernels().products.on
    forward = program.load_method("forward", cache=program.new_cache(capacity=16))
    layers = program.metadata.n_caches
    assert forward.op_names.count("MatmulGroup") == 2 * layers * grouped
    assert forward.op_names.count("MatmulGrouped") == 3 * layers * grouped


def assert_close_where_decisive(tokens, ours, ref, rel_tol):
    """Logits within rel_tol of the scale; greedy picks equal the reference's
    wherever its top-2 margin exceeds that tolerance."""
    scale = np.abs(ref).max()
    tol = rel_tol * scale
    err = np.abs(ours - ref).max()
    assert err <= tol, f"max abs error {err} > {tol}"
    top2 = np.sort(ref, axis=-1)[:, -2:]
    decisive = (top2[:, 1] - top2[:, 0]) > 2 * tol
    picks = np.array(tokens[PROMPT_LEN:])
    ref_picks = ref[PROMPT_LEN - 1 :].argmax(-1)
    mask = decisive[PROMPT_LEN - 1 :]
    assert mask.sum() >= len(mask) // 2, "the fixture should mostly have clear winners"
    assert (picks[mask] == ref_picks[mask]).all()


# bf16 compute rounds every activation to 8 bits of mantissa: 3% of the logit
# scale covers the drift of two engines (MLX and torch) over a few layers.
BF16_REL_TOL = 3e-2
# 4-bit weights with fp32 activations: both engines use the same quantized
# weights; the remaining gap is accumulation order.
Q4_REL_TOL = 1e-3
# A rounding route (int8_activations, bf16_activations) against transformers
# with each linear's input rounded as it rounds it (round_linear_inputs_to_*):
# the same numbers, but where the two sums' fp32 order tips an activation
# across a rounding boundary it moves by one step (int8: 2^-7 of its group's
# largest |x|; bf16: 2^-8 of itself) and the positions after it differ by
# that: every position within FLIP_TOL of the logits' scale, nine in ten
# within Q4_REL_TOL.
FLIP_TOL = 1e-2


def assert_rounded_close(tokens, ours, ref):
    err = np.abs(ours - ref).max(-1) / np.abs(ref).max()
    assert (err <= Q4_REL_TOL).mean() >= 0.9, f"errors by position, as a fraction of the scale: {err.round(5)}"
    assert_close_where_decisive(tokens, ours, ref, FLIP_TOL)


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_bf16_native_matches_transformers_bf16(exported, arch):
    """The file's own dtype (what a GPU runs): bf16 compute on both sides."""
    model_dir, pte = exported(arch, trained=True, dtype="bf16")
    tokens, ours = greedy(pte, prompt_for(1), NEW_TOKENS, compute="native")
    ref = reference_logits(model_dir, tokens[:-1], dtype=torch.bfloat16)
    assert_close_where_decisive(tokens, ours[:-1], ref, BF16_REL_TOL)


@pytest.mark.parametrize("products, few_rows", [("1", 32), ("1", 4), ("0", 32)],
                         ids=["bf16-linears-as-stored", "as-stored-chunks-widened-for-blas", "all-widened"])
@pytest.mark.parametrize("arch", ["llama", "llama-tied", "gemma3"])
def test_bf16_widened_matches_fp32_compute_on_bf16_weights(exported, arch, products, few_rows, monkeypatch,
                                                           compiler):
    """The CPU route: a bf16 program computes in fp32 exactly what
    transformers computes in fp32 on the same bf16-rounded weights, whether
    its linear weights stay bf16 for the extension's products (which widen
    them as they read them; a chunk of more rows than the plan's
    ``dense_rows`` has them widened per product for BLAS, which the second
    case makes every prefill chunk) or, without them, everything is widened
    at load."""
    from llm_executorch_mlx.runtime.plan import Plan

    monkeypatch.setenv("LLM_PTE_CPU_PRODUCTS", products)
    real_rows = Plan.dense_rows
    monkeypatch.setattr(Plan, "dense_rows", lambda plan, dtype: min(real_rows(plan, dtype), few_rows))
    model_dir, pte = exported(arch, trained=True, dtype="bf16")
    program = load_program(pte, compute="fp32")
    assert program.compute_dtype == "fp32"
    kernels = program.prepare_cpu_kernels()
    assert kernels.products.on == (products == "1" and compiler)
    program.load_method("forward", cache=program.new_cache(capacity=8))
    held = sum(a.nbytes for a in program._constants["forward"])  # what MLX holds
    graph = program._graph("forward")
    linear = weights_read_only_by_matmuls_and_gathers(graph)
    assert linear  # the model's linear layers
    gathered = {i.op.x.idx for c in graph.instructionChains for i in c.instructions if node_name(i) == "TakeNode"}
    tied = gathered & matmul_weights(graph)
    assert bool(tied) == (arch == "llama-tied") and tied <= linear  # a tied table: an LM head and a gather
    expected = 0
    for tid, meta in enumerate(graph.tensorMeta[: graph.numConstantTensors]):
        n = int(np.prod([d.value for d in meta.shape]))
        bf16 = meta.scalarType == 15
        expected += n * (2 if bf16 and kernels.products.on and tid in linear else 4 if bf16 else mlx_dtype(meta.scalarType).size)
    assert held == expected == program.weight_bytes()
    tokens, ours = greedy(pte, prompt_for(1), NEW_TOKENS, compute="fp32", bf16_activations=False)
    ref = reference_logits(model_dir, tokens[:-1], dtype=torch.bfloat16, compute_dtype=torch.float32)
    scale = np.abs(ref).max()
    err = np.abs(ours[:-1] - ref).max()
    assert err <= 1e-4 * scale, f"max abs error {err} vs logit scale {scale}"
    assert tokens[PROMPT_LEN:] == ref[PROMPT_LEN - 1 :].argmax(-1).tolist()
    assert_products_grouped(program)


@pytest.mark.parametrize("arch", ["llama", "llama-tied"])
def test_bf16_activations_match_fp32_compute_with_linear_inputs_rounded_to_bf16(exported, arch):
    """The default CPU route of a bf16 program where the CPU has bf16 dot
    products: each product of the extension multiplies its input rounded to
    bf16, as transformers does with its linear layers' inputs so rounded
    (the rounding routes' contract); elsewhere the exact route, within 1e-4."""
    model_dir, pte = exported(arch, trained=True, dtype="bf16")
    tokens, ours = greedy(pte, prompt_for(3), NEW_TOKENS, compute="fp32")
    program = load_program(pte, compute="fp32")
    program.prepare_cpu_kernels()
    rounds = program.plan.rounds_to_bf16
    ref = reference_logits(model_dir, tokens[:-1], dtype=torch.bfloat16, compute_dtype=torch.float32,
                           bf16_activations=rounds)
    if rounds:
        assert_rounded_close(tokens, ours[:-1], ref)
    else:
        assert_close_where_decisive(tokens, ours[:-1], ref, 1e-4)


@pytest.mark.parametrize("products, int8", [("1", False), ("1", True), ("0", True)],
                         ids=["quantized-gemv", "int8-activations", "mlx-quantized-matmul"])
def test_4bit_linear_matches_torchao_reference(exported, products, int8, monkeypatch):
    """Every CPU route of a quantized product: the extension's (weights read
    as stored, activations within 2^-16, dequantized for BLAS past 128 rows),
    its int8-activation route (the default where the CPU has integer dot
    products, held to its own contract) and MLX's own ops, which a machine
    without a C++ compiler runs whatever the option says."""
    monkeypatch.setenv("LLM_PTE_CPU_PRODUCTS", products)
    model_dir, pte = exported("llama", trained=True, dtype="fp32", qlinear="4w")
    tokens, ours = greedy(pte, prompt_for(2), NEW_TOKENS, kv_dtype="fp32", int8_activations=int8)
    program = load_program(pte)
    program.prepare_cpu_kernels()
    int8_here = int8 and program.plan.limits is not None and 4 in program.plan.limits.int8_bits
    ref = reference_logits(model_dir, tokens[:-1], quantize="4w", int8_activations=int8_here)
    if int8_here:
        assert_rounded_close(tokens, ours[:-1], ref)
    else:
        assert_close_where_decisive(tokens, ours[:-1], ref, Q4_REL_TOL)
    # with the extension's products, each layer's q, k, v and its gate, up ran as
    # one op each (grouping.py); without it (the flag, or no compiler) none did
    program = load_program(pte)
    grouped = program.prepare_cpu_kernels().products.on
    assert grouped == (products == "1" and program.cpu_kernels.extension is not None)
    calls = []  # the weights of each grouped call a decode step makes
    if grouped:
        extension = program.cpu_kernels.extension
        together = extension.quantized_gemvs
        monkeypatch.setattr(extension, "quantized_gemvs",
                            lambda x, ws, *a, **k: calls.append(len(ws)) or together(x, ws, *a, **k))
    forward = program.load_method("forward", cache=program.new_cache(capacity=16))
    layers = program.metadata.n_caches
    assert forward.op_names.count("QuantizedMatmulGroup") == 2 * layers * grouped
    assert forward.op_names.count("QuantizedMatmulGrouped") == 3 * layers * grouped
    forward.execute([np.array([[1, 2, 3]]), np.arange(3)])
    calls.clear()
    forward.execute([np.array([[4]]), np.array([3])])
    assert sorted(calls) == sorted([3, 2] * layers * grouped)  # each layer's q, k, v in one call, gate and up in one
    # and their weights (the LM head's too) are stored interleaved for the extension's products
    assert len(program._interleaved.get("forward", ())) == (7 * layers + 1) * grouped


def test_gemma3_ring_layers_wrap_in_decode(exported):
    """Gemma3's sliding layers (window 16) hold 16 + chunk - 1 slots, so 60
    positions wrap the ring several times; parity above already covers the
    numbers, this checks the cache really is a ring of that size."""
    model_dir, pte = exported("gemma3")
    program = load_program(pte)
    assert program.metadata.windows == [16, 16, 0]
    cache = program.new_cache(capacity=128)
    assert [k.shape[2] for k in cache.state[:2]] == [16 + program.metadata.prefill_chunk - 1] * 2
