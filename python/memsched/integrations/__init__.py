"""memsched inside the training loops people already use.

  memsched.integrations.transformers.MemschedCallback  a transformers.TrainerCallback
  memsched.integrations.lightning.MemschedCallback     a lightning.pytorch.Callback

Each turns memsched.optimize() on for the model the trainer trains, from the trainer's first
training step to its end, and logs run figures through the trainer's logger. Importing memsched
(or this package) imports neither framework: import the submodule you use. Both rest on
optimize()'s optimizer step routing (Note [optimizer.step() without run.step()] in step_hook.py)
and share _common.py.
"""
