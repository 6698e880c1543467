// One-row products (a decode step's linear layers) on MLX's CPU stream,
// shared with the host thread.
//
// A decode step reads every weight once in one-row products: 538 MB for
// SmolLM-135M in fp32; one core reads ~8 GB/s on our 2-core VM, two 11-16.
// MLX runs the step on its CPU stream thread, and its async_eval sleeps
// whenever ten tasks are queued, so the host thread sleeps through most of
// the step. Here the host submits the step itself (`submit_helping`): a
// slice of the graph whenever the stream's queue runs low. In between, and
// while it waits for the step's result (`wait_helping`), it runs chunks of
// the product the stream thread has posted, or, when none is posted, reads
// the next products' weights ahead into the shared L3 (`read_ahead`). When
// the host is busy building the next step in Python, the stream thread runs
// every chunk itself. Each output is one thread's dot product in a fixed
// order, so results do not depend on who ran which chunk.
//
// extension.py builds this with attention.cpp into one extension module.

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <deque>
#include <memory>
#include <sstream>
#include <stdexcept>
#include <unordered_set>
#include <vector>

#include <nanobind/nanobind.h>

#include "kernels.h"
#include "quantized_dot.h"
#include "quantized_rows.h"
#include "mlx/backend/cpu/encoder.h"
#include "mlx/ops.h"
#include "mlx/primitives.h"
#include "mlx/transforms.h"
#include "simd.h"

namespace nb = nanobind;

namespace llm_pte {
namespace {

// One product, split into chunks of output rows that any helping thread may run.
struct RowsJob {
  void (*rows)(const RowsJob&, int64_t lo, int64_t hi);  // y for W's rows [lo, hi)
  // a dense product (dense_rows): W fp32, or bf16 under fp32 compute
  const float* x;
  const void* w;
  float* y;
  int64_t K, N;
  int64_t w_row, w_col;  // strides of W [N, K] (W^T is the op's [K, N] operand)
  QuantizedRows q;  // a quantized product (quantized_rows) of q_rows rows of x
  int q_rows;
  int64_t chunk;
  int chunks;
  std::atomic<int> next{0}, done{0};
};

// Most rows of x a quantized product takes: a short chunk's, whose weights are
// read once (a longer chunk dequantizes them for BLAS, interp/ops/quant.py).
constexpr int kQuantizedRows = 16;

std::atomic<RowsJob*> posted_job{nullptr};
std::atomic<int> helpers_inside{0};  // host threads that may be reading posted_job

inline void relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield");
#endif
}

// y[n] = W[n, :] . x for n in [lo, hi): four rows at a time when each row is
// contiguous (how layout.py leaves linear weights when this op runs them),
// a plain strided loop otherwise. T: float, or uint16_t for bf16 weights,
// widened as they are loaded (exactly: a bf16 is the top half of an fp32).
template <typename T>
void dense_rows(const RowsJob& j, int64_t lo, int64_t hi) {
  const int64_t K = j.K;
  const T* W = static_cast<const T*>(j.w);
  if (j.w_col != 1) {
    for (int64_t n = lo; n < hi; ++n) {
      float s = 0.f;
      for (int64_t k = 0; k < K; ++k) s += widen(W[n * j.w_row + k * j.w_col]) * j.x[k];
      j.y[n] = s;
    }
    return;
  }
  const int64_t K8 = K / 8 * 8;
  int64_t n = lo;
  for (; n + 4 <= hi; n += 4) {
    const T *w0 = W + n * j.w_row, *w1 = w0 + j.w_row, *w2 = w1 + j.w_row, *w3 = w2 + j.w_row;
    f8 a0 = {}, a1 = {}, a2 = {}, a3 = {};
    for (int64_t k = 0; k < K8; k += 8) {
      const f8 x = load8(j.x + k);
      a0 += x * load8(w0 + k);
      a1 += x * load8(w1 + k);
      a2 += x * load8(w2 + k);
      a3 += x * load8(w3 + k);
    }
    float s[4] = {sum8(a0), sum8(a1), sum8(a2), sum8(a3)};
    for (int64_t k = K8; k < K; ++k) {
      s[0] += widen(w0[k]) * j.x[k], s[1] += widen(w1[k]) * j.x[k], s[2] += widen(w2[k]) * j.x[k], s[3] += widen(w3[k]) * j.x[k];
    }
    std::memcpy(j.y + n, s, sizeof s);
  }
  for (; n < hi; ++n) {
    const T* w = W + n * j.w_row;
    f8 a = {};
    int64_t k = 0;
    for (; k < K8; k += 8) a += load8(j.x + k) * load8(w + k);
    float s = sum8(a);
    for (; k < K; ++k) s += widen(w[k]) * j.x[k];
    j.y[n] = s;
  }
}

// Up to 4 rows of x per pass over a chunk of weight rows (the accumulators
// then fit the registers); more rows take more passes over the same chunk,
// which the first pass left in cache.
// The quantized kernel this build has: integer dot products on x86
// (quantized_dot.h), float FMAs elsewhere (quantized_rows.h).
template <int BITS, int M>
void quantized_rows_here(const QuantizedRows& r, int64_t lo, int64_t hi) {
#if LLM_PTE_INTEGER_DOT
  quantized_rows_integer<BITS, M>(r, lo, hi);
#else
  quantized_rows<BITS, M>(r, lo, hi);
#endif
}

template <int BITS>
void quantized_job_rows(const RowsJob& j, int64_t lo, int64_t hi) {
  const int64_t groups = j.q.K / j.q.group;
  for (int m = 0; m < j.q_rows; m += 4) {
    QuantizedRows r = j.q;
    r.xsum += m * groups, r.y += m * r.N;
    if (r.xp) r.xp += m * r.K;
#if LLM_PTE_INTEGER_DOT
    if (r.xq) r.xq += m * 2 * r.K, r.xd += m * (r.K / integer_span(BITS, r.group)) * kLanes32;
#endif
    switch (std::min(4, j.q_rows - m)) {
      case 1: quantized_rows_here<BITS, 1>(r, lo, hi); break;
      case 2: quantized_rows_here<BITS, 2>(r, lo, hi); break;
      case 3: quantized_rows_here<BITS, 3>(r, lo, hi); break;
      default: quantized_rows_here<BITS, 4>(r, lo, hi);
    }
  }
}

// Run chunks of `j` until none is left unclaimed.
void take_chunks(RowsJob& j) {
  if (j.next.load(std::memory_order_relaxed) >= j.chunks) return;  // all claimed: no needless RMW
  for (int c; (c = j.next.fetch_add(1, std::memory_order_relaxed)) < j.chunks;) {
    const int64_t lo = c * j.chunk;
    j.rows(j, lo, std::min(j.N, lo + j.chunk));
    j.done.fetch_add(1, std::memory_order_release);
  }
}

// On a stream thread: post `j` (unless another stream's job is posted), run
// chunks, and return once every chunk is done and no helper can still be
// reading `j`.
void run_shared(RowsJob& j) {
  RowsJob* none = nullptr;
  const bool posted = posted_job.compare_exchange_strong(none, &j);
  take_chunks(j);
  while (j.done.load(std::memory_order_acquire) < j.chunks) relax();
  if (posted) {
    posted_job.store(nullptr);
    while (helpers_inside.load() != 0) relax();
  }
}

// Weights of the products queued on the stream but not started yet, in
// order, which the host reads ahead into the shared L3 while the stream runs
// other ops and no product is posted: DRAM that would sit idle during
// attention and the element-wise ops then serves the next products. Host
// thread only; each entry holds its weight array, so what it reads stays
// allocated.
struct Upcoming {
  std::shared_ptr<std::atomic<bool>> started;  // set by the product's task, first thing
  mx::array weight;                            // keeps `data` allocated while listed
  const char* data;
  int64_t bytes, read;
};
thread_local std::deque<Upcoming> upcoming;
// Products queued from this thread whose task has not started (shared with
// the tasks, which count themselves out).
thread_local std::shared_ptr<std::atomic<int>> unstarted = std::make_shared<std::atomic<int>>(0);
// 12 MB: half this machine's L3 (read-ahead of 0, 4, 12 and 24 MB, one
// process, 4 rounds: decode 15.6-18.8, 17.5-18.7, 19.0-20.3, 17.9-19.7 tok/s)
constexpr int64_t kReadAheadBytes = 12 << 20;

void drop_started() {
  while (!upcoming.empty() && upcoming.front().started->load(std::memory_order_relaxed)) upcoming.pop_front();
}

// Read the next 4 KB of upcoming weights (one load per cache line), unless
// that would run more than kReadAheadBytes ahead. False: nothing to do.
bool read_ahead() {
  drop_started();
  int64_t ahead = 0;
  for (auto& e : upcoming) {
    if (e.read < e.bytes) {
      if (ahead + e.read >= kReadAheadBytes || e.started->load(std::memory_order_relaxed)) return false;
      const int64_t end = std::min(e.bytes, e.read + 4096);
      float sink = 0.f;
      for (int64_t at = e.read; at < end; at += 64) {
        float v;
        std::memcpy(&v, e.data + at, sizeof v);
        sink += v;
      }
      asm volatile("" : : "r"(sink));  // keep the loads
      e.read = end;
      return true;
    }
    ahead += e.bytes;
  }
  return false;
}

// x @ W^T run in chunks shared with the host thread: W fp32 ([K, N] as the
// op's operand), or affine-quantized as MLX stores it (bits > 0: W [N, K]
// packed, with scales and biases).
class SharedGemv : public mx::Primitive {
 public:
  SharedGemv(mx::Stream stream, int bits = 0, int group = 0)
      : mx::Primitive(stream), bits_(bits), group_(group) {}

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override {
    if (bits_) return eval_quantized(inputs, outputs);
    const auto &x = inputs[0], &w = inputs[1];
    auto& out = outputs[0];
    out.set_data(mx::allocator::malloc(out.nbytes()));
    auto& encoder = mx::cpu::get_command_encoder(stream());
    encoder.set_input_array(x);
    encoder.set_input_array(w);
    encoder.set_output_array(out);
    const float* xp = x.data<float>();
    const bool bf16 = w.dtype() == mx::bfloat16;
    const void* wp = w.data<void>();
    float* yp = out.data<float>();
    const int64_t K = w.shape(0), N = w.shape(1), x_step = x.strides().back();
    const int64_t w_row = w.strides(1), w_col = w.strides(0);
    auto started = std::make_shared<std::atomic<bool>>(false);
    auto queued_here = unstarted;
    queued_here->fetch_add(1);
    drop_started();
    if (w_col == 1) {  // rows contiguous: the weights are one span
      upcoming.push_back({started, w, static_cast<const char*>(wp), ((N - 1) * w_row + K) * int64_t(w.itemsize()), 0});
    }
    encoder.dispatch([=]() {
      started->store(true, std::memory_order_relaxed);
      queued_here->fetch_sub(1, std::memory_order_release);
      std::vector<float> packed;  // x is one row, but may be strided
      const float* xs = xp;
      if (x_step != 1) {
        packed.resize(K);
        for (int64_t k = 0; k < K; ++k) packed[k] = xp[k * x_step];
        xs = packed.data();
      }
      RowsJob j;
      j.rows = bf16 ? dense_rows<uint16_t> : dense_rows<float>;
      j.x = xs, j.w = wp, j.y = yp, j.K = K, j.N = N, j.w_row = w_row, j.w_col = w_col;
      // ~8k weights (32 KB) a chunk, whole groups of four rows: small enough
      // to share a 576-row product, large enough to stream
      j.chunk = std::max<int64_t>(4, 8192 / std::max<int64_t>(K, 1) / 4 * 4);
      j.chunks = int((N + j.chunk - 1) / j.chunk);
      run_shared(j);
    });
  }

  void eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) override {
    throw std::runtime_error("SharedGemv runs on the CPU only");
  }

  const char* name() const override { return "SharedGemv"; }

  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override {
    auto shape = inputs[0].shape();
    shape.back() = bits_ ? inputs[1].shape(0) : inputs[1].shape(1);
    return {shape};
  }

  bool is_equivalent(const mx::Primitive& other) const override {
    const auto& o = static_cast<const SharedGemv&>(other);
    return bits_ == o.bits_ && group_ == o.group_;
  }

 private:
  int bits_, group_;

  // x [..., M, K] (M <= kQuantizedRows) against W [N, K] stored as MLX's affine
  // quantization, read as stored (quantized_rows.h).
  void eval_quantized(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) {
    const auto &x = inputs[0], &w = inputs[1], &scales = inputs[2], &biases = inputs[3];
    auto& out = outputs[0];
    out.set_data(mx::allocator::malloc(out.nbytes()));
    auto& encoder = mx::cpu::get_command_encoder(stream());
    for (auto& a : inputs) encoder.set_input_array(a);
    encoder.set_output_array(out);
    const int64_t K = x.shape(-1), N = w.shape(0), M = x.size() / K;
    const int64_t x_col = x.strides().back(), x_row = x.ndim() >= 2 ? x.strides(-2) : K;
    const float* xp = x.data<float>();
    const uint32_t* wp = w.data<uint32_t>();
    const float *sp = scales.data<float>(), *bp = biases.data<float>();
    float* yp = out.data<float>();
    const int bits = bits_, group = group_;
    auto started = std::make_shared<std::atomic<bool>>(false);
    auto queued_here = unstarted;
    queued_here->fetch_add(1);
    drop_started();
    upcoming.push_back({started, w, reinterpret_cast<const char*>(wp), w.nbytes(), 0});
    encoder.dispatch([=]() {
      started->store(true, std::memory_order_relaxed);
      queued_here->fetch_sub(1, std::memory_order_release);
      RowsJob j;
      std::vector<float> sums(M * (K / group));
#if LLM_PTE_INTEGER_DOT
      std::vector<int16_t> rounded(M * 2 * K);
      std::vector<float> steps(M * (K / integer_span(bits, group)) * kLanes32);
      prepare_x(xp, x_row, x_col, int(M), K, bits, group, rounded.data(), steps.data(), sums.data());
      j.q = {wp, sp, bp, nullptr, sums.data(), rounded.data(), steps.data(), yp, K, N, group};
#else
      std::vector<float> permuted(M * K);
      permute_x(xp, x_row, x_col, int(M), K, bits, group, permuted.data(), sums.data());
      j.q = {wp, sp, bp, permuted.data(), sums.data(), nullptr, nullptr, yp, K, N, group};
#endif
      j.rows = bits == 4 ? quantized_job_rows<4> : quantized_job_rows<8>;
      j.q_rows = int(M);
      j.N = N;
      // ~32 KB of packed weights a chunk, as the fp32 product's chunks
      j.chunk = std::max<int64_t>(4, 32768 / std::max<int64_t>(w.shape(1) * 4, 1) / 4 * 4);
      j.chunks = int((N + j.chunk - 1) / j.chunk);
      run_shared(j);
    });
  }
};

// On the host thread, GIL released: run posted chunks while `busy()` holds.
template <typename Busy>
void help_while(Busy busy) {
  for (int spins = 0;; ++spins) {
    helpers_inside.fetch_add(1);
    RowsJob* j = posted_job.load();
    if (j) take_chunks(*j);
    helpers_inside.fetch_sub(1);
    if (spins % 16 == 0 && !busy()) return;
    if (j == nullptr && read_ahead()) continue;
    relax();
  }
}

// Every `stride`-th not yet scheduled array of the graph below `outputs`,
// inputs before the arrays that read them, and whether any is a gemv.
std::pair<std::vector<mx::array>, bool> checkpoints(const std::vector<mx::array>& outputs, size_t stride) {
  std::vector<mx::array> found;
  bool products = false;
  std::unordered_set<std::uintptr_t> seen;
  std::vector<std::pair<mx::array, size_t>> stack;  // an array, its next input to visit
  auto push = [&](const mx::array& a) {
    if (a.status() == mx::array::Status::unscheduled && a.has_primitive() && seen.insert(a.id()).second) {
      stack.emplace_back(a, 0);
    }
  };
  for (auto& a : outputs) push(a);
  for (size_t visited = 0; !stack.empty();) {
    auto& [a, next] = stack.back();
    if (next < a.inputs().size()) {
      const mx::array input = a.inputs()[next++];
      push(input);  // may move the stack: `a` is not used after this
      continue;
    }
    products = products || dynamic_cast<SharedGemv*>(&a.primitive()) != nullptr;
    if (++visited % stride == 0) found.push_back(a);
    stack.pop_back();
  }
  return {found, products};
}

constexpr size_t kNodesPerSlice = 20;  // a few hundred microseconds of small ops

}  // namespace

mx::array gemv(const mx::array& x, const mx::array& w, mx::StreamOrDevice s) {
  std::ostringstream err;
  if (x.dtype() != mx::float32 || (w.dtype() != mx::float32 && w.dtype() != mx::bfloat16)) {
    err << "x must be float32 and w float32 or bfloat16";
  } else if (w.ndim() != 2 || x.ndim() < 1 || x.shape(-1) != w.shape(0) || x.size() != x.shape(-1)) {
    err << "needs one row x [..., K] and w [K, N], got " << x.shape() << " and " << w.shape();
  }
  auto stream = mx::to_stream(s, mx::Device::cpu);
  if (err.str().empty() && stream.device != mx::Device::cpu) err << "runs on the CPU only";
  if (!err.str().empty()) throw std::invalid_argument("gemv: " + err.str());
  auto shape = x.shape();
  shape.back() = w.shape(1);
  return mx::array(shape, mx::float32, std::make_shared<SharedGemv>(stream), {x, w});
}

// The checks quantized_gemv and dequantize share: "" when w, scales, biases
// are a layout the row loops read.
std::string check_quantized(const mx::array& w, const mx::array& scales, const mx::array& biases, int64_t K,
                            int group_size, int bits) {
  std::ostringstream err;
  if (w.dtype() != mx::uint32 || scales.dtype() != mx::float32 || biases.dtype() != mx::float32) {
    err << "scales and biases must be float32 and w uint32";
  } else if (bits != 4 && bits != 8) {
    err << "bits must be 4 or 8, not " << bits;
  } else if (group_size != 32 && group_size != 64 && group_size != 128) {
    err << "group_size must be 32, 64 or 128, not " << group_size;
  } else if (w.ndim() != 2 || K == 0 || w.shape(1) * 32 / bits != K || K % group_size ||
             K % block_values(bits) || scales.shape() != mx::Shape{w.shape(0), int(K / group_size)} ||
             biases.shape() != scales.shape()) {
    err << "needs x [..., K], w [N, K * bits / 32] and scales, biases [N, K / group_size] with K a "
        << "multiple of " << block_values(bits) << ", got K " << K << ", w " << w.shape() << ", scales "
        << scales.shape();
  } else if (!w.flags().row_contiguous || !scales.flags().row_contiguous || !biases.flags().row_contiguous) {
    err << "w, scales and biases must be row-contiguous";
  }
  return err.str();
}

mx::array quantized_gemv(const mx::array& x, const mx::array& w, const mx::array& scales,
                         const mx::array& biases, int group_size, int bits, mx::StreamOrDevice s) {
  std::ostringstream err;
  const int64_t K = x.ndim() ? x.shape(-1) : 0;
  if (x.dtype() != mx::float32) {
    err << "x must be float32";
  } else if (std::string why = check_quantized(w, scales, biases, K, group_size, bits); !why.empty()) {
    err << why;
  } else if (x.size() / K > kQuantizedRows || (x.ndim() > 2 && x.size() / K != x.shape(-2) && x.size() != K)) {
    err << "takes at most " << kQuantizedRows << " rows in its last two axes, got " << x.shape();
  }
  auto stream = mx::to_stream(s, mx::Device::cpu);
  if (err.str().empty() && stream.device != mx::Device::cpu) err << "runs on the CPU only";
  if (!err.str().empty()) throw std::invalid_argument("quantized_gemv: " + err.str());
  auto shape = x.shape();
  shape.back() = w.shape(0);
  return mx::array(shape, mx::float32, std::make_shared<SharedGemv>(stream, bits, group_size),
                   {x, w, scales, biases});
}

// MLX's affine dequantization (4 or 8 bits, fp32 scales and biases) on the
// CPU, vectorised: what a prefill chunk's quantized products multiply with BLAS.
class Dequantize : public mx::UnaryPrimitive {
 public:
  Dequantize(mx::Stream stream, int bits, int group) : mx::UnaryPrimitive(stream), bits_(bits), group_(group) {}

  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override {
    const auto &w = inputs[0], &scales = inputs[1], &biases = inputs[2];
    out.set_data(mx::allocator::malloc(out.nbytes()));
    auto& encoder = mx::cpu::get_command_encoder(stream());
    for (auto& a : inputs) encoder.set_input_array(a);
    encoder.set_output_array(out);
    QuantizedRows r{w.data<uint32_t>(), scales.data<float>(), biases.data<float>(), nullptr, nullptr, nullptr, nullptr,
                    nullptr, out.shape(1), out.shape(0), group_};
    float* wp = out.data<float>();
    const int bits = bits_;
    encoder.dispatch([=]() {
      if (bits == 4) dequantize_rows<4>(r, wp, 0, r.N);
      else dequantize_rows<8>(r, wp, 0, r.N);
    });
  }

  void eval_gpu(const std::vector<mx::array>&, mx::array&) override {
    throw std::runtime_error("Dequantize runs on the CPU only");
  }

  const char* name() const override { return "Dequantize"; }

  bool is_equivalent(const mx::Primitive& other) const override {
    const auto& o = static_cast<const Dequantize&>(other);
    return bits_ == o.bits_ && group_ == o.group_;
  }

 private:
  int bits_, group_;
};

mx::array dequantize(const mx::array& w, const mx::array& scales, const mx::array& biases, int group_size,
                     int bits, mx::StreamOrDevice s) {
  std::string err = check_quantized(w, scales, biases, w.ndim() == 2 ? w.shape(1) * 32 / bits : 0,
                                    group_size, bits);
  auto stream = mx::to_stream(s, mx::Device::cpu);
  if (err.empty() && stream.device != mx::Device::cpu) err = "runs on the CPU only";
  if (!err.empty()) throw std::invalid_argument("dequantize: " + err);
  return mx::array({w.shape(0), int(w.shape(1) * 32 / bits)}, mx::float32,
                   std::make_shared<Dequantize>(stream, bits, group_size), {w, scales, biases});
}

// Wait until `a` is computed, helping while a product is posted or any
// queued from this thread has not started; then sleep in MLX's wait.
void wait_helping(const mx::array& a) {
  if (a.status() == mx::array::Status::unscheduled) return;  // nothing queued: .item() evaluates it
  nb::gil_scoped_release release;
  help_while([&] {
    return !a.is_available() && (posted_job.load() != nullptr || unstarted->load() > 0);
  });
  mx::array(a).wait();
  drop_started();  // what the read-ahead list still holds is done
}

// mx.async_eval(outputs); for a graph with gemv nodes (a decode step), a
// slice at a time: slice i is queued once slice i - 2 is computed, so the
// stream always has a slice in hand, and in between the host runs posted
// chunks and reads ahead. (This graph's own progress, not MLX's count of
// queued tasks, which covers every thread's streams.) Without a gemv there
// is nothing to help with: the host would only take a core from BLAS's
// threads.
void submit_helping(const std::vector<mx::array>& outputs) {
  const auto [slices, products] = checkpoints(outputs, kNodesPerSlice);
  nb::gil_scoped_release release;
  if (products) {
    for (size_t i = 0; i < slices.size(); ++i) {
      if (i >= 2) help_while([&] { return !slices[i - 2].is_available(); });
      mx::async_eval({slices[i]});
    }
    if (slices.size() >= 2) help_while([&] { return !slices[slices.size() - 2].is_available(); });
  }
  mx::async_eval(outputs);
}

}  // namespace llm_pte
