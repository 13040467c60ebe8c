// raw_memory.h -- the two narrow interfaces through which the block pool gets
// memory and learns when other streams are done with it. Defined in core (no
// CUDA); implemented in csrc/backend (host malloc, cudaMalloc, cudaHostAlloc,
// CUDA events) and, for tests and planning, by core's VirtualRawMemory and
// ManualStreamEvents.
//
// Glossary of the allocator's types (see block_pool.h for the pool itself):
//   Segment   one chunk obtained from RawMemory::allocate; returned whole.
//   Block     a contiguous piece of a segment: allocated, pending free, or free.
//   Stream    an opaque handle (cudaStream_t on CUDA; any integer on the host).
//   Event     an opaque handle recorded on a stream; done once the stream has
//             reached it.
#pragma once

#include <cstddef>
#include <cstdint>

namespace memsched {

using StreamHandle = uintptr_t;  // cudaStream_t or an arbitrary id; 0 = default stream
using EventHandle = uintptr_t;   // cudaEvent_t or an arbitrary id

// Raw memory: segments in, segments out. allocate() returns nullptr when it
// cannot give the memory (the pool then frees its cache and retries); it must
// not throw for an ordinary out-of-memory.
class RawMemory {
 public:
  virtual ~RawMemory() = default;
  virtual void* allocate(size_t bytes) = 0;             // nullptr on failure
  virtual void free(void* ptr, size_t bytes) = 0;       // bytes == the size allocated
  virtual const char* name() const = 0;                 // "host", "cuda", "cuda_pinned", ...
};

// Stream-ordered completion. Events on one stream complete in the order they
// were recorded (as CUDA events do); the pool relies on that to stop scanning
// a stream's queue at its first unfinished event.
class StreamEvents {
 public:
  virtual ~StreamEvents() = default;
  virtual EventHandle record(StreamHandle stream) = 0;  // an event after all work queued so far
  virtual bool query(EventHandle event) = 0;            // true once the stream reached it
  virtual void synchronize(EventHandle event) = 0;      // block until query() would be true
  virtual void release(EventHandle event) = 0;          // the handle is not used again
};

}  // namespace memsched
