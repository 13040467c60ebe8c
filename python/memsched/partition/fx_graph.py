"""A torch.fx GraphModule as a training-step Trace with one forward op per graph node, so a
partition of the trace is a placement of the graph's nodes.

Entry points: to_graph_module(model) -> GraphModule (a clear error naming the module fx cannot
trace); graph_trace(gm, example_inputs) -> GraphTrace(trace, forward_op_of_node, node_of_op).

Note [A graph module as a trace]
  Rationale: memsched.profile records aten ops, which do not map one-to-one onto fx nodes; a
  partition that is to become pipeline stages needs a device per node.
  Approach: the module runs once on the example inputs under an fx Interpreter; each call_module,
  call_function and call_method node becomes a forward op with its measured time (wall clock),
  FLOPs (torch.utils.flop_counter) and bytes. Then a loss op, one backward op per node in reverse
  order (twice the forward's time and FLOPs: dX and dW), and one optimizer op per node that owns
  parameters. Tensors: a node's output lives from its op to the backward of its last consumer
  (saved for backward); its gradient from the backward of its last consumer to its own backward;
  a node's parameters (one record per node) live all step with their gradient (backward to the
  optimizer op) and Adam's state (2x the parameters, all step). Module paths are the call_module
  targets (a function node uses its node name), so layers and repair units follow the modules.
  Limitations: a model of a training step, not a profile: autograd's actual saved tensors and
  temporaries differ; profile the real step (memsched.profile) for figures you will quote.
"""
import contextlib
import time
from dataclasses import dataclass
from typing import Dict, List, Optional

import torch
import torch.fx
from torch.utils.flop_counter import FlopCounterMode

from memsched import _C

_COMPUTE = ("call_module", "call_function", "call_method")


class _PathTracer(torch.fx.Tracer):
    """symbolic_trace's tracer, remembering the module being traced when an error happens."""

    def __init__(self):
        super().__init__()
        self.stack = []

    def call_module(self, m, forward, args, kwargs):
        self.stack.append(self.path_of_module(m))
        result = super().call_module(m, forward, args, kwargs)
        self.stack.pop()  # left in place when the module raised: the error names it
        return result


def to_graph_module(model):
    """`model` if it is a GraphModule, else torch.fx.symbolic_trace of it; an untraceable model
    raises TypeError naming the innermost module being traced and the way out."""
    if isinstance(model, torch.fx.GraphModule):
        return model
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"partition: expected a memsched.Trace, a trace JSON path, a torch.fx.GraphModule or an "
                        f"nn.Module, got {type(model).__name__}")
    tracer = _PathTracer()
    try:
        graph = tracer.trace(model)
    except Exception as e:  # fx raises TraceError, TypeError, RuntimeError... for untraceable code
        where = tracer.stack[-1] if tracer.stack else ""
        sub = model.get_submodule(where) if where else model
        name = f"module '{where}' ({type(sub).__name__})" if where else f"the top-level module ({type(model).__name__})"
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise TypeError(f"partition: torch.fx cannot trace {name}: {type(e).__name__}: {first}. Make its forward "
                        f"traceable (no control flow on tensor values), or profile the step with memsched.profile "
                        f"and pass the Trace instead") from e
    return torch.fx.GraphModule(model, graph)


@dataclass
class GraphTrace:
    trace: object                        # memsched.Trace
    forward_op_of_node: Dict[str, int]   # fx node name -> its forward op id
    node_of_op: List[Optional[str]]      # op id -> fx node name (None for the loss op)
    backward_op_of_node: Dict[str, int]
    optimizer_op_of_node: Dict[str, int]


def _storages(value, out):
    if isinstance(value, torch.Tensor):
        out[value.untyped_storage().data_ptr()] = value.untyped_storage().nbytes()
    elif isinstance(value, (list, tuple)):
        for v in value:
            _storages(v, out)
    elif isinstance(value, dict):
        for v in value.values():
            _storages(v, out)
    return out


# Note [Measuring leaves the model as it was]
#   Rationale: graph_trace runs the user's own modules (to_graph_module shares them) once, in the mode
#   they are in: train mode measures the ops training runs (eval would swap BatchNorm's batch
#   statistics for its running ones and skip Dropout). That run updated BatchNorm's running_mean,
#   running_var and num_batches_tracked and advanced the global RNG (Dropout), so partitioning a model
#   and then training it trained differently from the same loop without the call.
#   Approach: every buffer (the tensor each module holds, and a copy of its values) and the RNG state
#   of the CPU and of the CUDA devices the model or inputs use are saved before the run and restored
#   after it, also when the run raises. Parameters are not saved: the run is under no_grad and
#   changes no parameter unless the forward writes one itself.
@contextlib.contextmanager
def _model_state_kept(gm, example_inputs):
    held = [(m, name, b, b.detach().clone()) for m in gm.modules() for name, b in m._buffers.items()
            if b is not None]
    tensors = [t for t in list(gm.parameters()) + list(gm.buffers()) + list(example_inputs)
               if isinstance(t, torch.Tensor)]
    cuda = sorted({t.device.index for t in tensors if t.is_cuda})
    try:
        with torch.random.fork_rng(devices=cuda):
            yield
    finally:
        with torch.no_grad():
            for m, name, b, values in held:
                m._buffers[name] = b  # the tensor the module held (a forward may have rebound it)
                b.copy_(values)


def graph_trace(gm, example_inputs, optimizer_state_factor=2.0):
    """The Trace of Note [A graph module as a trace] for `gm` run on `example_inputs` (a tuple)."""
    if not isinstance(example_inputs, (tuple, list)):
        example_inputs = (example_inputs,)
    nodes = list(gm.graph.nodes)
    info = {}

    class _Recorder(torch.fx.Interpreter):
        def run_node(self, n):
            if n.op not in _COMPUTE:
                out = super().run_node(n)
                info[n.name] = (sum(_storages(out, {}).values()), 0.0, 0.0)
                return out
            with FlopCounterMode(display=False) as fc:
                t0 = time.perf_counter()
                out = super().run_node(n)
                dt = time.perf_counter() - t0
            info[n.name] = (sum(_storages(out, {}).values()), dt * 1e6, float(fc.get_total_flops()))
            return out

    with torch.no_grad(), _model_state_kept(gm, example_inputs):
        _Recorder(gm).run(*example_inputs)

    compute = [n for n in nodes if n.op in _COMPUTE]
    users = {n.name: [u for u in n.users if u.op in _COMPUTE] for n in nodes}
    outputs = [n for n in nodes if n.op == "output"]
    to_loss = set()
    for o in outputs:
        torch.fx.node.map_arg(o.args, lambda a: to_loss.add(a.name))

    def param_bytes(n):
        if n.op == "call_module":
            return sum(p.numel() * p.element_size() for p in gm.get_submodule(n.target).parameters())
        return 0

    def path(n):
        return n.target if n.op == "call_module" else n.name

    trace = _C.Trace()
    trace.device = "cpu"
    fwd, bwd, opt = {}, {}, {}
    node_of_op = []
    for n in compute:
        out_bytes, us, flops = info[n.name]
        in_bytes = sum(info[a.name][0] for a in n.all_input_nodes)
        fwd[n.name] = trace.add_op(f"fx::{n.op}:{n.target if n.op != 'call_function' else n.target.__name__}",
                                   path(n), "forward", us, flops, in_bytes + param_bytes(n), out_bytes)
        node_of_op.append(n.name)
    loss = trace.add_op("loss", "", "forward", 0.0, 0.0, sum(info[a][0] for a in to_loss), 4)
    node_of_op.append(None)
    for n in reversed(compute):
        out_bytes, us, flops = info[n.name]
        in_bytes = sum(info[a.name][0] for a in n.all_input_nodes)
        bwd[n.name] = trace.add_op(f"fx::backward:{path(n)}", path(n), "backward", 2 * us, 2 * flops,
                                   in_bytes + out_bytes + param_bytes(n), in_bytes + param_bytes(n))
        node_of_op.append(n.name)
    for n in compute:
        pb = param_bytes(n)
        if pb:
            opt[n.name] = trace.add_op(f"fx::optimizer:{path(n)}", path(n), "optimizer", 0.0, 2.5 * pb,
                                       int((2 + optimizer_state_factor) * pb), int((1 + optimizer_state_factor) * pb))
            node_of_op.append(n.name)

    def first_backward(consumers, is_loss_input):
        # The consumer whose backward runs first (reverse order), or the loss.
        cands = [bwd[c.name] for c in consumers]
        if is_loss_input:
            cands.append(loss)
        return min(cands) if cands else None

    for n in nodes:
        if n.op not in _COMPUTE and n.op != "placeholder" and n.op != "get_attr":
            continue
        nbytes = info[n.name][0]
        consumers = users[n.name]
        feeds_loss = n.name in to_loss
        uses = [fwd[c.name] for c in consumers] + [bwd[c.name] for c in consumers] + ([loss] if feeds_loss else [])
        uses = sorted(set(uses))
        if n.op in ("placeholder", "get_attr"):
            kind = "parameter" if n.op == "get_attr" else "activation"
            if nbytes:
                trace.add_tensor(nbytes, "float32", kind, -1, uses, -1, f"input:{n.name}")
            continue
        producer = fwd[n.name]
        if nbytes:
            trace.add_tensor(nbytes, "float32", "activation", producer, uses, max(uses) if uses else producer,
                             f"out:{n.name}")
            g = first_backward(consumers, feeds_loss)
            if g is not None and g < bwd[n.name]:
                guses = sorted({bwd[c.name] for c in consumers if bwd[c.name] != g} | {bwd[n.name]})
                trace.add_tensor(nbytes, "float32", "temporary", g, guses, max(guses), f"grad:{n.name}")
        pb = param_bytes(n)
        if pb:
            trace.add_tensor(pb, "float32", "parameter", -1, sorted({producer, bwd[n.name], opt[n.name]}), -1,
                             f"param:{n.name}")
            trace.add_tensor(pb, "float32", "gradient", bwd[n.name], [opt[n.name]], opt[n.name], f"pgrad:{n.name}")
            trace.add_tensor(int(optimizer_state_factor * pb), "float32", "optimizer_state", -1, [opt[n.name]], -1,
                             f"state:{n.name}")
    trace.validate()
    return GraphTrace(trace, fwd, node_of_op, bwd, opt)
