// partition_fixtures.h -- devices and tiny traces for the partition suites.
#pragma once

#include <cstdint>
#include <vector>

#include "core/partition/partition_problem.h"
#include "core/synthetic_trace.h"
#include "trace_fixtures.h"

namespace memsched::test_partition {

// `n` identical devices (1 TFLOP/s roofline, measured durations used), cap each, links bw GB/s, latency us.
inline PartitionDevices devices(int n, int64_t cap, double bw_gbps = 1.0, double latency_us = 0.0) {
  PartitionDevices d;
  DeviceModel m;
  m.name = "test";
  for (int k = 0; k < n; ++k) d.devices.push_back(m);
  d.caps_bytes.assign(n, cap);
  d.default_link_bw_gbps = bw_gbps;
  d.link_latency_us = latency_us;
  return d;
}

inline Op op(int64_t id, double us, Phase phase = Phase::kForward, const char* module = "") {
  Op o;
  o.id = id;
  o.name = "op";
  o.module_path = module;
  o.phase = phase;
  o.duration_us = us;
  return o;
}

// A small random step: the synthetic trace generator at a few ops.
inline Trace small_random_trace(uint64_t seed, int64_t layers = 3) {
  SyntheticTraceOptions o;
  o.num_layers = layers;
  o.ops_per_layer = 1;
  o.min_bytes = 1000;
  o.max_bytes = 8000;
  o.min_op_us = 1.0;
  o.max_op_us = 10.0;
  o.skip_probability = 0.5;
  o.seed = seed;
  return make_synthetic_trace(o);
}

}  // namespace memsched::test_partition
