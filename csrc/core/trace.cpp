// trace.cpp -- validation and derived views of a Trace (see trace.h).
#include "core/trace.h"

#include <algorithm>

#include "core/check.h"

namespace memsched {

const char* to_string(Phase phase) {
  switch (phase) {
    case Phase::kForward: return "forward";
    case Phase::kBackward: return "backward";
    case Phase::kOptimizer: return "optimizer";
  }
  return "?";
}

const char* to_string(TensorKind kind) {
  switch (kind) {
    case TensorKind::kParameter: return "parameter";
    case TensorKind::kGradient: return "gradient";
    case TensorKind::kActivation: return "activation";
    case TensorKind::kOptimizerState: return "optimizer_state";
    case TensorKind::kTemporary: return "temporary";
  }
  return "?";
}

bool parse_phase(const std::string& text, Phase* out) {
  for (Phase p : {Phase::kForward, Phase::kBackward, Phase::kOptimizer}) {
    if (text == to_string(p)) { *out = p; return true; }
  }
  return false;
}

bool parse_tensor_kind(const std::string& text, TensorKind* out) {
  for (TensorKind k : {TensorKind::kParameter, TensorKind::kGradient, TensorKind::kActivation,
                       TensorKind::kOptimizerState, TensorKind::kTemporary}) {
    if (text == to_string(k)) { *out = k; return true; }
  }
  return false;
}

Phase phase_from_string(const std::string& text) {
  Phase p;
  MEMSCHED_CHECK(parse_phase(text, &p), "unknown phase '", text, "'; expected forward, backward or optimizer");
  return p;
}

TensorKind tensor_kind_from_string(const std::string& text) {
  TensorKind k;
  MEMSCHED_CHECK(parse_tensor_kind(text, &k), "unknown tensor kind '", text,
                 "'; expected parameter, gradient, activation, optimizer_state or temporary");
  return k;
}

void Trace::validate() const {
  MEMSCHED_CHECK(version == kTraceVersion, "trace: field 'version' is ", version,
                 " but this memsched reads version ", kTraceVersion, "; re-profile the step");
  const auto n_ops = static_cast<int64_t>(ops.size());
  for (int64_t i = 0; i < n_ops; ++i) {
    const Op& op = ops[i];
    MEMSCHED_CHECK(op.id == i, "trace: ops[", i, "] field 'id' is ", op.id,
                   (op.id >= 0 && op.id < i ? " (a duplicate id)" : ""),
                   "; op ids must be 0, 1, 2, ... in execution order");
    MEMSCHED_CHECK(op.duration_us >= 0, "trace: ops[", i, "] ('", op.name,
                   "') field 'duration_us' is negative (", op.duration_us, ")");
    MEMSCHED_CHECK(op.flops >= 0, "trace: ops[", i, "] ('", op.name, "') field 'flops' is negative");
    MEMSCHED_CHECK(op.bytes_read >= 0, "trace: ops[", i, "] ('", op.name,
                   "') field 'bytes_read' is negative");
    MEMSCHED_CHECK(op.bytes_written >= 0, "trace: ops[", i, "] ('", op.name,
                   "') field 'bytes_written' is negative");
  }
  auto op_in_range = [&](int64_t op) { return op >= 0 && op < n_ops; };
  for (size_t j = 0; j < tensors.size(); ++j) {
    const TensorRecord& t = tensors[j];
    MEMSCHED_CHECK(t.id == static_cast<int64_t>(j), "trace: tensors[", j, "] field 'id' is ", t.id,
                   (t.id >= 0 && t.id < static_cast<int64_t>(j) ? " (a duplicate id)" : ""),
                   "; tensor ids must be 0, 1, 2, ...");
    MEMSCHED_CHECK(t.bytes >= 0, "trace: tensors[", j, "] field 'bytes' is negative (", t.bytes, ")");
    MEMSCHED_CHECK(t.producer_op == kBeforeStep || op_in_range(t.producer_op), "trace: tensors[", j,
                   "] field 'producer_op' is ", t.producer_op, " but there are ", n_ops,
                   " ops (use -1 for a tensor that exists before the step)");
    int64_t prev = -1;
    for (size_t u = 0; u < t.uses.size(); ++u) {
      const int64_t use = t.uses[u];
      MEMSCHED_CHECK(op_in_range(use), "trace: tensors[", j, "] field 'uses[", u, "]' is op ", use,
                     " but there are ", n_ops, " ops");
      MEMSCHED_CHECK(t.producer_op == kBeforeStep || use >= t.producer_op, "trace: tensors[", j,
                     "] field 'uses[", u, "]' is op ", use, ", before its producer op ",
                     t.producer_op);
      MEMSCHED_CHECK(use >= prev, "trace: tensors[", j, "] field 'uses' is not in ascending order at index ", u);
      prev = use;
    }
    if (t.freed_after_op != kAfterStep) {
      MEMSCHED_CHECK(op_in_range(t.freed_after_op), "trace: tensors[", j, "] field 'freed_after_op' is ",
                     t.freed_after_op, " but there are ", n_ops, " ops (use -1 for 'outlives the step')");
      MEMSCHED_CHECK(t.producer_op == kBeforeStep || t.freed_after_op >= t.producer_op, "trace: tensors[",
                     j, "] field 'freed_after_op' (", t.freed_after_op, ") is before its producer op ",
                     t.producer_op);
      MEMSCHED_CHECK(t.uses.empty() || t.freed_after_op >= t.uses.back(), "trace: tensors[", j,
                     "] field 'freed_after_op' (", t.freed_after_op, ") is before its last use (op ",
                     t.uses.back(), ")");
    }
  }
}

int64_t Trace::live_start(const TensorRecord& t) const {
  return t.producer_op == kBeforeStep ? 0 : t.producer_op;
}

int64_t Trace::live_end(const TensorRecord& t) const {
  return t.freed_after_op == kAfterStep ? static_cast<int64_t>(ops.size()) - 1 : t.freed_after_op;
}

std::vector<int64_t> Trace::live_bytes() const {
  const size_t n = ops.size();
  std::vector<int64_t> delta(n + 1, 0);  // difference array: +bytes at start, -bytes after end
  if (n == 0) return {};
  for (const TensorRecord& t : tensors) {
    delta[live_start(t)] += t.bytes;
    delta[live_end(t) + 1] -= t.bytes;
  }
  std::vector<int64_t> live(n);
  int64_t running = 0;
  for (size_t i = 0; i < n; ++i) {
    running += delta[i];
    live[i] = running;
  }
  return live;
}

int64_t Trace::peak_bytes() const {
  const auto live = live_bytes();
  return live.empty() ? 0 : *std::max_element(live.begin(), live.end());
}

int64_t Trace::peak_op() const {
  const auto live = live_bytes();
  if (live.empty()) return -1;
  return std::max_element(live.begin(), live.end()) - live.begin();
}

int64_t Trace::bytes_of_kind(TensorKind kind) const {
  int64_t total = 0;
  for (const TensorRecord& t : tensors)
    if (t.kind == kind) total += t.bytes;
  return total;
}

int64_t Trace::activation_bytes() const { return bytes_of_kind(TensorKind::kActivation); }

}  // namespace memsched
