// dw_scheduler.h -- ordering and bookkeeping for out-of-order backward: a queue
// of deferred weight-gradient (dW) work items, the bytes they hold alive, the
// number of gradient contributions each parameter still expects, and (under
// data parallelism) the gradient buckets they complete. No torch: items are ids,
// parameters are indices, sizes are bytes. The Python executor
// (python/memsched/ooo) runs the tensor work and reports back.
//
// Entry point: DwScheduler. One iteration (one backward pass) looks like
//   begin_iteration();                                 // forward starts
//   expect_contribution(p) per use of parameter p      // forward
//   id = enqueue({p...}, held_bytes)                   // backward, per deferred dW
//   while ((id = next_urgent()) >= 0) run(id), complete(id)
//   contribute(p)                                      // a gradient that autograd produced
//   while ((id = pop()) >= 0) run(id), complete(id)    // end of backward (flush)
//   end_iteration();                                   // checks that every contribution came
//
// Note [dW priority]
//   Rationale: a deferred dW item holds its layer input and output gradient
//   (held_bytes) until it runs; a parameter's gradient can be handed to the
//   optimizer (fused update) or to communication (DDP bucket) only once all its
//   contributions are in. So work that finishes something should run first.
//   Approach: pop() picks, by linear scan over the (small, byte-bounded) queue,
//   the item with the smallest key
//     (bucket rank, contributions its parameters still miss after it,
//      -gradient bytes already held for parameters it makes final, -held_bytes, seq)
//   bucket rank = position of the item's earliest bucket among buckets not yet
//   ready (0 when no buckets were given), so the bucket that DDP would reduce
//   next is completed first; then items that make a parameter final; among
//   those, first the ones that finish a parameter whose earlier contributions
//   already hold gradient memory (a tied weight), so that memory goes to the
//   fused update soonest; then the items that free the most held bytes; then FIFO. The linear scan keeps the keys
//   exact although they change as other items complete (a heap would go stale).
//   next_urgent() returns an item only when one must run now: the queue holds
//   more than max_deferred_bytes, or (buckets given) running every queued item
//   of the next bucket would make that bucket ready -- so communication starts as
//   early as possible, while work for later buckets stays deferred and fills
//   the time the all-reduce takes (source S4).
//   Limitations: priorities are per item, not a global optimum; an item that
//   touches several buckets ranks by its earliest.
//
// Invariants (check_invariants()):
//   held_bytes == sum of held_bytes of queued and in-flight items
//   for each parameter: 0 <= received <= expected once end_iteration() ran
//   bucket_missing[b] == number of parameters of bucket b that are not final
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace memsched {

struct DwWorkItem {
  int64_t id = 0;                 // returned by enqueue(); unique per scheduler
  std::vector<int32_t> params;    // parameter indices this item contributes to (weight, bias)
  int64_t held_bytes = 0;         // bytes the item keeps alive until it runs (input + grad_output)
  int64_t seq = 0;                // enqueue order within the scheduler's lifetime
};

struct DwCompletion {
  std::vector<int32_t> final_params;  // parameters whose last contribution just arrived
  std::vector<int32_t> ready_buckets; // buckets whose every parameter is now final, ascending
};

struct DwStats {
  int64_t enqueued = 0;           // COUNT: items enqueued (all iterations)
  int64_t completed = 0;          // COUNT: items completed
  int64_t urgent = 0;             // COUNT: items handed out by next_urgent()
  int64_t limit_flushes = 0;      // COUNT: of those, because held bytes exceeded the limit
  int64_t held_bytes = 0;         // SUM: bytes held by queued + in-flight items now
  int64_t peak_held_bytes = 0;    // SUM: max of held_bytes seen
  int64_t queued = 0;             // COUNT: items queued now
  int64_t peak_queued = 0;        // COUNT: max of queued seen
};

class DwScheduler {
 public:
  // max_deferred_bytes < 0 means no limit; 0 means run every item at once.
  explicit DwScheduler(int64_t max_deferred_bytes = -1);

  // Registers a parameter; returns its index (0, 1, ...). bucket = -1: none
  // (0 = the bucket reduced first). Buckets must be numbered densely: a
  // bucket b > 0 needs bucket b-1 to exist when the iteration begins.
  // A bucket is ready when each of its parameters is final (received its
  // expected contributions, at least one); a bucket with an unused parameter
  // is never ready during backward, the executor reduces it at the flush.
  int32_t add_param(int64_t grad_bytes, int32_t bucket = -1);
  int32_t num_params() const { return static_cast<int32_t>(expected_.size()); }
  int32_t num_buckets() const { return static_cast<int32_t>(bucket_size_.size()); }

  // Starts an iteration: contribution counts go to zero. The queue must be empty.
  void begin_iteration();
  // Forward: parameter p will receive one more gradient contribution.
  void expect_contribution(int32_t param);
  int32_t expected(int32_t param) const;
  int32_t received(int32_t param) const;
  bool is_final(int32_t param) const;

  // Backward: queue a deferred item contributing once to each of params.
  int64_t enqueue(const std::vector<int32_t>& params, int64_t held_bytes);
  // The id of an item that must run now (See Note [dW priority]), removed
  // from the queue; -1 if none.
  int64_t next_urgent();
  // The highest-priority queued item, removed from the queue; -1 if empty.
  int64_t pop();
  // The executor finished item id (handed out by pop/next_urgent): its
  // parameters receive one contribution each, its bytes are released.
  DwCompletion complete(int64_t id);
  // A contribution that did not go through the queue (autograd accumulated it).
  DwCompletion contribute(int32_t param);

  // Ends the iteration. Throws if work is queued or in flight. A parameter
  // that received fewer contributions than forward counted (a use whose output
  // never reached the loss) throws unless allow_missing; with allow_missing the
  // short parameters are returned (ascending) so the executor can finish them
  // with what did arrive -- exactly what plain autograd would hold.
  std::vector<int32_t> end_iteration(bool allow_missing = false);

  const DwStats& stats() const { return stats_; }
  int64_t held_bytes() const { return stats_.held_bytes; }
  int64_t max_deferred_bytes() const { return max_deferred_bytes_; }
  size_t queued() const { return queue_.size(); }
  size_t in_flight() const { return in_flight_.size(); }
  // Items queued now (unordered), for tests and reports.
  std::vector<DwWorkItem> queued_items() const { return queue_; }
  bool bucket_ready(int32_t bucket) const;

  void check_invariants() const;

 private:
  int32_t checked_param(int32_t param, const char* what) const;
  void add_contribution(int32_t param, DwCompletion* out);
  int64_t bucket_rank(const DwWorkItem& item) const;
  int32_t next_bucket() const;
  bool bucket_completable(int32_t bucket) const;
  int64_t missing_after(const DwWorkItem& item) const;
  int64_t partial_grad_bytes_finished(const DwWorkItem& item) const;
  size_t best_index() const;
  int64_t take(size_t index);

  int64_t max_deferred_bytes_;              // bytes; < 0: unlimited
  std::vector<int64_t> grad_bytes_;         // per parameter, bytes of its gradient
  std::vector<int32_t> bucket_of_;          // per parameter, bucket or -1
  std::vector<int32_t> bucket_size_;        // per bucket, number of parameters
  std::vector<std::vector<int32_t>> bucket_params_;  // per bucket, its parameter indices
  std::vector<int32_t> bucket_missing_;     // per bucket, parameters not final yet
  std::vector<int32_t> expected_;           // per parameter, contributions expected this iteration
  std::vector<int32_t> received_;           // per parameter, contributions received
  std::vector<int32_t> queued_for_;         // per parameter, queued items that contribute to it
  std::vector<DwWorkItem> queue_;           // deferred items, unordered (See Note [dW priority])
  std::vector<DwWorkItem> in_flight_;       // handed out, not yet completed
  int64_t next_id_ = 0;
  bool in_iteration_ = false;
  DwStats stats_;
};

}  // namespace memsched
