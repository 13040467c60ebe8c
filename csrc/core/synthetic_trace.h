// synthetic_trace.h -- random but well-formed training-step Traces for tests
// and benchmarks of the planners and the simulator (no profiler needed).
//
// Entry point: make_synthetic_trace(options).
//
// Shape: `num_layers` layers of `ops_per_layer` forward ops; op s of layer j
// produces one activation read by the next forward op and, with probability
// skip_probability, by a forward op 2..4 ops later (a skip connection); then
// a loss op; then the backward ops in reverse order, the mirror of forward op
// x reading the activations x produced and x read, and producing a gradient
// temporary read by the next backward op. A model input (producer
// kBeforeStep) is saved for the first layer's backward; one parameter per
// layer lives all step. Sizes and durations are uniform in their ranges.
#pragma once

#include <cstdint>

#include "core/trace.h"

namespace memsched {

struct SyntheticTraceOptions {
  int64_t num_layers = 8;          // layers (>= 1)
  int64_t ops_per_layer = 2;       // forward ops per layer (>= 1)
  int64_t min_bytes = 1 << 20;     // activation size range, bytes
  int64_t max_bytes = 8 << 20;
  double min_op_us = 50.0;         // op duration range, microseconds (written as duration_us)
  double max_op_us = 500.0;
  double skip_probability = 0.25;  // chance an activation is also read 2..4 ops later
  uint64_t seed = 1;               // the same seed gives the same trace
};

Trace make_synthetic_trace(const SyntheticTraceOptions& options);

}  // namespace memsched
