// ProcessGroupFromEnv and RendezvousStore (zinf/comm.h): a process's place in its group, from
// what launchers set, and the store where the group's processes meet (gloo's and NCCL's).
#include <xxhash.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <string>

#include "zinf/comm.h"

namespace zinf {
namespace {

const char* Env(const char* name) {
  const char* v = std::getenv(name);
  return v != nullptr && *v != '\0' ? v : nullptr;
}

// The integer in `name` (>= min), or `fallback` when unset; InvalidArgument naming the
// variable otherwise.
Result<int> IntVar(const char* name, int fallback, int min) {
  const char* text = Env(name);
  if (text == nullptr) return fallback;
  char* end = nullptr;
  errno = 0;
  const long v = std::strtol(text, &end, 10);
  if (errno != 0 || end == text || *end != '\0' || v < min || v > (1 << 24)) {
    return Status::InvalidArgument(std::string(name) + "='" + text + "' is not an integer >= " +
                                   std::to_string(min) + " (the launcher's process group)");
  }
  return static_cast<int>(v);
}

}  // namespace

std::string JobTag(const std::string& job_id) {
  char hex[17];
  std::snprintf(hex, sizeof(hex), "%016llx",
                static_cast<unsigned long long>(XXH3_64bits(job_id.data(), job_id.size())));
  return hex;
}

Result<ProcessGroupOptions> ProcessGroupFromEnv() {
  ProcessGroupOptions o;
  // torchrun / accelerate / deepspeed first; mpirun's names where those are absent.
  const bool torch_style = Env("RANK") != nullptr;
  const bool mpi_style = !torch_style && Env("OMPI_COMM_WORLD_RANK") != nullptr;
  const char* rank = torch_style ? "RANK" : "OMPI_COMM_WORLD_RANK";
  const char* world = torch_style ? "WORLD_SIZE" : "OMPI_COMM_WORLD_SIZE";
  const char* local = torch_style ? "LOCAL_RANK" : "OMPI_COMM_WORLD_LOCAL_RANK";
  const char* local_world = torch_style ? "LOCAL_WORLD_SIZE" : "OMPI_COMM_WORLD_LOCAL_SIZE";
  if (!torch_style && !mpi_style) {
    if (Env("WORLD_SIZE") != nullptr) {
      ZINF_ASSIGN_OR_RETURN(const int w, IntVar("WORLD_SIZE", 1, 1));
      if (w > 1) {
        return Status::InvalidArgument("WORLD_SIZE=" + std::to_string(w) +
                                       " is set but RANK is not: start the processes with a "
                                       "launcher (torchrun, zinf-train --nproc) or set RANK");
      }
    }
    return o;  // one process
  }
  ZINF_ASSIGN_OR_RETURN(o.rank, IntVar(rank, 0, 0));
  ZINF_ASSIGN_OR_RETURN(o.world_size, IntVar(world, 1, 1));
  ZINF_ASSIGN_OR_RETURN(o.local_rank, IntVar(local, o.rank, 0));
  ZINF_ASSIGN_OR_RETURN(o.local_world_size, IntVar(local_world, o.world_size, 1));
  if (o.rank >= o.world_size) {
    return Status::InvalidArgument(std::string(rank) + "=" + std::to_string(o.rank) +
                                   " is not below " + world + "=" + std::to_string(o.world_size));
  }
  if (o.local_rank >= o.local_world_size) {
    return Status::InvalidArgument(std::string(local) + "=" + std::to_string(o.local_rank) +
                                   " is not below " + local_world + "=" +
                                   std::to_string(o.local_world_size));
  }
  if (const char* folder = Env("ZINF_STORE_FOLDER")) o.store_folder = folder;
  if (const char* addr = Env("MASTER_ADDR")) o.master_addr = addr;
  ZINF_ASSIGN_OR_RETURN(o.master_port, IntVar("MASTER_PORT", 0, 1));
  if (const char* listen = Env("ZINF_LISTEN_ADDR")) o.listen_addr = listen;
  // Under torchrun the agent serves torch's own store on MASTER_PORT
  // (TORCHELASTIC_USE_AGENT_STORE=True); zinf's store, which speaks another protocol, goes on
  // ZINF_STORE_PORT, by default the port after it (every rank computes the same).
  const char* agent = Env("TORCHELASTIC_USE_AGENT_STORE");
  if (const char* port = Env("ZINF_STORE_PORT")) {
    ZINF_ASSIGN_OR_RETURN(o.master_port, IntVar("ZINF_STORE_PORT", 0, 1));
    (void)port;
  } else if (agent != nullptr && std::string(agent) == "True" && o.master_port > 0) {
    o.master_port += 1;
  }
  if (o.master_port > 65535) {
    return Status::InvalidArgument("the rendezvous port " + std::to_string(o.master_port) +
                                   " is not a TCP port: set ZINF_STORE_PORT");
  }
  if (const char* listen = Env("ZINF_STORE_LISTEN_ADDR")) o.store_listen_addr = listen;
  // The job's identity: ours, else torchrun's run id ("none" is its default when not given).
  if (const char* job = Env("ZINF_JOB_ID")) {
    o.job_id = job;
  } else if (const char* run = Env("TORCHELASTIC_RUN_ID");
             run != nullptr && std::string(run) != "none") {
    o.job_id = run;
  }
  if (o.job_id.size() > 256) {
    return Status::InvalidArgument("ZINF_JOB_ID is " + std::to_string(o.job_id.size()) +
                                   " bytes long; at most 256");
  }
  // Keys carry the job (a digest: the id itself is the store's password), so that two jobs
  // sharing a store folder or a store never read each other's keys.
  if (!o.job_id.empty()) o.prefix += "/job-" + JobTag(o.job_id);
  // A restarted group (torchrun --max-restarts) must not read the dead attempt's keys.
  if (const char* attempt = Env("TORCHELASTIC_RESTART_COUNT")) {
    o.prefix += "/attempt" + std::string(attempt);
  }
  if (o.world_size > 1 && o.store_folder.empty() && (o.master_addr.empty() || o.master_port == 0)) {
    return Status::InvalidArgument(
        std::string(world) + "=" + std::to_string(o.world_size) +
        " needs a rendezvous: set MASTER_ADDR and MASTER_PORT (rank 0 serves a store there), or "
        "ZINF_STORE_FOLDER (a folder every rank can read and write)");
  }
  return o;
}

Result<std::shared_ptr<KeyValueStore>> RendezvousStore(const ProcessGroupOptions& o) {
  if (o.store != nullptr) return o.store;
  if (!o.store_folder.empty()) return NewFileStore(o.store_folder);
  if (o.master_addr.empty() || o.master_port == 0) {
    return Status::InvalidArgument(
        "a group of " + std::to_string(o.world_size) +
        " processes needs a rendezvous: MASTER_ADDR and MASTER_PORT (as torchrun sets them), "
        "or a store folder (ZINF_STORE_FOLDER)");
  }
  TcpStoreOptions t;
  t.host = o.master_addr;
  t.port = o.master_port;
  t.serve = o.rank == 0;
  t.timeout = o.timeout;
  t.job_id = o.job_id;
  t.listen_addr = o.store_listen_addr;
  t.max_clients = 2 * o.world_size + 8;  // each rank, and each reconnecting once
  return NewTcpStore(t);
}

}  // namespace zinf
