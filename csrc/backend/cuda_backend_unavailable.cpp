// cuda_backend_unavailable.cpp -- the CUDA backend's entry points in a build
// without CUDA (see cuda_backend.h): a clear error, never a link failure.
#include "backend/cuda_backend.h"

#ifndef MEMSCHED_WITH_CUDA
#include "core/check.h"

namespace memsched {

namespace {
[[noreturn]] void unavailable(const char* what) {
  MEMSCHED_CHECK(false, what, ": memsched was built without CUDA (MEMSCHED_WITH_CUDA=OFF); "
                 "rebuild on a machine with the CUDA toolkit (nvcc) to use CUDA memory");
  throw;  // unreachable
}
}  // namespace

int cuda_device_count() { return 0; }
std::shared_ptr<RawMemory> make_cuda_device_memory(int) { unavailable("make_cuda_device_memory"); }
std::shared_ptr<RawMemory> make_cuda_pinned_memory() { unavailable("make_cuda_pinned_memory"); }
std::shared_ptr<StreamEvents> make_cuda_stream_events(int) { unavailable("make_cuda_stream_events"); }
StreamHandle cuda_stream_create(int) { unavailable("cuda_stream_create"); }
void cuda_stream_destroy(StreamHandle) { unavailable("cuda_stream_destroy"); }
void cuda_stream_sleep(StreamHandle, int) { unavailable("cuda_stream_sleep"); }
void cuda_stream_synchronize(StreamHandle) { unavailable("cuda_stream_synchronize"); }

}  // namespace memsched
#endif
