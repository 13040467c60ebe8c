// device_memory.cpp -- See device_memory.h.
#include "torch/device_memory.h"

#include <c10/core/CachingDeviceAllocator.h>

#include "core/check.h"

namespace memsched {
namespace {

c10::DeviceAllocator* allocator_of(c10::Device device) {
  MEMSCHED_CHECK(!device.is_cpu(), "memsched: device memory counters are for accelerators, not ", device.str());
  return c10::getDeviceAllocator(device.type());
}

c10::DeviceIndex index_of(c10::Device device) { return device.has_index() ? device.index() : 0; }

constexpr size_t kAll = static_cast<size_t>(c10::CachingAllocator::StatType::AGGREGATE);

}  // namespace

int64_t device_allocated_bytes(c10::Device device) {
  return allocator_of(device)->getDeviceStats(index_of(device)).allocated_bytes[kAll].current;
}

int64_t device_peak_bytes(c10::Device device) {
  return allocator_of(device)->getDeviceStats(index_of(device)).allocated_bytes[kAll].peak;
}

int64_t device_reserved_peak_bytes(c10::Device device) {
  return allocator_of(device)->getDeviceStats(index_of(device)).reserved_bytes[kAll].peak;
}

void reset_device_peak(c10::Device device) { allocator_of(device)->resetPeakStats(index_of(device)); }

}  // namespace memsched
