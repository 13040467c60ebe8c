// trace.cpp -- validation and derived views of a Trace (see trace.h).
#include "core/trace.h"

#include <algorithm>
#include <cctype>
#include <cmath>

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

bool is_rng_op_name(const std::string& name) {
  std::string lower(name);
  std::transform(lower.begin(), lower.end(), lower.begin(),
                 [](unsigned char ch) { return static_cast<char>(std::tolower(ch)); });
  for (const char* word : {"dropout", "bernoulli", "rand", "rrelu", "normal", "uniform", "multinomial", "exponential",
                           "geometric", "cauchy"})
    if (lower.find(word) != std::string::npos) return true;
  return false;
}

bool is_valid_utf8(const std::string& text) {
  const auto* s = reinterpret_cast<const unsigned char*>(text.data());
  const size_t n = text.size();
  size_t i = 0;
  while (i < n) {
    const unsigned char c = s[i];
    if (c < 0x80) { ++i; continue; }
    size_t len = 0;
    uint32_t cp = 0;
    if ((c & 0xE0) == 0xC0) { len = 2; cp = c & 0x1F; }
    else if ((c & 0xF0) == 0xE0) { len = 3; cp = c & 0x0F; }
    else if ((c & 0xF8) == 0xF0) { len = 4; cp = c & 0x07; }
    else return false;  // a continuation byte first, or 0xF8..0xFF
    if (i + len > n) return false;
    for (size_t k = 1; k < len; ++k) {
      if ((s[i + k] & 0xC0) != 0x80) return false;
      cp = (cp << 6) | (s[i + k] & 0x3F);
    }
    const uint32_t least[] = {0, 0, 0x80, 0x800, 0x10000};
    if (cp < least[len] || cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF)) return false;  // overlong, surrogate
    i += len;
  }
  return true;
}

namespace {

// "field 'flops' is 1e+400": a measured number must be finite and within [0, bound].
void check_measurement(double value, double bound, int64_t index, const std::string& name, const char* field,
                       const char* fix) {
  MEMSCHED_CHECK(!(value < 0), "trace: ops[", index, "] ('", name, "') field '", field, "' is negative (", value,
                 "); ", fix);
  MEMSCHED_CHECK(std::isfinite(value) && value <= bound, "trace: ops[", index, "] ('", name, "') field '", field,
                 "' is ", value, (std::isfinite(value) ? ", above the bound " : ", not a finite number; the bound is "),
                 bound, "; ", fix);
}

void check_utf8(const std::string& text, const std::string& where, const char* field) {
  MEMSCHED_CHECK(is_valid_utf8(text), "trace: ", where, " field '", field,
                 "' is not valid UTF-8; names must be UTF-8 text (pass a str, not bytes, from Python)");
}

}  // namespace

void Trace::validate() const {
  MEMSCHED_CHECK(version == kTraceVersion, "trace: field 'version' is ", version,
                 " but this memsched reads version ", kTraceVersion, "; re-profile the step");
  check_utf8(device, "the top level", "device");
  MEMSCHED_CHECK(min_offload_bytes >= 0, "trace: field 'min_offload_bytes' is ", min_offload_bytes,
                 "; it must be >= 0 (0: every activation may be offloaded)");
  const auto n_ops = static_cast<int64_t>(ops.size());
  for (int64_t i = 0; i < n_ops; ++i) {
    const Op& op = ops[i];
    const std::string where = "ops[" + std::to_string(i) + "]";
    MEMSCHED_CHECK(op.id == i, "trace: ops[", i, "] field 'id' is ", op.id,
                   (op.id >= 0 && op.id < i ? " (a duplicate id)" : ""),
                   "; op ids must be 0, 1, 2, ... in execution order");
    check_utf8(op.name, where, "name");
    check_utf8(op.module_path, where, "module_path");
    check_measurement(op.duration_us, kMaxOpDurationUs, i, op.name, "duration_us",
                      "write the measured time in microseconds, or 0 when unknown");
    check_measurement(op.flops, kMaxOpFlops, i, op.name, "flops",
                      "write the op's floating-point operations, or 0 when unknown");
    MEMSCHED_CHECK(op.bytes_read >= 0, "trace: ops[", i, "] ('", op.name,
                   "') field 'bytes_read' is negative");
    MEMSCHED_CHECK(op.bytes_written >= 0, "trace: ops[", i, "] ('", op.name,
                   "') field 'bytes_written' is negative");
    MEMSCHED_CHECK(op.bytes_read <= kMaxTraceBytes - op.bytes_written, "trace: ops[", i, "] ('", op.name,
                   "') fields 'bytes_read' (", op.bytes_read, ") + 'bytes_written' (", op.bytes_written,
                   ") exceed ", kMaxTraceBytes, " bytes (2^62); write the bytes "
                   "of the op's tensor inputs and outputs");
  }
  auto op_in_range = [&](int64_t op) { return op >= 0 && op < n_ops; };
  int64_t total_bytes = 0;  // <= kMaxTraceBytes, so every sum of bytes fits
  for (size_t j = 0; j < tensors.size(); ++j) {
    const TensorRecord& t = tensors[j];
    const std::string where = "tensors[" + std::to_string(j) + "]";
    MEMSCHED_CHECK(t.id == static_cast<int64_t>(j), "trace: tensors[", j, "] field 'id' is ", t.id,
                   (t.id >= 0 && t.id < static_cast<int64_t>(j) ? " (a duplicate id)" : ""),
                   "; tensor ids must be 0, 1, 2, ...");
    MEMSCHED_CHECK(t.bytes >= 0, "trace: tensors[", j, "] field 'bytes' is negative (", t.bytes, ")");
    MEMSCHED_CHECK(t.bytes <= kMaxTraceBytes, "trace: tensors[", j, "] field 'bytes' is ", t.bytes,
                   ", above the bound ", kMaxTraceBytes, " (2^62 = 4 EiB); "
                   "write the tensor's storage size in bytes");
    MEMSCHED_CHECK(t.bytes <= kMaxTraceBytes - total_bytes, "trace: tensors[", j, "] field 'bytes' (", t.bytes,
                   ") brings the bytes of tensors[0..", j, "] together to more than ", kMaxTraceBytes,
                   " (2^62 = 4 EiB), where sums of bytes could overflow; "
                   "write each tensor's storage size in bytes");
    total_bytes += t.bytes;
    check_utf8(t.dtype, where, "dtype");
    check_utf8(t.label, where, "label");
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
    MEMSCHED_CHECK(t.save_counters >= 1, "trace: tensors[", j, "] field 'save_counters' is ", t.save_counters,
                   "; it must be at least 1 (the version counters its saves came through)");
    if (t.held_until_op != kNotHeld) {
      MEMSCHED_CHECK(op_in_range(t.held_until_op), "trace: tensors[", j, "] field 'held_until_op' is ",
                     t.held_until_op, " but there are ", n_ops, " ops (use -1 for 'held by nothing but its saves')");
      MEMSCHED_CHECK(t.producer_op == kBeforeStep || t.held_until_op >= t.producer_op, "trace: tensors[", j,
                     "] field 'held_until_op' (", t.held_until_op, ") is before its producer op ", t.producer_op);
      MEMSCHED_CHECK(t.freed_after_op == kAfterStep || t.held_until_op <= t.freed_after_op, "trace: tensors[", j,
                     "] field 'held_until_op' (", t.held_until_op, ") is after its free op ", t.freed_after_op,
                     " (a storage cannot be held after it died)");
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
  validate();  // See Note [Trace value bounds]: in range, and no sum overflows
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
  validate();  // See Note [Trace value bounds]: the sum fits
  int64_t total = 0;
  for (const TensorRecord& t : tensors)
    if (t.kind == kind) total += t.bytes;
  return total;
}

int64_t Trace::activation_bytes() const { return bytes_of_kind(TensorKind::kActivation); }

}  // namespace memsched
