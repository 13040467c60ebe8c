// contiguous_split.cpp -- even and FLOP-balanced contiguous layer splits.
#include "core/partition/contiguous_split.h"

#include <algorithm>

namespace memsched {

std::vector<int> assign_by_layer(const PartitionProblem& problem, const std::vector<int>& device_of_layer) {
  std::vector<int> out(problem.num_ops());
  for (int64_t i = 0; i < problem.num_ops(); ++i) out[i] = device_of_layer[problem.layer_of(i)];
  return out;
}

std::vector<int> even_layer_split(const PartitionProblem& problem) {
  const int64_t layers = problem.num_layers();
  const int64_t nd = problem.num_devices();
  std::vector<int> device_of_layer(layers);
  for (int64_t l = 0; l < layers; ++l) device_of_layer[l] = static_cast<int>(l * nd / layers);
  return assign_by_layer(problem, device_of_layer);
}

std::vector<int> flop_balanced_split(const PartitionProblem& problem) {
  const int64_t layers = problem.num_layers();
  const int64_t nd = problem.num_devices();
  std::vector<double> weight(layers, 0.0);
  double total = 0;
  for (int64_t i = 0; i < problem.num_ops(); ++i) total += problem.flops(i);
  for (int64_t i = 0; i < problem.num_ops(); ++i) weight[problem.layer_of(i)] += total > 0 ? problem.flops(i) : 1.0;
  // Runs needed when no run may exceed `limit` (greedy, left to right).
  auto runs_for = [&](double limit, std::vector<int>* out) {
    int run = 0;
    double sum = 0;
    for (int64_t l = 0; l < layers; ++l) {
      if (sum > 0 && sum + weight[l] > limit) {
        ++run;
        sum = 0;
      }
      sum += weight[l];
      if (out != nullptr) (*out)[l] = std::min<int>(run, static_cast<int>(nd - 1));
    }
    return run + 1;
  };
  double lo = *std::max_element(weight.begin(), weight.end());
  double hi = 0;
  for (double w : weight) hi += w;
  for (int it = 0; it < 100 && hi - lo > 1e-9 * hi; ++it) {
    const double mid = (lo + hi) / 2;
    if (runs_for(mid, nullptr) <= nd) hi = mid;
    else lo = mid;
  }
  std::vector<int> device_of_layer(layers, 0);
  runs_for(hi, &device_of_layer);
  return assign_by_layer(problem, device_of_layer);
}

}  // namespace memsched
