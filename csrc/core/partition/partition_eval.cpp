// partition_eval.cpp -- makespan by earliest-start list scheduling, memory by
// difference arrays over the op axis (See Note [Partition model]).
#include "core/partition/partition_eval.h"

#include <algorithm>

#include "core/check.h"

namespace memsched {

void check_assignment(const PartitionProblem& problem, const std::vector<int>& device_of_op) {
  MEMSCHED_CHECK(static_cast<int64_t>(device_of_op.size()) == problem.num_ops(), "partition: device_of_op has ",
                 device_of_op.size(), " entries for a trace of ", problem.num_ops(), " ops; give one device per op");
  for (size_t i = 0; i < device_of_op.size(); ++i) {
    MEMSCHED_CHECK(device_of_op[i] >= 0 && device_of_op[i] < problem.num_devices(), "partition: device_of_op[", i,
                   "] is ", device_of_op[i], "; devices are numbered 0..", problem.num_devices() - 1);
  }
}

namespace {

// Ready time of tensor t for op on device d.
inline double arrival_us(const PartitionProblem& p, const std::vector<int>& a, const std::vector<double>& finish,
                         int64_t t, int d) {
  const auto& tensor = p.tensors()[t];
  const double ready = tensor.producer >= 0 ? finish[tensor.producer] : 0.0;
  const int from = home_device(p, a, t);
  return from == d ? ready : ready + p.comm_us(tensor.bytes, from, d);
}

}  // namespace

double simulate_makespan(const PartitionProblem& problem, const std::vector<int>& a, std::vector<double>* start_us,
                         std::vector<double>* finish_us) {
  const int64_t n = problem.num_ops();
  std::vector<double> finish(n, 0.0);
  std::vector<double> device_free(problem.num_devices(), 0.0);
  double makespan = 0.0;
  for (int64_t i = 0; i < n; ++i) {
    const int d = a[i];
    double start = device_free[d];
    for (int64_t t : problem.inputs(i)) start = std::max(start, arrival_us(problem, a, finish, t, d));
    finish[i] = start + problem.op_us(i, d);
    device_free[d] = finish[i];
    makespan = std::max(makespan, finish[i]);
    if (start_us != nullptr) {
      start_us->resize(n);
      (*start_us)[i] = start;
    }
  }
  if (finish_us != nullptr) *finish_us = std::move(finish);
  return makespan;
}

std::vector<Transfer> partition_transfers(const PartitionProblem& problem, const std::vector<int>& a) {
  check_assignment(problem, a);
  std::vector<double> finish;
  simulate_makespan(problem, a, nullptr, &finish);
  std::vector<Transfer> out;
  std::vector<char> seen(problem.num_devices(), 0);
  const auto& tensors = problem.tensors();
  for (size_t t = 0; t < tensors.size(); ++t) {
    const int from = home_device(problem, a, static_cast<int64_t>(t));
    std::fill(seen.begin(), seen.end(), 0);
    for (int64_t op : tensors[t].reasons) seen[a[op]] = 1;
    for (int d = 0; d < problem.num_devices(); ++d) {
      if (!seen[d] || d == from) continue;
      Transfer x;
      x.tensor = static_cast<int64_t>(t);
      x.from_device = from;
      x.to_device = d;
      x.bytes = tensors[t].bytes;
      x.ready_us = tensors[t].producer >= 0 ? finish[tensors[t].producer] : 0.0;
      x.arrive_us = x.ready_us + problem.comm_us(x.bytes, from, d);
      out.push_back(x);
    }
  }
  return out;
}

PartitionEval evaluate_partition(const PartitionProblem& problem, const std::vector<int>& a) {
  check_assignment(problem, a);
  const int64_t n = problem.num_ops();
  const int64_t nd = problem.num_devices();
  PartitionEval ev;
  ev.makespan_us = simulate_makespan(problem, a);
  ev.busy_us.assign(nd, 0.0);
  ev.ops_per_device.assign(nd, 0);
  for (int64_t i = 0; i < n; ++i) {
    ev.busy_us[a[i]] += problem.op_us(i, a[i]);
    ev.ops_per_device[a[i]] += 1;
  }
  // Difference arrays, one per device, over the op axis.
  std::vector<int64_t> diff((n + 1) * nd, 0);
  std::vector<char> seen(nd, 0);
  for (const auto& t : problem.tensors()) {
    std::fill(seen.begin(), seen.end(), 0);
    if (t.reasons.empty()) seen[0] = 1;
    for (int64_t op : t.reasons) seen[a[op]] = 1;
    int present = 0;
    for (int64_t d = 0; d < nd; ++d) {
      if (!seen[d]) continue;
      ++present;
      diff[t.start * nd + d] += t.bytes;
      diff[(t.end + 1) * nd + d] -= t.bytes;
    }
    if (present > 1) {
      ev.bytes_moved += t.bytes * (present - 1);
      ev.num_transfers += present - 1;
    }
  }
  ev.peak_bytes.assign(nd, 0);
  ev.peak_op.assign(nd, -1);
  std::vector<int64_t> live(nd, 0);
  for (int64_t i = 0; i < n; ++i) {
    for (int64_t d = 0; d < nd; ++d) {
      live[d] += diff[i * nd + d];
      if (live[d] > ev.peak_bytes[d]) {
        ev.peak_bytes[d] = live[d];
        ev.peak_op[d] = i;
      }
    }
  }
  const auto& caps = problem.devices().caps_bytes;
  for (int64_t d = 0; d < nd; ++d) {
    if (ev.peak_bytes[d] > caps[d]) {
      ev.fits = false;
      ev.excess_bytes += ev.peak_bytes[d] - caps[d];
    }
  }
  return ev;
}

}  // namespace memsched
