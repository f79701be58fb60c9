// The communicator seam: collectives among the ranks of a ZeRO-3 group.
//
// Implementations: LocalComm (N ranks as threads of one process; deterministic reductions in
// rank order), GlooComm (N ranks as processes on host devices, over gloo's TCP transport; the
// same reductions in rank order, so bit-identical with LocalComm) and, when built with CUDA,
// NcclComm (NCCL's own reduction order; see ReduceScatterSum). Collectives are ordered on a Stream
// of the rank's Device; they complete asynchronously like every other stream operation.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "zinf/device.h"
#include "zinf/status.h"

namespace zinf {

// What a communicator has moved, for benchmarks: collectives run, payload bytes this rank
// sent to its peers, and the time spent inside collectives (waiting for peers included).
struct CommCounters {
  uint64_t collectives = 0;
  uint64_t bytes_sent = 0;
  double seconds = 0;
};

// One rank's endpoint. Each rank uses its own Communicator from one thread at a time; every
// rank must issue the same collectives in the same order.
class Communicator {
 public:
  virtual ~Communicator() = default;
  // Since creation; all zero where an implementation does not count (LocalComm, NcclComm).
  virtual CommCounters Counters() const { return {}; }
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
  // recv[r * bytes_per_rank ...] = send_r[rank * bytes_per_rank ...]: each rank's r-th block
  // goes to rank r (send and recv hold world_size * bytes_per_rank, and do not overlap). The
  // quantized gradient reduction (zero_quantized_gradients) moves its int8 blocks with it.
  virtual Status AllToAll(const void* send, void* recv, size_t bytes_per_rank, Stream* stream) = 0;
  // buf = sum over ranks on every rank (the same values on all; the order as above).
  virtual Status AllReduceSum(float* buf, size_t count, Stream* stream) = 0;
  virtual Status Broadcast(void* buf, size_t bytes, int root, Stream* stream) = 0;
  // Blocks until every rank has reached the barrier.
  virtual Status Barrier() = 0;

  // A sub-group of this communicator's ranks (hpZ's ranks of one node, qgZ's hops). Every rank
  // calls Split, at the same place of its collective order, with its `color` (>= 0); the ranks
  // that give the same color form one new communicator, ranked in their order here. The colors
  // are exchanged with a collective of this communicator on `stream`, and Split waits for it
  // (and for the new group to connect) before it returns. A color below 0 on any rank fails
  // Split on every rank, naming that rank. The new communicator is independent of this one:
  // its collectives never pair with this one's, and either may be destroyed first.
  // NotSupported where an implementation cannot split (the default).
  virtual Result<std::unique_ptr<Communicator>> Split(int /*color*/, Stream* /*stream*/) {
    return Status::NotSupported(
        "this communicator cannot split into sub-groups (LocalComm, GlooComm and NcclComm can)");
  }
};

// The ranks of a group of `colors.size()` that Split(color) with these colors (colors[r]: rank
// r's) puts with `rank`, in rank order; InvalidArgument, `who` first, naming the first rank
// whose color is negative. Every implementation's Split uses it, so they agree.
inline Result<std::vector<int>> SplitMembers(const std::vector<int32_t>& colors, int rank,
                                             const std::string& who) {
  for (size_t r = 0; r < colors.size(); ++r) {
    if (colors[r] < 0) {
      return Status::InvalidArgument(who + ": Split: rank " + std::to_string(r) + " gave color " +
                                     std::to_string(colors[r]) +
                                     "; a sub-group's color must be >= 0 on every rank");
    }
  }
  if (rank < 0 || rank >= static_cast<int>(colors.size())) {
    return Status::InvalidArgument(who + ": Split: rank " + std::to_string(rank) +
                                   " is not a rank of a world of " + std::to_string(colors.size()));
  }
  std::vector<int> members;
  for (size_t r = 0; r < colors.size(); ++r) {
    if (colors[r] == colors[rank]) members.push_back(static_cast<int>(r));
  }
  return members;
}

// Creates `world_size` connected LocalComm endpoints, one per rank; `devices[r]` is rank r's
// device (HostDevice: buffers are host memory). Endpoint r is used by rank r's thread.
Result<std::vector<std::unique_ptr<Communicator>>> NewLocalComms(
    const std::vector<Device*>& devices);

// ---- Ranks as processes ---------------------------------------------------------------------

// Where the ranks of a process group meet before their first collective (rendezvous only:
// addresses, the NCCL unique id). Keys are written once. Thread-safe.
class KeyValueStore {
 public:
  virtual ~KeyValueStore() = default;
  virtual Status Set(const std::string& key, const std::string& value) = 0;
  // Waits until `key` is set, at most `timeout`: DeadlineExceeded-like FailedPrecondition
  // naming the key and the wait otherwise.
  virtual Result<std::string> Get(const std::string& key, std::chrono::milliseconds timeout) = 0;
};

// A store served over TCP by rank 0 on host:port (what MASTER_ADDR:MASTER_PORT name).
struct TcpStoreOptions {
  std::string host;
  int port = 0;
  bool serve = false;  // rank 0: serve the store (EADDRINUSE is an error naming the port)
  // Every connection's wait: connecting (retried while rank 0 starts), sending, a SET's reply.
  std::chrono::milliseconds timeout{std::chrono::minutes(10)};
  // The job's identity, checked in a handshake before any key is read or written: a client
  // of another job (or a stranger) is refused and told so. At most 256 bytes; "" matches "".
  std::string job_id;
  // Where the server listens: "" the address `host` resolves to (never every interface
  // unless asked: "0.0.0.0" or "::").
  std::string listen_addr;
  // The job's members connected at once (the ranks; a few more for reconnections).
  int max_clients = 64;
};
// The server (rank 0) runs on a thread of the store object: keep the result as long as the
// group lives. It never blocks on a client (a client that stops reading is dropped), bounds
// what it holds (64 MiB of keys and values, 4 MiB of unread replies per client, 64 connections
// that have not passed the handshake, each closed after 10 s), and keys are written once: a
// SET of a key that holds another value fails (a second process claiming a rank).
Result<std::shared_ptr<KeyValueStore>> NewTcpStore(const TcpStoreOptions& options);
// The same without a job id, on `host`'s address.
Result<std::shared_ptr<KeyValueStore>> NewTcpStore(const std::string& host, int port, bool serve,
                                                   std::chrono::milliseconds timeout);
// A store in a folder every rank can read and write (one machine, or a shared filesystem):
// each key a file, written to a temporary name and renamed. Use a fresh folder per job.
Result<std::shared_ptr<KeyValueStore>> NewFileStore(const std::string& folder);

// One process's place in a group of `world_size` processes, and how the group meets.
struct ProcessGroupOptions {
  int rank = 0;
  int world_size = 1;
  int local_rank = 0;  // the rank among the processes of its machine (its GPU)
  // Processes on this machine; 0: not said (then a loopback listen address is not questioned).
  int local_world_size = 0;
  // The rendezvous, first that is set: `store`; `store_folder` (NewFileStore); a TcpStore on
  // master_addr:master_port served by rank 0.
  std::shared_ptr<KeyValueStore> store;
  std::string store_folder;
  std::string master_addr;
  int master_port = 0;
  // The job's identity (ZINF_JOB_ID, else torchrun's TORCHELASTIC_RUN_ID): the TCP store
  // answers only ranks that present it, and it is part of every key (two jobs meeting in one
  // store never pair). zinf-train --nproc generates one; "" where no launcher gives one.
  std::string job_id;
  // Where rank 0's TCP store listens (ZINF_STORE_LISTEN_ADDR): "" the address MASTER_ADDR
  // resolves to; "0.0.0.0" every interface.
  std::string store_listen_addr;
  // Keys of this group in the store start with this (a store may be shared with other users,
  // e.g. torch.distributed's; each group a process creates needs its own prefix).
  std::string prefix = "zinf";
  // The address this rank's collective connections listen on: "" picks the address of the
  // interface that routes to master_addr (127.0.0.1 with a store folder and no master).
  std::string listen_addr;
  // The longest a collective (or the rendezvous) waits for the peers; a closed connection (a
  // peer that died) fails at once. zinf.collective_timeout_seconds.
  std::chrono::milliseconds timeout{std::chrono::minutes(10)};
};

// From the environment launchers set: RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE,
// MASTER_ADDR, MASTER_PORT (torchrun, accelerate, DeepSpeed's launcher), else
// OMPI_COMM_WORLD_RANK / _SIZE / _LOCAL_RANK / _LOCAL_SIZE (mpirun). With neither RANK nor
// OMPI_COMM_WORLD_RANK set: rank 0 of 1. ZINF_STORE_FOLDER, when set, is the rendezvous
// instead of MASTER_ADDR:MASTER_PORT. Under torchrun (TORCHELASTIC_USE_AGENT_STORE=True: its
// agent serves torch's store on MASTER_PORT) zinf's store goes on MASTER_PORT + 1;
// ZINF_STORE_PORT sets the port explicitly. TORCHELASTIC_RESTART_COUNT joins the key prefix
// (a restarted group never reads a dead attempt's keys). ZINF_JOB_ID (else TORCHELASTIC_RUN_ID
// unless it is "none") is the job id; ZINF_STORE_LISTEN_ADDR the store's listen address.
// InvalidArgument naming the variable for a malformed or inconsistent value (RANK >= WORLD_SIZE,
// WORLD_SIZE > 1 without a rendezvous).
Result<ProcessGroupOptions> ProcessGroupFromEnv();

// A job id's tag in key names: 16 hex digits of its xxh3 (the id itself is the store's
// password and stays out of keys and file names).
std::string JobTag(const std::string& job_id);

// The store `options` names for its rendezvous (options.store; a folder store; else a TCP
// store on master_addr:master_port, served by rank 0: keep the result as long as the group
// lives). InvalidArgument when none is named.
Result<std::shared_ptr<KeyValueStore>> RendezvousStore(const ProcessGroupOptions& options);

// Rank `options.rank`'s endpoint of a group of processes on host devices (HostDevice: buffers
// are host memory), over gloo's TCP transport. Collectives are HostDevice stream tasks, like
// LocalComm's, and give the same bits: sums are taken in rank order 0, 1, ..., N-1 (gloo moves
// the bytes with alltoall / allgather / broadcast, this rank adds). Errors: a peer that closed
// its connection (died) or a collective that waited `options.timeout` fails the collective
// with FailedPrecondition naming this rank, the collective, and the peer when gloo names one;
// every later collective fails at once with the same Status. Creating the group waits
// `options.timeout` for every rank to join. It sets SIGPIPE to SIG_IGN when the program left it
// at the default (gloo's writes to a dead peer would otherwise kill this rank).
Result<std::unique_ptr<Communicator>> NewGlooComm(Device* device,
                                                  const ProcessGroupOptions& options);

}  // namespace zinf
