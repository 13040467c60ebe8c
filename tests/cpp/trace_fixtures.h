// trace_fixtures.h -- building small hand-written Traces in GoogleTest suites.
#pragma once

#include <cstdint>
#include <utility>
#include <vector>

#include "core/trace.h"

namespace memsched::test_traces {

// Append a float32 TensorRecord whose id is its index.
inline void add_tensor(Trace& t, int64_t bytes, TensorKind kind, int64_t producer, std::vector<int64_t> uses,
                       int64_t freed) {
  TensorRecord r;
  r.id = static_cast<int64_t>(t.tensors.size());
  r.bytes = bytes;
  r.dtype = "float32";
  r.kind = kind;
  r.producer_op = producer;
  r.uses = std::move(uses);
  r.freed_after_op = freed;
  t.tensors.push_back(std::move(r));
}

}  // namespace memsched::test_traces
