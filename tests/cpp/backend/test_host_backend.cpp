// Tests for backend/host_memory with the block pool on real memory: alignment,
// capacity refusal (the out-of-memory path end to end), and an 8-thread stress
// test that writes a per-thread pattern into every block and checks it before
// freeing (any overlap between threads' blocks corrupts a pattern).
#include <gtest/gtest.h>

#include <atomic>
#include <cstring>
#include <memory>
#include <random>
#include <thread>
#include <vector>

#include "backend/host_memory.h"
#include "core/alloc/block_pool.h"
#include "core/alloc/virtual_memory.h"

namespace memsched {
namespace {

constexpr size_t kMiB = 1024 * 1024;

TEST(HostRawMemory, AlignsAndRefusesBeyondCapacity) {
  HostRawMemory raw(4096, 8 * kMiB);
  void* a = raw.allocate(5 * kMiB);
  ASSERT_NE(a, nullptr);
  EXPECT_EQ(reinterpret_cast<uintptr_t>(a) % 4096, 0u);
  std::memset(a, 0xab, 5 * kMiB);
  EXPECT_EQ(raw.allocate(4 * kMiB), nullptr);
  EXPECT_EQ(raw.outstanding_bytes(), 5 * kMiB);
  raw.free(a, 5 * kMiB);
  EXPECT_EQ(raw.outstanding_bytes(), 0u);
  EXPECT_THROW(HostRawMemory(3), Error);
}

TEST(HostBlockPool, OutOfMemoryWithARefusingBackendIsClearAndRecoverable) {
  auto raw = std::make_shared<HostRawMemory>(4096, 24 * kMiB);
  BlockPool pool(raw, std::make_shared<ManualStreamEvents>(true));
  void* a = pool.malloc(20 * kMiB);
  try {
    pool.malloc(12 * kMiB);
    FAIL() << "expected OutOfMemoryError";
  } catch (const OutOfMemoryError& e) {
    EXPECT_NE(std::string(e.what()).find("the 'host' backend refused"), std::string::npos) << e.what();
  }
  pool.free(a);
  void* b = pool.malloc(12 * kMiB);  // reuses the cached 20 MiB block
  std::memset(b, 1, 12 * kMiB);
  pool.free(b);
  pool.empty_cache();
  EXPECT_EQ(raw->outstanding_bytes(), 0u);
  pool.check_invariants();
}

TEST(HostBlockPool, EightThreadStress) {
  auto raw = std::make_shared<HostRawMemory>();
  auto events = std::make_shared<ManualStreamEvents>(/*immediate=*/true);
  BlockPool pool(raw, events);
  std::atomic<int> corrupted{0};
  std::atomic<bool> stop{false};
  constexpr int kThreads = 8;
  constexpr int kOpsPerThread = 40000;
  auto worker = [&](int tid) {
    std::mt19937 rng(1000 + tid);
    struct Live {
      unsigned char* ptr;
      size_t bytes;
      unsigned char tag;
    };
    std::vector<Live> live;
    auto fill = [](const Live& l) {
      const size_t n = std::min<size_t>(l.bytes, 256);
      std::memset(l.ptr, l.tag, n);
      std::memset(l.ptr + l.bytes - n, l.tag, n);
    };
    auto intact = [](const Live& l) {
      const size_t n = std::min<size_t>(l.bytes, 256);
      for (size_t i = 0; i < n; ++i) {
        if (l.ptr[i] != l.tag || l.ptr[l.bytes - 1 - i] != l.tag) return false;
      }
      return true;
    };
    for (int op = 0; op < kOpsPerThread; ++op) {
      const int kind = std::uniform_int_distribution<int>(0, 9)(rng);
      if ((kind < 5 && live.size() < 48) || live.empty()) {
        const int shift = std::uniform_int_distribution<int>(0, 22)(rng);
        const size_t bytes = 1 + std::uniform_int_distribution<size_t>(0, (size_t{1} << shift))(rng);
        const StreamHandle stream = std::uniform_int_distribution<int>(0, 2)(rng);
        Live l{static_cast<unsigned char*>(pool.malloc(bytes, stream)), bytes,
               static_cast<unsigned char>(tid * 16 + op % 16)};
        fill(l);
        live.push_back(l);
      } else if (kind < 9) {
        const size_t i = std::uniform_int_distribution<size_t>(0, live.size() - 1)(rng);
        if (!intact(live[i])) corrupted.fetch_add(1);
        pool.free(live[i].ptr);
        live[i] = live.back();
        live.pop_back();
      } else {
        const size_t i = std::uniform_int_distribution<size_t>(0, live.size() - 1)(rng);
        pool.record_stream(live[i].ptr, std::uniform_int_distribution<int>(0, 2)(rng));
      }
    }
    for (const Live& l : live) {
      if (!intact(l)) corrupted.fetch_add(1);
      pool.free(l.ptr);
    }
  };
  // A ninth thread checks invariants and empties the cache while the others run.
  std::thread checker([&] {
    while (!stop.load()) {
      pool.check_invariants();
      pool.empty_cache();
      std::this_thread::sleep_for(std::chrono::milliseconds(2));
    }
  });
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) threads.emplace_back(worker, t);
  for (auto& t : threads) t.join();
  stop.store(true);
  checker.join();
  EXPECT_EQ(corrupted.load(), 0);
  pool.process_events();
  pool.check_invariants();
  const AllocatorStats s = pool.stats();
  EXPECT_EQ(s.allocation[kAggregatePool].current, 0);
  EXPECT_EQ(s.allocation[kAggregatePool].allocated, s.allocation[kAggregatePool].freed);
  EXPECT_GE(s.allocation[kAggregatePool].allocated, kThreads * kOpsPerThread / 3);
  pool.empty_cache();
  EXPECT_EQ(raw->outstanding_bytes(), 0u);
}

}  // namespace
}  // namespace memsched
