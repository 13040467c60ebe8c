// trace_builder.cpp -- see trace_builder.h and Note [Trace builder events].
#include "core/trace_builder.h"

#include <algorithm>
#include <utility>

#include "core/check.h"

namespace memsched {
namespace {

// Upgrade order: temporary < activation < gradient < optimizer_state < parameter.
int kind_rank(TensorKind kind) {
  switch (kind) {
    case TensorKind::kTemporary: return 0;
    case TensorKind::kActivation: return 1;
    case TensorKind::kGradient: return 2;
    case TensorKind::kOptimizerState: return 3;
    case TensorKind::kParameter: return 4;
  }
  return 0;
}

}  // namespace

TraceBuilder::TraceBuilder(std::string device) : device_(std::move(device)) {}

int64_t TraceBuilder::begin_op(const std::string& name, const std::string& module_path, Phase phase) {
  MEMSCHED_CHECK(!in_op_, "TraceBuilder::begin_op('", name, "'): op ", ops_.size() - 1, " ('",
                 ops_.back().name, "') is still open; call end_op first");
  Op op;
  op.id = num_ops();
  op.name = name;
  op.module_path = module_path;
  op.phase = phase;
  op.rng = is_rng_op_name(name);
  ops_.push_back(std::move(op));
  in_op_ = true;
  return ops_.back().id;
}

void TraceBuilder::end_op(double duration_us, double flops, int64_t bytes_read, int64_t bytes_written) {
  MEMSCHED_CHECK(in_op_, "TraceBuilder::end_op: no op is open; call begin_op first");
  MEMSCHED_CHECK(duration_us >= 0 && flops >= 0 && bytes_read >= 0 && bytes_written >= 0,
                 "TraceBuilder::end_op: op ", ops_.back().id, " ('", ops_.back().name,
                 "') got a negative measurement (duration_us=", duration_us, ", flops=", flops,
                 ", bytes_read=", bytes_read, ", bytes_written=", bytes_written, ")");
  Op& op = ops_.back();
  op.duration_us = duration_us;
  op.flops = flops;
  op.bytes_read = bytes_read;
  op.bytes_written = bytes_written;
  in_op_ = false;
}

int64_t TraceBuilder::record_op(const std::string& name, const std::string& module_path, Phase phase,
                                const std::vector<uint64_t>& used, const std::vector<OutputInfo>& outputs,
                                double duration_us, double flops, int64_t bytes_read, int64_t bytes_written) {
  const int64_t id = begin_op(name, module_path, phase);
  try {
    for (uint64_t key : used) tensor_used(key);
    for (const OutputInfo& out : outputs) tensor_allocated(out.key, out.bytes, out.dtype, TensorKind::kTemporary);
    end_op(duration_us, flops, bytes_read, bytes_written);
  } catch (...) {
    in_op_ = false;  // leave the builder usable: the op stays, half-filled, and the error propagates
    throw;
  }
  return id;
}

void TraceBuilder::set_duration_us(int64_t op_id, double duration_us) {
  MEMSCHED_CHECK(op_id >= 0 && op_id < num_ops(), "TraceBuilder::set_duration_us: op ", op_id,
                 " is out of range (", num_ops(), " ops)");
  MEMSCHED_CHECK(duration_us >= 0, "TraceBuilder::set_duration_us: op ", op_id, " duration_us is negative (",
                 duration_us, ")");
  ops_[op_id].duration_us = duration_us;
}

int64_t TraceBuilder::new_record(uint64_t key, int64_t bytes, const std::string& dtype, TensorKind kind,
                                 const std::string& label, int64_t producer_op) {
  MEMSCHED_CHECK(bytes >= 0, "TraceBuilder: storage ", key, " has negative bytes (", bytes, ")");
  TensorRecord r;
  r.id = num_records();
  r.bytes = bytes;
  r.dtype = dtype;
  r.kind = kind;
  r.producer_op = producer_op;
  r.label = label;
  records_.push_back(std::move(r));
  dropped_.push_back(0);
  live_[key] = records_.back().id;
  return records_.back().id;
}

int64_t TraceBuilder::live_record(uint64_t key, const char* event) const {
  auto it = live_.find(key);
  MEMSCHED_CHECK(it != live_.end(), "TraceBuilder::", event, ": storage ", key,
                 " is not live; register it first with tensor_existing or tensor_allocated");
  return it->second;
}

int64_t TraceBuilder::tensor_existing(uint64_t key, int64_t bytes, const std::string& dtype, TensorKind kind,
                                      const std::string& label) {
  MEMSCHED_CHECK(!is_live(key), "TraceBuilder::tensor_existing: storage ", key,
                 " is live already (record ", live_.at(key), "); a key names one live storage");
  return new_record(key, bytes, dtype, kind, label, kBeforeStep);
}

bool TraceBuilder::tensor_allocated(uint64_t key, int64_t bytes, const std::string& dtype, TensorKind kind,
                                    const std::string& label) {
  MEMSCHED_CHECK(in_op_, "TraceBuilder::tensor_allocated: storage ", key,
                 " allocated outside an op; call begin_op first (or tensor_existing)");
  auto it = live_.find(key);
  if (it != live_.end()) {
    TensorRecord& r = records_[it->second];
    if (bytes > r.bytes) r.bytes = bytes;  // resize_ grew the storage in place
    upgrade_kind(key, kind, label);
    return false;
  }
  new_record(key, bytes, dtype, kind, label, ops_.back().id);
  return true;
}

void TraceBuilder::tensor_used(uint64_t key) {
  MEMSCHED_CHECK(in_op_, "TraceBuilder::tensor_used: storage ", key, " used outside an op; call begin_op first");
  TensorRecord& r = records_[live_record(key, "tensor_used")];
  const int64_t op = ops_.back().id;
  if (r.uses.empty() || r.uses.back() != op) r.uses.push_back(op);
}

void TraceBuilder::tensor_freed(uint64_t key) {
  const int64_t index = live_record(key, "tensor_freed");
  live_.erase(key);
  if (ops_.empty()) {
    dropped_[index] = 1;  // never live during an op
    return;
  }
  records_[index].freed_after_op = ops_.back().id;
}

void TraceBuilder::tensor_held(uint64_t key) {
  const int64_t index = live_record(key, "tensor_held");
  if (!ops_.empty()) records_[index].held_until_op = std::max(records_[index].held_until_op, ops_.back().id);
}

void TraceBuilder::tensor_save_counters(uint64_t key, int64_t counters) {
  TensorRecord& r = records_[live_record(key, "tensor_save_counters")];
  r.save_counters = std::max(r.save_counters, counters);
}

void TraceBuilder::upgrade_kind(uint64_t key, TensorKind kind, const std::string& label) {
  TensorRecord& r = records_[live_record(key, "upgrade_kind")];
  if (kind_rank(kind) > kind_rank(r.kind)) r.kind = kind;
  if (r.label.empty() && !label.empty()) r.label = label;
}

std::vector<uint64_t> TraceBuilder::live_keys() const {
  std::vector<uint64_t> keys;
  keys.reserve(live_.size());
  for (const auto& kv : live_) keys.push_back(kv.first);
  return keys;
}

Trace TraceBuilder::finish() {
  MEMSCHED_CHECK(!in_op_, "TraceBuilder::finish: op ", ops_.back().id, " ('", ops_.back().name,
                 "') is still open; call end_op first");
  Trace trace;
  trace.device = device_;
  trace.ops = std::move(ops_);
  trace.tensors.reserve(records_.size());
  for (size_t i = 0; i < records_.size(); ++i) {
    if (dropped_[i]) continue;
    TensorRecord r = std::move(records_[i]);
    r.id = static_cast<int64_t>(trace.tensors.size());
    trace.tensors.push_back(std::move(r));
  }
  ops_.clear();
  records_.clear();
  dropped_.clear();
  live_.clear();
  trace.validate();
  return trace;
}

void TraceBuilder::check_invariants() const {
  MEMSCHED_CHECK(!in_op_ || !ops_.empty(), "TraceBuilder invariant: in_op_ without any op");
  MEMSCHED_CHECK(records_.size() == dropped_.size(), "TraceBuilder invariant: records_/dropped_ sizes differ");
  for (size_t i = 0; i < ops_.size(); ++i)
    MEMSCHED_CHECK(ops_[i].id == static_cast<int64_t>(i), "TraceBuilder invariant: op ", i, " has id ", ops_[i].id);
  for (const auto& kv : live_) {
    MEMSCHED_CHECK(kv.second >= 0 && kv.second < num_records(), "TraceBuilder invariant: live key ", kv.first,
                   " points at record ", kv.second, " of ", num_records());
    const TensorRecord& r = records_[kv.second];
    MEMSCHED_CHECK(r.freed_after_op == kAfterStep && !dropped_[kv.second], "TraceBuilder invariant: live key ",
                   kv.first, " points at freed record ", kv.second);
  }
  for (const TensorRecord& r : records_) {
    for (size_t u = 1; u < r.uses.size(); ++u)
      MEMSCHED_CHECK(r.uses[u - 1] < r.uses[u], "TraceBuilder invariant: record ", r.id, " uses not ascending");
    MEMSCHED_CHECK(r.producer_op == kBeforeStep || r.producer_op < num_ops(), "TraceBuilder invariant: record ",
                   r.id, " producer out of range");
  }
}

}  // namespace memsched
