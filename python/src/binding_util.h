// What every binding file of zinf._zinf shares: Status → zinf.ZinfError, calls without the GIL,
// and the DLPack structs through which engine memory reaches torch.
#pragma once

#include <pybind11/pybind11.h>

#include <cstdint>
#include <type_traits>
#include <utility>

#include "zinf/status.h"

namespace zinf::python {
namespace py = pybind11;

// Thrown by Throw/Check/Take; the module's translator raises it as zinf.ZinfError with the
// Status's message, code name and errno.
struct ZinfException {
  Status status;
};

[[noreturn]] inline void Throw(const Status& s) { throw ZinfException{s}; }
inline void Check(const Status& s) {
  if (!s.ok()) Throw(s);
}
template <typename T>
T Take(Result<T> r) {
  if (!r.ok()) Throw(r.status());
  return std::move(r).value();
}

// Runs `fn` (an engine call returning a Status or a Result) with the GIL released, so that
// other Python threads run during its waits; raises its failure, returns its value.
template <typename Fn>
auto WithoutGil(Fn&& fn) {
  using R = decltype(fn());
  if constexpr (std::is_same_v<R, Status>) {
    Status s;
    {
      py::gil_scoped_release nogil;
      s = fn();
    }
    Check(s);
  } else {
    R r = Status::Internal("not run");
    {
      py::gil_scoped_release nogil;
      r = fn();
    }
    return Take(std::move(r));
  }
}

// ---- DLPack (the stable C ABI of dlpack.h, v0.x, which torch.utils.dlpack reads) ----------

struct DLDevice {
  int32_t device_type;  // kDLCPU = 1, kDLCUDA = 2
  int32_t device_id;
};
struct DLDataType {
  uint8_t code;  // kDLUInt = 1, kDLFloat = 2, kDLBfloat = 4
  uint8_t bits;
  uint16_t lanes;
};
struct DLTensor {
  void* data;
  DLDevice device;
  int32_t ndim;
  DLDataType dtype;
  int64_t* shape;
  int64_t* strides;  // null: compact, row-major
  uint64_t byte_offset;
};
struct DLManagedTensor {
  DLTensor dl_tensor;
  void* manager_ctx;
  void (*deleter)(DLManagedTensor* self);
};

// A 1-D capsule named "dltensor" over `data` whose deleter (`managed->deleter`) runs when torch
// frees the tensor, or when the capsule dies unconsumed. `shape` must outlive the capsule
// (it lives beside `managed`).
py::capsule MakeCapsule(DLManagedTensor* managed, void* data, DLDevice device, DLDataType dtype,
                        int64_t* shape);

}  // namespace zinf::python
