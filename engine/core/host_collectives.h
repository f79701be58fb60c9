// Collectives on host values (a norm, a failure flag, commit steps, a gathered master),
// staged through device memory because NCCL needs device buffers. Trainer thread only; every
// rank calls them in the same order.
#pragma once

#include <cstddef>
#include <string>

#include "engine/core/device_budget.h"
#include "zinf/comm.h"
#include "zinf/device.h"

namespace zinf {

class HostCollectives {
 public:
  // Reserves the small scratch once (planned in `budget`), so that the small collectives
  // never fail to allocate on one rank while the others wait in them.
  static Result<std::unique_ptr<HostCollectives>> Create(Device* device, Communicator* comm,
                                                         DeviceBudget* budget, Stream* stream);
  ~HostCollectives();
  HostCollectives(const HostCollectives&) = delete;
  HostCollectives& operator=(const HostCollectives&) = delete;

  Status AllReduceSum(float* values, size_t count, Stream* stream, const std::string& what);
  Status AllGather(const void* send, void* recv, size_t bytes_per_rank, const std::string& what);
  // Every rank learns whether every rank succeeded: `local` on the rank that failed, a
  // FailedPrecondition naming "another rank" on the others.
  Status Agree(const Status& local, const std::string& what);

  static constexpr size_t kSmallScratchBytes = 16384;

 private:
  HostCollectives(Device* device, Communicator* comm, DeviceBudget* budget, Stream* stream)
      : device_(device), comm_(comm), budget_(budget), stream_(stream) {}
  Device* const device_;
  Communicator* const comm_;
  DeviceBudget* const budget_;
  Stream* const stream_;  // the gathers' stream
  void* small_scratch_ = nullptr;
};

}  // namespace zinf
