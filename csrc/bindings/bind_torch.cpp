// bind_torch.cpp -- bindings that take torch tensors; the only binding file that
// includes torch headers (See Note [One module, several binding files]).
#include <torch/python.h>

#include "bindings/bindings.h"
#include "torch/tensor_adapter.h"

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
}

}  // namespace memsched::bindings
