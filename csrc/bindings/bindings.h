// bindings.h -- the bind_* functions that module.cpp calls to fill memsched._C.
//
// Note [One module, several binding files]
//   Rationale: STYLE.md wants one file that registers every binding; a file
//   that includes torch headers costs ~30 s and ~1 GB to compile here.
//   Approach: module.cpp is the one registry (it calls every bind_* below, in
//   order); each bind_*.cpp binds one component with pybind11 alone, so only
//   bind_torch.cpp, bind_saved_tensors.cpp, bind_copy_engine.cpp and bind_ooo.cpp pay for torch headers. pybind11 is
//   torch's bundled copy.
#pragma once

#include <pybind11/pybind11.h>

namespace memsched {
struct DwStats;
}

namespace memsched::bindings {

// DwStats as the dict both the scheduler and the ooo runtime return from .stats() (bind_sched.cpp).
pybind11::dict dw_stats_dict(const DwStats& st);

void bind_errors(pybind11::module_& m);
void bind_trace(pybind11::module_& m);
void bind_plan(pybind11::module_& m);
void bind_trace_builder(pybind11::module_& m);
void bind_torch(pybind11::module_& m);
void bind_saved_tensors(pybind11::module_& m);
void bind_copy_engine(pybind11::module_& m);
void bind_sched(pybind11::module_& m);
void bind_ooo(pybind11::module_& m);
void bind_alloc(pybind11::module_& m);
void bind_pipeline(pybind11::module_& m);
void bind_partition(pybind11::module_& m);

}  // namespace memsched::bindings
