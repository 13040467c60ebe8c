"""Out-of-order backward: eligible layers compute the input gradient at once and
queue their weight-gradient work; a DwScheduler (csrc/core/dw_scheduler.h)
orders it; finished gradients are handed to a fused optimizer update or to DDP
bucket communication.

Entry point: ``OutOfOrderBackward(model, optimizer=None, fuse_optimizer=False,
...)``, used as a context manager (or install()/remove()); ``step()`` once per
backward pass (micro-step); ``report()``.

Note [One iteration of out-of-order backward]
  Forward: every call of an eligible layer (nn.Linear, nn.Conv1d/2d/3d with
  zero padding) with grad enabled goes through the C++ Functions of
  csrc/torch/deferred_layers.h (_C.deferred_linear / deferred_conv) and
  counts one expected contribution per parameter; every call of a module that
  owns parameters directly and is not patched counts one *autograd*
  contribution per parameter per iteration (autograd sums all such uses in one
  AccumulateGrad call). Backward: the Function computes dX and hands (x, dY)
  to the C++ DwRuntime as one item (See Note [dW runtime in C++] in
  csrc/torch/dw_runtime.h), which asks the scheduler which items must run now
  (byte limit, next DDP bucket) and runs them. Contributions of
  one parameter are summed into a pending buffer in arrival order and added to
  ``param.grad`` once, when the parameter is final -- the same additions
  autograd's InputBuffer + AccumulateGrad perform, hence bitwise equal
  gradients (float addition is commutative, not associative: a parameter with both
  deferred and autograd uses would be summed in another order once autograd sees two
  or more, so a Linear owning a tied parameter stays plain, and a patched layer's
  calls of one iteration are all summed on one side -- See Notes [Tied parameters],
  [One kind of use per parameter and iteration], [Parameters with gradient
  hooks]). Autograd contributions (non-eligible uses)
  are seen through a tensor hook (is the gradient defined?) and a
  post-accumulate-grad hook. At the end of the backward pass (an engine
  callback, so ``loss.backward()`` returns with everything done) the queue is
  flushed, DDP buckets are waited for, and the iteration ends.
  Fused update: a final parameter, on the last micro-step, is stepped with
  torch's optimizer together with the rest of its step unit (See Note [Step
  units]; Note [Grouped step through torch's functional optimizer] in
  fused.py) and its gradient freed. A parameter is final only after its last
  contribution, whose dX -- the last reader of the old weight -- was computed
  before the contribution was queued.

Note [AccumulateGrad gate]
  Rationale: a weight used outside its layer (F.linear(x, layer.weight), a
  regulariser on weight.T) gets an autograd gradient that forward never
  counted. If the deferred contribution alone made the parameter final, the
  fused update would step it with part of its gradient before the extra one
  is seen.
  Approach: each parameter used in an iteration also expects one contribution
  from its AccumulateGrad node (the tensor hook, which runs after every
  backward node that feeds it, with None when every use was deferred). Until
  that hook ran the parameter is not final; an uncounted autograd gradient
  arriving there is refused while the parameter is still untouched.
  Limitations: each parameter becomes final at its own AccumulateGrad, so
  weight and bias of one layer become final one after the other (Note [Step
  units] steps them together).

Note [Step units]
  Rationale: one optimizer call per parameter pays the call's fixed cost per
  parameter; a layer's weight and bias become final one right after the other.
  Approach: every parameter belongs to one unit: the parameters its first
  owning module (in model.modules() order) holds directly. A final parameter
  (last micro-step) waits in the runtime (DwRuntime.set_units) until all of its unit is final, then the
  unit is stepped in one call: DwRuntime's C++ Adam update (See Note [Adam
  plan for the C++ update] in fused.py), else one ParamStepper.step_params call. Without DDP that is
  the whole ready group; under DDP a reduced bucket is the group. At the end
  of backward every unit still waiting (a member got no gradient) is stepped
  as it is.
  Limitations: a module whose own parameters are used far apart in forward
  (one at the start, one at the end) keeps the first-final one's gradient
  until the other is final; memory is bounded by that module's parameters.

Note [Update batches]
  Rationale: on a GPU each C++ Adam update of a unit launches its own kernels (the foreach
  path: about ten multi-tensor kernels a call, whatever the unit's size), so a model of many small
  units pays hundreds of launches per backward pass more than one optimizer.step() over all of
  them: the first H100 run measured the fused update about 750 launches a step over plain, 1.26x
  ooo's step on MobileNetV3-small b32 and 1.31x on a small transformer, all host-bound.
  Approach: on an accelerator, complete units join a batch (DwRuntime.update_batch_bytes) that is
  updated in one call, split by param group, once its gradients reach update_batch_bytes; what is
  left is updated at the end of the backward pass (DwRuntime.end_iteration), before the owner
  books what C++ stepped. The update is elementwise per tensor, so a parameter is updated bitwise
  as in its own unit's call. The default is an eighth of the fused parameters' bytes: about eight
  calls a pass, and at most that eighth (plus the unit that filled it) of gradients alive beside
  the one being made, so the fused update still frees most of the gradient memory.
  On CPU the kernels cost their work, not their launch, and the default is 0: each unit at once,
  as before (one layer's gradient at a time). update_batch_bytes=... sets it either way.
  Limitations: units held for the end of backward (Note [A parameter read after its gradient is
  final]) and DDP buckets are stepped as before, not batched; so is a model spread over several
  devices by default (a batch is stepped on one device's side stream).

Note [Fused update and gradient accumulation]
  Rationale: with fuse_optimizer a parameter is stepped inside the backward
  pass that completes its gradient: on every backward pass when
  grad_accumulation_steps is 1. A caller who accumulates over two backward
  passes per step() without saying so got two updates, each with half the
  gradient -- parameters silently unlike plain PyTorch's.
  Approach: a backward pass that begins after a fused update and before the
  next step() is refused (MemschedError naming grad_accumulation_steps) at
  its first forward use of a parameter, before anything of it is counted.
  memsched.optimize passes its grad_accumulation_steps through; its
  run.step() may follow every backward pass or only every K-th.
  Limitations: the refusal comes after the first, early update: the caller
  learns at the first accumulated step, not before it.

Note [A failed backward]
  Rationale: a backward pass that raises (out of memory) never runs the
  end-of-backward callback, so queued work (layer inputs, output gradients),
  partial gradient sums and parked .grad tensors would stay here, and the
  next forward would count its uses as late uses of a running backward.
  Approach: every Deferred* node of an iteration keeps one _IterationGraph
  object in its ctx; a weak reference with a callback sees it die. When it
  dies outside the engine while the phase is still "backward", the caller has
  dropped the failed step: _abandon() runs. A forward outside the engine that
  finds the phase "backward" (the failed graph still referenced) abandons it
  too, and so does remove(). memsched.optimize abandons an iteration whose
  root forward raised (abandon_forward()).
  A pass that memsched itself refuses mid-backward (a parameter used outside its layer, a use counted
  too late) left the gradients half-written: AccumulateGrad had stored some, others were None, and a
  deferred one held part of its sum; a caller who retried with ooo=False, as the message says, without a
  zero_grad() first trained on the leftovers (3.7e-3 off plain; found by a helper). Such a pass's
  abandonment drops every gradient of the model (.grad = None, as after a refused budget's step), and
  the refusal says so.
  Limitations: with a fused update, parameters stepped before the backward pass raised keep their
  update (plain PyTorch, whose step follows backward, updates none); a RuntimeWarning names how
  many when the iteration is abandoned. A pass that raises for another reason (the caller's hook, out of
  memory) keeps the gradients autograd stored before it raised, as in plain PyTorch.

Note [A reentrant checkpoint's nested backward passes]
  Rationale: torch.utils.checkpoint(..., use_reentrant=True) runs each segment's forward under no_grad
  and, in backward, recomputes it and runs a backward pass of its own inside the caller's. Where the
  only trainable layers sit inside the segments (LoRA adapters, a frozen head), nothing of the model is
  seen before backward: each nested pass begins and ends an iteration of its own (its uses are all the
  recompute's, so its gradients are whole), and one loss.backward() counted as one pass per segment --
  refused at optimizer.step() as "2 backward pass(es) ... expects 1" (found by a helper).
  Approach: without a fused update, a pass that begins inside a reentrant checkpoint's backward
  (CheckpointFunction.backward on the stack) is not counted when it ends; the nested passes of one
  backward() count as one pass, booked at the next forward outside backward, zero_grad(), step() or
  when the count is read. A fused update refuses reentrant checkpointing at the forward.

Note [A step the loop skipped after a fused update]
  Rationale: with fuse_optimizer the update runs during the backward pass that completes a step's
  accumulation, before the loop's step(). A loop that then skips step() -- an exception between
  backward and step that it catches, a check of non-finite gradients -- and goes on finds every
  later forward refused: the parameters already hold an update plain PyTorch would have skipped.
  Approach: the refusal stands (a zero_grad() does not lift it: a GAN's generator pass through the
  discriminator looks the same, and there the fix is to freeze the discriminator), and its message
  names the skipped step and the two ways on: step() there, going on from the updated parameters,
  or fuse_optimizer=False (found by a helper injecting failures mid-step, whose loop retried each
  later step into the same refusal).

Note [Backward passes whose gradients the loop discards]
  Rationale: a loop that runs two backward passes per step and drops the first one's gradients with
  zero_grad() before the second (SAM's ascent pass, a probe pass whose gradients are only logged)
  trains plainly under memsched.optimize's profiled step, which updates after backward (Note [The
  profiled step updates after backward] in optimize.py); at the next step the fused update ran inside
  the *first* backward pass, with gradients plain PyTorch discards, and only the second forward was
  refused, that update applied (found by a helper probing loops that change things mid-training).
  A step skipped at the first step looks the same to memsched (GradScaler's first steps skip on
  inf/NaN, and a loop may catch an error before its step): backward, zero_grad(), backward, step.
  A zero_grad() of a module between backward and the step (`loss.backward(); model.head.zero_grad();
  optimizer.step()`) looks alike without the second pass, and the fused update stepped what plain
  leaves unchanged (found by a helper reviewing this change: 0.022 off plain).
  Approach: under memsched.optimize (fusion_paused set), a zero_grad() after a backward pass of an
  unfused step and before its step boundary marks the step; the next step then runs unfused too
  (its update after backward, as the profiled step's). If that step drops a pass again, its step
  boundary is refused before its update, naming fuse_optimizer=False; if not, the first was a skip
  and later steps fuse. A bare OutOfOrderBackward cannot update after backward (its loop calls
  step() and nothing else), so there the pass is refused at the next forward as before. A zero_grad()
  after a fused update and before the step boundary is refused at the boundary (the update stays
  applied), unless a forward was refused there first (a skipped step, whose way on is step()).

Note [A parameter read after its gradient is final]
  Rationale: the fused update steps a parameter in place once its gradient is final. A backward
  node that reads the parameter but sends it no gradient can still run after that: the node of
  `h = x @ w.detach().t()` or `x @ w.data.t()`, earlier in the forward than w's last gradient
  use, has no edge to w's AccumulateGrad. `.detach()` shares w's version counter, so the saved
  tensor's version check raised mid-backward, with some parameters already stepped, where plain
  PyTorch (step after backward) trains; `.data` has a counter of its own, so the node silently read
  the stepped weights: a wrong gradient (found by probing reads of a weight after its final
  gradient; PyTorch's own optimizer-in-backward recipe, register_post_accumulate_grad_hook, does
  the same).
  Approach: memsched's pack hooks (the executor's and the profiler's: every step under
  memsched.optimize) pass each save of a parameter's storage that carries no gradient to
  note_parameter_alias_saved (csrc/torch/dw_runtime.h); every installed fused runtime holds the
  parameter whose storage it aliases, for this iteration (cleared at the next begin_iteration).
  The caller's own saved-tensor hooks (save_on_cpu, a non-reentrant checkpoint, whose recompute in
  backward reads the weight again) take such saves from memsched's (found by probing: 3.1e-2 off
  plain), and a read that is no save at all (a tensor hook, another parameter's post-accumulate-grad
  hook, a custom Function's backward reading a module's weight it keeps on ctx) shows only in
  backward: memsched.optimize's profiled step updates after its backward (Note [The profiled step
  updates after backward] in optimize.py), so every read there sees plain's weights, and its
  dispatch mode passes every backward op's argument on a parameter's storage to
  note_backward_parameter_read, which holds for good a parameter whose gradient is already final
  (DwRuntime.finalize marks it) -- 1.5e-3 off plain before. A forward read through an alias matters
  only where a backward op reads it again, which that sees; the profiler also held every parameter a
  forward op read through a tensor without gradient, which held nn.Embedding(max_norm=...)'s weight
  (its renorm reads weight.detach()) and every parameter whose `p.detach().norm()` was logged during
  the profiled step, for good and with no read after its final gradient (found by a helper probing
  the same rule in the first-iteration watch). The models of memsched.models and tiny Hugging Face
  Llama, GPT-2, BERT and T5 hold nothing.
  A held parameter's step unit is not handed over when final but stays complete until the end of
  backward, where _flush_ready steps it with the partial units; under DDP its bucket's update
  leaves it out and the end of backward steps it after wait_all(). Its gradient lives until then
  (peak_grad_bytes shows it). A save that is the parameter itself, or a view that requires grad, is
  not a hold: its node feeds the parameter's AccumulateGrad, which runs after it. Parameters that
  are views of one buffer (nn.Parameter(flat[a:b].view(...))) share its version counter: stepping
  one in place failed the version check of another's saved tensor (found by probing), so
  DwRuntime.map_storages holds every parameter sharing its storage with another, at every iteration.
  memsched.optimize runs a step without saved-tensor hooks when it has nothing to do (Note [A plan
  with nothing to do] in offload/executor.py) only while no hold was ever seen (DwRuntime.holds).
  Limitations: a read under the caller's own saved-tensor hooks, and a read that is no save, are
  held only if the profiled step made them; so is a save that first appears in a step run without
  hooks (a code path the profiled step did not take, under a plan with nothing to do).
  OutOfOrderBackward without memsched.optimize has no profile and no pack hooks of memsched's: its
  first fused iteration is watched instead (Note [The first fused iteration watches its parameter
  reads]). The version-check error names the fused update when one is installed (version_error_tail
  in csrc/torch/saved_tensor_path.cpp).

Note [The first fused iteration watches its parameter reads]
  Rationale: OutOfOrderBackward used without memsched.optimize has no profiled step: a `.data` alias
  read in the forward, a tensor hook or another parameter's post-accumulate-grad hook reading a later
  layer's weight, or a custom Function's backward reading a weight it keeps on ctx read the stepped
  weights, silently (found by probing: 1e-3 to 2e-2 off plain after 4 AdamW steps), as under
  PyTorch's own optimizer-in-backward recipe; a `.detach()` alias raised PyTorch's in-place error.
  Approach: when no profile pauses the fusion (fusion_paused is None), install sets
  DwRuntime.watching: until the end of the first accumulation cycle's last backward pass, every
  parameter is held (updated at the end of backward, as the profiled step of memsched.optimize is,
  after backward), so every read of a parameter in that backward sees its unstepped values, and a C++
  observer of every aten op (csrc/torch/parameter_read_watch.h: a RecordFunction callback, not a
  dispatch mode, so the watched iteration's gradients stay bitwise plain's) notes each op run inside
  backward (a graph task on its thread) with an argument on the storage of a parameter whose gradient
  is already final (DwRuntime.finalize marks it): the read a fused update would have handed the
  stepped weights, whatever made it (a saved alias, a hook, a ctx). Reads outside backward are not
  noted: a forward's read through an alias matters only where a backward op reads it again, which
  the observer sees (noting them held every parameter a teacher deepcopy'd or a state_dict cloned
  inside the `with` block touched, or nn.Embedding(max_norm=...)'s renorm of `weight.detach()`). Only
  the outermost op's arguments count: addmm's CPU kernel expands the bias below autograd and held
  every bias of Hugging Face GPT-2's Conv1D when nested ops counted. The watch ends just before that
  pass's update; the parameters it noted are held at every later iteration (DwRuntime.holds counts
  them). The dW items of out-of-order backward are memsched's own reads, covered by the runtime for
  every iteration: an item whose input is on a parameter's storage (learned queries fed to a Linear)
  holds that parameter (DwRuntime::defer), since a queued item runs after that parameter may be final
  -- on the thread executor's worker, which no graph task marks as backward (4.4e-2 off plain), or
  deferred in bf16 only from the iteration after the watch (Note [Deferred calls under autocast]).
  Cost: the first iteration keeps every gradient to the end of backward (the peak of a step without
  fusion) and pays a boxed-argument callback per aten op; later iterations pay nothing.
  Limitations: what the first iteration does not do is not seen (a hook registered later, a code
  path taken later), and a read that is no aten op (a kernel reading data_ptr()) or happens inside
  one (the Python body of a torch.library custom op) neither.

Note [Edits between backward and the step boundary]
  Rationale: plain PyTorch's optimizer.step() reads the hyper-parameters and the parameters at the
  step; the fused update ran during backward, with the values of then. A loop that sets the
  learning rate between loss.backward() and optimizer.step() (a warm-up written there), calls its
  scheduler's step() before the optimizer's, or edits a parameter in place there (a clamp under
  no_grad) trained differently with no word (found by probing: 3.4e-2 off plain after 3 steps).
  Approach: at the end of the last micro-step's backward, after the update, the groups' hyper-
  parameters (every entry but "params"; a tensor by identity and version) and the parameters'
  version counters (DwRuntime.snapshot_versions) are noted; at the step boundary (step(), and
  memsched.optimize's run.step() or routed optimizer.step()) a change to either warns once,
  naming it, that the update already used the values of before and how to order the loop. The
  update is not redone: it cannot be taken back.
  Limitations: an edit through .data (no version bump) is not seen; a change made and undone in
  between is not either.

Note [Parameters added or unfrozen after install]
  Rationale: a parameter that requires grad but was not registered at install is neither
  deferred nor (fused) updated; it must be refused at the next forward. Walking the model's
  parameters at every iteration cost ~0.1-0.2 ms a step on a 76-parameter decoder.
  A layer's weight gradient is routed to the parameter index it got at install (its patched
  forward and its C++ fast path keep it), so a weight tied to another layer's since
  (``m4.weight = m2.weight``) or replaced by a new Parameter got the wrong gradients (5e-4 off
  after three steps) or a raw TypeError.
  Approach: the walk runs only when a parameter frozen at install now requires grad, or
  when torch's global parameter/module registration hooks saw a registration anywhere since
  the last check (the flag is cleared once an iteration's checks pass). On a registration the
  first call of the next iteration also checks that every module still in the model owns the
  Parameters it owned at install (_check_parameters_unchanged), and refuses a tie, a
  replacement or a removal naming the layer and the fix (install again), before anything changes;
  a patched layer begins its iteration before it reads its parameters' hooks, so these checks
  come first. A parameter that requires grad but is unknown is refused as new or as frozen at
  install, whichever it is.
  Limitations: a parameter put into ``module._parameters`` directly, bypassing
  register_parameter and __setattr__, is not seen.

Note [Parameters with gradient hooks]
  Rationale: a deferred layer's Function returns no weight gradient, so a hook the caller put on
  the parameter (p.register_hook(fn)) was called with None: ``g * 0.5`` raised in user code and a
  None-tolerant hook was skipped (parameters off by 0.09). A post-accumulate-grad hook
  (clip_grad_value_ per parameter) saw .grad already stepped and freed under a fused update.
  Approach: a patched layer checks its parameters' hook dicts at every forward (two len() calls):
  when one carries a hook besides memsched's own, that call runs the stock forward and is
  counted as an autograd use, so autograd sums the gradient and calls the hook with all of it, as
  plain PyTorch does. With a fused update, memsched's post-accumulate-grad hook (which may step
  the parameter) is moved behind the caller's at the start of each iteration, so the caller's
  hook sees and may change the accumulated .grad before the update.
  A hook registered between a forward and its backward comes too late for that forward: the
  layer's weight gradient was already deferred. The runtime keeps each parameter's two hook dicts
  and, at the start of every backward pass (before any gradient or parameter changes), checks in
  C++ the parameters that this iteration's deferred uses feed (DwRuntime.first_hooked_deferred):
  one that now carries a caller's hook is refused with a MemschedError naming it and the fix
  (register the hook before the forward). memsched's post-accumulate-grad hooks are moved behind
  hooks registered since the forward at that point too (DwRuntime.post_hooks_last, also C++).
  Limitations: a hook registered during the backward pass (from another hook) is not checked.

Note [Tied parameters]
  Rationale: a parameter owned by several modules (a T5/BART shared embedding tied to the output
  nn.Linear) gets some gradient through autograd and some through the deferred layer. Mixing the
  two sums them in another order than autograd's InputBuffer when autograd sees two or more uses
  (HF T5: 1.2e-7 off after 3 steps).
  Approach: a Linear/Conv owning a parameter that a module memsched does not patch also owns
  (named_parameters(remove_duplicate=False) lists it twice) is not patched; all uses of that
  parameter then go through autograd, bitwise as plain. A parameter whose owners are all
  patchable (two Linears sharing a weight, one layer reached by several paths) stays deferred:
  all its uses are deferred and summed in autograd's order.
  Limitations: a patched layer's weight also read functionally (F.linear(x, layer.weight)) is
  refused (Note [AccumulateGrad gate]). A patched layer called both ways in one iteration (under
  autocast and not, say) sums all its contributions in arrival order (Note [One kind of use per
  parameter and iteration]).

Note [Gradients the fused update did not see]
  Rationale: plain optimizer.step() steps every parameter whose .grad is not None. A parameter
  whose gradient no backward pass delivered -- a zero tensor left by zero_grad(set_to_none=False),
  a branch or MoE expert unused this step -- is stepped by plain AdamW (its step count advances,
  weight decay applies) and SGD (momentum) but was never made final, so the fused update skipped
  it; and a step whose gradients came from torch.autograd.grad and were set by hand had no backward
  pass at all, so step() returned False and nothing was updated. What plain holds in the .grad of a
  parameter whose gradient the fused update freed depends on how the caller zeroes: None after
  set_to_none=True, a zero tensor after zeroing in place, the old gradient when nothing zeroes it.
  Approach: every zero_grad of the optimizer or of a module owning the parameters is watched
  (zero_grad_watch.py, Note [Watching zero_grad]). A parameter the fused update freed is
  "undeclared" until such a call covers it: set_to_none=True forgets it, set_to_none=False marks
  it zeroed. step() (OutOfOrderBackward.step, run.step()) counts as set_to_none=True for what is
  still undeclared, unless a later zero_grad(set_to_none=False) says otherwise; memsched.optimize's
  routing of the caller's own optimizer.step() does not (the loop zeroes after it). At the start of
  a backward pass -- before it changes any gradient or parameter -- an undeclared parameter whose
  .grad is still None (zeroed by hand in place, or never zeroed: memsched cannot know which) is
  refused with a MemschedError naming the calls that fix it; one whose .grad the caller set again
  (p.grad = torch.zeros_like(p)) is fine. At the end of the last micro-step's backward a zeroed
  parameter no pass reached gets a zero .grad again (before DDP's buckets are reduced, so a zero
  gradient is reduced and stepped as DDP does), and without DDP every parameter still holding a
  .grad (the fused update frees the gradients it steps) is stepped in one grouped call; under DDP
  memsched's bucket reducer steps them with their bucket. step() after no backward pass returns
  True, so the caller (run.step()) runs optimizer.step(). The optimizer's parameters outside the
  model (a learned temperature used in the loss) that hold a .grad are stepped in the same place:
  run.step() skips optimizer.step() after a fused update, so they were never stepped.
  Limitations: zero_grad of an optimizer or module subclass that does not call torch's is not seen
  (the next backward is refused). Under DDP with several processes, a parameter that this rank did
  not reach and whose .grad is None gets the other ranks' reduced gradient, as under plain DDP
  (ooo/ddp.py, "Unused parameters"). Under memsched's DDP bucket reducer the optimizer's parameters
  outside the model are stepped at the end of the last micro-step's backward, with their local
  gradients as under plain DDP (which does not reduce them either); they were not stepped at all
  (found by a helper probing compositions under DDP: a learned temperature stopped training, 2.17 off
  plain DDP after five steps).

Note [Linear inputs that at::linear reduces in another order]
  Rationale: the deferred dW/db of a Linear are mm and sum(0) over the input and output gradient
  flattened to rows, which is what autograd computes for at::linear's addmm path (a 2-D input, or a
  contiguous one flattened). For an input of more than two dimensions that is not contiguous (a
  transposed [T, B, D] view), at::linear runs matmul and adds the bias in place, so autograd reduces
  the bias gradient over the output gradient's own dimensions in memory order: it differed from the
  rows' sum(0) in the last bits when the output gradient was not contiguous either (found with a
  Linear applied to `h.view(B, T, D).transpose(0, 1)`). The weight gradient stays the rows' mm: with
  the weight requiring grad, matmul folds such an input into rows too.
  Approach: such a call with a bias that requires grad runs the stock forward and counts as an
  autograd use of its parameters, as an autocast call does; every other call keeps the deferred path.

Note [Linear calls the deferred path gives at::linear's own rows]
  Rationale: autograd's gradients of at::linear depend on the matrices at::linear multiplies, which
  the deferred Function did not always see: (a) mm_mat1_backward computes the input gradient as
  (W^T grad^T)^T when the input matrix is column-major (a transposed [B, D] input, a [1, 1] one),
  where the Function's grad.mm(W) differed in the last bits (Linear(33, 33) on a [3, 33] view of a
  [33, 3] tensor); (b) with a frozen weight, the Function's grad.matmul(W) over a 3-D output
  gradient that is not contiguous takes bmm where autograd multiplies the flattened rows, so the
  input gradient differed (float64, 1e-16); (c) for an input flattened with a bias (3-D contiguous,
  1-D) at::linear returns a view of addmm's output: returned from the Function it is a view made in
  a custom Function, and an in-place op on it (relu_, mul_) raised "Output 0 of ... LinearFunction
  is a view and is being modified inplace" where plain PyTorch runs; (d) a weight whose strides are
  not a contiguous matrix's (a transposed Parameter) gets autograd's gradient as (rows^T grad)^T in
  the weight's own layout, where the deferred one is grad^T rows, contiguous (the fused AdamW kernel
  then read the gradient in the wrong order: 3e-2 off).
  Approach: a contiguous input of more than two dimensions with a trainable weight goes to the
  Function as it is. Without a bias at::linear folds it to contiguous rows (matmul), the
  Function's grad.matmul(W) in backward folds the output gradient to rows as autograd's does, and
  its output is no view. With a bias the Function flattens it as at::linear does and returns
  addmm's [rows, out] output (deferred_linear's flat; its dX reshaped back as the reshape's
  backward does), which the caller views back outside it. Any other input the patched forward (and
  the C++ fast path) hands over as the [rows, in] matrix at::linear itself multiplies
  (x.reshape(rows, in), as at::linear's flatten and matmul's fold do; a 1-D input with a bias
  viewed [1, in]). Either way the caller gives back at::linear's output form (_linear_output: a view
  where it flattened with a bias, an _unsafe_view where matmul folded), so the Function's output
  gradient is autograd's flattened one. The view matters: (e) an in-place op on the output of a
  flattened Linear with a bias rebases that view (with grad) or regenerates its grad_fn (under
  no_grad), and addmm's backward then gets the base's contiguous gradient; the Function's output
  returned as no view kept a transposed output gradient's layout and summed the bias gradient in
  another order (1e-6 off, found by fuzzing).
  A call whose matrix is column-major, or whose trainable weight is not a contiguous matrix, runs
  the stock forward and counts as an autograd use.

Note [Conv weight gradients in the weight's layout]
  Rationale: autograd's AccumulateGrad stores a gradient in its parameter's layout (the gradient
  layout contract: a channels_last weight gets a channels_last .grad), while the deferred weight
  gradient is stored as aten.convolution_backward returns it, and that layout depends on the
  backend it picks: channels_last when the input or the weight is (oneDNN), contiguous on the
  float64 and other native paths even for a channels_last weight; which one runs depends on the
  dtype, the sizes and the thread count. Found with a channels_last input and a contiguous weight
  (float32) and with a channels_last weight (float64): equal values in another layout, which
  torch's fused Adam/AdamW/SGD kernels (fused=True) read element by element in the parameter's
  order, so the update was wrong (6e-2 off) -- also with ooo=True alone, where the caller's
  optimizer.step() reads that .grad.
  Approach: a conv call with a trainable weight is deferred only when its input and its weight
  are both contiguous, where every CPU backend returns a contiguous weight gradient; any other
  call (channels_last input or weight, a sliced input) runs the stock forward and counts as an
  autograd use.
  Limitations: channels_last models get no deferred weight gradients. Storing the deferred
  gradient as AccumulateGrad does (clone_obey_contract in DwRuntime::finalize) would lift this.

Note [Layer calls out-of-order backward leaves to autograd]
  Rationale: the deferred Functions reproduce a stock Linear/conv call only for what they were
  written for; fuzzing found the rest: a complex weight (the deferred dW misses the conjugate:
  3.85 off), a conv whose padding_mode was set to 'reflect' after install (zero padding: 8.3 off)
  or whose padding, stride or dilation was set to an int or a string (a raw pybind TypeError), a
  tensor subclass input whose __torch_function__ the Function bypassed (its output came back a
  plain Tensor), and torch.func.functional_call, whose substitute tensors stand in the module's
  parameters for one call (a raw TypeError from _user_hooked; a hooked substitute lost its gradient).
  Approach: at every call the patched forward (and the C++ fast path, which leaves such calls to
  it) checks these; a call with a complex input or weight, a __torch_function__ override or mode
  among its arguments, or a conv whose padding_mode is not 'zeros' or whose padding, stride or
  dilation is not a tuple runs the stock forward, counted as an autograd use of its parameters
  (Note [One kind of use per parameter and iteration]). A weight or bias that is not the registered
  parameter (a functional_call substitute) is not memsched's: the call runs as if frozen. A call
  inside a torch.func transform (jvp, vmap, grad: PyTorch refuses C++ autograd Functions there) or on
  an input with a forward-mode tangent (torch.autograd.forward_ad: they have no jvp) is autograd's too
  (_forward_mode); both raised PyTorch's own RuntimeError where plain PyTorch computes.

Note [Deferred calls under autocast]
  Rationale: under torch.autocast every Linear/conv call went to autograd (autocast casts the weight
  once per autocast region and autograd sums that region's weight gradients in the autocast dtype in
  the cast's node, which a deferral per call in float32 would not reproduce), so a model trained in
  bf16 autocast -- most of them -- deferred nothing and gained nothing from ooo.
  Approach: a call under autocast is deferred in the autocast dtype when its parameter's every use in
  the last iteration was such a call in one autocast region (learned at the start of each iteration
  from the one before: _learn_cast_uses; the first iteration goes through autograd): the patched
  forward casts x, the weight and the bias as autocast's own wrapper does (at::autocast::cached_cast,
  _C.autocast_cast: the weight's cast is the region's cached one, whose identity tells regions apart)
  and applies the deferred Function to the cast tensors. Its weight gradients are summed in the runtime
  in the autocast dtype in arrival order, as the cast node's input buffer sums them, and cast to the
  parameter's dtype when the parameter is final (DwRuntime::finalize), as the cast node does, before
  .grad (or the fused update) takes them: bitwise autograd's. Only what autocast's cast reproduces is
  taken: the autocast cache on, float32 weight and bias, an input in float32 or in the autocast dtype,
  and a call the deferred Function takes as it is (the rows at::linear multiplies; a contiguous conv).
  Limitations: a parameter so deferred that is then used otherwise in the same iteration (outside its
  region, in a second region, or by a call left to autograd) is refused in forward, naming it, and is
  never deferred under autocast again in that installation: the runtime's autocast-dtype sum cannot take
  that contribution in autograd's order. A program whose pattern of use changes from one iteration to
  the next can meet this once. Under memsched.optimize the profiled step is the first such iteration:
  its trace holds autograd's saves, which the later deferred steps would not match (two plain steps
  and a re-profile), so a profile after which deferral begins (cast_deferral_pending) is dropped and
  the next step profiled (Run.cast_warmup_profiles_). The C++ fast path (Note [Fast path of a patched
  layer call]) takes the calls this path would defer, with the same state (the runtime holds
  _cast_region, _cast_eligible and _MIXED: set_cast_state); every other call under autocast comes here.

Note [One kind of use per parameter and iteration]
  Rationale: autograd sums a parameter's contributions in the order they arrive, and float addition
  is not associative. A patched layer called both ways in one iteration -- some calls deferred, some
  through autograd (an input layout the deferred path leaves to autograd, a call under autocast) --
  had its deferred contributions summed in the runtime and its autograd ones in AccumulateGrad, and
  the two sums added: another order than autograd's once there were three contributions (a Linear on
  two row-major inputs and one column-major: 1e-6 off). A queueing executor (a byte limit above 0,
  "thread": 64 MiB by default, DDP) ran a parameter's queued items by priority (the item holding
  the most bytes first), so three or more deferred uses were summed out of arrival order too (a Linear
  on 8, 2 and 4 rows).
  Approach: the first use of a parameter in an iteration fixes its kind for the iteration.
  _AUTOGRAD (that call needed autograd's math): later calls that could be deferred run the deferred
  Function with index -1 for it, which hands the gradient to autograd at once, so autograd sums all.
  _DEFERRED: a later call that needs autograd's math runs the stock forward on a _Tap of the
  parameter, whose backward adds the call's gradient to the deferred sum where it arrives (in the
  parameter's layout, as AccumulateGrad would store it) instead of passing it to the AccumulateGrad
  node. With a queueing executor, from a parameter's second use in an iteration on, each of its
  deferred calls' nodes (the first one's too) gets a pre-hook that, just before the item is queued,
  runs the queued items if one of them is for one of the call's parameters (as a _Tap does before it
  adds), so each parameter's contributions complete in arrival order. Under
  torch.autograd.grad() asking for the parameter a _Tap passes the gradient on (plain). Calls of a
  parameter with a caller's gradient hook stay the stock forward (Note [Parameters with gradient
  hooks]). Under autocast a deferred-kind parameter gets no _Tap: autocast casts a weight once per
  autocast region (its cast cache) and autograd sums that region's calls in bfloat16 in the cast's
  node before the parameter sees them (a _Tap per call split that sum: 5e-3 off). Such a call goes to
  autograd, whose sum the runtime adds to the deferred one: autograd's order for two contributions;
  a use that makes three is refused (MemschedError, in forward) -- it may also refuse three uses whose
  autocast calls share one region, which plain sums as two. The thread executor gets no _Tap either:
  a tensor that has a Python object needs the GIL when the worker drops it, which DwRuntime::finalize
  does under the runtime's lock while the engine thread, in memsched's gradient hook, holds the GIL
  and waits for that lock (a Linear called row-major, then column-major, hung); such calls are
  treated as autocast ones are.
  Limitations: a _Tap costs a Python Function per parameter and call, and a queueing executor a
  Python pre-hook per deferred call of a parameter used more than once; the flush runs a reused
  layer's items earlier than the byte limit alone would. A queueing executor keeps the node of each
  parameter's first deferred call until that backward pass ends.

Note [Executors]
  "inline" (default on CPU): urgent items run inside the backward Function
  that queued them, the rest at the end-of-backward flush, on the autograd
  thread. Waiting buys nothing on one thread except DDP bucket ordering, and
  every waiting item keeps a layer input and an output gradient alive that
  plain autograd frees right after that layer's backward (realistic
  transformer, batch 8: 73 MiB held at the flush with no limit, 9 MiB with
  limit 0; the step's peak, at the start of backward, is the same), so
  without DDP and without an explicit max_deferred_bytes the inline
  executor's limit is 0: each dW runs right after its dX, the fused update
  still frees each gradient at once. Elsewhere the default limit is
  DEFAULT_MAX_DEFERRED_BYTES.
  "stream" (CUDA): each item runs as soon as it is queued, on a side
  stream that first waits for the compute stream, so the dX chain never waits
  for dW; sums, .grad and the fused update stay on the side stream, and the
  end-of-backward callback makes the compute stream wait for the side stream
  once (See Note [Streams of out-of-order backward] in csrc/torch/dw_runtime.h).
  "thread" (CPU): a C++ worker thread runs items while autograd continues. It is
  correct (tests compare it bitwise) but on CPU both sides compete for the
  same cores and intra-op thread pool: measure before using it (bench_ooo.py).
"""
from __future__ import annotations

import math
import functools
import numbers
import sys
import threading
import time
import warnings
import weakref
from operator import is_
from typing import Dict, List, Optional, Sequence, Set

import torch
import torch.autograd.forward_ad as _fw_ad
import torch.nn as nn
import torch.nn.functional as F
from torch.autograd.graph import get_gradient_edge
from torch.nn.utils import parametrize

from memsched._C import DwRuntime, MemschedError, deferred_conv, deferred_linear
from memsched._C import autocast_cast as _autocast_cast
from memsched._C import guard_retained_graph as _guard_retained_graph
from memsched.copy_inert import PatchedForward, inert_on_copy
from memsched.errors import MemschedArgumentError  # See Note [Argument errors of both kinds]
from memsched.ooo import clip_guard, grad_scaler_guard
from memsched.ooo import ddp as ddp_support
from memsched.ooo.fused import SUPPORTED_OPTIMIZERS, ParamStepper, has_step_hooks
from memsched.ooo.zero_grad_watch import ZeroGradWatch
from memsched.units import parse_bytes
from memsched.user_frame import user_stacklevel  # See Note [Warnings point at the caller's code]

DEFAULT_MAX_DEFERRED_BYTES = 64 * 1024 * 1024

_CONV_TYPES = {nn.Conv1d: 1, nn.Conv2d: 2, nn.Conv3d: 3}


def _hypers(optimizer) -> list:
    """Every param group's entries but "params", a tensor as (identity, version) (See Note [Edits
    between backward and the step boundary])."""
    return [{k: (id(v), v._version) if isinstance(v, torch.Tensor) else v for k, v in g.items() if k != "params"}
            for g in optimizer.param_groups]


def _eligible(module: nn.Module) -> bool:
    """Linear and Conv1d/2d/3d whose forward is the stock one (subclasses that
    override forward stay plain), with zero padding given as numbers."""
    t = type(module)
    # A parametrized weight (torch.nn.utils.parametrize, weight_norm) or one
    # recomputed by a forward pre-hook (legacy weight_norm/spectral_norm) is no
    # leaf Parameter of the module: its gradient must flow through autograd.
    if parametrize.is_parametrized(module):
        return False
    if "weight" not in module._parameters or module._parameters["weight"] is None:
        # deleted and set by a forward pre-hook from a Parameter of another name (AWD-LSTM's WeightDrop,
        # DropConnect): `del lin.weight` left no attribute, which the check below took for none needed (an
        # AttributeError at install; found by a helper)
        return False
    for name in ("weight", "bias"):
        if name not in module._parameters and getattr(module, name, None) is not None:
            return False
    if isinstance(module, nn.Linear):
        return t.forward is nn.Linear.forward
    for base in _CONV_TYPES:
        if isinstance(module, base):
            return (t.forward is base.forward and module.padding_mode == "zeros"
                    and not isinstance(module.padding, str) and not module.transposed)
    return False


_unsafe_view = torch.ops.aten._unsafe_view
_has_torch_function = torch._C._has_torch_function  # a __torch_function__ override (or mode) among its arguments
_peek_transform = torch._C._functorch.peek_interpreter_stack


def _forward_mode(x: torch.Tensor) -> bool:
    """The call runs inside a torch.func transform (jvp, vmap, grad, ...) or x carries a forward-mode tangent
    (torch.autograd.forward_ad): the deferred Functions have neither a jvp nor a functorch rule, so the call is
    autograd's (Note [Layer calls out-of-order backward leaves to autograd])."""
    return _peek_transform() is not None or (_fw_ad._current_level >= 0 and _fw_ad.unpack_dual(x).tangent is not None)


def _linear_rows(x: torch.Tensor, has_bias: bool, folds: bool):
    """What the deferred Linear is applied to: x itself (2-D; 1-D or more than two dimensions where
    at::linear's own flattening and the Function's matmul in backward, which folds x's leading
    dimensions when the weight requires grad (folds), multiply the same contiguous rows), the [rows,
    in] matrix at::linear itself multiplies (otherwise), or None when autograd must run the call: the
    matrix is column-major, where autograd's input gradient is a differently ordered mm, or x has more
    than two dimensions, is not contiguous and meets a bias (See Notes [Linear inputs that at::linear
    reduces in another order], [Linear calls the deferred path gives at::linear's own rows])."""
    d = x.dim()
    if d == 2:
        rows = x
    elif d == 1:
        if x.size(0) == 1:
            return None  # [1, 1]: column-major strides
        if not (has_bias and x.is_contiguous()):
            return x
        rows = x.view(1, x.size(0))
    elif d == 0:
        return x  # at::linear raises its own error
    else:
        contiguous = x.is_contiguous()
        if contiguous and folds and x.numel() > x.size(-1) > 1:
            return x  # rows > 1 and in > 1: row-major [rows, in] strides (with a bias: deferred_linear's flat)
        if has_bias and not contiguous:
            return None
        n = 1
        for k in x.shape[:-1]:
            n *= k
        rows = x.reshape(n, x.size(-1))  # at::linear's reshape: a view, or the copy it makes too
    if rows.stride(0) == 1 and rows.stride(1) == rows.size(0):
        return None
    return rows if d != 2 else x


def _linear_output(x, out, has_bias: bool):
    """The deferred Linear's output in at::linear's own form (Note [Linear calls the deferred path gives
    at::linear's own rows]): as the Function returned it when it has x's dimensions, else a view of it for
    rows flattened with a bias (so an in-place op on it rebases or regenerates the view as plain's does),
    an _unsafe_view where matmul folded them."""
    if out.dim() == x.dim():
        return out
    shape = x.shape[:-1] + out.shape[-1:]
    return out.view(shape) if has_bias else _unsafe_view(out, shape)


def _deferred_linear_call(rt, rows, x, w, b, wd, bd, token):
    """deferred_linear on `rows` (_linear_rows(x)): x itself of more than two dimensions with a bias is
    flattened inside (flat), its output for _linear_output to view back."""
    return deferred_linear(rt, rows, w, b, wd, bd, token, rows is x and x.dim() > 2 and b is not None)


def _deferred_linear_rows(rt, x, w, b, wd, bd, token):
    """_deferred_linear_call on the rows at::linear multiplies (the caller checked there are some)."""
    return _deferred_linear_call(rt, _linear_rows(x, b is not None, True), x, w, b, wd, bd, token)


def _cast_args(x, w, b, device_type):
    """(x, w, b) as autocast's own wrapper of linear/conv casts them (the weight's cast cached for the autocast
    region), or None when that is not what the deferred path reproduces: autocast's cache off, an argument of
    another dtype than float32 (or x already in the autocast dtype). See Note [Deferred calls under autocast]."""
    dtype = torch.get_autocast_dtype(device_type)
    if not torch.is_autocast_cache_enabled() or dtype not in _LOW_FLOATS or w.dtype != torch.float32 \
            or (b is not None and b.dtype != torch.float32) or x.dtype not in (torch.float32, dtype):
        return None
    return (_autocast_cast(x, device_type), _autocast_cast(w, device_type),
            None if b is None else _autocast_cast(b, device_type))


_DEFERRED, _AUTOGRAD = 1, 2  # a parameter's kind of use in one iteration (Note [One kind of use per parameter and iteration])
_DEFERRED_CAST = 3  # deferred in autocast's dtype (Note [Deferred calls under autocast])
_MIXED = object()  # a parameter used otherwise than by deferrable calls of one autocast region (same Note)
_LOW_FLOATS = (torch.float16, torch.bfloat16)


def _dense(t: torch.Tensor) -> bool:
    """t's elements fill its storage span once (is_non_overlapping_and_dense)."""
    expected = 1
    for stride, size in sorted((st, sz) for sz, st in zip(t.shape, t.stride()) if sz != 1):
        if stride != expected:
            return False
        expected *= size
    return True


def _in_layout_of(g: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """g as AccumulateGrad would store it for p (the gradient layout contract: p's strides when p is
    dense, else contiguous); g itself when it already is."""
    if g.stride() == p.stride():
        return g
    if _dense(p):
        if all(gs == ps if n != 1 else gs != 0 for n, gs, ps in zip(g.shape, g.stride(), p.stride())):
            return g
        return torch.empty_strided(p.shape, p.stride(), dtype=g.dtype, device=g.device).copy_(g)
    return g.contiguous()


class _Tap(torch.autograd.Function):
    """See Note [One kind of use per parameter and iteration]: the identity on a parameter for one layer
    call that autograd computes; the gradient this call gives the parameter arrives in backward() and
    joins the parameter's deferred sum where it arrives, instead of reaching its AccumulateGrad."""

    @staticmethod
    def forward(ctx, p, owner, i):
        ctx.owner, ctx.i = owner, i
        return p.view_as(p)

    @staticmethod
    def backward(ctx, g):
        try:
            taken = g is not None and not torch.is_grad_enabled() and ctx.owner._tap_arrived(ctx.i, g)
        except ReferenceError:  # the OutOfOrderBackward is gone: plain
            taken = False
        return (None if taken else g), None, None


def _before_queued(owner, params, grad_outputs):
    """Pre-hook of a deferred call's node, run just before it queues its item (Note [One kind of use
    per parameter and iteration])."""
    try:
        owner._arriving(params)
    except ReferenceError:
        pass


def _in_reentrant_checkpoint(method: str = "forward") -> bool:
    """True inside the forward (or, with method="backward", the backward: its nested backward pass, Note [A
    reentrant checkpoint's nested backward passes]) of torch.utils.checkpoint(..., use_reentrant=True)."""
    ckpt = sys.modules.get("torch.utils.checkpoint")
    fn = getattr(ckpt, "CheckpointFunction", None)
    if fn is None:
        return False
    code = getattr(fn, method).__code__
    f = sys._getframe(1)
    while f is not None:
        if f.f_code is code:
            return True
        f = f.f_back
    return False


_REENTRANT_MESSAGE = (
    "torch.utils.checkpoint(..., use_reentrant=True) cannot be combined with fuse_optimizer=True: its "
    "segments run forward under no_grad and recompute it as a separate backward pass, so a parameter used "
    "there is not counted before backward starts and could be updated before all of its gradient arrived. "
    "Use checkpoint(..., use_reentrant=False) (a Hugging Face model: {'use_reentrant': "
    "False} as TrainingArguments' gradient_checkpointing_kwargs, or to gradient_checkpointing_enable()), or "
    "fuse_optimizer=False.")


class _IterationGraph:
    """Kept by every Deferred* node of one iteration; dies with the last of them."""

    __slots__ = ("__weakref__",)


def _nbytes(t: Optional[torch.Tensor]) -> int:
    return 0 if t is None else t.numel() * t.element_size()


def _user_hooked(p: torch.Tensor) -> bool:
    """p carries a gradient hook of the caller's besides memsched's own one of each kind (See
    Note [Parameters with gradient hooks])."""
    return len(p._backward_hooks) > 1 or len(p._post_accumulate_grad_hooks) > 1


_DROPPED = ("The gradients of this step are dropped (every .grad of the model set to None, as zero_grad("
            "set_to_none=True) does) once the pass is abandoned -- at the next forward, step() or when the Run is "
            "left -- so a retry starts from none (Note [A failed backward]).")


class OutOfOrderBackward:
    """Defers weight gradients of eligible layers; optionally fuses the optimizer update.

    Args:
      model: the nn.Module, or a DistributedDataParallel wrapping it.
      optimizer: torch.optim.SGD / Adam / AdamW; needed for fuse_optimizer.
      fuse_optimizer: step each parameter as soon as its gradient is final (last
        micro-step only) and free the gradient. Then do not call optimizer.step().
      max_deferred_bytes: bound on the bytes (layer inputs + output gradients)
        that queued work keeps alive; int or "64MiB"; 0 runs every item at once.
        Default: 0 for the inline executor without DDP, else 64 MiB.
      grad_accumulation_steps: backward passes per optimizer step.
      max_grad_norm: global gradient-norm clipping. Not possible with a fused
        update (raises); without fusion, step() clips before returning True.
      executor: "auto" (stream on CUDA, inline on CPU), "inline", "thread", "stream".
      update_batch_bytes: with fuse_optimizer, layers whose gradients are final wait until they
        hold this many bytes of gradients and are updated in one call; int or "32MiB"; 0: each
        layer at once. Default: 0 on CPU, an eighth of the parameters' bytes on a GPU (See
        Note [Update batches]).
    """

    def __init__(self, model: nn.Module, optimizer: Optional[torch.optim.Optimizer] = None,
                 fuse_optimizer: bool = False, max_deferred_bytes=None, grad_accumulation_steps: int = 1,
                 max_grad_norm: Optional[float] = None, executor: str = "auto", update_batch_bytes=None):
        if not isinstance(model, nn.Module):
            raise MemschedArgumentError(f"model: expected a torch.nn.Module (or a DistributedDataParallel wrapping one), "
                                f"got {type(model).__name__}")
        lazy = next((n for n, p in model.named_parameters() if torch.nn.parameter.is_lazy(p)), None)
        if lazy is not None:
            raise MemschedArgumentError(f"model: parameter {lazy} is not initialized yet (a LazyModule such as "
                                f"nn.LazyLinear); run the model once on a batch before OutOfOrderBackward (under "
                                f"torch.no_grad() is enough)")
        if not isinstance(fuse_optimizer, bool):
            raise MemschedArgumentError(f"fuse_optimizer: expected True or False, got {fuse_optimizer!r}")
        if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
            # was accepted without fusion and silently unused (a class, a list of optimizers)
            what = (f"the class {optimizer.__module__}.{optimizer.__qualname__}" if isinstance(optimizer, type)
                    else type(optimizer).__name__)
            raise MemschedArgumentError(f"optimizer: expected a torch.optim.Optimizer instance (or None), got {what}; "
                                f"pass the optimizer built from the model's parameters, e.g. "
                                f"torch.optim.AdamW(model.parameters(), lr=...)")
        if fuse_optimizer and optimizer is None:
            raise MemschedArgumentError("fuse_optimizer=True needs optimizer=...: the torch.optim optimizer whose "
                                "update runs per parameter during backward")
        if fuse_optimizer and type(optimizer) not in SUPPORTED_OPTIMIZERS:
            # checked here, so memsched.optimize(...) refuses it too, before the `with` block
            raise MemschedArgumentError(
                f"optimizer: fuse_optimizer=True supports torch.optim.SGD, Adam and AdamW (per-parameter "
                f"updates); got {type(optimizer).__module__}.{type(optimizer).__qualname__}. Use "
                f"fuse_optimizer=False (ooo=True alone) and let optimizer.step() run after backward.")
        if fuse_optimizer and max_grad_norm is not None:
            raise MemschedArgumentError(
                "max_grad_norm: global gradient-norm clipping cannot be fused with the optimizer update -- "
                "the norm needs every gradient before the first parameter is updated, and the fused update "
                "frees each gradient as soon as it is used. Use fuse_optimizer=False (ooo=True alone) with "
                "torch.nn.utils.clip_grad_norm_ before optimizer.step() (or max_grad_norm here, which clips "
                "in step()), or clip per parameter (torch.nn.utils.clip_grad_value_ in a "
                "register_post_accumulate_grad_hook).")
        if isinstance(grad_accumulation_steps, bool) or not isinstance(grad_accumulation_steps, numbers.Integral) \
                or grad_accumulation_steps < 1:
            raise MemschedArgumentError(f"grad_accumulation_steps must be a whole number >= 1 (backward passes per "
                                f"optimizer step), got {grad_accumulation_steps!r}")
        if max_grad_norm is not None and (isinstance(max_grad_norm, bool)
                                          or not isinstance(max_grad_norm, numbers.Real)
                                          or not math.isfinite(max_grad_norm) or max_grad_norm <= 0):
            raise MemschedArgumentError(f"max_grad_norm must be None or a finite number > 0 (the global gradient norm "
                                f"to clip to), got {max_grad_norm!r}")
        if executor not in ("auto", "inline", "thread", "stream"):
            raise MemschedArgumentError(f"executor must be 'auto', 'inline', 'thread' or 'stream', got {executor!r}")
        self._limit_given = max_deferred_bytes is not None
        if max_deferred_bytes is None:
            max_deferred_bytes = DEFAULT_MAX_DEFERRED_BYTES  # resolved at install (See Note [Executors])
        else:
            try:  # an int, a whole float or "64MiB"; the error names this argument, not "budget"
                max_deferred_bytes = parse_bytes(max_deferred_bytes, name="max_deferred_bytes")
            except ValueError as e:
                raise MemschedArgumentError(f"{e} (max_deferred_bytes >= 0; 0 = run every item at once)") from None
        if update_batch_bytes is not None:
            try:
                update_batch_bytes = parse_bytes(update_batch_bytes, name="update_batch_bytes")
            except ValueError as e:
                raise MemschedArgumentError(f"{e} (update_batch_bytes >= 0; 0 = update each layer at once; "
                                            f"None = the default, Note [Update batches])") from None
        self.update_batch_bytes = update_batch_bytes  # None: resolved at install (Note [Update batches])
        self.model = model
        self.optimizer = optimizer
        self.fuse_optimizer = bool(fuse_optimizer)
        # None, or a callable: true while the owner wants backward passes unfused (memsched.optimize's
        # profiled step: Note [The profiled step updates after backward] in optimize.py)
        self.fusion_paused = None
        self.max_deferred_bytes = int(max_deferred_bytes)
        self.grad_accumulation_steps = int(grad_accumulation_steps)
        self.max_grad_norm = max_grad_norm
        self.executor_name = executor
        self._installed = False
        self._reset_state()

    _PHASES = {"idle": 0, "forward": 1, "backward": 2}

    def _resolved_update_batch_bytes(self) -> int:
        """See Note [Update batches]: the caller's, else 0 on CPU and an eighth of the parameters' bytes on
        an accelerator."""
        if self.update_batch_bytes is not None:
            return int(self.update_batch_bytes)
        devices = {p.device for p in self._params}
        if len(devices) != 1 or next(iter(devices)).type == "cpu":
            return 0  # CPU; or a model spread over devices, whose units are stepped on their own side streams
        return sum(_nbytes(p) for p in self._params) // 8

    @property
    def _phase(self) -> str:
        """idle / forward / backward; mirrored into the runtime (its hooks read it)."""
        return self._phase_name

    @_phase.setter
    def _phase(self, value: str) -> None:
        self._phase_name = value
        rt = self.__dict__.get("_rt")
        if rt is not None:
            rt.phase = self._PHASES[value]

    # ------------------------------------------------------------------ install
    def _reset_state(self) -> None:
        self._patched: List[tuple] = []  # (module, had_instance_forward, old)
        self._eligible_layers = 0
        self._handles: List = []
        self._params: List[nn.Parameter] = []
        self._index: Dict[int, int] = {}
        self._frozen: List[nn.Parameter] = []  # See Note [Parameters added or unfrozen after install]
        self._owned: List[tuple] = []  # (module, its (name, Parameter) pairs at install); same Note
        self._patchable: Set[int] = set()  # ids of modules patched (See Note [Tied parameters])
        self._structure_changed = True
        self._deferred_only: Set[int] = set()
        self._kind: Dict[int, int] = {}  # this iteration's kind of use per parameter (_DEFERRED / _AUTOGRAD)
        self._maybe_queued: Set[int] = set()  # parameters an item of which may wait in the queue
        self._cast_uses: Dict[int, int] = {}  # deferred-kind parameters' uses under autocast this iteration
        # See Note [Deferred calls under autocast]: this iteration's autocast region per parameter (a weak
        # reference to its cached cast, or _MIXED), what the last iterations taught, and what never qualifies
        self._cast_region: Dict[int, object] = {}
        self._cast_eligible: Set[int] = set()
        self._cast_began_at = -1  # completed iterations when a parameter last became eligible (cast_deferral_began_since)
        self._cast_never: Set[int] = set()
        self._first_node: Dict[int, tuple] = {}  # queueing executors: a parameter's first deferred node
        self._queues = False  # items may wait in the queue and complete out of arrival order
        self._acc: List = []  # each parameter's AccumulateGrad node
        self._phase = "idle"
        self._callback_queued = False
        self._forward_since_end = False  # See Note [A backward over an ended iteration's graph]
        self._root_called = False  # the root module's forward ran since install (same Note)
        self._micro_step = 0
        self._backwards_since_step = 0   # backward passes since the last step()
        self._updated_since_step = False # a fused update ran since the last step()
        self._fusing = False             # this backward pass runs the fused update (set at its start)
        self._hypers_at_update = []      # See Note [Edits between backward and the step boundary]
        self._warned_late_edit = False
        self._warned_step_hooks = False
        self._warned_read_updated = False  # See _warn_read_updated
        self._zeroed_after_update = False  # zero_grad() after a fused update, before step()
        self._discarded_pass = False  # See Note [Backward passes whose gradients the loop discards]
        self._discard_followed = False  # another backward pass of the step came after that zero_grad()
        self._forward_refused_after_update = False  # _refuse_extra_backward ran since the fused update
        self._update_raised = False   # the optimizer (or its hook) raised inside the fused update
        self._stepped_in_step = set()  # parameters the fused update stepped since the last step boundary
        self._refused_in_backward = False  # memsched refused this pass mid-backward (Note [A failed backward])
        self._pass_nested = False   # this pass began inside a reentrant checkpoint's backward (Note [A reentrant ...])
        self._nested_ended = False  # such passes ended and are not counted yet
        self._probation = False       # this step runs unfused: the last one discarded a pass
        self._step_called = False  # the caller's step() ran at least once
        self._warned_sync_each = False  # See ddp.py's Note [DDP features the bucket reduction replaces]
        self._iterations = 0
        self._fused_steps = 0
        self._native_seen = 0  # the runtime's native_updates at the end of the last backward
        self._native_steps = 0  # COUNT: fused updates run in C++ (See Note [Adam plan for the C++ update])
        self._iter_stepped = 0
        # See Note [Gradients the fused update did not see]
        self._undeclared: Set[int] = set()  # freed by the fused update; no zero_grad call covered them since
        self._zeroed: Set[int] = set()  # freed, then zero_grad(set_to_none=False): plain holds a zero .grad
        self._step_declared = False  # step() since the last free: _undeclared count as set to None
        self._zero_watch: Optional[ZeroGradWatch] = None
        self._last_peak_grad_bytes = 0
        self._reducer = None
        self._ddp_saved_sync = None
        self._stepper: Optional[ParamStepper] = None
        self._unit_of: List[int] = []     # parameter index -> its step unit (See Note [Step units])
        self._unit_size: List[int] = []   # parameters per unit
        self._timeline: List[tuple] = []
        self._last_timeline: List[tuple] = []
        self._outside_cache = None  # _step_outside: (the groups' parameters, those outside the model)
        self._lock = threading.RLock()
        self._rt: Optional[DwRuntime] = None  # See Note [dW runtime in C++] in csrc/torch/dw_runtime.h
        self._graph: Optional[weakref.ref] = None  # to this iteration's _IterationGraph (Note [A failed backward])

    def install(self) -> "OutOfOrderBackward":
        if self._installed:
            raise MemschedError("OutOfOrderBackward is already installed; call remove() first")
        self._reset_state()  # a second install() starts from scratch
        try:
            self._install()
        except BaseException:
            self.remove()
            raise
        self._installed = True
        return self

    def _install(self) -> None:
        from torch.nn.parallel import DistributedDataParallel

        model = self.model
        ddp = model if isinstance(model, DistributedDataParallel) else None
        root = model.module if ddp is not None else model
        self._root = root
        seen: Set[int] = set()
        for p in root.parameters():
            if p.requires_grad and id(p) not in seen:
                seen.add(id(p))
                self._index[id(p)] = len(self._params)
                self._params.append(p)
        # Which modules own each parameter directly (tied weights have several).
        owners: Dict[int, List[nn.Module]] = {}
        modules = list(dict.fromkeys(root.modules()))
        # See Note [Parameters added or unfrozen after install]
        self._frozen = [p for p in root.parameters() if id(p) not in self._index]
        self._structure_changed = False
        ref = weakref.ref(self)

        def _changed(*args):
            me_ = ref()
            if me_ is not None:
                me_._structure_changed = True

        self._handles.append(torch.nn.modules.module.register_module_parameter_registration_hook(_changed))
        self._handles.append(torch.nn.modules.module.register_module_module_registration_hook(_changed))

        def _root_forward(module, args):  # See Note [A backward over an ended iteration's graph]
            me_ = ref()
            if me_ is not None:
                me_._root_called = True
                if torch.is_grad_enabled():  # (a forward under no_grad makes no graph to go backward through)
                    me_._forward_since_end = True
                if me_._updated_since_step and not me_._warned_read_updated and not torch.is_grad_enabled():
                    me_._warn_read_updated()

        self._handles.append(root.register_forward_pre_hook(inert_on_copy(_root_forward)))
        # One OutOfOrderBackward per model: a second one would patch the first's forward, and removing
        # them out of order would leave a dead patch behind (every later forward: ReferenceError).
        for name, m in root.named_modules():
            if isinstance(m.__dict__.get("forward"), PatchedForward):
                where = f"layer '{name}'" if name else "the model"
                raise MemschedError(f"model: {where} is already patched by another OutOfOrderBackward (or "
                                    "memsched.optimize(..., ooo=True)) that is still installed; remove() it (leave "
                                    "its `with` block) before installing another on the same model")
        for m in modules:
            for p in m.parameters(recurse=False):
                if id(p) in self._index:
                    owners.setdefault(id(p), []).append(m)
        # See Note [Parameters added or unfrozen after install]: which Parameter each module owned
        self._owned = [(m, tuple(m._parameters.items())) for m in modules if m._parameters]
        # See Note [Tied parameters]: a Linear/Conv owning a parameter another module owns stays plain.
        tied = {pid for pid, ms in owners.items() if len(ms) > 1 and not all(_eligible(m) for m in ms)}
        self._patchable = {id(m) for m in modules if _eligible(m) and not any(
            id(p) in tied for p in m.parameters(recurse=False))}
        for pid, ms in owners.items():
            if all(id(m) in self._patchable for m in ms):
                self._deferred_only.add(self._index[pid])
        # See Note [Step units]: a parameter's unit is its first owner's own parameters.
        self._unit_of = [-1] * len(self._params)
        self._unit_size = []
        for m in modules:
            members = [self._index[id(p)] for p in m.parameters(recurse=False)
                       if id(p) in self._index and self._unit_of[self._index[id(p)]] < 0]
            for i in dict.fromkeys(members):
                self._unit_of[i] = len(self._unit_size)
            if members:
                self._unit_size.append(len(dict.fromkeys(members)))

        if ddp is not None:
            from memsched.ooo.ddp import BucketReducer

            if self.executor_name == "thread":
                raise MemschedError("executor='thread' is not supported under DistributedDataParallel: "
                                    "collectives must be issued in one order on every rank; use 'inline'")
            ddp_support.refuse_unsupported(ddp)  # See Note [DDP features the bucket reduction replaces]
            self._reducer = BucketReducer(ddp, self._params)
            self._ddp_saved_sync = ddp.require_backward_grad_sync
            ddp.require_backward_grad_sync = ddp_support.SYNC_OFF
            def _after_ddp_forward(module, args, output):
                me_ = ref()
                if me_ is not None and me_._reducer is not None:
                    # as DDP's own post-forward: buffers are broadcast at the next forward unless the
                    # caller's no_sync() is on (also between micro-steps of an accumulation)
                    ddp_support.buffers_after_forward(module, not ddp_support.in_no_sync(module))

            self._handles.append(ddp.register_forward_hook(inert_on_copy(_after_ddp_forward)))
        executor = self.executor_name
        if executor == "auto":
            executor = "stream" if any(p.is_cuda for p in self._params) else "inline"
        if not self._limit_given and executor == "inline" and ddp is None:
            self.max_deferred_bytes = 0
        if self.optimizer is not None and self.fuse_optimizer:
            self._stepper = ParamStepper(self.optimizer)
            grad_scaler_guard.guard(self)  # See Note [GradScaler and fused updates]
            clip_guard.guard(self)  # See Note [Clipping and fused updates]
        # See Note [Gradients the fused update did not see] and Note [Watching zero_grad]
        self._zero_watch = ZeroGradWatch(self.optimizer, self._params, self._on_zero_grad, self._zeroing_may_drop_a_pass)
        self._zero_watch.install()

        if executor == "stream" and not any(p.is_cuda for p in self._params):
            raise MemschedError("executor='stream' needs the model on a CUDA device; use 'inline' or 'thread'")
        self._executor = executor
        self._queues = executor == "thread" or (executor == "inline" and self.max_deferred_bytes > 0)
        rt = DwRuntime(self.max_deferred_bytes, executor, self)
        for i, p in enumerate(self._params):
            rt.add_param(p, self._reducer.bucket_of[i] if self._reducer is not None else -1)
        rt.notify = self._stepper is not None or self._reducer is not None
        rt.fused = self._stepper is not None  # See Note [A parameter read after its gradient is final]
        # See Note [The first fused iteration watches its parameter reads]
        rt.watching = self._stepper is not None and self.fusion_paused is None
        if self._stepper is not None and self._reducer is None:
            rt.set_units(self._unit_of)  # final parameters come back a whole unit at a time
            rt.update_batch_bytes = self._resolved_update_batch_bytes()  # See Note [Update batches]
        rt.poll_after_defer = self._reducer is not None
        # See Note [Fast path of a patched layer call] (csrc/torch/layer_fast_path.h): it reads and
        # writes these two dicts in place, and leaves calls a queueing executor orders to Python
        rt.set_iteration_dicts(self._kind, self._cast_uses)
        rt.set_cast_state(self._cast_region, self._cast_eligible, _MIXED)  # Note [Deferred calls under autocast]
        rt.fast_calls = not self._queues
        self._rt = rt
        self._native_seen = 0

        me = weakref.proxy(self)
        self._proxy = me
        for m in modules:
            if id(m) in self._patchable:
                self._patch(m, me)
            elif isinstance(m, torch.jit.ScriptModule):
                # torch refuses hooks on a ScriptModule; its parameters' gradients arrive through autograd,
                # counted at their first arrival (on_autograd_accumulated), as a functional read's are
                continue
            elif any(id(p) in self._index for p in m.parameters(recurse=False)):
                ids = [self._index[id(p)] for p in m.parameters(recurse=False) if id(p) in self._index]
                # a C function counting the use (Note [Fast path of a patched layer call])
                self._handles.append(m.register_forward_pre_hook(inert_on_copy(rt.autograd_use_hook(ids))))
        if not self._patched and self._params:
            warnings.warn(
                "memsched: out-of-order backward found no eligible layer in this model (stock nn.Linear and "
                "nn.Conv1d/2d/3d with zero padding, not subclasses with their own forward: Hugging Face GPT-2's "
                "Conv1D is not one), so it defers no weight gradient" +
                ("; the fused optimizer update still runs per layer" if self.fuse_optimizer else ""),
                RuntimeWarning, stacklevel=user_stacklevel())
        self._acc = [get_gradient_edge(p).node for p in self._params]  # the runtime holds them too
        for i, p in enumerate(self._params):  # C functions (See Note [dW runtime in C++])
            self._handles.append(p.register_hook(self._rt.grad_hook(i)))
            post = p.register_post_accumulate_grad_hook(self._rt.accumulated_hook(i))
            self._handles.append(post)
            # See Note [Parameters with gradient hooks]: the runtime reads the caller's hooks there
            self._rt.set_hook_dicts(i, p._backward_hooks, p._post_accumulate_grad_hooks, post.id)

    def _patch(self, m: nn.Module, me) -> None:
        had = "forward" in m.__dict__
        old = m.__dict__.get("forward")
        w_idx = self._index.get(id(m.weight)) if m.weight is not None else None
        b_idx = self._index.get(id(m.bias)) if m.bias is not None else None
        rt = self._rt
        stock = self._stock_call
        params = self._params
        if isinstance(m, nn.Linear):
            # See Note [Fast path of a patched layer call]: the common call, decided and applied in C++
            fast = rt.linear_fast_path(w_idx, -1 if b_idx is None else b_idx) if w_idx is not None else None

            def forward(mod, input):
                x = input
                if fast is not None:
                    out = fast(mod, x)
                    if out is not NotImplemented:
                        return out
                if not torch.is_grad_enabled():
                    me._check_no_grad_use()
                    return nn.Linear.forward(mod, x)
                if me._phase_name != "forward":
                    me._begin_if_idle()  # its checks first: the module's parameters may have changed
                # See Note [Layer calls out-of-order backward leaves to autograd]: frozen since install, or
                # not the registered parameter (torch.func.functional_call): no deferral, like autograd
                w, b = mod.weight, mod.bias
                wi = w_idx if w_idx is not None and w is params[w_idx] and w.requires_grad else None
                bi = b_idx if b_idx is not None and b is params[b_idx] and b.requires_grad else None
                if wi is None and bi is None:
                    return nn.Linear.forward(mod, x)
                # See Note [Parameters with gradient hooks]
                if (wi is not None and _user_hooked(w)) or (bi is not None and _user_hooked(b)):
                    me._note_autograd_use([i for i in (wi, bi) if i is not None], hooked=True)
                    return nn.Linear.forward(mod, x)
                # See Notes [Linear inputs that at::linear reduces in another order], [Linear calls the
                # deferred path gives at::linear's own rows], [One kind of use per parameter and iteration]
                if x.dim() == 2:  # the common case, inline: x itself unless column-major
                    rows = None if x.stride(0) == 1 and x.stride(1) == x.size(0) else x
                else:
                    rows = _linear_rows(x, b is not None, w.requires_grad)
                cast = torch.is_autocast_enabled(x.device.type)
                if cast:  # See Note [Deferred calls under autocast]
                    out = me._cast_call(x, w, b, wi, bi, lambda x_c, w_c, b_c: (
                        _linear_rows(x_c, b_c is not None, True) is not None
                        and (wi is None or (w_c.stride(1) == 1 and w_c.stride(0) == w_c.size(1)))),
                        _deferred_linear_rows, lambda x_c, b_c, out: _linear_output(x_c, out, b_c is not None))
                    if out is not None:
                        return out
                autograd = cast or rows is None or (wi is not None and not (w.stride(1) == 1 and w.stride(0) == w.size(1))) \
                    or x.is_complex() or w.is_complex() or _has_torch_function((x, w, b)) or _forward_mode(x)
                wd, bd = me._deferred_indices(wi, bi, autograd, cast)
                if wd < 0 and bd < 0:
                    return stock(lambda w, b: F.linear(x, w, b), w, b, wi, bi, cast)
                out = _deferred_linear_call(rt, rows, x, w, b, wd, bd, me.graph_token())
                if me._queues:
                    me._keep_arrival_order(out, wd, bd)
                return _linear_output(x, out, b is not None)
        else:
            base = next(b for b in _CONV_TYPES if isinstance(m, b))
            nd = _CONV_TYPES[base]
            fast = rt.conv_fast_path(w_idx, -1 if b_idx is None else b_idx, nd) if w_idx is not None else None

            def forward(mod, input):
                x = input
                if fast is not None:  # See Note [Fast path of a patched layer call]
                    out = fast(mod, x)
                    if out is not NotImplemented:
                        return out
                if not torch.is_grad_enabled():
                    me._check_no_grad_use()
                    return base.forward(mod, x)
                if me._phase_name != "forward":
                    me._begin_if_idle()  # its checks first: the module's parameters may have changed
                w, b = mod.weight, mod.bias  # See Note [Layer calls out-of-order backward leaves to autograd]
                wi = w_idx if w_idx is not None and w is params[w_idx] and w.requires_grad else None
                bi = b_idx if b_idx is not None and b is params[b_idx] and b.requires_grad else None
                if wi is None and bi is None:
                    return base.forward(mod, x)
                # See Note [Parameters with gradient hooks]
                if (wi is not None and _user_hooked(w)) or (bi is not None and _user_hooked(b)):
                    me._note_autograd_use([i for i in (wi, bi) if i is not None], hooked=True)
                    return base.forward(mod, x)
                # See Notes [Conv weight gradients in the weight's layout], [One kind of use per parameter
                # and iteration]; the deferred Function pads with zeros, given as tuples
                cast = torch.is_autocast_enabled(x.device.type)
                if cast:  # See Note [Deferred calls under autocast]
                    out = me._cast_call(x, w, b, wi, bi, lambda x_c, w_c, b_c: (
                        x_c.dim() == nd + 2 and x_c.is_contiguous() and w_c.is_contiguous()
                        and mod.padding_mode == "zeros" and type(mod.padding) is tuple
                        and type(mod.stride) is tuple and type(mod.dilation) is tuple),
                        lambda rt_, x_c, w_c, b_c, wd, bd, token: deferred_conv(
                            rt_, x_c, w_c, b_c, mod.stride, mod.padding, mod.dilation, mod.groups, wd, bd, token))
                    if out is not None:
                        return out
                autograd = cast or x.dim() != nd + 2 \
                    or (wi is not None and not (x.is_contiguous() and w.is_contiguous())) \
                    or mod.padding_mode != "zeros" or not (type(mod.padding) is tuple and type(mod.stride) is tuple
                                                           and type(mod.dilation) is tuple) \
                    or x.is_complex() or w.is_complex() or _has_torch_function((x, w, b)) or _forward_mode(x)
                wd, bd = me._deferred_indices(wi, bi, autograd, cast)
                if wd < 0 and bd < 0:
                    return stock(lambda w, b: mod._conv_forward(x, w, b), w, b, wi, bi, cast)
                out = deferred_conv(rt, x, w, b, mod.stride, mod.padding, mod.dilation,
                                    mod.groups, wd, bd, me.graph_token())
                if me._queues:
                    me._keep_arrival_order(out, wd, bd)
                return out
        m.forward = PatchedForward(forward, m, had, old)  # See Note [Copies of a model under memsched]
        self._patched.append((m, had, old))
        self._eligible_layers = len(self._patched)

    def remove(self) -> None:
        """Restores every patched forward and removes every hook (safe to call twice). An
        iteration still running (its forward or backward raised) is abandoned."""
        if self._phase != "idle":
            self._abandon()
        if self._installed and self._updated_since_step and self._stepper is not None:
            # left between a backward pass and step(): an exception, a KeyboardInterrupt, a break (found by a
            # helper probing Run lifecycles: 1e-2 off plain without a word)
            self._updated_since_step = False
            warnings.warn(
                f"memsched: out-of-order backward was removed (its `with` block left) after a backward pass whose "
                f"fused optimizer update (fuse_optimizer=True) had already stepped {self._iter_stepped} parameters, "
                f"before step(): they keep that update, where a plain loop that stops between loss.backward() and "
                f"optimizer.step() updates nothing. Use fuse_optimizer=False where a loop may stop there and must "
                f"leave the model as it was.", RuntimeWarning, stacklevel=user_stacklevel())
        for m, had, old in reversed(self._patched):
            if had:
                m.__dict__["forward"] = old
            else:
                m.__dict__.pop("forward", None)
        self._patched = []
        self._owned = []
        self._acc = []
        self._outside_cache = None
        for h in self._handles:
            h.remove()
        self._handles = []
        grad_scaler_guard.unguard(self)
        clip_guard.unguard(self)
        if self._zero_watch is not None:
            self._zero_watch.remove()
            self._zero_watch = None
        if self._stepper is not None:
            self._stepper.close()
        if self._rt is not None:
            self._rt.shutdown()  # nodes recorded before now return their gradients plainly
            self._rt.set_graph(None, None)
        if self._reducer is not None and self._ddp_saved_sync is not None:
            self.model.require_backward_grad_sync = self._ddp_saved_sync
            self._ddp_saved_sync = None
        self._installed = False

    def __enter__(self) -> "OutOfOrderBackward":
        return self.install()

    def __exit__(self, *exc) -> None:
        self.remove()

    # ------------------------------------------------------------------ forward
    def _begin_if_idle(self) -> None:
        if self._nested_ended:
            self._book_nested_passes()
        if self._phase == "backward" and torch._C._current_graph_task_id() == -1:
            # A forward outside the engine while a backward pass is unfinished: that pass raised
            # (its end-of-backward callback never runs) and its graph is still referenced.
            self._abandon()
        if self._phase == "idle":
            if self._reducer is not None:  # See Note [DDP features the bucket reduction replaces] (ddp.py)
                ddp_support.check_forward(self.model, self._last_micro_step(), self.grad_accumulation_steps)
                if not self._last_micro_step() and not self._warned_sync_each \
                        and not ddp_support.in_no_sync(self.model):
                    self._warn_sync_each_micro_step()
            if self._updated_since_step:
                self._refuse_extra_backward()
            self._failed_backward = False
            index = self._index
            if self._structure_changed:
                self._check_parameters_unchanged()
            regraded = self._rt.first_regraded()
            if regraded >= 0:
                self._refuse_regraded(regraded)
            if (self._structure_changed or any(p.requires_grad for p in self._frozen)) and \
                    not all(id(p) in index for p in self._root.parameters() if p.requires_grad):
                n, p = next((n, p) for n, p in self._root.named_parameters()
                            if p.requires_grad and id(p) not in index)
                if any(p is q for q in self._frozen):
                    raise MemschedError(
                        f"parameter {n} requires grad but had requires_grad=False when OutOfOrderBackward was "
                        f"installed, so memsched neither defers nor (fuse_optimizer) updates it. Unfreeze "
                        f"parameters before install() (before entering memsched.optimize), or remove() and "
                        f"install() again (leave the `with` block and enter it again) after unfreezing.")
                raise MemschedError(
                    f"parameter {n} was added to the model (or replaced one) after OutOfOrderBackward was installed, "
                    f"so memsched neither defers nor (fuse_optimizer) updates it. Change the model before install() "
                    f"(before entering memsched.optimize), or remove() and install() again (leave the `with` block "
                    f"and enter it again) after changing it.")
            self._structure_changed = False
            if self._stepper is not None:
                self._rt.post_hooks_last()  # See Note [Parameters with gradient hooks]
            self._iter_stepped = 0  # parameters the fused update stepped in this iteration (Note [A failed backward])
            self._learn_cast_uses()
            self._kind.clear()
            self._cast_uses.clear()
            self._maybe_queued.clear()
            self._first_node.clear()
            self._rt.begin_iteration(self._last_micro_step())
            if self._reducer is not None:
                self._reducer.begin_iteration()
            self._rt.start_tracking()
            self._timeline = []
            self._phase = "forward"
            graph = _IterationGraph()
            self._graph = weakref.ref(graph, self._graph_gone)
            self._rt.set_graph(graph, self._graph)  # handed to the iteration's nodes by graph_token(), then dropped

    def _refuse_regraded(self, i: int) -> None:
        p = self._params[i]
        raise MemschedError(
            f"parameter {self._name(i)} is now {p.dtype} on {p.device}, converted after OutOfOrderBackward was "
            f"installed (model.to(...), .double(), .half(), .cuda()): PyTorch gave it a new gradient-accumulation "
            f"node, and out-of-order backward routes its weight gradients through the one it saw at install, so "
            f"every gradient would be lost. Nothing was changed. Convert the model before install() (before entering "
            f"memsched.optimize), or remove() and install() again (leave the `with` block and enter it again).")

    # See Note [Deferred calls under autocast]
    def _learn_cast_uses(self) -> None:
        """The iteration that ended: a parameter all of whose uses were deferrable calls of one autocast region
        (through autograd that time, or deferred already) is deferred in its autocast dtype from now on."""
        kind = self._kind
        for i, region in self._cast_region.items():
            if region is _MIXED or kind.get(i) == _DEFERRED:  # (_DEFERRED: a call outside autocast, in C++)
                self._cast_eligible.discard(i)
            elif kind.get(i) in (_AUTOGRAD, _DEFERRED_CAST) and i not in self._cast_never:
                if i not in self._cast_eligible:
                    self._cast_began_at = self._iterations  # deferred from the iteration after this many
                self._cast_eligible.add(i)
        self._cast_region.clear()

    def completed_iterations(self) -> int:
        """Backward passes ended since install."""
        return self._iterations

    def cast_deferral_began_since(self, iterations: int) -> bool:
        """Whether a parameter began to be deferred under autocast after more than `iterations` backward
        passes: inside a step that started after that many (with gradient accumulation, its second
        micro-batch defers what its first ran through autograd), so that step's trace mixes both."""
        return self._cast_began_at > iterations

    def cast_deferral_pending(self) -> bool:
        """After an iteration's backward: whether the next iteration defers under autocast a parameter this
        one ran through autograd (so it saves other tensors). memsched.optimize then profiles the next step
        rather than plan from this one."""
        kind, eligible, never = self._kind, self._cast_eligible, self._cast_never
        return any(r is not _MIXED and kind.get(i) == _AUTOGRAD and i not in eligible and i not in never
                   for i, r in self._cast_region.items())

    def _not_cast(self, ids) -> None:
        """A use of these parameters other than a deferrable call of an autocast region: none of them is
        deferred in its autocast dtype from the next iteration on, and one that already is in this iteration
        is refused (its autocast-dtype sum cannot take this contribution in autograd's order)."""
        region, kind = self._cast_region, self._kind
        for i in ids:
            if i is None:
                continue
            region[i] = _MIXED
            if kind.get(i) == _DEFERRED_CAST:
                self._refuse_cast_mix(i)

    def _cast_call(self, x, w, b, wi, bi, deferrable, apply, finish=None):
        """A layer call under autocast: its output when it is deferred in the autocast dtype, else None (the
        call goes on as before). deferrable(x_c, w_c, b_c): the deferred Function takes the cast arguments;
        apply(rt, x_c, w_c, b_c, wd, bd, graph_token): that Function; finish(x_c, b_c, out): the layer's
        output made of the Function's (None: as it is)."""
        c = _cast_args(x, w, b, x.device.type)
        if c is None:
            self._cast_indices(wi, bi, None, False)
            return None
        x_c, w_c, b_c = c
        ok = deferrable(x_c, w_c, b_c) and not _has_torch_function((x, w, b)) and not _forward_mode(x)
        idx = self._cast_indices(wi, bi, w_c if wi is not None else b_c, ok)
        if idx is None:
            return None
        out = apply(self._rt, x_c, w_c, b_c, idx[0], idx[1], self.graph_token())
        if self._queues:
            self._keep_arrival_order(out, idx[0], idx[1])
        return out if finish is None else finish(x_c, b_c, out)

    def _cast_indices(self, wi, bi, region, ok: bool):
        """A call under autocast: (wd, bd) when it is deferred in the autocast dtype, else None (the call goes to
        autograd as before). region: the cached cast of the call's weight (its bias's if the weight is not
        trained), which tells one autocast region from another; ok: the call is deferrable."""
        kind, seen = self._kind, self._cast_region
        ids = [i for i in (wi, bi) if i is not None]
        same = True
        for i in ids:
            r = seen.get(i)
            if r is None and ok:
                seen[i] = weakref.ref(region)
            elif r is None or r is _MIXED or r() is not region or not ok:
                seen[i] = _MIXED
                same = False
        if ok and same and all(i in self._cast_eligible and kind.get(i) in (None, _DEFERRED_CAST) for i in ids):
            for i in ids:
                kind[i] = _DEFERRED_CAST
            wd, bd = -1 if wi is None else wi, -1 if bi is None else bi
            self._note_deferred_use(wd, bd)
            return wd, bd
        for i in ids:
            if kind.get(i) == _DEFERRED_CAST:
                self._refuse_cast_mix(i)
        return None

    def _refuse_cast_mix(self, i: int) -> None:
        self._cast_never.add(i)
        self._cast_eligible.discard(i)
        if self._phase == "forward":
            self._abandon()  # this forward raises: what it counted and deferred never reaches a backward pass
        raise MemschedError(
            f"parameter {self._name(i)} was deferred in autocast's dtype in this forward pass -- every use of it in "
            f"the last iteration was a call inside one torch.autocast region -- and is now used otherwise (outside "
            f"that region, in another region, or by a call out-of-order backward leaves to autograd): autograd sums "
            f"one region's contributions in the autocast dtype before casting them, which memsched cannot reproduce "
            f"for this mix. Nothing was changed, and this parameter is never deferred under autocast again in this "
            f"installation: run the step again. To avoid this, call the layer the same way in every iteration.")

    def _check_parameters_unchanged(self) -> None:
        """See Note [Parameters added or unfrozen after install]: every module still in the model owns the
        Parameters it owned at install. A layer's weight gradient is routed to the parameter it had then, so a
        weight tied to another layer's or replaced by another Parameter since would get the wrong gradients."""
        names = {id(m): n for n, m in self._root.named_modules(remove_duplicate=False)}
        for m, owned in self._owned:
            if id(m) not in names:
                continue  # no longer in the model: never called by it
            params = m._parameters
            for name, p in owned:
                now = params.get(name)
                if now is p:
                    continue
                where = names[id(m)]
                what = f"layer '{where}'" if where else "the model"
                change = ("was removed" if now is None else
                          "is now a Parameter another layer owns (tied)" if id(now) in self._index else
                          "was replaced by another Parameter")
                raise MemschedError(
                    f"{what}: its parameter '{name}' {change} after OutOfOrderBackward was installed; out-of-order "
                    f"backward routes each layer's weight gradient to the parameters it saw at install, so "
                    f"gradients would be wrong. Nothing was changed. Change the model before install() (before "
                    f"entering memsched.optimize), or remove() and install() again (leave the `with` block and "
                    f"enter it again) after changing it.")

    def graph_token(self):
        """The object every Deferred* node of this iteration keeps in its ctx: it dies with the
        iteration's last node (Note [A failed backward])."""
        return self._rt.graph_token()  # the graph at the first call, then what self._graph still reaches

    def _graph_gone(self, ref) -> None:
        # Every node of the iteration died, outside the engine, while its backward pass was
        # unfinished: that pass raised and the caller dropped it. Drop its deferred work, partial
        # sums and parked gradients now. (A forward that raised holds nothing here yet; under
        # memsched.optimize the root's hook abandons it at once.)
        if ref is self._graph and self._phase == "backward" and torch._C._current_graph_task_id() == -1:
            self._abandon()
            self._failed_backward = True  # step() still says so

    def abandon_forward(self) -> None:
        """The root forward raised (memsched.optimize's always-called hook): abandon an iteration
        that has not started its backward pass."""
        if self._phase == "forward":
            self._abandon()

    def _note_deferred_use(self, w_idx: int, b_idx: int) -> None:
        # A use during backward is legal: activation checkpointing recomputes
        # forward there. A recomputed use whose backward never runs is
        # finished at the flush (end_iteration(allow_missing)). -1: no parameter.
        if self._phase_name != "forward":
            self._begin_if_idle()
        late = self._rt.note_deferred_use(w_idx, b_idx)
        if late >= 0:
            self._refuse_late_use(late)

    def _refuse_late_use(self, i: int) -> None:
        self._refused_in_backward = True  # See Note [A failed backward]
        raise MemschedError(
            f"parameter {self._name(i)} is used by a forward that runs during backward (activation "
            f"checkpointing recomputes it) after it already received gradient in this backward pass: its "
            f"use inside the checkpointed region is counted too late. This happens when the layer runs both "
            f"inside and outside checkpointed regions, or in two checkpointed regions of one backward pass "
            f"(the model called twice before one backward: two views, two batches, with gradient "
            f"checkpointing on). Run one forward per backward pass (two micro-batches with "
            f"grad_accumulation_steps=2), turn activation checkpointing off for this model, or train without "
            f"ooo=True and fuse_optimizer=True (plain PyTorch's backward handles it). {_DROPPED}")

    def _refuse_uncounted(self, i: int) -> None:
        """Called by the runtime's post-accumulate-grad hook (See Note [AccumulateGrad gate])."""
        self._refused_in_backward = True  # See Note [A failed backward]
        raise MemschedError(
            f"parameter {self._name(i)} received a gradient through autograd that memsched did not "
            f"count during forward: it is used outside the layer that owns it (a functional call, a "
            f"loss term such as a penalty on the weight), or the loss differentiates through a "
            f"gradient (double backward: torch.autograd.grad(..., create_graph=True), which ooo does "
            f"not support). Its "
            f"deferred gradient may already be final; memsched refuses to compute a wrong update. Use "
            f"it only through its module, or leave that model out of ooo (ooo=False). {_DROPPED}")

    def _check_no_grad_use(self) -> None:
        # See _REENTRANT_MESSAGE; the stack walk runs only with a fused update.
        if self._stepper is not None and _in_reentrant_checkpoint():
            raise MemschedError(_REENTRANT_MESSAGE)

    def _note_autograd_use(self, ids: Sequence[int], hooked: bool = False) -> None:
        if not torch.is_grad_enabled():
            self._check_no_grad_use()
            return
        if self._phase_name != "forward":
            self._begin_if_idle()
        if hooked:  # autograd sums every use of a hooked parameter (Note [Parameters with gradient hooks])
            if self._cast_region or self._cast_eligible:
                self._not_cast(ids)
            for i in ids:
                self._kind.setdefault(i, _AUTOGRAD)
        late = self._rt.note_autograd_use(ids)
        if late >= 0:
            self._refuse_late_use(late)

    # See Note [One kind of use per parameter and iteration]
    def _deferred_indices(self, wi, bi, autograd: bool, cast: bool = False):
        """The runtime indices this eligible call defers its weight and bias gradient to (-1: autograd
        gets that gradient); its counted uses. autograd: the call's math must be autograd's own (it runs
        the stock forward when neither index is >= 0)."""
        if self._phase_name != "forward":
            self._begin_if_idle()
        kind = self._kind
        if not autograd and not self._cast_uses:  # the common case, in short
            kw = _DEFERRED if wi is None else kind.setdefault(wi, _DEFERRED)
            kb = _DEFERRED if bi is None else kind.setdefault(bi, _DEFERRED)
            if kw == _DEFERRED and kb == _DEFERRED:
                wd = -1 if wi is None else wi
                bd = -1 if bi is None else bi
                self._note_deferred_use(wd, bd)
                return wd, bd
        out = [-1, -1]
        direct = []
        if not cast and (self._cast_region or self._cast_eligible):
            self._not_cast((wi, bi))  # (an autocast call was seen by _cast_indices)
        for k, i in enumerate((wi, bi)):
            if i is None:
                continue
            c = kind.get(i)
            if c is None:
                c = kind[i] = _AUTOGRAD if autograd else _DEFERRED
            if c == _DEFERRED and not autograd:
                out[k] = i
            elif c == _AUTOGRAD:
                direct.append(i)
        if out[0] >= 0 or out[1] >= 0:
            if direct:
                self._note_autograd_use(direct)  # the Function hands that gradient to autograd at once
            self._note_deferred_use(out[0], out[1])
            if self._cast_uses:
                for i in out:
                    if i in self._cast_uses:
                        self._check_cast_mix(i)
        return out[0], out[1]

    def _stock_call(self, run, w, b, wi, bi, cast: bool = False):
        """The stock forward of a call no index is deferred for: run(weight, bias). A parameter whose
        uses this iteration are deferred gets a _Tap, so this call's gradient joins its deferred sum --
        except under autocast (cast), whose weight cast autograd shares between the calls of one autocast
        region: the call goes to autograd, and a third contribution of such a parameter is refused."""
        kind = self._kind
        if not cast and (self._cast_region or self._cast_eligible):
            self._not_cast((wi, bi))  # (an autocast call was seen by _cast_indices)
        tw = wi is not None and kind.get(wi) == _DEFERRED
        tb = bi is not None and kind.get(bi) == _DEFERRED
        if (cast or self._executor == "thread") and (tw or tb):
            self._note_autograd_use([i for i in (wi, bi) if i is not None])
            for i, t in ((wi, tw), (bi, tb)):
                if t:
                    self._cast_uses[i] = self._cast_uses.get(i, 0) + 1
                    self._check_cast_mix(i, cast)
            return run(w, b)
        direct = [i for i in (wi, bi) if i is not None and kind.get(i) != _DEFERRED]
        if direct:
            self._note_autograd_use(direct)
        if tw or tb:
            self._note_deferred_use(wi if tw else -1, bi if tb else -1)
            me = self._proxy
            for i, t in ((wi, tw), (bi, tb)):
                if t:
                    if self._queues:
                        self._another_use(i)
                    if i in self._cast_uses:  # a tapped use counts as a deferred one there
                        self._check_cast_mix(i)
            if tw:
                w = _Tap.apply(w, me, wi)
            if tb:
                b = _Tap.apply(b, me, bi)
        return run(w, b)

    def _check_cast_mix(self, i: int, cast: Optional[bool] = None) -> None:
        """Parameter i has deferred uses and untapped autograd uses in this iteration (under autocast, or
        any with the thread executor): autograd sums the latter and the runtime adds that sum to the
        deferred one, which is autograd's order for two contributions, not for three."""
        n = self._rt.expected(i) - 1 + self._cast_uses[i]  # deferred/tapped uses (+1: the gate) and the others
        if n < 3:
            return
        if cast is None:
            cast = self._executor != "thread"
        why = ("inside torch.autocast, which shares one weight cast between the calls of a region and hands "
               "memsched only their sum" if cast else
               "with executor='thread', whose worker cannot take a gradient made in Python: it would wait for "
               "the GIL while holding the runtime's lock")
        raise MemschedError(
            f"parameter {self._name(i)} has {n} uses in one forward pass, some whose weight gradient out-of-order "
            f"backward defers and some it leaves to autograd ({why}): autograd sums them in an order memsched "
            f"cannot reproduce there, so gradients would differ from plain PyTorch's in the last bits. Nothing "
            f"was changed. Call that layer the same way in every use of a forward pass (all inside or all outside "
            f"autocast; with executor='thread', inputs of one layout: contiguous, not transposed), use the default "
            f"executor, or leave the model out of ooo (ooo=False, fuse_optimizer=False).")

    def _keep_arrival_order(self, out: torch.Tensor, wd: int, bd: int) -> None:
        """A queueing executor: from a parameter's second use in an iteration on, each of its deferred
        calls -- the first one too: backward usually reaches it last -- tells _arriving() before its
        item is queued (a pre-hook of its node). A parameter used once costs no Python in backward."""
        first = self._first_node
        params = tuple(i for i in (wd, bd) if i >= 0)
        again = False
        for i in params:
            if i in first:
                again = True
                self._another_use(i)
        if again:
            out.grad_fn.register_prehook(functools.partial(_before_queued, self._proxy, params))
        entry = (None, None) if again else (out.grad_fn, params)  # (None, None): hooked, or to be hooked
        for i in params:
            first[i] = entry

    def _another_use(self, i: int) -> None:
        """Parameter i has another use this iteration: its first deferred call's node gets the pre-hook."""
        node, params = self._first_node.get(i, (None, None))
        if node is not None:
            node.register_prehook(functools.partial(_before_queued, self._proxy, params))
            for j in params:
                self._first_node[j] = (None, None)
        else:
            self._first_node[i] = (None, None)  # a _Tap first: i's deferred calls get the pre-hook

    def _arriving(self, params) -> None:
        """A gradient of these parameters is about to join their sums (an item queued, a _Tap adding):
        a queued item of one of them runs first, so each parameter's contributions complete in the
        order they arrive."""
        waiting = self._maybe_queued
        if any(i in waiting for i in params):
            self._flush_queue()
            waiting.clear()
        if self._queues:
            waiting.update(i for i in params if i >= 0)

    def _flush_queue(self) -> None:
        """Runs every queued item now (the thread executor: waits for its worker to finish them)."""
        rt = self._rt
        if rt is None or not rt.queued:
            return
        if self._executor == "thread":
            rt.drain()
        else:
            rt.run(False)

    def _tap_arrived(self, i: int, g: torch.Tensor) -> bool:
        """A _Tap's backward (See Note [One kind of use per parameter and iteration]): adds g to
        parameter i's deferred sum, after every item queued before it; False: autograd takes g (the
        runtime is gone, torch.autograd.grad() asks for the parameter, or this pass does not want it)."""
        rt = self._rt
        if rt is None or not self._installed:
            return False
        try:
            runs = torch._C._will_engine_execute_node(self._acc[i])
        except RuntimeError:  # torch.autograd.grad() capturing this leaf's gradient: plain
            return False
        if not runs:
            return False
        if not rt.backward_started:
            self._first_deferred()  # as the runtime's first deferred item does
            rt.backward_started = True
        self._arriving((i,))
        self._maybe_queued.discard(i)  # added below, not queued
        rt.add_autograd_grad(i, _in_layout_of(g, self._params[i]))
        rt.contribute(i)
        if rt.poll_after_defer:
            self._poll_reducer()
        return True

    # ------------------------------------------------------------------ backward
    def _backward_started(self) -> None:
        if not self._callback_queued:
            self._callback_queued = True
            self._phase = "backward"
            self._timeline.append(("backward_start", time.perf_counter()))
            if self._discarded_pass:
                self._discard_followed = True
            # See Note [A reentrant checkpoint's nested backward passes]
            self._pass_nested = self._stepper is None and _in_reentrant_checkpoint("backward")
            torch.autograd.Variable._execution_engine.queue_callback(self._on_backward_end)
            # the checks run before anything of this pass changed a gradient or a parameter
            if self._undeclared and not self._step_declared:
                self._check_zeroing_seen()
            hooked = self._rt.first_hooked_deferred()  # See Note [Parameters with gradient hooks]
            if hooked >= 0:
                self._refuse_hook_after_forward(hooked)
            # memsched.optimize's profiled step updates after backward (Note [The profiled step updates
            # after backward] in optimize.py): this pass then fuses nothing
            self._fusing = (self._stepper is not None and not self._probation
                            and not (self.fusion_paused is not None and self.fusion_paused()))
            self._rt.notify = self._fusing or self._reducer is not None
            if self._fusing and not self._warned_step_hooks and has_step_hooks(self.optimizer):
                self._warn_step_hooks()
            if self._stepper is not None:
                self._rt.post_hooks_last()  # also those registered since the forward
                if self._fusing and self._last_micro_step():
                    # See Note [Adam plan for the C++ update] in fused.py
                    self._stepper.install_native_plan(self._rt, self._params)

    def _warn_step_hooks(self) -> None:
        """The optimizer has step hooks (its own or global): each fused call runs them on a one-layer view
        of its group (Note [Per-parameter step through a one-parameter group view] in fused.py), which a
        hook that edits hyper-parameters edits in vain (found by probing: 1e-2 off plain). Said once."""
        self._warned_step_hooks = True
        warnings.warn(
            "memsched: the optimizer has step hooks (register_step_pre_hook / register_step_post_hook, or "
            "global ones); with fuse_optimizer=True they run once per layer the update steps during backward, "
            "each seeing a one-layer view of its param group, not once per step: a hook that counts steps "
            "counts layers, and one that changes hyper-parameters changes only that view. Use "
            "fuse_optimizer=False for such hooks. Warned once.", RuntimeWarning, stacklevel=user_stacklevel())

    def _warn_read_updated(self) -> None:
        """A forward without gradients (a metric, an evaluation) after the fused update and before step():
        it reads the updated parameters, where plain PyTorch's loop reads those of before its
        optimizer.step() (found by a helper logging a held-out loss there: 1.553 where plain logged
        1.610). With gradients enabled such a forward is refused (_refuse_extra_backward). Said once."""
        self._warned_read_updated = True
        warnings.warn(
            "memsched: a forward pass ran after the backward pass that applied the fused optimizer update "
            "(fuse_optimizer=True) and before step(): it reads the updated parameters, as PyTorch's "
            "optimizer-in-backward recipe does, where a plain loop (backward, forward, optimizer.step()) reads "
            "the old ones. Training is unchanged; a metric computed there differs. Run such forwards before "
            "backward or after step() to see the values plain PyTorch sees, or use fuse_optimizer=False. Warned "
            "once.", RuntimeWarning, stacklevel=user_stacklevel())

    def _warn_sync_each_micro_step(self) -> None:
        """A micro-step before the last of an accumulation, not under ddp.no_sync(): plain DDP all-reduces the
        accumulated gradients at every micro-step, memsched once per optimizer step (See Note [DDP features
        the bucket reduction replaces] in ddp.py). Said once."""
        self._warned_sync_each = True
        warnings.warn(
            f"memsched: under DistributedDataParallel with grad_accumulation_steps={self.grad_accumulation_steps}, "
            f"a micro-step before the last runs outside ddp.no_sync(): plain DDP then all-reduces the accumulated "
            f"gradients at every micro-step, where memsched's out-of-order backward reduces once per optimizer step "
            f"(as plain DDP does under no_sync()). The gradients are equal up to float rounding, not bitwise. Wrap "
            f"the micro-steps before the last in ddp.no_sync() -- plain DDP's way to accumulate, and fewer "
            f"all-reduces -- for results bitwise equal to plain DDP. Warned once.",
            RuntimeWarning, stacklevel=user_stacklevel())

    def _refuse_hook_after_forward(self, i: int) -> None:
        raise MemschedError(
            f"parameter {self._name(i)} got a gradient hook (register_hook or "
            f"register_post_accumulate_grad_hook) after the forward pass that used it and before this backward "
            f"pass: that forward already deferred its layer's weight gradient, which out-of-order backward "
            f"computes outside autograd, so the hook would receive None (or not run) instead of the gradient. "
            f"Nothing was changed. Register the hook before the forward pass (memsched then runs that layer "
            f"through autograd, and the hook sees its whole gradient as in plain PyTorch), or leave the model "
            f"out of ooo (ooo=False, fuse_optimizer=False).")

    def _first_deferred(self) -> None:
        """Called by the runtime (C++, the engine's thread) at the first deferred item of a backward pass."""
        if self._phase == "idle":
            if 0 <= torch._C._current_graph_task_id() < self.__dict__.get("_ended_task", -1):
                # graph task ids grow: this pass began before the one that ended the iteration, which ran
                # inside it -- a reentrant checkpoint's nested backward
                raise MemschedError(
                    "torch.utils.checkpoint(..., use_reentrant=True) ran its own backward pass inside this one "
                    "before the other deferred layers of this forward, and that nested pass ended out-of-order "
                    "backward's iteration early: the deferred weight gradients left would be lost. Use "
                    "use_reentrant=False (PyTorch's recommended checkpoint; a Hugging Face model: "
                    "{'use_reentrant': False} as TrainingArguments' gradient_checkpointing_kwargs, or to "
                    "gradient_checkpointing_enable()), or leave the model out of ooo (ooo=False, fuse_optimizer=False).")
            self._refuse_ended_graph()
        self._backward_started()

    def _begin_at_gradient(self) -> None:
        """Called by the runtime (C++, the engine's thread) at a gradient of a parameter while no iteration
        runs. See Note [A backward over an ended iteration's graph]."""
        if not self._forward_since_end and self._root_called:
            # (a loop that calls a submodule, never the model itself, cannot be told apart: it begins, as before)
            self._refuse_ended_graph()
        self._begin_if_idle()

    def _refuse_ended_graph(self) -> None:
        # Note [A backward over an ended iteration's graph]
        # ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
        # A backward pass that arrives while no iteration runs is over the graph of one that ended:
        # retain_graph=True and a second backward, or two forwards and a backward of each. It is
        # refused at its first gradient of a model parameter, before that gradient or any other
        # changed: at the first deferred item (_first_deferred), or, when a parameter autograd
        # accumulates comes first (a LayerNorm after the last Linear), at its tensor hook
        # (_begin_at_gradient). That hook also begins the iteration of a forward that called no
        # module owning a parameter (nn.ParameterList entries read directly): the root module's
        # forward pre-hook (with gradients enabled) tells the two apart -- where the root module is
        # called at all: a loop that calls only a submodule of the model begins there, as before. Refused there only from the first deferred item,
        # the LayerNorm's gradient was already doubled (2G where the caller kept G).
        raise MemschedError(
            "a second backward pass over a graph whose backward already ran (retain_graph=True, or "
            "backward(inputs=...) first), or the backward of a forward made before the last backward pass ran "
            "(two forwards, then a backward of each) or before OutOfOrderBackward was installed (before entering "
            "memsched.optimize), is not supported by OutOfOrderBackward: each backward "
            "pass needs its own forward, run after the last backward pass, and with fuse_optimizer the "
            "parameters it read were already updated. Nothing was changed. Run forward again right before "
            "each backward, or use grad_accumulation_steps with one forward per backward.")

    def _last_micro_step(self) -> bool:
        return self._micro_step % self.grad_accumulation_steps == self.grad_accumulation_steps - 1

    def _flush_ready(self) -> None:
        """End of backward: units some of whose parameters got no gradient are stepped as they are."""
        if self._fusing and self._reducer is None:
            for idx in self._rt.take_partial_units():  # held units too (Note [A parameter read after ...])
                self._step_params(idx, at_end=True)

    def _step_params(self, idx: Sequence[int], at_end: bool = False) -> None:
        """One grouped optimizer update of the parameters idx (See Note [Grouped step through torch's
        functional optimizer] in fused.py); frees their gradients. Before the end of backward, a DDP
        bucket's held parameters wait for it (Note [A parameter read after its gradient is final])."""
        if not self._fusing:  # (never with no optimizer to step)
            return
        if not at_end and self._reducer is not None:
            held = self._rt.held_params()
            if held:
                held = set(held)
                idx = [i for i in idx if i not in held]
        idx = self._rt.step_native(list(idx))  # those the C++ Adam update covers (set_adam)
        params = [p for p in (self._params[i] for i in idx) if p.grad is not None and self._stepper.owns(p)]
        if not params:
            return
        nbytes = sum(_nbytes(p.grad) for p in params)
        try:
            self._stepper.step_params(params)  # frees each p.grad
        except BaseException:
            # an optimizer step hook (or the optimizer) raised part way: some of these may be stepped, and
            # the failed backward's warning (_abandon) says how many at most
            self._iter_stepped += len(params)
            self._update_raised = True
            raise
        self._rt.track(-nbytes)
        self._fused_steps += len(params)
        self._iter_stepped += len(params)
        self._mark_freed(idx)

    def note_step_zeroed(self, idx: Sequence[int]) -> None:
        """memsched.optimize's run.step() after a backward pass it kept unfused (Note [The profiled step
        updates after backward] in optimize.py) ran optimizer.step() and zero_grad(set_to_none=True):
        as after a fused update, the gradients of the parameters idx count as freed by it, and a later
        zero_grad(set_to_none=False) gives them zeros back (Note [Gradients the fused update did not see])."""
        self._mark_freed(idx, stepped=False)
        self._step_declared = True

    def _zeroes_a_stepped_parameter(self, params) -> bool:
        """Whether a zero_grad() covering `params` (None: the optimizer's) drops a gradient the fused update
        of this step already used: a module that got none this step (a task head it did not use) does not
        (found by a helper: refused, 'that update stays applied', where training was plain's)."""
        if params is None:
            return bool(self._stepped_in_step)
        index, stepped = self._index, self._stepped_in_step
        return any(index.get(id(p), -1) in stepped for p in params)

    def _mark_freed(self, idx: Sequence[int], stepped: bool = True) -> None:
        """The fused update stepped these and freed their gradients (Note [Gradients the fused update
        did not see]): what plain PyTorch holds in their .grad now depends on the caller's zeroing."""
        if stepped:
            self._stepped_in_step.update(idx)
        self._undeclared.update(idx)
        self._zeroed.difference_update(idx)
        self._step_declared = False

    def _note_native_steps(self) -> None:
        """Book the parameters the C++ Adam update stepped (and freed) as _step_params books its own."""
        idx = self._rt.take_native_stepped()
        if idx:
            self._iter_stepped += len(idx)
            self._mark_freed(idx)

    def _restore_zeroed(self) -> None:
        """See Note [Gradients the fused update did not see]: the zero .grad plain PyTorch holds for a
        parameter zeroed in place after the fused update freed its gradient, where no backward pass
        of this step reached it (end of the last micro-step's backward, before DDP's buckets are
        reduced: a zero gradient is reduced and stepped as DDP does)."""
        self._note_native_steps()  # stepped in C++ this pass: not left over, even with .grad now None
        for i in self._zeroed:
            p = self._params[i]
            if p.grad is None:
                p.grad = torch.zeros_like(p)

    def _step_leftovers(self) -> None:
        """See Note [Gradients the fused update did not see]: one grouped update of every parameter
        that still has a .grad at the end of the last micro-step's backward."""
        self._note_native_steps()
        # the C++ runtime lists the parameters with a .grad (after a C++ update: none), in index order --
        # a Python scan of every p.grad cost ~0.3 us per parameter and step
        owns, params = self._stepper.owns, self._params
        left = [i for i in self._rt.params_with_grad() if owns(params[i])]
        if left:
            self._stepper.step_params([self._params[i] for i in left])
            self._fused_steps += len(left)
            self._iter_stepped += len(left)
            self._mark_freed(left)
        self._step_outside()

    def _step_outside(self) -> None:
        """The optimizer's parameters outside the model (a learned temperature used in the loss): plain
        optimizer.step() steps them too, and run.step() skips it after a fused update. Under DDP too:
        plain DDP does not reduce them either (Note [Gradients the fused update did not see])."""
        # the optimizer's parameters outside the model, found again only when a group's parameters changed
        # (an identity check per parameter, in C; the scan in Python cost ~0.35 us per parameter and step)
        pgs = self._stepper.optimizer.param_groups
        cache = self._outside_cache
        if cache is None or len(cache[0]) != len(pgs) or not all(
                len(g["params"]) == len(m) and all(map(is_, g["params"], m)) for g, m in zip(pgs, cache[0])):
            members = tuple(tuple(g["params"]) for g in pgs)
            cache = self._outside_cache = (members, [p for m in members for p in m if id(p) not in self._index])
        outside = [p for p in cache[1] if p.grad is not None]
        if outside:
            self._stepper.step_params(outside)  # frees their gradients, as run.step()'s zero_grad would
            self._fused_steps += len(outside)

    def _zeroing_may_drop_a_pass(self) -> bool:
        """Whether a zero_grad() now may drop a backward pass's gradients under memsched.optimize's fused
        update (Note [Backward passes whose gradients the loop discards]): then the watch says which of the
        zeroed parameters held a gradient."""
        return (self._backwards_since_step > 0 and not self._updated_since_step and self._stepper is not None
                and self.fusion_paused is not None and self._micro_step % self.grad_accumulation_steps == 0)

    def _on_zero_grad(self, set_to_none: bool, params, had=None) -> None:
        """The caller's optimizer.zero_grad(set_to_none) (params None) or module.zero_grad(set_to_none)
        (params: the module's) (Note [Gradients the fused update did not see]); had: those of them that held
        a gradient, when _zeroing_may_drop_a_pass() asked."""
        if self._nested_ended:
            self._book_nested_passes()
        if not self._updated_since_step and self._micro_step % self.grad_accumulation_steps == 0:
            # the gradients of the backward passes so far are dropped without a step (GradScaler
            # skipped it on inf/NaN, or the loop caught an error before its step): the caller's next
            # optimizer.step() follows the passes after this -- also with fuse_optimizer while no fused
            # update ran since the last step (memsched.optimize's profiled step updates after backward:
            # a skip there was refused as an accumulation mismatch)
            if had and any(id(p) in self._index for p in had):
                # See Note [Backward passes whose gradients the loop discards]; a module without gradients
                # (a task head this step did not use) drops nothing (found by a helper)
                self._discarded_pass = True
                self._discard_followed = False  # by another backward pass of the step (else: zeroed before it)
            self._backwards_since_step = 0
        self._note_native_steps()  # frees of the C++ update come before this call (a failed backward's too)
        if self._updated_since_step and self._zeroes_a_stepped_parameter(params):
            self._zeroed_after_update = True  # names the likely cause in _refuse_extra_backward
        if not self._undeclared and (not set_to_none or not self._zeroed):
            return  # nothing freed since: nothing to learn (the common case)
        index = self._index
        if params is None:  # the optimizer's parameters
            params = [p for g in self.optimizer.param_groups for p in g["params"]]
        idx = {index[id(p)] for p in params if id(p) in index}
        if set_to_none:
            self._zeroed.difference_update(idx)
        else:
            self._zeroed.update(self._undeclared & idx)
        self._undeclared.difference_update(idx)

    def _check_zeroing_seen(self) -> None:
        """See Note [Gradients the fused update did not see]: a parameter whose gradient the fused
        update freed, and that no zero_grad call covered since, is fine when the caller has set its
        .grad again (p.grad = torch.zeros_like(p)); otherwise the step is refused."""
        params = self._params
        self._undeclared = {i for i in self._undeclared if params[i].grad is None}
        if not self._undeclared:
            return
        n = self._name(min(self._undeclared))
        raise MemschedError(
            f"the fused optimizer update (fuse_optimizer=True) freed the gradients of {len(self._undeclared)} "
            f"parameter(s) ({n}, ...) at the last step, and no optimizer.zero_grad(...) or model.zero_grad(...) "
            f"call was seen before this backward pass, so memsched cannot tell what plain PyTorch would hold in "
            f"their .grad if this step does not reach them: a zero tensor (zeroed in place, e.g. "
            f"zero_grad(set_to_none=False) of a subclass, or p.grad.zero_() by hand: plain optimizer.step() "
            f"updates such a parameter -- weight decay, momentum), None (it is left alone), or the old gradient "
            f"(never zeroed: plain adds it to this step's). Nothing was changed. Call optimizer.zero_grad() or "
            f"model.zero_grad() (set_to_none=True or False: memsched follows either) once per optimizer step, "
            f"or run.step() (memsched.optimize) / OutOfOrderBackward.step(), which count as "
            f"zero_grad(set_to_none=True).")

    def _on_ready(self, groups: List[List[int]], ready_buckets: List[int]) -> None:
        """Called by the runtime (C++) on the last micro-step, with a fused update or DDP: step the
        units whose every parameter is final (See Note [Step units]), or reduce the buckets that are
        ready. Under the stream executor this runs with the side stream current (Note [Streams of
        out-of-order backward] in csrc/torch/dw_runtime.h)."""
        with self._lock:
            if self._reducer is not None:
                for b in ready_buckets:
                    self._reducer.ready(b)
            else:
                for idx in groups:
                    self._step_params(idx)

    def _poll_reducer(self) -> None:
        if self._reducer is None or not self._last_micro_step():
            return
        idx = self._reducer.poll()
        if idx and self._executor == "stream":
            # Called by the runtime with the side stream current: the update below reads each .grad
            # there and then frees it; one made on the compute stream (AccumulateGrad) must not go back
            # to that stream's pool while the side stream still reads it (Note [Streams of
            # out-of-order backward] in csrc/torch/dw_runtime.h).
            for i in idx:
                g = self._params[i].grad
                if g is not None and g.is_cuda:
                    g.record_stream(torch.cuda.current_stream(g.device))
        self._step_params(idx)  # a reduced bucket is one ready group

    def _abandon(self) -> None:
        """Drops the running iteration after an error: queued work, pending
        sums, the scheduler's counts (a fresh scheduler, same parameters)."""
        self._rt.abandon()  # queued items, pending sums, a fresh scheduler, the C++ Adam plan
        if self._stepper is not None:
            self._stepper.forget_native_plan()
        self._note_native_steps()  # updates the C++ Adam path ran before the error count too
        stepped, self._iter_stepped = self._iter_stepped, 0
        in_update, self._update_raised = self._update_raised, False
        if stepped and in_update:
            # the optimizer (or a step hook of it) raised inside the fused update: the group it was stepping may
            # be stepped in part or not at all (found by a helper: "2 of 6 ... keep that update", none changed)
            warnings.warn(
                f"memsched: the fused optimizer update (fuse_optimizer=True) raised during a backward pass (the "
                f"optimizer or one of its step hooks, in the exception above), after it had begun stepping: up to "
                f"{stepped} of {len(self._params)} parameters may hold that update and the others keep their old "
                f"values, whereas plain PyTorch's update after backward would raise before or while stepping all "
                f"of them. Use fuse_optimizer=False to see such an error outside backward (Note [A failed "
                f"backward] in memsched/ooo/backward.py).", RuntimeWarning, stacklevel=user_stacklevel())
        elif stepped:
            warnings.warn(
                f"memsched: a backward pass raised after the fused optimizer update (fuse_optimizer=True) had "
                f"already stepped {stepped} of {len(self._params)} parameters; they keep that update and the "
                f"others keep their old values, whereas plain PyTorch updates nothing when backward raises. "
                f"Raise before backward (check the loss) or use fuse_optimizer=False to skip such a step "
                f"exactly (Note [A failed backward] in memsched/ooo/backward.py).",
                RuntimeWarning, stacklevel=user_stacklevel())
        self._callback_queued = False
        self._first_node.clear()
        self._phase = "idle"
        self._graph = None
        self._rt.set_graph(None, None)
        if self._refused_in_backward:  # See Note [A failed backward]
            self._refused_in_backward = False
            for p in self._root.parameters():
                p.grad = None

    def _on_backward_end(self) -> None:
        self._callback_queued = False
        self._ended_task = torch._C._current_graph_task_id()  # See _first_deferred
        self._first_node.clear()  # (the nodes of a queueing executor's first deferred calls)
        rt = self._rt
        if self._fusing and self._last_micro_step():
            _guard_retained_graph()  # See Note [A retained graph after a fused update] (csrc/torch/deferred_layers.h)
        try:
            if self._executor == "thread":
                rt.drain()
            rt.run(False)
            # uses whose output never reached the loss: finish with what arrived
            rt.end_iteration(True)
            # the compute stream waits for the side stream here, where gradients are consumed
            rt.sync_streams()
            if self._last_micro_step() and rt.watching:
                rt.watching = False  # before the update, which reads every parameter (Note [The first fused ...])
            if self._zeroed and self._last_micro_step():
                self._restore_zeroed()
            if self._reducer is not None and self._last_micro_step():
                self._step_params(self._reducer.poll())
                self._step_params(self._reducer.wait_all())
                self._step_params(self._rt.held_params(), at_end=True)  # Note [A parameter read after ...]
            self._flush_ready()
            if self._fusing and self._reducer is None and self._last_micro_step():
                self._step_leftovers()
            elif self._fusing and self._last_micro_step():
                self._step_outside()  # (the model's own are stepped with their buckets above)
        except BaseException:
            self._abandon()
            raise
        finally:
            self._phase = "idle"
            self._forward_since_end = False
            rt.backward_started = False
            self._note_native_steps()
            native = rt.native_updates  # parameters stepped in C++: See Note [Adam plan for the C++ update] in fused.py
            if native != self._native_seen:
                self._fused_steps += native - self._native_seen
                self._native_steps += native - self._native_seen
                self._native_seen = native
                self.optimizer._opt_called = True  # what the LR scheduler's step wrapper records
        self._timeline.append(("backward_end", time.perf_counter()))
        self._last_timeline = list(self._timeline) + (list(self._reducer.trace) if self._reducer else [])
        self._last_peak_grad_bytes = rt.peak_grad_bytes
        if self._fusing and self._last_micro_step():
            self._updated_since_step = True
            # See Note [Edits between backward and the step boundary]
            self._hypers_at_update = _hypers(self.optimizer)
            rt.snapshot_versions()
        if self._pass_nested:  # See Note [A reentrant checkpoint's nested backward passes]
            self._pass_nested = False
            self._nested_ended = True
            return
        self._nested_ended = False  # nested passes inside this one: this one counts for them
        self._micro_step += 1
        self._backwards_since_step += 1
        self._iterations += 1

    def _book_nested_passes(self) -> None:
        """The nested passes of one backward() inside reentrant checkpoints count as one pass (Note [A reentrant
        checkpoint's nested backward passes]); booked outside backward."""
        if torch._C._current_graph_task_id() == -1:
            self._nested_ended = False
            self._micro_step += 1
            self._backwards_since_step += 1
            self._iterations += 1

    # ------------------------------------------------------------------ user API
    def _refuse_extra_backward(self) -> None:
        # See Note [Fused update and gradient accumulation].
        n = self._backwards_since_step
        self._forward_refused_after_update = True  # the step() this refusal names is the way on (not refused)
        if self._zeroed_after_update and self.fusion_paused is None and not self._step_called:
            # the usual loop (backward, optimizer.step(), zero_grad()) around a bare OutOfOrderBackward, which
            # never called its step() (memsched.optimize sets fusion_paused and routes optimizer.step())
            raise MemschedError(
                "a forward pass with gradients enabled began after the backward pass that applied the fused "
                "optimizer update, and after optimizer.zero_grad(), but without OutOfOrderBackward.step(): with "
                "a bare OutOfOrderBackward(fuse_optimizer=True) the step boundary is its step(), not "
                "optimizer.step() (the update already ran during backward). This forward changed nothing. Call "
                "ooo.step() after each backward pass in place of optimizer.step() and zero_grad(), or use "
                "memsched.optimize(model, optimizer, fuse_optimizer=True), where optimizer.step() marks the "
                "boundary.")
        dropped = ""
        if self._zeroed_after_update:
            # a zero_grad() came after the update: SAM's second pass after a warm-up, a probe pass (found by a
            # helper following the README: the refusal spoke of accumulation, metrics and GANs only)
            dropped = ("zero_grad() ran after that update: if this step drops the gradients of that backward pass "
                       "before another (SAM's ascent pass, a probe pass whose gradients are only looked at), the "
                       "fused update already applied them, which plain PyTorch discards -- such a loop needs "
                       "fuse_optimizer=False (Note [Backward passes whose gradients the loop discards]). ")
        raise MemschedError(
            f"a forward pass with gradients enabled began after {n} backward pass(es) since the last step(), the "
            f"last of which already applied the fused optimizer update (grad_accumulation_steps="
            f"{self.grad_accumulation_steps}): with fuse_optimizer each parameter is stepped during the backward "
            f"that completes its accumulation, so this forward reads the updated parameters and its backward "
            f"would be one more than the update allows. This forward changed nothing (the update of that pass "
            f"stays applied). {dropped}A forward only for a metric or an "
            f"evaluation: run it under torch.no_grad() (it then reads the updated parameters, as PyTorch's "
            f"optimizer-in-backward recipe does; plain PyTorch reads the old ones), before backward, or after "
            f"step(). To accumulate gradients over K backward passes per optimizer step, pass "
            f"grad_accumulation_steps=K (memsched.optimize(..., grad_accumulation_steps=K) or "
            f"OutOfOrderBackward(..., grad_accumulation_steps=K)) and call step() after every backward pass "
            f"(run.step() once per K backward passes under memsched.optimize). A backward pass that only goes "
            f"through this model (a GAN's generator loss through the discriminator) updated it too, with "
            f"gradients plain PyTorch's zero_grad() would discard: freeze its parameters "
            f"(requires_grad_(False)) around such passes, or use fuse_optimizer=False. If the loop skipped "
            f"step() after that pass (an exception between backward and step that it caught, or a check of "
            f"non-finite gradients): its update was already applied, where plain PyTorch would skip it; call "
            f"step() (run.step()) there to go on from the updated parameters, or use fuse_optimizer=False for "
            f"a loop that may skip steps (Note [A step the loop skipped after a fused update]).")

    def owns_parameter(self, p) -> bool:
        """Whether p is one of the parameters this object defers (and, fused, updates)."""
        return id(p) in self._index and self._params[self._index[id(p)]] is p

    def stepped_since_step(self, p) -> bool:
        """Whether a fused update ran in a backward pass since the last step() and p is one of the
        parameters it steps (its optimizer's): p's gradient was used and freed (See Note [Clipping and
        fused updates] in clip_guard.py)."""
        return self._updated_since_step and self._stepper is not None and self._stepper.owns(p)

    @property
    def holds_seen(self) -> bool:
        """Whether a save ever held a parameter's fused update to the end of backward (See Note [A
        parameter read after its gradient is final])."""
        return self._rt is not None and self._rt.holds > 0

    @property
    def updating(self) -> bool:
        """Inside a fused update's optimizer call (memsched.optimize's step routing passes it through)."""
        return self._stepper is not None and self._stepper.stepping > 0

    @property
    def micro_steps(self) -> int:
        """Backward passes that ended since install (the accumulation position is micro_steps % K)."""
        if self._nested_ended:
            self._book_nested_passes()
        return self._micro_step

    @property
    def backward_passes_since_step(self) -> int:
        """Backward passes that ended since the last step()."""
        if self._nested_ended:
            self._book_nested_passes()
        return self._backwards_since_step

    def step(self) -> bool:
        """Marks the end of one micro-step. Returns True when the caller should
        now run ``optimizer.step()`` (no fusion, last micro-step); with
        max_grad_norm set that clipping has been applied. With fuse_optimizer the
        updates already happened during backward and this returns False -- unless no
        backward pass ran since the last step() (gradients from torch.autograd.grad set by
        hand): then it returns True, as without fusion. With fuse_optimizer it also stands for
        ``optimizer.zero_grad(set_to_none=True)`` for the gradients the update freed, unless a
        later zero_grad(set_to_none=False) says otherwise (Note [Gradients the fused update did
        not see])."""
        self._step_called = True
        return self._end_micro_step(True)

    def _end_micro_step(self, declares_zeroing: bool) -> bool:
        """step(); memsched.optimize's optimizer.step() routing passes declares_zeroing=False: the
        caller's loop zeroes the gradients itself after that."""
        if self._nested_ended:
            self._book_nested_passes()
        if self._phase == "backward" or self.__dict__.pop("_failed_backward", False):
            # The end-of-backward callback never ran: backward raised part way.
            self._abandon()
            raise MemschedError("step(): the last backward pass did not finish (it raised part way); its "
                                "deferred weight gradients were dropped and parameters not yet updated keep "
                                "their old values. Zero the gradients and run the step again.")
        if (self._discarded_pass or self._probation) and self._micro_step % self.grad_accumulation_steps == 0:
            self._end_discarding_step()
        ran = self._backwards_since_step
        fused = self._updated_since_step  # the last backward pass ran the update (not a paused one)
        refused_forward, self._forward_refused_after_update = self._forward_refused_after_update, False
        if fused and self._zeroed_after_update and not refused_forward:
            self._refuse_zeroed_after_update()
        if fused and not self._warned_late_edit:
            self._check_late_edits()
        self._backwards_since_step = 0
        self._updated_since_step = False
        self._zeroed_after_update = False
        self._stepped_in_step.clear()
        if declares_zeroing:
            self._step_declared = True
        # No backward pass since the last step(): gradients (if any) came from torch.autograd.grad and
        # the caller's own .grad assignments, which no fused update saw -- step them as plain PyTorch.
        completed = ran == 0 or (self._micro_step % self.grad_accumulation_steps == 0 and self._micro_step > 0)
        if (fused and ran > 0) or not completed:
            return False
        if self.max_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(self._params, self.max_grad_norm)
        return True

    def forget_discarded_pass(self) -> None:
        """The gradients just dropped were a refused step's, dropped by memsched.optimize, not by the loop
        (Note [Backward passes whose gradients the loop discards])."""
        self._discarded_pass = False

    def _refuse_zeroed_after_update(self) -> None:
        """zero_grad() between the backward pass whose fused update ran and the step boundary (`loss.backward();
        model.head.zero_grad(); optimizer.step()`): plain PyTorch's step leaves what it zeroed unchanged, the
        fused update had stepped it (0.022 off plain, silent; found by a helper). The boundary is taken (the
        next step goes on), then refused."""
        self._backwards_since_step = 0
        self._updated_since_step = False
        self._zeroed_after_update = False
        raise MemschedError(
            "zero_grad() (the optimizer's or a module's) ran after the backward pass whose fused optimizer update "
            "(fuse_optimizer=True) had already stepped the parameters with their gradients, and before the step "
            "boundary: plain PyTorch's optimizer.step() would leave the parameters whose gradients it dropped "
            "unchanged (or step them with zeros, set_to_none=False). That update stays applied. Zero gradients after "
            "the step boundary (optimizer.step() / run.step()), freeze parameters with requires_grad_(False) before "
            "backward, or use fuse_optimizer=False.")

    def _end_discarding_step(self) -> None:
        """The step boundary of a step that discarded a backward pass, or of the unfused step after one (Note
        [Backward passes whose gradients the loop discards])."""
        discarded, self._discarded_pass = self._discarded_pass, False
        if not discarded:
            self._probation = False  # the last one was a skipped step: fuse again
            return
        if not self._probation:
            self._probation = True  # the next step runs unfused, to see whether every step discards a pass
            return
        if not self._discard_followed:
            raise MemschedError(
                "fuse_optimizer=True: this step, like the one before it, called zero_grad() (the optimizer's or a "
                "module's) between the backward pass and the step boundary. With fuse_optimizer the update runs "
                "inside backward, before that zero_grad(), so it would step the parameters whose gradients plain "
                "PyTorch's optimizer.step() finds dropped and leaves unchanged. This step's update was not applied: "
                "the model and optimizer are as after the last step. Zero gradients after the step boundary, "
                "freeze parameters with requires_grad_(False) before backward, or use fuse_optimizer=False.")
        raise MemschedError(
            "fuse_optimizer=True: this step, like the one before it, ran a backward pass whose gradients the loop "
            "then dropped with zero_grad() before another backward pass (SAM's ascent pass, a pass whose gradients "
            "are only looked at). With fuse_optimizer the update runs inside the backward pass that completes a "
            "step, so it would use the first pass's gradients, which plain PyTorch discards. This step's update "
            "was not applied: the model and optimizer are as after the last step. Use fuse_optimizer=False "
            "(ooo=True keeps the out-of-order backward; Note [Backward passes whose gradients the loop "
            "discards] in memsched/ooo/backward.py).")

    def _check_late_edits(self) -> None:
        """See Note [Edits between backward and the step boundary]: warns once when the hyper-parameters
        or a parameter changed since the fused update of the last backward pass."""
        what = ""
        now = _hypers(self.optimizer)
        if now != self._hypers_at_update:
            changed = [f"param group {g}: {k} {before[k]!r} -> {after.get(k)!r}"
                       for g, (before, after) in enumerate(zip(self._hypers_at_update, now))
                       for k in before if before[k] != after.get(k)]
            what = "the optimizer's hyper-parameters changed (" + ("; ".join(changed[:3]) or "param groups") + ")"
        else:
            i = self._rt.first_changed_version()
            while i >= 0 and not self._stepper.owns(self._params[i]):
                # not the fused update's (another optimizer steps it after backward, as in plain PyTorch)
                i = self._rt.first_changed_version(i + 1)
            if i >= 0:
                what = f"parameter {self._name(i)} was modified in place"
        if not what:
            return
        self._warned_late_edit = True
        warnings.warn(
            f"memsched: {what} between the backward pass and the step boundary; with fuse_optimizer=True every "
            f"parameter was already updated during that backward pass, with the values of before, where plain "
            f"PyTorch's optimizer.step() would use the new ones. Make such changes before backward (set the "
            f"learning rate before the forward; call the LR scheduler's step() after the step boundary) or use "
            f"fuse_optimizer=False (Note [Edits between backward and the step boundary] in memsched/ooo/backward.py). "
            f"Warned once.", RuntimeWarning, stacklevel=user_stacklevel())

    def _name(self, i: int) -> str:
        root = self.model
        for n, p in root.named_parameters():
            if p is self._params[i]:
                return n
        return f"#{i}"

    def report(self) -> dict:
        """Counters of the last iteration and in total. Units in the names."""
        st = self._rt.stats() if self._rt is not None else {}
        tl = self._last_timeline
        t0 = next((t for e, *rest in tl for t in [rest[-1]] if e == "backward_start"), None)
        t_end = next((rest[-1] for e, *rest in tl if e == "backward_end"), None)
        ar = [rest[-1] for e, *rest in tl if e == "allreduce_start"]
        out = {
            "executor": getattr(self, "_executor", None),
            "iterations": self._iterations,
            "eligible_layers": self._eligible_layers,
            "params": len(self._params),
            "deferred_only_params": len(self._deferred_only),
            "deferred_items": st.get("enqueued", 0),
            "urgent_items": st.get("urgent", 0),
            "limit_flushes": st.get("limit_flushes", 0),
            "peak_deferred_bytes": st.get("peak_held_bytes", 0),
            "peak_queued_items": st.get("peak_queued", 0),
            "max_deferred_bytes": self.max_deferred_bytes,
            "fused_updates": self._fused_steps,
            "fused_updates_in_cpp": self._native_steps,  # of those, Adam/AdamW updates run in C++
            # C++ update calls (one per param group of a unit or batch) and the batch size (Note [Update batches])
            "fused_calls_in_cpp": self._rt.native_calls if self._rt is not None else 0,
            "update_batch_bytes": self._rt.update_batch_bytes if self._rt is not None else 0,
            "param_bytes": sum(_nbytes(p) for p in self._params),
            "peak_grad_bytes": self._last_peak_grad_bytes,
            "buckets": len(self._reducer.buckets) if self._reducer is not None else 0,
        }
        if t0 is not None and t_end is not None:
            out["backward_ms"] = (t_end - t0) * 1e3
            out["first_allreduce_start_ms"] = (min(ar) - t0) * 1e3 if ar else None
        return out
