#include "torch/parameter_read_watch.h"

#include <ATen/record_function.h>
#include <torch/csrc/autograd/graph_task.h>

#include <algorithm>
#include <mutex>

namespace memsched {
namespace {

// The watches that exist, and the callback's handle while there is one. WARNING: nothing under
// g_mu may run an aten op (the callback takes g_mu from inside every op's dispatch).
std::mutex g_mu;
std::vector<ParameterReadWatch*> g_watches;
at::CallbackHandle g_handle = 0;

void see_value(const c10::IValue& v) {
  if (v.isTensor()) {
    for (ParameterReadWatch* w : g_watches) w->see(v.toTensor());
  } else if (v.isList()) {  // Tensor[] and Tensor?[] (torch.cat, index)
    for (const c10::IValue& e : v.toListRef()) {
      if (e.isTensor()) see_value(e);
    }
  }
}

// Ops running inside another op's kernel on this thread: addmm's CPU kernel reads an expand() of
// the bias made below autograd (no gradient), a computation of the outer op and no read of the
// caller's: only the outermost op's arguments are looked at. Records that are no op (the engine's
// "evaluate_function" around each node, inside which hooks run) do not count.
thread_local int t_depth = 0;
struct Counted : at::ObserverContext {};  // the start callback's context for an op it counted

void on_op_end(const at::RecordFunction&, at::ObserverContext* ctx) {
  if (ctx != nullptr) --t_depth;
}

std::unique_ptr<at::ObserverContext> on_op(const at::RecordFunction& fn) {
  if (!fn.operator_name().has_value()) return nullptr;
  const bool outermost = t_depth++ == 0;
  std::unique_ptr<at::ObserverContext> counted = std::make_unique<Counted>();
  if (!outermost) return counted;
  if (torch::autograd::get_current_graph_task_id() == -1) return counted;  // not inside backward
  std::lock_guard<std::mutex> lock(g_mu);
  for (const c10::IValue& v : fn.inputs()) see_value(v);
  return counted;
}

}  // namespace

ParameterReadWatch::ParameterReadWatch() {
  std::lock_guard<std::mutex> lock(g_mu);
  g_watches.push_back(this);
  if (g_watches.size() == 1) {
    g_handle = at::addGlobalCallback(
        at::RecordFunctionCallback(&on_op, &on_op_end).needsInputs(true).scopes({at::RecordScope::FUNCTION}));
  }
}

ParameterReadWatch::~ParameterReadWatch() {
  at::CallbackHandle handle = 0;
  {
    std::lock_guard<std::mutex> lock(g_mu);
    g_watches.erase(std::remove(g_watches.begin(), g_watches.end(), this), g_watches.end());
    if (g_watches.empty()) std::swap(handle, g_handle);
  }
  // (outside g_mu: removal waits for no callback, and a callback running now finds this watch gone)
  if (handle != 0) at::removeCallback(handle);
}

void ParameterReadWatch::begin_iteration(const std::vector<at::Tensor>& params) {
  std::lock_guard<std::mutex> lock(g_mu);
  by_storage_.clear();
  for (size_t i = 0; i < params.size(); ++i) {
    if (params[i].has_storage()) {
      by_storage_[params[i].storage().unsafeGetStorageImpl()].push_back(static_cast<int32_t>(i));
    }
  }
  final_.assign(params.size(), 0);
  hit_.resize(params.size(), 0);
}

void ParameterReadWatch::mark_final(int32_t param) {
  std::lock_guard<std::mutex> lock(g_mu);
  if (param >= 0 && param < static_cast<int32_t>(final_.size())) final_[param] = 1;
}

std::vector<int32_t> ParameterReadWatch::hits() const {
  std::lock_guard<std::mutex> lock(g_mu);
  std::vector<int32_t> out;
  for (size_t i = 0; i < hit_.size(); ++i) {
    if (hit_[i] != 0) out.push_back(static_cast<int32_t>(i));
  }
  return out;
}

void ParameterReadWatch::see(const at::Tensor& t) {
  if (!t.defined() || !t.has_storage()) return;
  const auto on = by_storage_.find(t.storage().unsafeGetStorageImpl());
  if (on == by_storage_.end()) return;
  if (std::none_of(on->second.begin(), on->second.end(), [this](int32_t i) { return final_[i] != 0; })) return;
  for (int32_t i : on->second) hit_[i] = 1;
}

}  // namespace memsched
