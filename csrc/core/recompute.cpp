// recompute.cpp -- recompute chains of activations (See Note [Recompute model] in recompute.h).
#include "core/recompute.h"

#include <algorithm>

#include "core/check.h"

namespace memsched {

namespace {

// "aten::div_" or "aten::add_.Tensor" -> "div_", "add_": after any namespace, before any overload.
std::string base_op_name(const std::string& name) {
  const size_t ns = name.rfind("::");
  const std::string base = name.substr(ns == std::string::npos ? 0 : ns + 2);
  return base.substr(0, base.find('.'));
}

}  // namespace

bool is_inplace_op_name(const std::string& name) {
  const std::string base = base_op_name(name);
  return base.size() >= 2 && base.back() == '_' && base[base.size() - 2] != '_';
}

bool has_own_rng_state(const std::string& name) {
  const std::string base = base_op_name(name);
  return base == "_cudnn_rnn" || base == "miopen_rnn";
}

bool is_uninitialized_factory_name(const std::string& name) {
  const std::string base = base_op_name(name);
  return base == "empty" || base == "empty_like" || base == "empty_strided" || base == "new_empty" ||
         base == "new_empty_strided" || base == "empty_permuted";
}

namespace {

// The forward ops that give tensor u its saved value: its producer, then the
// in-place ops among its forward uses (See Note [Recompute model]). Returns how many in-place ops.
int64_t push_writers(const Trace& trace, const OffloadAnalysis& analysis, const TensorRecord& u,
                     std::vector<int64_t>& stack) {
  stack.push_back(u.producer_op);
  int64_t writers = 0;
  // Its forward: up to its own backward pass (Note [Micro-batches] in plan.h).
  const int64_t beta = u.producer_op == kBeforeStep ? analysis.first_backward_op : analysis.next_backward_op[u.producer_op];
  for (int64_t i : u.uses) {
    if (i >= beta) break;
    if (i > u.producer_op && trace.ops[i].phase == Phase::kForward && is_inplace_op_name(trace.ops[i].name)) {
      stack.push_back(i);
      ++writers;
    }
  }
  return writers;
}

// Note [Memory filled outside the dispatcher]
//   Rationale: a C++/CUDA extension or a Triton kernel called from a custom autograd.Function (a fused
//   LayerNorm, an attention kernel) allocates its output with at::empty* -- an aten op the profiler
//   records as the producer -- and fills it with a kernel no dispatch mode sees. Replaying "the
//   producer" would give uninitialised memory: silently wrong gradients.
//   Approach: a tensor the chain must recreate whose producer is an uninitialised factory (empty,
//   empty_like, empty_strided, new_empty, ...) and that no forward in-place op writes is not
//   recomputable. An out= op that fills it (add.out) is not counted as a writer by name, so such a
//   tensor is refused too: conservative, never wrong. The executor makes the same check on what it
//   records (Note [Unpack-time recompute] in offload/recompute.py).
std::string filled_outside_the_dispatcher(const Trace& trace, const TensorRecord& u, int64_t writers) {
  if (writers > 0 || u.producer_op == kBeforeStep || !is_uninitialized_factory_name(trace.ops[u.producer_op].name))
    return "";
  return "tensor " + std::to_string(u.id) + " is made by op " + std::to_string(u.producer_op) + " (" +
         trace.ops[u.producer_op].name + ") and no aten op writes it: a kernel outside the dispatcher " +
         "(an extension, Triton, numpy) filled it, which a replay cannot redo";
}

// The chain recreating candidate `candidate` before op b, where present(u)
// says whether tensor u is on the device then without a replay. Fills
// `recreated` with the candidates (other than `candidate`) the chain recreates.
template <typename Present>
RecomputeChain derive_chain(const Trace& trace, const OffloadAnalysis& analysis, int64_t candidate, Present present,
                            std::vector<int64_t>* recreated_candidates) {
  RecomputeChain r;
  const OffloadCandidate& c = analysis.candidates[candidate];
  const TensorRecord& t = trace.tensors[c.tensor_id];
  if (t.producer_op == kBeforeStep) {
    r.why = "it exists before the step, no forward op produces it";
    return r;
  }
  const int64_t b = c.first_backward_use;
  std::vector<int64_t> stack;
  std::vector<int64_t> recreated = {t.id};  // tensors whose writers are in the chain
  r.why = filled_outside_the_dispatcher(trace, t, push_writers(trace, analysis, t, stack));
  if (!r.why.empty()) return r;  // See Note [Memory filled outside the dispatcher]
  while (!stack.empty()) {
    const int64_t p = stack.back();
    stack.pop_back();
    if (std::find(r.ops.begin(), r.ops.end(), p) != r.ops.end()) continue;
    r.ops.push_back(p);
    if (static_cast<int64_t>(r.ops.size()) > kMaxRecomputeOps) {
      r.ops.clear();
      r.why = "its replay would re-run more than " + std::to_string(kMaxRecomputeOps) + " forward ops";
      return r;
    }
    for (int64_t q = analysis.op_inputs_begin[p]; q < analysis.op_inputs_begin[p + 1]; ++q) {
      const TensorRecord& u = trace.tensors[analysis.op_inputs[q]];
      if (u.producer_op == p || u.id == t.id || present(u)) continue;
      if (std::find(recreated.begin(), recreated.end(), u.id) != recreated.end()) continue;  // the chain writes it
      if (u.producer_op == kBeforeStep || trace.ops[u.producer_op].phase != Phase::kForward) {
        r.ops.clear();
        r.why = "op " + std::to_string(p) + " reads tensor " + std::to_string(u.id) +
                ", which is gone by op " + std::to_string(b) + " and has no forward producer to replay";
        return r;
      }
      recreated.push_back(u.id);
      r.why = filled_outside_the_dispatcher(trace, u, push_writers(trace, analysis, u, stack));
      if (!r.why.empty()) {
        r.ops.clear();
        return r;
      }
    }
  }
  std::sort(r.ops.begin(), r.ops.end());
  for (int64_t op : r.ops) {
    if (!has_own_rng_state(trace.ops[op].name)) continue;
    r.ops.clear();
    r.why = "op " + std::to_string(op) + " (" + trace.ops[op].name +
            ") draws dropout masks from an RNG state of its own, which a replay cannot restore";
    return r;
  }
  // An in-place op of the chain writes one of the tensors it reads, and the trace does not say which
  // (uses are by storage, not by argument). Where it reads a tensor the chain does not recreate -- a
  // live one the plan keeps -- the replay might write into that live tensor (ATen's LSTM cell adds
  // the step's input gates into its hidden gates in place), so such a chain is refused.
  for (int64_t op : r.ops) {
    if (!is_inplace_op_name(trace.ops[op].name)) continue;
    for (int64_t q = analysis.op_inputs_begin[op]; q < analysis.op_inputs_begin[op + 1]; ++q) {
      const int64_t u = analysis.op_inputs[q];
      if (std::find(recreated.begin(), recreated.end(), u) != recreated.end()) continue;
      r.ops.clear();
      r.why = "in-place op " + std::to_string(op) + " of its replay reads tensor " + std::to_string(u) +
              ", which the replay does not recreate: it could write a live tensor";
      return r;
    }
  }
  for (int64_t op : r.ops) r.rng = r.rng || trace.ops[op].rng;
  r.feasible = true;
  if (recreated_candidates != nullptr) {
    for (size_t q = 1; q < recreated.size(); ++q) {
      const int64_t k = analysis.candidate_index[recreated[q]];
      if (k >= 0) recreated_candidates->push_back(k);
    }
  }
  return r;
}

bool made_whole_by(const Trace& trace, const OffloadAnalysis& analysis, const TensorRecord& u,
                   const std::vector<int64_t>& ops) {
  std::vector<int64_t> writers;
  if (!filled_outside_the_dispatcher(trace, u, push_writers(trace, analysis, u, writers)).empty()) return false;
  for (int64_t op : writers)
    if (!std::binary_search(ops.begin(), ops.end(), op)) return false;
  return true;
}

bool live_at(const Trace& trace, const TensorRecord& u, int64_t op) {
  return trace.live_start(u) <= op && op <= trace.live_end(u);
}

}  // namespace

RecomputeSchedule recompute_schedule(const Trace& trace, const OffloadAnalysis& analysis,
                                     const std::vector<TensorDecision>& decisions) {
  const size_t n = analysis.candidates.size();
  MEMSCHED_CHECK(decisions.size() == n, "recompute_schedule: ", decisions.size(), " decisions for ", n,
                 " offloadable tensors");
  RecomputeSchedule s;
  s.chains.resize(n);
  s.at_op.assign(n, -1);
  s.kept_alive.resize(n);
  std::vector<int64_t> order;
  for (size_t k = 0; k < n; ++k)
    if (decisions[k].recompute) order.push_back(static_cast<int64_t>(k));
  // (producer op, candidate) of every recomputed candidate, by op: a replay's other outputs
  std::vector<std::pair<int64_t, int64_t>> made_by;
  for (int64_t k : order) made_by.emplace_back(trace.tensors[analysis.candidates[k].tensor_id].producer_op, k);
  std::sort(made_by.begin(), made_by.end());
  std::sort(order.begin(), order.end(), [&](int64_t x, int64_t y) {
    const int64_t bx = analysis.candidates[x].first_backward_use, by = analysis.candidates[y].first_backward_use;
    return bx != by ? bx < by : x < y;
  });
  for (int64_t k : order) {
    const OffloadCandidate& c = analysis.candidates[k];
    const int64_t b = c.first_backward_use;
    if (s.at_op[k] >= 0) {  // recreated and kept by an earlier replay: nothing to replay
      s.chains[k].feasible = true;
      continue;
    }
    auto present = [&](const TensorRecord& u) {
      const int64_t j = analysis.candidate_index[u.id];
      if (j >= 0 && decisions[j].recompute) return s.at_op[j] >= 0 && s.at_op[j] <= b && live_at(trace, u, b);
      if (j >= 0 && decisions[j].offload) return false;
      return live_at(trace, u, b);
    };
    std::vector<int64_t> recreated;
    s.chains[k] = derive_chain(trace, analysis, k, present, &recreated);
    if (!s.chains[k].feasible) continue;
    s.at_op[k] = b;
    for (int64_t j : recreated) {
      if (!decisions[j].recompute || s.at_op[j] >= 0) continue;
      s.at_op[j] = b;  // recreated here and kept until its own first backward use
      s.kept_alive[k].push_back(j);
    }
    for (int64_t op : s.chains[k].ops) {  // See Note [Recompute model]: another output of a replayed op
      auto it = std::lower_bound(made_by.begin(), made_by.end(), std::make_pair(op, int64_t{-1}));
      for (; it != made_by.end() && it->first == op; ++it) {
        const int64_t j = it->second;
        if (s.at_op[j] >= 0 || analysis.candidates[j].first_backward_use < b ||
            !made_whole_by(trace, analysis, trace.tensors[analysis.candidates[j].tensor_id], s.chains[k].ops))
          continue;
        s.at_op[j] = b;
        s.kept_alive[k].push_back(j);
      }
    }
    std::sort(s.kept_alive[k].begin(), s.kept_alive[k].end());
  }
  return s;
}

RecomputeChain recompute_chain(const Trace& trace, const OffloadAnalysis& analysis, int64_t candidate,
                               const std::vector<TensorDecision>& decisions) {
  MEMSCHED_CHECK(candidate >= 0 && candidate < static_cast<int64_t>(analysis.candidates.size()),
                 "recompute_chain: candidate ", candidate, " out of range");
  MEMSCHED_CHECK(decisions.empty() || decisions.size() == analysis.candidates.size(), "recompute_chain: ",
                 decisions.size(), " decisions for ", analysis.candidates.size(), " offloadable tensors");
  if (decisions.empty()) {  // every other candidate kept
    const int64_t b = analysis.candidates[candidate].first_backward_use;
    auto present = [&](const TensorRecord& u) { return live_at(trace, u, b); };
    return derive_chain(trace, analysis, candidate, present, nullptr);
  }
  std::vector<TensorDecision> d = decisions;
  d[candidate] = TensorDecision(analysis.candidates[candidate].tensor_id, false, -1, -1);
  d[candidate].recompute = true;
  return recompute_schedule(trace, analysis, d).chains[candidate];
}

double recompute_time_us(const Trace& trace, const DeviceModel& device, const std::vector<int64_t>& ops) {
  double total = 0.0;
  for (int64_t op : ops) total += op_time_us(device, trace.ops[op]);
  return total;
}

int64_t recompute_transient_bytes(const OffloadAnalysis& analysis, const OffloadCandidate& c,
                                  const std::vector<int64_t>& ops) {
  int64_t total = 0;
  for (int64_t op : ops) {
    MEMSCHED_CHECK(op >= 0 && op < static_cast<int64_t>(analysis.op_output_bytes.size()), "recompute_ops: op ", op,
                   " of tensor ", c.tensor_id, " is out of range [0, ", analysis.op_output_bytes.size(), ")");
    total += analysis.op_output_bytes[op];
  }
  return std::max<int64_t>(0, total - c.bytes);
}

}  // namespace memsched
