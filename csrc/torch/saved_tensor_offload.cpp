// saved_tensor_offload.cpp -- the offloaded saves of SavedTensorPath (saved_tensor_path.h): their
// host copies, what autograd stores for them, prefetch and unpack, all in C++.
//
// Note [Offloaded saves in C++]
//   Rationale: a save the plan offloads used to go to Python: a handle object, a weak reference to
//   the packed tensor, a view object with the geometry, a storage weak reference per fetch, a
//   Python loop per prefetch trigger. On a small decoder that cost 70-115 us of host time per
//   offloaded storage (bench_offload_overhead.py), Python's cyclic GC was 8% of the step, and on an
//   H100 the forward was host-bound.
//   Approach: the rules are those of Note [What is never offloaded] and Note [Version checks]
//   (executor.py), implemented here. An OffloadHandle is one host copy of one storage through one
//   version counter; autograd stores an OffloadedSave (a Python object that refers to no Python
//   object, so the GC never tracks it) holding the handle and the view's geometry. The handle
//   holds the saved tensor's version counter itself (not its storage): an in-place change made
//   through any alias before backward is seen at unpack, as plain PyTorch sees it -- the Python
//   handle could only watch the packed tensor's Python object while that lived. Prefetches fire
//   from a trigger table (op -> ordinals) on the engine's C++ streams; unpack waits for the
//   prefetch or fetches on demand and rebuilds the view on the fetched bytes, with its lazy
//   conjugate and negative bits: a later save through the same counter (`z.conj() * z` saves z and
//   z.conj()) shares the first's copy, and without its bit came back as z (gradients 0.15 off plain,
//   found by a helper's random programs); a first save with a bit is offloaded too (it was kept, 25%
//   over a plan that counted it off the device). The ops made here
//   (the flat byte views, the fetched tensor) exclude the Python dispatch keys, so a caller's
//   TorchDispatchMode (the recompute plan's op log) does not see them, as the Python path paused
//   the log. Python keeps only the recomputed saves (recompute.py).
//   Limitations: an offloaded save still costs PyTorch's own hook call (a Python call into a C
//   function) at pack and at unpack.
#include "torch/saved_tensor_path.h"

#include <chrono>
#include <optional>

#include <ATen/core/LegacyTypeDispatch.h>
#include <c10/core/impl/VirtualGuardImpl.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/autograd/graph_task.h>
#include <torch/csrc/autograd/python_variable.h>

#include "core/check.h"
#include "torch/device_memory.h"
#include "torch/tensor_adapter.h"

namespace py = pybind11;

namespace memsched {

// Every handle of one step refers to its StepGraph; autograd's graph owns the handles, so the
// StepGraph dies with the step's graph. Dying outside backward means the step raised (or its graph
// was dropped unused): copies still in flight hold its memory, so the engine waits and releases.
struct StepGraph {
  std::weak_ptr<SavedTensorPath> path;
  uint64_t generation;
  ~StepGraph() {
    if (auto p = path.lock()) p->graph_gone(generation);
  }
};

struct OffloadHandle {
  int64_t ordinal = -1;
  int64_t nbytes = 0;
  uint32_t version = 0;             // the saved tensor's version when copied
  uintptr_t counter_key = 0;        // version_counter_key of the tensor copied
  c10::VariableVersion counter;     // that counter (not the storage); disabled until set
  std::shared_ptr<CopyTicket> d2h;  // the host copy; null until issued
  std::shared_ptr<CopyTicket> h2d;  // the prefetch in flight, null until issued
  at::Tensor device_bytes;          // flat uint8 device copy once fetched, until the last unpack
  int64_t packs = 0;                // saves referring to this copy
  int64_t unpacks = 0;
  c10::weak_intrusive_ptr<c10::StorageImpl> source{c10::intrusive_ptr<c10::StorageImpl>()};  // the original
  std::string label;                // for errors
  // Copies of the same storage taken for saves through other version counters (first copy only).
  std::unordered_map<uintptr_t, std::shared_ptr<OffloadHandle>> others;
  std::shared_ptr<StepGraph> step;
  // Accelerator only (Note [A fetched copy read on other streams]): the stream current when the
  // device copy was allocated, the one that waited for it, and the event it is ready at.
  std::optional<c10::Stream> fetched_on;
  std::optional<c10::Stream> waited_on;
  PooledEvent ready;
};

namespace {

// Ops made by the executor itself are not the model's: a caller's dispatch mode must not see them,
// and they run below autograd, so they carry no sequence number and the next-op callback (Note
// [Copies issued at the next op]) does not take them for the model's next op.
struct HiddenFromModes {
  at::AutoDispatchBelowADInplaceOrView below_autograd;
  c10::impl::ExcludeDispatchKeyGuard guard{
      c10::DispatchKeySet({c10::DispatchKey::Python, c10::DispatchKey::PythonTLSSnapshot})};
};

c10::Stream current_stream(const c10::Device& device) {
  c10::impl::VirtualGuardImpl impl(device.type());
  return impl.getStream(device);
}

struct OffloadedSave {
  PyObject_HEAD
  std::shared_ptr<OffloadHandle> handle;
  std::shared_ptr<SavedTensorPath> path;  // a retained graph may be unpacked after the Run ended
  at::ScalarType dtype;
  std::vector<int64_t> sizes;
  std::vector<int64_t> strides;
  int64_t offset;
  bool conj;  // the save's lazy conjugate and negative bits (z.conj(), z.conj().imag): a later save of
  bool neg;   // an offloaded storage through its counter may be such a view (See Note [Offloaded saves in C++])
};

void offloaded_dealloc(PyObject* self) {
  auto* save = reinterpret_cast<OffloadedSave*>(self);
  save->handle.~shared_ptr();
  save->path.~shared_ptr();
  save->sizes.~vector();
  save->strides.~vector();
  Py_TYPE(self)->tp_free(self);
}

PyTypeObject offloaded_type = saved_object_type(
    "memsched._C.OffloadedSave", sizeof(OffloadedSave), offloaded_dealloc,
    "A saved tensor memsched copied to host memory (See Note [Offloaded saves in C++]).");

PyObject* make_offloaded(std::shared_ptr<OffloadHandle> handle, std::shared_ptr<SavedTensorPath> path,
                         const at::Tensor& t) {
  auto* save = PyObject_New(OffloadedSave, &offloaded_type);
  if (save == nullptr) return nullptr;
  new (&save->handle) std::shared_ptr<OffloadHandle>(std::move(handle));
  new (&save->path) std::shared_ptr<SavedTensorPath>(std::move(path));
  new (&save->sizes) std::vector<int64_t>(t.sizes().begin(), t.sizes().end());
  new (&save->strides) std::vector<int64_t>(t.strides().begin(), t.strides().end());
  save->dtype = t.scalar_type();
  save->offset = t.storage_offset();
  save->conj = t.is_conj();
  save->neg = t.is_neg();
  return reinterpret_cast<PyObject*>(save);
}

at::Tensor flat_bytes(const at::Tensor& t, int64_t nbytes) {
  HiddenFromModes hidden;
  return at::empty({0}, t.options().dtype(at::kByte)).set_(t.storage(), 0, {nbytes}, {1});
}

}  // namespace

bool is_offloaded_save(PyObject* obj) { return Py_IS_TYPE(obj, &offloaded_type); }

void prepare_offloaded_type(py::module_& m) {
  if (PyType_Ready(&offloaded_type) < 0) throw py::error_already_set();
  Py_INCREF(&offloaded_type);
  m.attr("OffloadedSave") = py::handle(reinterpret_cast<PyObject*>(&offloaded_type));
}

void SavedTensorPath::set_prefetches(const py::dict& prefetch_at) {
  prefetch_at_.clear();
  for (auto item : prefetch_at) {
    auto& ordinals = prefetch_at_[item.first.cast<int64_t>()];
    for (auto k : py::reinterpret_borrow<py::iterable>(item.second)) ordinals.push_back(k.cast<int64_t>());
  }
}

void SavedTensorPath::set_recompute(const py::iterable& ordinals) {
  recompute_.clear();
  for (auto item : ordinals) {
    const int64_t k = item.cast<int64_t>();
    MEMSCHED_CHECK(k >= 0 && k < (int64_t{1} << 40), "SavedTensorPath.set_recompute: ordinal ", k, " out of range");
    if (static_cast<int64_t>(recompute_.size()) <= k) recompute_.resize(static_cast<size_t>(k) + 1, 0);
    recompute_[static_cast<size_t>(k)] = 1;
  }
}

// Note [Memory guard]
//   Rationale: a plan's memory holds only if offloaded blocks go back to the allocator when the
//   plan says; on a GPU the host runs ahead of the device and sees D2H copies finish late (Note
//   [Releases in stream order] in copy_engine.h), and memory the trace does not model (workspaces,
//   the autocast cache, rounding) takes room the plan counted on. A budget is a promise: the step
//   must not silently go over it.
//   Approach: while D2H copies are in flight, the first save of each activation (after its op has
//   allocated) reads the device allocator's count of allocated bytes -- a host-side counter, no
//   synchronisation -- and adds the headroom the trace gives that ordinal: how far memory grows
//   between it and the next activation's producer (offload/guard.py). In backward the same check
//   runs before every fetch (prefetch or on demand) with the fetched bytes as headroom: copies the
//   forward did not need to release still hold their blocks there while gradients and fetched
//   copies accumulate. Above the budget, the oldest copies in flight are released in stream order
//   until the excess is covered: the compute stream waits for them, their blocks are free for the
//   next allocation (a fetch's H2D copy waits for its own D2H copy anyway). Each such wait
//   is counted (guard_waits, guard_releases, guard_released_bytes in offload_counters) and timed
//   as a stall; run.report() shows them. With memsched's allocator installed its count comes from
//   the shim (memsched_allocated_bytes), since torch's pluggable allocator keeps no statistics.
//   Limitations: the guard can only release copies in flight; memory over the budget that no copy
//   holds (a plan whose trace misses what the device allocates) is reported, not prevented.
void SavedTensorPath::set_memory_guard(int64_t budget_bytes, std::vector<int64_t> headroom, uintptr_t allocated_fn) {
  MEMSCHED_CHECK(!is_cpu_, "SavedTensorPath.set_memory_guard: the memory guard is for accelerators (on CPU "
                 "copies complete at once and hold nothing)");
  MEMSCHED_CHECK(budget_bytes > 0, "SavedTensorPath.set_memory_guard: budget_bytes must be positive, got ",
                 budget_bytes);
  for (const int64_t h : headroom) {
    MEMSCHED_CHECK(h >= 0, "SavedTensorPath.set_memory_guard: headroom bytes must be >= 0, got ", h);
  }
  guard_budget_ = budget_bytes;
  guard_headroom_ = std::move(headroom);
  allocated_fn_ = reinterpret_cast<int64_t (*)(int)>(allocated_fn);
}

void SavedTensorPath::clear_memory_guard() {
  guard_budget_ = 0;
  guard_headroom_.clear();
  allocated_fn_ = nullptr;
}

int64_t SavedTensorPath::allocated_bytes() const {
  MEMSCHED_CHECK(!is_cpu_, "SavedTensorPath.allocated_bytes: a CPU path counts saved storages, not the allocator");
  if (allocated_fn_ != nullptr) return allocated_fn_(device_.has_index() ? device_.index() : 0);
  return device_allocated_bytes(device_);
}

void SavedTensorPath::guard_memory(int64_t k) {
  guard_for(k < static_cast<int64_t>(guard_headroom_.size()) ? guard_headroom_[static_cast<size_t>(k)] : 0);
}

void SavedTensorPath::guard_for(int64_t headroom) {
  // See Note [Memory guard].
  if (engine_ == nullptr || engine_->pending_count() == 0) return;
  int64_t allocated = 0;
  try {
    allocated = allocated_bytes();
  } catch (const std::exception& e) {
    // An allocator that keeps no statistics (another pluggable allocator): the step goes on unguarded.
    guard_error = e.what();
    clear_memory_guard();
    return;
  }
  if (allocated > counters.sampled_peak_bytes) {  // Note [Where the peak went]: two integers, no sync
    counters.sampled_peak_bytes = allocated;
    counters.in_flight_at_sampled_peak = engine_->held_source_bytes();
  }
  const int64_t over = allocated + headroom - guard_budget_;
  if (over <= 0) return;
  const auto [copies, bytes] = engine_->release_in_stream_order(over);
  if (copies == 0) return;
  ++counters.guard_waits;
  counters.guard_releases += copies;
  counters.guard_released_bytes += bytes;
}

void SavedTensorPath::reset_offloads() {
  offloaded_.clear();
  dropped_.clear();
  queued_.clear();
  fetched_.clear();
  graph_.reset();
  counters = OffloadCounters{};
}

bool SavedTensorPath::offloadable(PyObject* obj, const at::Tensor& t, int64_t nbytes) {
  // See Note [What is never offloaded] (executor.py).
  if (!(nbytes >= min_bytes && nbytes > 0 && t.device() == device_ && t.layout() == at::kStrided &&
        Py_TYPE(obj) == reinterpret_cast<PyTypeObject*>(THPVariableClass) && !t.is_quantized() &&
        t.unsafeGetTensorImpl()->version_counter().enabled())) {
    return false;
  }
  if (engine_ == nullptr) return false;
  if (!engine_->has_room(nbytes)) {
    ++counters.host_limited;  // See Note [Host memory limit] (host_buffers.py)
    return false;
  }
  return true;
}

std::shared_ptr<OffloadHandle> SavedTensorPath::copy(int64_t k, const at::Tensor& t, int64_t nbytes) {
  // A host copy of t's whole storage, queued until its op has run (Note [Copy after the op]).
  std::shared_ptr<StepGraph> graph = graph_.lock();
  if (graph == nullptr) {
    graph = std::make_shared<StepGraph>();
    graph->path = weak_from_this();
    graph->generation = generation_;
    graph_ = graph;
  }
  auto h = std::make_shared<OffloadHandle>();
  h->ordinal = k;
  h->nbytes = nbytes;
  h->version = t._version();
  h->counter_key = version_counter_key(t);
  h->counter = t.unsafeGetTensorImpl()->version_counter();
  h->source = t.storage().getWeakStorageImpl();
  h->step = std::move(graph);
  queued_.emplace_back(h, flat_bytes(t, nbytes));
  queued_op = at::sequence_number::peek();  // See Note [Copy after the op]
  set_has_queued(true);
  ++counters.offloaded;
  counters.offloaded_bytes += nbytes;
  return h;
}

std::shared_ptr<OffloadHandle> SavedTensorPath::offload(int64_t k, const at::Tensor& t, int64_t nbytes) {
  std::shared_ptr<OffloadHandle> h = copy(k, t, nbytes);
  offloaded_[k] = h;  // weak: the packed save holds h
  dropped_.insert(k);
  return h;
}

std::shared_ptr<OffloadHandle> SavedTensorPath::copy_for(PyObject* obj, const std::shared_ptr<OffloadHandle>& first,
                                                         const at::Tensor& t) {
  // See Note [What is never offloaded]: a copy serves saves through the version counter it was
  // taken from; a save through another counter gets a copy of its own, taken now (null: kept).
  const uintptr_t counter = version_counter_key(t);
  if (counter == 0) return nullptr;
  if (counter == first->counter_key) return first;
  auto hit = first->others.find(counter);
  if (hit != first->others.end()) return hit->second;
  if (!offloadable(obj, t, first->nbytes)) return nullptr;
  std::shared_ptr<OffloadHandle> other = copy(first->ordinal, t, first->nbytes);
  first->others.emplace(counter, other);
  return other;
}

PyObject* SavedTensorPath::pack_offloaded(PyObject* obj, const at::Tensor& t, int64_t k, bool may_offload,
                                          int64_t nbytes, uintptr_t key) {
  std::shared_ptr<OffloadHandle> h;
  if (may_offload && offloadable(obj, t, nbytes)) h = offload(k, t, nbytes);
  if (h == nullptr) {
    auto hit = offloaded_.find(k);
    h = hit != offloaded_.end() ? hit->second.lock() : nullptr;
    if (h == nullptr && dropped_.count(k) != 0 && !diverged && key != 0) {
      // Offloaded earlier in this step, and every save of it has died since (a first micro-batch's
      // graph): saved again, it is copied again.
      const auto whole = static_cast<int64_t>(t.storage().nbytes());
      if (offloadable(obj, t, whole)) h = offload(k, t, whole);
    } else if (h != nullptr) {
      h = copy_for(obj, h, t);
    }
  }
  if (h != nullptr && t._version() == h->version) {
    ++h->packs;
    if (h->label.empty()) h->label = numbering_.label(k);
    return make_offloaded(h, shared_from_this(), t);
  }
  // Kept (See Notes [Packing without reference cycles], [Version checks] in executor.py).
  return kept_alias(k, t);
}

PyObject* SavedTensorPath::pack_fetched(const at::Tensor& t) {
  // A fetched copy saved again (a reentrant checkpoint's recompute): the profiled step saw the
  // original storage here, so this is a re-pack of the same ordinal, kept on the device.
  const StorageRef ref = storage_ref(t);
  auto hit = fetched_.find(ref.key);
  if (ref.key == 0 || hit == fetched_.end() || hit->second.storage.expired()) return nullptr;
  return kept_alias(hit->second.ordinal, t);
}

void SavedTensorPath::issue_copies() {
  if (queued_.empty()) {
    set_has_queued(false);
    return;
  }
  if (!fail_next_issue.empty()) {
    const std::string message = std::move(fail_next_issue);
    fail_next_issue.clear();
    queued_.clear();
    set_has_queued(false);
    MEMSCHED_CHECK(false, message);
  }
  auto queued = std::move(queued_);
  queued_.clear();
  set_has_queued(false);
  std::vector<at::Tensor> flats;
  flats.reserve(queued.size());
  for (auto& q : queued) flats.push_back(std::move(q.second));
  std::vector<std::shared_ptr<CopyTicket>> tickets;
  {
    HiddenFromModes hidden;
    // Copies on the compute stream (offload_all_sync) read their sources in stream order: the blocks
    // may go back to the allocator at once, as save_on_cpu's do (Note [Offload copy ordering]).
    tickets = engine_->offload_many(flats, /*hold=*/!engine_->on_compute_stream);
  }
  for (size_t i = 0; i < queued.size(); ++i) queued[i].first->d2h = std::move(tickets[i]);
  need_poll = engine_->pending_count() > 0;
}

void SavedTensorPath::fire(int64_t op, int64_t fired_upto_before) {
  // Every prefetch whose trigger lies in (fired_upto_before, op], in trigger order.
  auto lo = std::upper_bound(triggers_.begin(), triggers_.end(), fired_upto_before);
  auto hi = std::upper_bound(triggers_.begin(), triggers_.end(), op);
  if (lo == hi) return;
  if (!queued_.empty()) issue_copies();  // a prefetch reads what its D2H copy wrote
  HiddenFromModes hidden;
  for (auto q = lo; q != hi; ++q) {
    auto at = prefetch_at_.find(*q);
    if (at == prefetch_at_.end()) continue;
    for (const int64_t j : at->second) {
      auto hit = offloaded_.find(j);
      std::shared_ptr<OffloadHandle> first = hit != offloaded_.end() ? hit->second.lock() : nullptr;
      if (first == nullptr) continue;
      auto fetch = [&](OffloadHandle& h) {
        if (h.h2d != nullptr || h.device_bytes.defined() || h.d2h == nullptr) return;
        if (guard_budget_ > 0) guard_for(h.nbytes);  // See Note [Memory guard]: before it allocates
        h.h2d = engine_->fetch(h.d2h->dst, h.d2h);
        if (engine_->is_accelerator()) h.fetched_on = current_stream(h.h2d->dst.device());
        track(h.h2d->dst);
        ++counters.prefetched;
      };
      fetch(*first);
      for (auto& other : first->others) fetch(*other.second);
    }
  }
  need_poll = engine_->pending_count() > 0;
}

void SavedTensorPath::materialize(OffloadHandle& h) {
  // Make h's bytes available on the compute stream: wait for its prefetch, or fetch now. On CUDA
  // the compute stream waits on the copy's event (the host never blocks; the engine times the
  // stall); on CPU an on-demand fetch is a synchronous copy and its duration is the stall.
  std::shared_ptr<CopyTicket> ticket;
  if (h.h2d != nullptr) {
    ticket = std::move(h.h2d);
    h.h2d = nullptr;
    if (!ticket->is_complete()) ++counters.late_prefetches;
  } else {
    MEMSCHED_CHECK(h.d2h != nullptr, "memsched: the host copy of saved activation ", h.label,
                   " was never issued (its step was abandoned)");
    const auto start = std::chrono::steady_clock::now();
    if (guard_budget_ > 0) guard_for(h.nbytes);  // See Note [Memory guard]: before it allocates
    {
      HiddenFromModes hidden;
      ticket = engine_->fetch(h.d2h->dst, h.d2h);
    }
    if (engine_->is_accelerator()) h.fetched_on = current_stream(ticket->dst.device());
    track(ticket->dst);
    ++counters.on_demand;
    need_poll = engine_->pending_count() > 0;
    if (!engine_->is_accelerator()) {
      counters.stall_s += std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    }
  }
  engine_->wait(*ticket);
  h.device_bytes = ticket->dst;
  if (engine_->is_accelerator()) {
    h.waited_on = current_stream(h.device_bytes.device());
    h.ready = ticket->done;
  }
}

// Note [A fetched copy read on other streams]
//   Rationale: the autograd engine runs each backward node on the stream its forward op ran on, so
//   with a forward that used side streams the saves of one fetched copy may be unpacked on several
//   streams, and a prefetch fires on its trigger node's stream, which need not be the consumer's.
//   engine_->wait makes only the first unpack's stream wait for the H2D copy, and the caching
//   allocator returns a block to the pool of the stream that allocated it, free to reuse there once
//   the last tensor on it dies: a read on another stream could see the bytes before the copy landed,
//   or the block could be handed out again while it still reads them.
//   Approach: an unpack on a stream other than the one that waited waits for the copy's event too, and
//   one on a stream other than the allocating one records the block on it (record_stream), as
//   Note [Replayed values and streams] (recompute.py) does for a replayed value. On one stream this
//   is two comparisons and nothing else.
void SavedTensorPath::order_for_current_stream(OffloadHandle& h, const at::Tensor& dev) {
  if (!h.fetched_on.has_value()) return;  // CPU
  const c10::Stream current = current_stream(dev.device());
  if (h.waited_on.has_value() && current != *h.waited_on && h.ready != nullptr) h.ready->block(current);
  if (current != *h.fetched_on) {
    c10::impl::VirtualGuardImpl impl(dev.device().type());
    impl.recordDataPtrOnStream(dev.storage().data_ptr(), current);
  }
}

PyObject* SavedTensorPath::unpack_offloaded(PyObject* packed) {
  auto* save = reinterpret_cast<OffloadedSave*>(packed);
  OffloadHandle& h = *save->handle;
  // See Note [Version checks] (executor.py): the counter itself, whatever alias changed it.
  const uint32_t now = h.counter.current_version();
  if (now != h.version) {
    const std::string message =
        "one of the variables needed for gradient computation has been modified by an inplace operation: "
        "saved activation " + h.label + " is at version " + std::to_string(now) + "; expected version " +
        std::to_string(h.version) + " instead." + version_error_tail(false, false);
    PyErr_SetString(PyExc_RuntimeError, message.c_str());
    return nullptr;
  }
  observe(h.ordinal);
  if (!h.device_bytes.defined()) materialize(h);
  ++h.unpacks;
  at::Tensor dev = h.device_bytes;
  order_for_current_stream(h, dev);  // See Note [A fetched copy read on other streams]
  const StorageRef ref = storage_ref(dev);
  if (ref.key != 0) {
    fetched_.insert_or_assign(ref.key, Fetched{dev.storage().getWeakStorageImpl(), h.ordinal});
    check_fetched = true;
  }
  if (h.unpacks % std::max<int64_t>(h.packs, 1) == 0) {
    // Every save of it has been used once: the returned tensor owns the copy now. Another backward
    // of a retained graph (or a later micro-batch saving it again) fetches again.
    h.device_bytes = at::Tensor();
    h.ready = nullptr;  // back to the pool once the copy's other holders let go
  }
  at::Tensor out;
  {
    HiddenFromModes hidden;
    out = at::empty({0}, dev.options().dtype(save->dtype))
              .set_(dev.storage(), save->offset, save->sizes, save->strides);
  }
  out.unsafeGetTensorImpl()->_set_conj(save->conj);  // read through its bits, as the save was
  out.unsafeGetTensorImpl()->_set_neg(save->neg);
  // On the saved tensor's own version counter, as SavedVariable::unpack does: a backward that changes
  // this tensor in place is seen by every other save of it (Note [Version counter of a saved tensor],
  // saved_tensors.py).
  out.unsafeGetTensorImpl()->set_version_counter(h.counter);
  sample();
  return THPVariable_Wrap(out);
}

void SavedTensorPath::graph_gone(uint64_t generation) {
  if (generation != generation_ || torch::autograd::get_current_graph_task_id() != -1) return;
  try {
    if (engine_ != nullptr) engine_->release();
  } catch (const std::exception&) {
    // a destructor must not throw; the engine's next step or release() reports a failed copy
  }
}

std::vector<std::pair<int64_t, uintptr_t>> SavedTensorPath::offloaded_sources() const {
  std::vector<std::pair<int64_t, uintptr_t>> out;
  for (const auto& [k, weak] : offloaded_) {
    auto first = weak.lock();
    if (first == nullptr) continue;
    auto add = [&](const OffloadHandle& h) {
      c10::intrusive_ptr<c10::StorageImpl> alive = h.source.lock();
      out.emplace_back(k, reinterpret_cast<uintptr_t>(alive.get()));
    };
    add(*first);
    for (const auto& other : first->others) add(*other.second);
  }
  return out;
}

void SavedTensorPath::check_offload_invariants() const {
  for (const auto& [k, weak] : offloaded_) {
    auto first = weak.lock();
    if (first == nullptr) continue;
    MEMSCHED_CHECK(first->ordinal == k, "offloaded handle of ordinal ", k, " says ", first->ordinal);
    MEMSCHED_CHECK(first->h2d == nullptr || !first->device_bytes.defined(),
                   "a fetched tensor has no prefetch in flight (ordinal ", k, ")");
    MEMSCHED_CHECK(diverged || planned(k), "ordinal ", k, " was offloaded but the plan keeps it");
  }
}

}  // namespace memsched
