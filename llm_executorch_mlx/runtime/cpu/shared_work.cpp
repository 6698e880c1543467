// Sharing a step's work with the host thread.
//
// A decode step reads every weight once in one-row products: 538 MB for
// SmolLM-135M in fp32. MLX runs the step on its CPU stream thread, and its
// async_eval sleeps whenever ten tasks are queued, so the host thread would
// sleep through most of the step. Here the host submits the step itself
// (`submit_helping`): a slice of the graph whenever the stream's queue runs
// low. In between, and while it waits for the step's result
// (`wait_helping`), it runs chunks of the job the stream thread has posted
// (a product's rows, attention's query rows), or, when none is posted, reads
// the next products' weights ahead into cache (`read_ahead`). When the host is
// busy building the next step in Python, the stream thread runs every chunk
// itself. Each item is one thread's work in a fixed order, so results do not
// depend on who ran which chunk.

#include <algorithm>
#include <chrono>
#include <cstring>
#include <deque>
#include <stdexcept>
#include <string>
#include <thread>
#include <unordered_set>
#include <vector>

#include <nanobind/nanobind.h>

#include "kernels.h"
#include "mlx/transforms.h"
#include "primitive.h"
#include "shared_work.h"

namespace nb = nanobind;

namespace llm_pte {
namespace {

std::atomic<SharedJob*> posted_job{nullptr};
std::atomic<int> helpers_inside{0};  // host threads that may be reading posted_job
std::atomic<bool> helping{false};  // host_helps()

inline void relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield");
#endif
}

// Run chunks of `j` until none is left unclaimed. Never throws: a chunk's
// error is kept for run_shared, and each claimed chunk is counted done
// whatever became of it, or the stream thread would wait for it for ever.
void take_chunks(SharedJob& j) {
  if (j.next.load(std::memory_order_relaxed) >= j.chunks) return;  // all claimed: no needless RMW
  for (int c; (c = j.next.fetch_add(1, std::memory_order_relaxed)) < j.chunks;) {
    if (!j.failed.load(std::memory_order_relaxed)) {
      try {
        const int64_t lo = c * j.chunk;
        j.run(j, lo, std::min(j.items, lo + j.chunk));
      } catch (...) {
        if (!j.failed.exchange(true)) j.error = std::current_exception();
      }
    }
    j.done.fetch_add(1, std::memory_order_release);
  }
}

// Weights of the ops queued on the stream but not started yet, in order,
// which the host reads ahead into cache while the stream runs other ops and
// no job is posted: DRAM that would sit idle during the element-wise ops then
// serves the next products. Host thread only; each entry holds its weight
// array, so what it reads stays allocated.
struct Upcoming {
  std::shared_ptr<std::atomic<bool>> started;  // set by the op's task, first thing
  mx::array weight;                            // keeps `data` allocated while listed
  const char* data;
  int64_t bytes, read;
};
thread_local std::deque<Upcoming> upcoming;
// About half a small server's L3: read further ahead and the weights read
// first are evicted before their product runs; much less, and DRAM idles
// through the element-wise ops again.
constexpr int64_t kReadAheadBytes = 12 << 20;

void drop_started() {
  while (!upcoming.empty() && upcoming.front().started->load(std::memory_order_relaxed)) upcoming.pop_front();
}

// Whether ops listed in `upcoming` from this thread have not started yet.
bool any_unstarted() {
  drop_started();
  return !upcoming.empty();
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

// On the host thread, GIL released: run posted chunks while `busy()` holds.
template <typename Busy>
void help_while(Busy busy) {
  for (int spins = 0;; ++spins) {
    helpers_inside.fetch_add(1);
    SharedJob* j = posted_job.load();
    if (j) take_chunks(*j);
    helpers_inside.fetch_sub(1);
    if (spins % 16 == 0 && !busy()) return;
    if (j == nullptr && read_ahead()) continue;
    if (j == nullptr && spins % 64 == 63) {
      // Nothing to help with or read ahead: give the core away now and
      // then. Where threads outnumber cores (the ranks of a group on one
      // machine), a host spinning here holds a core that its own stream
      // thread, or another rank waiting on this one, needs.
      std::this_thread::yield();
    } else {
      relax();
    }
  }
}

// Every `stride`-th not yet scheduled array of the graph below `outputs`,
// inputs before the arrays that read them, and whether any op shares its work.
std::pair<std::vector<mx::array>, bool> checkpoints(const std::vector<mx::array>& outputs, size_t stride) {
  std::vector<mx::array> found;
  bool shared = false;
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
    if (auto* op = dynamic_cast<SharedPrimitive*>(&a.primitive())) shared = shared || op->shares_work();
    if (++visited % stride == 0) found.push_back(a);
    stack.pop_back();
  }
  return {found, shared};
}

constexpr size_t kNodesPerSlice = 20;  // a few hundred microseconds of small ops

}  // namespace

bool host_helps() { return helping.load(std::memory_order_relaxed); }

void run_shared(SharedJob& j) {
  SharedJob* none = nullptr;
  const bool posted = posted_job.compare_exchange_strong(none, &j);
  take_chunks(j);
  while (j.done.load(std::memory_order_acquire) < j.chunks) relax();
  if (posted) {
    posted_job.store(nullptr);
    while (helpers_inside.load() != 0) relax();
  }
  if (j.error) std::rethrow_exception(j.error);
}

std::shared_ptr<std::atomic<bool>> read_ahead_later(const mx::array& weight, const void* data, int64_t bytes) {
  auto started = std::make_shared<std::atomic<bool>>(false);
  drop_started();
  upcoming.push_back({started, weight, static_cast<const char*>(data), bytes, 0});
  return started;
}

// Wait until `a` is computed, helping: to the end where the host helps with
// the graph (a decode step's: a host asleep in MLX's wait is woken late, and
// the stream thread meanwhile runs a posted job alone, as it did the LM head
// of a small model's step), else while a job is posted or any op queued from
// this thread has not started; then sleep in MLX's wait.
void wait_helping(const mx::array& a) {
  if (a.status() == mx::array::Status::unscheduled) return;  // nothing queued: .item() evaluates it
  nb::gil_scoped_release release;
  help_while([&] {
    return !a.is_available() && (host_helps() || posted_job.load() != nullptr || any_unstarted());
  });
  mx::array(a).wait();
  drop_started();  // what the read-ahead list still holds is done
}

// mx.async_eval(outputs); for a graph with ops that post jobs (a decode
// step), a slice at a time: slice i is queued once slice i - 2 is computed,
// so the stream always has a slice in hand, and in between the host runs
// posted chunks and reads ahead. (This graph's own progress, not MLX's count
// of queued tasks, which covers every thread's streams.) Without such an op
// there is nothing to help with: the host would only take a core from BLAS's
// threads.
void submit_helping(const std::vector<mx::array>& outputs) {
  const auto [slices, shared] = checkpoints(outputs, kNodesPerSlice);
  helping.store(shared, std::memory_order_relaxed);
  nb::gil_scoped_release release;
  if (shared) {
    for (size_t i = 0; i < slices.size(); ++i) {
      if (i >= 2) help_while([&] { return !slices[i - 2].is_available(); });
      mx::async_eval({slices[i]});
    }
    if (slices.size() >= 2) help_while([&] { return !slices[slices.size() - 2].is_available(); });
  }
  mx::async_eval(outputs);
}

namespace {

// debug_throwing_job's op: y[c] = c, chunk c of the job writing it after a
// millisecond's sleep (long enough for a helping host to take chunks too),
// or throwing if it is chunk `throwing` (every chunk: -1).
struct ThrowingTask {
  float* y;
  int throwing;
};

void sleep_then_write_or_throw(const SharedJob& job, int64_t lo, int64_t hi) {
  const auto& task = *static_cast<const ThrowingTask*>(job.task);
  std::this_thread::sleep_for(std::chrono::milliseconds(1));
  for (int64_t c = lo; c < hi; ++c) {
    if (task.throwing < 0 || c == task.throwing) throw std::runtime_error("chunk " + std::to_string(c) + " threw");
    task.y[c] = float(c);
  }
}

class ThrowingJob : public CpuPrimitive<ThrowingJob, SharedPrimitive> {
 public:
  static constexpr const char* kName = "ThrowingJob";
  ThrowingJob(mx::Stream stream, int throwing) : CpuPrimitive(stream), throwing_(throwing) {}
  auto params() const { return std::tuple(throwing_); }

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override {
    auto& encoder = bind(inputs, outputs);
    encoder.dispatch([y = outputs[0].data<float>(), chunks = outputs[0].size(), throwing = throwing_]() {
      ThrowingTask task{y, throwing};
      SharedJob job(sleep_then_write_or_throw, &task, int64_t(chunks), 1);
      run_shared(job);
    });
  }

 private:
  int throwing_;
};

}  // namespace

mx::array debug_throwing_job(int chunks, int throwing, mx::StreamOrDevice s) {
  const auto stream = cpu_stream("debug_throwing_job", chunks > 0 ? "" : "needs one or more chunks", s);
  return mx::array({chunks}, mx::float32, std::make_shared<ThrowingJob>(stream, throwing), {});
}

}  // namespace llm_pte
