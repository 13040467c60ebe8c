// device_model.cpp -- op and copy times of the S5 performance model (see device_model.h).
#include "core/device_model.h"

#include <cmath>

#include <algorithm>

#include "core/check.h"

namespace memsched {

// Note [Device model bounds]
//   Every field is finite and within a range that no real device leaves, so no
//   simulated time can become inf or NaN: with flops <= 1e30 and bytes <= 2^62
//   (Note [Trace value bounds]) every op and copy time stays below ~1e33 us.
namespace {
void check_range(const DeviceModel& d, const char* field, double value, double least, double most,
                 const char* unit) {
  MEMSCHED_CHECK(std::isfinite(value) && value >= least && value <= most, "device '", d.name, "': field '",
                 field, "' must be a finite number in [", least, ", ", most, "] ", unit, " (got ", value, ")");
}
}  // namespace

void DeviceModel::validate() const {
  MEMSCHED_CHECK(peak_flops > 0, "device '", name, "': field 'peak_flops' must be > 0 (got ", peak_flops, ")");
  MEMSCHED_CHECK(hbm_bw_gbps > 0, "device '", name, "': field 'hbm_bw_gbps' must be > 0 (got ", hbm_bw_gbps, ")");
  MEMSCHED_CHECK(d2h_bw_gbps > 0, "device '", name, "': field 'd2h_bw_gbps' must be > 0 (got ", d2h_bw_gbps, ")");
  MEMSCHED_CHECK(h2d_bw_gbps > 0, "device '", name, "': field 'h2d_bw_gbps' must be > 0 (got ", h2d_bw_gbps, ")");
  MEMSCHED_CHECK(d2h_latency_us >= 0, "device '", name, "': field 'd2h_latency_us' must be >= 0");
  MEMSCHED_CHECK(h2d_latency_us >= 0, "device '", name, "': field 'h2d_latency_us' must be >= 0");
  MEMSCHED_CHECK(memory_bytes >= 0, "device '", name, "': field 'memory_bytes' must be >= 0");
  // See Note [Device model bounds].
  check_range(*this, "peak_flops", peak_flops, 1e3, 1e21, "FLOP/s");
  check_range(*this, "hbm_bw_gbps", hbm_bw_gbps, 1e-3, 1e6, "GB/s");
  check_range(*this, "d2h_bw_gbps", d2h_bw_gbps, 1e-3, 1e6, "GB/s");
  check_range(*this, "h2d_bw_gbps", h2d_bw_gbps, 1e-3, 1e6, "GB/s");
  check_range(*this, "d2h_latency_us", d2h_latency_us, 0.0, 1e9, "us");
  check_range(*this, "h2d_latency_us", h2d_latency_us, 0.0, 1e9, "us");
}

double op_time_us(const DeviceModel& device, const Op& op) {
  if (device.use_measured_durations && op.duration_us > 0) return op.duration_us;
  const double compute_us = op.flops / device.peak_flops * 1e6;
  const double memory_us = static_cast<double>(op.bytes_read + op.bytes_written) / (device.hbm_bw_gbps * 1e3);
  return std::max(compute_us, memory_us);
}

// GB/s = 1e9 B/s = 1e3 B/us.
double d2h_time_us(const DeviceModel& device, int64_t bytes) {
  return device.d2h_latency_us + static_cast<double>(bytes) / (device.d2h_bw_gbps * 1e3);
}

double h2d_time_us(const DeviceModel& device, int64_t bytes) {
  return device.h2d_latency_us + static_cast<double>(bytes) / (device.h2d_bw_gbps * 1e3);
}

}  // namespace memsched
