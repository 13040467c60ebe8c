// trace.h -- one training step as memsched sees it: ops in execution order and
// the tensors they produce, use and free. The contract between the profiler,
// the planners, the simulator and the executor.
//
// Entry points: Trace (the struct), validate(), live_bytes(), peak(),
// activation_bytes(); JSON I/O lives in trace_json.h.
//
// Note [Tensor lifetime convention]
//   A tensor occupies memory from the start of its producer op up to and
//   including its free op:  live during op i  <=>  start <= i <= end, where
//   start = producer_op   (or 0 when producer_op == kBeforeStep: parameters,
//                          inputs and optimizer state that exist before the step)
//   end   = freed_after_op (or ops.size()-1 when freed_after_op == kAfterStep).
//   live_bytes[i] = sum of bytes of the tensors live during op i; the step's
//   peak is max_i live_bytes[i]. Storage de-duplication happens before a
//   TensorRecord is made: views of one storage are one record.
//
// Note [Held by the caller]
//   Rationale: an activation that leaves the device (offloaded or recomputed)
//   is released once the autograd graph lets go of it -- but only if nothing
//   else references its storage. In eager PyTorch the caller's frame often
//   does: `input = module(input)` in an outer nn.Sequential keeps a block's
//   input until the inner block returns, a residual `x + f(x)` keeps x until
//   the add. Its last use is then not when it can leave.
//   Approach: `held_until_op` is the last forward op during which something
//   other than the step's saved tensors (a frame, a module's attribute)
//   references the storage, as the profiler observed it; kNotHeld (-1) when
//   nothing but the saves (or its uses) keeps it. analyze_offload() releases
//   a candidate no earlier than after that op (OffloadCandidate::
//   last_forward_use), and a storage held into the backward pass is no
//   candidate: leaving the device would free nothing while it is held.
//   Limitations: recorded for activations only (other kinds stay on the
//   device anyway); a save dropped during the forward (a discarded branch)
//   can make a storage look released early.
//
// Note [Saves through several counters]
//   Rationale: autograd checks a saved tensor by its version counter, and not every alias shares
//   its storage's: ATen's CPU LSTM and GRU cells split the gates with unsafe_chunk and save several
//   pieces, each with a counter of its own. The executor gives each counter a host copy of the whole
//   storage (equal versions on two counters prove nothing: Note [Version counter identity] in
//   csrc/torch/tensor_adapter.h), and each comes back as a device storage of its own, so an offloaded
//   gate storage was resident up to four times where the plan counted it once: nn.LSTMCell under dp
//   at 0.5 measured 118% over the plan and 86% over the budget (found by a helper).
//   Approach: the profiler counts the distinct version counters the saves of each storage came
//   through (`save_counters`, written to JSON when above 1), and analyze_offload() leaves a storage
//   saved through more than one out of the candidates: it stays on the device, as planned.
//   Limitations: such a storage is not recomputed either (the hybrid planner could, exactly).
//
// Note [The executor's size floor]
//   Rationale: the executor never offloads a storage below memsched.optimize's
//   min_offload_bytes (1 MiB on CUDA by default: a copy that small costs its
//   latency and frees little), but the planners did not know: a plan counted
//   such activations as offloaded, and the measured peak passed the planned one
//   and the budget with no word (min_offload_bytes="64KiB" on the small
//   transformer at its least budget: 499332 measured saved-activation bytes
//   against 218372 planned; found by a helper probing budgets).
//   Approach: Trace::min_offload_bytes, set by optimize() on the trace it plans
//   (0 by default), makes analyze_offload() leave smaller activations out of
//   the candidates, so every planner, the simulator and the least budget keep
//   them on the device. It is written to the trace's JSON when not 0.
//   Limitations: the hybrid planner cannot recompute them either.
//
// Note [Trace value bounds]
//   Rationale: the derived views sum bytes (the memory curve, the peak, the
//   bytes of a kind), the planners add and subtract those sums, and the
//   simulator sums op times. A trace whose sums overflow int64 gave a negative
//   peak (signed overflow: undefined behaviour), and an op id out of range read
//   outside the curve (a segfault). Bounding the inputs once, in validate(),
//   keeps every consumer on plain arithmetic instead of checked arithmetic in
//   each of them.
//   Approach: validate() requires
//     - the bytes of all tensors together <= kMaxTraceBytes (2^62 = 4 EiB, far
//       beyond any device). Every sum of tensor bytes then fits in int64 with a
//       factor 2 to spare for derived values (bytes moved out and back, a curve
//       plus a budget); each op's bytes_read + bytes_written too;
//     - duration_us in [0, kMaxOpDurationUs] and flops in [0, kMaxOpFlops],
//       finite, so that sums of op times stay finite (no inf - inf = NaN);
//     - names (op name, module_path, dtype, label, device) to be UTF-8, the
//       text JSON and Python exchange.
//   Every derived view (live_bytes, peak_bytes, peak_op, activation_bytes,
//   bytes_of_kind) and every consumer (analyze_offload, so every planner and
//   the simulator; trace replay; the placement planner; JSON writing)
//   validates first, so a trace built field by field (the Python
//   Trace.add_op/add_tensor API, or C++) cannot reach code that indexes out of
//   range or overflows: it gets the error naming the record and the field.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace memsched {

enum class Phase { kForward, kBackward, kOptimizer };
enum class TensorKind { kParameter, kGradient, kActivation, kOptimizerState, kTemporary };

const char* to_string(Phase phase);
const char* to_string(TensorKind kind);
// Parse the JSON spellings ("forward", "activation", ...); false if unknown.
bool parse_phase(const std::string& text, Phase* out);
bool parse_tensor_kind(const std::string& text, TensorKind* out);
// The same, throwing memsched::Error that lists the accepted spellings.
Phase phase_from_string(const std::string& text);
TensorKind tensor_kind_from_string(const std::string& text);

constexpr int64_t kBeforeStep = -1;  // producer_op of a tensor that exists before the step
constexpr int64_t kAfterStep = -1;   // freed_after_op of a tensor that outlives the step
constexpr int64_t kNotHeld = -1;     // held_until_op: nothing but its saves and uses keeps it (Note [Held by the caller])
constexpr int kTraceVersion = 1;
// See Note [Trace value bounds].
constexpr int64_t kMaxTraceBytes = int64_t{1} << 62;  // all tensors' bytes together (4 EiB)
constexpr double kMaxOpDurationUs = 1e15;             // about 32 years
constexpr double kMaxOpFlops = 1e30;

// True when `text` is well-formed UTF-8 (no overlong forms, no surrogates).
bool is_valid_utf8(const std::string& text);

struct Op {
  int64_t id = 0;               // == index in Trace::ops (execution order)
  std::string name;             // e.g. "aten::addmm" or "Linear"
  std::string module_path;      // e.g. "layers.3.mlp.fc1"; "" outside any module
  Phase phase = Phase::kForward;
  double duration_us = 0.0;     // measured; 0 = unknown (the device model estimates it)
  double flops = 0.0;           // floating-point operations
  int64_t bytes_read = 0;       // bytes of tensor inputs
  int64_t bytes_written = 0;    // bytes of tensor outputs
  bool rng = false;             // draws random numbers (dropout, bernoulli, rand*): a replay must
                                // restore the RNG state first (See Note [Recompute model] in recompute.h)
};

// True for op names that draw random numbers: they contain (case-insensitive)
// dropout, bernoulli, rand (rand, randn, randint, randperm), rrelu, normal,
// uniform, multinomial, exponential, geometric or cauchy. Conservative: a
// false positive only asks a replay to restore the RNG state. The default of
// Op::rng wherever a trace is built or read without the field.
bool is_rng_op_name(const std::string& name);

struct TensorRecord {
  int64_t id = 0;                      // == index in Trace::tensors
  int64_t bytes = 0;                   // storage bytes after de-duplication
  std::string dtype;                   // e.g. "float32"
  TensorKind kind = TensorKind::kActivation;  // kActivation == saved for backward
  int64_t producer_op = kBeforeStep;   // op that allocates it
  std::vector<int64_t> uses;           // ops that read it, ascending
  int64_t freed_after_op = kAfterStep; // last op during which it is live
  int64_t held_until_op = kNotHeld;    // last forward op a non-graph reference holds it (Note [Held by the caller])
  int64_t save_counters = 1;           // version counters its saves came through (Note [Saves through several counters])
  std::string label;                   // optional: "module_path:call#:shape" for matching
};

struct Trace {
  int version = kTraceVersion;
  std::string device;                  // "cpu", "cuda:0", ... (informational)
  // Activations below this many bytes are neither offloaded nor recomputed: kept on the device, as the
  // executor keeps them (optimize's min_offload_bytes). See Note [The executor's size floor].
  int64_t min_offload_bytes = 0;
  std::vector<Op> ops;
  std::vector<TensorRecord> tensors;

  // Throws memsched::Error naming the record and field on the first problem:
  // ids not equal to their index (duplicates), op ids out of range, negative
  // bytes or durations, uses not ascending, a use before the producer, a free
  // before the producer or before the last use, a number that is not finite or
  // beyond Note [Trace value bounds], byte sums that could overflow, names
  // that are not UTF-8.
  void validate() const;

  // First and last op index during which tensor `t` is live (See Note
  // [Tensor lifetime convention]). Require at least one op and a valid trace.
  int64_t live_start(const TensorRecord& t) const;
  int64_t live_end(const TensorRecord& t) const;

  // The views below validate() first (See Note [Trace value bounds]).
  // live_bytes()[i]: bytes live during op i -- the memory curve. O(ops + tensors).
  std::vector<int64_t> live_bytes() const;
  int64_t peak_bytes() const;       // max of live_bytes(); 0 for an empty trace
  int64_t peak_op() const;          // first op index where the peak happens; -1 if none
  int64_t activation_bytes() const; // total bytes of kActivation tensors
  int64_t bytes_of_kind(TensorKind kind) const;
};

}  // namespace memsched
