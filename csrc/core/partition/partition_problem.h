// partition_problem.h -- one training step (a Trace) placed on several
// devices: the graph the partitioners and the multi-device evaluation share.
//
// Entry points: PartitionDevices (devices, per-device memory caps, links),
// PartitionProblem(trace, devices).
//
// Note [Partition model]
//   Rationale: S3 (ParDNN) places the ops of one training step on several
//   devices under per-device memory caps, minimising the step time. The
//   heuristic, the baselines, the exact MILP (python/memsched/partition/
//   milp.py) and the reported figures must all measure one and the same
//   model, or "within 10% of the optimum" means nothing.
//   Approach:
//   - Each op runs on one device, taking op_time_us(device, op) (Note [Op time
//     model] in device_model.h). A device runs its ops one at a time in trace
//     order (the trace order restricted to the device).
//   - A tensor lives on the device of every op that produces or uses it: its
//     "reasons" are the producer (if any) and its uses. A tensor that exists
//     before the step (parameter, optimizer state, input) with no use lives on
//     device 0. Its home is the producer's device, or for a tensor from before
//     the step the device of its first use.
//   - On each device it lives for its whole trace lifetime [live_start,
//     live_end] (Note [Tensor lifetime convention] in trace.h): memory is
//     counted on the trace's logical time axis, so with one device the curve
//     is the trace's own. A device's peak is the maximum over ops of the bytes
//     present on it. A receiver keeps its copy as long as the sender keeps the
//     original (a copy used by a later backward op must stay).
//   - An op may start when its device is free and each input has arrived: a
//     tensor produced by op u is ready at u's finish on u's device, a tensor
//     from before the step at time 0 on its home device; another device gets
//     it after link_latency_us + bytes / link bandwidth (a -> b). Transfers
//     do not contend for links (the delay model of DAG scheduling): a tensor
//     reaches each device that uses it once, and bytes moved count each
//     (tensor, receiving device) once.
//   - Makespan = the finish of the last op, from that earliest-start schedule.
//   Limitations: in-place writes are uses like reads, so a reader on another
//   device orders after the producer only, not after an in-place writer in
//   between; link contention and compute/communication overlap limits of real
//   hardware are not modelled; memory is not re-timed by the multi-device
//   schedule.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "core/device_model.h"
#include "core/trace.h"

namespace memsched {

struct PartitionDevices {
  std::vector<DeviceModel> devices;   // one per device (>= 1)
  std::vector<int64_t> caps_bytes;    // memory cap per device, bytes (>= 0), same length
  std::vector<double> link_bw_gbps;   // D*D row-major, a->b at [a*D+b], GB/s (> 0 off the diagonal);
                                      // empty: every pair uses default_link_bw_gbps
  double default_link_bw_gbps = 450.0;  // NVLink 4: 900 GB/s both directions together
  double link_latency_us = 5.0;       // fixed cost per transfer, microseconds (>= 0)

  int64_t size() const { return static_cast<int64_t>(devices.size()); }
  double bw_gbps(int64_t a, int64_t b) const;
  // Throws memsched::Error naming the field (caps, links, a device's figures).
  void validate() const;
};

class PartitionProblem {
 public:
  struct Tensor {
    int64_t bytes = 0;
    int64_t producer = -1;         // producing op, or -1 (exists before the step)
    int64_t home_op = -1;          // producer, else first use, else -1 (device 0)
    int64_t start = 0, end = 0;    // live interval on the trace's op axis (inclusive)
    std::vector<int64_t> reasons;  // producer (if any) and uses: the ops that keep it on their device
  };

  PartitionProblem(const Trace& trace, PartitionDevices devices);  // validates both

  int64_t num_ops() const { return num_ops_; }
  int64_t num_devices() const { return devices_.size(); }
  const PartitionDevices& devices() const { return devices_; }
  double op_us(int64_t op, int64_t device) const { return op_us_[op * num_devices() + device]; }
  double comm_us(int64_t bytes, int64_t from, int64_t to) const;
  double mean_comm_us(int64_t bytes) const;  // over ordered pairs of distinct devices (0 for one device)

  const std::vector<Tensor>& tensors() const { return tensors_; }
  // Tensors op i reads and was not their producer (its inputs), ascending ids.
  const std::vector<int64_t>& inputs(int64_t op) const { return inputs_[op]; }
  // Every tensor whose reasons include op i (produced or used), ascending ids.
  const std::vector<int64_t>& touched(int64_t op) const { return touched_[op]; }
  // Ops that read a tensor op i produced (successors in the dataflow graph).
  const std::vector<int64_t>& consumers(int64_t op) const { return consumers_[op]; }
  double flops(int64_t op) const { return flops_[op]; }
  Phase phase(int64_t op) const { return phases_[op]; }

  // Repair and refinement units (Note [S3 partitioner] in s3_partitioner.h):
  // ops of one module (forward and backward share module_path); an op outside
  // any module joins the unit of the first parameter it reads, else its own.
  int64_t unit_of(int64_t op) const { return unit_of_[op]; }
  int64_t num_units() const { return static_cast<int64_t>(unit_ops_.size()); }
  const std::vector<int64_t>& unit_ops(int64_t unit) const { return unit_ops_[unit]; }
  // Layers for the contiguous baselines (Note [Layers] in contiguous_split.h).
  int64_t layer_of(int64_t op) const { return layer_of_[op]; }
  int64_t num_layers() const { return num_layers_; }

 private:
  PartitionDevices devices_;
  int64_t num_ops_ = 0;
  std::vector<double> op_us_;
  std::vector<double> flops_;
  std::vector<Phase> phases_;
  std::vector<Tensor> tensors_;
  std::vector<std::vector<int64_t>> inputs_, touched_, consumers_;
  std::vector<int64_t> unit_of_;
  std::vector<std::vector<int64_t>> unit_ops_;
  std::vector<int64_t> layer_of_;
  int64_t num_layers_ = 0;
};

// The layer key of a module path: up to and including its first all-digit
// component ("blocks.3.attn.qkv" -> "blocks.3", "layer2.1.conv1" -> "layer2.1"),
// else its first component ("head" -> "head"); "" stays "".
std::string layer_key(const std::string& module_path);

}  // namespace memsched
