// cuda_backend.cpp -- see backend/cuda_backend.h. Compiled only with
// MEMSCHED_WITH_CUDA; the only translation unit that calls the CUDA runtime.
#include "backend/cuda_backend.h"

#include <cuda_runtime_api.h>

#include <chrono>
#include <mutex>
#include <thread>
#include <vector>

#include "core/check.h"

namespace memsched {

namespace {

void check_cuda(cudaError_t status, const char* what) {
  MEMSCHED_CHECK(status == cudaSuccess, "memsched CUDA backend: ", what, " failed: ",
                 cudaGetErrorName(status), " (", cudaGetErrorString(status), ")");
}

// Makes `device` current for its scope (no-op for -1 or the current device).
class DeviceGuard {
 public:
  explicit DeviceGuard(int device) {
    if (device < 0) return;
    check_cuda(cudaGetDevice(&previous_), "cudaGetDevice");
    if (previous_ != device) check_cuda(cudaSetDevice(device), "cudaSetDevice");
    else previous_ = -1;
  }
  ~DeviceGuard() {
    if (previous_ >= 0) (void)cudaSetDevice(previous_);
  }

 private:
  int previous_ = -1;
};

class CudaDeviceMemory : public RawMemory {
 public:
  explicit CudaDeviceMemory(int device) : device_(device) {}
  void* allocate(size_t bytes) override {
    DeviceGuard guard(device_);
    void* ptr = nullptr;
    const cudaError_t status = cudaMalloc(&ptr, bytes);
    if (status == cudaErrorMemoryAllocation) {
      (void)cudaGetLastError();  // clear the sticky-free error so later calls succeed
      return nullptr;
    }
    check_cuda(status, "cudaMalloc");
    return ptr;
  }
  void free(void* ptr, size_t) override {
    DeviceGuard guard(device_);
    check_cuda(cudaFree(ptr), "cudaFree");
  }
  const char* name() const override { return "cuda"; }

 private:
  int device_;  // CUDA device ordinal
};

class CudaPinnedMemory : public RawMemory {
 public:
  void* allocate(size_t bytes) override {
    void* ptr = nullptr;
    const cudaError_t status = cudaHostAlloc(&ptr, bytes, cudaHostAllocPortable);
    if (status == cudaErrorMemoryAllocation) {
      (void)cudaGetLastError();
      return nullptr;
    }
    check_cuda(status, "cudaHostAlloc");
    return ptr;
  }
  void free(void* ptr, size_t) override { check_cuda(cudaFreeHost(ptr), "cudaFreeHost"); }
  const char* name() const override { return "cuda_pinned"; }
};

// Note [Recycled events]
//   cudaEventCreate costs microseconds; the pool records one event per
//   cross-stream free, so released events go to a free list and are reused.
class CudaStreamEvents : public StreamEvents {
 public:
  explicit CudaStreamEvents(int device) : device_(device) {}
  ~CudaStreamEvents() override {
    for (cudaEvent_t e : free_) (void)cudaEventDestroy(e);
  }
  EventHandle record(StreamHandle stream) override {
    cudaEvent_t event = nullptr;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (!free_.empty()) {
        event = free_.back();
        free_.pop_back();
      }
    }
    DeviceGuard guard(device_);
    if (event == nullptr) check_cuda(cudaEventCreateWithFlags(&event, cudaEventDisableTiming), "cudaEventCreate");
    check_cuda(cudaEventRecord(event, reinterpret_cast<cudaStream_t>(stream)), "cudaEventRecord");
    return reinterpret_cast<EventHandle>(event);
  }
  bool query(EventHandle handle) override {
    const cudaError_t status = cudaEventQuery(reinterpret_cast<cudaEvent_t>(handle));
    if (status == cudaErrorNotReady) {
      (void)cudaGetLastError();
      return false;
    }
    check_cuda(status, "cudaEventQuery");
    return true;
  }
  void synchronize(EventHandle handle) override {
    check_cuda(cudaEventSynchronize(reinterpret_cast<cudaEvent_t>(handle)), "cudaEventSynchronize");
  }
  void release(EventHandle handle) override {
    std::lock_guard<std::mutex> lock(mutex_);
    free_.push_back(reinterpret_cast<cudaEvent_t>(handle));
  }

 private:
  int device_;                      // device of the events; -1 = current
  std::mutex mutex_;
  std::vector<cudaEvent_t> free_;   // recycled events (See Note [Recycled events])
};

void CUDART_CB sleep_host_fn(void* user_data) {
  std::this_thread::sleep_for(std::chrono::microseconds(reinterpret_cast<uintptr_t>(user_data)));
}

}  // namespace

int cuda_device_count() {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) {
    (void)cudaGetLastError();
    return 0;
  }
  return count;
}

std::shared_ptr<RawMemory> make_cuda_device_memory(int device) {
  MEMSCHED_CHECK(device >= 0 && device < cuda_device_count(), "make_cuda_device_memory: device ",
                 device, " does not exist (", cuda_device_count(), " CUDA devices visible)");
  return std::make_shared<CudaDeviceMemory>(device);
}

std::shared_ptr<RawMemory> make_cuda_pinned_memory() {
  MEMSCHED_CHECK(cuda_device_count() > 0,
                 "make_cuda_pinned_memory: pinned host memory needs a CUDA device and driver; "
                 "none is visible (use the host backend on a CPU-only machine)");
  return std::make_shared<CudaPinnedMemory>();
}

std::shared_ptr<StreamEvents> make_cuda_stream_events(int device) {
  MEMSCHED_CHECK(cuda_device_count() > 0, "make_cuda_stream_events: no CUDA device is visible");
  return std::make_shared<CudaStreamEvents>(device);
}

StreamHandle cuda_stream_create(int device) {
  DeviceGuard guard(device);
  cudaStream_t stream = nullptr;
  check_cuda(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "cudaStreamCreate");
  return reinterpret_cast<StreamHandle>(stream);
}

void cuda_stream_destroy(StreamHandle stream) {
  check_cuda(cudaStreamDestroy(reinterpret_cast<cudaStream_t>(stream)), "cudaStreamDestroy");
}

void cuda_stream_sleep(StreamHandle stream, int duration_us) {
  check_cuda(cudaLaunchHostFunc(reinterpret_cast<cudaStream_t>(stream), sleep_host_fn,
                                reinterpret_cast<void*>(static_cast<uintptr_t>(duration_us))),
             "cudaLaunchHostFunc");
}

void cuda_stream_synchronize(StreamHandle stream) {
  check_cuda(cudaStreamSynchronize(reinterpret_cast<cudaStream_t>(stream)), "cudaStreamSynchronize");
}

}  // namespace memsched
