// LocalComm: the Communicator seam for N ranks that are threads of one process.
//
// The ranks' endpoints share one hub. A collective is a stream task on the rank's HostDevice
// (LaunchHostTask), so it runs after the work queued before it on that stream; on the compute
// stream it runs inside the call. Inside the task the ranks rendezvous on the hub: each posts
// its buffer pointers under the collective's sequence number (the order in which the rank
// issued it), waits for all ranks, reads the peers' buffers and writes its own, then waits at
// a second barrier so that no rank reuses a buffer while a peer still reads it. Sums are taken
// in rank order 0, 1, ..., N-1, so results are bit-identical from run to run.
//
// Errors. The Status a collective call returns covers its arguments (null pointers, a bad
// root, a stream of another device): such a call does not run, and the peers' matching
// collective fails at once with an error naming the rank, so nobody waits for it. Failures
// inside the rendezvous are reported where the task runs: on a worker stream they become the
// stream's sticky error (HostDevice::SynchronizeStream, and the Status of events recorded
// after it); on the compute stream the call returns them. Those failures are:
//   - a timeout: a rank waited `LocalCommOptions::timeout` at one rendezvous point for peers
//     that did not arrive (a rank stopped, or ranks issued collectives in different orders);
//   - a mismatch: ranks issued different collectives (or sizes, or roots) as the same one.
// Either leaves the group unusable: every later collective of every rank fails at once with
// the same FailedPrecondition.
#pragma once

#include <chrono>
#include <memory>
#include <vector>

#include "zinf/comm.h"
#include "zinf/device.h"
#include "zinf/status.h"

namespace zinf {

struct LocalCommOptions {
  // How long a rank waits at one rendezvous point of a collective (or Barrier) for its peers
  // before failing the group. Generous by default: a peer may legitimately be busy (a slow
  // copy or host task queued before the collective on its stream).
  std::chrono::milliseconds timeout{60000};
};

// Like NewLocalComms(devices) (include/zinf/comm.h), with options. REQUIRES: every device is
// a HostDevice (NewHostDevice), else InvalidArgument; ranks may share a device. Queued
// collectives hold the shared hub, not their endpoint, so endpoints may be destroyed while
// collectives are queued; the buffers must stay valid until the collectives complete.
Result<std::vector<std::unique_ptr<Communicator>>> NewLocalComms(
    const std::vector<Device*>& devices, const LocalCommOptions& options);

}  // namespace zinf
