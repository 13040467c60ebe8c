// bind_alloc.cpp -- memsched._C.BlockPool (a pool Python drives directly:
// host, virtual, CUDA device or pinned backend), plan_placement / Placement,
// replay_trace, OutOfMemoryError. No torch headers (the torch-facing
// HostTensorPool lives in bind_torch.cpp).
#include <pybind11/stl.h>

#include <limits>
#include <memory>
#include <string>

#include "backend/cuda_backend.h"
#include "backend/host_memory.h"
#include "bindings/bindings.h"
#include "core/alloc/block_pool.h"
#include "core/alloc/placement_planner.h"
#include "core/alloc/pool_json.h"
#include "core/alloc/trace_replay.h"
#include "core/alloc/virtual_memory.h"

namespace py = pybind11;

namespace memsched::bindings {
namespace {

// A BlockPool plus the backend objects Python may need to poke (manual events).
class PyBlockPool {
 public:
  PyBlockPool(const std::string& backend, int device, size_t capacity_bytes, bool split_blocks,
              bool manual_events)
      : backend_(backend), device_(device) {
    std::shared_ptr<RawMemory> raw;
    std::shared_ptr<StreamEvents> events;
    const size_t cap = capacity_bytes == 0 ? std::numeric_limits<size_t>::max() : capacity_bytes;
    if (backend == "host" || backend == "virtual") {
      if (backend == "host") raw = std::make_shared<HostRawMemory>(4096, cap);
      else raw = std::make_shared<VirtualRawMemory>(cap);
      manual_ = std::make_shared<ManualStreamEvents>(/*immediate=*/!manual_events);
      events = manual_;
    } else if (backend == "cuda" || backend == "cuda_pinned") {
      MEMSCHED_CHECK(!manual_events, "BlockPool: manual_events is only for the 'host' and 'virtual' "
                     "backends; CUDA pools use real CUDA events");
      MEMSCHED_CHECK(capacity_bytes == 0, "BlockPool: capacity_bytes is only for the 'host' and "
                     "'virtual' backends");
      raw = backend == "cuda" ? make_cuda_device_memory(device) : make_cuda_pinned_memory();
      events = make_cuda_stream_events(backend == "cuda" ? device : -1);
    } else {
      MEMSCHED_CHECK(false, "BlockPool: unknown backend '", backend,
                     "'; expected 'host', 'virtual', 'cuda' or 'cuda_pinned'");
    }
    PoolOptions options;
    options.split_blocks = split_blocks;
    pool_ = std::make_shared<BlockPool>(raw, events, options);
  }

  BlockPool& pool() { return *pool_; }
  ManualStreamEvents& manual() {
    MEMSCHED_CHECK(manual_ != nullptr, "BlockPool: events are real CUDA events on backend '",
                   backend_, "'; only host/virtual pools complete events by hand");
    return *manual_;
  }
  const std::string& backend() const { return backend_; }
  int device() const { return device_; }

 private:
  std::string backend_;
  int device_;
  std::shared_ptr<ManualStreamEvents> manual_;
  std::shared_ptr<BlockPool> pool_;
};

void* as_ptr(uintptr_t address) { return reinterpret_cast<void*>(address); }

py::dict stats_dict(const AllocatorStats& stats) {
  py::dict d;
  for (const auto& [key, value] : flatten_stats(stats)) d[py::str(key)] = value;
  return d;
}

}  // namespace

void bind_alloc(py::module_& m) {
  static py::exception<OutOfMemoryError> oom(m, "OutOfMemoryError", m.attr("MemschedError").ptr());
  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const OutOfMemoryError& e) {
      PyErr_SetString(oom.ptr(), e.what());
    }
  });

  py::class_<PyBlockPool>(m, "BlockPool",
                          "memsched's caching block pool over one backend: 'host' (aligned malloc), "
                          "'virtual' (fake addresses, no memory), 'cuda' (device), 'cuda_pinned' "
                          "(cudaHostAlloc). Addresses are plain ints. See csrc/core/alloc/block_pool.h.")
      .def(py::init<const std::string&, int, size_t, bool, bool>(), py::arg("backend") = "host",
           py::arg("device") = 0, py::arg("capacity_bytes") = 0, py::arg("split_blocks") = true,
           py::arg("manual_events") = false,
           "capacity_bytes: refuse segments beyond this (host/virtual; 0 = unlimited). "
           "manual_events: events complete only via complete_next_event/complete_stream "
           "(host/virtual), else at once.")
      .def("malloc", [](PyBlockPool& p, size_t nbytes, StreamHandle stream) {
             return reinterpret_cast<uintptr_t>(p.pool().malloc(nbytes, stream));
           }, py::arg("nbytes"), py::arg("stream") = 0)
      .def("free", [](PyBlockPool& p, uintptr_t address) { p.pool().free(as_ptr(address)); },
           py::arg("address"))
      .def("record_stream", [](PyBlockPool& p, uintptr_t address, StreamHandle stream) {
             p.pool().record_stream(as_ptr(address), stream);
           }, py::arg("address"), py::arg("stream"))
      .def("complete_next_event", [](PyBlockPool& p, StreamHandle s) { return p.manual().complete_next(s); },
           py::arg("stream"))
      .def("complete_stream", [](PyBlockPool& p, StreamHandle s) { p.manual().complete_all(s); },
           py::arg("stream"))
      .def("process_events", [](PyBlockPool& p) { p.pool().process_events(); })
      .def("empty_cache", [](PyBlockPool& p) { p.pool().empty_cache(); },
           py::call_guard<py::gil_scoped_release>())
      .def("block_size", [](PyBlockPool& p, uintptr_t a) { return p.pool().block_size(as_ptr(a)); },
           py::arg("address"))
      .def("owns", [](PyBlockPool& p, uintptr_t a) { return p.pool().owns(as_ptr(a)); },
           py::arg("address"))
      .def("stats", [](PyBlockPool& p) { return stats_dict(p.pool().stats()); },
           "Statistics keyed like torch.cuda.memory_stats().")
      .def("state_json", [](PyBlockPool& p, bool include_history) {
             return pool_state_json(p.pool(), p.device(), include_history);
           }, py::arg("include_history") = true,
           "Statistics, segments and history as JSON in torch.cuda.memory._snapshot()'s layout.")
      .def("record_history", [](PyBlockPool& p, bool enabled, size_t max_entries) {
             p.pool().record_history(enabled, max_entries);
           }, py::arg("enabled") = true, py::arg("max_entries") = 100000)
      .def("reset_peak_stats", [](PyBlockPool& p) { p.pool().reset_peak_stats(); })
      .def("reset_accumulated_stats", [](PyBlockPool& p) { p.pool().reset_accumulated_stats(); })
      .def("check_invariants", [](PyBlockPool& p) { p.pool().check_invariants(); })
      .def_property_readonly("largest_free_block", [](PyBlockPool& p) { return p.pool().largest_free_block(); })
      .def_property_readonly("pending_free_blocks", [](PyBlockPool& p) { return p.pool().pending_free_blocks(); })
      .def_property_readonly("backend", &PyBlockPool::backend)
      .def_property_readonly("device", &PyBlockPool::device);

  py::class_<Placement>(m, "Placement", "Offsets of a step's tensors in one arena (plan_placement).")
      .def_readonly("offsets", &Placement::offsets, "per tensor id: byte offset; -1 for empty tensors")
      .def_readonly("sizes", &Placement::sizes, "per tensor id: aligned bytes")
      .def_readonly("arena_bytes", &Placement::arena_bytes)
      .def_readonly("lower_bound_bytes", &Placement::lower_bound_bytes, "the trace's peak live bytes")
      .def_readonly("strategy", &Placement::strategy)
      .def_property_readonly("ratio", &Placement::ratio, "arena_bytes / lower_bound_bytes")
      .def("check_invariants", &Placement::check_invariants, py::arg("trace"),
           py::arg("alignment_bytes") = 512)
      .def("__repr__", [](const Placement& p) {
        return "Placement(arena_bytes=" + std::to_string(p.arena_bytes) +
               ", lower_bound_bytes=" + std::to_string(p.lower_bound_bytes) +
               ", ratio=" + std::to_string(p.ratio()) + ", strategy='" + p.strategy + "')";
      });

  m.def("plan_placement", [](const Trace& trace, int64_t alignment_bytes) {
          PlacementOptions options;
          options.alignment_bytes = alignment_bytes;
          return plan_placement(trace, options);
        }, py::arg("trace"), py::arg("alignment_bytes") = 512,
        "Lay out the trace's tensors at fixed offsets in one arena (greedy interval packing).",
        py::call_guard<py::gil_scoped_release>());

  m.def("replay_trace", [](const Trace& trace, bool split_blocks, int steps) {
          PoolOptions options;
          options.split_blocks = split_blocks;
          ReplayResult r;
          {
            py::gil_scoped_release release;
            r = replay_trace(trace, options, steps);
          }
          py::dict d;
          d["peak_live_bytes"] = r.peak_live_bytes;
          d["peak_reserved_bytes"] = r.peak_reserved_bytes;
          d["peak_allocated_bytes"] = r.peak_allocated_bytes;
          d["allocations"] = r.allocations;
          d["stats"] = stats_dict(r.stats);
          return d;
        }, py::arg("trace"), py::arg("split_blocks") = true, py::arg("steps") = 2,
        "Replay the trace's allocations on a fresh block pool over virtual memory "
        "(See Note [Replaying a step]); peaks in bytes.");

  m.def("cuda_device_count", &cuda_device_count,
        "CUDA devices visible to memsched's backend (0 without CUDA); creates no context on a CPU-only machine.");
}

}  // namespace memsched::bindings
