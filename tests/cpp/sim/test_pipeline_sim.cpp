// test_pipeline_sim.cpp -- the pipeline schedule simulator against the closed
// forms of uniform pipelines (worked out in the comments), its orderings, and
// its refusals.
#include <gtest/gtest.h>

#include <string>

#include "core/check.h"
#include "core/pipeline_sim.h"

namespace memsched {
namespace {

std::vector<PipelineStageCost> uniform(int k, double f, double bi, double bw, double u = 0.0) {
  PipelineStageCost c;
  c.forward_us = f;
  c.backward_input_us = bi;
  c.backward_weight_us = bw;
  c.update_us = u;
  return std::vector<PipelineStageCost>(k, c);
}

PipelineLink free_link() {
  PipelineLink l;
  l.bandwidth_gbps = 1e9;
  l.latency_us = 0.0;
  return l;
}

PipelineSimResult run(const std::vector<PipelineStageCost>& s, PipelineSchedule sched, int m,
                      PipelineLink link = free_link()) {
  PipelineSimOptions o;
  o.schedule = sched;
  o.microbatches = m;
  return simulate_pipeline(s, link, o);
}

// GPipe and 1F1B on K equal stages, M micro-batches, free links: one step takes
// (M + K - 1) * (f + b) -- the classic bubble of (K - 1) / (M + K - 1).
TEST(PipelineSim, GPipeAnd1F1BMatchTheClosedForm) {
  for (int K : {2, 4, 8}) {
    for (int M : {1, 4, 8, 16}) {
      const auto s = uniform(K, 1.0, 1.0, 1.0);
      const double step = (M + K - 1) * 3.0;
      for (auto sched : {PipelineSchedule::kGPipe, PipelineSchedule::kOneFOneB}) {
        const auto r = run(s, sched, M);
        EXPECT_NEAR(r.time_per_microbatch_us * M, step, 1e-9) << pipeline_schedule_name(sched) << " K=" << K
                                                              << " M=" << M;
        EXPECT_NEAR(r.bubble_fraction, (K - 1.0) / (M + K - 1.0), 1e-9);
      }
    }
  }
}

// Links cost latency + bytes / bandwidth per hop, each way: with 2 stages and M = 1
// the step is f + t + f + b + t + b.
TEST(PipelineSim, TransfersDelayTheDependentOp) {
  auto s = uniform(2, 2.0, 3.0, 0.0);
  s[0].send_bytes = 1000;
  PipelineLink l;
  l.bandwidth_gbps = 1.0;  // 1000 B/us
  l.latency_us = 4.0;      // t = 4 + 1 = 5 us
  EXPECT_NEAR(run(s, PipelineSchedule::kGPipe, 1, l).time_per_microbatch_us, 2 + 5 + 2 + 3 + 5 + 3, 1e-9);
}

// Zero bubble (W filling the stalls) is never slower than 1F1B and strictly faster
// once dW is a real share of the backward.
TEST(PipelineSim, ZeroBubbleFillsStallsWithWeightGradients) {
  for (int K : {2, 4, 8}) {
    for (int M : {K, 2 * K}) {
      const auto s = uniform(K, 1.0, 1.0, 1.0);
      const double zb = run(s, PipelineSchedule::kZeroBubble, M).time_per_microbatch_us;
      const double ofob = run(s, PipelineSchedule::kOneFOneB, M).time_per_microbatch_us;
      EXPECT_LT(zb, ofob - 1e-9) << "K=" << K << " M=" << M;
      EXPECT_GE(zb, 3.0 - 1e-9);  // never below the work of one micro-batch per stage
    }
  }
}

// Asynchronous 1F1B in the steady state: one micro-batch per f + b + u (+ policy) on the
// slowest stage; no bubble on balanced stages.
TEST(PipelineSim, AsyncSteadyStateIsTheSlowestStage) {
  auto s = uniform(4, 1.0, 1.0, 1.0, 0.5);
  auto r = run(s, PipelineSchedule::kAsyncOneFOneB, 1);
  EXPECT_NEAR(r.time_per_microbatch_us, 3.5, 1e-9);
  EXPECT_NEAR(r.bubble_fraction, 0.0, 1e-9);
  s[2].forward_us = 3.0;
  s[1].policy_us = 0.25;
  r = run(s, PipelineSchedule::kAsyncOneFOneB, 1);
  EXPECT_NEAR(r.time_per_microbatch_us, 5.5, 1e-9);
}

// With a slow link the input gradient leaving before dW (split_backward) shortens the step.
TEST(PipelineSim, AsyncDxFirstHidesTheLink) {
  auto s = uniform(4, 1.0, 1.0, 1.0);
  for (auto& c : s) c.send_bytes = 2000;
  PipelineLink l;
  l.bandwidth_gbps = 1.0;  // 2 us per transfer
  l.latency_us = 0.0;
  PipelineSimOptions o;
  o.schedule = PipelineSchedule::kAsyncOneFOneB;
  o.split_backward = true;
  const double first = simulate_pipeline(s, l, o).time_per_microbatch_us;
  o.split_backward = false;
  const double last = simulate_pipeline(s, l, o).time_per_microbatch_us;
  EXPECT_LT(first, last - 1e-9);  // 5.4 us against 6.2 us here
  EXPECT_GE(first, 3.0 - 1e-9);
}

// Ring all-reduce: 2 (D-1)/D * bytes / bw + 2 (D-1) * latency, minus the overlap.
TEST(PipelineSim, DataParallelRingAllReduce) {
  DataParallelCost c;
  c.compute_us_per_microbatch = 10.0;
  c.update_us = 2.0;
  c.grad_bytes = 4000;
  c.devices = 4;
  c.microbatches = 8;
  c.link.bandwidth_gbps = 1.0;  // 1000 B/us
  c.link.latency_us = 1.0;
  c.overlap_us = 3.0;
  const auto r = simulate_data_parallel(c);
  EXPECT_NEAR(r.allreduce_us, 2.0 * 3 / 4 * 4.0 + 6.0, 1e-9);  // 12 us
  EXPECT_NEAR(r.step_us, 2 * 10.0 + (12.0 - 3.0) + 2.0, 1e-9);
  EXPECT_NEAR(r.time_per_microbatch_us, r.step_us / 8, 1e-9);
}

TEST(PipelineSim, RefusesBadInputNamingTheField) {
  auto s = uniform(2, 1.0, 1.0, 1.0);
  s[1].forward_us = -1.0;
  try {
    run(s, PipelineSchedule::kOneFOneB, 4);
    FAIL() << "negative forward_us accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("stages[1].forward_us"), std::string::npos) << e.what();
  }
  PipelineLink bad;
  bad.bandwidth_gbps = 0.0;
  EXPECT_THROW(run(uniform(2, 1, 1, 1), PipelineSchedule::kOneFOneB, 4, bad), Error);
  EXPECT_THROW(run({}, PipelineSchedule::kOneFOneB, 4), Error);
  EXPECT_THROW(run(uniform(2, 1, 1, 1), PipelineSchedule::kOneFOneB, 0), Error);
  EXPECT_THROW(pipeline_schedule_from_name("pipedream"), Error);
  EXPECT_EQ(pipeline_schedule_from_name("zero_bubble"), PipelineSchedule::kZeroBubble);
}

}  // namespace
}  // namespace memsched
