// bench_planner.cpp -- planner and simulator time on synthetic traces of about
// 1k, 10k and 100k tensors (goal: dp and hybrid on 10k tensors under 1 s on
// the 2-core dev machine). Budget: halfway between the least reachable budget
// and the keep_all peak. Counters: tensors, offloadable tensors, DP granularity.
#include <benchmark/benchmark.h>

#include <map>

#include "core/dp_planner.h"
#include "core/planner.h"
#include "core/simulator.h"
#include "core/synthetic_trace.h"

namespace memsched {
namespace {

DeviceModel bench_device() {
  DeviceModel d;
  d.name = "bench";
  d.d2h_bw_gbps = 53.6;
  d.h2d_bw_gbps = 53.6;
  d.d2h_latency_us = 10;
  d.h2d_latency_us = 10;
  return d;
}

// ~2 tensors per forward op (activation + gradient) + one parameter per layer:
// tensors ~= layers * (2 * ops_per_layer + 1) with ops_per_layer = 2 -> 5 per layer.
const Trace& trace_with_tensors(int64_t tensors) {
  static std::map<int64_t, Trace> cache;
  auto it = cache.find(tensors);
  if (it != cache.end()) return it->second;
  SyntheticTraceOptions o;
  o.num_layers = tensors / 5;
  o.ops_per_layer = 2;
  o.seed = 7;
  return cache.emplace(tensors, make_synthetic_trace(o)).first->second;
}

int64_t mid_budget(const Trace& t) {
  const OffloadAnalysis a = analyze_offload(t);
  const int64_t least = least_budget_bytes(a);
  return least + (t.peak_bytes() - least) / 2;
}

void run_planner(benchmark::State& state, const std::string& planner) {
  const Trace& t = trace_with_tensors(state.range(0));
  const int64_t budget = mid_budget(t);
  for (auto _ : state) {
    Plan p = make_plan(t, bench_device(), budget, planner);
    benchmark::DoNotOptimize(p);
  }
  state.counters["tensors"] = static_cast<double>(t.tensors.size());
  state.counters["offloadable"] = static_cast<double>(analyze_offload(t).candidates.size());
}

void BM_DpPlanner(benchmark::State& state) { run_planner(state, "dp"); }
void BM_GreedyPlanner(benchmark::State& state) { run_planner(state, "greedy"); }
void BM_HybridPlanner(benchmark::State& state) { run_planner(state, "hybrid"); }

// The DP alone (one cost), without prefetch placement and candidate simulation.
void BM_DpSolveOnly(benchmark::State& state) {
  const Trace& t = trace_with_tensors(state.range(0));
  const OffloadAnalysis a = analyze_offload(t);
  const DpModel m = build_dp_model(a, mid_budget(t));
  for (auto _ : state) {
    DpSolution s = solve_dp(m, a.candidates.size());
    benchmark::DoNotOptimize(s);
  }
  state.counters["states"] = static_cast<double>(m.capacity_units + 1);
  state.counters["granularity_bytes"] = static_cast<double>(m.granularity_bytes);
}

void BM_Simulate(benchmark::State& state) {
  const Trace& t = trace_with_tensors(state.range(0));
  const Plan p = make_plan(t, bench_device(), mid_budget(t), "greedy");
  for (auto _ : state) {
    SimResult r = simulate(t, p, bench_device());
    benchmark::DoNotOptimize(r);
  }
}

BENCHMARK(BM_DpPlanner)->Arg(1000)->Arg(10000)->Arg(100000)->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK(BM_DpSolveOnly)->Arg(1000)->Arg(10000)->Arg(100000)->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK(BM_GreedyPlanner)->Arg(1000)->Arg(10000)->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK(BM_HybridPlanner)->Arg(1000)->Arg(10000)->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK(BM_Simulate)->Arg(1000)->Arg(10000)->Arg(100000)->Unit(benchmark::kMillisecond)->UseRealTime();

}  // namespace
}  // namespace memsched

BENCHMARK_MAIN();
