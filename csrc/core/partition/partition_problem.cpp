// partition_problem.cpp -- building the dataflow graph, units and layers from a Trace.
#include "core/partition/partition_problem.h"

#include <algorithm>
#include <cctype>
#include <cmath>
#include <unordered_map>
#include <utility>

#include "core/check.h"

namespace memsched {

double PartitionDevices::bw_gbps(int64_t a, int64_t b) const {
  if (link_bw_gbps.empty()) return default_link_bw_gbps;
  return link_bw_gbps[a * size() + b];
}

void PartitionDevices::validate() const {
  MEMSCHED_CHECK(!devices.empty(), "partition: devices is empty; give at least one device");
  MEMSCHED_CHECK(caps_bytes.size() == devices.size(), "partition: caps has ", caps_bytes.size(),
                 " entries for ", devices.size(), " devices; give one cap per device (or one for all)");
  for (size_t d = 0; d < devices.size(); ++d) {
    devices[d].validate();
    MEMSCHED_CHECK(caps_bytes[d] >= 0, "partition: caps[", d, "] is negative (", caps_bytes[d], ")");
  }
  MEMSCHED_CHECK(std::isfinite(link_latency_us) && link_latency_us >= 0, "partition: link_latency_us must be a finite ",
                 "number >= 0, got ", link_latency_us);
  MEMSCHED_CHECK(std::isfinite(default_link_bw_gbps) && default_link_bw_gbps > 0,
                 "partition: link_bw_gbps must be a finite number > 0, got ", default_link_bw_gbps);
  if (!link_bw_gbps.empty()) {
    const size_t n = devices.size();
    MEMSCHED_CHECK(link_bw_gbps.size() == n * n, "partition: links has ", link_bw_gbps.size(), " entries; give a ",
                   n, "x", n, " matrix of GB/s (", n * n, " entries)");
    for (size_t a = 0; a < n; ++a)
      for (size_t b = 0; b < n; ++b) {
        const double bw = link_bw_gbps[a * n + b];
        MEMSCHED_CHECK(a == b || (std::isfinite(bw) && bw > 0), "partition: links[", a, "][", b,
                       "] must be a finite bandwidth > 0 GB/s, got ", bw);
      }
  }
}

std::string layer_key(const std::string& module_path) {
  size_t begin = 0;
  std::string first;
  while (begin <= module_path.size()) {
    size_t dot = module_path.find('.', begin);
    if (dot == std::string::npos) dot = module_path.size();
    const std::string part = module_path.substr(begin, dot - begin);
    if (begin == 0) first = part;
    const bool digits = !part.empty() && std::all_of(part.begin(), part.end(), [](unsigned char c) {
      return std::isdigit(c) != 0;
    });
    if (digits) return module_path.substr(0, dot);
    begin = dot + 1;
  }
  return first;
}

PartitionProblem::PartitionProblem(const Trace& trace, PartitionDevices devices) : devices_(std::move(devices)) {
  trace.validate();
  devices_.validate();
  MEMSCHED_CHECK(!trace.ops.empty(), "partition: the trace has no ops; profile a training step first");
  num_ops_ = static_cast<int64_t>(trace.ops.size());
  const int64_t nd = devices_.size();
  op_us_.resize(num_ops_ * nd);
  flops_.resize(num_ops_);
  phases_.resize(num_ops_);
  for (int64_t i = 0; i < num_ops_; ++i) {
    for (int64_t d = 0; d < nd; ++d) op_us_[i * nd + d] = op_time_us(devices_.devices[d], trace.ops[i]);
    flops_[i] = trace.ops[i].flops;
    phases_[i] = trace.ops[i].phase;
  }

  inputs_.assign(num_ops_, {});
  touched_.assign(num_ops_, {});
  consumers_.assign(num_ops_, {});
  tensors_.resize(trace.tensors.size());
  for (size_t k = 0; k < trace.tensors.size(); ++k) {
    const TensorRecord& r = trace.tensors[k];
    Tensor& t = tensors_[k];
    t.bytes = r.bytes;
    t.producer = r.producer_op;
    t.start = trace.live_start(r);
    t.end = trace.live_end(r);
    if (r.producer_op >= 0) t.reasons.push_back(r.producer_op);
    for (int64_t u : r.uses)
      if (u != r.producer_op && (t.reasons.empty() || t.reasons.back() != u)) t.reasons.push_back(u);
    t.home_op = r.producer_op >= 0 ? r.producer_op : (r.uses.empty() ? -1 : r.uses.front());
    const auto id = static_cast<int64_t>(k);
    for (int64_t op : t.reasons) touched_[op].push_back(id);
    for (int64_t u : r.uses) {
      if (u == r.producer_op) continue;
      if (inputs_[u].empty() || inputs_[u].back() != id) inputs_[u].push_back(id);
      if (r.producer_op >= 0) consumers_[r.producer_op].push_back(u);
    }
  }
  for (auto& c : consumers_) {
    std::sort(c.begin(), c.end());
    c.erase(std::unique(c.begin(), c.end()), c.end());
  }

  // Units: one per module path; an op outside any module joins the unit of the
  // first parameter it reads (the optimizer's ops join their layer's module).
  auto first_parameter_home = [&](int64_t op) -> int64_t {
    for (int64_t t : inputs_[op]) {
      const TensorRecord& r = trace.tensors[t];
      if (r.kind == TensorKind::kParameter && tensors_[t].home_op >= 0 && tensors_[t].home_op < op)
        return tensors_[t].home_op;
    }
    return -1;
  };
  unit_of_.assign(num_ops_, -1);
  std::unordered_map<std::string, int64_t> unit_by_path;
  for (int64_t i = 0; i < num_ops_; ++i) {
    const std::string& path = trace.ops[i].module_path;
    int64_t unit = -1;
    if (!path.empty()) {
      auto it = unit_by_path.find(path);
      if (it != unit_by_path.end()) {
        unit = it->second;
      } else {
        unit = unit_by_path[path] = static_cast<int64_t>(unit_ops_.size());
        unit_ops_.emplace_back();
      }
    } else if (int64_t home = first_parameter_home(i); home >= 0) {
      unit = unit_of_[home];
    }
    if (unit < 0) {
      unit = static_cast<int64_t>(unit_ops_.size());
      unit_ops_.emplace_back();
    }
    unit_of_[i] = unit;
    unit_ops_[unit].push_back(i);
  }

  // Layers (Note [Layers] in contiguous_split.h): forward layer keys in order of first appearance.
  std::unordered_map<std::string, int64_t> layer_by_key;
  for (int64_t i = 0; i < num_ops_; ++i) {
    if (trace.ops[i].phase != Phase::kForward) continue;
    const std::string key = layer_key(trace.ops[i].module_path);
    if (!key.empty() && layer_by_key.find(key) == layer_by_key.end()) {
      layer_by_key.emplace(key, static_cast<int64_t>(layer_by_key.size()));
    }
  }
  const bool by_module = !layer_by_key.empty();
  layer_of_.assign(num_ops_, -1);
  int64_t next_layer = 0;
  for (int64_t i = 0; i < num_ops_; ++i) {
    int64_t layer = -1;
    if (by_module) {
      auto it = layer_by_key.find(layer_key(trace.ops[i].module_path));
      if (it != layer_by_key.end()) layer = it->second;
    } else if (trace.ops[i].phase == Phase::kForward) {
      layer = next_layer++;  // no module paths: each forward op is a layer
    }
    if (layer < 0) {
      if (int64_t home = first_parameter_home(i); home >= 0) layer = layer_of_[home];
    }
    if (layer < 0) {
      for (int64_t t : inputs_[i]) {
        const int64_t home = tensors_[t].home_op;
        if (home >= 0 && home < i) layer = std::max(layer, layer_of_[home]);
      }
    }
    if (layer < 0) layer = i > 0 ? layer_of_[i - 1] : 0;
    layer_of_[i] = layer;
  }
  num_layers_ = by_module ? static_cast<int64_t>(layer_by_key.size()) : std::max<int64_t>(next_layer, 1);
}

double PartitionProblem::comm_us(int64_t bytes, int64_t from, int64_t to) const {
  if (from == to) return 0.0;
  return devices_.link_latency_us + static_cast<double>(bytes) / (devices_.bw_gbps(from, to) * 1e3);
}

double PartitionProblem::mean_comm_us(int64_t bytes) const {
  const int64_t nd = num_devices();
  if (nd < 2) return 0.0;
  double sum = 0;
  for (int64_t a = 0; a < nd; ++a)
    for (int64_t b = 0; b < nd; ++b)
      if (a != b) sum += comm_us(bytes, a, b);
  return sum / static_cast<double>(nd * (nd - 1));
}

}  // namespace memsched
