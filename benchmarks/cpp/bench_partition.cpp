// bench_partition.cpp -- S3 (csrc/core/partition/s3_partitioner.h) on synthetic training steps of
// 10k and 100k ops, 4 devices of the h100-sxm figures, cap 40% of the single-device peak.
// Issue 15's target: 100k ops in under 60 s on a 2-core machine.
#include <benchmark/benchmark.h>

#include "core/partition/s3_partitioner.h"
#include "core/synthetic_trace.h"

namespace memsched {
namespace {

void BM_S3Synthetic(benchmark::State& state) {
  SyntheticTraceOptions o;
  o.num_layers = state.range(0) / 4;  // 2 forward ops per layer, mirrored in backward
  o.ops_per_layer = 2;
  o.seed = 7;
  const Trace trace = make_synthetic_trace(o);
  PartitionDevices devices;
  DeviceModel h100;
  h100.name = "h100-sxm";
  h100.peak_flops = 67e12;
  h100.hbm_bw_gbps = 3350;
  for (int d = 0; d < 4; ++d) devices.devices.push_back(h100);
  devices.caps_bytes.assign(4, static_cast<int64_t>(0.4 * static_cast<double>(trace.peak_bytes())));
  const PartitionProblem problem(trace, devices);
  S3Result r;
  for (auto _ : state) {
    r = partition_s3(problem);
    benchmark::DoNotOptimize(r.device_of_op.data());
  }
  state.counters["ops"] = static_cast<double>(problem.num_ops());
  state.counters["fits"] = r.fits ? 1 : 0;
  state.counters["makespan_ms"] = r.eval.makespan_us / 1e3;
  state.counters["seconds"] = r.seconds;
}
BENCHMARK(BM_S3Synthetic)->Arg(10000)->Arg(100000)->Unit(benchmark::kSecond)->Iterations(1);

}  // namespace
}  // namespace memsched

BENCHMARK_MAIN();
