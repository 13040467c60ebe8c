// trace_json.h -- Trace <-> JSON (nlohmann_json), versioned and validated.
//
// Format (version 1):
//   {"version": 1, "device": "cpu",
//    "ops": [{"id", "name", "module_path", "phase", "duration_us", "flops",
//             "bytes_read", "bytes_written", "rng"?}, ...],
//    "tensors": [{"id", "bytes", "dtype", "kind", "producer_op", "uses",
//                 "freed_after_op", "label"?}, ...]}
// "rng" (bool) is optional: when absent it is is_rng_op_name(name), and it is
// written only where it differs from that, so version-1 files without it stay
// valid and unchanged.
// Loading checks every field's presence and type, then Trace::validate(); the
// first problem throws memsched::Error naming the record and the field.
#pragma once

#include <string>

#include "core/trace.h"

namespace memsched {

std::string trace_to_json(const Trace& trace, int indent = -1);
Trace trace_from_json(const std::string& text);

void save_trace(const Trace& trace, const std::string& path);
Trace load_trace(const std::string& path);

}  // namespace memsched
