"""One plan per input shape: the step signature a Run keys its plans by.

Entry points: step_signature(args, kwargs), describe(signature), PLAN_FIELDS, MAX_SHAPE_PLANS.

Note [One plan per input shape]
  Rationale: a plan is made from one profiled step and matched against later steps activation by
  activation, shapes included (Note [Activation identity]). Batches whose shapes change from step to
  step -- dynamic padding, the default of Hugging Face's collators, a smaller last batch -- never
  matched: each change cost two plain steps and a re-profile, and once max_reprofiles was spent every
  step ran plainly (found by a helper training a Hugging Face model: 3 profiled, 0 planned, 5 plain).
  Approach: the Run keys its plans by the signature of a step's first forward with gradients enabled
  -- shape, dtype and device of every tensor among the model's arguments -- and keeps up to
  max_shape_plans of them (an option of optimize(); MAX_SHAPE_PLANS by default, 1 turns it off). At that forward (before the executor begins the step) a signature other
  than the current plan's switches to its plan when one was made, or has this step profiled and
  planned when there is room: a new sequence length costs one profiled step, once. Each plan is made
  for the same budget (a fraction: of that step's own activation memory). A re-profile after
  mismatching steps (other control flow) replaces the plan of its signature. With
  pad_to_multiple_of= (a few lengths) every step runs a plan after the first of each length.
  budget=None keeps one plan (keep everything, for any shape). A byte budget that a step of new
  shapes cannot be planned within is refused at its run.step(), naming the least budget, as the
  first step's is (before, such a step ran plainly over the budget after a mismatch).
  An evaluation under no_grad that began the executor's step (it saved nothing) does not stop the
  switch, and a profile is filed under the shapes of its first forward with gradients.
  A step of new shapes past max_shape_plans warns once, naming the cap, and run.report() counts such
  steps; a re-profile of new shapes at the cap drops the plan left longest ago (it had filed one beyond
  the cap).
  Limitations: with gradient accumulation a step is keyed by its first micro-batch: micro-batches of
  other shapes in one step mismatch its plan (pad the micro-batches of a step to one length; the Hugging
  Face Trainer collates each micro-batch on its own, so padding='max_length' there); the mismatch's
  warning and run.report() name the later forward's shapes against the plan's step's at that position,
  and that fix. Past
  max_shape_plans signatures, a new one runs against the current plan as before (a
  mismatch, then re-profiles up to max_reprofiles). The signature does not see non-tensor arguments
  or shapes made inside the forward; a step they change mismatches as before. Under torch.distributed
  each process plans its own steps: a byte budget one rank's new shapes cannot meet is refused on that
  rank only, and the message says not to go on.
"""
from torch.utils._pytree import tree_leaves

import torch

__all__ = ["step_signature", "describe", "PLAN_FIELDS", "MAX_SHAPE_PLANS"]

MAX_SHAPE_PLANS = 8

# What a Run's plan is made of, saved and restored when it switches plans (Run._plan_state)
PLAN_FIELDS = ("trace", "budget_bytes", "plan", "schedule", "simulation", "host_limit_note_", "prefetch_note_",
               "node_of_op_", "forward_starts_", "unmodeled_bytes_", "profile_stats", "profile_eval_grad_",
               "profile_forward_in_backward_", "optimizer_state_extra_", "plan_index_", "plan_checked_", "plan_sigs_")


def step_signature(args, kwargs):
    """(shape, dtype, device) of every tensor among a forward's arguments; None where one has no plain
    shape (a nested tensor: its steps are matched as before)."""
    out = []
    for t in tree_leaves((args, kwargs)):
        if isinstance(t, torch.Tensor):
            if t.is_nested:
                return None
            out.append((tuple(t.shape), t.dtype, t.device))
    return tuple(out)


def describe(signature):
    """'[8, 128] int64, [8, 128] int64' for messages."""
    if not signature:
        return "no tensor arguments"
    return ", ".join(f"{list(shape)} {str(dtype).removeprefix('torch.')}" for shape, dtype, _ in signature)
