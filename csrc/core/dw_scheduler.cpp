// dw_scheduler.cpp -- DwScheduler: deferred dW queue, contribution counting,
// bucket readiness. See Note [dW priority] in dw_scheduler.h.
#include "core/dw_scheduler.h"

#include <algorithm>
#include <limits>
#include <tuple>

#include "core/check.h"

namespace memsched {

DwScheduler::DwScheduler(int64_t max_deferred_bytes) : max_deferred_bytes_(max_deferred_bytes) {}

int32_t DwScheduler::checked_param(int32_t param, const char* what) const {
  MEMSCHED_CHECK(param >= 0 && param < num_params(), what, ": parameter index ", param,
                 " is out of range; ", num_params(), " parameters are registered (add_param)");
  return param;
}

int32_t DwScheduler::add_param(int64_t grad_bytes, int32_t bucket) {
  MEMSCHED_CHECK(grad_bytes >= 0, "add_param: grad_bytes must be >= 0, got ", grad_bytes);
  MEMSCHED_CHECK(bucket >= -1, "add_param: bucket must be -1 (none) or >= 0, got ", bucket);
  MEMSCHED_CHECK(!in_iteration_ && queue_.empty() && in_flight_.empty(),
                 "add_param: register every parameter before the first iteration begins");
  const auto index = static_cast<int32_t>(expected_.size());
  grad_bytes_.push_back(grad_bytes);
  bucket_of_.push_back(bucket);
  expected_.push_back(0);
  received_.push_back(0);
  queued_for_.push_back(0);
  if (bucket >= 0) {
    if (bucket >= num_buckets()) {
      bucket_size_.resize(bucket + 1, 0);
      bucket_missing_.resize(bucket + 1, 0);
      bucket_params_.resize(bucket + 1);
    }
    bucket_size_[bucket] += 1;
    bucket_missing_[bucket] += 1;
    bucket_params_[bucket].push_back(index);
  }
  return index;
}

void DwScheduler::begin_iteration() {
  MEMSCHED_CHECK(queue_.empty() && in_flight_.empty(), "begin_iteration: ", queue_.size(),
                 " deferred items are queued and ", in_flight_.size(),
                 " in flight; flush (pop + complete) before the next forward");
  for (int32_t b = 0; b < num_buckets(); ++b) {
    MEMSCHED_CHECK(bucket_size_[b] > 0, "begin_iteration: bucket ", b,
                   " has no parameters; number buckets densely from 0");
  }
  std::fill(expected_.begin(), expected_.end(), 0);
  std::fill(received_.begin(), received_.end(), 0);
  bucket_missing_ = bucket_size_;
  in_iteration_ = true;
}

void DwScheduler::expect_contribution(int32_t param) {
  checked_param(param, "expect_contribution");
  MEMSCHED_CHECK(in_iteration_, "expect_contribution: call begin_iteration() first");
  MEMSCHED_CHECK(received_[param] == 0, "expect_contribution: parameter ", param,
                 " already received a gradient this iteration; a forward use after backward "
                 "started needs a new iteration (begin_iteration)");
  expected_[param] += 1;
}

int32_t DwScheduler::expected(int32_t param) const { return expected_[checked_param(param, "expected")]; }
int32_t DwScheduler::received(int32_t param) const { return received_[checked_param(param, "received")]; }
bool DwScheduler::is_final(int32_t param) const {
  checked_param(param, "is_final");
  return expected_[param] > 0 && received_[param] == expected_[param];
}

bool DwScheduler::bucket_ready(int32_t bucket) const {
  MEMSCHED_CHECK(bucket >= 0 && bucket < num_buckets(), "bucket_ready: bucket ", bucket,
                 " is out of range; ", num_buckets(), " buckets exist");
  return bucket_missing_[bucket] == 0;
}

int64_t DwScheduler::enqueue(const std::vector<int32_t>& params, int64_t held_bytes) {
  MEMSCHED_CHECK(in_iteration_, "enqueue: call begin_iteration() before the forward pass");
  MEMSCHED_CHECK(!params.empty(), "enqueue: a deferred item must contribute to at least one parameter");
  MEMSCHED_CHECK(held_bytes >= 0, "enqueue: held_bytes must be >= 0, got ", held_bytes);
  for (int32_t p : params) {
    checked_param(p, "enqueue");
    MEMSCHED_CHECK(received_[p] + queued_for_[p] < expected_[p], "enqueue: parameter ", p,
                   " would get more contributions (", received_[p] + queued_for_[p] + 1,
                   ") than forward uses counted (", expected_[p],
                   "); every use must call expect_contribution during forward");
  }
  DwWorkItem item;
  item.id = next_id_++;
  item.params = params;
  item.held_bytes = held_bytes;
  item.seq = stats_.enqueued;
  for (int32_t p : params) queued_for_[p] += 1;
  queue_.push_back(std::move(item));
  stats_.enqueued += 1;
  stats_.held_bytes += held_bytes;
  stats_.peak_held_bytes = std::max(stats_.peak_held_bytes, stats_.held_bytes);
  stats_.queued = static_cast<int64_t>(queue_.size());
  stats_.peak_queued = std::max(stats_.peak_queued, stats_.queued);
  MEMSCHED_EXPENSIVE_ASSERT((check_invariants(), true));
  return queue_.back().id;
}

int32_t DwScheduler::next_bucket() const {
  for (int32_t b = 0; b < num_buckets(); ++b) {
    if (bucket_missing_[b] > 0) return b;
  }
  return -1;
}

int64_t DwScheduler::bucket_rank(const DwWorkItem& item) const {
  if (num_buckets() == 0) return 0;
  int64_t rank = std::numeric_limits<int32_t>::max();
  const int32_t first = std::max<int32_t>(next_bucket(), 0);
  for (int32_t p : item.params) {
    const int32_t b = bucket_of_[p];
    if (b >= 0) rank = std::min<int64_t>(rank, std::max<int32_t>(b - first, 0));
  }
  return rank;
}

int64_t DwScheduler::missing_after(const DwWorkItem& item) const {
  int64_t missing = 0;
  for (int32_t p : item.params) missing += expected_[p] - received_[p] - 1;
  return missing;
}

int64_t DwScheduler::partial_grad_bytes_finished(const DwWorkItem& item) const {
  int64_t bytes = 0;
  for (int32_t p : item.params) {
    if (received_[p] > 0 && received_[p] + 1 == expected_[p]) bytes += grad_bytes_[p];
  }
  return bytes;
}

size_t DwScheduler::best_index() const {
  size_t best = 0;
  auto key = [this](const DwWorkItem& it) {
    return std::make_tuple(bucket_rank(it), missing_after(it), -partial_grad_bytes_finished(it), -it.held_bytes,
                           it.seq);
  };
  auto best_key = key(queue_[0]);
  for (size_t i = 1; i < queue_.size(); ++i) {
    auto k = key(queue_[i]);
    if (k < best_key) {
      best_key = k;
      best = i;
    }
  }
  return best;
}

int64_t DwScheduler::take(size_t index) {
  DwWorkItem item = std::move(queue_[index]);
  queue_.erase(queue_.begin() + static_cast<std::ptrdiff_t>(index));
  stats_.queued = static_cast<int64_t>(queue_.size());
  const int64_t id = item.id;
  in_flight_.push_back(std::move(item));
  return id;
}

bool DwScheduler::bucket_completable(int32_t bucket) const {
  bool any_queued = false;
  for (int32_t p : bucket_params_[bucket]) {
    if (expected_[p] == 0) return false;  // unused so far: cannot be final during backward
    if (received_[p] + queued_for_[p] < expected_[p]) return false;
    any_queued = any_queued || queued_for_[p] > 0;
  }
  return any_queued;
}

int64_t DwScheduler::next_urgent() {
  if (queue_.empty()) return -1;
  // Held bytes (queued + in flight) over the limit: the best item runs now.
  if (max_deferred_bytes_ >= 0 && stats_.held_bytes > max_deferred_bytes_) {
    stats_.urgent += 1;
    stats_.limit_flushes += 1;
    return take(best_index());
  }
  // The next bucket can be completed from the queue: run its items first.
  const int32_t b = next_bucket();
  if (b >= 0 && bucket_completable(b)) {
    size_t best = queue_.size();
    for (size_t i = 0; i < queue_.size(); ++i) {
      bool touches = false;
      for (int32_t p : queue_[i].params) touches = touches || bucket_of_[p] == b;
      if (!touches) continue;
      if (best == queue_.size() || std::make_tuple(missing_after(queue_[i]), -queue_[i].held_bytes, queue_[i].seq) <
                                       std::make_tuple(missing_after(queue_[best]), -queue_[best].held_bytes,
                                                       queue_[best].seq)) {
        best = i;
      }
    }
    MEMSCHED_DEBUG_ASSERT(best < queue_.size());
    stats_.urgent += 1;
    return take(best);
  }
  return -1;
}

int64_t DwScheduler::pop() {
  if (queue_.empty()) return -1;
  return take(best_index());
}

void DwScheduler::add_contribution(int32_t param, DwCompletion* out) {
  MEMSCHED_CHECK(received_[param] < expected_[param], "parameter ", param, " received ",
                 received_[param] + 1, " gradient contributions but forward counted ", expected_[param],
                 " uses; every use must call expect_contribution during forward");
  received_[param] += 1;
  if (received_[param] == expected_[param]) {
    out->final_params.push_back(param);
    const int32_t b = bucket_of_[param];
    if (b >= 0) {
      bucket_missing_[b] -= 1;
      if (bucket_missing_[b] == 0) out->ready_buckets.push_back(b);
    }
  }
}

DwCompletion DwScheduler::complete(int64_t id) {
  auto it = std::find_if(in_flight_.begin(), in_flight_.end(), [id](const DwWorkItem& w) { return w.id == id; });
  MEMSCHED_CHECK(it != in_flight_.end(), "complete: item ", id,
                 " is not in flight; complete only ids returned by pop() or next_urgent(), once");
  DwWorkItem item = std::move(*it);
  in_flight_.erase(it);
  DwCompletion out;
  for (int32_t p : item.params) {
    queued_for_[p] -= 1;
    add_contribution(p, &out);
  }
  stats_.held_bytes -= item.held_bytes;
  stats_.completed += 1;
  std::sort(out.ready_buckets.begin(), out.ready_buckets.end());
  MEMSCHED_EXPENSIVE_ASSERT((check_invariants(), true));
  return out;
}

DwCompletion DwScheduler::contribute(int32_t param) {
  checked_param(param, "contribute");
  MEMSCHED_CHECK(in_iteration_, "contribute: call begin_iteration() before the forward pass");
  DwCompletion out;
  add_contribution(param, &out);
  return out;
}

std::vector<int32_t> DwScheduler::end_iteration(bool allow_missing) {
  MEMSCHED_CHECK(in_iteration_, "end_iteration: no iteration is running (begin_iteration)");
  MEMSCHED_CHECK(queue_.empty() && in_flight_.empty(), "end_iteration: ", queue_.size(),
                 " deferred items are still queued and ", in_flight_.size(),
                 " in flight; flush (pop + complete) first");
  std::vector<int32_t> short_params;
  for (int32_t p = 0; p < num_params(); ++p) {
    if (received_[p] == expected_[p]) continue;
    MEMSCHED_CHECK(allow_missing, "end_iteration: parameter ", p, " received ", received_[p], " of ",
                   expected_[p],
                   " expected gradient contributions; a use produced no gradient (was backward run "
                   "through every output?)");
    short_params.push_back(p);
  }
  in_iteration_ = false;
  return short_params;
}

void DwScheduler::check_invariants() const {
  int64_t held = 0;
  std::vector<int32_t> queued_for(expected_.size(), 0);
  for (const auto* list : {&queue_, &in_flight_}) {
    for (const auto& item : *list) {
      held += item.held_bytes;
      for (int32_t p : item.params) queued_for[p] += 1;
    }
  }
  MEMSCHED_CHECK(held == stats_.held_bytes, "internal: held_bytes ", stats_.held_bytes,
                 " != sum over queued and in-flight items ", held);
  MEMSCHED_CHECK(queued_for == queued_for_, "internal: per-parameter queued counts disagree with the queue");
  for (int32_t p = 0; p < num_params(); ++p) {
    const bool counts_ok = received_[p] >= 0 && received_[p] + queued_for_[p] <= expected_[p];
    MEMSCHED_CHECK(counts_ok || !in_iteration_, "internal: parameter ", p, " has received ", received_[p], " + queued ", queued_for_[p],
                   " > expected ", expected_[p]);
  }
  for (int32_t b = 0; b < num_buckets(); ++b) {
    int32_t missing = 0;
    for (int32_t p : bucket_params_[b]) missing += is_final(p) ? 0 : 1;
    MEMSCHED_CHECK(!in_iteration_ || missing == bucket_missing_[b], "internal: bucket ", b, " missing ",
                   bucket_missing_[b], " but ", missing, " of its parameters are not final");
  }
}

}  // namespace memsched
