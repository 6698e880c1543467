// The CPU kernel extension's Python module: attention.cpp's and gemv.cpp's
// ops, bound with nanobind in MLX's type domain (extension.py builds it).

#include <nanobind/nanobind.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/variant.h>
#include <nanobind/stl/vector.h>

#include "kernels.h"

namespace nb = nanobind;
using namespace nb::literals;

NB_MODULE(cpu_kernels, m) {
  m.def("attention", &llm_pte::attention, "q"_a, "k"_a, "v"_a, "scale"_a, "causal"_a = false,
        nb::kw_only(), "window"_a = 0, "stream"_a = nb::none(),
        "softmax(scale * q k^T) v for q [B, Hq, T, D] (fp32) and k, v [B, Hkv, S, D] (fp32, bf16 or\n"
        "fp16), on the CPU.\n"
        "causal: the T queries are the last T of the S positions; window > 0: each query sees\n"
        "only the last `window` keys up to its own.");
  m.def("quantized_attention", &llm_pte::quantized_attention, "q"_a, "k"_a, "k_scales"_a, "k_biases"_a, "v"_a,
        "v_scales"_a, "v_biases"_a, "scale"_a, "causal"_a, "k_bits"_a, "v_bits"_a, "group_size"_a, nb::kw_only(),
        "window"_a = 0, "rotated"_a = false, "stream"_a = nb::none(),
        "attention(q, K, V, scale, causal, window=window) over a quantized cache: K and V [B, Hkv, S, D] as\n"
        "mx.quantize(x, group_size, bits) returns them (uint32 words of k_bits / v_bits values, 4 or 8;\n"
        "float16 scales and biases per group of 32, 64 or 128 along D), dequantized as they are read.\n"
        "rotated: K and V quantized from rotate(x, group_size) (quantized_kv.py); the queries' groups are\n"
        "rotated before scoring and the output's after, so the result is attention over x.");
  m.def("update_and_attend", &llm_pte::update_and_attend, "q"_a, "k"_a, "v"_a, "k_pool"_a, "v_pool"_a,
        "position"_a, "scale"_a, nb::kw_only(), "rope"_a = nb::none(), "stream"_a = nb::none(),
        "A flat cache layer's step as one op on the CPU: k and v [1, Hkv, T, D] (fp32) written into\n"
        "the pools [1, Hkv, slots, D] (fp32, bf16 or fp16) at position, then attention of q [1, Hq, T, D]\n"
        "over the pools' first position + T slots, causal when T > 1. Returns [out, k_pool', v_pool'].\n"
        "rope: the step's RoPE tables, float32 [2, T, D / 2] (cos rows, then sin rows), applied to q\n"
        "and k first as transformers does (x * cos + rotate_half(x) * sin).");
  m.def("quantized_update_and_attend", &llm_pte::quantized_update_and_attend, "q"_a, "k"_a, "v"_a, "k_words"_a,
        "k_scales"_a, "k_biases"_a, "v_words"_a, "v_scales"_a, "v_biases"_a, "position"_a, "scale"_a, "k_bits"_a,
        "v_bits"_a, "group_size"_a, nb::kw_only(), "rotated"_a = false, "rope"_a = nb::none(),
        "stream"_a = nb::none(),
        "update_and_attend over a quantized cache: k and v [1, Hkv, T, D] (fp32) stored as\n"
        "mx.quantize(x.astype(float16), group_size, bits) stores them (rotated: x's groups first rotated,\n"
        "quantized_kv.rotate), at k_bits / v_bits, into rows position .. position + T of the pools\n"
        "(quantized_attention's words, scales and biases, [1, Hkv, slots, ...]),\n"
        "then quantized_attention of q over their first position + T rows, causal when T > 1.\n"
        "Returns [out, k_words', k_scales', k_biases', v_words', v_scales', v_biases'].\n"
        "rope: as update_and_attend's (the keys rotated before they are stored).");
  m.def("gemv", &llm_pte::gemv, "x"_a, "w"_a, nb::kw_only(), "helped"_a = true, "bf16_x"_a = false,
        "stream"_a = nb::none(),
        "x @ w for x [..., M, K] fp32 (M <= limits()['dense_rows']) and w [K, N] fp32 or bf16 on the CPU;\n"
        "unless not helped, the host thread helps while it is in submit_helping or wait_helping.\n"
        "bf16_x (bf16 w, where limits()['bf16_dot']): x rounded to bf16 first, the pairs multiplied\n"
        "with vdpbf16ps.");
  m.def("gemvs", &llm_pte::gemvs, "x"_a, "ws"_a, nb::kw_only(), "helped"_a = true, "bf16_x"_a = false,
        "stream"_a = nb::none(),
        "[gemv(x, w) for w in ws] as one op (weights all fp32 or all bf16): one job shared with\n"
        "the host.");
  m.def("add_to_product", &llm_pte::add_to_product, "product"_a, "addend"_a,
        "product + addend as the product's own op, or None (kernels.h)");
  m.def("quantized_gemv", &llm_pte::quantized_gemv, "x"_a, "w"_a, "scales"_a, "biases"_a, "group_size"_a,
        "bits"_a, nb::kw_only(), "interleaved"_a = false, "int8"_a = false, "stream"_a = nb::none(),
        "x @ dequantize(w, scales, biases).T for x [..., M, K] fp32 (M <= 16) and w MLX's affine\n"
        "quantization (4 or 8 bits, groups of 32/64/128, fp32 scales and biases), on the CPU,\n"
        "read as stored; the host thread helps as with gemv. interleaved: interleave_quantized's\n"
        "layout (M <= 128); int8: its int8 layout, x rounded to int8 per group, any M.");
  m.def("quantized_gemvs", &llm_pte::quantized_gemvs, "x"_a, "ws"_a, "scales"_a, "biases"_a, "group_size"_a,
        "bits"_a, nb::kw_only(), "interleaved"_a = false, "int8"_a = false, "stream"_a = nb::none(),
        "[quantized_gemv(x, w, s, b) for w, s, b in zip(ws, scales, biases)] as one op: x prepared\n"
        "once, the products one job shared with the host.");
  m.def("dequantize", &llm_pte::dequantize, "w"_a, "scales"_a, "biases"_a, "group_size"_a, "bits"_a,
        nb::kw_only(), "interleaved"_a = false, "stream"_a = nb::none(),
        "mx.dequantize(w, scales, biases, group_size, bits) for 4- or 8-bit affine weights with\n"
        "fp32 scales and biases, on the CPU, vectorised; interleaved: of interleave_quantized's\n"
        "layout, returned transposed ([K, N]).");
  m.def("take_interleaved", &llm_pte::take_interleaved, "w"_a, "scales"_a, "biases"_a, "indices"_a, "group_size"_a,
        "bits"_a, nb::kw_only(), "int8"_a = false, "stream"_a = nb::none(),
        "mx.dequantize(w, scales, biases, group_size, bits)[indices] for w, scales and biases in\n"
        "interleave_quantized's layout (int8: its int8 one), on the CPU: fp32 rows [*indices.shape, K].");
  m.def("interleave_quantized", &llm_pte::interleave_quantized, "w"_a, "scales"_a, "biases"_a, "group_size"_a,
        "bits"_a, nb::kw_only(), "weight"_a = true, "int8"_a = false,
        "(w, scales, biases) with limits()['interleave_lanes'] weight rows interleaved, the layout the short\n"
        "products read fastest (quantized_interleaved.h); same shapes and sizes. weight=False: w is\n"
        "interleaved already and comes back as it is. int8=True: the layout quantized_gemv reads\n"
        "with int8 (its rows interleaved four bytes at a time).");
  m.def(
      "limits",
      [] {
        const auto l = llm_pte::limits();
        nb::dict d;
        d["dense_rows"] = l.dense_rows;
        d["quantized_rows"] = l.quantized_rows;
        d["interleaved_rows"] = l.interleaved_rows;
        d["interleave_lanes"] = l.interleave_lanes;
        d["quantized_bits"] = nb::tuple(nb::cast(l.quantized_bits));
        d["quantized_groups"] = nb::tuple(nb::cast(l.quantized_groups));
        d["int8_bits"] = nb::tuple(nb::cast(l.int8_bits));
        d["bf16_dot"] = l.bf16_dot;
        d["int8_tiles"] = l.int8_tiles;
        d["bf16_tiles"] = l.bf16_tiles;
        return d;
      },
      "What this build's products take (kernels.h's Limits) as a dict: most rows of x per layout,\n"
      "the rows of an interleaved block (0: none here), the quantized widths and group sizes, and\n"
      "whether the int8 and bf16_x products take AMX tiles (int8_tiles, bf16_tiles).");
  m.def("silu_mul", &llm_pte::silu_mul, "gate"_a, "up"_a, nb::kw_only(), "stream"_a = nb::none(),
        "silu(gate) * up for float32 gate and up of one shape, on the CPU, vectorised.");
  m.def("rms_norm", &llm_pte::rms_norm, "x"_a, "weight"_a.none(), "eps"_a, nb::kw_only(), "stream"_a = nb::none(),
        "mx.fast.rms_norm(x, weight, eps) for float32 x and weight (or None) as one op on the CPU.");
  m.def("widen_bf16", &llm_pte::widen_bf16, "w"_a, nb::kw_only(), "stream"_a = nb::none(),
        "w.astype(mx.float32) for a 2-D bfloat16 w on the CPU, vectorised where its rows are\n"
        "contiguous.");
  m.def("submit_helping", &llm_pte::submit_helping, "outputs"_a,
        "mx.async_eval(outputs), queued a slice at a time, running posted gemv chunks meanwhile.");
  m.def("wait_helping", &llm_pte::wait_helping, "a"_a,
        "Wait until the queued array `a` is computed, running posted gemv chunks meanwhile.");
  m.def("debug_throwing_job", &llm_pte::debug_throwing_job, "chunks"_a, "throwing"_a, nb::kw_only(),
        "stream"_a = nb::none(),
        "For tests only: arange(chunks) as float32 from a shared job whose chunk `throwing` (-1: each\n"
        "one) throws, a millisecond into each chunk; the error reaches whoever evaluates it.");
}
