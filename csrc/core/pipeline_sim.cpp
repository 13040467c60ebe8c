// pipeline_sim.cpp -- See Note [Pipeline schedule model] in pipeline_sim.h.
#include "core/pipeline_sim.h"

#include <algorithm>
#include <cmath>
#include <deque>
#include <limits>

#include "core/check.h"

namespace memsched {
namespace {

struct SimOp {
  char kind;       // F, B, I, W, U
  int32_t mb;      // global micro-batch id; -1 for U
};

bool finite_nonneg(double v) { return std::isfinite(v) && v >= 0.0; }

void check_link(const PipelineLink& link, const char* where) {
  MEMSCHED_CHECK(std::isfinite(link.bandwidth_gbps) && link.bandwidth_gbps > 0.0, where,
                 ".bandwidth_gbps must be a finite number > 0 (GB/s per direction), got ", link.bandwidth_gbps);
  MEMSCHED_CHECK(finite_nonneg(link.latency_us), where, ".latency_us must be a finite number >= 0, got ",
                 link.latency_us);
}

double transfer_us(const PipelineLink& link, int64_t bytes) {
  return link.latency_us + static_cast<double>(bytes) / (link.bandwidth_gbps * 1e3);  // GB/s = 1e3 B/us
}

// Per-stage op order of one schedule (W of zero_bubble is not listed: it is queued when I runs).
std::vector<std::vector<SimOp>> build_orders(int32_t K, const PipelineSimOptions& o, int32_t steps) {
  std::vector<std::vector<SimOp>> orders(K);
  const int32_t M = o.microbatches;
  for (int32_t k = 0; k < K; ++k) {
    auto& ops = orders[k];
    if (o.schedule == PipelineSchedule::kAsyncOneFOneB) {
      const int32_t s = K - 1 - k;
      for (int32_t t = 0; t < steps; ++t) {
        ops.push_back({'F', t});
        if (t >= s) {
          if (o.split_backward) {
            ops.push_back({'I', t - s});
            ops.push_back({'W', t - s});
          } else {
            ops.push_back({'B', t - s});
          }
          ops.push_back({'U', -1});
        }
      }
      continue;
    }
    const char back = o.schedule == PipelineSchedule::kZeroBubble ? 'I' : 'B';
    for (int32_t step = 0; step < steps; ++step) {
      const int32_t base = step * M;
      if (o.schedule == PipelineSchedule::kGPipe) {
        for (int32_t m = 0; m < M; ++m) ops.push_back({'F', base + m});
        for (int32_t m = 0; m < M; ++m) ops.push_back({'B', base + m});
      } else {
        const int32_t w = std::min(K - 1 - k, M);
        for (int32_t m = 0; m < w; ++m) ops.push_back({'F', base + m});
        for (int32_t i = 0; i < M - w; ++i) {
          ops.push_back({'F', base + w + i});
          ops.push_back({back, base + i});
        }
        for (int32_t i = M - w; i < M; ++i) ops.push_back({back, base + i});
      }
      ops.push_back({'U', -1});
    }
  }
  return orders;
}

}  // namespace

PipelineSchedule pipeline_schedule_from_name(const std::string& name) {
  if (name == "gpipe") return PipelineSchedule::kGPipe;
  if (name == "1f1b") return PipelineSchedule::kOneFOneB;
  if (name == "zero_bubble") return PipelineSchedule::kZeroBubble;
  if (name == "async_1f1b") return PipelineSchedule::kAsyncOneFOneB;
  MEMSCHED_CHECK(false, "schedule: expected 'gpipe', '1f1b', 'zero_bubble' or 'async_1f1b', got '", name, "'");
  return PipelineSchedule::kOneFOneB;
}

std::string pipeline_schedule_name(PipelineSchedule schedule) {
  switch (schedule) {
    case PipelineSchedule::kGPipe: return "gpipe";
    case PipelineSchedule::kOneFOneB: return "1f1b";
    case PipelineSchedule::kZeroBubble: return "zero_bubble";
    case PipelineSchedule::kAsyncOneFOneB: return "async_1f1b";
  }
  return "?";
}

PipelineSimResult simulate_pipeline(const std::vector<PipelineStageCost>& stages, const PipelineLink& link,
                                    const PipelineSimOptions& options) {
  const int32_t K = static_cast<int32_t>(stages.size());
  MEMSCHED_CHECK(K >= 1, "stages: need at least one stage cost");
  for (int32_t k = 0; k < K; ++k) {
    const auto& c = stages[k];
    for (auto [v, name] : {std::pair{c.forward_us, "forward_us"}, {c.backward_input_us, "backward_input_us"},
                           {c.backward_weight_us, "backward_weight_us"}, {c.update_us, "update_us"},
                           {c.policy_us, "policy_us"}}) {
      MEMSCHED_CHECK(finite_nonneg(v), "stages[", k, "].", name, " must be a finite number >= 0 (microseconds), got ",
                     v);
    }
    MEMSCHED_CHECK(c.send_bytes >= 0, "stages[", k, "].send_bytes must be >= 0, got ", c.send_bytes);
  }
  check_link(link, "link");
  const bool async = options.schedule == PipelineSchedule::kAsyncOneFOneB;
  MEMSCHED_CHECK(options.microbatches >= 1, "microbatches must be >= 1, got ", options.microbatches);
  MEMSCHED_CHECK(options.steps >= 0, "steps must be >= 0 (0: the default), got ", options.steps);
  const int32_t steps = options.steps > 0 ? options.steps : (async ? 4 * K + 8 : 3);
  MEMSCHED_CHECK(async ? steps >= 2 * K + 2 : steps >= 2, "steps: ", steps,
                 " is too few to reach the steady state; use at least ", async ? 2 * K + 2 : 2, " or 0");
  const int32_t M = async ? 1 : options.microbatches;
  const int32_t total_mb = steps * M;

  const auto orders = build_orders(K, options, steps);
  const bool zb = options.schedule == PipelineSchedule::kZeroBubble;
  const double unknown = -1.0;
  std::vector<std::vector<double>> f_end(K, std::vector<double>(total_mb, unknown));
  std::vector<std::vector<double>> g_end(K, std::vector<double>(total_mb, unknown));
  std::vector<size_t> next(K, 0);
  std::vector<double> free_at(K, 0.0);
  std::vector<std::deque<int32_t>> pending_w(K);
  std::vector<std::vector<double>> update_end(K);
  PipelineSimResult result;

  auto duration = [&](int32_t k, char kind) {
    const auto& c = stages[k];
    switch (kind) {
      case 'F': return c.forward_us + (async ? c.policy_us : 0.0);
      case 'B': return c.backward_input_us + c.backward_weight_us;
      case 'I': return c.backward_input_us;
      case 'W': return c.backward_weight_us;
      default: return c.update_us;
    }
  };
  // When op's inputs from a neighbour are ready; `unknown` while the neighbour has not run it.
  auto ready_at = [&](int32_t k, const SimOp& op) {
    if (op.kind == 'F' && k > 0) {
      const double e = f_end[k - 1][op.mb];
      return e < 0 ? unknown : e + transfer_us(link, stages[k - 1].send_bytes);
    }
    if ((op.kind == 'B' || op.kind == 'I') && k < K - 1) {
      const double e = g_end[k + 1][op.mb];
      return e < 0 ? unknown : e + transfer_us(link, stages[k].send_bytes);
    }
    return 0.0;
  };

  while (true) {
    int32_t best = -1;
    double best_start = std::numeric_limits<double>::infinity();
    SimOp best_op{'F', 0};
    bool any_left = false;
    for (int32_t k = 0; k < K; ++k) {
      const bool has_main = next[k] < orders[k].size();
      if (!has_main && pending_w[k].empty()) continue;
      any_left = true;
      SimOp op{'W', pending_w[k].empty() ? -1 : pending_w[k].front()};
      double start = free_at[k];
      if (has_main) {
        const SimOp& main = orders[k][next[k]];
        const double r = ready_at(k, main);
        const bool fill = zb && !pending_w[k].empty() && (main.kind == 'U' || r < 0 || r > free_at[k]);
        if (!fill) {
          if (r < 0) continue;  // waits for a neighbour not simulated that far yet
          op = main;
          start = std::max(free_at[k], r);
        }
      }
      if (start < best_start) {
        best = k;
        best_start = start;
        best_op = op;
      }
    }
    if (!any_left) break;
    MEMSCHED_CHECK(best >= 0, "internal: pipeline schedule ", pipeline_schedule_name(options.schedule),
                   " deadlocked (a stage waits for an op no stage will run)");
    const int32_t k = best;
    if (best_op.kind == 'W' && zb) {
      pending_w[k].pop_front();
    } else {
      ++next[k];
    }
    const double end = best_start + duration(k, best_op.kind);
    free_at[k] = end;
    if (best_op.kind == 'F') f_end[k][best_op.mb] = end;
    if (best_op.kind == 'B' || best_op.kind == 'I') g_end[k][best_op.mb] = end;
    if (best_op.kind == 'I' && zb) pending_w[k].push_back(best_op.mb);
    if (best_op.kind == 'U') update_end[k].push_back(end);
    result.timeline.push_back({k, best_op.mb, best_op.kind, best_start, end});
  }

  double w0 = 0.0, w1 = 0.0;
  int64_t mbs = 0;
  if (async) {
    const auto& u = update_end[0];  // stage 0 updates once per step after its warm-up
    MEMSCHED_DEBUG_ASSERT(u.size() >= 2);
    const size_t a = u.size() / 2, b = u.size() - 1;
    w0 = u[a];
    w1 = u[b];
    mbs = static_cast<int64_t>(b - a);
  } else {
    for (int32_t k = 0; k < K; ++k) {
      w0 = std::max(w0, update_end[k][steps - 2]);
      w1 = std::max(w1, update_end[k][steps - 1]);
    }
    mbs = M;
  }
  const double window = w1 - w0;
  result.time_per_microbatch_us = window / static_cast<double>(mbs);
  result.microbatches_per_s = window > 0 ? 1e6 * static_cast<double>(mbs) / window : 0.0;
  result.busy_us.assign(K, 0.0);
  for (const auto& e : result.timeline) {
    result.busy_us[e.stage] += std::max(0.0, std::min(e.end_us, w1) - std::max(e.start_us, w0));
  }
  double busy = 0.0;
  for (double b : result.busy_us) busy += b;
  result.bubble_fraction = window > 0 ? 1.0 - busy / (K * window) : 0.0;
  return result;
}

DataParallelResult simulate_data_parallel(const DataParallelCost& c) {
  MEMSCHED_CHECK(c.devices >= 1, "devices must be >= 1, got ", c.devices);
  MEMSCHED_CHECK(c.microbatches >= 1, "microbatches must be >= 1, got ", c.microbatches);
  MEMSCHED_CHECK(finite_nonneg(c.compute_us_per_microbatch), "compute_us_per_microbatch must be a finite number >= 0, got ",
                 c.compute_us_per_microbatch);
  MEMSCHED_CHECK(finite_nonneg(c.overlap_us), "overlap_us must be a finite number >= 0, got ", c.overlap_us);
  MEMSCHED_CHECK(finite_nonneg(c.update_us), "update_us must be a finite number >= 0, got ", c.update_us);
  MEMSCHED_CHECK(c.grad_bytes >= 0, "grad_bytes must be >= 0, got ", c.grad_bytes);
  check_link(c.link, "link");
  DataParallelResult r;
  const int32_t D = c.devices;
  const int32_t per_device = (c.microbatches + D - 1) / D;
  if (D > 1) {
    r.allreduce_us = 2.0 * (D - 1) / D * static_cast<double>(c.grad_bytes) / (c.link.bandwidth_gbps * 1e3) +
                     2.0 * (D - 1) * c.link.latency_us;
  }
  r.step_us = per_device * c.compute_us_per_microbatch + std::max(0.0, r.allreduce_us - c.overlap_us) + c.update_us;
  r.time_per_microbatch_us = r.step_us / c.microbatches;
  r.microbatches_per_s = r.step_us > 0 ? 1e6 * c.microbatches / r.step_us : 0.0;
  return r;
}

}  // namespace memsched
