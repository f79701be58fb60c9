// The communicator seam: collectives among the ranks of a ZeRO-3 group.
//
// Implementations: LocalComm (N ranks as threads of one process; deterministic reductions in
// rank order) and, when built with CUDA, NcclComm (NCCL's own reduction order; see
// ReduceScatterSum). Collectives are ordered on a Stream of the
// rank's Device; they complete asynchronously like every other stream operation.
#pragma once

#include <cstddef>
#include <memory>
#include <vector>

#include "zinf/device.h"
#include "zinf/status.h"

namespace zinf {

// One rank's endpoint. Each rank uses its own Communicator from one thread at a time; every
// rank must issue the same collectives in the same order.
class Communicator {
 public:
  virtual ~Communicator() = default;
  virtual int rank() const = 0;
  virtual int world_size() const = 0;

  // recv[r * bytes_per_rank ...] = send of rank r. recv holds world_size * bytes_per_rank.
  virtual Status AllGather(const void* send, void* recv, size_t bytes_per_rank, Stream* stream) = 0;
  // recv[i] = sum over ranks r of send_r[rank * count_per_rank + i]. send holds
  // world_size * count_per_rank.
  //
  // The order of the sum is the implementation's: LocalComm adds in rank order (0, 1, ...,
  // N-1), so its results are deterministic and the same on every rank. NCCL picks its own
  // order (ring or tree, channels, chunking) from the topology and the message size, and does
  // not promise it: in practice a run repeats bit for bit on the same machine, world size and
  // NCCL version (NCCL_ALGO / NCCL_PROTO pin the choice), but results differ in the last bits
  // between world sizes, machines or NCCL versions, and from LocalComm's. What holds
  // everywhere: one rank sums nothing (bit-exact with the host device's run), and with
  // all-reduce every rank gets the same values.
  virtual Status ReduceScatterSum(const float* send, float* recv, size_t count_per_rank,
                                  Stream* stream) = 0;
  // buf = sum over ranks on every rank (the same values on all; the order as above).
  virtual Status AllReduceSum(float* buf, size_t count, Stream* stream) = 0;
  virtual Status Broadcast(void* buf, size_t bytes, int root, Stream* stream) = 0;
  // Blocks until every rank has reached the barrier.
  virtual Status Barrier() = 0;
};

// Creates `world_size` connected LocalComm endpoints, one per rank; `devices[r]` is rank r's
// device (HostDevice: buffers are host memory). Endpoint r is used by rank r's thread.
Result<std::vector<std::unique_ptr<Communicator>>> NewLocalComms(
    const std::vector<Device*>& devices);

}  // namespace zinf
