// s3_partitioner.h -- source S3 (ParDNN): place a training step's ops on
// several devices under per-device memory caps, minimising the simulated
// makespan (Note [Partition model] in partition_problem.h).
//
// Entry points: partition_s3(problem, options) -> S3Result;
// least_uniform_cap(problem, options): the smallest cap, equal on every
// device, at which partition_s3 meets every cap.
//
// Note [S3 partitioner]
//   Rationale: ParDNN partitions graphs of hundreds of thousands of ops in
//   seconds to minutes with static-scheduling heuristics instead of a solver:
//   critical-path clustering, mapping clusters to devices, memory repair.
//   Approach:
//   1. Clustering: op weight = its mean time over the devices, edge weight =
//      the mean transfer time of the tensor. With b-level (longest path to an
//      exit) and t-level (longest path from an entry), ops are visited by
//      descending t + b; each unclustered op starts a path that follows the
//      unclustered successor with the largest edge + b-level forward and the
//      unclustered predecessor with the largest t-level + weight + edge
//      backward (linear clustering: one pass, O(edges log ops)).
//   2. Mapping: clusters by descending weight each go to the device with the
//      least estimated cost: the delay its ops would meet on that device (the
//      busy share of the device's time buckets at each op's t-level) plus the
//      transfers to neighbours already mapped elsewhere.
//   3. Memory repair (MemoryLedger, incremental): while a device is over its
//      cap, at its peak op, the units (ops of one module, forward and backward
//      together: moving half a module leaves copies behind) and the tensors
//      present there are candidates; the move of one candidate's ops on that
//      device to another device that lowers (total excess, that device's
//      bytes at the peak op, bytes moved) most is made. Stops when every cap
//      holds, or when no move helps (then the placement does not fit).
//   4. Refinement: units on a cut (a neighbour on another device) move to a
//      neighbour's device -- on graphs up to 4096 ops to any device -- when
//      the simulated makespan drops and every cap still holds; on graphs up
//      to 256 ops single ops move too. Bounded by max_refine_trials (default
//      scales with the graph so a pass is about 2e8 simulated edges) and
//      time_limit_s.
//   The same repair and refinement also start from the contiguous layer
//   splits (contiguous_split.h), from everything on device 0, and on graphs
//   up to 64 ops from `restarts` random placements, and from any
//   `extra_starts` the caller gives (memsched.partition passes the METIS
//   min-cut when pymetis is installed); the best placement that fits wins
//   (ties: the earlier start). So S3 never returns a worse makespan than
//   those baselines where they fit.
//   Limitations: a local search: no optimality guarantee (the MILP in
//   python/memsched/partition/milp.py measures the gap on small graphs).
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "core/partition/partition_eval.h"
#include "core/partition/partition_problem.h"

namespace memsched {

struct S3Options {
  double time_limit_s = 40.0;        // wall-clock bound on refinement over all starts (repair always completes)
  int64_t max_refine_trials = -1;    // per start; -1: about 2e8 / (ops + edges), at least 64
  int64_t restarts = -1;             // random starts on graphs up to 64 ops; -1: 24
  uint64_t seed = 1;
  bool contiguous_starts = true;     // also start from the layer splits and from device 0
  // More starting placements (name, device_of_op), e.g. a METIS min-cut from Python.
  std::vector<std::pair<std::string, std::vector<int>>> extra_starts;
};

struct S3Result {
  std::vector<int> device_of_op;
  PartitionEval eval;
  std::string start;                 // the start the winner came from ("clusters", "flops", "even", "device0", "random")
  int64_t num_clusters = 0;
  bool fits = false;
  double seconds = 0.0;              // wall-clock time of partition_s3
};

S3Result partition_s3(const PartitionProblem& problem, const S3Options& options = {});

// Clustering and mapping alone (steps 1-2), before repair: for tests and the ablation.
std::vector<int> s3_cluster_mapping(const PartitionProblem& problem, int64_t* num_clusters = nullptr);

// Bisection over one cap for every device between a lower bound (the trace's
// peak over the devices, the largest tensor) and the single-device peak: the
// smallest cap (to `tolerance` of the single-device peak) at which
// partition_s3 fits. Used for the error that names the cap that works.
int64_t least_uniform_cap(const PartitionProblem& problem, const S3Options& options = {}, double tolerance = 0.01);

}  // namespace memsched
