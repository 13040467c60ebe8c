// placement_planner.h -- planned placement: lay out one steady-state step's
// tensors at fixed offsets in a single arena, from the Trace alone.
//
// Entry point: plan_placement(trace, options) -> Placement.
//
// Note [Greedy interval packing]
//   Rationale: a training step allocates the same tensors in the same order
//   every step, so their offsets can be decided once. Two tensors may share
//   bytes iff their lifetimes (See Note [Tensor lifetime convention] in
//   trace.h) do not overlap. Minimising the arena is NP-hard (dynamic storage
//   allocation); the greedy packers of inference runtimes (TFLite's
//   "greedy by size", ONNX Runtime's arena planner) land close to the lower
//   bound, the step's peak live bytes.
//   Approach: take tensors in one of several orders (size descending; size x
//   lifetime descending; lifetime start ascending); place each at the
//   best-fitting gap (smallest gap that holds it) among the already placed
//   tensors whose lifetimes overlap its own, or on top of them if no gap fits.
//   Keep the order that gives the smallest arena. Sizes are rounded up to
//   `alignment_bytes` first, so every offset is aligned.
//   Limitations: the lower bound counts raw bytes; alignment alone can push
//   the arena above it for traces of many tiny tensors.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "core/trace.h"

namespace memsched {

struct PlacementOptions {
  int64_t alignment_bytes = 512;  // every offset and size is a multiple of this
};

struct Placement {
  std::vector<int64_t> offsets;      // per tensor id: byte offset in the arena; -1 if 0 bytes
  std::vector<int64_t> sizes;        // per tensor id: aligned bytes it occupies
  int64_t arena_bytes = 0;           // bytes the arena needs
  int64_t lower_bound_bytes = 0;     // the trace's peak live bytes (unaligned)
  std::string strategy;              // which tensor order won ("size", "area", "start")

  double ratio() const {             // arena_bytes / lower_bound_bytes (1.0 if the bound is 0)
    return lower_bound_bytes > 0 ? static_cast<double>(arena_bytes) / lower_bound_bytes : 1.0;
  }
  // Throws memsched::Error if two tensors with overlapping lifetimes overlap
  // in the arena, an offset is misaligned, or a tensor sticks out of the arena.
  void check_invariants(const Trace& trace, int64_t alignment_bytes) const;
};

Placement plan_placement(const Trace& trace, const PlacementOptions& options = PlacementOptions());

}  // namespace memsched
