// memory_ledger.h -- per-device memory curves of a placement, updated in
// O(k log n) when an op changes device (k: the tensors it touches), for the
// S3 memory repair and refinement.
//
// Entry point: MemoryLedger(problem, device_of_op); move(op, device), peak(),
// peak_op(), value_at(), excess(caps), bytes_moved().
//
// Invariant (checked by the tests against evaluate_partition): for every
// device d and op i, value_at(d, i) == the bytes evaluate_partition counts on
// d during op i, and count(t, d) == the number of t's reasons placed on d.
#pragma once

#include <cstdint>
#include <vector>

#include "core/partition/partition_problem.h"

namespace memsched {

class MemoryLedger {
 public:
  MemoryLedger(const PartitionProblem& problem, std::vector<int> device_of_op);

  void move(int64_t op, int device);
  int device_of(int64_t op) const { return assignment_[op]; }
  const std::vector<int>& assignment() const { return assignment_; }

  int64_t peak(int device) const { return trees_[device].max(); }
  int64_t peak_op(int device) const { return trees_[device].argmax(); }
  int64_t value_at(int device, int64_t op) const { return trees_[device].value_at(op); }
  int32_t count(int64_t tensor, int device) const { return count_[tensor * num_devices_ + device]; }
  // Sum over devices of max(0, peak - cap).
  int64_t excess(const std::vector<int64_t>& caps) const;
  int64_t bytes_moved() const { return present_bytes_ - owned_bytes_; }

 private:
  // Range add, global max and its first index, point value: mx[node] = max(children) + add[node].
  class MaxTree {
   public:
    void init(int64_t n);
    void add(int64_t l, int64_t r, int64_t v) { add(1, 0, size_ - 1, l, r, v); }
    int64_t max() const { return mx_[1]; }
    int64_t argmax() const;
    int64_t value_at(int64_t i) const;

   private:
    void add(int64_t node, int64_t lo, int64_t hi, int64_t l, int64_t r, int64_t v);
    int64_t size_ = 1;
    int64_t n_ = 1;
    std::vector<int64_t> mx_, add_;
  };

  void change(int64_t tensor, int device, int delta);

  const PartitionProblem& problem_;
  int num_devices_;
  std::vector<int> assignment_;
  std::vector<int32_t> count_;  // T * D: reasons of tensor t on device d
  std::vector<MaxTree> trees_;
  int64_t present_bytes_ = 0;   // sum over (tensor, device present) of bytes
  int64_t owned_bytes_ = 0;     // sum over tensors of bytes (each is present somewhere)
};

}  // namespace memsched
