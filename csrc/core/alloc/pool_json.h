// pool_json.h -- a BlockPool's statistics, segments and history as JSON text,
// laid out like torch.cuda.memory._snapshot() so that PyTorch's memory
// visualiser (torch/cuda/_memory_viz.py, pytorch.org/memory_viz) reads it:
//   {"stats": {"allocated_bytes.all.current": ..., ...},
//    "segments": [{"device", "address", "total_size", "allocated_size",
//                  "active_size", "requested_size", "stream", "segment_type",
//                  "segment_pool_id", "is_expandable", "frames",
//                  "blocks": [{"address", "size", "requested_size", "state",
//                              "frames"}]}],
//    "device_traces": [[{"action", "addr", "size", "stream", "time_us",
//                        "frames", "device_free"}]]}
// Plain text crosses every boundary (the pybind module, the C ABI of the
// pluggable-allocator library) without sharing C++ objects.
#pragma once

#include <string>

#include "core/alloc/block_pool.h"

namespace memsched {

// `device` is written into each segment; device_traces gets `device + 1`
// lists with this pool's history (when recorded) in the last one.
std::string pool_state_json(const BlockPool& pool, int device, bool include_history);

}  // namespace memsched
