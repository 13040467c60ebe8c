// memsched_core.h -- the core's one include and its glossary. The core is C++17
// and the standard library only (+ nlohmann_json for trace I/O): no torch, no
// CUDA. Algorithms take plain structs -- sizes, times, op indices -- never tensors.
//
// Glossary
//   Trace          one training step: ops in execution order and the tensors
//                  they produce, use and free (trace.h); JSON in trace_json.h.
//   Op             one recorded operation: name, module path, phase, duration_us,
//                  flops, bytes read/written. Op ids are execution order.
//   TensorRecord   one storage after de-duplication: bytes, kind, producer op,
//                  uses, free op, label (Note [Activation identity]).
//   TraceBuilder   turns the profiler's event stream into a validated Trace.
//   DeviceModel    the S5 performance model: roofline op time, per-direction
//                  copy latency + bandwidth, budget (device_model.h).
//   Plan           per offloadable tensor a TensorDecision: keep, copy out
//                  after op a and prefetch at op b, or recompute by replaying
//                  forward ops before its first backward use (plan.h, Note
//                  [Plan semantics]; recompute.h, Note [Recompute model]).
//   Planner        makes a Plan for (Trace, DeviceModel, budget); registry by
//                  name: keep_all, offload_all_sync, offload_all_prefetch, vdnn,
//                  greedy, dp, hybrid (planner.h, dp_planner.h, hybrid_planner.h).
//   SimResult      what the discrete-event simulator of one compute and two copy
//                  streams predicts: step time, stalls, peak, bytes moved,
//                  timeline (simulator.h).
//   BlockPool      the caching allocator's logic: Blocks carved from Segments
//                  that a RawMemory backend provides, stream-ordered reuse
//                  through StreamEvents (alloc/block_pool.h).
//   Block/Segment  a Segment is one backend allocation; Blocks split it and
//                  coalesce back (alloc/block_pool.h, BlockInfo/SegmentInfo).
//   Stat           {current, peak, allocated, freed}, COUNT or SUM (alloc/alloc_stats.h).
//   Placement      fixed arena offsets for a step's tensors (alloc/placement_planner.h).
//   DwScheduler    the out-of-order backward's queue of deferred weight-gradient
//                  work: priorities, byte limit, contribution counting, DDP
//                  buckets (dw_scheduler.h).
#pragma once

#include "core/check.h"
#include "core/trace.h"
#include "core/trace_json.h"
#include "core/trace_builder.h"
#include "core/device_model.h"
#include "core/plan.h"
#include "core/planner.h"
#include "core/simulator.h"
#include "core/dp_planner.h"
#include "core/hybrid_planner.h"
#include "core/recompute.h"
#include "core/alloc/block_pool.h"
#include "core/alloc/alloc_stats.h"
#include "core/alloc/placement_planner.h"
#include "core/dw_scheduler.h"
