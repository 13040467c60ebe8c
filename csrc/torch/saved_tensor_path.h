// saved_tensor_path.h -- the offload executor's per-saved-tensor hot path, in C++.
//
// Note [The saved-tensor fast path]
//   Rationale: PyTorch calls a saved-tensor pack hook for every tensor autograd saves and an
//   unpack hook for every use in backward. Written in Python (numbering, identity, label check,
//   bookkeeping, a tuple) the pair cost ~18 us per saved tensor on CPU -- 1.4x a plain step of a
//   small decoder, and 630 us of host time per addmm on an H100 -- while all but a few saved
//   tensors are simply kept.
//   Approach: pack and unpack are C functions (METH_O PyCFunctions over a capsule that shares
//   ownership of this object), pushed as the default hooks. Everything a KEPT tensor needs runs
//   here: storage identity and numbering (ActivationNumbering, shared with the profiler), the
//   first pack's label check against the trace, the step's counters, CPU memory tracking, the
//   kept tuple `(ordinal, detached tensor, version)` and, at unpack, the version check and the
//   prefetch trigger test. A save the plan offloads is C++ too (saved_tensor_offload.cpp, Note
//   [Offloaded saves in C++]): its host copy, what autograd stores, the prefetch and the unpack.
//   Python (OffloadExecutor) keeps the policy and is called, through a weak reference to it, only
//   for a save the plan recomputes (`_pack_slow`, RecomputedView.unpack()) and a mismatch
//   (`_diverge_label`).
//   Executed steps label activations without the module path, so no Python hook runs per module
//   call (docs/CONVENTIONS-activation-identity.md).
//   While copies are in flight every hook call polls the copy engine (csrc/torch/copy_engine.h)
//   directly, in C++ (Note [Draining completions in order]).
//   Limitations: each save still costs PyTorch's own hook call (a Python call into a C function,
//   a Python tensor for the argument) at pack and at unpack -- about as much as identity hooks
//   written in Python, the floor for any hook-based offloader.
#pragma once

#include <thread>
#include <chrono>
#include <cstdint>
#include <limits>
#include <atomic>
#include <memory>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <vector>

#include <torch/python.h>

#include "torch/activation_numbering.h"
#include "torch/copy_engine.h"

namespace memsched {

// Registers the KeptSave type (See Note [Kept saves are not Python containers]) as m.KeptSave;
// call once at module import, before any hook runs.
void prepare_kept_type(pybind11::module_& m);

// A save kept on its device and version-checked at unpack, with no step state: what the profiler's
// hooks and a pass-through pair pack (new references, or nullptr with a Python error set).
PyObject* kept_pack(PyObject* tensor);
PyObject* kept_unpack(PyObject* packed);
// A KeptSave of `t` at ordinal k: an op's own output without its history (Note [Keeping an output
// without its history]), any other tensor as it is; version-checked at unpack.
PyObject* kept_alias(int64_t ordinal, const at::Tensor& t);
// The end of the in-place-modification error of a version check, from " (memsched checks this
// itself ...": where plain PyTorch raises it too, and where a fused optimizer update made it
// (parameter_itself: the saved tensor is a parameter; without_grad: it carries no gradient).
std::string version_error_tail(bool parameter_itself, bool without_grad);
// Whether `obj` is an OffloadedSave (saved_tensor_offload.cpp).
bool is_offloaded_save(PyObject* obj);

// The Python type of an object autograd stores for a save (KeptSave, OffloadedSave): a static type
// without GC support, since it refers to no Python object (Note [Kept saves are not Python containers]).
PyTypeObject saved_object_type(const char* name, Py_ssize_t basicsize, destructor dealloc, const char* doc);

struct OffloadHandle;  // See Note [Offloaded saves in C++] (saved_tensor_offload.cpp)
struct StepGraph;

// Registers the OffloadedSave type (what autograd stores for an offloaded save) as m.OffloadedSave.
void prepare_offloaded_type(pybind11::module_& m);

class SavedTensorPath : public std::enable_shared_from_this<SavedTensorPath> {
 public:
  // owner: the Python OffloadExecutor (held weakly).
  SavedTensorPath(at::Device device, pybind11::object owner);

  // New pack and unpack callables to push. Each shares ownership of this object (a saved tensor's
  // unpack may run after the executor is gone); the executor creates them once and compares
  // their identity with the hook stack's top.
  pybind11::object pack_function();
  pybind11::object unpack_function();

  // The hooks themselves: a new reference, or nullptr with a Python error set.
  PyObject* pack(PyObject* tensor);
  PyObject* unpack(PyObject* packed);

  // Numbering with the same identity rule as the hooks (the profiler's entry point).
  ActivationNumbering& numbering() { return numbering_; }
  static StorageIdentity identity_of(PyObject* obj, const at::Tensor& tensor);

  // -- step state, driven by the executor ---------------------------------------------------------
  void begin_step(double t0_s);
  void set_schedule(const pybind11::dict& labels, const pybind11::iterable& planned,
                    const pybind11::dict& first_bwd_op, const pybind11::iterable& triggers,
                    const pybind11::iterable& before_step);
  void clear_schedule();
  void observe(int64_t ordinal);                  // an unpack of `ordinal`: fire prefetch triggers
  // A backward pass that unpacked a save of these hooks began and has not completed (it raised): See
  // Note [A step whose backward raised] (offload/executor.py).
  bool backward_open() const { return backward_open_->load(std::memory_order_acquire); }
  // Note [Backward node triggers]: trigger nodes by their sequence offset in the step -> trace op.
  void set_trigger_nodes(const pybind11::dict& node_to_op);
  // Hook the trigger nodes of the graph behind `roots` (a forward's outputs); returns how many.
  int64_t hook_nodes(const std::vector<at::Tensor>& roots);
  void fire_at(int64_t op, uint64_t generation);   // a trigger node starts (the engine's thread)
  void track(const at::Tensor& device_tensor);    // CPU: count this storage's bytes while it lives, from now
  void sample();                                  // a memory sample (peak; timeline when enabled)
  int64_t alive_bytes();                          // CPU: tracked storages alive now
  void forget(PyObject* weak_ref);                // a tracked storage died
  // The executor's copy engine: the hooks poll its completions themselves, with no Python call
  // per saved tensor while copies are in flight.
  void set_copy_engine(std::shared_ptr<CopyEngine> engine) { engine_ = std::move(engine); }
  // D2H copies were queued (or all issued): See Note [Copies issued at the next op].
  void set_has_queued(bool queued);
  bool next_op_armed() const { return next_op_callback_ != 0; }  // See Note [Copies issued at the next op]
  // -- offloaded saves (saved_tensor_offload.cpp, Note [Offloaded saves in C++]) --------------------
  // The plan's prefetches: trigger op -> the ordinals it fetches; and the ordinals it recomputes
  // (their saves go to the executor's Python slow path).
  void set_prefetches(const pybind11::dict& prefetch_at);
  void set_recompute(const pybind11::iterable& ordinals);
  void issue_copies();                            // queued D2H copies go out now
  int64_t min_bytes = 0;                          // smaller storages are never offloaded
  std::string fail_next_issue;                    // tests: the next issue_copies() raises this
  struct OffloadCounters {                        // this step's; begin_step() zeroes them
    int64_t offloaded = 0, offloaded_bytes = 0, prefetched = 0, on_demand = 0, late_prefetches = 0;
    int64_t host_limited = 0;
    int64_t guard_waits = 0, guard_releases = 0, guard_released_bytes = 0;  // Note [Memory guard]
    // The highest allocator count the guard read this step, and the device bytes the copy engine
    // held for D2H copies in flight at that read (Note [Where the peak went], offload/peak_gap.py).
    int64_t sampled_peak_bytes = 0, in_flight_at_sampled_peak = 0;
    double stall_s = 0.0;                         // CPU: on-demand copy time
  };
  OffloadCounters counters;
  // This step's offloaded storages: (ordinal, storage key while the device storage lives, else 0).
  std::vector<std::pair<int64_t, uintptr_t>> offloaded_sources() const;
  void check_offload_invariants() const;
  void op_starts();                               // the next op starts: issue the queued copies
  // -- the memory guard (accelerator; Note [Memory guard] in saved_tensor_offload.cpp) -----------
  // budget_bytes: the allocator's count the step must stay within; headroom: ordinal -> bytes the
  // ops up to the next activation allocate; allocated_fn: a C function int64_t(int device) that
  // counts the installed allocator's bytes (memsched's), 0 for the device allocator's own stats.
  void set_memory_guard(int64_t budget_bytes, std::vector<int64_t> headroom, uintptr_t allocated_fn);
  void clear_memory_guard();
  int64_t guard_budget() const { return guard_budget_; }
  int64_t allocated_bytes() const;                // the device allocator's count now (no sync)
  std::string guard_error;                        // why the guard turned itself off ("" while it works)
  // CPU: the step's peak of tracked storages alive, each from its birth (Note [Measured from
  // birth]) into peak_bytes, and the timeline samples' values; call once at the step's end.
  void finish_step();
  struct Lifetime {
    int64_t born;   // clock
    int64_t died;   // clock; kAliveClock while alive
    int64_t bytes;  // storage bytes
  };
  static constexpr int64_t kAliveClock = std::numeric_limits<int64_t>::max();
  const std::vector<Lifetime>& lifetimes() const { return lifetimes_; }  // this step's tracked storages
  ~SavedTensorPath();
  SavedTensorPath(const SavedTensorPath&) = delete;
  SavedTensorPath& operator=(const SavedTensorPath&) = delete;

  bool step_active = false;     // a step runs and its forward has not failed
  bool diverged = false;        // the step left the trace: nothing more is offloaded
  bool check_fetched = false;   // fetched copies exist: a save may be one of them
  bool need_poll = false;       // copies in flight: poll at each hook call
  bool has_queued = false;      // D2H copies queued until their op has run (set through set_has_queued)
  uint64_t queued_op = 0;       // autograd sequence number when they were queued
  bool timeline = false;        // keep (t, bytes) samples
  bool track_memory = true;     // CPU: count saved storages alive (Note [CPU memory by weak references])
  int64_t fired_upto = -2;      // last trigger op fired (-2: none, -1: backward start)
  int64_t activations = 0;      // COUNT activation storages packed this step
  int64_t activation_bytes = 0; // SUM their bytes
  int64_t peak_bytes = 0;       // max sampled memory this step
  std::vector<std::pair<double, int64_t>> samples;  // timeline=True: (seconds since t0, bytes)

 private:
  void open_backward();  // the first unpack of a backward pass: its completion closes it
  // Set by open_backward, cleared by an engine callback that runs only when the pass completes (the
  // engine's threads: atomic; shared so a callback outliving this path writes nothing freed).
  std::shared_ptr<std::atomic<bool>> backward_open_ = std::make_shared<std::atomic<bool>>(false);
  pybind11::object owner() const;  // the executor, or None once it died
  template <typename... Args>
  pybind11::object call_owner(const char* method, Args&&... args);
  PyObject* pack_saved(PyObject* obj, const at::Tensor& t);  // pack()'s work for a save of a step (throws)
  void check_label(int64_t ordinal, bool has_storage);
  void poll_copies();                        // need_poll: release what completed copies held
  void guard_memory(int64_t ordinal);        // See Note [Memory guard]: at an activation's first save
  void guard_for(int64_t headroom);          // the check itself: allocated + headroom against the budget
  bool planned(int64_t ordinal) const {
    return has_schedule_ && ordinal >= 0 && ordinal < static_cast<int64_t>(planned_.size()) &&
           planned_[static_cast<size_t>(ordinal)];
  }

  at::Device device_;
  bool is_cpu_;
  pybind11::object owner_ref_;     // weakref.ref(executor)
  ActivationNumbering numbering_;
  std::shared_ptr<CopyEngine> engine_;      // set_copy_engine(); null: no copies to poll

  bool has_schedule_ = false;
  std::vector<std::string> expected_;       // ordinal -> the trace's label without its module path
  std::vector<LabelShape> expected_shape_;  // ordinal -> its shape and dtype (Note [Labels built on demand])
  std::vector<std::string> expected_full_;  // ordinal -> the trace's label (messages)
  std::vector<char> has_expected_;          // ordinal -> the trace has a label for it
  std::vector<char> planned_;               // ordinal -> the plan offloads it
  std::vector<int64_t> first_bwd_op_;       // ordinal -> its first backward op (kNoOp: none)
  std::vector<char> before_step_;           // ordinal -> the trace saw it exist before the step (Note [Measured from birth])
  std::vector<int64_t> triggers_;           // sorted trigger ops that prefetch something (-1: backward start)
  std::unordered_map<uint64_t, int64_t> trigger_nodes_;  // node sequence offset -> trigger op
  uint64_t seq_base_ = 0;                   // this thread's autograd sequence number at the step's start
  uint64_t generation_ = 0;                 // steps begun: a hook of an older step's node does nothing

  // See Note [Offloaded saves in C++].
  PyObject* pack_offloaded(PyObject* obj, const at::Tensor& t, int64_t k, bool may_offload, int64_t nbytes,
                           uintptr_t key);
  PyObject* unpack_offloaded(PyObject* packed);
  PyObject* pack_fetched(const at::Tensor& t);    // nullptr: not a fetched copy
  bool offloadable(PyObject* obj, const at::Tensor& t, int64_t nbytes);
  std::shared_ptr<OffloadHandle> offload(int64_t k, const at::Tensor& t, int64_t nbytes);
  std::shared_ptr<OffloadHandle> copy(int64_t k, const at::Tensor& t, int64_t nbytes);
  std::shared_ptr<OffloadHandle> copy_for(PyObject* obj, const std::shared_ptr<OffloadHandle>& first,
                                          const at::Tensor& t);
  void fire(int64_t op, int64_t fired_upto);
  void materialize(OffloadHandle& h);
  void reset_offloads();
  friend struct StepGraph;
  void graph_gone(uint64_t generation);
  std::vector<char> recompute_;                                         // ordinal -> the plan recomputes it
  std::unordered_map<int64_t, std::vector<int64_t>> prefetch_at_;       // trigger op -> ordinals
  std::unordered_map<int64_t, std::weak_ptr<OffloadHandle>> offloaded_; // ordinal -> its first copy
  std::unordered_set<int64_t> dropped_;                                 // ordinals offloaded this step
  std::vector<std::pair<std::shared_ptr<OffloadHandle>, at::Tensor>> queued_;  // copies not issued yet
  struct Fetched {
    c10::weak_intrusive_ptr<c10::StorageImpl> storage;
    int64_t ordinal;
  };
  std::unordered_map<uintptr_t, Fetched> fetched_;                      // fetched copy's storage key -> ordinal
  std::weak_ptr<StepGraph> graph_;                                      // this step's (See StepGraph)
  int64_t guard_budget_ = 0;                                            // 0: no guard (Note [Memory guard])
  std::vector<int64_t> guard_headroom_;                                 // ordinal -> bytes
  int64_t (*allocated_fn_)(int) = nullptr;                              // memsched's allocator, when installed

  void drop_tracked();
  void disarm();                           // remove the next-op callback (never from inside it)
  void order_for_current_stream(OffloadHandle& h, const at::Tensor& dev);  // Note [A fetched copy read on other streams]
  uint64_t next_op_callback_ = 0;          // at::CallbackHandle while armed, else 0
  std::thread::id callback_thread_ = std::this_thread::get_id();  // the step's: the only one that arms and removes it
  void track_from(const at::Tensor& t, int64_t born);
  // See Note [Measured from birth].
  int64_t tick();                          // a new moment on the step's clock; marks a new forward node
  void mark_inputs_saved();                // the current node's input saves are done
  int64_t birth_of(const at::Tensor& t, int64_t ordinal);  // the moment the storage of `t` was made
  struct NodeMark {
    uint64_t peek;          // at::sequence_number::peek() after the node was made: its sequence_nr + 1
    int64_t first;          // clock of the first moment at this peek
    int64_t after_inputs;   // clock when its input saves were done; -1: none seen
  };
  pybind11::object death_callback_ = pybind11::none();
  std::unordered_map<PyObject*, size_t> tracked_;  // weak reference (owned) -> index into lifetimes_
  std::vector<Lifetime> lifetimes_;                // this step's tracked storages
  std::vector<NodeMark> marks_;                    // ascending peek
  std::vector<int64_t> sample_clocks_;             // timeline: the clock of each sample
  int64_t clock_ = 0;
  int64_t tracked_bytes_ = 0;
  double t0_s_ = 0.0;
};

}  // namespace memsched
