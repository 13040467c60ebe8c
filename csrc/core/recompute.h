// recompute.h -- what recomputing an activation costs, derived from what the
// Trace already holds (producers, uses, op durations): which forward ops a
// replay re-runs, how long they take, what else they allocate, and whether
// they draw random numbers.
//
// Entry points: recompute_chain(), recompute_time_us(), recompute_transient_bytes().
//
// Note [Recompute model]
//   Rationale: a recompute decision needs, per activation, the ops that
//   recreate it and their cost. The trace already records every tensor's
//   producer op and the ops that read it, so the chain is derived, not
//   profiled separately (no new trace fields besides Op::rng, which old
//   traces derive from the op name).
//   Approach: candidate t (an offloadable activation, plan.h) is recreated just
//   before its first backward use b by replaying its producer op p. Each input
//   u of p (a tensor whose uses include p and whose producer is not p) must be
//   on the device at b:
//     - a non-candidate tensor is there iff live_start(u) <= b <= live_end(u)
//       (parameters, buffers, tensors held all step);
//     - a kept candidate is there iff live at b; a recomputed one iff an
//       earlier replay (or one before the same op) has recreated it and it
//       is still live at b; an offloaded one never counts as there, even if
//       its prefetch has brought it back by b (so the chain does not depend
//       on prefetch points), at the price of sometimes replaying more.
//   An absent input is itself recreated by replaying its producer, which must
//   be a forward op, recursively ("from its nearest kept inputs").
//   In-place writers: a storage is often allocated by one op and filled by
//   in-place ops (dropout's mask: empty_like, then bernoulli_ and div_), and
//   the trace records those as uses. So "replaying the producer" of a tensor
//   means replaying its producer AND every forward op among its uses whose
//   name is in-place (is_inplace_op_name: ATen's trailing underscore); a
//   tensor the chain recreates is never an input to fetch. An in-place op writing two operands (a.mul_(b) is a writer of
//   a only) is counted as a writer of both: the chain may be longer than
//   needed, never shorter. But replaying it writes its other operand too: an
//   in-place op of the chain that reads a tensor the chain does not recreate
//   (a live, kept one: ATen's LSTM cell adds the step's input gates into its
//   hidden gates in place) could write that live tensor, so such a chain is
//   refused (not recomputable; found by the module zoo's wrong LSTM
//   gradients). The chain
//   is the set of replayed ops in ascending (execution) order; each op is
//   replayed once. A tensor is not recomputable when an absent input has no
//   forward producer (a model input freed in forward) or the chain would
//   exceed kMaxRecomputeOps ops.
//   Shared replays (recompute_schedule): recomputed tensors are handled in
//   backward order (first backward use, then id). A replay that recreates
//   another recomputed tensor u on its way (the chain of a GELU output
//   replays the addmm whose output u the GELU reads) keeps u alive until u's
//   own first backward use: u's recompute_ops are then empty and its
//   recompute_at_op is the op before which that replay ran. Replaying ops
//   51, 52, 53 once instead of 51; 51, 52; 51, 52, 53 for three tensors of
//   one MLP block is what a checkpointed region does too. The same holds for
//   another output of a replayed op that the plan recomputes (max_pool2d's
//   values and indices, an LSTM cell's gates): the replay makes it anyway, so
//   it is kept from that replay (when the chain's ops are all its writers)
//   rather than replayed a second time, which made the op's outputs twice
//   (the measured peak 13% over the plan's on a CNN; found by a helper).
//   Memory: the replay allocates every output of the chain's ops; all but t
//   and the tensors it keeps alive are dropped once t exists. Time: the sum
//   of op_time_us() over the chain, on the compute stream (Note [Simulator
//   semantics]).
//   RNG: chain.rng is set when an op of the chain has Op::rng; the replay must
//   then restore the RNG state the forward saw (torch.utils.checkpoint's
//   preserve_rng_state) or the recreated tensor differs.
//   Limitations: in-place writers are recognised by name only (a custom op
//   that writes its input without a trailing underscore is missed, and the
//   chain's cost underestimated); the executor records the chain's ops in
//   the forward, and every op that writes what they made, and replays those
//   (Note [Unpack-time recompute] in python/memsched/offload/recompute.py),
//   so it stays exact whatever the model says.
//   Only forward ops are replayed. A chain with an op that draws from an RNG
//   state of its own (has_own_rng_state: cuDNN's RNNs and their dropout
//   state) is refused: no restored generator state reproduces its masks.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "core/device_model.h"
#include "core/plan.h"
#include "core/trace.h"

namespace memsched {

constexpr int64_t kMaxRecomputeOps = 64;  // longest chain a recompute may replay

struct RecomputeChain {
  bool feasible = false;        // every absent input could be recreated
  std::vector<int64_t> ops;     // forward ops to replay, ascending
  bool rng = false;             // some op of the chain draws random numbers (Op::rng)
  std::string why;              // when not feasible: the reason, for error messages
};

// Every recomputed candidate's chain under `decisions` (See Note [Recompute model]: shared replays).
struct RecomputeSchedule {
  std::vector<RecomputeChain> chains;            // per candidate; ops empty when an earlier replay keeps it
  std::vector<int64_t> at_op;                    // per candidate: op before which it is recreated; -1 if not
  std::vector<std::vector<int64_t>> kept_alive;  // per candidate: other candidates its replay recreates and keeps
};
RecomputeSchedule recompute_schedule(const Trace& trace, const OffloadAnalysis& analysis,
                                     const std::vector<TensorDecision>& decisions);

// The chain recreating analysis.candidates[candidate] if it were recomputed:
// with `decisions` empty, every other candidate kept; otherwise under
// `decisions` (one per candidate) with this candidate's own set to recompute.
RecomputeChain recompute_chain(const Trace& trace, const OffloadAnalysis& analysis, int64_t candidate,
                               const std::vector<TensorDecision>& decisions = {});

// ATen's factories of uninitialised memory (empty, empty_like, empty_strided, new_empty, ...): See
// Note [Memory filled outside the dispatcher] (recompute.cpp).
bool is_uninitialized_factory_name(const std::string& name);

// ATen's in-place naming: the base name (after "::", before any ".overload")
// ends in one underscore ("aten::div_", "aten::add_.Tensor"; not "__and__").
bool is_inplace_op_name(const std::string& name);

// An op that draws random numbers from an RNG state of its own, which no generator state saved
// around a replay restores: cuDNN's and MIOpen's RNNs keep their dropout state in a buffer the
// kernel advances in place ("aten::_cudnn_rnn", "aten::miopen_rnn"). A chain with one is refused
// (Note [Recompute model]), as the executor refuses to replay one that applied dropout (Note
// [Unpack-time recompute] in python/memsched/offload/recompute.py).
bool has_own_rng_state(const std::string& name);

// Sum of op_time_us() over `ops`.
double recompute_time_us(const Trace& trace, const DeviceModel& device, const std::vector<int64_t>& ops);

// Bytes the replay of `ops` allocates besides candidate `c` itself (all
// outputs of the ops minus c.bytes, never negative; the tensors it keeps
// alive included). Throws on an op id out of range.
int64_t recompute_transient_bytes(const OffloadAnalysis& analysis, const OffloadCandidate& c,
                                  const std::vector<int64_t>& ops);

}  // namespace memsched
