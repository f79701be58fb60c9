#include "python/src/binding_util.h"

namespace zinf::python {
namespace {

void CapsuleDestructor(PyObject* capsule) {
  // A capsule torch consumed is renamed "used_dltensor"; torch calls the deleter itself.
  if (PyCapsule_IsValid(capsule, "dltensor")) {
    auto* t = static_cast<DLManagedTensor*>(PyCapsule_GetPointer(capsule, "dltensor"));
    if (t != nullptr && t->deleter != nullptr) t->deleter(t);
  }
}

}  // namespace

py::capsule MakeCapsule(DLManagedTensor* managed, void* data, DLDevice device, DLDataType dtype,
                        int64_t* shape) {
  DLTensor& t = managed->dl_tensor;
  t.data = data;
  t.device = device;
  t.ndim = 1;
  t.dtype = dtype;
  t.shape = shape;
  t.strides = nullptr;
  t.byte_offset = 0;
  return py::capsule(managed, "dltensor", &CapsuleDestructor);
}

}  // namespace zinf::python
