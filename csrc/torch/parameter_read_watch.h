// parameter_read_watch.h -- which parameters a training iteration reads where a fused optimizer
// update would hand them already stepped: an observer of every aten op (a RecordFunction callback,
// C++, no dispatch mode), on while an OutOfOrderBackward without memsched.optimize's profile watches
// its first fused iteration.
//
// Entry point: ParameterReadWatch (owned by DwRuntime::set_watch; See Note [The first fused iteration
// watches its parameter reads] in python/memsched/ooo/backward.py).
#pragma once

#include <ATen/ATen.h>
#include <c10/core/StorageImpl.h>

#include <cstdint>
#include <unordered_map>
#include <vector>

namespace memsched {

// While any ParameterReadWatch exists, a global RecordFunction callback sees the tensor arguments
// of every aten op on every thread; it is removed with the last one. An argument of an op run inside
// backward (a graph task runs on this thread: the autograd engine's nodes and the hooks it calls), on
// the storage of a watched parameter whose gradient is already final in this iteration (mark_final),
// is a hit: a node, a hook or a custom Function's backward reading it late. Only the outermost op's
// arguments count (not those of ops its kernel calls).
// Thread-safe: one process-wide mutex, never held while an op runs. The storage map and final marks are
// this watch's own copies of DwRuntime's: the observer runs inside ops DwRuntime itself runs while holding
// its mutex (sums, casts), so it cannot take that mutex to read them.
class ParameterReadWatch {
 public:
  ParameterReadWatch();
  ~ParameterReadWatch();
  ParameterReadWatch(const ParameterReadWatch&) = delete;
  ParameterReadWatch& operator=(const ParameterReadWatch&) = delete;

  // A new iteration over `params` (their storages now: `p.data = ...` between iterations moves one):
  // clears the final marks.
  void begin_iteration(const std::vector<at::Tensor>& params);
  // The parameter's gradient is final in this iteration.
  void mark_final(int32_t param);
  // Parameters hit since the watch began, in index order.
  std::vector<int32_t> hits() const;

  // Called by the observer, under the process-wide mutex.
  void see(const at::Tensor& t);

 private:
  std::unordered_map<const c10::StorageImpl*, std::vector<int32_t>> by_storage_;
  std::vector<uint8_t> final_;
  std::vector<uint8_t> hit_;
};

}  // namespace memsched
