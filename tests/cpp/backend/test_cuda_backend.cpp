// Tests for backend/cuda_backend with the block pool on a real GPU: device
// memory, pinned host memory, and stream-ordered reuse through real CUDA
// events. Every test skips (GTEST_SKIP, reported as skipped) without a device.
#include <gtest/gtest.h>

#include <cstring>
#include <memory>

#include "backend/backend_info.h"
#include "backend/cuda_backend.h"
#include "core/alloc/block_pool.h"

#ifdef MEMSCHED_WITH_CUDA
#include <cuda_runtime_api.h>
#endif

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

TEST(CudaBackend, EmptyCacheWaitsForABusySideStreamBeforeReleasing) {
  SKIP_WITHOUT_GPU();
  BlockPool pool(make_cuda_device_memory(0), make_cuda_stream_events(0));
  const StreamHandle side = cuda_stream_create(0);
  void* a = pool.malloc(12 * kMiB, 0);  // a segment of its own
  void* live = pool.malloc(4096, 0);
  cuda_stream_sleep(side, 100000);     // the side stream is busy for 100 ms
  pool.record_stream(a, side);
  pool.free(a);
  EXPECT_EQ(pool.pending_free_blocks(), 1u);
  pool.empty_cache();                  // waits for the side stream's event, then releases a's segment
  EXPECT_EQ(pool.pending_free_blocks(), 0u);
  const AllocatorStats s = pool.stats();
  EXPECT_EQ(s.num_sync_all_streams, 1);
  EXPECT_EQ(s.reserved_bytes[kAggregatePool].current, int64_t(2 * kMiB));  // the live block's segment stays
  EXPECT_TRUE(pool.owns(live));
  pool.check_invariants();
  cuda_stream_destroy(side);
}

TEST(CudaBackend, PinnedBlocksAreHostMemoryToCuda) {
  // What torch's Tensor.is_pinned() asks (CUDAHooks::isPinnedPtr), for blocks
  // at a segment's start and inside it.
  SKIP_WITHOUT_GPU();
#ifdef MEMSCHED_WITH_CUDA
  BlockPool pool(make_cuda_pinned_memory(), make_cuda_stream_events(-1));
  void* first = pool.malloc(1000);
  void* second = pool.malloc(1000);
  for (void* p : {first, second}) {
    cudaPointerAttributes attr{};
    ASSERT_EQ(cudaPointerGetAttributes(&attr, p), cudaSuccess);
    EXPECT_EQ(attr.type, cudaMemoryTypeHost);
  }
  pool.free(first);
  pool.free(second);
#endif
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
