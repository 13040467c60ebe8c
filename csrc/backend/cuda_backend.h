// cuda_backend.h -- the CUDA implementations of RawMemory and StreamEvents:
// device memory (cudaMalloc/cudaFree), pinned host memory (cudaHostAlloc),
// and stream-ordered events (cudaEventRecord/Query, pooled). The only place
// in memsched that calls the CUDA runtime (csrc/backend/cuda/).
//
// Every function is declared in every build; in a build without CUDA
// (MEMSCHED_WITH_CUDA off) they throw memsched::Error, except
// cuda_device_count(), which returns 0. Nothing here runs at load time.
#pragma once

#include <memory>

#include "core/alloc/raw_memory.h"

namespace memsched {

// Number of CUDA devices; 0 when built without CUDA, with no driver or no GPU.
// Never throws.
int cuda_device_count();

// cudaMalloc on `device` (the current device is restored afterwards);
// allocate() returns nullptr on cudaErrorMemoryAllocation.
std::shared_ptr<RawMemory> make_cuda_device_memory(int device);
// cudaHostAlloc (portable, page-locked); usable by every device's copies.
std::shared_ptr<RawMemory> make_cuda_pinned_memory();
// CUDA events (timing disabled, recycled) on `device`; -1 = the device that is
// current when each event is created.
std::shared_ptr<StreamEvents> make_cuda_stream_events(int device);

// Test helpers: a non-blocking stream on `device`, and its destruction.
StreamHandle cuda_stream_create(int device);
void cuda_stream_destroy(StreamHandle stream);
// Enqueue on `stream` a kernel-free delay: a host function that sleeps
// `duration_us` (tests use it to keep an event unfinished for a while).
void cuda_stream_sleep(StreamHandle stream, int duration_us);
void cuda_stream_synchronize(StreamHandle stream);

}  // namespace memsched
