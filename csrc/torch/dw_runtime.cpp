// dw_runtime.cpp -- see dw_runtime.h, Note [dW runtime in C++] and Note [Streams of out-of-order
// backward].
#include "torch/dw_runtime.h"

#include <algorithm>
#include <optional>
#include <utility>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/core/StreamGuard.h>
#include <c10/core/impl/VirtualGuardImpl.h>
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/graph_task.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/autograd/utils/grad_layout_contract.h>
#include <torch/csrc/autograd/variable.h>

#include "core/check.h"
#include "torch/capsule_function.h"

namespace py = pybind11;

namespace memsched {

namespace {

int64_t nbytes(const at::Tensor& t) { return t.defined() ? static_cast<int64_t>(t.numel() * t.element_size()) : 0; }

bool on_accelerator(const at::Tensor& t) { return t.defined() && t.device().type() != c10::DeviceType::CPU; }

void record_on(const at::Tensor& t, const c10::Stream& stream) {
  // WARNING: the tensor is read (or freed) on `stream`, not the one that allocated it.
  if (!on_accelerator(t) || !t.has_storage()) return;
  c10::impl::VirtualGuardImpl impl(t.device().type());
  impl.recordDataPtrOnStream(t.storage().data_ptr(), stream);
}

// A Python call failed: carry its exception through the autograd engine (torch's own way, as
// PyNode does), so the caller of backward() gets the original exception.
[[noreturn]] void throw_python_error() {
  python_error err;
  err.persist();
  throw std::move(err);
}

}  // namespace

int64_t DwItem::held_bytes() const { return nbytes(x) + nbytes(grad); }

std::vector<at::Tensor> compute_dw(const DwItem& item, bool want_weight, bool want_bias) {
  at::NoGradGuard no_grad;
  std::vector<at::Tensor> out;
  if (!item.conv) {
    // mm_mat2_backward for a transposed mat2 and sum_to(grad, bias.shape), as autograd does
    // after flattening the leading dimensions (0 rows or features are allowed).
    const int64_t features = item.grad.size(-1);
    int64_t rows = 1;  // the product of the leading sizes, not -1: a layer may have 0 rows or features
    for (int64_t d = 0; d + 1 < item.grad.dim(); ++d) rows *= item.grad.size(d);
    const at::Tensor grad2d = item.grad.reshape({rows, features});
    if (want_weight) out.push_back(grad2d.t().mm(item.x.reshape({rows, item.x.size(-1)})));
    if (want_bias) out.push_back(grad2d.sum(0));
    return out;
  }
  const int64_t nd = item.weight.dim() - 2;
  const std::vector<int64_t> bias_shape{item.weight.size(0)};
  const at::OptionalIntArrayRef bias_sizes =
      want_bias ? at::OptionalIntArrayRef(bias_shape) : at::OptionalIntArrayRef(std::nullopt);
  auto grads = at::convolution_backward(item.grad, item.x, item.weight, bias_sizes, item.stride, item.padding,
                                        item.dilation, false, std::vector<int64_t>(nd, 0), item.groups,
                                        {false, want_weight, want_bias});
  if (want_weight) out.push_back(std::get<1>(grads));
  if (want_bias) out.push_back(std::get<2>(grads));
  return out;
}

bool engine_runs(torch::autograd::Node* node, bool* captured) {
  // torch._C._will_engine_execute_node, in C++ (See Note [Same kernels, same order] in
  // deferred_layers.h for how each answer is used).
  *captured = false;
  const auto* exec_info = torch::autograd::get_current_graph_task_exec_info();
  const auto* nodes = torch::autograd::get_current_graph_task_nodes_in_graph();
  if (exec_info == nullptr || nodes == nullptr || node == nullptr) return false;
  if (nodes->find(node) == nodes->end()) return false;
  if (exec_info->empty()) return true;
  auto it = exec_info->find(node);
  if (it == exec_info->end() || !it->second.should_execute()) return false;
  if (it->second.captures_) *captured = true;
  return true;
}

DwRuntime::DwRuntime(int64_t max_deferred_bytes, const std::string& executor, py::object owner)
    : max_deferred_bytes_(max_deferred_bytes),
      owner_ref_(py::module_::import("weakref").attr("ref")(owner)),
      sched_(max_deferred_bytes) {
  if (executor == "inline") {
    executor_ = Executor::kInline;
  } else if (executor == "thread") {
    executor_ = Executor::kThread;
  } else if (executor == "stream") {
    executor_ = Executor::kStream;
  } else {
    MEMSCHED_CHECK(false, "DwRuntime: executor must be 'inline', 'thread' or 'stream', got '", executor, "'");
  }
  if (executor_ == Executor::kThread) worker_ = std::thread([this] { worker_loop(); });
}

DwRuntime::~DwRuntime() {
  shutdown();
  if (Py_IsInitialized()) {
    py::gil_scoped_acquire gil;
    owner_ref_ = py::object();
    hook_dicts_.clear();
    kind_ = py::object();
    cast_uses_ = py::object();
    cast_region_ = py::object();
    cast_eligible_ = py::object();
    cast_mixed_ = py::object();
    graph_ = py::object();
    graph_ref_ = py::object();
  } else {
    owner_ref_.release();  // interpreter gone: leak the references rather than touch Python
    kind_.release();
    cast_uses_.release();
    cast_region_.release();
    cast_eligible_.release();
    cast_mixed_.release();
    graph_.release();
    graph_ref_.release();
    for (HookDicts& d : hook_dicts_) {
      d.tensor_hooks.release();
      d.post_hooks.release();
      d.own_post_key.release();
    }
  }
}

namespace {
// DwRuntimes with fused set and not shut down; g_fused_installed counts them for the lock-free test.
std::atomic<int> g_fused_installed{0};
std::mutex g_fused_mu;
std::vector<DwRuntime*> g_fused;

void set_registered(DwRuntime* rt, bool on) {
  std::lock_guard<std::mutex> lock(g_fused_mu);
  if (on) {
    g_fused.push_back(rt);
  } else {
    g_fused.erase(std::remove(g_fused.begin(), g_fused.end(), rt), g_fused.end());
  }
  g_fused_installed.store(static_cast<int>(g_fused.size()), std::memory_order_relaxed);
}
}  // namespace

bool fused_update_installed() { return g_fused_installed.load(std::memory_order_relaxed) > 0; }

void note_parameter_alias_saved(const at::Tensor& t) {
  if (g_fused_installed.load(std::memory_order_relaxed) == 0) return;  // the fast path: no fused update
  if (!t.defined() || t.requires_grad() || !t.has_storage()) return;
  std::lock_guard<std::mutex> lock(g_fused_mu);
  for (DwRuntime* rt : g_fused) rt->hold_if_parameter(t);
}

void note_backward_parameter_read(const at::Tensor& t) {
  if (g_fused_installed.load(std::memory_order_relaxed) == 0) return;
  if (!t.defined() || !t.has_storage()) return;
  std::lock_guard<std::mutex> lock(g_fused_mu);
  for (DwRuntime* rt : g_fused) rt->hold_if_final(t);
}

void DwRuntime::set_fused(bool on) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!installed || on == fused) return;
    fused = on;
  }
  set_registered(this, on);
}

const std::vector<int32_t>* DwRuntime::params_on(const at::Tensor& t) {
  if (!by_storage_valid_) map_storages();
  const auto hit = by_storage_.find(t.storage().unsafeGetStorageImpl());
  return hit == by_storage_.end() ? nullptr : &hit->second;
}

void DwRuntime::hold_locked(int32_t param, bool sticky) {
  if (held_[param] == 0) holds += 1;
  held_[param] = 1;
  if (sticky) sticky_[param] = 1;
}

void DwRuntime::hold_if_parameter(const at::Tensor& t) {
  std::lock_guard<std::mutex> lock(mu_);
  const std::vector<int32_t>* on = params_on(t);
  if (on == nullptr) return;
  for (int32_t i : *on) hold_locked(i, /*sticky=*/false);
}

void DwRuntime::map_storages() {
  // (`p.data = ...` between iterations gives a parameter another storage: rebuilt every iteration)
  by_storage_.clear();
  for (size_t i = 0; i < params_.size(); ++i) {
    if (params_[i].has_storage()) {
      by_storage_[params_[i].storage().unsafeGetStorageImpl()].push_back(static_cast<int32_t>(i));
    }
  }
  by_storage_valid_ = true;
  // Parameters that are views of one buffer (nn.Parameter(flat[a:b].view(...))) share its version
  // counter: stepping one in place mid-backward failed the version check of another's saved tensor,
  // where plain PyTorch trains. They are held (See Note [A parameter read after its gradient is final]).
  for (const auto& entry : by_storage_) {
    if (entry.second.size() < 2) continue;
    for (int32_t i : entry.second) hold_locked(i, false);
  }
}

void DwRuntime::snapshot_versions() {
  std::lock_guard<std::mutex> lock(mu_);
  versions_.resize(params_.size());
  for (size_t i = 0; i < params_.size(); ++i) versions_[i] = params_[i]._version();
}

int32_t DwRuntime::first_changed_version(int32_t from) {
  std::lock_guard<std::mutex> lock(mu_);
  for (size_t i = static_cast<size_t>(std::max<int32_t>(from, 0)); i < versions_.size() && i < params_.size(); ++i) {
    if (params_[i]._version() != versions_[i]) return static_cast<int32_t>(i);
  }
  return -1;
}

void DwRuntime::hold_if_final(const at::Tensor& t) {
  std::lock_guard<std::mutex> lock(mu_);
  const std::vector<int32_t>* on = params_on(t);
  if (on == nullptr || std::none_of(on->begin(), on->end(), [this](int32_t i) { return final_[i] != 0; })) {
    return;
  }
  for (int32_t i : *on) hold_locked(i, /*sticky=*/true);
}

void DwRuntime::set_watch(bool on) {
  std::unique_ptr<ParameterReadWatch> ended;  // (destroyed outside mu_: it removes the observer)
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (on == (watch_ != nullptr)) return;
    if (on) {
      watch_ = std::make_unique<ParameterReadWatch>();
      watch_->begin_iteration(params_);
      std::fill(held_.begin(), held_.end(), 1);
      return;
    }
    ended = std::move(watch_);
    for (int32_t i : ended->hits()) {  // (held_ is all set this iteration: hold_locked would not count them)
      if (sticky_[i] == 0) holds += 1;
      sticky_[i] = 1;
    }
  }
}

bool DwRuntime::watching() {
  std::lock_guard<std::mutex> lock(mu_);
  return watch_ != nullptr;
}

std::vector<int32_t> DwRuntime::held_params() {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<int32_t> out;
  for (size_t i = 0; i < held_.size(); ++i) {
    if (held_[i] != 0) out.push_back(static_cast<int32_t>(i));
  }
  return out;
}

std::vector<int32_t> DwRuntime::params_with_grad() {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<int32_t> out;
  for (size_t i = 0; i < params_.size(); ++i) {
    if (params_[i].grad().defined()) out.push_back(static_cast<int32_t>(i));
  }
  return out;
}

void DwRuntime::shutdown() {
  std::unique_ptr<ParameterReadWatch> watch;
  {
    std::lock_guard<std::mutex> lock(mu_);
    installed = false;
    stop_ = true;
    watch = std::move(watch_);
  }
  watch.reset();  // (outside mu_, as in set_watch)
  if (fused) {
    set_registered(this, false);  // (g_fused_mu before mu_, as in note_parameter_alias_saved)
    fused = false;
  }
  wake_.notify_all();
  if (worker_.joinable()) {
    // WARNING: the worker may wait for the GIL in hand_over(); the binding releases it around
    // shutdown(), and the destructor runs it before a worker can still hold a Python call.
    if (PyGILState_Check()) {
      py::gil_scoped_release release;
      worker_.join();
    } else {
      worker_.join();
    }
  }
}

int32_t DwRuntime::add_param(const at::Tensor& param, int32_t bucket) {
  std::lock_guard<std::mutex> lock(mu_);
  MEMSCHED_CHECK(param.defined() && param.requires_grad() && param.is_leaf(),
                 "DwRuntime.add_param: expected a leaf tensor that requires grad");
  const int32_t index = sched_.add_param(nbytes(param), bucket);
  params_.push_back(param);
  buckets_.push_back(bucket);
  accumulators_.push_back(torch::autograd::impl::grad_accumulator(param));
  pending_.emplace_back();
  autograd_expected_.push_back(0);
  hook_expected_.push_back(0);
  seen_.emplace_back();
  held_.push_back(0);
  sticky_.push_back(0);
  final_.push_back(0);
  by_storage_valid_ = false;
  stash_.emplace_back();
  deferred_used_.push_back(0);
  hook_dicts_.emplace_back();
  return index;
}

int32_t DwRuntime::first_regraded() const {
  for (size_t i = 0; i < params_.size(); ++i) {
    if (torch::autograd::impl::try_get_grad_accumulator(params_[i]).get() != accumulators_[i].get()) {
      return static_cast<int32_t>(i);
    }
  }
  return -1;
}

torch::autograd::Node* DwRuntime::accumulator(int32_t param) const {
  return param >= 0 && param < static_cast<int32_t>(accumulators_.size()) ? accumulators_[param].get() : nullptr;
}

void DwRuntime::begin_iteration(bool last_micro_step) {
  std::lock_guard<std::mutex> lock(mu_);
  sched_.begin_iteration();
  iteration += 1;
  last_micro_step_ = last_micro_step;
  backward_started = false;
  std::fill(autograd_expected_.begin(), autograd_expected_.end(), 0);
  std::fill(hook_expected_.begin(), hook_expected_.end(), 0);
  std::fill(seen_.begin(), seen_.end(), AutogradSeen{});
  std::fill(deferred_used_.begin(), deferred_used_.end(), 0);
  held_ = sticky_;  // the forward's saves hold the others again
  std::fill(final_.begin(), final_.end(), 0);
  if (watch_) {  // See set_watch()
    watch_->begin_iteration(params_);
    std::fill(held_.begin(), held_.end(), 1);
  }
  by_storage_valid_ = false;
  if (fused) map_storages();  // parameters sharing a storage are held at once
}

void DwRuntime::expect_contribution(int32_t param) {
  std::lock_guard<std::mutex> lock(mu_);
  sched_.expect_contribution(param);
}

int32_t DwRuntime::expected(int32_t param) {
  std::lock_guard<std::mutex> lock(mu_);
  return sched_.expected(param);
}

int32_t DwRuntime::received(int32_t param) {
  std::lock_guard<std::mutex> lock(mu_);
  return sched_.received(param);
}

size_t DwRuntime::queued() {
  std::lock_guard<std::mutex> lock(mu_);
  return sched_.queued() + sched_.in_flight();
}

DwStats DwRuntime::stats() {
  std::lock_guard<std::mutex> lock(mu_);
  return sched_.stats();
}

void DwRuntime::track(int64_t delta_bytes, int64_t transient_bytes) {
  grad_bytes += delta_bytes;
  peak_grad_bytes = std::max(peak_grad_bytes, grad_bytes + transient_bytes);
}

void DwRuntime::track_locked(int64_t delta_bytes, int64_t transient_bytes) {
  std::lock_guard<std::mutex> lock(mu_);
  track(delta_bytes, transient_bytes);
}

void DwRuntime::start_tracking() {
  std::lock_guard<std::mutex> lock(mu_);
  int64_t bytes = 0;
  for (const at::Tensor& p : params_) bytes += nbytes(p.grad());
  grad_bytes = bytes;
  peak_grad_bytes = bytes;
}

DwRuntime::Side& DwRuntime::side_for(const c10::Device& device) {
  for (auto& entry : sides_) {
    if (entry.first == device) return entry.second;
  }
  c10::impl::VirtualGuardImpl impl(device.type());
  sides_.emplace_back(device, Side{impl.getStreamFromGlobalPool(device, false), c10::Event(device.type()),
                                   c10::Event(device.type())});
  return sides_.back().second;
}

void DwRuntime::wait_for_current(Side& side) {
  c10::impl::VirtualGuardImpl impl(side.stream.device_type());
  side.to_side.record(impl.getStream(side.stream.device()));
  side.to_side.block(side.stream);
}

void DwRuntime::release_holds(Side& side, bool all, std::vector<at::Tensor>* out) {
  // See Note [Streams of out-of-order backward]: an event that completed means the side stream is
  // past that item's kernels (and every earlier one's: one stream, recorded in order).
  while (!side.holds.empty() && (all || side.holds.front().done.query())) {
    Hold& h = side.holds.front();
    out->push_back(std::move(h.x));
    out->push_back(std::move(h.grad));
    side.spare.push_back(std::move(h.done));
    side.holds.pop_front();
  }
}

void DwRuntime::defer(DwItem item) {
  if (!backward_started) {
    // The first deferred item of this backward pass: the owner checks the phase and queues the
    // end-of-backward callback (engine thread; it is the thread running this graph task).
    py::gil_scoped_acquire gil;
    py::object owner = owner_ref_();
    if (!owner.is_none()) {
      PyObject* r = PyObject_CallMethod(owner.ptr(), "_first_deferred", nullptr);
      if (r == nullptr) throw_python_error();
      Py_DECREF(r);
    }
    backward_started = true;
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    std::vector<int32_t> ps;
    if (item.weight_idx >= 0) ps.push_back(item.weight_idx);
    if (item.bias_idx >= 0) ps.push_back(item.bias_idx);
    const int64_t id = sched_.enqueue(ps, item.held_bytes());
    if (fused && item.x.defined() && item.x.has_storage()) {
      // See Note [A parameter read after its gradient is final] (backward.py): the item reads its input
      // later, and an input on a parameter's storage (learned queries fed to a Linear) may be final, and
      // stepped, before then -- the thread executor's worker read the stepped values (4e-2 off plain).
      if (const std::vector<int32_t>* on = params_on(item.x)) {
        for (int32_t i : *on) hold_locked(i, /*sticky=*/false);
      }
    }
    if (executor_ == Executor::kStream && on_accelerator(item.grad)) {
      // Note [Streams of out-of-order backward]: the side stream waits for what the compute
      // stream queued so far (this layer's dX included), not the other way round.
      Side& side = side_for(item.grad.device());
      wait_for_current(side);
      record_on(item.x, side.stream);
      record_on(item.grad, side.stream);
    }
    if (executor_ == Executor::kThread) {
      item.intra_op_threads = at::get_num_threads();  // See Note [The worker's intra-op threads]
    }
    if (executor_ == Executor::kThread && on_accelerator(item.grad)) {
      // See Note [dW runtime in C++]: the item runs on the stream its inputs were made on
      const c10::Device dev = item.grad.device();
      item.stream = c10::impl::VirtualGuardImpl(dev.type()).getStream(dev);
      if (std::find(item_streams_.begin(), item_streams_.end(), *item.stream) == item_streams_.end()) {
        item_streams_.push_back(*item.stream);
      }
    }
    items_.emplace(id, std::move(item));
  }
  if (executor_ == Executor::kThread) {
    wake_.notify_one();
  } else {
    run(executor_ == Executor::kInline);
  }
  if (poll_after_defer) {
    // DDP: finished all-reduces are copied back (and their buckets stepped) on the side stream
    // under "stream", so the compute stream does not wait for the collective.
    std::optional<c10::StreamGuard> guard;
    if (executor_ == Executor::kStream && on_accelerator(params_.empty() ? at::Tensor() : params_.front())) {
      std::lock_guard<std::mutex> lock(mu_);
      Side& side = side_for(params_.front().device());
      wait_for_current(side);
      guard.emplace(side.stream);
    }
    py::gil_scoped_acquire gil;
    call_owner("_poll_reducer");
  }
}

void DwRuntime::run(bool urgent_only) {
  for (;;) {
    int64_t id;
    DwItem item;
    {
      std::lock_guard<std::mutex> lock(mu_);
      id = urgent_only ? sched_.next_urgent() : sched_.pop();
      if (id < 0) return;
      auto it = items_.find(id);
      MEMSCHED_CHECK(it != items_.end(), "DwRuntime: internal: scheduler item ", id, " has no tensors");
      item = std::move(it->second);
      items_.erase(it);
    }
    Completion done;
    execute(id, item, &done);
  }
}

void DwRuntime::execute(int64_t id, DwItem& item, Completion* out) {
  Side* side = nullptr;
  if (executor_ == Executor::kStream && on_accelerator(item.grad)) {
    std::lock_guard<std::mutex> lock(mu_);
    side = &side_for(item.grad.device());
  }
  std::optional<c10::StreamGuard> guard;
  if (side != nullptr) {
    guard.emplace(side->stream);  // the wait was queued at defer()
  } else if (item.stream.has_value()) {
    guard.emplace(*item.stream);  // executor "thread": the stream its inputs were made on
  }
  std::vector<at::Tensor> grads = compute_dw(item, item.weight_idx >= 0, item.bias_idx >= 0);
  std::vector<at::Tensor> released;  // destroyed after the lock (and after hand_over)
  if (side != nullptr) {
    // Note [Streams of out-of-order backward]: x and the output gradient stay referenced until the
    // side stream is past these kernels, so autograd does not add into them in place meanwhile.
    std::lock_guard<std::mutex> lock(mu_);
    c10::Event done = side->spare.empty() ? c10::Event(side->stream.device_type()) : std::move(side->spare.back());
    if (!side->spare.empty()) side->spare.pop_back();
    done.record(side->stream);
    side->holds.push_back(Hold{std::move(done), std::move(item.x), std::move(item.grad)});
    release_holds(*side, false, &released);
  }
  item.x.reset();  // (record_stream'ed on the side stream at defer(), so a free is stream-safe too)
  item.grad.reset();
  item.weight.reset();
  {
    std::lock_guard<std::mutex> lock(mu_);
    size_t k = 0;
    if (item.weight_idx >= 0) add_pending(item.weight_idx, std::move(grads[k++]), &out->released);
    if (item.bias_idx >= 0) add_pending(item.bias_idx, std::move(grads[k++]), &out->released);
    collect(sched_.complete(id), out);
  }
  hand_over(*out, side);
}

void DwRuntime::add_pending(int32_t param, at::Tensor g, std::vector<at::Tensor>* released) {
  // Contributions are summed in arrival order, as autograd's InputBuffer does.
  at::Tensor& pend = pending_[param];
  if (!pend.defined()) {
    track(nbytes(g), 0);
    pend = std::move(g);
  } else {
    track(0, nbytes(g));
    at::NoGradGuard no_grad;
    pend.add_(g);
    released->push_back(std::move(g));
  }
}

void DwRuntime::finalize(int32_t param, std::vector<at::Tensor>* released) {
  final_[param] = 1;  // See note_backward_parameter_read
  if (watch_) watch_->mark_final(param);
  at::Tensor pend = std::move(pending_[param]);
  pending_[param] = at::Tensor();
  if (!pend.defined()) return;
  if (C10_UNLIKELY(!params_[param].requires_grad())) {
    // See Note [A parameter frozen between its forward and backward]
    track(-nbytes(pend), 0);
    released->push_back(std::move(pend));
    return;
  }
  at::Tensor& grad = params_[param].mutable_grad();
  if (pend.scalar_type() != params_[param].scalar_type()) {
    // Deferred under autocast (Note [Deferred calls under autocast] in backward.py): the sum was made in
    // the cast's dtype, as autograd's cast node sums it, and is cast to the parameter's as that node does.
    at::NoGradGuard no_grad;
    at::Tensor cast = pend.to(params_[param].scalar_type());
    track(nbytes(cast) - nbytes(pend), 0);
    released->push_back(std::move(pend));
    pend = std::move(cast);
  }
  if (!grad.defined()) {
    if (!torch::autograd::utils::obeys_layout_contract(pend, params_[param])) {
      // See Note [Deferred gradients in their parameter's layout] (dw_runtime.h)
      at::NoGradGuard no_grad;
      at::Tensor laid = torch::autograd::utils::clone_obey_contract(pend, params_[param]);
      track(0, nbytes(laid));
      released->push_back(std::move(pend));
      pend = std::move(laid);
    }
    grad = std::move(pend);
  } else {
    at::NoGradGuard no_grad;
    grad.add_(pend);
    track(-nbytes(pend), 0);
    released->push_back(std::move(pend));
  }
}

void DwRuntime::collect(const DwCompletion& done, Completion* out) {
  for (int32_t i : done.final_params) finalize(i, &out->released);
  if (!notify || !last_micro_step_) return;
  out->ready_buckets.insert(out->ready_buckets.end(), done.ready_buckets.begin(), done.ready_buckets.end());
  if (unit_of_.empty()) return;
  for (int32_t i : done.final_params) {
    const int32_t u = unit_of_[i];
    std::vector<int32_t>& ready = unit_ready_[u];
    ready.push_back(i);
    if (static_cast<int32_t>(ready.size()) >= unit_size_[u]) {
      // See Note [A parameter read after its gradient is final] (backward.py): a held unit stays
      // here, complete, until the end of backward (take_partial_units).
      if (std::any_of(ready.begin(), ready.end(), [this](int32_t j) { return held_[j] != 0; })) continue;
      out->groups.push_back(std::move(ready));
      ready = std::vector<int32_t>();
    }
  }
}

void DwRuntime::set_units(const std::vector<int32_t>& unit_of) {
  std::lock_guard<std::mutex> lock(mu_);
  MEMSCHED_CHECK(unit_of.size() == params_.size(), "DwRuntime.set_units: ", unit_of.size(),
                 " units given for ", params_.size(), " parameters");
  unit_of_ = unit_of;
  unit_size_.clear();
  for (int32_t u : unit_of_) {
    MEMSCHED_CHECK(u >= 0, "DwRuntime.set_units: every parameter needs a unit >= 0");
    if (u >= static_cast<int32_t>(unit_size_.size())) unit_size_.resize(u + 1, 0);
    unit_size_[u] += 1;
  }
  unit_ready_.assign(unit_size_.size(), {});
}

std::vector<std::vector<int32_t>> DwRuntime::take_partial_units() {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<std::vector<int32_t>> out;
  for (auto& ready : unit_ready_) {
    if (!ready.empty()) out.push_back(std::move(ready));
    ready = std::vector<int32_t>();
  }
  return out;
}

void DwRuntime::set_adam(std::vector<AdamHyper> hypers, std::vector<int32_t> group_of, std::vector<AdamSlot> slots) {
  MEMSCHED_CHECK(group_of.size() == params_.size() && slots.size() == params_.size(), "DwRuntime.set_adam: ",
                 group_of.size(), " groups and ", slots.size(), " slots given for ", params_.size(), " parameters");
  for (size_t i = 0; i < group_of.size(); ++i) {
    const int32_t g = group_of[i];
    if (g < 0) continue;
    MEMSCHED_CHECK(g < static_cast<int32_t>(hypers.size()), "DwRuntime.set_adam: parameter ", i, " has group ", g,
                   " of ", hypers.size());
    const AdamSlot& s = slots[i];
    MEMSCHED_CHECK(s.step.defined() && s.exp_avg.defined() && s.exp_avg_sq.defined() &&
                       (!hypers[g].amsgrad || s.max_exp_avg_sq.defined()),
                   "DwRuntime.set_adam: parameter ", i, " lacks optimizer state");
  }
  auto plan = std::make_shared<AdamPlan>();
  plan->hypers = std::move(hypers);
  plan->group_of = std::move(group_of);
  plan->slots = std::move(slots);
  std::shared_ptr<const AdamPlan> old;
  {
    std::lock_guard<std::mutex> lock(mu_);
    old = std::exchange(adam_, std::move(plan));
  }
}  // the old plan's tensors are released here, outside the lock

void DwRuntime::set_adam_hypers(std::vector<AdamHyper> hypers) {
  std::shared_ptr<const AdamPlan> old;
  std::lock_guard<std::mutex> lock(mu_);
  MEMSCHED_CHECK(adam_ != nullptr, "DwRuntime.set_adam_hypers: no plan was set (set_adam first)");
  MEMSCHED_CHECK(hypers.size() == adam_->hypers.size(), "DwRuntime.set_adam_hypers: ", hypers.size(),
                 " param groups given, the plan has ", adam_->hypers.size());
  for (size_t g = 0; g < hypers.size(); ++g) {
    MEMSCHED_CHECK(hypers[g].amsgrad == adam_->hypers[g].amsgrad, "DwRuntime.set_adam_hypers: group ", g,
                   " changed amsgrad; its state differs: set_adam again");
  }
  auto plan = std::make_shared<AdamPlan>(*adam_);
  plan->hypers = std::move(hypers);
  old = std::exchange(adam_, std::move(plan));
}  // the lock is released before the old plan

bool DwRuntime::has_adam() {
  std::lock_guard<std::mutex> lock(mu_);
  return adam_ != nullptr;
}

void DwRuntime::clear_adam() {
  std::shared_ptr<const AdamPlan> old;
  std::lock_guard<std::mutex> lock(mu_);
  old = std::exchange(adam_, nullptr);
}

int64_t DwRuntime::native_updates() {
  std::lock_guard<std::mutex> lock(mu_);
  return native_updates_;
}

std::vector<int32_t> DwRuntime::take_native_stepped() {
  std::lock_guard<std::mutex> lock(mu_);
  return std::exchange(native_stepped_, {});
}

int64_t DwRuntime::native_calls() {
  std::lock_guard<std::mutex> lock(mu_);
  return native_calls_;
}

std::vector<int32_t> DwRuntime::step_native(const std::vector<int32_t>& params) {
  return step_native_on(params, nullptr);
}

std::vector<int32_t> DwRuntime::step_native_on(const std::vector<int32_t>& params, Side* side) {
  std::shared_ptr<const AdamPlan> plan;
  {
    std::lock_guard<std::mutex> lock(mu_);
    plan = adam_;
  }
  if (plan == nullptr) return params;
  // Split by param group, as ParamStepper.step_params does; the rest goes to the owner (a
  // parameter without state yet, a sparse gradient torch refuses with its own message, ...).
  std::vector<int32_t> rest;
  std::vector<std::vector<int32_t>> by_group(plan->hypers.size());
  for (int32_t i : params) {
    const int32_t g = (i >= 0 && i < static_cast<int32_t>(plan->group_of.size())) ? plan->group_of[i] : -1;
    const at::Tensor& grad = params_[i].grad();
    if (g < 0 || !grad.defined() || grad.layout() != c10::kStrided) {
      rest.push_back(i);
    } else {
      by_group[g].push_back(i);
    }
  }
  std::optional<c10::StreamGuard> guard;
  if (side != nullptr) guard.emplace(side->stream);
  for (size_t g = 0; g < by_group.size(); ++g) {
    const std::vector<int32_t>& idx = by_group[g];
    if (idx.empty()) continue;
    std::vector<at::Tensor> ps, grads;
    std::vector<const AdamSlot*> slots;
    int64_t bytes = 0;
    for (int32_t i : idx) {
      ps.push_back(params_[i]);
      grads.push_back(params_[i].grad());
      slots.push_back(&plan->slots[i]);
      bytes += nbytes(grads.back());
      // The gradient is freed below, after the update queued on the current stream (the side
      // stream, or the one the owner's _poll_reducer made current under DDP) read it: a .grad made
      // on another stream (AccumulateGrad on the compute stream) is recorded here, or its block
      // would go back to that stream while the update still reads it. A no-op on its own stream.
      if (on_accelerator(grads.back())) {
        const c10::Device dev = grads.back().device();
        record_on(grads.back(), c10::impl::VirtualGuardImpl(dev.type()).getStream(dev));
      }
    }
    adam_update(plan->hypers[g], ps, grads, slots);
    grads.clear();
    for (int32_t i : idx) params_[i].mutable_grad() = at::Tensor();  // p.grad = None
    std::lock_guard<std::mutex> lock(mu_);
    track(-bytes, 0);
    native_updates_ += static_cast<int64_t>(idx.size());
    native_stepped_.insert(native_stepped_.end(), idx.begin(), idx.end());
    native_calls_ += 1;
  }
  return rest;
}

std::vector<std::vector<int32_t>> DwRuntime::batch_locked(const std::vector<std::vector<int32_t>>& groups) {
  for (const auto& group : groups) {
    for (int32_t i : group) {
      batch_.push_back(i);
      const at::Tensor& g = params_[i].grad();
      if (g.defined()) batch_grad_bytes_ += nbytes(g);
    }
  }
  std::vector<std::vector<int32_t>> out;
  if (!batch_.empty() && batch_grad_bytes_ >= update_batch_bytes_.load(std::memory_order_relaxed)) {
    out.push_back(std::exchange(batch_, {}));
    batch_grad_bytes_ = 0;
  }
  return out;
}

void DwRuntime::set_update_batch_bytes(int64_t bytes) {
  MEMSCHED_CHECK(bytes >= 0, "DwRuntime.update_batch_bytes: must be >= 0 bytes (0: no batching), got ", bytes);
  std::lock_guard<std::mutex> lock(mu_);
  MEMSCHED_CHECK(batch_.empty(), "DwRuntime.update_batch_bytes: cannot change while units wait in a batch "
                 "(during a backward pass)");
  update_batch_bytes_ = bytes;
}

int64_t DwRuntime::update_batch_bytes() { return update_batch_bytes_.load(std::memory_order_relaxed); }

void DwRuntime::hand_over(const Completion& given, Side* side, bool batch) {
  if (given.groups.empty() && given.ready_buckets.empty()) return;
  const Completion* pc = &given;
  Completion rest;
  std::vector<std::vector<int32_t>> batched;
  const std::vector<std::vector<int32_t>>* to_step = &given.groups;
  if (batch && !given.groups.empty() && update_batch_bytes_.load(std::memory_order_relaxed) > 0) {
    // (set only between backward passes: no lock to read it, so unbatched hand-overs take none)
    std::lock_guard<std::mutex> lock(mu_);
    batched = batch_locked(given.groups);
    to_step = &batched;
  }
  if (!given.groups.empty()) {
    rest.ready_buckets = given.ready_buckets;
    for (const auto& group : *to_step) {
      std::vector<int32_t> left = step_native_on(group, side);
      if (!left.empty()) rest.groups.push_back(std::move(left));
    }
    pc = &rest;
    if (rest.groups.empty() && rest.ready_buckets.empty()) return;
  }
  const Completion& c = *pc;
  py::gil_scoped_acquire gil;
  py::object owner = owner_ref_();
  if (owner.is_none()) return;
  std::optional<c10::StreamGuard> guard;
  if (side != nullptr) {
    // The fused update runs on the side stream (of the gradient's device: end_iteration makes
    // every device's current); a .grad made on the compute stream (autograd) is freed there after
    // the update.
    guard.emplace(side->stream);
    for (const auto& group : c.groups) {
      for (int32_t i : group) {
        const at::Tensor& g = params_[i].grad();
        if (on_accelerator(g)) record_on(g, c10::impl::VirtualGuardImpl(g.device().type()).getStream(g.device()));
      }
    }
  }
  py::object groups = py::cast(c.groups);
  py::object buckets = py::cast(c.ready_buckets);
  PyObject* r = PyObject_CallMethod(owner.ptr(), "_on_ready", "(OO)", groups.ptr(), buckets.ptr());
  if (r == nullptr) throw_python_error();
  Py_DECREF(r);
}

void DwRuntime::contribute(int32_t param) {
  Completion out;
  Side* side = nullptr;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (executor_ == Executor::kStream && on_accelerator(params_[param])) {
      side = &side_for(params_[param].device());
      wait_for_current(*side);  // the hook runs after the compute stream's last use of it
    }
    std::optional<c10::StreamGuard> guard;
    if (side != nullptr) guard.emplace(side->stream);
    collect(sched_.contribute(param), &out);
  }
  hand_over(out, side);
}

void DwRuntime::add_autograd_grad(int32_t param, const at::Tensor& e) {
  std::vector<at::Tensor> released;  // destroyed after the lock (See Completion)
  std::lock_guard<std::mutex> lock(mu_);
  std::optional<c10::StreamGuard> guard;
  if (executor_ == Executor::kStream && on_accelerator(e)) {
    Side& side = side_for(e.device());
    wait_for_current(side);
    record_on(e, side.stream);
    guard.emplace(side.stream);
  }
  add_pending(param, e, &released);
}

void DwRuntime::end_iteration(bool allow_missing) {
  Completion out;
  Side* side = nullptr;
  // Every device's side stream is current through finalize and hand_over: a short parameter's
  // pending sum was made on its own device's side stream (a model spread over several devices).
  std::optional<c10::MultiStreamGuard> guard;
  {
    std::lock_guard<std::mutex> lock(mu_);
    const std::vector<int32_t> short_params = sched_.end_iteration(allow_missing);
    // uses whose output never reached the loss: finish with what arrived
    DwCompletion done;
    done.final_params = short_params;  // (no bucket becomes ready here: the owner waits for them all)
    if (executor_ == Executor::kStream && !sides_.empty()) {
      side = &sides_.front().second;
      std::vector<c10::Stream> streams;
      for (auto& entry : sides_) {
        wait_for_current(entry.second);
        streams.push_back(entry.second.stream);
      }
      guard.emplace(streams);
    }
    collect(done, &out);
  }
  hand_over(out, side);
  // Note [Update batches] (backward.py): what waits in the batch is stepped before backward ends.
  Completion last;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!batch_.empty()) last.groups.push_back(std::exchange(batch_, {}));
    batch_grad_bytes_ = 0;
  }
  hand_over(last, side, false);
}

void DwRuntime::sync_streams() {
  std::vector<at::Tensor> released;  // destroyed after the lock
  std::lock_guard<std::mutex> lock(mu_);
  for (auto& [device, side] : sides_) {
    c10::impl::VirtualGuardImpl impl(device.type());
    const c10::Stream compute = impl.getStream(device);
    side.to_compute.record(side.stream);
    side.to_compute.block(compute);
    for (const at::Tensor& p : params_) {
      if (p.device() == device) record_on(p.grad(), compute);  // made on the side stream, used here
    }
    // backward is over (no InputBuffer can add into them) and the compute stream now waits for the
    // side stream; the blocks were record_stream'ed on it
    release_holds(side, true, &released);
  }
  for (const c10::Stream& s : item_streams_) {
    // executor "thread" (drained before this): the caller's stream waits for the items' streams
    c10::impl::VirtualGuardImpl impl(s.device_type());
    const c10::Stream current = impl.getStream(s.device());
    if (current == s) continue;
    c10::Event done(s.device_type());
    done.record(s);
    done.block(current);
  }
  item_streams_.clear();
}

void DwRuntime::new_scheduler() {
  DwScheduler fresh(max_deferred_bytes_);
  for (size_t i = 0; i < params_.size(); ++i) fresh.add_param(nbytes(params_[i]), buckets_[i]);
  sched_ = std::move(fresh);
}

void DwRuntime::abandon() {
  std::unordered_map<int64_t, DwItem> items;
  std::vector<at::Tensor> pending;
  std::vector<at::Tensor> held;
  std::shared_ptr<const AdamPlan> plan;
  {
    std::unique_lock<std::mutex> lock(mu_);
    if (executor_ == Executor::kThread) idle_.wait(lock, [this] { return !worker_busy_; });
    for (auto& entry : sides_) release_holds(entry.second, true, &held);  // record_stream'ed on the side
    item_streams_.clear();
    items.swap(items_);
    pending.swap(pending_);
    pending_.resize(params_.size());
    for (size_t i = 0; i < params_.size(); ++i) {
      if (seen_[i].mixed) params_[i].mutable_grad() = std::move(stash_[i]);  // the parked .grad comes back
      stash_[i] = at::Tensor();
      seen_[i] = AutogradSeen{};
    }
    for (auto& ready : unit_ready_) ready.clear();  // final but not stepped: they keep .grad and old values
    batch_.clear();  // the same
    batch_grad_bytes_ = 0;
    plan.swap(adam_);
    new_scheduler();
    backward_started = false;
  }
  // tensors are released here, outside the lock
}

void DwRuntime::drain() {
  std::unique_lock<std::mutex> lock(mu_);
  idle_.wait(lock, [this] { return (items_.empty() && !worker_busy_) || worker_error_ != nullptr || stop_; });
  if (worker_error_ != nullptr) {
    std::exception_ptr e = worker_error_;
    worker_error_ = nullptr;
    std::rethrow_exception(e);
  }
}

void DwRuntime::call_owner(const char* method) {
  py::object owner = owner_ref_();
  if (owner.is_none()) return;
  PyObject* r = PyObject_CallMethod(owner.ptr(), method, nullptr);
  if (r == nullptr) throw_python_error();
  Py_DECREF(r);
}

void DwRuntime::expect_hook(int32_t param) {
  // See Note [AccumulateGrad gate]: one contribution per parameter for its AccumulateGrad node.
  if (!hook_expected_[param]) {
    hook_expected_[param] = 1;
    sched_.expect_contribution(param);
  }
}

int32_t DwRuntime::note_deferred_use(int32_t weight_idx, int32_t bias_idx) {
  // A use during backward is legal: activation checkpointing recomputes forward there. A
  // recomputed use whose backward never runs is finished at the flush (end_iteration).
  std::lock_guard<std::mutex> lock(mu_);
  for (int32_t i : {weight_idx, bias_idx}) {
    if (i < 0) continue;
    if (phase == 2 && sched_.received(i) > 0) return i;
    sched_.expect_contribution(i);
    expect_hook(i);
    deferred_used_[i] = 1;
  }
  return -1;
}

int32_t DwRuntime::note_autograd_use(const std::vector<int32_t>& params) {
  std::lock_guard<std::mutex> lock(mu_);
  for (int32_t i : params) {
    if (autograd_expected_[i]) continue;
    if (phase == 2 && sched_.received(i) > 0) return i;
    autograd_expected_[i] = 1;
    expect_hook(i);
  }
  return -1;
}

void DwRuntime::on_autograd_grad(int32_t i, const at::Tensor& grad) {
  // Tensor hook: runs before AccumulateGrad with the summed gradient of all autograd uses;
  // undefined when every use was deferred (the Functions return none). A mixed parameter (a
  // deferred use and autograd uses, e.g. a tied embedding) has its accumulated .grad parked so
  // AccumulateGrad stores this gradient alone; on_autograd_accumulated moves it into the
  // pending sum and restores .grad: the sum is then G + (h + e), autograd's order.
  bool captured = false;
  engine_runs(accumulator(i), &captured);
  if (captured) return;  // torch.autograd.grad() asking for this parameter: plain, .grad untouched
  if (phase == 0) {
    // A forward that called no module owning a parameter (ParameterList entries read directly)
    // counted no use and so never began the iteration: begin it now -- unless no forward ran since
    // the last iteration ended, which the owner refuses before any gradient changed.
    call_owner("_begin_at_gradient");
  }
  at::Tensor& g = params_[i].mutable_grad();
  bool hook_gate = false;
  if (!backward_started) {
    // the owner's checks run before this pass changes any gradient (also when none arrives here)
    call_owner("_backward_started");
    backward_started = true;
  }
  // See Note [A parameter frozen between its forward and backward]: its AccumulateGrad will drop this
  // gradient and run no post-accumulate hook, so nothing is parked and its contribution is counted here.
  const bool frozen = grad.defined() && !params_[i].requires_grad();
  {
    std::lock_guard<std::mutex> lock(mu_);
    const bool mixed = grad.defined() && !frozen && autograd_expected_[i] && sched_.expected(i) > 1;
    seen_[i] = frozen ? AutogradSeen{} : AutogradSeen{true, grad.defined(), !g.defined(), mixed};
    if (mixed) {
      stash_[i] = std::move(g);
      g = at::Tensor();
    }
    if ((!grad.defined() || frozen) && hook_expected_[i]) {
      // No gradient through autograd: every use of this graph task was deferred (or reached no
      // loss). Its AccumulateGrad ran, so no uncounted use can still add to it: the gate opens.
      hook_expected_[i] = 0;
      hook_gate = true;
    }
  }
  if (grad.defined() && !frozen) return;
  if (hook_gate) {
    contribute(i);
    if (executor_ == Executor::kInline) {
      run(true);
      if (poll_after_defer) call_owner("_poll_reducer");
    }
  }
}

void DwRuntime::on_autograd_accumulated(int32_t i) {
  AutogradSeen seen;
  {
    std::lock_guard<std::mutex> lock(mu_);
    seen = seen_[i];
    seen_[i] = AutogradSeen{};
  }
  if (!seen.valid || !seen.defined) return;
  bool refuse = false;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!autograd_expected_[i]) {
      // No use of it was counted this iteration (MultiheadAttention reads out_proj.weight
      // functionally, never calling out_proj): no deferred contribution exists, so this gradient
      // is all of it -- count it now. A deferred use counted later is refused as a late use.
      if (phase == 0 || sched_.expected(i) > 0) {
        refuse = true;
      } else {
        autograd_expected_[i] = 1;
        expect_hook(i);
      }
    }
    if (!refuse) hook_expected_[i] = 0;
  }
  if (refuse) {
    py::object owner = owner_ref_();
    if (owner.is_none()) return;
    PyObject* r = PyObject_CallMethod(owner.ptr(), "_refuse_uncounted", "(i)", static_cast<int>(i));
    if (r == nullptr) throw_python_error();
    Py_DECREF(r);
    return;
  }
  at::Tensor& g = params_[i].mutable_grad();
  if (seen.mixed) {
    at::Tensor e = std::move(g);
    {
      std::lock_guard<std::mutex> lock(mu_);
      g = std::move(stash_[i]);
      stash_[i] = at::Tensor();
    }
    add_autograd_grad(i, e);  // pending += e (on the side stream under "stream")
  } else if (seen.had_none) {
    track_locked(nbytes(g), 0);
  }
  contribute(i);
}

namespace {

Py_ssize_t hooks_in(const py::object& dict) {
  if (!dict || dict.is_none()) return 0;
  const Py_ssize_t n = PyDict_Check(dict.ptr()) ? PyDict_Size(dict.ptr()) : PyObject_Size(dict.ptr());
  if (n < 0) PyErr_Clear();
  return n;
}

}  // namespace

void DwRuntime::set_hook_dicts(int32_t param, py::object tensor_hooks, py::object post_hooks,
                               py::object own_post_key) {
  MEMSCHED_CHECK(param >= 0 && param < static_cast<int32_t>(hook_dicts_.size()), "DwRuntime.set_hook_dicts: ",
                 "parameter ", param, " is not registered");
  hook_dicts_[param] = HookDicts{std::move(tensor_hooks), std::move(post_hooks), std::move(own_post_key)};
}

bool DwRuntime::user_hooked(int32_t param) const {
  const HookDicts& d = hook_dicts_[static_cast<size_t>(param)];
  return hooks_in(d.tensor_hooks) > 1 || hooks_in(d.post_hooks) > 1;
}

void DwRuntime::set_iteration_dicts(py::object kind, py::object cast_uses) {
  MEMSCHED_CHECK(PyDict_Check(kind.ptr()) && PyDict_Check(cast_uses.ptr()),
                 "DwRuntime.set_iteration_dicts: kind and cast_uses must be dicts");
  kind_ = std::move(kind);
  cast_uses_ = std::move(cast_uses);
}

void DwRuntime::set_cast_state(py::object region, py::object eligible, py::object mixed) {
  MEMSCHED_CHECK(PyDict_Check(region.ptr()) && PySet_Check(eligible.ptr()) && !mixed.is_none(),
                 "DwRuntime.set_cast_state: region must be a dict, eligible a set and mixed an object");
  cast_region_ = std::move(region);
  cast_eligible_ = std::move(eligible);
  cast_mixed_ = std::move(mixed);
}

void DwRuntime::set_graph(py::object graph, py::object graph_ref) {
  graph_ = graph.is_none() ? py::object() : std::move(graph);
  graph_ref_ = graph_ref.is_none() ? py::object() : std::move(graph_ref);
}

py::object DwRuntime::graph_token() {
  if (graph_) {
    py::object g = std::move(graph_);
    graph_ = py::object();
    return g;
  }
  if (graph_ref_) return graph_ref_();
  return py::none();
}

int32_t DwRuntime::first_hooked_deferred() {
  std::vector<char> used;
  {
    std::lock_guard<std::mutex> lock(mu_);
    used = deferred_used_;
  }
  for (size_t i = 0; i < used.size(); ++i) {
    if (used[i] && (hooks_in(hook_dicts_[i].tensor_hooks) > 1 || hooks_in(hook_dicts_[i].post_hooks) > 1)) {
      return static_cast<int32_t>(i);
    }
  }
  return -1;
}

void DwRuntime::post_hooks_last() {
  // torch calls post-accumulate-grad hooks in dict order (PyDict_Next): memsched's, which may step
  // the parameter and free its gradient, goes last.
  for (HookDicts& d : hook_dicts_) {
    if (hooks_in(d.post_hooks) < 2 || !PyDict_Check(d.post_hooks.ptr())) continue;
    PyObject* dict = d.post_hooks.ptr();
    Py_ssize_t pos = 0;
    PyObject *key = nullptr, *value = nullptr, *last = nullptr;
    while (PyDict_Next(dict, &pos, &key, &value)) last = key;
    const int same = last == nullptr ? 1 : PyObject_RichCompareBool(last, d.own_post_key.ptr(), Py_EQ);
    if (same < 0) throw py::error_already_set();
    if (same) continue;
    py::object hook = d.post_hooks.attr("pop")(d.own_post_key);
    d.post_hooks[d.own_post_key] = hook;
  }
}

namespace {

constexpr const char* kHookCapsule = "memsched.DwRuntimeHook";

struct HookTarget {
  std::weak_ptr<DwRuntime> rt;
  int32_t param;
};

PyObject* hook_call(PyObject* capsule, PyObject* arg, bool accumulated) {
  auto* target = static_cast<HookTarget*>(PyCapsule_GetPointer(capsule, kHookCapsule));
  if (target == nullptr) return nullptr;
  std::shared_ptr<DwRuntime> rt = target->rt.lock();
  if (rt == nullptr || !rt->installed) Py_RETURN_NONE;
  try {
    if (accumulated) {
      rt->on_autograd_accumulated(target->param);
    } else if (arg == Py_None) {
      rt->on_autograd_grad(target->param, at::Tensor());
    } else {
      rt->on_autograd_grad(target->param, THPVariable_Unpack(arg));
    }
  } catch (python_error& e) {
    e.restore();
    return nullptr;
  } catch (py::error_already_set& e) {
    e.restore();
    return nullptr;
  } catch (const std::exception& e) {
    PyErr_SetString(PyExc_RuntimeError, e.what());
    return nullptr;
  }
  Py_RETURN_NONE;
}

PyObject* grad_hook_entry(PyObject* capsule, PyObject* grad) { return hook_call(capsule, grad, false); }
PyObject* accumulated_hook_entry(PyObject* capsule, PyObject* param) { return hook_call(capsule, param, true); }

PyMethodDef grad_hook_def{"memsched_ooo_grad_hook", grad_hook_entry, METH_O,
                          "memsched's AccumulateGrad gate (See Note [dW runtime in C++])."};
PyMethodDef accumulated_hook_def{"memsched_ooo_accumulated_hook", accumulated_hook_entry, METH_O,
                                 "memsched's post-accumulate-grad hook (See Note [dW runtime in C++])."};

py::object make_hook(PyMethodDef* def, const std::shared_ptr<DwRuntime>& rt, int32_t param) {
  return capsule_function(def, kHookCapsule, new HookTarget{rt, param});
}

}  // namespace

py::object DwRuntime::grad_hook(int32_t param) { return make_hook(&grad_hook_def, shared_from_this(), param); }

py::object DwRuntime::accumulated_hook(int32_t param) {
  return make_hook(&accumulated_hook_def, shared_from_this(), param);
}

void DwRuntime::worker_loop() {
  std::unique_lock<std::mutex> lock(mu_);
  for (;;) {
    wake_.wait(lock, [this] { return stop_ || !items_.empty(); });
    if (stop_) return;
    const int64_t id = sched_.pop();
    if (id < 0) continue;
    auto it = items_.find(id);
    DwItem item = std::move(it->second);
    items_.erase(it);
    worker_busy_ = true;
    lock.unlock();
    try {
      // See Note [The worker's intra-op threads]; only on a change: at::set_num_threads also clears
      // oneDNN's primitive cache
      if (item.intra_op_threads > 0 && at::get_num_threads() != item.intra_op_threads) {
        at::set_num_threads(item.intra_op_threads);
      }
      Completion done;
      execute(id, item, &done);
    } catch (...) {
      item = DwItem();  // its tensors released before the lock (See Completion)
      lock.lock();
      worker_error_ = std::current_exception();
      worker_busy_ = false;
      idle_.notify_all();
      continue;
    }
    lock.lock();
    worker_busy_ = false;
    if (items_.empty()) idle_.notify_all();
  }
}

}  // namespace memsched
