// trace_fixtures.h -- building small hand-written Traces in GoogleTest suites.
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "core/trace.h"

namespace memsched::test_traces {

// Append one op per name, ids from 0; the first `forward_ops` are forward, the rest backward.
inline void add_ops(Trace& t, const std::vector<std::string>& names, size_t forward_ops, double duration_us = 0.0) {
  for (size_t i = 0; i < names.size(); ++i) {
    Op op;
    op.id = static_cast<int64_t>(t.ops.size());
    op.name = names[i];
    op.phase = i < forward_ops ? Phase::kForward : Phase::kBackward;
    op.duration_us = duration_us;
    op.rng = is_rng_op_name(op.name);
    t.ops.push_back(op);
  }
}

// Append a float32 TensorRecord whose id is its index (held: its held_until_op).
inline void add_tensor(Trace& t, int64_t bytes, TensorKind kind, int64_t producer, std::vector<int64_t> uses,
                       int64_t freed, int64_t held = kNotHeld) {
  TensorRecord r;
  r.id = static_cast<int64_t>(t.tensors.size());
  r.bytes = bytes;
  r.dtype = "float32";
  r.kind = kind;
  r.producer_op = producer;
  r.uses = std::move(uses);
  r.freed_after_op = freed;
  r.held_until_op = held;
  t.tensors.push_back(std::move(r));
}

}  // namespace memsched::test_traces
