// RMSNorm of fp32 rows on MLX's CPU stream, one op: y = x / sqrt(mean(x^2) +
// eps) * w. MLX's CPU runs mx.fast.rms_norm as ten nodes, and the compiled
// MLX-op version (interp/ops/nn.py) as three; at ~60 norms a decode step of a
// 30-layer model, each node's dispatch cost more than its arithmetic.
// Rounding: the squares summed in fp32 eight lanes wide (MLX sums in fp32
// too, in another order), then x * rsqrt(...) * w, as MLX multiplies.

#include <cmath>
#include <cstdint>
#include <stdexcept>
#include <string>

#include "kernels.h"
#include "mlx/backend/common/utils.h"
#include "primitive.h"
#include "simd.h"

namespace llm_pte {
namespace {

// y = x * (1 / sqrt(mean(x^2) + eps)) * w for one contiguous row of K values
// (w null: no weight).
void norm_row(const float* x, const float* w, float* y, int64_t K, float eps) {
  f8 acc = {};
  int64_t k = 0;
  for (; k + 8 <= K; k += 8) {
    const f8 v = load8(x + k);
    acc += v * v;
  }
  float squares = sum8(acc);
  for (; k < K; ++k) squares += x[k] * x[k];
  const float r = 1.0f / std::sqrt(squares / float(K) + eps);
  const f8 rs = splat(r);
  k = 0;
  for (; k + 8 <= K; k += 8) store8(y + k, w ? load8(x + k) * rs * load8(w + k) : load8(x + k) * rs);
  for (; k < K; ++k) y[k] = w ? x[k] * r * w[k] : x[k] * r;
}

class RmsNorm : public CpuPrimitive<RmsNorm> {
 public:
  static constexpr const char* kName = "RmsNorm";
  RmsNorm(mx::Stream stream, float eps) : CpuPrimitive(stream), eps_(eps) {}
  auto params() const { return std::tuple(eps_); }

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override {
    const auto& x = inputs[0];
    const bool weighted = inputs.size() > 1;
    auto& encoder = bind(inputs, outputs);
    auto& out = outputs[0];
    const int64_t K = x.shape(-1), rows = K ? x.size() / K : 0;
    const float* xp = x.data<float>();
    const float* wp = weighted ? inputs[1].data<float>() : nullptr;
    const int64_t w_step = weighted ? inputs[1].strides(0) : 1;
    float* y = out.data<float>();
    const float eps = eps_;
    const bool contiguous = x.flags().row_contiguous && w_step == 1;
    encoder.dispatch([=, shape = x.shape(), strides = x.strides()]() {
      if (contiguous) {
        for (int64_t r = 0; r < rows; ++r) norm_row(xp + r * K, wp, y + r * K, K, eps);
        return;
      }
      // a view: each row gathered, then normalised as a contiguous one
      std::vector<float> row(K), weight(weighted ? K : 0);
      for (int64_t k = 0; k < int64_t(weight.size()); ++k) weight[k] = wp[k * w_step];
      for (int64_t r = 0; r < rows; ++r) {
        for (int64_t k = 0; k < K; ++k) row[k] = xp[mx::elem_to_loc(r * K + k, shape, strides)];
        norm_row(row.data(), weighted ? weight.data() : nullptr, y + r * K, K, eps);
      }
    });
  }

 private:
  float eps_;
};

}  // namespace

mx::array rms_norm(const mx::array& x, const std::optional<mx::array>& w, float eps, mx::StreamOrDevice s) {
  std::string err;
  if (x.dtype() != mx::float32 || (w && w->dtype() != mx::float32)) {
    err = "x and the weight must be float32";
  } else if (x.ndim() < 1 || x.shape(-1) < 1) {
    err = "x must have a last axis of at least one value";
  } else if (w && (w->ndim() != 1 || w->shape(0) != x.shape(-1))) {
    err = "the weight must be one value per entry of x's last axis";
  }
  const auto stream = cpu_stream("rms_norm", err, s);
  std::vector<mx::array> inputs{x};
  if (w) inputs.push_back(*w);
  return mx::array(x.shape(), mx::float32, std::make_shared<RmsNorm>(stream, eps), std::move(inputs));
}

}  // namespace llm_pte
