// backend_info.cpp -- see backend_info.h.
#include "backend/backend_info.h"

namespace memsched {

bool backend_built_with_cuda() {
#ifdef MEMSCHED_WITH_CUDA
  return true;
#else
  return false;
#endif
}

}  // namespace memsched
