// simulator.cpp -- discrete-event simulation of a Plan (See Note [Simulator semantics]).
#include "core/simulator.h"

#include <algorithm>
#include <deque>
#include <limits>

#include "core/check.h"
#include "core/recompute.h"

namespace memsched {

const char* to_string(Stream stream) {
  switch (stream) {
    case Stream::kCompute: return "compute";
    case Stream::kD2H: return "d2h";
    case Stream::kH2D: return "h2d";
  }
  return "?";
}

const char* to_string(EventKind kind) {
  switch (kind) {
    case EventKind::kOp: return "op";
    case EventKind::kD2H: return "d2h";
    case EventKind::kH2D: return "h2d";
    case EventKind::kRecompute: return "recompute";
  }
  return "?";
}

namespace {

// Per-op index lists of the offloaded tensors (indices into analysis.candidates).
struct OffloadSchedule {
  std::vector<std::vector<int64_t>> d2h_after;      // op -> tensors whose D2H is queued when it ends
  std::vector<std::vector<int64_t>> fwd_done_after; // op -> tensors whose last forward use it is
  std::vector<std::vector<int64_t>> prefetch_at;    // op -> tensors requested when it is reached
  std::vector<std::vector<int64_t>> needed_by;      // op -> tensors whose first backward use it is
  std::vector<std::vector<int64_t>> replay_before;  // op -> recomputed tensors replayed before it, ascending
};

class Simulation {
 public:
  Simulation(const Trace& trace, const Plan& plan, const DeviceModel& device)
      : trace_(trace), plan_(plan), device_(device), analysis_(analyze_offload(trace)) {
    device.validate();
    validate_plan(trace, analysis_, plan);
    n_ = static_cast<int64_t>(trace.ops.size());
    duration_us_.resize(n_);
    for (int64_t i = 0; i < n_; ++i) duration_us_[i] = op_time_us(device, trace.ops[i]);
    outputs_bytes_.assign(n_, 0);
    frees_bytes_.assign(n_, 0);
    for (const auto& t : trace.tensors) {
      if (t.producer_op == kBeforeStep) initial_bytes_ += t.bytes;
      else outputs_bytes_[t.producer_op] += t.bytes;
      if (t.freed_after_op != kAfterStep) frees_bytes_[t.freed_after_op] += t.bytes;
    }
    sched_.d2h_after.resize(n_);
    sched_.fwd_done_after.resize(n_);
    sched_.prefetch_at.resize(n_);
    sched_.needed_by.resize(n_);
    sched_.replay_before.resize(n_);
    state_.assign(analysis_.candidates.size(), TensorState{});
    replay_us_.assign(analysis_.candidates.size(), 0.0);
    replay_kept_bytes_.assign(analysis_.candidates.size(), 0);
    replay_transient_.assign(analysis_.candidates.size(), 0);
    replay_keeps_.assign(analysis_.candidates.size(), {});
    if (plan.num_recomputed() > 0) replay_keeps_ = recompute_schedule(trace, analysis_, plan.decisions).kept_alive;
    for (size_t k = 0; k < plan.decisions.size(); ++k) {
      const auto& d = plan.decisions[k];
      const auto& c = analysis_.candidates[k];
      const auto kk = static_cast<int64_t>(k);
      if (d.recompute) {  // released after its forward use (no copy to wait for), replayed before its use
        state_[k].copied = true;
        sched_.fwd_done_after[c.last_forward_use].push_back(kk);
        sched_.needed_by[c.first_backward_use].push_back(kk);
        if (d.recompute_ops.empty()) continue;  // recreated and kept by an earlier replay
        replay_us_[k] = recompute_time_us(trace, device, d.recompute_ops);
        replay_transient_[k] = recompute_transient_bytes(analysis_, c, d.recompute_ops);
        for (int64_t j : replay_keeps_[k]) replay_kept_bytes_[k] += bytes_of(j);
        sched_.replay_before[d.recompute_at_op].push_back(kk);
        continue;
      }
      if (!d.offload) continue;
      sched_.d2h_after[d.offload_after_op].push_back(kk);
      sched_.fwd_done_after[c.last_forward_use].push_back(kk);
      sched_.prefetch_at[d.prefetch_at_op].push_back(kk);
      sched_.needed_by[c.first_backward_use].push_back(kk);
    }
    for (auto& list : sched_.prefetch_at) {
      std::sort(list.begin(), list.end(), [&](int64_t x, int64_t y) {
        const auto bx = analysis_.candidates[x].first_backward_use, by = analysis_.candidates[y].first_backward_use;
        return bx != by ? bx < by : x < y;
      });
    }
    r_.budget_bytes = plan.budget_bytes;
    r_.stall_us_per_op.assign(n_, 0.0);
    r_.op_start_us.assign(n_, 0.0);
    r_.op_end_us.assign(n_, 0.0);
  }

  SimResult run() {
    change_memory(0.0, initial_bytes_, 0);
    if (plan_.copies_on_compute_stream) run_sync();
    else run_async();
    for (int64_t i = 0; i < n_; ++i) {
      r_.compute_us += duration_us_[i];
      r_.stall_us += r_.stall_us_per_op[i];
    }
    for (size_t k = 0; k < plan_.decisions.size(); ++k) r_.recompute_us += plan_.decisions[k].recompute ? replay_us_[k] : 0.0;
    r_.step_time_us = n_ > 0 ? r_.op_end_us[n_ - 1] : 0.0;
    return std::move(r_);
  }

 private:
  struct TensorState {
    bool queued = false;     // D2H copy queued or running
    bool copied = false;     // D2H copy finished
    bool fwd_done = false;   // last forward use finished
    bool released = false;   // device memory returned
    bool fetched = false;    // H2D copy (or replay) finished: the first backward use may run
  };

  int64_t bytes_of(int64_t k) const { return analysis_.candidates[k].bytes; }

  void change_memory(double now, int64_t delta, int64_t op) {
    mem_ += delta;
    MEMSCHED_CHECK(mem_ >= 0, "simulate: device memory went negative (", mem_, " bytes) at ", now,
                   " us; internal error");
    if (!r_.memory.empty() && r_.memory.back().time_us == now) r_.memory.back().bytes = mem_;
    else r_.memory.push_back({now, mem_});
    if (mem_ > r_.peak_bytes) {
      r_.peak_bytes = mem_;
      r_.peak_time_us = now;
      r_.peak_op = std::min<int64_t>(op, n_ - 1);
    }
    if (mem_ > plan_.budget_bytes) r_.over_budget = true;
  }

  // Offloaded tensor k: both conditions for releasing its device memory hold.
  void maybe_release(int64_t k, double now, int64_t op) {
    TensorState& s = state_[k];
    if (s.copied && s.fwd_done && !s.released) {
      s.released = true;
      change_memory(now, -bytes_of(k), op);
    }
  }

  void add_event(Stream stream, EventKind kind, int64_t id, double start, double end, int64_t bytes) {
    r_.events.push_back({stream, kind, id, start, end, bytes});
  }

  // --- copies on side streams ------------------------------------------------
  void run_async() {
    const double kInf = std::numeric_limits<double>::infinity();
    double now = 0.0, prev_end = 0.0;
    int64_t next_op = 0, running_op = -1, requested_upto = -1;
    double op_end = kInf, d2h_end = kInf, h2d_end = kInf;
    int64_t d2h_cur = -1, h2d_cur = -1;
    int64_t replay_cur = -1, replay_next = 0;  // replay running on the compute stream; next index in replay_before
    double replay_end = kInf, replayed_us = 0.0;  // replayed_us: replay time since the previous op ended
    std::deque<int64_t> d2h_queue, h2d_queue;
    int64_t freeable = 0;  // tensors queued for D2H and past their forward use: memory that will come back
    const int64_t budget = plan_.budget_bytes;

    while (true) {
      bool progressed = true;
      while (progressed) {
        progressed = false;
        const int64_t current_op = running_op >= 0 ? running_op : next_op;
        const bool compute_busy = running_op >= 0 || replay_cur >= 0;
        if (d2h_cur < 0 && !d2h_queue.empty()) {
          d2h_cur = d2h_queue.front();
          d2h_queue.pop_front();
          d2h_end = now + d2h_time_us(device_, bytes_of(d2h_cur));
          r_.bytes_to_host += bytes_of(d2h_cur);
          add_event(Stream::kD2H, EventKind::kD2H, analysis_.candidates[d2h_cur].tensor_id, now, d2h_end, bytes_of(d2h_cur));
          progressed = true;
        }
        if (!compute_busy && next_op < n_) {
          if (requested_upto < next_op) {
            requested_upto = next_op;
            replay_next = 0;
            for (int64_t k : sched_.prefetch_at[next_op]) h2d_queue.push_back(k);
            progressed = true;
          }
          const auto& replays = sched_.replay_before[next_op];
          if (replay_next < static_cast<int64_t>(replays.size())) {
            const int64_t k = replays[replay_next];
            const int64_t alloc = bytes_of(k) + replay_transient_[k];
            if (mem_ + alloc <= budget || freeable == 0) {
              ++replay_next;
              replay_cur = k;
              replay_end = now + replay_us_[k];
              change_memory(now, alloc, next_op);
              add_event(Stream::kCompute, EventKind::kRecompute, analysis_.candidates[k].tensor_id, now, replay_end,
                        alloc);
              progressed = true;
            }
          }
          bool inputs_ready = replay_next >= static_cast<int64_t>(replays.size()) && replay_cur < 0;
          for (int64_t k : sched_.needed_by[next_op]) inputs_ready = inputs_ready && state_[k].fetched;
          const int64_t out = outputs_bytes_[next_op];
          if (inputs_ready && (mem_ + out <= budget || freeable == 0)) {
            running_op = next_op++;
            r_.stall_us_per_op[running_op] = now - prev_end - replayed_us;
            replayed_us = 0.0;
            r_.op_start_us[running_op] = now;
            op_end = now + duration_us_[running_op];
            change_memory(now, out, running_op);
            add_event(Stream::kCompute, EventKind::kOp, running_op, now, op_end, out);
            progressed = true;
          }
        }
        if (h2d_cur < 0 && !h2d_queue.empty()) {
          const int64_t k = h2d_queue.front();
          // The copy back reads the host copy: it waits for the D2H copy (and the
          // release) of the same tensor. That always happens without compute progress.
          const bool out = state_[k].released;
          const bool fits = out && mem_ + bytes_of(k) <= budget;
          // Nothing running on compute and nothing queued to free: waiting would deadlock.
          const bool forced = out && !fits && running_op < 0 && replay_cur < 0 && freeable == 0;
          if (fits || forced) {
            h2d_queue.pop_front();
            h2d_cur = k;
            h2d_end = now + h2d_time_us(device_, bytes_of(k));
            r_.bytes_to_device += bytes_of(k);
            change_memory(now, bytes_of(k), current_op);
            add_event(Stream::kH2D, EventKind::kH2D, analysis_.candidates[k].tensor_id, now, h2d_end, bytes_of(k));
            progressed = true;
          }
        }
      }
      now = std::min({op_end, d2h_end, h2d_end, replay_end});
      if (now == kInf) {
        MEMSCHED_CHECK(next_op == n_, "simulate: deadlock before op ", next_op, "; internal error");
        break;
      }
      const int64_t current_op = running_op >= 0 ? running_op : next_op;
      if (d2h_end == now) {
        TensorState& s = state_[d2h_cur];
        s.copied = true;
        if (s.fwd_done) --freeable;
        maybe_release(d2h_cur, now, current_op);
        d2h_cur = -1;
        d2h_end = kInf;
      }
      if (h2d_end == now) {
        state_[h2d_cur].fetched = true;
        h2d_cur = -1;
        h2d_end = kInf;
      }
      if (replay_end == now) {
        state_[replay_cur].fetched = true;
        for (int64_t j : replay_keeps_[replay_cur]) state_[j].fetched = true;
        change_memory(now, -(replay_transient_[replay_cur] - replay_kept_bytes_[replay_cur]), current_op);
        replayed_us += replay_us_[replay_cur];
        replay_cur = -1;
        replay_end = kInf;
      }
      if (op_end == now) {
        const int64_t i = running_op;
        r_.op_end_us[i] = now;
        prev_end = now;
        running_op = -1;
        op_end = kInf;
        change_memory(now, -frees_bytes_[i], i);
        for (int64_t k : sched_.fwd_done_after[i]) {
          TensorState& s = state_[k];
          s.fwd_done = true;
          if (s.queued && !s.copied) ++freeable;
          maybe_release(k, now, i);
        }
        for (int64_t k : sched_.d2h_after[i]) {
          TensorState& s = state_[k];
          s.queued = true;
          if (s.fwd_done) ++freeable;
          d2h_queue.push_back(k);
        }
      }
    }
  }

  // --- copies on the compute stream (offload_all_sync) ----------------------
  void run_sync() {
    double now = 0.0;
    for (int64_t i = 0; i < n_; ++i) {
      const double prev_end = i > 0 ? r_.op_end_us[i - 1] : 0.0;
      double replayed_us = 0.0;
      for (int64_t k : sched_.replay_before[i]) {
        const int64_t alloc = bytes_of(k) + replay_transient_[k];
        change_memory(now, alloc, i);
        add_event(Stream::kCompute, EventKind::kRecompute, analysis_.candidates[k].tensor_id, now,
                  now + replay_us_[k], alloc);
        now += replay_us_[k];
        replayed_us += replay_us_[k];
        change_memory(now, -(replay_transient_[k] - replay_kept_bytes_[k]), i);
        state_[k].fetched = true;
        for (int64_t j : replay_keeps_[k]) state_[j].fetched = true;
      }
      for (int64_t k : sched_.prefetch_at[i]) {
        const double end = now + h2d_time_us(device_, bytes_of(k));
        r_.bytes_to_device += bytes_of(k);
        change_memory(now, bytes_of(k), i);
        add_event(Stream::kCompute, EventKind::kH2D, analysis_.candidates[k].tensor_id, now, end, bytes_of(k));
        state_[k].fetched = true;
        now = end;
      }
      r_.stall_us_per_op[i] = now - prev_end - replayed_us;
      r_.op_start_us[i] = now;
      change_memory(now, outputs_bytes_[i], i);
      add_event(Stream::kCompute, EventKind::kOp, i, now, now + duration_us_[i], outputs_bytes_[i]);
      now += duration_us_[i];
      r_.op_end_us[i] = now;
      change_memory(now, -frees_bytes_[i], i);
      for (int64_t k : sched_.fwd_done_after[i]) {
        state_[k].fwd_done = true;
        maybe_release(k, now, i);
      }
      for (int64_t k : sched_.d2h_after[i]) {
        const double end = now + d2h_time_us(device_, bytes_of(k));
        r_.bytes_to_host += bytes_of(k);
        add_event(Stream::kCompute, EventKind::kD2H, analysis_.candidates[k].tensor_id, now, end, bytes_of(k));
        now = end;
        state_[k].copied = true;
        maybe_release(k, now, i + 1);
      }
    }
  }

  const Trace& trace_;
  const Plan& plan_;
  const DeviceModel& device_;
  OffloadAnalysis analysis_;
  int64_t n_ = 0;
  std::vector<double> duration_us_;
  std::vector<int64_t> outputs_bytes_;  // allocated when the op starts
  std::vector<int64_t> frees_bytes_;    // released when the op ends
  int64_t initial_bytes_ = 0;           // tensors live before the step
  OffloadSchedule sched_;
  std::vector<TensorState> state_;
  std::vector<double> replay_us_;          // per candidate: replay time of a recomputed tensor
  std::vector<int64_t> replay_transient_;  // per candidate: bytes its replay allocates besides itself
  std::vector<std::vector<int64_t>> replay_keeps_;  // per candidate: candidates its replay recreates and keeps
  std::vector<int64_t> replay_kept_bytes_;  // per candidate: their bytes (part of replay_transient_, not freed)
  int64_t mem_ = 0;
  SimResult r_;
};

}  // namespace

SimResult simulate(const Trace& trace, const Plan& plan, const DeviceModel& device) {
  return Simulation(trace, plan, device).run();
}

void SimResult::check_invariants(const Trace& trace, const Plan& plan) const {
  for (const auto& s : memory) MEMSCHED_CHECK(s.bytes >= 0, "sim invariant: negative memory at ", s.time_us);
  const auto n = static_cast<int64_t>(op_start_us.size());
  MEMSCHED_CHECK(n == static_cast<int64_t>(trace.ops.size()), "sim invariant: one start time per op");
  for (int64_t i = 0; i < n; ++i) {
    MEMSCHED_CHECK(op_end_us[i] >= op_start_us[i], "sim invariant: op ", i, " ends before it starts");
    if (i > 0) MEMSCHED_CHECK(op_start_us[i] >= op_end_us[i - 1], "sim invariant: ops ", i - 1, " and ", i, " overlap");
  }
  // Events on one stream never overlap.
  for (Stream s : {Stream::kCompute, Stream::kD2H, Stream::kH2D}) {
    double last_end = 0.0;
    for (const auto& e : events) {
      if (e.stream != s) continue;
      MEMSCHED_CHECK(e.start_us >= last_end, "sim invariant: events overlap on stream ", to_string(s), " at ",
                     e.start_us, " us");
      last_end = e.end_us;
    }
  }
  // Every offloaded tensor is back before its first backward use starts.
  const OffloadAnalysis analysis = analyze_offload(trace);
  for (size_t k = 0; k < plan.decisions.size(); ++k) {
    const auto& c = analysis.candidates[k];
    if (plan.decisions[k].recompute) {
      int replays = 0;
      for (const auto& e : events) {
        if (e.kind != EventKind::kRecompute || e.id != c.tensor_id) continue;
        ++replays;
        MEMSCHED_CHECK(e.stream == Stream::kCompute && e.end_us <= op_start_us[c.first_backward_use],
                       "sim invariant: tensor ", c.tensor_id, " is replayed by ", e.end_us,
                       " us, after its first backward use (op ", c.first_backward_use, ") started");
        MEMSCHED_CHECK(c.first_backward_use == 0 || e.start_us >= op_end_us[c.first_backward_use - 1],
                       "sim invariant: tensor ", c.tensor_id, " is replayed before op ", c.first_backward_use - 1,
                       " ended");
      }
      const int expected = plan.decisions[k].recompute_ops.empty() ? 0 : 1;  // 0: kept by an earlier replay
      MEMSCHED_CHECK(replays == expected, "sim invariant: recomputed tensor ", c.tensor_id, " was replayed ",
                     replays, " times (expected ", expected, ")");
      continue;
    }
    if (!plan.decisions[k].offload) continue;
    int copies_in = 0;
    for (const auto& e : events) {
      if (e.kind != EventKind::kH2D || e.id != c.tensor_id) continue;
      ++copies_in;
      MEMSCHED_CHECK(e.end_us <= op_start_us[c.first_backward_use], "sim invariant: tensor ", c.tensor_id,
                     " arrives at ", e.end_us, " us, after its first backward use (op ", c.first_backward_use,
                     ") started at ", op_start_us[c.first_backward_use], " us");
    }
    MEMSCHED_CHECK(copies_in == 1, "sim invariant: offloaded tensor ", c.tensor_id, " was fetched ", copies_in,
                   " times (expected once)");
  }
}

}  // namespace memsched
