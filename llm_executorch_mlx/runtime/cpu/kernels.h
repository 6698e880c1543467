// The extension's kernels as module.cpp binds them: CPU attention
// (attention.cpp) and the few-row products (gemv.cpp), each one MLX op on
// the CPU stream whose decode-step work the host thread helps with
// (shared_work.cpp: submit_helping, wait_helping); and element-wise SwiGLU
// (swiglu.cpp), and RMSNorm (rms_norm.cpp).

#pragma once

#include <optional>
#include <vector>

#include "mlx/array.h"
#include "mlx/utils.h"

namespace llm_pte {

namespace mx = mlx::core;

// softmax(scale * q k^T) v for q [B, Hq, T, D] (fp32) and k, v [B, Hkv, S, D]
// (fp32, bf16 or fp16); window > 0: each query sees only the last `window`
// keys up to its own.
mx::array attention(const mx::array& q, const mx::array& k, const mx::array& v, float scale,
                    bool causal, int window, mx::StreamOrDevice s);

// attention(q, K, V) over a quantized cache: K and V [B, Hkv, S, D] as
// mx.quantize makes them along D (uint32 words of 4- or 8-bit values, k_bits
// and v_bits each, float16 scales and biases per group of 32, 64 or 128),
// dequantized in registers as they are read (q * scale + bias in fp32).
// rotated: each group of K and V stored times the orthonormal Walsh-Hadamard
// matrix of its size (as the cache stores them); the queries' groups are
// rotated so before scoring and the output's after, so the result is
// attention over the values as they were before rotation.
mx::array quantized_attention(const mx::array& q, const mx::array& k, const mx::array& k_scales,
                              const mx::array& k_biases, const mx::array& v, const mx::array& v_scales,
                              const mx::array& v_biases, float scale, bool causal, int k_bits, int v_bits,
                              int group_size, int window, bool rotated, mx::StreamOrDevice s);

// A flat cache layer's step as one op: k and v [1, Hkv, T, D] (fp32) written
// into the pools [1, Hkv, slots, D] (fp32, bf16 or fp16) at `position`, then
// attention(q, the pools' first position + T slots, causal when T > 1).
// Returns [out, the pools written]: their input buffers where nothing else
// holds them. `rope`: the RoPE tables of the step's positions (cos [T, D/2]
// then sin, float32 [2, T, D/2]), applied to q and k first (x * cos +
// rotate_half(x) * sin, as transformers does).
std::vector<mx::array> update_and_attend(const mx::array& q, const mx::array& k, const mx::array& v,
                                         const mx::array& k_pool, const mx::array& v_pool, int position, float scale,
                                         const std::optional<mx::array>& rope, mx::StreamOrDevice s);

// update_and_attend over a quantized cache: the T rows of k and v [1, Hkv,
// T, D] (fp32), each group of group_size rotated where `rotated` (as
// quantized_attention reads them), rounded to fp16 and quantized as
// mx.quantize quantizes them (k_bits and v_bits, 4 or 8), written into rows
// position .. position + T of the pools (words, scales and biases as
// quantized_attention takes them, [1, Hkv, slots, ...]), then
// quantized_attention over the pools' first position + T rows, causal when
// T > 1. Returns [out, the six pool arrays written], each its input's
// buffer where nothing else holds it. `rope`: as update_and_attend's, the
// keys rotated so before they are stored.
std::vector<mx::array> quantized_update_and_attend(const mx::array& q, const mx::array& k, const mx::array& v,
                                                   const mx::array& k_words, const mx::array& k_scales,
                                                   const mx::array& k_biases, const mx::array& v_words,
                                                   const mx::array& v_scales, const mx::array& v_biases, int position,
                                                   float scale, int k_bits, int v_bits, int group_size, bool rotated,
                                                   const std::optional<mx::array>& rope, mx::StreamOrDevice s);

// x @ w for x [..., M, K] fp32 with M <= 128 rows (a decode step's one, a
// short chunk's, a prefill chunk's) and w [K, N] fp32 or bf16, read as stored; unless not
// `helped`, the host thread helps run it while it is in submit_helping or
// wait_helping.
mx::array gemv(const mx::array& x, const mx::array& w, bool helped, bool bf16_x, mx::StreamOrDevice s);

// gemv of one x with each of several weights of one dtype (a layer's q, k and
// v projections; its gate and up), the products one shared job.
std::vector<mx::array> gemvs(const mx::array& x, const std::vector<mx::array>& ws, bool helped, bool bf16_x,
                             mx::StreamOrDevice s);

// product + addend as one op, where `product` is a not yet computed output of
// gemv or quantized_gemv (one product, not gemvs') and addend fp32 of its
// shape: the product's op adds it when done, rounded as mx.add rounds. None
// otherwise (the caller adds). Only for a product nothing else reads: that
// reader would compute the product a second time.
std::optional<mx::array> add_to_product(const mx::array& product, const mx::array& addend);

// x @ dequantize(w, scales, biases).T for x [..., M, K] fp32 with M <= 16 and w
// MLX's affine quantization (4 or 8 bits, groups of 32, 64 or 128, fp32
// scales and biases), read as stored; shared with the host thread as gemv.
// interleaved: w, scales and biases as interleave_quantized made them (M <=
// 128). int8: as interleave_quantized made them with int8, x rounded to int8
// per group (quantized_int8.h), any M.
mx::array quantized_gemv(const mx::array& x, const mx::array& w, const mx::array& scales,
                         const mx::array& biases, int group_size, int bits, bool interleaved, bool int8,
                         mx::StreamOrDevice s);

// quantized_gemv of one x with each of several weights (a layer's q, k and v
// projections), x prepared once and the products one shared job.
std::vector<mx::array> quantized_gemvs(const mx::array& x, const std::vector<mx::array>& ws,
                                       const std::vector<mx::array>& scales, const std::vector<mx::array>& biases,
                                       int group_size, int bits, bool interleaved, bool int8, mx::StreamOrDevice s);

// mx.dequantize(w, scales, biases) for the layouts quantized_gemv takes, vectorised;
// interleaved: of interleave_quantized's layout, as W^T [K, N].
mx::array dequantize(const mx::array& w, const mx::array& scales, const mx::array& biases, int group_size,
                     int bits, bool interleaved, mx::StreamOrDevice s);

// mx.dequantize(w, scales, biases)[indices] for a weight in interleave_quantized's
// layout (with int8: its int8 one): a quantized embedding's rows when its
// table is the LM head's too.
mx::array take_interleaved(const mx::array& w, const mx::array& scales, const mx::array& biases,
                           const mx::array& indices, int group_size, int bits, bool int8, mx::StreamOrDevice s);

// (w, scales, biases) of MLX's affine layout in the interleaved one that
// quantized_gemv and dequantize take with interleaved (quantized_interleaved.h):
// the same shapes and sizes, computed now; weight false: w is interleaved
// already (returned as it is), only scales and biases are converted. int8:
// the layout quantized_gemv reads with int8 (quantized_int8.h's quads).
std::vector<mx::array> interleave_quantized(const mx::array& w, const mx::array& scales, const mx::array& biases,
                                            int group_size, int bits, bool weight, bool int8);

// What this build's products take: the one statement of their limits, which
// the runtime's plan reads (cpu/selection.py) rather than copies.
struct Limits {
  int dense_rows;        // most rows of x gemv and gemvs take
  int quantized_rows;    // ... quantized_gemv(s) against MLX's layout
  int interleaved_rows;  // ... against interleave_quantized's layout (int8 takes any number)
  int interleave_lanes;  // weight rows an interleaved block holds; 0: no interleaved layout
  std::vector<int> quantized_bits, quantized_groups;  // every layout; K a multiple of 256 / bits
  std::vector<int> int8_bits;  // the widths multiplied with int8 activations here
  bool bf16_dot = false;  // gemv's bf16_x: bf16 weights times x rounded to bf16 (AVX512_BF16)
  bool int8_tiles = false;  // int8 products take x's rows 16 at a time on AMX tiles (quantized_amx.h)
  bool bf16_tiles = false;  // bf16_x products take x's rows 16 at a time on AMX tiles (dense_amx.h)
};
Limits limits();

// silu(gate) * up for fp32 gate and up of one shape (swiglu.cpp).
mx::array silu_mul(const mx::array& gate, const mx::array& up, mx::StreamOrDevice s);

// x / sqrt(mean(x^2, axis=-1) + eps) * w for fp32 x and w [K] (or none): mx.fast.rms_norm
// as one op (rms_norm.cpp).
mx::array rms_norm(const mx::array& x, const std::optional<mx::array>& w, float eps, mx::StreamOrDevice s);

// w.astype(float32) for a 2-D bf16 w, vectorised where w's rows are contiguous.
mx::array widen_bf16(const mx::array& w, mx::StreamOrDevice s);

// mx.async_eval(outputs), queued a slice at a time for a graph with gemv
// nodes, the host running posted gemv chunks meanwhile.
void submit_helping(const std::vector<mx::array>& outputs);

// Wait until the queued array `a` is computed, running posted gemv chunks meanwhile.
void wait_helping(const mx::array& a);

// For tests only: arange(chunks) as float32, computed by a shared job of
// `chunks` chunks of which chunk `throwing` throws (-1: every one), so that a
// test can see a chunk's error reach the caller, whichever thread ran it.
mx::array debug_throwing_job(int chunks, int throwing, mx::StreamOrDevice s);

}  // namespace llm_pte
