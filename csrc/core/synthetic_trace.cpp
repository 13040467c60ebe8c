// synthetic_trace.cpp -- random layered training steps (see synthetic_trace.h).
#include "core/synthetic_trace.h"

#include <algorithm>
#include <random>
#include <string>

#include "core/check.h"

namespace memsched {

Trace make_synthetic_trace(const SyntheticTraceOptions& o) {
  MEMSCHED_CHECK(o.num_layers >= 1, "synthetic trace: num_layers must be >= 1");
  MEMSCHED_CHECK(o.ops_per_layer >= 1, "synthetic trace: ops_per_layer must be >= 1");
  MEMSCHED_CHECK(o.min_bytes >= 0 && o.max_bytes >= o.min_bytes, "synthetic trace: need 0 <= min_bytes <= max_bytes");
  MEMSCHED_CHECK(o.min_op_us >= 0 && o.max_op_us >= o.min_op_us, "synthetic trace: need 0 <= min_op_us <= max_op_us");
  std::mt19937_64 rng(o.seed);
  auto bytes = [&] { return std::uniform_int_distribution<int64_t>(o.min_bytes, o.max_bytes)(rng); };
  auto dur = [&] { return std::uniform_real_distribution<double>(o.min_op_us, o.max_op_us)(rng); };
  auto coin = [&](double p) { return std::uniform_real_distribution<double>(0.0, 1.0)(rng) < p; };

  Trace t;
  t.device = "synthetic";
  const int64_t nf = o.num_layers * o.ops_per_layer;  // forward ops before the loss
  const int64_t loss = nf;
  const int64_t n_ops = 2 * nf + 1;
  auto mirror = [&](int64_t x) { return 2 * nf - x; };  // backward op of forward op x (loss mirrors itself)
  static const char* kNames[] = {"aten::linear", "aten::relu", "aten::conv2d", "aten::layer_norm", "aten::mul"};
  for (int64_t i = 0; i < n_ops; ++i) {
    Op op;
    op.id = i;
    op.phase = i <= loss ? Phase::kForward : Phase::kBackward;
    const int64_t fwd = i <= loss ? i : mirror(i);
    op.module_path = fwd == loss ? "loss" : "layers." + std::to_string(fwd / o.ops_per_layer);
    op.name = fwd == loss ? "aten::cross_entropy" : kNames[fwd % 5];
    if (op.phase == Phase::kBackward) op.name += "_backward";
    op.duration_us = dur();
    op.flops = op.duration_us * 1e6;
    t.ops.push_back(op);
  }
  auto add = [&](int64_t b, TensorKind kind, int64_t producer, std::vector<int64_t> uses, int64_t freed,
                 const std::string& label) {
    std::sort(uses.begin(), uses.end());
    uses.erase(std::unique(uses.begin(), uses.end()), uses.end());
    TensorRecord r;
    r.id = static_cast<int64_t>(t.tensors.size());
    r.bytes = b;
    r.dtype = "float32";
    r.kind = kind;
    r.producer_op = producer;
    r.uses = std::move(uses);
    r.freed_after_op = freed;
    r.label = label;
    t.tensors.push_back(std::move(r));
  };
  for (int64_t j = 0; j < o.num_layers; ++j) {
    std::vector<int64_t> uses;
    for (int64_t s = 0; s < o.ops_per_layer; ++s) {
      uses.push_back(j * o.ops_per_layer + s);
      uses.push_back(mirror(j * o.ops_per_layer + s));
    }
    add(bytes() / 4, TensorKind::kParameter, kBeforeStep, uses, kAfterStep, "param:" + std::to_string(j));
  }
  // Model input, saved for the first op's backward.
  add(bytes(), TensorKind::kActivation, kBeforeStep, {0, mirror(0)}, mirror(0), "input");
  for (int64_t x = 0; x < nf; ++x) {
    std::vector<int64_t> uses = {x + 1, mirror(x), mirror(x + 1)};
    if (coin(o.skip_probability)) {
      const int64_t later = std::min(loss, x + 2 + static_cast<int64_t>(rng() % 3));
      uses.push_back(later);
      uses.push_back(mirror(later));
    }
    const int64_t last = *std::max_element(uses.begin(), uses.end());
    add(bytes(), TensorKind::kActivation, x, uses, last, "act:" + std::to_string(x));
  }
  // Loss output and the gradient chain through backward.
  add(64, TensorKind::kTemporary, loss, {loss + 1}, loss + 1, "loss");
  for (int64_t i = loss + 1; i + 1 < n_ops; ++i) add(bytes() / 2, TensorKind::kTemporary, i, {i + 1}, i + 1, "grad");
  t.validate();
  return t;
}

}  // namespace memsched
