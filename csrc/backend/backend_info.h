// backend_info.h -- what this build of the backends can do.
#pragma once

namespace memsched {

// True when the CUDA backends were compiled in (MEMSCHED_WITH_CUDA); says
// nothing about whether a GPU is present at run time.
bool backend_built_with_cuda();

}  // namespace memsched
