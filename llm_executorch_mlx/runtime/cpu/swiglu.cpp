// silu(gate) * up = gate * up / (1 + e^-gate) on MLX's CPU stream, one op
// with a polynomial exp eight lanes wide (simd.h). MLX's sigmoid evaluates
// its exp one element at a time, and its multiplies are nodes of their own:
// every layer's SwiGLU pays both, in decode and prefill alike.

#include <cstdint>
#include <string>
#include <stdexcept>

#include "kernels.h"
#include "mlx/backend/common/utils.h"
#include "primitive.h"
#include "simd.h"

namespace llm_pte {
namespace {

inline f8 silu_mul8(f8 g, f8 u) { return g * u / (1.0f + exp8(-g)); }

class SiluMul : public CpuPrimitive<SiluMul> {
 public:
  static constexpr const char* kName = "SiluMul";
  using CpuPrimitive::CpuPrimitive;

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override {
    const auto &gate = inputs[0], &up = inputs[1];
    auto& encoder = bind(inputs, outputs);
    auto& out = outputs[0];
    const float *g = gate.data<float>(), *u = up.data<float>();
    float* y = out.data<float>();
    const int64_t n = out.size();
    if (gate.flags().row_contiguous && up.flags().row_contiguous) {
      encoder.dispatch([=]() {
        int64_t i = 0;
        for (; i + 8 <= n; i += 8) store8(y + i, silu_mul8(load8(g + i), load8(u + i)));
        if (i < n) {  // the last few, through a padded vector
          float gs[8] = {}, us[8] = {}, ys[8];
          for (int64_t j = i; j < n; ++j) gs[j - i] = g[j], us[j - i] = u[j];
          store8(ys, silu_mul8(load8(gs), load8(us)));
          for (int64_t j = i; j < n; ++j) y[j] = ys[j - i];
        }
      });
      return;
    }
    // views: element by element, through the same exp
    encoder.dispatch([=, gs = gate.shape(), gst = gate.strides(), ust = up.strides()]() {
      for (int64_t i = 0; i < n; ++i) {
        const f8 v = silu_mul8(splat(g[mx::elem_to_loc(i, gs, gst)]), splat(u[mx::elem_to_loc(i, gs, ust)]));
        y[i] = v[0];
      }
    });
  }
};

}  // namespace

mx::array silu_mul(const mx::array& gate, const mx::array& up, mx::StreamOrDevice s) {
  std::string err;
  if (gate.dtype() != mx::float32 || up.dtype() != mx::float32) {
    err = "gate and up must be float32";
  } else if (gate.shape() != up.shape()) {
    err = "gate and up must have one shape, got " + text(gate.shape()) + " and " + text(up.shape());
  }
  const auto stream = cpu_stream("silu_mul", err, s);
  return mx::array(gate.shape(), mx::float32, std::make_shared<SiluMul>(stream), {gate, up});
}

}  // namespace llm_pte
