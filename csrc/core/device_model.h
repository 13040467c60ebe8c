// device_model.h -- the performance model of source S5: how long an op and a
// host<->device copy take on one device, and how much memory it has.
//
// Entry points: DeviceModel (the struct), op_time_us(), d2h_time_us(),
// h2d_time_us(), DeviceModel::validate().
//
// Note [Op time model]
//   op time = the measured duration when the trace has one (duration_us > 0)
//             and use_measured_durations is on; otherwise the roofline
//             max(flops / peak_flops, (bytes_read + bytes_written) / hbm_bandwidth).
//   copy    = latency + bytes / bandwidth, separately device->host (D2H) and
//             host->device (H2D); the two directions run concurrently (PCIe is
//             full duplex), each direction is one FIFO stream.
//   Rationale: a trace profiled on a CPU carries CPU durations; simulating it
//   on a GPU model must then ignore them (use_measured_durations = false) and
//   fall back to the roofline, or copies would look free next to slow ops.
#pragma once

#include <cstdint>
#include <string>

#include "core/trace.h"

namespace memsched {

struct DeviceModel {
  std::string name = "unnamed";        // e.g. "h100-pcie5-sxm"
  double peak_flops = 1e12;            // FLOP/s the roofline assumes (> 0)
  double hbm_bw_gbps = 1000.0;         // device memory bandwidth, GB/s (1e9 B/s) (> 0)
  double d2h_bw_gbps = 25.0;           // device->host copy bandwidth, GB/s (> 0)
  double h2d_bw_gbps = 25.0;           // host->device copy bandwidth, GB/s (> 0)
  double d2h_latency_us = 0.0;         // fixed cost per D2H copy, microseconds (>= 0)
  double h2d_latency_us = 0.0;         // fixed cost per H2D copy, microseconds (>= 0)
  int64_t memory_bytes = 0;            // device memory capacity (informational; 0 = unknown)
  bool use_measured_durations = true;  // See Note [Op time model]
  std::string source;                  // where the figures come from (free text)

  // Throws memsched::Error naming the field on a non-positive bandwidth/FLOP
  // rate or a negative latency.
  void validate() const;
};

// Seconds -> microseconds helpers used by the model.
double op_time_us(const DeviceModel& device, const Op& op);
double d2h_time_us(const DeviceModel& device, int64_t bytes);
double h2d_time_us(const DeviceModel& device, int64_t bytes);

}  // namespace memsched
