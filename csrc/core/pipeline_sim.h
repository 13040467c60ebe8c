// pipeline_sim.h -- discrete-event model of pipelined model parallelism: K
// devices, one stage each, joined by point-to-point links, running a
// pipeline schedule; and the data-parallel step it is compared with.
//
// Entry points: simulate_pipeline(stages, link, options) -> PipelineSimResult;
// simulate_data_parallel(cost) -> DataParallelResult.
//
// Note [Pipeline schedule model]
//   - Each stage runs one op at a time, in a fixed per-stage order given by
//     the schedule. Op kinds: F (forward of a micro-batch), B (whole
//     backward), I (input gradient dX only), W (weight gradient dW only), U
//     (optimizer update of the stage's parameters).
//   - F of micro-batch m on stage k starts after F(m) on stage k-1 ended plus
//     the transfer time of its activation; B or I of m on stage k after B or
//     I(m) on stage k+1 plus the transfer of the gradient. A transfer takes
//     latency_us + send_bytes / bandwidth; every neighbouring pair has its
//     own full-duplex link and transfers do not contend (an assumption).
//     Computation and communication overlap.
//   - gpipe: per step, F of every micro-batch, then B of every micro-batch,
//     then U. one_f_one_b: warm-up of min(K-1-k, M) forwards, then F/B
//     alternating, cool-down Bs, then U (torch's Schedule1F1B). zero_bubble:
//     one_f_one_b with B split into I and W; a stage with W pending runs one
//     whenever its next F/I is not ready yet, the rest before U (the greedy
//     reading of ZB-H1; no memory limit on pending W).
//   - async_1f1b (no flush; See Note [Asynchronous 1F1B schedule] in
//     python/memsched/pipeline/async_stage.py): step t runs F(t) with the
//     policy's per-forward cost added (predict: computing W_hat; stash: copying
//     the weights), then, once t >= s = K-1-k, I(t-s), W(t-s) and U -- an
//     update per micro-batch. With split_backward = false it runs B instead
//     of I and W (dX leaves only after dW: no out-of-order backward).
//   - Throughput is taken in the steady state: synchronous schedules over the
//     last simulated step (all steps are alike after the first), async over
//     the updates of stage 0 in the second half of the simulated steps.
//   Limitations: no memory model (a schedule that would not fit is not
//   refused here), no contention on links, one stage per device.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace memsched {

struct PipelineStageCost {
  double forward_us = 0.0;          // forward of one micro-batch on this stage
  double backward_input_us = 0.0;   // its input gradient dX
  double backward_weight_us = 0.0;  // its weight gradients dW
  double update_us = 0.0;           // one optimizer update of the stage's parameters
  double policy_us = 0.0;           // async only: weight-policy work per forward (predict / stash)
  int64_t send_bytes = 0;           // activation sent downstream per micro-batch (and its gradient back)
};

struct PipelineLink {
  double bandwidth_gbps = 50.0;  // per direction, GB/s (1e9 B/s) (> 0)
  double latency_us = 10.0;      // per transfer (>= 0)
};

enum class PipelineSchedule { kGPipe, kOneFOneB, kZeroBubble, kAsyncOneFOneB };

// "gpipe", "1f1b", "zero_bubble", "async_1f1b"; throws naming the field otherwise.
PipelineSchedule pipeline_schedule_from_name(const std::string& name);
std::string pipeline_schedule_name(PipelineSchedule schedule);

struct PipelineSimOptions {
  PipelineSchedule schedule = PipelineSchedule::kOneFOneB;
  int32_t microbatches = 8;     // per step (synchronous schedules); async: one per step
  int32_t steps = 0;            // simulated steps; 0 = 3 (sync) or 4K + 8 (async)
  bool split_backward = true;   // async only: dX before dW (out-of-order backward in each stage)
};

struct PipelineEvent {
  int32_t stage = 0;
  int32_t microbatch = 0;  // -1 for U
  char kind = 'F';         // F, B, I, W, U
  double start_us = 0.0;
  double end_us = 0.0;
};

struct PipelineSimResult {
  double time_per_microbatch_us = 0.0;  // steady state
  double microbatches_per_s = 0.0;
  double bubble_fraction = 0.0;         // 1 - busy / (K * window) over the measured window
  std::vector<double> busy_us;          // per stage, in the measured window
  std::vector<PipelineEvent> timeline;  // every op simulated, in the order it was scheduled
};

PipelineSimResult simulate_pipeline(const std::vector<PipelineStageCost>& stages, const PipelineLink& link,
                                    const PipelineSimOptions& options);

// Data parallelism over `devices` replicas of the whole model, on the same
// global batch of `microbatches` micro-batches: each replica runs
// ceil(M / D) forward+backward passes, then a ring all-reduce of the
// gradients (2 (D-1)/D * grad_bytes / bandwidth + 2 (D-1) * latency), of
// which up to `overlap_us` (the backward of the last micro-batch, DDP's
// bucketed overlap) is hidden, then one update.
struct DataParallelCost {
  double compute_us_per_microbatch = 0.0;  // forward + backward of the whole model, one micro-batch
  double overlap_us = 0.0;                 // all-reduce time hidden behind backward
  double update_us = 0.0;                  // optimizer update of the whole model
  int64_t grad_bytes = 0;                  // gradient bytes all-reduced per step
  int32_t devices = 1;
  int32_t microbatches = 1;                // global batch, in micro-batches
  PipelineLink link;
};

struct DataParallelResult {
  double step_us = 0.0;
  double allreduce_us = 0.0;  // whole ring all-reduce, before overlap
  double time_per_microbatch_us = 0.0;
  double microbatches_per_s = 0.0;
};

DataParallelResult simulate_data_parallel(const DataParallelCost& cost);

}  // namespace memsched
