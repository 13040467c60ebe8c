// bench_alloc.cpp -- the block pool's latency on the host backend:
//   BM_AllocFreePair/<bytes>   malloc + free of a size whose block is cached
//                              (goal: median under 100 ns per pair)
//   BM_GlibcMallocFree/<bytes> the same pair with glibc malloc, for scale
//   BM_RandomCachedMix         64 live blocks, random free/malloc of cached sizes
//   BM_TraceReplayMix          a transformer-like training step replayed on a
//                              warm pool (every malloc and free of the step)
// Run: build-*/benchmarks/cpp/bench_alloc --benchmark_repetitions=10
//      --benchmark_report_aggregates_only=true
#include <benchmark/benchmark.h>

#include <cstdlib>
#include <memory>
#include <random>
#include <vector>

#include "backend/host_memory.h"
#include "core/alloc/block_pool.h"
#include "core/alloc/virtual_memory.h"
#include "core/trace.h"
#include "core/trace_json.h"

namespace memsched {
namespace {

std::unique_ptr<BlockPool> host_pool() {
  return std::make_unique<BlockPool>(std::make_shared<HostRawMemory>(),
                                     std::make_shared<ManualStreamEvents>(/*immediate=*/true));
}

void BM_AllocFreePair(benchmark::State& state) {
  auto pool = host_pool();
  const size_t bytes = static_cast<size_t>(state.range(0));
  pool->free(pool->malloc(bytes));  // warm: the block is now cached
  for (auto _ : state) {
    void* p = pool->malloc(bytes);
    benchmark::DoNotOptimize(p);
    pool->free(p);
  }
  state.SetItemsProcessed(state.iterations());
}
BENCHMARK(BM_AllocFreePair)->Arg(512)->Arg(4096)->Arg(65536)->Arg(1 << 20)->Arg(4 << 20)->Arg(32 << 20);

void BM_GlibcMallocFree(benchmark::State& state) {
  const size_t bytes = static_cast<size_t>(state.range(0));
  for (auto _ : state) {
    void* p = std::malloc(bytes);
    benchmark::DoNotOptimize(p);
    std::free(p);
  }
  state.SetItemsProcessed(state.iterations());
}
BENCHMARK(BM_GlibcMallocFree)->Arg(512)->Arg(65536)->Arg(4 << 20);

void BM_RandomCachedMix(benchmark::State& state) {
  auto pool = host_pool();
  std::mt19937 rng(1);
  const size_t sizes[] = {512, 2048, 8192, 65536, 300000, 2 << 20, 6 << 20};
  std::vector<void*> live;
  for (int i = 0; i < 64; ++i) live.push_back(pool->malloc(sizes[i % 7]));
  std::vector<std::pair<size_t, size_t>> script(4096);  // (slot, size index)
  for (auto& s : script) s = {rng() % 64, rng() % 7};
  size_t k = 0;
  for (auto _ : state) {
    const auto [slot, size] = script[k++ % script.size()];
    pool->free(live[slot]);
    live[slot] = pool->malloc(sizes[size]);
  }
  state.SetItemsProcessed(state.iterations());
  for (void* p : live) pool->free(p);
}
BENCHMARK(BM_RandomCachedMix);

// A transformer-like step (as in tests/cpp/alloc/test_placement_planner.cpp),
// scaled down so its real host memory stays small.
Trace synthetic_step(int layers, int64_t hidden_bytes) {
  const int per_layer = 4;
  const int n_ops = 2 * layers * per_layer + 1;
  Trace t;
  for (int i = 0; i < n_ops; ++i) {
    Op op;
    op.id = i;
    op.phase = i < n_ops / 2 ? Phase::kForward : Phase::kBackward;
    t.ops.push_back(op);
  }
  auto add = [&](int64_t bytes, int64_t producer, int64_t freed) {
    TensorRecord r;
    r.id = static_cast<int64_t>(t.tensors.size());
    r.bytes = bytes;
    r.producer_op = producer;
    r.freed_after_op = freed;
    if (freed != kAfterStep) r.uses = {freed};
    t.tensors.push_back(r);
  };
  for (int l = 0; l < layers; ++l) add(12 * hidden_bytes / 8, kBeforeStep, kAfterStep);
  for (int l = 0; l < layers; ++l) {
    for (int k = 0; k < per_layer; ++k) {
      const int64_t fwd = l * per_layer + k;
      const int64_t bwd = n_ops - 2 - fwd;
      const int64_t bytes = (k == 2 ? 4 : 1) * hidden_bytes + 4096 * k + 300 * l;
      add(bytes, fwd, bwd);
      add(bytes / 2 + 1000, fwd, fwd);
      add(bytes, bwd, bwd);
      add(2048 + 64 * k, fwd, fwd);  // small temporaries (norm statistics, masks)
    }
    add(12 * hidden_bytes / 8, n_ops - 2 - l * per_layer, kAfterStep);
  }
  return t;
}

// MEMSCHED_BENCH_TRACE=path.json replays a saved Trace (e.g. a profiled model:
// memsched.profile(...).to_json(path)) instead of the synthetic step.
Trace bench_trace() {
  if (const char* path = std::getenv("MEMSCHED_BENCH_TRACE")) return load_trace(path);
  return synthetic_step(12, 256 << 10);
}

void BM_TraceReplayMix(benchmark::State& state) {
  const Trace trace = bench_trace();
  // The step's malloc/free sequence (See Note [Replaying a step]), precomputed
  // so that only the pool is timed: +id+1 = malloc tensor id, -(id+1) = free it.
  std::vector<int64_t> script;
  const auto n_ops = static_cast<int64_t>(trace.ops.size());
  for (int64_t op = 0; op < n_ops; ++op) {
    for (const TensorRecord& t : trace.tensors) {
      if (t.producer_op != kBeforeStep && t.producer_op == op) script.push_back(t.id + 1);
    }
    for (const TensorRecord& t : trace.tensors) {
      if (t.producer_op != kBeforeStep && t.freed_after_op == op) script.push_back(-(t.id + 1));
    }
  }
  for (const TensorRecord& t : trace.tensors) {
    if (t.producer_op != kBeforeStep && t.freed_after_op == kAfterStep) script.push_back(-(t.id + 1));
  }
  auto pool = host_pool();
  std::vector<void*> ptr(trace.tensors.size(), nullptr);
  for (const TensorRecord& t : trace.tensors) {
    if (t.producer_op == kBeforeStep) ptr[t.id] = pool->malloc(static_cast<size_t>(t.bytes));
  }
  auto run_step = [&] {
    for (int64_t e : script) {
      if (e > 0) ptr[e - 1] = pool->malloc(static_cast<size_t>(trace.tensors[e - 1].bytes));
      else pool->free(ptr[-e - 1]);
    }
  };
  run_step();  // warm the cache
  for (auto _ : state) run_step();
  state.SetItemsProcessed(state.iterations() * static_cast<int64_t>(script.size()));
  state.counters["ops_per_step"] = static_cast<double>(script.size());
  state.counters["reserved_MiB"] = pool->stats().reserved_bytes[kAggregatePool].current / 1048576.0;
}
BENCHMARK(BM_TraceReplayMix);

}  // namespace
}  // namespace memsched

BENCHMARK_MAIN();
