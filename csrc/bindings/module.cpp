// module.cpp -- memsched._C: registers every binding (See Note [One module,
// several binding files] in bindings.h).
#include "bindings/bindings.h"

PYBIND11_MODULE(_C, m) {
  m.doc() = "memsched native core: trace, simulator, planners, allocator, scheduler";
  memsched::bindings::bind_errors(m);
  memsched::bindings::bind_trace(m);
  memsched::bindings::bind_plan(m);
  memsched::bindings::bind_trace_builder(m);
  memsched::bindings::bind_torch(m);
  memsched::bindings::bind_saved_tensors(m);
  memsched::bindings::bind_copy_engine(m);
  memsched::bindings::bind_sched(m);
  memsched::bindings::bind_ooo(m);
  memsched::bindings::bind_alloc(m);
  memsched::bindings::bind_pipeline(m);
  memsched::bindings::bind_partition(m);
#ifdef MEMSCHED_WITH_CUDA
  m.attr("built_with_cuda") = true;
#else
  m.attr("built_with_cuda") = false;
#endif
}
