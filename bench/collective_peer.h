// The engine's collectives beside gloo alone moving the same data (zinf-engine-bench --nproc).
//
// A TracingComm wraps the rank's communicator (and every sub-group split from it) and records
// when each collective starts and ends on its stream: a host function queued before it and one
// after it, so the start is when the stream reached the collective, not when it was issued.
// After the steps the ranks share their records (files in the launcher's store folder; the
// ranks run on one machine, so they share the monotonic clock). For each collective that gives
// its last arrival: from it to the end is the collective's own time, without the wait for a
// peer still computing, the figure to set against gloo alone.
//
// The peer replays this rank's collectives of one step on gloo contexts of its own (the same
// sizes, the same groups, in the order of their last arrivals, which every rank shares, so the
// replay cannot deadlock), one at a time, with nothing else running: in-place allgathers,
// gloo's alltoall, its halving-doubling reduce-scatter and its allreduce.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "zinf/comm.h"
#include "zinf/device.h"
#include "zinf/status.h"

namespace zinf::bench {

enum class CollectiveKind : int32_t {
  kAllGather,
  kReduceScatterSum,
  kAllToAll,
  kAllReduceSum,
  kBroadcast,
  kBarrier
};

// One collective as this rank ran it. Plain data: written to and read from the span files.
struct CollectiveSpan {
  int32_t group = 0;       // 0: the job's communicator; 1, 2, ...: Split's, in creation order
  int32_t color = 0;       // the Split color (0 for the job's)
  int32_t group_rank = 0;  // this rank in the group
  int32_t group_size = 0;
  uint64_t seq = 0;  // the collective's place in its group
  CollectiveKind kind = CollectiveKind::kBarrier;
  int32_t root = 0;      // Broadcast's
  uint64_t size = 0;     // bytes per rank (AllGather, AllToAll, Broadcast) or floats (the sums)
  int32_t step = -1;     // the bench step that issued it
  int64_t start_ns = 0;  // CLOCK_MONOTONIC; 0: never started
  int64_t end_ns = 0;    // 0: never ended (failed)
};

// The spans of one rank's communicators, shared by the wrappers.
class CollectiveTrace;

// `inner` wrapped: the same collectives, recorded in `trace`. `inner` outlives the wrapper.
std::unique_ptr<Communicator> TraceCollectives(Communicator* inner, Device* device,
                                               std::shared_ptr<CollectiveTrace> trace);
std::shared_ptr<CollectiveTrace> NewCollectiveTrace();
// The step later collectives belong to.
void SetTraceStep(CollectiveTrace& trace, int step);

struct CollectiveFigures {
  // Medians over the steps [first_step, last_step] of rank 0's time inside collectives (the
  // union of their intervals): from its own arrival (waits for peers included) and from the
  // last arrival (the collectives' own).
  double engine_seconds_with_waits = 0;
  double engine_seconds = 0;
  uint64_t collectives_per_step = 0;  // in last_step, on this rank
  // The median of the bytes this rank sent per step, sub-groups' collectives included.
  double bytes_per_step = 0;
  // gloo alone replaying last_step's collectives: the median of 7 replays.
  double peer_seconds = 0;
};

// Every rank calls it, after its engine has drained (collectives after the measured steps
// belong to another step: SetTraceStep first): shares the spans through the store
// folder ($ZINF_STORE_FOLDER) with `comm`'s Barrier, then replays `last_step`.
Result<CollectiveFigures> CompareWithGloo(const CollectiveTrace& trace, Communicator* comm,
                                          int first_step, int last_step);

}  // namespace zinf::bench
