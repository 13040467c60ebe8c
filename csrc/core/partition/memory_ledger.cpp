// memory_ledger.cpp -- the incremental per-device memory curves.
#include "core/partition/memory_ledger.h"

#include <algorithm>

#include "core/check.h"
#include "core/partition/partition_eval.h"

namespace memsched {

void MemoryLedger::MaxTree::init(int64_t n) {
  n_ = std::max<int64_t>(n, 1);
  size_ = 1;
  while (size_ < n_) size_ *= 2;
  mx_.assign(2 * size_, 0);
  add_.assign(2 * size_, 0);
}

void MemoryLedger::MaxTree::add(int64_t node, int64_t lo, int64_t hi, int64_t l, int64_t r, int64_t v) {
  if (r < lo || hi < l) return;
  if (l <= lo && hi <= r) {
    mx_[node] += v;
    add_[node] += v;
    return;
  }
  const int64_t mid = (lo + hi) / 2;
  add(2 * node, lo, mid, l, r, v);
  add(2 * node + 1, mid + 1, hi, l, r, v);
  mx_[node] = std::max(mx_[2 * node], mx_[2 * node + 1]) + add_[node];
}

int64_t MemoryLedger::MaxTree::argmax() const {
  // Leaves past n_ hold 0 and no interval reaches them; a curve of all zeros peaks at op 0.
  int64_t node = 1;
  int64_t want = mx_[1];
  while (node < size_) {
    want -= add_[node];
    node = mx_[2 * node] == want ? 2 * node : 2 * node + 1;
  }
  return std::min(node - size_, n_ - 1);
}

int64_t MemoryLedger::MaxTree::value_at(int64_t i) const {
  int64_t node = size_ + i;
  int64_t v = mx_[node];
  for (node /= 2; node >= 1; node /= 2) v += add_[node];
  return v;
}

MemoryLedger::MemoryLedger(const PartitionProblem& problem, std::vector<int> device_of_op)
    : problem_(problem), num_devices_(static_cast<int>(problem.num_devices())), assignment_(std::move(device_of_op)) {
  check_assignment(problem, assignment_);
  const auto& tensors = problem.tensors();
  count_.assign(tensors.size() * num_devices_, 0);
  trees_.resize(num_devices_);
  for (auto& tree : trees_) tree.init(problem.num_ops());
  for (size_t t = 0; t < tensors.size(); ++t) {
    owned_bytes_ += tensors[t].bytes;
    if (tensors[t].reasons.empty()) {
      change(static_cast<int64_t>(t), 0, 1);  // kept on device 0 (Note [Partition model])
      continue;
    }
    for (int64_t op : tensors[t].reasons) change(static_cast<int64_t>(t), assignment_[op], 1);
  }
}

void MemoryLedger::change(int64_t tensor, int device, int delta) {
  int32_t& c = count_[tensor * num_devices_ + device];
  const int32_t before = c;
  c += delta;
  const auto& t = problem_.tensors()[tensor];
  if (before == 0 && c > 0) {
    trees_[device].add(t.start, t.end, t.bytes);
    present_bytes_ += t.bytes;
  } else if (before > 0 && c == 0) {
    trees_[device].add(t.start, t.end, -t.bytes);
    present_bytes_ -= t.bytes;
  }
}

void MemoryLedger::move(int64_t op, int device) {
  const int from = assignment_[op];
  if (from == device) return;
  for (int64_t t : problem_.touched(op)) {
    change(t, device, 1);
    change(t, from, -1);
  }
  assignment_[op] = device;
}

int64_t MemoryLedger::excess(const std::vector<int64_t>& caps) const {
  int64_t sum = 0;
  for (int d = 0; d < num_devices_; ++d) sum += std::max<int64_t>(0, peak(d) - caps[d]);
  return sum;
}

}  // namespace memsched
