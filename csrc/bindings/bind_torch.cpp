// bind_torch.cpp -- bindings that take torch tensors; the only binding file that
// includes torch headers (See Note [One module, several binding files]).
#include <torch/python.h>
#include <pybind11/stl.h>

#include "bindings/bindings.h"
#include "torch/device_memory.h"
#include "torch/tensor_adapter.h"
#include "torch/host_tensor.h"
#include "torch/pluggable_hooks.h"
#include "core/alloc/pool_json.h"

#include <torch/csrc/Dtype.h>
#include <ATen/SequenceNumber.h>

namespace memsched::bindings {

void bind_torch(pybind11::module_& m) {
  m.def(
      "storage_ref",
      [](const at::Tensor& t) {
        StorageRef ref = storage_ref(t);
        return pybind11::make_tuple(ref.key, ref.nbytes);
      },
      pybind11::arg("tensor"),
      "(key, nbytes) of the tensor's storage: views of one storage share the key. "
      "See Note [Storage identity].");
  m.def("autograd_sequence_peek", &at::sequence_number::peek,
        "This thread's next autograd Node sequence number: it changes when an op that records a "
        "Node starts, not between the saves of one op. See Note [Copy after the op].");
  m.def("version_counter_key", &version_counter_key, pybind11::arg("tensor"),
        "Identity of the tensor's autograd version counter (0 if disabled): detach() and views share "
        "it, unsafe_chunk outputs and .data do not. See Note [Version counter identity].");

  // See Note [Version counter aliases in C++] (csrc/torch/tensor_adapter.h).
  m.def("counter_alias", &counter_alias, pybind11::arg("tensor"),
        "A tensor with no storage on `tensor`'s version counter (its dtype and conj/neg bits), made without "
        "dispatch; None for a tensor subclass. See Note [Version counter aliases in C++].");
  m.def("on_counter", &on_counter, pybind11::arg("counter"), pybind11::arg("base"), pybind11::arg("size"),
        pybind11::arg("stride"), pybind11::arg("offset"),
        "A tensor of counter's dtype, bits and version counter on base's storage with this geometry, made "
        "without dispatch; None for a tensor subclass. See Note [Version counter aliases in C++].");

  // See csrc/torch/device_memory.h: the allocator's counters without building torch's statistics dict.
  m.def("device_allocated_bytes", [](const std::string& d) { return device_allocated_bytes(c10::Device(d)); },
        pybind11::arg("device"), "torch.cuda.memory_allocated(device), read in C++ (an accelerator device).");
  m.def("device_peak_bytes", [](const std::string& d) { return device_peak_bytes(c10::Device(d)); },
        pybind11::arg("device"), "torch.cuda.max_memory_allocated(device), read in C++.");
  m.def("device_reserved_peak_bytes", [](const std::string& d) { return device_reserved_peak_bytes(c10::Device(d)); },
        pybind11::arg("device"), "torch.cuda.max_memory_reserved(device), read in C++.");
  m.def("reset_device_peak", [](const std::string& d) { reset_device_peak(c10::Device(d)); },
        pybind11::arg("device"), "torch.cuda.reset_peak_memory_stats(device), in C++.");

  // --- allocator (issue 4): pooled host tensors and the pluggable-allocator hooks.
  namespace py = pybind11;
  py::class_<HostTensorPool, std::shared_ptr<HostTensorPool>>(
      m, "HostTensorPool",
      "CPU tensors carved from a memsched block pool: pinned=True uses cudaHostAlloc segments "
      "(GPU machines; the offload executor's staging buffers), pinned=False aligned malloc. "
      "Tensors return their block when freed, from any thread. See Note [Host tensor deleter].")
      .def(py::init<bool>(), py::arg("pinned") = false)
      .def("empty", [](HostTensorPool& p, int64_t nbytes, uintptr_t stream) { return p.empty_bytes(nbytes, stream); },
           py::arg("nbytes"), py::arg("stream") = 0, "A uint8 tensor of nbytes bytes.")
      .def("empty",
           [](HostTensorPool& p, std::vector<int64_t> shape, py::object dtype, uintptr_t stream) {
             MEMSCHED_CHECK(THPDtype_Check(dtype.ptr()), "HostTensorPool.empty: dtype must be a torch.dtype");
             return p.empty(shape, reinterpret_cast<THPDtype*>(dtype.ptr())->scalar_type, stream);
           },
           py::arg("shape"), py::arg("dtype"), py::arg("stream") = 0)
      .def("record_stream", [](HostTensorPool& p, const at::Tensor& t, uintptr_t stream) { p.record_stream(t, stream); },
           py::arg("tensor"), py::arg("stream"), "stream: a raw handle, e.g. torch.cuda.Stream.cuda_stream")
      .def("stats", [](HostTensorPool& p) {
             py::dict d;
             for (const auto& [key, value] : flatten_stats(p.pool().stats())) d[py::str(key)] = value;
             return d;
           })
      .def("state_json", [](HostTensorPool& p, bool include_history) { return pool_state_json(p.pool(), 0, include_history); },
           py::arg("include_history") = true)
      .def("record_history", [](HostTensorPool& p, bool enabled, size_t n) { p.pool().record_history(enabled, n); },
           py::arg("enabled") = true, py::arg("max_entries") = 100000)
      .def("empty_cache", [](HostTensorPool& p) { p.pool().empty_cache(); }, py::call_guard<py::gil_scoped_release>())
      .def("reset_peak_stats", [](HostTensorPool& p) { p.pool().reset_peak_stats(); })
      .def("check_invariants", [](HostTensorPool& p) { p.pool().check_invariants(); })
      .def_property_readonly("pinned", &HostTensorPool::pinned)
      .def_property_readonly("backend", [](HostTensorPool& p) { return std::string(p.pool().backend_name()); });

  m.def("_pluggable_hooks_supported", &pluggable_hooks_supported);
  m.def(
      "_install_memsched_allocator",
      [](uintptr_t malloc_fn, uintptr_t free_fn, uintptr_t last_error_fn, uintptr_t last_error_is_oom_fn,
         uintptr_t record_stream_fn, uintptr_t empty_cache_fn) {
        install_memsched_allocator(ShimFunctions{malloc_fn, free_fn, last_error_fn, last_error_is_oom_fn,
                                                 record_stream_fn, empty_cache_fn});
      },
      py::arg("malloc_fn"), py::arg("free_fn"), py::arg("last_error_fn"), py::arg("last_error_is_oom_fn"),
      py::arg("record_stream_fn"), py::arg("empty_cache_fn"),
      "Make the shim torch's CUDA allocator, with its hooks. See Note [Installing from C++].");
  m.def(
      "_memsched_malloc_or_throw",
      [](uintptr_t malloc_fn, uintptr_t last_error_fn, uintptr_t last_error_is_oom_fn, size_t size,
         int device) -> py::tuple {
        ShimFunctions shim;
        shim.malloc_fn = malloc_fn;
        shim.last_error_fn = last_error_fn;
        shim.last_error_is_oom_fn = last_error_is_oom_fn;
        try {
          const auto ptr = reinterpret_cast<uintptr_t>(memsched_malloc_or_throw(shim, size, device, 0));
          return py::make_tuple(ptr, "ok", "");
        } catch (const c10::OutOfMemoryError& e) {
          return py::make_tuple(0, "OutOfMemoryError", e.what_without_backtrace());
        } catch (const c10::Error& e) {
          return py::make_tuple(0, "Error", e.what_without_backtrace());
        }
      },
      "Test helper: the malloc torch gets from _install_memsched_allocator, as (ptr, thrown type, message).");
  m.def("_install_pluggable_hooks", &install_pluggable_hooks, py::arg("record_stream_fn"),
        py::arg("empty_cache_fn"),
        "Point torch's CUDAPluggableAllocator record_stream/reset hooks at C function addresses. "
        "See Note [Wiring record_stream].");
}

}  // namespace memsched::bindings
