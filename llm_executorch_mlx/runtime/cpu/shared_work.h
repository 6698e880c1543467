// Work a stream thread shares with the host thread while the host submits a
// step or waits for it (shared_work.cpp): the decode step's products
// (gemv.cpp) and its attention (attention.cpp) post their chunks here.

#pragma once

#include <atomic>
#include <cstdint>
#include <exception>
#include <memory>

#include "mlx/array.h"
#include "mlx/primitives.h"

namespace llm_pte {

namespace mx = mlx::core;

// One op's work, split into `chunks` chunks of `chunk` of its `items` items
// (output rows, attention rows) that any helping thread may run. A chunk
// that throws ends the job: the chunks not yet started are skipped, and
// run_shared rethrows the first error once every chunk is accounted for.
struct SharedJob {
  void (*run)(const SharedJob&, int64_t lo, int64_t hi);  // items [lo, hi)
  const void* task;  // what `run` reads: the op's own description of its work
  int64_t items, chunk;
  int chunks;
  std::atomic<int> next{0}, done{0};
  std::atomic<bool> failed{false};
  std::exception_ptr error;  // the first thrown, written by the thread that set `failed`

  SharedJob(void (*run)(const SharedJob&, int64_t, int64_t), const void* task, int64_t items, int64_t chunk)
      : run(run), task(task), items(items), chunk(chunk), chunks(int((items + chunk - 1) / chunk)) {}
};

// On a stream thread: post `j` for the host (unless another stream's job is
// posted), run chunks, and return once every chunk is done and no helper can
// still be reading `j`; then rethrow a chunk's error, which MLX hands to
// whoever waits for the op's outputs.
void run_shared(SharedJob& j);

// Whether the host helps with the graph last submitted (submit_helping found
// an op in it that shares its work): an op whose work is worth sharing only
// then (a prefill chunk's attention, which beside BLAS's products would take
// a core from BLAS's threads) posts it only then.
bool host_helps();

// An op that posts SharedJobs: a graph with one that shares its work is worth
// submitting a slice at a time (submit_helping).
class SharedPrimitive : public mx::Primitive {
 public:
  using mx::Primitive::Primitive;
  virtual bool shares_work() const { return true; }
};

// For an op's eval_cpu (on the host thread, as the graph is queued): its
// weights, which the host may read ahead into cache while earlier ops run.
// The returned flag is the task's to set, first thing, when it starts.
std::shared_ptr<std::atomic<bool>> read_ahead_later(const mx::array& weight, const void* data, int64_t bytes);

}  // namespace llm_pte
