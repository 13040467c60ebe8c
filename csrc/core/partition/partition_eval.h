// partition_eval.h -- the multi-device extension of the simulator: what a
// placement of a step's ops on several devices costs under Note [Partition
// model] (partition_problem.h): makespan, per-device memory peak, transfers.
//
// Entry points: evaluate_partition(problem, device_of_op), simulate_makespan(),
// partition_transfers(), check_assignment().
#pragma once

#include <cstdint>
#include <vector>

#include "core/partition/partition_problem.h"

namespace memsched {

struct Transfer {
  int64_t tensor = 0;        // trace tensor id
  int64_t from_device = 0;   // its home device
  int64_t to_device = 0;     // a device where an op reads it
  int64_t bytes = 0;
  double ready_us = 0.0;     // when the sender has it (producer's finish; 0 before the step)
  double arrive_us = 0.0;    // ready_us + latency + bytes / link bandwidth
};

struct PartitionEval {
  double makespan_us = 0.0;             // finish of the last op
  std::vector<double> busy_us;          // per device: sum of its ops' times
  std::vector<int64_t> peak_bytes;      // per device: max over the op axis of bytes present
  std::vector<int64_t> peak_op;         // per device: first op index of that peak (-1: nothing there)
  std::vector<int64_t> ops_per_device;
  int64_t bytes_moved = 0;              // sum over (tensor, receiving device) of bytes
  int64_t num_transfers = 0;
  int64_t excess_bytes = 0;             // sum over devices of max(0, peak - cap)
  bool fits = true;                     // every device's peak <= its cap
};

// Throws memsched::Error naming the first op whose device is out of range, or a size mismatch.
void check_assignment(const PartitionProblem& problem, const std::vector<int>& device_of_op);

PartitionEval evaluate_partition(const PartitionProblem& problem, const std::vector<int>& device_of_op);

// Earliest-start schedule in per-device trace order; optional per-op start/finish.
double simulate_makespan(const PartitionProblem& problem, const std::vector<int>& device_of_op,
                         std::vector<double>* start_us = nullptr, std::vector<double>* finish_us = nullptr);

// One Transfer per (tensor, receiving device), ascending tensor then device.
std::vector<Transfer> partition_transfers(const PartitionProblem& problem, const std::vector<int>& device_of_op);

// The device a tensor's home is on under the assignment (0 for a tensor without reasons).
inline int home_device(const PartitionProblem& problem, const std::vector<int>& device_of_op, int64_t tensor) {
  const int64_t home = problem.tensors()[tensor].home_op;
  return home < 0 ? 0 : device_of_op[home];
}

}  // namespace memsched
