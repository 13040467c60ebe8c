// pool_options.h -- how the block pool rounds requests, picks a pool, sizes
// new segments and decides to split. Defaults follow PyTorch's CUDA caching
// allocator so that memsched's reserved memory is comparable with torch's.
//
// Note [Size classes]
//   Rationale: many small tensors (biases, norms, scalars) would each waste a
//   whole segment; large tensors would fragment small segments.
//   Approach: every request is rounded up to a multiple of min_block_bytes
//   (512 B). Rounded sizes <= small_size_bytes (1 MiB) come from the small
//   pool, whose segments are small_segment_bytes (2 MiB) and split down to
//   512 B. Larger ones come from the large pool: requests below
//   min_large_alloc_bytes (10 MiB) share large_segment_bytes (20 MiB)
//   segments; bigger ones get a segment of their own rounded to
//   large_round_bytes (2 MiB). A large free block is split only if the rest
//   exceeds small_size_bytes (a smaller rest is given away with the block).
//   split_blocks = false gives "plain best fit": one segment per request of
//   exactly the rounded size, reused whole by later requests that fit.
#pragma once

#include <cstddef>

namespace memsched {

struct PoolOptions {
  size_t min_block_bytes = 512;                  // rounding unit and smallest block
  size_t small_size_bytes = 1u << 20;            // largest request served by the small pool
  size_t small_segment_bytes = 2u << 20;         // size of a small-pool segment
  size_t min_large_alloc_bytes = 10u << 20;      // below this, large requests share segments
  size_t large_segment_bytes = 20u << 20;        // size of a shared large-pool segment
  size_t large_round_bytes = 2u << 20;           // rounding of a dedicated large segment
  bool split_blocks = true;                      // false: plain best fit, no splitting

  size_t round_size(size_t bytes) const {
    if (bytes < min_block_bytes) return min_block_bytes;
    return (bytes + min_block_bytes - 1) / min_block_bytes * min_block_bytes;
  }
  bool is_small(size_t rounded_bytes) const { return rounded_bytes <= small_size_bytes; }
  size_t segment_size(size_t rounded_bytes) const {
    if (!split_blocks) return rounded_bytes;
    if (is_small(rounded_bytes)) return small_segment_bytes;
    if (rounded_bytes < min_large_alloc_bytes) return large_segment_bytes;
    return (rounded_bytes + large_round_bytes - 1) / large_round_bytes * large_round_bytes;
  }
  bool should_split(size_t block_bytes, size_t rounded_bytes) const {
    if (!split_blocks) return false;
    const size_t rest = block_bytes - rounded_bytes;
    return is_small(rounded_bytes) ? rest >= min_block_bytes : rest > small_size_bytes;
  }
};

}  // namespace memsched
