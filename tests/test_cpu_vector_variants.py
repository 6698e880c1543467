"""The extension as other CPUs get it: built with its vector extensions capped
(``LLM_PTE_CPU_VECTORS``: ``avx512_vnni``, the default build without AMX
tiles, where the CPU has them; ``avx512``, AVX-512 without VNNI; ``avx2``, AVX2,
FMA and F16C only; ``portable``, the compiler's default target, which runs
the float kernels an Arm or older x86 CPU runs), each variant in its own process and its own cache directory,
against numpy on the weights dequantized by hand and MLX's own ops.

The default build (this CPU's widest vectors) is what the rest of the suite
runs. Variants this machine cannot build are not asked for: ``avx2`` runs
only where the CPU has AVX2 and FMA, ``avx512`` where it has AVX-512BW.
"""

import ctypes
import json
import os
import pathlib
import platform
import subprocess
import sys

import pytest

# Runs in the child: every quantized product shape and group the kernels take,
# 1 to 16 rows, then attention (over fp32 and quantized caches) and the dense GEMV; prints the worst error as a
# fraction of its tolerance, per case.
CHILD = r"""
import json, sys
import mlx.core as mx, numpy as np
from llm_executorch_mlx.runtime.cpu import extension, selection

found = selection.kernels(build=True)
assert found.products.on and found.attention.on, (found.products.why, found.attention.why)
ext = found.extension
command = extension._plan()[0].compile
rng = np.random.default_rng(0)

def by_hand(q, scales, biases, bits, group):
    words = np.array(q).astype(np.uint64)
    shifts = np.arange(32 // bits, dtype=np.uint64) * bits
    values = ((words[..., None] >> shifts) & ((1 << bits) - 1)).reshape(words.shape[0], -1)
    return values.astype(np.float32) * np.repeat(np.array(scales), group, 1) + np.repeat(np.array(biases), group, 1)

worst = {}
for bits in (4, 8):
    for group in (32, 64, 128):
        for N, K in ((7, 256), (96, 768), (33, 1536)):
            if K % group:
                continue
            q, s, b = mx.quantize(mx.array(rng.standard_normal((N, K)).astype(np.float32)), group_size=group, bits=bits)
            w = by_hand(q, s, b, bits, group)
            for M in (1, 3, 4, 16):
                x = rng.standard_normal((1, M, K)).astype(np.float32)
                y = np.array(ext.quantized_gemv(mx.array(x), q, s, b, group, bits))
                # fp32 rounding, and x's int16 rounding where x86 takes integer dot products
                tol = 1e-5 * np.sqrt(K) * np.abs(x).max() * np.abs(w).max() + np.abs(x).max() * np.abs(w).sum(1).max() / 65534
                worst[f"q{bits} g{group} {N}x{K} M{M}"] = float(np.abs(y - x @ w.T).max() / tol)
lanes = ext.limits()["interleave_lanes"]  # 16 with AVX-512, 8 with AVX2, 0 without integer dot products
for bits in (4, 8) if lanes else ():
    for group in (32, 128):
        N, K = 3 * lanes, 256
        q, s, b = mx.quantize(mx.array(rng.standard_normal((N, K)).astype(np.float32)), group_size=group, bits=bits)
        w = by_hand(q, s, b, bits, group)
        interleaved = ext.interleave_quantized(q, s, b, group, bits)
        for M in (1, 5, 40):
            x = rng.standard_normal((1, M, K)).astype(np.float32)
            y = np.array(ext.quantized_gemv(mx.array(x), *interleaved, group, bits, interleaved=True))
            tol = 1e-5 * np.sqrt(K) * np.abs(x).max() * np.abs(w).max() + np.abs(x).max() * np.abs(w).sum(1).max() / 65534
            worst[f"interleaved q{bits} g{group} M{M}"] = float(np.abs(y - x @ w.T).max() / tol)
        w_t = np.array(ext.dequantize(*interleaved, group, bits, interleaved=True))
        worst[f"interleaved dequantize q{bits} g{group}"] = float(np.abs(w_t - w.T).max() / 1e-5)
x, w = rng.standard_normal((1, 1, 576)).astype(np.float32), rng.standard_normal((576, 200)).astype(np.float32)
y = np.array(ext.gemv(mx.array(x), mx.array(w)))
worst["gemv fp32"] = float(np.abs(y - x @ w).max() / (1e-5 * np.sqrt(576) * np.abs(x).max() * np.abs(w).max()))
w16 = mx.array(w).astype(mx.bfloat16)
# a short chunk's rows and a prefill chunk's (passes of 4 rows of x over 3 or 4
# weight rows at a time, 200 weight rows leaving a tail), and an odd K and N
for K, N, M in ((576, 200, 3), (576, 200, 5), (576, 200, 128), (13, 7, 6)):
    xm = rng.standard_normal((1, M, K)).astype(np.float32)
    wm = w if (K, N) == (576, 200) else rng.standard_normal((K, N)).astype(np.float32)
    for name, weight in (("fp32", mx.array(wm)), ("bf16", mx.array(wm).astype(mx.bfloat16))):
        wide = np.array(weight.astype(mx.float32))
        y = np.array(ext.gemv(mx.array(xm), weight))
        worst[f"gemv {name} {K}x{N} M{M}"] = float(
            np.abs(y - xm @ wide).max() / (1e-5 * np.sqrt(K) * np.abs(xm).max() * np.abs(wide).max()))
if ext.limits()["bf16_dot"]:
    # x rounded to bf16: 35 rows are two tiles of 16 (AMX's, where built) and 3 more;
    # 56 weight rows a block of 32, one of 16 and 8 more
    xm = rng.standard_normal((1, 35, 96)).astype(np.float32)
    wm = mx.array(rng.standard_normal((96, 56)).astype(np.float32)).astype(mx.bfloat16)
    xr = np.array(mx.array(xm).astype(mx.bfloat16).astype(mx.float32))
    wide = np.array(wm.astype(mx.float32))
    y = np.array(ext.gemv(mx.array(xm), wm, bf16_x=True))
    worst["gemv bf16_x 96x56 M35"] = float(np.abs(y - xr @ wide).max() / (1e-5 * np.sqrt(96) * np.abs(xr).max() * np.abs(wide).max()))
worst["widen_bf16"] = float(np.abs(np.array(ext.widen_bf16(w16.T)) - np.array(w16.T.astype(mx.float32))).max())
for bits in (4, 8):
    q, s, b = mx.quantize(mx.array(rng.standard_normal((33, 256)).astype(np.float32)), group_size=32, bits=bits)
    worst[f"dequantize q{bits}"] = float(np.abs(np.array(ext.dequantize(q, s, b, 32, bits)) - by_hand(q, s, b, bits, 32)).max() / 1e-5)
q = mx.array(rng.standard_normal((1, 6, 3, 64)).astype(np.float32))
k, v = (mx.array(rng.standard_normal((1, 2, 40, 64)).astype(np.float32)) for _ in range(2))
ours = np.array(ext.attention(q, k, v, 0.125, True))
mask = np.arange(40)[None] <= np.arange(37, 40)[:, None]
scores = np.where(mask, 0.125 * np.array(q) @ np.repeat(np.array(k), 3, 1).swapaxes(-1, -2), -np.inf)
p = np.exp(scores - scores.max(-1, keepdims=True))
reference = (p / p.sum(-1, keepdims=True)) @ np.repeat(np.array(v), 3, 1)
worst["attention"] = float(np.abs(ours - reference).max() / 1e-5)
# over a quantized cache: every bit pair, a few queries (rows) and 70 (tiles),
# against the same softmax on the cache dequantized by hand
def attention_reference(q, k, v, scale):
    T, S = q.shape[2], k.shape[2]
    scores = scale * q @ np.repeat(k, q.shape[1] // k.shape[1], 1).swapaxes(-1, -2)
    scores = np.where(np.arange(S)[None] <= np.arange(S - T, S)[:, None], scores, -np.inf)
    p = np.exp(scores - scores.max(-1, keepdims=True))
    return (p / p.sum(-1, keepdims=True)) @ np.repeat(v, q.shape[1] // k.shape[1], 1)

for k_bits, v_bits in ((8, 8), (8, 4), (4, 8), (4, 4)):
    quantized = []
    for bits in (k_bits, v_bits):
        words, s, b = mx.quantize(mx.array(rng.standard_normal((2, 100, 64)).astype(np.float32)), group_size=32, bits=bits)
        s, b = s.astype(mx.float16), b.astype(mx.float16)
        flat = (words.reshape(200, -1), s.reshape(200, -1).astype(mx.float32), b.reshape(200, -1).astype(mx.float32))
        quantized.append(((words[None], s[None], b[None]), by_hand(*flat, bits, 32).reshape(1, 2, 100, 64)))
    for T in (3, 70):
        q = rng.standard_normal((1, 6, T, 64)).astype(np.float32)
        ours = np.array(ext.quantized_attention(mx.array(q), *quantized[0][0], *quantized[1][0], 0.125, True,
                                                k_bits, v_bits, 32))
        reference = attention_reference(q, quantized[0][1], quantized[1][1], 0.125)
        worst[f"quantized attention k{k_bits} v{v_bits} T{T}"] = float(np.abs(ours - reference).max() / 1e-5)
# the last pair's cache read as stored rotated (groups of 32 times Sylvester's
# Hadamard matrix): the queries' groups rotated in, the output's out
hadamard = np.ones((1, 1))
while len(hadamard) < 32:
    hadamard = np.block([[hadamard, hadamard], [hadamard, -hadamard]])
hadamard /= np.sqrt(32)
def rotate(x):
    return (x.reshape(*x.shape[:-1], -1, 32) @ hadamard).reshape(x.shape).astype(np.float32)
for T in (3, 70):
    q = rng.standard_normal((1, 6, T, 64)).astype(np.float32)
    ours = np.array(ext.quantized_attention(mx.array(q), *quantized[0][0], *quantized[1][0], 0.125, True,
                                            k_bits, v_bits, 32, rotated=True))
    reference = rotate(attention_reference(rotate(q), quantized[0][1], quantized[1][1], 0.125))
    worst[f"rotated quantized attention k{k_bits} v{v_bits} T{T}"] = float(np.abs(ours - reference).max() / 1e-5)
# a flat quantized layer's step as one op: the rows written as mx.quantize
# writes the rotated rows (any byte else counts 2: past the tolerance), the
# attention as above over the history written
for k_bits, v_bits in ((8, 8), (8, 4)):
    for T, position in ((1, 40), (70, 3)):
        slots, end = position + T + 2, position + T
        pools = [list(mx.quantize(mx.array(rotate(rng.standard_normal((1, 2, slots, 64)).astype(np.float32)))
                                  .astype(mx.float16), group_size=32, bits=bits)) for bits in (k_bits, v_bits)]
        q, k, v = (rng.standard_normal((1, h, T, 64)).astype(np.float32) for h in (6, 2, 2))
        out, *written = ext.quantized_update_and_attend(mx.array(q), mx.array(k), mx.array(v), *pools[0], *pools[1],
                                                        position, 0.125, k_bits, v_bits, 32, rotated=True)
        wrong, history = 0, []
        for got, pool, x, bits in ((written[:3], pools[0], k, k_bits), (written[3:], pools[1], v, v_bits)):
            step = mx.quantize(mx.array(rotate(x)).astype(mx.float16), group_size=32, bits=bits)
            for g, p, s in zip(got, pool, step):
                want = np.array(p).copy()
                want[:, :, position:end] = np.array(s)
                wrong += int((np.array(g).view(np.uint8) != want.view(np.uint8)).sum())
            flat = (got[0].reshape(2 * slots, -1), got[1].reshape(2 * slots, -1).astype(mx.float32),
                    got[2].reshape(2 * slots, -1).astype(mx.float32))
            history.append(rotate(by_hand(*flat, bits, 32).reshape(1, 2, slots, 64)[:, :, :end]))
        worst[f"quantized update_and_attend k{k_bits} v{v_bits} T{T}: wrong bytes"] = 2.0 * wrong
        reference = attention_reference(q, *history, 0.125)
        worst[f"quantized update_and_attend k{k_bits} v{v_bits} T{T}"] = float(np.abs(np.array(out) - reference).max() / 1e-5)
# the int8-activation products, against numpy's integer math (test_cpu_int8_products.py)
sys.path.insert(0, sys.argv[1])
from test_cpu_int8_products import as_laid, int8_reference, quantized, symmetric
for bits in list(ext.limits()["int8_bits"]):
    for group, form in ((32, quantized), (128, quantized), (32, symmetric)):
        stored = form(rng, 3 * lanes, 256, bits, group)
        laid = ext.interleave_quantized(*stored, group, bits, int8=True)
        for M in (1, 6, 130):
            x = rng.standard_normal((M, 256)).astype(np.float32)
            y = np.array(ext.quantized_gemv(mx.array(x), *laid, group, bits, int8=True))
            ref = int8_reference(x, *as_laid(stored, laid, bits), bits, group)
            worst[f"int8 q{bits} g{group} {form.__name__} M{M}"] = float(np.abs(y - ref).max() / (1e-5 * np.abs(ref).max()))
# NaN in, NaN out (test_cpu_kernel_safety.py holds the default build to MLX's
# own ops): a NaN in one row of x spoils that row of each product only
x = rng.standard_normal((1, 3, 256)).astype(np.float32)
x[0, 1, 9] = np.nan
q, s, b = mx.quantize(mx.array(rng.standard_normal((16, 256)).astype(np.float32)), group_size=32, bits=4)
products = {"quantized": lambda: ext.quantized_gemv(mx.array(x), q, s, b, 32, 4)}
if lanes:
    products["interleaved"] = lambda: ext.quantized_gemv(mx.array(x), *ext.interleave_quantized(q, s, b, 32, 4), 32, 4,
                                                         interleaved=True)
if ext.limits()["int8_bits"]:
    products["int8"] = lambda: ext.quantized_gemv(mx.array(x), *ext.interleave_quantized(q, s, b, 32, 4, int8=True),
                                                  32, 4, int8=True)
products["attention"] = lambda: ext.attention(mx.array(x.reshape(1, 1, 3, 256)), *(mx.ones((1, 1, 5, 256)),) * 2,
                                              0.1, True)
kv = [a if a.dtype == mx.uint32 else a.astype(mx.float16) for a in mx.quantize(mx.ones((1, 1, 5, 256)), group_size=32, bits=4)]
products["quantized attention"] = lambda: ext.quantized_attention(mx.array(x.reshape(1, 1, 3, 256)), *kv, *kv, 0.1, True,
                                                                  4, 4, 32)
for name, product in products.items():
    spoilt = np.isnan(np.array(product())).reshape(3, -1)
    only_row_1 = spoilt.all(1).tolist() == [False, True, False] and not spoilt[[0, 2]].any()
    worst[f"NaN row, {name}"] = 0.0 if only_row_1 else 2.0
# without integer dot products, the interleaved layout's ops are refused as they are made
for name, make in () if lanes else (
        ("interleave_quantized", lambda: ext.interleave_quantized(q, s, b, 32, 4)),
        ("quantized_gemv", lambda: ext.quantized_gemv(mx.array(x), q, s, b, 32, 4, interleaved=True)),
        ("dequantize", lambda: ext.dequantize(q, s, b, 32, 4, interleaved=True)),
        ("take_interleaved", lambda: ext.take_interleaved(q, s, b, mx.array([0]), 32, 4))):
    try:
        make()
        worst[f"refused: {name}"] = 2.0
    except ValueError as refusal:
        worst[f"refused: {name}"] = 0.0 if "no interleaved layout" in str(refusal) else 2.0
print(json.dumps({"command": command, "worst": worst, "int8_bits": list(ext.limits()["int8_bits"]),
                  "bf16_dot": ext.limits()["bf16_dot"], "int8_tiles": ext.limits()["int8_tiles"],
                  "bf16_tiles": ext.limits()["bf16_tiles"]}))
"""


def cpu_flags() -> set[str]:
    try:
        return set(pathlib.Path("/proc/cpuinfo").read_text().split())
    except OSError:
        return set()


def amx_lent() -> bool:
    """Whether Linux lends this process AMX's tile registers (arch_prctl's
    ARCH_REQ_XCOMP_PERM for XFEATURE_XTILEDATA), as the kernel asks."""
    if platform.machine() != "x86_64" or sys.platform != "linux":
        return False
    return ctypes.CDLL(None, use_errno=True).syscall(158, 0x1023, 18) == 0  # SYS_arch_prctl


VARIANTS = (["portable"] + (["avx2"] if {"avx2", "fma"} <= cpu_flags() else [])
            + (["avx512"] if {"avx2", "fma", "avx512f", "avx512bw", "avx512vl"} <= cpu_flags() else [])
            + (["avx512_vnni"] if {"amx_tile", "amx_int8", "avx512_vnni"} <= cpu_flags() else []))


@pytest.mark.parametrize("variant", VARIANTS)
def test_every_vector_variant_computes_the_same_products(variant, tmp_path):
    env = dict(os.environ, LLM_PTE_CPU_VECTORS=variant, XDG_CACHE_HOME=str(tmp_path))
    done = subprocess.run([sys.executable, "-c", CHILD, str(pathlib.Path(__file__).parent)], env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    flags = {f for f in report["command"] if f.startswith("-m")}
    avx2 = {"-mavx2", "-mfma"} | ({"-mf16c"} & {f"-m{f}" for f in cpu_flags()})
    avx512 = avx2 | {"-mavx512f", "-mavx512bw", "-mavx512vl"}
    vnni = avx512 | {"-mavx512vnni"} | ({"-mavx512bf16"} & {f"-m{f.replace('_', '')}" for f in cpu_flags()})
    assert flags == {"portable": set(), "avx2": avx2, "avx512": avx512, "avx512_vnni": vnni}[variant]
    # x86 has integer dot products, hence the interleaved layout and the int8
    # route (without VNNI: vpmaddubsw, 8-bit weights offset); the portable build has neither
    assert any(case.startswith("interleaved") for case in report["worst"]) == (variant != "portable")
    assert report["int8_bits"] == ([] if variant == "portable" else [4, 8])
    assert report["bf16_dot"] is ("-mavx512bf16" in flags)  # only avx512_vnni keeps AVX512_BF16
    assert not report["int8_tiles"] and not report["bf16_tiles"]  # no variant has AMX; the default build does
    too_far = {case: ratio for case, ratio in report["worst"].items() if not ratio <= 1.0}
    assert not too_far, f"{variant}: errors above tolerance (as a fraction of it): {too_far}"


def test_the_default_build_takes_amx_tiles_where_the_cpu_lends_them():
    """The default build multiplies on AMX's tiles wherever the CPU has them
    and Linux lends them (the rest of the suite then runs its products
    there), and nowhere else."""
    from llm_executorch_mlx.runtime import cpu

    found = cpu.kernels(build=True)
    assert found.products.on, found.products.why
    limits = found.extension.limits()
    amx = {"amx_tile", "amx_int8", "avx512_vnni"} <= cpu_flags() and amx_lent()
    assert limits["int8_tiles"] is amx
    assert limits["bf16_tiles"] is (amx and {"amx_bf16", "avx512_bf16"} <= cpu_flags())


SOURCES = pathlib.Path(__file__).resolve().parent.parent / "llm_executorch_mlx" / "runtime" / "cpu"


def test_the_extension_formats_its_refusals_without_streams():
    """g++ 13 instantiates libstdc++'s stream templates inside the extension,
    with locale facet ids of their own: a refusal that wrote a number to an
    string stream crashed the process (SIGSEGV) there. The sources use no
    stream, and the built library defines none of libstdc++'s stream or
    locale symbols (it would show them where such a compiler built it)."""
    sources = sorted(SOURCES.glob("*.cpp")) + sorted(SOURCES.glob("*.h"))
    assert sources
    for source in sources:
        text = source.read_text()
        for stream in ("<sstream>", "<iostream>", "<ostream>", "stringstream", "std::cout", "std::cerr"):
            assert stream not in text, f"{source.name} uses {stream}"
    from llm_executorch_mlx.runtime.cpu import extension

    built = extension.build()
    assert built.module is not None, built.why
    symbols = subprocess.run(["nm", "-D", "--defined-only", "-C", built.why], capture_output=True, text=True,
                             check=True).stdout
    assert "gemvs" in symbols or "PyInit_cpu_kernels" in symbols  # the listing is the library's own
    for name in ("std::locale", "std::num_put", "std::basic_ostream", "std::ostream::_M_insert"):
        assert name not in symbols
