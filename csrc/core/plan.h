// plan.h -- a Plan: which activations leave the device during a step, when
// they go out and when they come back. The contract between the planners, the
// simulator and the offload executor.
//
// Entry points: Plan, TensorDecision, OffloadAnalysis / analyze_offload()
// (which tensors may be offloaded and their key ops), validate_plan(),
// modelled_memory() (the plan's memory curve when copies are instantaneous),
// least_budget_bytes().
//
// Note [Plan semantics]
//   Offloadable tensor: kind activation, producer a forward op (or kBeforeStep,
//   e.g. a model input saved for backward) and at least one use at or after
//   its `backward_start` -- the first backward op after its producer, See Note
//   [Micro-batches] -- the first such use being a backward op, and not held by
//   the caller into that backward pass (held_until_op < backward_start; Note
//   [Held by the caller] in trace.h). Its `last_forward_use` below is its last
//   forward use or held_until_op, whichever is later. Everything else
//   stays on the device; a Plan has one TensorDecision per offloadable tensor,
//   ascending tensor_id, and nothing for the other tensors.
//   For an offloaded tensor t (offload == true):
//   - offload: the device->host copy is issued on the D2H stream once op
//     `offload_after_op` has finished (earliest_offload_op <= offload_after_op
//     < backward_start; the copy cannot start before its producer). Its
//     device memory is released when BOTH the copy has finished AND op
//     `last_forward_use` has finished (eager PyTorch's forward graph may still
//     hold the tensor).
//   - prefetch: the host->device copy is requested when the compute stream
//     reaches op `prefetch_at_op` (backward_start <= prefetch_at_op <=
//     first_backward_use), i.e. before that op waits for anything; it starts
//     when the H2D stream is free AND the budget has room for the tensor. The
//     tensor's first backward use waits for the copy. prefetch_at_op ==
//     first_backward_use means "fetched on demand" (the copy is exposed).
//   - after it is back, the tensor stays on the device until its freed_after_op.
//   For a kept tensor (offload == false, recompute == false) both op fields
//   are -1 and recompute_ops is empty.
//   For a recomputed tensor (recompute == true, offload == false, both op
//   fields -1): its device memory is released once op last_forward_use has
//   finished; just before op recompute_at_op (its first backward use) the
//   compute stream replays `recompute_ops` (forward ops, ascending), which
//   recreate it; it then stays on the device until its freed_after_op. With
//   recompute_ops empty, an earlier replay (before op recompute_at_op <
//   first backward use) recreates it on its way and keeps it. Both fields must
//   equal recompute_schedule() for the plan (See Note [Recompute model] in
//   recompute.h).
//   copies_on_compute_stream (offload_all_sync, i.e. torch's save_on_cpu): the
//   same copies run on the compute stream: D2H right after op offload_after_op,
//   H2D right before op prefetch_at_op, so the compute stream waits for them.
//
// Note [Micro-batches]
//   Rationale: with gradient accumulation a step runs forward and backward
//   once per micro-batch before the optimizer: F1 B1 F2 B2 (opt). Taking the
//   step's first backward op as every tensor's boundary made F2's activations
//   (produced after it) no candidates, so the second micro-batch's memory was
//   never planned for.
//   Approach: each tensor's boundary is its own backward pass, the first
//   backward op after its producer (OffloadCandidate::backward_start; an
//   activation that exists before the step takes the step's first). Its
//   windows, checks and prefetch placement use that op instead of
//   first_backward_op. Offload windows of different micro-batches are then
//   disjoint; the planners' models (dp's nested windows, greedy's, the
//   least budget) hold for any windows, and the simulator and the executor
//   act per op and per ordinal, so nothing else changes.
//   Limitations: dp's nested model orders candidates by first backward use,
//   so across micro-batches it counts earlier micro-batches' tensors off the
//   device for no ops (sound, not exact); its pruned and nested-subfamily
//   candidates and the simulator's choice recover most of that.
//
// Note [Modelled memory]
//   With instantaneous copies an offloaded tensor occupies the device during
//   ops [live_start, max(offload_after_op, last_forward_use)] and
//   [prefetch_at_op, live_end]; a recomputed tensor during [live_start,
//   last_forward_use] and [recompute_at_op, live_end], and at op
//   recompute_at_op its replay adds the bytes of every other output of
//   recompute_ops (an upper bound: the replay frees them before the op runs,
//   but those it keeps alive, already counted from that op, are counted twice);
//   modelled_memory()[i] sums that over all tensors.
//   The simulator never lets an op or a prefetch allocate past the budget while
//   a pending offload copy could still free memory, so its simulated peak is at
//   most max_i modelled_memory()[i] (tested); planners therefore place
//   decisions so that the modelled memory fits the budget at EVERY op.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "core/trace.h"

namespace memsched {

struct TensorDecision {
  TensorDecision() = default;
  TensorDecision(int64_t id, bool off, int64_t after_op, int64_t at_op)  // keep or offload, as before recompute
      : tensor_id(id), offload(off), offload_after_op(after_op), prefetch_at_op(at_op) {}
  int64_t tensor_id = 0;          // TensorRecord::id of an offloadable tensor
  bool offload = false;           // true: copied out and back (kept when neither offload nor recompute)
  int64_t offload_after_op = -1;  // D2H copy issued once this op finished; -1 unless offloaded
  int64_t prefetch_at_op = -1;    // H2D copy requested when this op is reached; -1 unless offloaded
  bool recompute = false;         // true: released after its forward use, recreated before backward
  std::vector<int64_t> recompute_ops;  // forward ops replayed just before the first backward use, ascending
                                       // (empty: an earlier replay recreates and keeps it)
  int64_t recompute_at_op = -1;   // recreated by a replay just before this op; -1 unless recomputed
};

enum class Action { kKeep, kOffload, kRecompute };
const char* to_string(Action action);  // "keep", "offload", "recompute"
inline Action action_of(const TensorDecision& d) {
  return d.recompute ? Action::kRecompute : d.offload ? Action::kOffload : Action::kKeep;
}

struct Plan {
  std::string planner;                   // registry name of the planner that made it
  int64_t budget_bytes = 0;              // device memory budget the plan was made for
  std::vector<TensorDecision> decisions; // one per offloadable tensor, ascending tensor_id
  double objective = 0.0;                // the planner's own objective value (see objective_name)
  std::string objective_name;            // e.g. "offloaded_bytes"
  bool copies_on_compute_stream = false; // offload_all_sync: copies block the compute stream

  int64_t num_offloaded() const;
  int64_t offloaded_bytes(const Trace& trace) const;  // sum of bytes of offloaded tensors (each moves out and back)
  int64_t num_recomputed() const;
  int64_t recomputed_bytes(const Trace& trace) const; // sum of bytes of recomputed tensors
};

// Key ops of one offloadable tensor (See Note [Plan semantics]).
struct OffloadCandidate {
  int64_t tensor_id = 0;           // TensorRecord::id
  int64_t bytes = 0;               // storage bytes
  int64_t live_start = 0;          // first op during which it is live (Trace::live_start)
  int64_t live_end = 0;            // last op during which it is live (Trace::live_end)
  int64_t earliest_offload_op = 0; // max(producer_op, 0): the D2H copy may follow this op
  int64_t last_forward_use = 0;    // last use before backward_start (or earliest_offload_op if none),
                                   // or held_until_op if later (Note [Held by the caller] in trace.h)
  int64_t first_backward_use = 0;  // first use at or after backward_start (a backward op)
  int64_t backward_start = 0;      // first backward op after its producer: its micro-batch's backward pass
                                   // (Note [Micro-batches])
};

struct OffloadAnalysis {
  int64_t first_backward_op = 0;            // index of the first backward op; ops.size() if none
  std::vector<int64_t> next_backward_op;    // per op i (size ops+1): the first backward op >= i; ops.size() if none
  std::vector<OffloadCandidate> candidates; // ascending tensor_id
  std::vector<int64_t> live_bytes;          // Trace::live_bytes(): everything on the device
  std::vector<int64_t> candidate_index;     // tensor id -> index into candidates, -1 if not offloadable
  std::vector<int64_t> op_output_bytes;     // per op: bytes of the tensors it produces
  // Tensors op i reads: op_inputs[op_inputs_begin[i] .. op_inputs_begin[i+1]) (size ops+1), ascending id.
  std::vector<int64_t> op_inputs_begin;
  std::vector<int64_t> op_inputs;
};

// Validates the trace, then finds the offloadable tensors.
OffloadAnalysis analyze_offload(const Trace& trace);

// A plan that keeps every offloadable tensor (the shape every planner fills in).
Plan keep_all_plan(const OffloadAnalysis& analysis, int64_t budget_bytes);

// Throws memsched::Error naming the decision and field when `plan` does not
// fit Note [Plan semantics] for this trace.
void validate_plan(const Trace& trace, const OffloadAnalysis& analysis, const Plan& plan);

// Note [Modelled memory]: bytes on the device during each op with instantaneous copies.
std::vector<int64_t> modelled_memory(const OffloadAnalysis& analysis, const std::vector<TensorDecision>& decisions);

// The least budget any plan can reach: max_i of modelled_memory() when every
// offloadable tensor leaves right after its last forward use and comes back
// on demand.
int64_t least_budget_bytes(const OffloadAnalysis& analysis);

}  // namespace memsched
