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
constexpr int kTraceVersion = 1;

struct Op {
  int64_t id = 0;               // == index in Trace::ops (execution order)
  std::string name;             // e.g. "aten::addmm" or "Linear"
  std::string module_path;      // e.g. "layers.3.mlp.fc1"; "" outside any module
  Phase phase = Phase::kForward;
  double duration_us = 0.0;     // measured; 0 = unknown (the device model estimates it)
  double flops = 0.0;           // floating-point operations
  int64_t bytes_read = 0;       // bytes of tensor inputs
  int64_t bytes_written = 0;    // bytes of tensor outputs
};

struct TensorRecord {
  int64_t id = 0;                      // == index in Trace::tensors
  int64_t bytes = 0;                   // storage bytes after de-duplication
  std::string dtype;                   // e.g. "float32"
  TensorKind kind = TensorKind::kActivation;  // kActivation == saved for backward
  int64_t producer_op = kBeforeStep;   // op that allocates it
  std::vector<int64_t> uses;           // ops that read it, ascending
  int64_t freed_after_op = kAfterStep; // last op during which it is live
  std::string label;                   // optional: "module_path:call#:shape" for matching
};

struct Trace {
  int version = kTraceVersion;
  std::string device;                  // "cpu", "cuda:0", ... (informational)
  std::vector<Op> ops;
  std::vector<TensorRecord> tensors;

  // Throws memsched::Error naming the record and field on the first problem:
  // ids not equal to their index (duplicates), op ids out of range, negative
  // bytes or durations, uses not ascending, a use before the producer, a free
  // before the producer or before the last use.
  void validate() const;

  // First and last op index during which tensor `t` is live (See Note
  // [Tensor lifetime convention]). Requires at least one op.
  int64_t live_start(const TensorRecord& t) const;
  int64_t live_end(const TensorRecord& t) const;

  // live_bytes()[i]: bytes live during op i -- the memory curve. O(ops + tensors).
  std::vector<int64_t> live_bytes() const;
  int64_t peak_bytes() const;       // max of live_bytes(); 0 for an empty trace
  int64_t peak_op() const;          // first op index where the peak happens; -1 if none
  int64_t activation_bytes() const; // total bytes of kActivation tensors
  int64_t bytes_of_kind(TensorKind kind) const;
};

}  // namespace memsched
