// dw_runtime.h -- out-of-order backward's per-layer and per-parameter hot path, in C++: the
// queue of deferred weight-gradient (dW) items, running them, summing each parameter's
// contributions, handing final gradients to .grad, and the side-stream/event handling on an
// accelerator. The policy (which item runs when, which parameter is final, which bucket is
// ready) stays in core/dw_scheduler.h; the Python OutOfOrderBackward (python/memsched/ooo)
// installs the layers, owns the per-iteration phase and runs the fused update and the DDP
// buckets when told a group is ready.
//
// Entry points: DwRuntime (one per OutOfOrderBackward); deferred_layers.h's Functions call
// defer(); Python calls the rest through memsched._C.DwRuntime.
//
// Note [dW runtime in C++]
//   Rationale: in Python each dW item cost an autograd Function, a DeferredWork object, dict
//   and set bookkeeping, and on CUDA a wait_stream, two record_stream calls and a stream
//   context; the layer's host overhead was 1.4x a plain step of a small decoder on CPU, and on
//   an H100 ooo ran at 0.44-0.61x plain.
//   Approach: the Functions (deferred_layers.h) compute dX and hand an item -- the layer input
//   and output gradient, which parameters it feeds -- to defer(). Items, pending sums (one
//   tensor per parameter) and the scheduler live here behind one mutex; a completion that makes
//   parameters final moves their sums into .grad here. Python is called only when something
//   needs it: the first deferred item of a backward pass (owner._backward_started, which queues
//   the end-of-backward callback), and -- only with a fused update or DDP, on the last
//   micro-step -- owner._on_ready(groups, ready_buckets): with a fused update, a group is a step
//   unit whose every parameter is final (Note [Step units] in backward.py; set_units()), so
//   Python is called once per layer, not per parameter -- and not at all for a group that
//   step_native() updates here (Adam/AdamW, See Note [Adam update in C++] in adam_update.h).
//   Executors: "inline" runs an item on the autograd thread when the scheduler says it is
//   urgent, "thread" on a C++ worker thread, "stream" at once on a side stream. On an
//   accelerator, "thread" runs an item on the stream that was current at defer() (the worker's
//   own current stream is the device's default stream, which a non-blocking stream the caller
//   computes on does not order with), and sync_streams makes the caller's stream wait for those.
//   The per-parameter AccumulateGrad hooks (Note [AccumulateGrad gate] in backward.py) are C
//   functions registered through the parameter's own Python hook lists (grad_hook() and
//   accumulated_hook(): METH_O PyCFunctions over a capsule, as Note [The saved-tensor fast path]
//   does), so they sit where a Python hook would, in the user's hook order, and no Python runs
//   per parameter; forward's use counting (note_deferred_use, note_autograd_use) is here too.
//   Limitations: the per-iteration phase (idle/forward/backward) is the owner's; it mirrors it
//   into `phase` whenever it changes.
//
// Note [Streams of out-of-order backward]
//   Rationale: a dW item must read its input and output gradient after the compute stream
//   wrote them, and the dX chain must never wait for dW work (that serialises the two streams
//   and loses the overlap that makes out-of-order backward faster).
//   Approach: the side stream waits for the compute stream only where it consumes a value the
//   compute stream made: before an item runs (one reusable event per device, recorded on the
//   current stream and blocked on by the side stream: cudaStreamWaitEvent waits for the latest
//   record as of the call), and before an autograd gradient is added on the side stream or a
//   parameter becomes final from a hook. The held tensors are record_stream'ed on the side
//   stream, so the caching allocator does not hand their blocks to the compute stream while
//   the item may still read them. They are also held (a Hold: the item's x and output gradient
//   and an event recorded after its kernels) until the side stream is known past them (the event
//   queried, never waited on; all of them at sync_streams): record_stream only keeps a block from
//   being reused after a free, not from being written while alive, and autograd's InputBuffer adds
//   a later gradient in place into a buffer whose last reference it holds (can_accumulate_inplace
//   in input_buffer.cpp). A residual connection hands the same gradient tensor to the layer and to
//   the skip path (AddBackward returns `grad` for both inputs): once the item dropped its
//   reference, the compute stream could add the branch's dX into the tensor the side stream's dW
//   kernel has not read yet. Holding the reference makes autograd add out of place instead.
//   Sums, .grad finalisation and the fused update (the owner's
//   _on_ready runs with the side stream current) all run on the side stream. The compute
//   stream waits for the side stream once, at the end of backward (sync_streams), where the
//   caller consumes gradients and updated parameters; every .grad is then record_stream'ed on
//   the compute stream. No host synchronisation anywhere. On CPU all of this is skipped.
//   Streams and events go through c10's device-generic interface (c10::Stream, c10::Event,
//   c10::StreamGuard, VirtualGuardImpl::recordDataPtrOnStream): on CUDA these are c10::cuda
//   streams and events and the CUDA caching allocator's recordStream.
//   Limitations: written to be correct by construction; not yet run on a GPU (issue 13).
//
// Note [Deferred gradients in their parameter's layout]
//   Rationale: AccumulateGrad stores a parameter's first gradient in the parameter's layout (the
//   gradient layout contract: torch::autograd::utils::obeys_layout_contract, else
//   clone_obey_contract), and torch's fused Adam/AdamW/SGD kernels (fused=True) read .grad element
//   by element in the parameter's order. A deferred weight gradient was stored as its kernel
//   returned it: a Conv1d input of length 1 whose strides are not the canonical ones (a [B, 1, C]
//   tensor transposed to [B, C, 1]: is_contiguous(), strides (C, 1, C)) gets a weight gradient in
//   another layout from oneDNN, equal values in another order, and the fused AdamW update was 0.67
//   off (found by fuzzing).
//   Approach: finalize() applies AccumulateGrad's own contract to the runtime's sum when it becomes
//   .grad: a sum that does not obey it is cloned into the parameter's layout (a later sum is added
//   into that .grad in place, which keeps it).
//   Limitations: Note [Conv weight gradients in the weight's layout] in backward.py still leaves
//   channels_last convs to autograd.
//
// Note [A parameter frozen between its forward and backward]
//   Rationale: AccumulateGrad checks requires_grad when it runs, not when the graph was built: a
//   parameter frozen after the forward and before backward (`loss = f(model(x));
//   model[0].requires_grad_(False); loss.backward()`, a Lightning on_before_backward hook, a GAN
//   freezing one network after computing its loss) gets no gradient from that pass, its .grad stays
//   as it was and the optimizer leaves it alone. The deferred path decided at the forward: its
//   gradient was written and the fused update stepped it (0.019-0.033 off plain; found by a helper
//   probing loops that change the model mid-training).
//   Approach: finalize() drops the pending sum of a parameter that no longer requires grad, as
//   AccumulateGrad drops the gradient; on_autograd_grad() counts the contribution of an autograd use
//   of such a parameter itself (its AccumulateGrad runs no post-accumulate hook) and parks nothing.
//   The fused update steps only parameters with a gradient, so a frozen one with none is not
//   stepped; one with a gradient from an earlier micro-batch keeps it, as in plain PyTorch.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <exception>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <unordered_map>
#include <utility>
#include <vector>

#include <c10/core/Event.h>
#include <c10/core/Stream.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/variable.h>
#include <torch/python.h>

#include "core/dw_scheduler.h"
#include "torch/adam_update.h"
#include "torch/parameter_read_watch.h"

namespace memsched {

// One deferred weight-gradient computation (See Note [Same kernels, same order] in
// deferred_layers.h for the kernels).
struct DwItem {
  bool conv = false;                 // false: Linear (mm / sum), true: aten::convolution_backward
  at::Tensor x;                      // the layer input
  at::Tensor grad;                   // the output gradient
  at::Tensor weight;                 // conv only: the weight (alive anyway; not final before this runs)
  int32_t weight_idx = -1;           // registered parameter index of the weight, -1: not computed
  int32_t bias_idx = -1;             // ... of the bias
  std::vector<int64_t> stride, padding, dilation;  // conv only
  int64_t groups = 1;                // conv only
  std::optional<c10::Stream> stream; // executor "thread" on an accelerator: the stream current at defer()
  int intra_op_threads = 0;          // executor "thread": at::get_num_threads() of the thread that queued it
  int64_t held_bytes() const;        // bytes: x + grad
};

// Computes the gradients `item` asks for: [dW if want_weight][db if want_bias] (same kernels as
// plain autograd; also the "now" path of the Functions).
std::vector<at::Tensor> compute_dw(const DwItem& item, bool want_weight, bool want_bias);

// True when a backward pass is running on this thread and the engine will execute `node`;
// *captured is set when the pass is torch.autograd.grad() asking for that leaf's gradient.
bool engine_runs(torch::autograd::Node* node, bool* captured);

// Whether some installed out-of-order backward steps parameters during backward (a DwRuntime
// with set_fused(true) and not shut down): the saved-tensor version check then names the fused
// update as a cause plain PyTorch does not have (version_holds in saved_tensor_path.cpp).
bool fused_update_installed();
// A save of `t`, which carries no gradient (a parameter's .detach() or .data, or a view of one):
// every fused runtime holds the parameter whose storage it aliases, if any (See Note [A parameter
// read after its gradient is final] in backward.py). Called by memsched's pack hooks; a relaxed
// load and nothing else while no fused update is installed.
void note_parameter_alias_saved(const at::Tensor& t);
// The profiler saw an op of backward read `t`, on a parameter's storage: a parameter whose gradient
// was already final in this iteration (a hook, or a custom Function's backward, reading it after
// its last gradient use) is held from now on, at every iteration (See Note [The profiled step
// updates after backward] in optimize.py).
void note_backward_parameter_read(const at::Tensor& t);

class DwRuntime : public std::enable_shared_from_this<DwRuntime> {
 public:
  enum class Executor { kInline, kThread, kStream };

  // owner: the Python OutOfOrderBackward (held weakly).
  DwRuntime(int64_t max_deferred_bytes, const std::string& executor, pybind11::object owner);
  ~DwRuntime();
  DwRuntime(const DwRuntime&) = delete;
  DwRuntime& operator=(const DwRuntime&) = delete;

  // Registers a parameter (a leaf) with its DDP bucket (-1: none); returns its index.
  int32_t add_param(const at::Tensor& param, int32_t bucket);
  // The parameter's AccumulateGrad node (held from add_param until the runtime dies).
  torch::autograd::Node* accumulator(int32_t param) const;
  // The first parameter whose AccumulateGrad node is no longer that one (its dtype or device was
  // changed through .data since add_param: model.to(...), .double()), or -1.
  int32_t first_regraded() const;

  // -- scheduler, under the lock ------------------------------------------------------------
  void begin_iteration(bool last_micro_step);
  void expect_contribution(int32_t param);
  int32_t expected(int32_t param);
  int32_t received(int32_t param);
  size_t queued();
  DwStats stats();

  // -- backward --------------------------------------------------------------------------
  // A Function's backward (any thread, no GIL): queue `item`, then run what the executor runs.
  void defer(DwItem item);
  // Runs queued items: all of them (urgent_only false) or those the scheduler calls urgent.
  void run(bool urgent_only);
  // Waits (GIL released by the binding) until the worker finished every queued item; rethrows
  // the worker's error.
  void drain();
  // An autograd contribution (the AccumulateGrad gate, or autograd's gradient already in .grad).
  void contribute(int32_t param);
  // A mixed parameter's autograd gradient `e` (made on the current stream): pending += e.
  void add_autograd_grad(int32_t param, const at::Tensor& e);
  // End of backward: the scheduler's end_iteration; short parameters are finalised (and handed
  // to the owner like any final parameter).
  void end_iteration(bool allow_missing);
  // Compute streams wait for the side streams; .grad tensors are record_stream'ed there.
  void sync_streams();
  // Drops queued items and pending sums; a fresh scheduler (same parameters).
  void abandon();
  // Stops the worker; the Functions' items then run plainly (the owner was removed).
  void shutdown();
  // Whether this runtime's owner steps parameters during backward (fuse_optimizer=True); counted
  // process-wide while installed, for fused_update_installed() and note_parameter_alias_saved().
  void set_fused(bool fused);
  // See Note [A parameter read after its gradient is final] (backward.py): the parameter whose
  // storage `t` aliases (if any) is held this iteration: its step unit is not handed over when
  // final, but at the end of backward (take_partial_units).
  void hold_if_parameter(const at::Tensor& t);
  // Holds for good the parameters on `t`'s storage whose gradient is final in this iteration.
  void hold_if_final(const at::Tensor& t);
  // See Note [The first fused iteration watches its parameter reads] (backward.py). on: every
  // parameter is held at each iteration (not counted in `holds`) and a ParameterReadWatch observes
  // the ops; off: the parameters it saw read are held from now on, at every iteration.
  void set_watch(bool on);
  bool watching();
  // See Note [Edits between backward and the step boundary] (backward.py): every parameter's
  // version now; then the first parameter from index `from` on whose version changed since (-1: none).
  void snapshot_versions();
  int32_t first_changed_version(int32_t from = 0);
  std::vector<int32_t> held_params();      // held this iteration, in index order
  // The parameters whose .grad is defined now, in index order: the end of a fused backward pass asks
  // for its leftovers once per pass, which a Python scan of every parameter's .grad made a per-parameter
  // cost of each step (See Note [Gradients the fused update did not see] in backward.py).
  std::vector<int32_t> params_with_grad();

  // -- forward: use counting (See Note [AccumulateGrad gate] in backward.py) --------------------
  // Each returns -1, or the index of a parameter used by a forward that runs during backward
  // after it already received gradient (the owner raises, naming it).
  int32_t note_deferred_use(int32_t weight_idx, int32_t bias_idx);
  int32_t note_autograd_use(const std::vector<int32_t>& params);

  // -- the parameter's hooks ----------------------------------------------------------------
  // New callables for param.register_hook / register_post_accumulate_grad_hook.
  pybind11::object grad_hook(int32_t param);
  pybind11::object accumulated_hook(int32_t param);
  // The hooks' bodies (GIL held; a Python error is raised as python_error).
  void on_autograd_grad(int32_t param, const at::Tensor& grad);
  void on_autograd_accumulated(int32_t param);

  // -- step units (fused update without DDP; See Note [Step units] in backward.py) ------------
  // unit_of[p]: the unit of parameter p; final parameters are handed over a whole unit at a time.
  void set_units(const std::vector<int32_t>& unit_of);
  // End of backward: the units some of whose parameters got no gradient, as they are.
  std::vector<std::vector<int32_t>> take_partial_units();
  // See Note [Update batches] (backward.py): complete units wait until their gradients reach this many bytes, then
  // go to the update together (0: each unit at once). end_iteration() steps what is left.
  void set_update_batch_bytes(int64_t bytes);
  int64_t update_batch_bytes();

  // -- the fused update in C++ (See Note [Adam update in C++] in adam_update.h) --------------
  // For this backward pass: param p is stepped here with hypers[group_of[p]] and slots[p]
  // (group_of[p] < 0: by the owner, in Python). Cleared by clear_adam() (the owner, at the end of
  // backward) and abandon().
  void set_adam(std::vector<AdamHyper> hypers, std::vector<int32_t> group_of, std::vector<AdamSlot> slots);
  // The plan set last, with new hyper-parameters (an LR scheduler stepped); the plan is kept from
  // one backward pass to the next (See Note [Adam plan for the C++ update] in fused.py).
  void set_adam_hypers(std::vector<AdamHyper> hypers);
  bool has_adam();
  void clear_adam();
  // Steps those of `params` (final, with .grad) that the Adam plan covers, grouped by param group,
  // and frees their gradients; returns the others, in order, for the owner.
  std::vector<int32_t> step_native(const std::vector<int32_t>& params);
  int64_t native_updates();  // COUNT: parameters updated here since construction
  // The parameters updated here since the last call (the owner's bookkeeping of freed gradients).
  std::vector<int32_t> take_native_stepped();
  int64_t native_calls();    // COUNT: adam_update calls (one per param group per ready group)

  // -- the caller's gradient hooks (See Note [Parameters with gradient hooks] in backward.py) --
  // GIL held for all three. The parameter's hook dicts (p._backward_hooks and
  // p._post_accumulate_grad_hooks, each holding memsched's own hook) and the key of memsched's
  // post-accumulate-grad hook in the second.
  void set_hook_dicts(int32_t param, pybind11::object tensor_hooks, pybind11::object post_hooks,
                      pybind11::object own_post_key);
  // The first parameter that a deferred use of this iteration feeds and that now carries a hook of
  // the caller's (registered after that forward), or -1.
  int32_t first_hooked_deferred();
  // Moves memsched's post-accumulate-grad hook behind the caller's wherever it is not last.
  void post_hooks_last();

  // -- the patched layers' fast path (See Note [Fast path of a patched layer call] in -----------
  // layer_fast_path.h); GIL held for all of these.
  // The owner's per-iteration dicts, read and written in place by the fast path: kind (parameter
  // index -> _DEFERRED 1 / _AUTOGRAD 2) and cast_uses (its autocast uses; the fast path runs only
  // while it is empty). The owner clears them, never rebinds them.
  void set_iteration_dicts(pybind11::object kind, pybind11::object cast_uses);
  // The owner's autocast state (See Note [Deferred calls under autocast] in backward.py), read and
  // written in place by the fast path of a call under autocast: region (parameter index -> a weak
  // reference to the autocast region's cached weight cast, or `mixed`), eligible (the set of indices
  // deferred in autocast's dtype this iteration when their calls allow it). Cleared, never rebound.
  void set_cast_state(pybind11::object region, pybind11::object eligible, pybind11::object mixed);
  // A new iteration's graph token (kept until the first node takes it) and the owner's weak
  // reference to it; (None, None) drops both (See Note [A failed backward] in backward.py).
  void set_graph(pybind11::object graph, pybind11::object graph_ref);
  // The token a Deferred* node of this iteration keeps: the graph itself at the first call (then
  // no longer held here), after that whatever the weak reference still reaches (None when none).
  pybind11::object graph_token();
  // True when the caller added a gradient hook of its own to the parameter besides memsched's
  // (See Note [Parameters with gradient hooks] in backward.py).
  bool user_hooked(int32_t param) const;
  const at::Tensor& param(int32_t i) const { return params_[static_cast<size_t>(i)]; }
  pybind11::object kind_dict() const { return kind_; }
  pybind11::object cast_uses_dict() const { return cast_uses_; }
  pybind11::object cast_region_dict() const { return cast_region_; }
  pybind11::object cast_eligible_set() const { return cast_eligible_; }
  pybind11::object cast_mixed() const { return cast_mixed_; }
  pybind11::object owner() const { return owner_ref_(); }

  // -- gradient memory accounting (peak_grad_bytes in report()) ----------------------------
  void track_locked(int64_t delta_bytes, int64_t transient_bytes);  // the owner's updates
  void start_tracking();  // grad_bytes = the .grad bytes held now

  bool installed = true;          // false after shutdown(): Functions return gradients plainly
  bool fused = false;             // set_fused(): counted in fused_update_installed() until shutdown()
  int64_t holds = 0;              // COUNT: parameters hold_if_parameter() held, over all iterations
  bool notify = false;            // call owner._on_ready (fused update or DDP) on the last micro-step
  bool poll_after_defer = false;  // call owner._poll_reducer() after each deferred item (DDP)
  bool backward_started = false;  // owner._backward_started ran for this iteration
  bool fast_calls = false;        // the owner allows the layers' fast path (no queueing executor)
  std::atomic<int64_t> iteration{0};  // COUNT: begin_iteration() calls; a Function node keeps the one it was made in
  int phase = 0;                  // the owner's phase: 0 idle, 1 forward, 2 backward
  int64_t grad_bytes = 0;         // SUM: gradient bytes held (.grad + pending sums)
  int64_t peak_grad_bytes = 0;    // SUM: max of grad_bytes (+ a transient addend) this iteration
  Executor executor() const { return executor_; }
  int64_t max_deferred_bytes() const { return max_deferred_bytes_; }

 private:
  struct Hold {                   // an item's inputs, until the side stream is past its kernels
    c10::Event done;              // recorded on the side stream after the item's kernels
    at::Tensor x, grad;
  };
  struct Side {                   // per accelerator device (Note [Streams of out-of-order backward])
    c10::Stream stream;
    c10::Event to_side;           // recorded on the compute stream, blocked on by the side stream
    c10::Event to_compute;        // recorded on the side stream at the end of backward
    std::deque<Hold> holds;       // in record order (so in completion order)
    std::vector<c10::Event> spare;  // events of released holds, reused
  };
  struct Completion {
    std::vector<std::vector<int32_t>> groups;  // complete step units (fused update)
    std::vector<int32_t> ready_buckets;        // DDP
    // Tensors dropped under the lock, released with the Completion, after it: a gradient made in
    // Python (a user's node hook) owns a Python object, whose release takes the GIL, which a hook
    // on the engine thread may hold while it waits for the lock.
    std::vector<at::Tensor> released;
  };
  Side& side_for(const c10::Device& device);  // under the lock
  void wait_for_current(Side& side);          // side stream waits for the current stream
  // Under the lock: moves the tensors of holds whose event completed (all of them: all true) into
  // *out, to be released after the lock.
  void release_holds(Side& side, bool all, std::vector<at::Tensor>* out);
  void execute(int64_t id, DwItem& item, Completion* out);
  // Under the lock; a tensor they drop goes to *released (See Completion).
  void add_pending(int32_t param, at::Tensor g, std::vector<at::Tensor>* released);
  void finalize(int32_t param, std::vector<at::Tensor>* released);
  void collect(const DwCompletion& done, Completion* out);  // under the lock
  // no lock; GIL taken when the owner is called. batch: complete units join the update batch first
  // (Note [Update batches] in backward.py); false steps c's groups as they are.
  void hand_over(const Completion& c, Side* side, bool batch = true);
  // Under the lock: c's groups added to the update batch; the batch as one group once it holds
  // update_batch_bytes_ of gradients (else none).
  std::vector<std::vector<int32_t>> batch_locked(const std::vector<std::vector<int32_t>>& groups);
  // step_native on `side`'s stream (nullptr: the current one); no lock held.
  std::vector<int32_t> step_native_on(const std::vector<int32_t>& params, Side* side);
  // Note [The worker's intra-op threads]
  //   Rationale: the "thread" executor's worker is a std::thread. Its OpenMP and MKL thread counts
  //   are the process defaults until ATen's lazy per-thread init (at its first thread-count query),
  //   which came inside the first kernel, after oneDNN had already split its work by the default; and
  //   a later torch.set_num_threads never reaches the worker. With torch.set_num_threads(1) on a
  //   2-core machine a deferred Conv1d's weight and bias gradients differed from plain PyTorch's in
  //   the last bits (a Python thread that queries torch.get_num_threads() before the kernel matches).
  //   Approach: defer() records at::get_num_threads() of the queuing thread in the item; before an
  //   item the worker queries its own (which runs ATen's lazy init) and calls at::set_num_threads
  //   with the item's count when they differ.
  void worker_loop();
  void track(int64_t delta_bytes, int64_t transient_bytes);  // under the lock
  void expect_hook(int32_t param);                            // under the lock
  void call_owner(const char* method);                        // GIL held; raises python_error
  struct AutogradSeen {           // what the grad hook saw, for the accumulated hook
    bool valid = false;           // the grad hook ran in this iteration and the pass accumulates
    bool defined = false;         // autograd's gradient was defined
    bool had_none = false;        // .grad was None before AccumulateGrad
    bool mixed = false;           // deferred and autograd uses: .grad parked in stash_
  };
  void new_scheduler();
  struct AdamPlan {               // See set_adam()
    std::vector<AdamHyper> hypers;
    std::vector<int32_t> group_of;  // per parameter
    std::vector<AdamSlot> slots;    // per parameter
  };

  int64_t max_deferred_bytes_;
  Executor executor_;
  pybind11::object owner_ref_;                  // weakref.ref(owner)
  std::mutex mu_;                               // guards everything below and the public counters
  DwScheduler sched_;
  std::vector<at::Tensor> params_;              // registered leaves
  std::vector<int32_t> buckets_;                // per parameter, its bucket (-1: none)
  // Per parameter. torch holds autograd nodes by shared_ptr up to 2.11 and by intrusive_ptr since;
  // grad_accumulator()'s own type builds against both (the GPU machine runs 2.11).
  using NodeRef = decltype(torch::autograd::impl::grad_accumulator(std::declval<const at::Tensor&>()));
  std::vector<NodeRef> accumulators_;
  std::vector<at::Tensor> pending_;             // per parameter, the sum of its contributions so far
  std::vector<char> autograd_expected_;         // per parameter: an autograd use was counted this iteration
  std::vector<char> hook_expected_;             // per parameter: its AccumulateGrad contribution is awaited
  std::vector<AutogradSeen> seen_;              // per parameter
  std::vector<uint8_t> held_;                   // per parameter: hold_if_parameter() this iteration
  std::vector<uint8_t> sticky_;                 // per parameter: held at every iteration
  std::vector<uint8_t> final_;                  // per parameter: finalize()d this iteration
  std::unique_ptr<ParameterReadWatch> watch_;   // set_watch(true) until set_watch(false) or shutdown()
  // storage -> parameters on it, for hold_if_parameter(); rebuilt at its first use in an iteration
  std::unordered_map<const c10::StorageImpl*, std::vector<int32_t>> by_storage_;
  bool by_storage_valid_ = false;
  std::vector<uint32_t> versions_;  // snapshot_versions()
  void map_storages();  // under the lock: by_storage_, and holds for parameters sharing a storage
  const std::vector<int32_t>* params_on(const at::Tensor& t);  // under the lock: by_storage_'s entry, or null
  void hold_locked(int32_t param, bool sticky);                // under the lock
  std::vector<at::Tensor> stash_;               // per parameter: the parked .grad of a mixed parameter
  std::vector<char> deferred_used_;             // per parameter: a deferred use counted this iteration
  struct HookDicts {                            // See set_hook_dicts(); read and released with the GIL
    pybind11::object tensor_hooks, post_hooks, own_post_key;
  };
  std::vector<HookDicts> hook_dicts_;           // per parameter
  pybind11::object kind_, cast_uses_;           // the owner's dicts (set_iteration_dicts); GIL
  pybind11::object cast_region_, cast_eligible_, cast_mixed_;  // set_cast_state(); GIL
  pybind11::object graph_, graph_ref_;          // set_graph(); GIL
  std::unordered_map<int64_t, DwItem> items_;   // queued, by scheduler id
  std::deque<std::pair<c10::Device, Side>> sides_;  // a deque: a Side& stays valid as devices are added
  bool last_micro_step_ = true;
  std::vector<int32_t> unit_of_;                // per parameter, its step unit (empty: no grouping)
  std::vector<int32_t> unit_size_;              // per unit, its parameters
  std::vector<std::vector<int32_t>> unit_ready_;  // per unit, its final parameters not yet handed over
  std::atomic<int64_t> update_batch_bytes_{0};  // Note [Update batches] (backward.py); 0: none (read unlocked)
  std::vector<int32_t> batch_;                  // complete units' parameters waiting for their update
  int64_t batch_grad_bytes_ = 0;                // their gradients' bytes

  std::shared_ptr<const AdamPlan> adam_;       // null: every fused update goes to the owner
  int64_t native_updates_ = 0;                  // COUNT
  std::vector<int32_t> native_stepped_;         // parameters updated here, until take_native_stepped()
  int64_t native_calls_ = 0;                    // COUNT

  std::vector<c10::Stream> item_streams_;       // executor "thread": the items' streams this pass (sync_streams)
  std::thread worker_;                          // executor "thread"
  std::condition_variable wake_;                // worker: items queued or stop
  std::condition_variable idle_;                // drain(): worker idle and queue empty
  bool stop_ = false;
  bool worker_busy_ = false;
  std::exception_ptr worker_error_;
};

}  // namespace memsched
