// What every op of the extension shares: MLX's Primitive boilerplate
// (CpuPrimitive) and the checks of a factory's arguments (cpu_stream, the
// refusals' text).

#pragma once

#include <initializer_list>
#include <stdexcept>
#include <string>
#include <tuple>
#include <vector>

#include "mlx/array.h"
#include "mlx/backend/cpu/encoder.h"
#include "mlx/primitives.h"
#include "mlx/utils.h"

namespace llm_pte {

namespace mx = mlx::core;

// An op of this extension as MLX sees it. Op names itself (a static kName)
// and returns what tells two of its kind apart as a tuple (params(); none
// unless it declares one). Base: mx::Primitive, or SharedPrimitive for an op
// that posts SharedJobs (shared_work.h).
template <typename Op, typename Base = mx::Primitive>
class CpuPrimitive : public Base {
 public:
  using Base::Base;

  const char* name() const override { return Op::kName; }

  // MLX asks only of two ops of one type (compile's shared subgraphs).
  bool is_equivalent(const mx::Primitive& other) const override {
    return static_cast<const Op&>(*this).params() == static_cast<const Op&>(other).params();
  }

  void eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) override {
    throw std::runtime_error(std::string(Op::kName) + " runs on the CPU only");
  }

  std::tuple<> params() const { return {}; }

 protected:
  // The stream's encoder with the inputs and outputs bound, each output given
  // a buffer of its own.
  mx::cpu::CommandEncoder& bind(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) {
    for (auto& out : outputs) out.set_data(mx::allocator::malloc(out.nbytes()));
    auto& encoder = mx::cpu::get_command_encoder(this->stream());
    for (const auto& a : inputs) encoder.set_input_array(a);
    for (auto& a : outputs) encoder.set_output_array(a);
    return encoder;
  }
};

// A shape as the ops' refusals print it, "(1,3,64)". Refusals are built from
// std::string and std::to_string alone, never a stream: g++ 13 instantiates
// the stream templates inside this library, with locale facet ids of their
// own, and a number written to a string stream then crashed (SIGSEGV).
inline std::string text(const mx::Shape& shape) {
  std::string out = "(";
  for (size_t i = 0; i < shape.size(); ++i) out += (i ? "," : "") + std::to_string(shape[i]);
  return out + ")";
}

inline bool is_one_of(mx::Dtype type, std::initializer_list<mx::Dtype> types) {
  for (const auto& t : types)
    if (type == t) return true;
  return false;
}

// The stream a factory's op runs on: `s`, the CPU's default unless asked
// otherwise. Throws std::invalid_argument("op: why"), a ValueError in
// Python, for the first refusal the factory's own checks found (`why`, ""
// for none) or for another device's stream.
inline mx::Stream cpu_stream(const char* op, std::string why, mx::StreamOrDevice s) {
  const auto stream = mx::to_stream(s, mx::Device::cpu);
  if (why.empty() && stream.device != mx::Device::cpu) why = "runs on the CPU only";
  if (!why.empty()) throw std::invalid_argument(std::string(op) + ": " + why);
  return stream;
}

}  // namespace llm_pte
