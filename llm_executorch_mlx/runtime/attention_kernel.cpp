// Fused attention for a few queries on MLX's CPU stream: one MLX op.
//
// MLX's CPU backend runs attention as ~10 ops (its fast SDPA falls back to
// them) with a BLAS call per kv head for each product and a scalar exp, which
// for a decode step costs ~0.5 ms a layer on a 2-core x86 machine, ten times
// the work. This primitive does the whole thing as one op: per query row it
// scores the keys of its kv head four at a time, takes a polynomial exp the
// compiler vectorises, and accumulates the values in registers (the rows
// sharing a kv head each read it; it stays in cache between them). fp32
// only; any strides (the cache hands over slices of its pools).
// attention_kernel.py builds it as an MLX extension (nanobind, in MLX's type
// domain) once per machine and checks it against MLX before use.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <sstream>
#include <stdexcept>
#include <vector>

#include <nanobind/nanobind.h>
#include <nanobind/stl/variant.h>

#include "mlx/backend/cpu/encoder.h"
#include "mlx/ops.h"
#include "mlx/primitives.h"
#include "mlx/utils.h"

namespace mx = mlx::core;
namespace nb = nanobind;
using namespace nb::literals;

namespace {

// e^x for x <= 0 (a softmax's shifted scores): Cody-Waite reduction to
// 2^n e^r with |r| <= ln2/2 and Cephes' degree-6 polynomial, ~1 ulp. Written
// without branches or libm calls so the loops around it vectorise.
inline float exp_nonpositive(float x) {
  x = std::max(x, -87.0f);  // 2^n stays a normal float
  float n = std::floor(x * 1.44269504088896341f + 0.5f);
  float r = x - n * 0.693359375f + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  float e = p * r * r + r + 1.0f;
  int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float two_n;
  std::memcpy(&two_n, &bits, sizeof two_n);
  return e * two_n;
}

struct Geometry {
  int B, Hq, Hkv, T, S, D;
  bool causal;
  float scale;
  mx::Strides q, k, v;  // in elements
};

// Eight floats: GCC/Clang vector extensions, AVX or NEON registers.
typedef float f8 __attribute__((vector_size(32)));

inline f8 load8(const float* p) {
  f8 x;
  std::memcpy(&x, p, sizeof x);
  return x;
}

inline float sum8(f8 x) {
  return ((x[0] + x[4]) + (x[1] + x[5])) + ((x[2] + x[6]) + (x[3] + x[7]));
}

// s[j] = q . k_j for j < n, keys of D (a multiple of 8) contiguous floats
// `stride` apart: four keys at a time, so four dot products are in flight.
void scores_of_row(const float* q, const float* k, int64_t stride, int n, int D, float* s) {
  int j = 0;
  for (; j + 4 <= n; j += 4) {
    const float *k0 = k + j * stride, *k1 = k0 + stride, *k2 = k1 + stride, *k3 = k2 + stride;
    f8 a0 = {}, a1 = {}, a2 = {}, a3 = {};
    for (int d = 0; d < D; d += 8) {
      const f8 x = load8(q + d);
      a0 += x * load8(k0 + d);
      a1 += x * load8(k1 + d);
      a2 += x * load8(k2 + d);
      a3 += x * load8(k3 + d);
    }
    s[j] = sum8(a0), s[j + 1] = sum8(a1), s[j + 2] = sum8(a2), s[j + 3] = sum8(a3);
  }
  for (; j < n; ++j) {
    f8 a = {};
    for (int d = 0; d < D; d += 8) a += load8(q + d) * load8(k + j * stride + d);
    s[j] = sum8(a);
  }
}

// out = sum_j p[j] v_j for j < n, accumulated 64 columns at a time in registers.
void weighted_values(const float* p, const float* v, int64_t stride, int n, int D, float* out) {
  for (int c = 0; c < D; c += 64) {
    const int w = std::min(64, D - c);  // a multiple of 8
    f8 a[8] = {};
    for (int j = 0; j < n; ++j) {
      const float* vj = v + j * stride + c;
      const f8 pj = f8{} + p[j];
      for (int i = 0; i < w / 8; ++i) a[i] += pj * load8(vj + 8 * i);
    }
    for (int i = 0; i < w / 8; ++i) std::memcpy(out + c + 8 * i, &a[i], sizeof(f8));
  }
}

// out[b, h, t, :] = softmax(scale * q[b, h, t] . k[b, h / rep, :S']) v[...],
// S' = S, or S - T + t + 1 when causal (the queries are the last T positions).
void attend(const float* q, const float* k, const float* v, float* out, const Geometry& g) {
  const int rep = g.Hq / g.Hkv, rows = rep * g.T, D = g.D, S = g.S;
  const bool fast = D % 8 == 0 && g.k[3] == 1 && g.v[3] == 1;
  std::vector<float> scores(S), qrow(D), acc(D);
  for (int b = 0; b < g.B; ++b) {
    for (int h = 0; h < g.Hkv; ++h) {
      const float* kh = k + b * g.k[0] + h * g.k[1];
      const float* vh = v + b * g.v[0] + h * g.v[1];
      for (int r = 0; r < rows; ++r) {
        const int head = h * rep + r / g.T, t = r % g.T;
        const int n = g.causal ? S - g.T + t + 1 : S;
        const float* src = q + b * g.q[0] + head * g.q[1] + t * g.q[2];
        for (int d = 0; d < D; ++d) qrow[d] = src[d * g.q[3]] * g.scale;
        if (fast) {
          scores_of_row(qrow.data(), kh, g.k[2], n, D, scores.data());
        } else {
          for (int j = 0; j < n; ++j) {
            float s = 0.0f;
            for (int d = 0; d < D; ++d) s += qrow[d] * kh[j * g.k[2] + d * g.k[3]];
            scores[j] = s;
          }
        }
        float m = -INFINITY;
        for (int j = 0; j < n; ++j) m = std::max(m, scores[j]);
        float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
        for (int j = 0; j < n; ++j) {
          scores[j] = exp_nonpositive(scores[j] - m);
          sum += scores[j];
        }
        if (fast) {
          weighted_values(scores.data(), vh, g.v[2], n, D, acc.data());
        } else {
          std::fill(acc.begin(), acc.end(), 0.0f);
          for (int j = 0; j < n; ++j)
            for (int d = 0; d < D; ++d) acc[d] += scores[j] * vh[j * g.v[2] + d * g.v[3]];
        }
        float* o = out + ((static_cast<size_t>(b) * g.Hq + head) * g.T + t) * D;
        const float inv = 1.0f / sum;
        for (int d = 0; d < D; ++d) o[d] = acc[d] * inv;
      }
    }
  }
}

class FewQueryAttention : public mx::Primitive {
 public:
  FewQueryAttention(mx::Stream stream, float scale, bool causal)
      : mx::Primitive(stream), scale_(scale), causal_(causal) {}

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override {
    const auto &q = inputs[0], &k = inputs[1], &v = inputs[2];
    auto& out = outputs[0];
    out.set_data(mx::allocator::malloc(out.nbytes()));
    auto& encoder = mx::cpu::get_command_encoder(stream());
    encoder.set_input_array(q);
    encoder.set_input_array(k);
    encoder.set_input_array(v);
    encoder.set_output_array(out);
    Geometry g{q.shape(0), q.shape(1), k.shape(1), q.shape(2), k.shape(2), q.shape(3),
               causal_,   scale_,     q.strides(), k.strides(), v.strides()};
    encoder.dispatch([qp = q.data<float>(), kp = k.data<float>(), vp = v.data<float>(),
                      op = out.data<float>(), g]() { attend(qp, kp, vp, op, g); });
  }

  void eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) override {
    throw std::runtime_error("FewQueryAttention runs on the CPU only");
  }

  const char* name() const override { return "FewQueryAttention"; }

  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override {
    return {inputs[0].shape()};
  }

  bool is_equivalent(const mx::Primitive& other) const override {
    auto& o = static_cast<const FewQueryAttention&>(other);
    return scale_ == o.scale_ && causal_ == o.causal_;
  }

 private:
  float scale_;
  bool causal_;
};

mx::array few_query_attention(const mx::array& q, const mx::array& k, const mx::array& v,
                              float scale, bool causal, mx::StreamOrDevice s) {
  std::ostringstream err;
  if (q.ndim() != 4 || k.ndim() != 4 || v.ndim() != 4) {
    err << "q, k and v must be 4-D, got " << q.shape() << ", " << k.shape() << ", " << v.shape();
  } else if (q.dtype() != mx::float32 || k.dtype() != mx::float32 || v.dtype() != mx::float32) {
    err << "q, k and v must be float32";
  } else if (k.shape() != v.shape() || k.shape(0) != q.shape(0) || k.shape(3) != q.shape(3) ||
             k.shape(1) == 0 || q.shape(1) % k.shape(1) != 0) {
    err << "incompatible shapes q " << q.shape() << ", k " << k.shape() << ", v " << v.shape();
  } else if (k.shape(2) == 0) {
    err << "no keys to attend to";
  } else if (causal && q.shape(2) > k.shape(2)) {
    err << "causal attention with more queries than keys";
  }
  auto stream = mx::to_stream(s, mx::Device::cpu);  // the CPU unless asked otherwise
  if (err.str().empty() && stream.device != mx::Device::cpu) err << "runs on the CPU only";
  if (!err.str().empty()) throw std::invalid_argument("few_query_attention: " + err.str());
  return mx::array(q.shape(), mx::float32,
                   std::make_shared<FewQueryAttention>(stream, scale, causal), {q, k, v});
}

}  // namespace

NB_MODULE(attention_kernel, m) {
  m.def("few_query_attention", &few_query_attention, "q"_a, "k"_a, "v"_a, "scale"_a,
        "causal"_a = false, nb::kw_only(), "stream"_a = nb::none(),
        "softmax(scale * q k^T) v for q [B, Hq, T, D] and k, v [B, Hkv, S, D], fp32, on the CPU");
}
