"""peak_gap.py -- where a planned step's measured peak went when it is over the plan.

Entry points: PhasePeaks (what a step records), explain_peak_gap(planned, stats) -> PeakGap.

Note [Where the peak went]
  Rationale: on an H100 memsched's plans were missed by up to 3x, and nothing said why: a copy
  the host saw complete too late, memory the profiled step never held (a workspace, a cast, a
  temporary), the optimizer's update, or the allocator's own segments. run.report() must say
  where a gap over 2% between the planned and the measured peak comes from (issue 11), from what
  a step measures anyway: no synchronisation, nothing per tensor beyond two integers.
  Approach: on an accelerator every planned step records, from the allocator's host-side counters
    - its peak after each phase: at the end of each forward, at the end of the backward
      (run.step() / the framework's optimizer.step()) and after the optimizer's update. The
      peak is not restarted between them (torch.cuda.max_memory_allocated() still covers the
      whole step), so the phase of the step's peak is the first whose reading reached it;
    - the highest count the memory guard read (at each activation's first save and before each
      fetch while copies are in flight, Note [Memory guard]) and the device bytes the copy
      engine held at that reading for D2H copies still in flight (CopyEngine.held_source_bytes):
      blocks the plan had given back, which the allocator could not yet reuse;
    - its reserved peak (torch.cuda.max_memory_reserved()).
  explain_peak_gap() splits measured - planned into
    - "optimizer update": the whole gap, when the step's peak came in the update (its temporaries
      and state are not activations: no plan moves them; a fused optimizer or fuse_optimizer=True
      lowers them);
    - "late release": at the guard's highest reading, the part of its excess over the plan that
      copies in flight held (at most the gap);
    - "not in the profiled step": the rest -- workspaces, autocast casts, temporaries and
      rounding the profiled step did not hold as this step did. The profiled step's own ones are
      in the plan already (Note [Memory the trace does not model]; the autocast cache through
      Note [Held outside the graph]);
  and reports apart "fragmentation": reserved beyond allocated at the peak. Only the steps of the
  current plan are compared with it: each StepStats carries the plan it ran (plan_index) and that
  plan's budget, so after a re-profile the earlier steps are held to their own (a fraction's bytes
  are re-resolved then). The budget counts
  allocated bytes, as max_memory_allocated does, but an out-of-memory error counts segments.
  The executor starts a new allocator peak at each step's first forward (the profiler at each op
  of a profiled step), so torch.cuda.max_memory_allocated() read after run.step() is that step's.
  Limitations: the guard reads the count only at saves and fetches; a peak between two readings
  (inside an op's workspace) is "not in the profiled step" even when copies in flight added to
  it. With several forwards per step (gradient accumulation) a backward between two forwards
  counts as the later forward's phase.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional

from memsched.units import format_bytes

GAP_TOLERANCE = 0.02  # a measured peak within 2% over the plan needs no explanation
PHASES = ("forward", "backward", "update")


@dataclass
class PhasePeaks:
    """A step's allocator peak as read after each phase (cumulative: the step's peak so far)."""
    forward: int = 0    # max over the step's forwards, read at each forward's end
    backward: int = 0   # read when the step's backward is done (before the update)
    update: int = 0     # read after the optimizer's update; 0 until it ran

    def peak_phase(self) -> str:
        """The first phase whose reading reached the step's peak ("" with no reading)."""
        top = max(self.forward, self.backward, self.update)
        if top <= 0:
            return ""
        return next(p for p in PHASES if getattr(self, p) >= top)


@dataclass
class PeakGap:
    """explain_peak_gap()'s answer for one step; str() is run.report()'s lines."""
    planned_bytes: int
    measured_bytes: int
    peak_phase: str = ""              # "forward", "backward", "update" or "" (not read)
    categories: Dict[str, int] = field(default_factory=dict)   # name -> bytes; they sum to the gap
    fragmentation_bytes: Optional[int] = None  # reserved beyond allocated at the peak; None: not read

    @property
    def gap_bytes(self) -> int:
        return self.measured_bytes - self.planned_bytes

    @property
    def explained(self) -> bool:
        """Whether the gap is over the tolerance (and so has categories)."""
        return bool(self.categories)

    def lines(self) -> List[str]:
        if not self.explained:
            return []
        pct = 100.0 * self.gap_bytes / self.planned_bytes if self.planned_bytes else float("inf")
        where = f", reached in the {self.peak_phase}" if self.peak_phase else ""
        out = [f"peak gap (the step of the current plan with the highest peak): measured {format_bytes(self.measured_bytes)} (max_memory_allocated"
               f"{where}) is {format_bytes(self.gap_bytes)} ({pct:.1f}%) over the planned "
               f"{format_bytes(self.planned_bytes)} (Note [Where the peak went]):"]
        for name, n in self.categories.items():
            out.append(f"  {name}: {format_bytes(n)}  ({_WHY[name]})")
        if self.fragmentation_bytes is not None:
            out.append(f"  fragmentation (not in the gap): the allocator reserved {format_bytes(self.fragmentation_bytes)} "
                       "beyond its allocated peak; the budget counts allocated bytes, an out-of-memory error counts "
                       "reserved ones")
        return out

    def __str__(self):
        return "\n".join(self.lines())


_WHY = {
    "optimizer update": "the peak came in optimizer.step(): its temporaries and state are no activations; "
                        "a fused optimizer (AdamW(fused=True)) or fuse_optimizer=True lowers them",
    "late release": "device blocks of offloaded activations whose D2H copies were still in flight at the "
                    "memory guard's highest reading: the plan had freed them",
    "not in the profiled step": "workspaces, autocast casts, temporaries or rounding this step held and the "
                                "profiled one did not: another sequence length or code path, or a peak between "
                                "two of the memory guard's readings",
}


def explain_peak_gap(planned_bytes: int, stats) -> PeakGap:
    """Split `stats`' measured peak above `planned_bytes` (the plan's whole-step peak) into the
    categories of Note [Where the peak went]; no categories when it is within GAP_TOLERANCE."""
    phases: PhasePeaks = stats.phase_peaks
    measured = stats.peak_bytes
    gap = PeakGap(planned_bytes=int(planned_bytes), measured_bytes=int(measured),
                  peak_phase=phases.peak_phase() if phases is not None else "")
    if stats.reserved_peak_bytes:
        gap.fragmentation_bytes = max(0, stats.reserved_peak_bytes - measured)
    excess = measured - planned_bytes
    if planned_bytes <= 0 or excess <= planned_bytes * GAP_TOLERANCE:
        return gap
    if gap.peak_phase == "update":
        gap.categories["optimizer update"] = excess
        return gap
    late = 0
    if stats.sampled_peak_bytes > planned_bytes:
        late = min(stats.in_flight_at_sampled_peak, stats.sampled_peak_bytes - planned_bytes, excess)
    if late:
        gap.categories["late release"] = late
    if excess - late:
        gap.categories["not in the profiled step"] = excess - late
    return gap
