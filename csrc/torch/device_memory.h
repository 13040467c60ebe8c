// device_memory.h -- the device allocator's own byte counters, read from C++ without a
// synchronisation (they are the host's bookkeeping of what the caching allocator handed out).
//
// torch.cuda.memory_allocated() builds the whole statistics dictionary in Python per call (~50 us);
// the memory guard reads the count at every activation's first save and the profiler around every
// op, so both go through here: c10's device-generic allocator interface (torch >= 2.9). With
// memsched's allocator installed, torch's pluggable allocator keeps no statistics: callers pass the
// shim's counters instead (memsched.allocator.allocated_bytes_fn).
#pragma once

#include <cstdint>

#include <c10/core/Device.h>

namespace memsched {

int64_t device_allocated_bytes(c10::Device device);  // allocated_bytes.all.current
int64_t device_peak_bytes(c10::Device device);       // allocated_bytes.all.peak since the last reset
int64_t device_reserved_peak_bytes(c10::Device device);  // reserved_bytes.all.peak since the last reset
void reset_device_peak(c10::Device device);          // start a new peak (torch.cuda.reset_peak_memory_stats)

}  // namespace memsched
