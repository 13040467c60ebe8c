// simulator.h -- discrete-event simulation of one training step executing a
// Plan: one compute stream, one device->host (D2H) and one host->device (H2D)
// copy stream, a device memory budget.
//
// Entry point: simulate(trace, plan, device) -> SimResult.
//
// Note [Simulator semantics]
//   - Ops run in trace order on the compute stream; op i starts when the
//     stream is free, every offloaded tensor whose first backward use is i is
//     back on the device, and its outputs (tensors produced by i) fit the
//     budget. Tensors live before the step are on the device at time 0.
//   - Memory is allocated when an op starts (its outputs) or a prefetch copy
//     starts, and released when an op ends (tensors whose freed_after_op it
//     is) or when an offloaded tensor is both copied out and past its last
//     forward use.
//   - D2H: tensor t's copy is queued when op offload_after_op ends; the stream
//     runs queued copies one at a time in FIFO order (ties: tensor id).
//   - H2D: tensor t's copy is requested when the compute stream reaches op
//     prefetch_at_op (right after the previous op ends); requests are served
//     in FIFO order (ties: first backward use, then tensor id), one at a time,
//     each starting only when the budget has room for it and the tensor's
//     own D2H copy has finished (the H2D stream waits on that copy).
//   - An op or prefetch that does not fit waits; it goes ahead over the budget
//     only when nothing pending could free memory (no offload copy in flight
//     or queued whose tensor is past its forward use, no op running) -- then
//     SimResult::over_budget is set. A plan whose modelled memory fits the
//     budget never triggers this (See Note [Modelled memory] in plan.h).
//   - copies_on_compute_stream: each D2H copy runs on the compute stream right
//     after op offload_after_op, each H2D copy right before op prefetch_at_op.
//   - Recompute (See Note [Recompute model] in recompute.h): a recomputed
//     tensor is released when op last_forward_use ends. When the compute
//     stream reaches op recompute_at_op (its first backward use), the replay
//     of its recompute_ops runs on the compute stream before that op, one
//     replay at a time (ascending tensor id), taking the sum of their op
//     times. A replay allocates the tensor plus its transient bytes (the
//     other outputs of its ops) when it starts -- waiting for budget room like
//     an op -- and frees them when it ends, except the recomputed tensors it
//     keeps alive (those with empty recompute_ops, ready from then on). The
//     op waits for its replays.
//   - stall_us_per_op[i] = start of op i - end of op i-1 (end of "op -1" is 0)
//     - the replay time run in between: time the compute stream ran neither an
//     op nor a replay before op i (waiting for inputs or memory, or running
//     synchronous copies). step_time_us = end of the last op
//     = compute_us + recompute_us + stall_us.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "core/device_model.h"
#include "core/plan.h"
#include "core/trace.h"

namespace memsched {

enum class Stream { kCompute, kD2H, kH2D };
enum class EventKind { kOp, kD2H, kH2D, kRecompute };  // what ran: an op, a copy, or a replay
const char* to_string(Stream stream);
const char* to_string(EventKind kind);

struct TimelineEvent {
  Stream stream = Stream::kCompute;  // where it ran
  EventKind kind = EventKind::kOp;   // kOp: id is an op id; kD2H/kH2D/kRecompute: id is a tensor id
  int64_t id = 0;                    // op id or tensor id
  double start_us = 0.0;             // microseconds from step start
  double end_us = 0.0;               // microseconds from step start
  int64_t bytes = 0;                 // bytes copied (copies), bytes allocated at start (ops, replays)
};

struct MemorySample {
  double time_us = 0.0;  // microseconds from step start
  int64_t bytes = 0;     // device bytes in use from this time on
};

struct SimResult {
  double step_time_us = 0.0;             // end of the last op
  double compute_us = 0.0;               // sum of op times (step time with no stall)
  double stall_us = 0.0;                 // sum of stall_us_per_op
  double recompute_us = 0.0;             // time the compute stream spent replaying recompute_ops
  std::vector<double> stall_us_per_op;   // See Note [Simulator semantics]
  std::vector<double> op_start_us;       // per op
  std::vector<double> op_end_us;         // per op
  int64_t peak_bytes = 0;                // max device bytes in use at any time
  double peak_time_us = 0.0;             // first time the peak is reached
  int64_t peak_op = -1;                  // op running (or about to run) at the peak
  int64_t bytes_to_host = 0;             // sum of D2H copy bytes
  int64_t bytes_to_device = 0;           // sum of H2D copy bytes
  int64_t budget_bytes = 0;              // the plan's budget
  bool over_budget = false;              // something had to allocate past the budget
  std::vector<TimelineEvent> events;     // per stream, in start order per stream
  std::vector<MemorySample> memory;      // device bytes in use over time (step function)

  // Throws if an invariant does not hold: memory never negative, copies on one
  // stream never overlap, ops in order without overlap, every offloaded
  // tensor back (every recomputed tensor replayed, once) before its first
  // backward use (needs the plan and trace).
  void check_invariants(const Trace& trace, const Plan& plan) const;
};

SimResult simulate(const Trace& trace, const Plan& plan, const DeviceModel& device);

}  // namespace memsched
