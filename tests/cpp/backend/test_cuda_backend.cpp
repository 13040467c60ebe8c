// Tests for backend/cuda_backend with the block pool on a real GPU: device
// memory, pinned host memory, and stream-ordered reuse through real CUDA
// events. Every test skips (GTEST_SKIP, reported as skipped) without a device.
#include <gtest/gtest.h>

#include <cstring>
#include <memory>

#include "backend/backend_info.h"
#include "backend/cuda_backend.h"
#include "core/alloc/block_pool.h"

namespace memsched {
namespace {

constexpr size_t kMiB = 1024 * 1024;

#define SKIP_WITHOUT_GPU()                                                              \
  do {                                                                                  \
    if (!backend_built_with_cuda()) GTEST_SKIP() << "built without CUDA";              \
    if (cuda_device_count() == 0) GTEST_SKIP() << "no CUDA device visible";            \
  } while (0)

TEST(CudaBackend, UnavailableIsAClearErrorNotACrash) {
  if (backend_built_with_cuda() && cuda_device_count() > 0) GTEST_SKIP() << "a GPU is present";
  EXPECT_EQ(cuda_device_count(), 0);
  EXPECT_THROW(make_cuda_pinned_memory(), Error);
  EXPECT_THROW(make_cuda_device_memory(0), Error);
}

TEST(CudaBackend, DevicePoolAllocatesAndReuses) {
  SKIP_WITHOUT_GPU();
  BlockPool pool(make_cuda_device_memory(0), make_cuda_stream_events(0));
  void* a = pool.malloc(1000);
  void* b = pool.malloc(3 * kMiB);
  ASSERT_NE(a, nullptr);
  ASSERT_NE(b, nullptr);
  pool.free(a);
  EXPECT_EQ(pool.malloc(1000), a);
  EXPECT_EQ(pool.stats().num_device_alloc, 2);
  pool.check_invariants();
}

TEST(CudaBackend, RecordStreamWaitsForTheRealStream) {
  SKIP_WITHOUT_GPU();
  BlockPool pool(make_cuda_device_memory(0), make_cuda_stream_events(0));
  const StreamHandle side = cuda_stream_create(0);
  void* a = pool.malloc(4096, 0);
  cuda_stream_sleep(side, 200000);  // the side stream is busy for 200 ms
  pool.record_stream(a, side);
  pool.free(a);
  void* b = pool.malloc(4096, 0);
  EXPECT_NE(b, a);                  // the side stream may still read a
  cuda_stream_synchronize(side);
  pool.free(b);
  EXPECT_EQ(pool.malloc(4096, 0), a);  // event done: a is reused
  pool.check_invariants();
  cuda_stream_destroy(side);
}

TEST(CudaBackend, PinnedPoolIsHostWritable) {
  SKIP_WITHOUT_GPU();
  BlockPool pool(make_cuda_pinned_memory(), make_cuda_stream_events(-1));
  auto* p = static_cast<unsigned char*>(pool.malloc(5 * kMiB));
  std::memset(p, 7, 5 * kMiB);
  EXPECT_EQ(p[5 * kMiB - 1], 7);
  pool.free(p);
  pool.empty_cache();
  EXPECT_EQ(pool.stats().reserved_bytes[kAggregatePool].current, 0);
}

}  // namespace
}  // namespace memsched
