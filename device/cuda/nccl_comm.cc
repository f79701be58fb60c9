// NcclComm: the Communicator seam over NCCL (see zinf/cuda.h for the contract).
//
// Non-blocking communicator (ncclConfig_t::blocking = 0): no NCCL call may hang the caller.
// Creation and each enqueue are settled by polling ncclCommGetAsyncError until it leaves
// ncclInProgress, against the deadline. Completion is asynchronous (on the caller's stream), so
// a watchdog thread follows it: after each collective an event is recorded on the stream; the
// watchdog polls the oldest pending events and the communicator's async error. A collective
// that has not completed within the timeout, or an async error, aborts the communicator
// (ncclCommAbort, which makes the stuck kernels return), marks the group broken (every later
// call fails at once with the same FailedPrecondition) and sets that Status as the sticky
// error of every stream with a pending collective, so SynchronizeStream reports it.
#include <fcntl.h>
#include <nccl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <deque>
#include <functional>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "common/thread_annotations.h"
#include "device/cuda/cuda_device.h"
#include "device/cuda/cuda_internal.h"
#include "zinf/cuda.h"
#include "zinf/log.h"

namespace zinf {
namespace {

using cuda_internal::CudaStream;
using cuda_internal::MakeCurrent;
using Clock = std::chrono::steady_clock;

Clock::duration Seconds(double s) {
  return std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(s));
}

std::string SecondsText(double s) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%.3g s", s);
  return buf;
}

std::string NcclErrorText(ncclResult_t r, ncclComm_t comm) {
  std::string text = std::string(ncclGetErrorString(r)) + " (ncclResult " + std::to_string(r) + ")";
  const char* last = ncclGetLastError(comm);
  if (last != nullptr && *last != '\0') text += ": " + std::string(last);
  return text;
}

// ---- The unique id file ---------------------------------------------------------------------

Status WriteIdFile(const std::string& path, const ncclUniqueId& id) {
  const std::string tmp = path + ".tmp." + std::to_string(getpid());
  const int fd = open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) return ErrnoToStatus(errno, "NcclComm: creating the NCCL id file " + tmp);
  const ssize_t n = write(fd, &id, sizeof(id));
  const int write_errno = errno;
  if (n != static_cast<ssize_t>(sizeof(id)) || fsync(fd) != 0) {
    const int err = n < 0 ? write_errno : (errno != 0 ? errno : EIO);
    close(fd);
    unlink(tmp.c_str());
    return ErrnoToStatus(err, "NcclComm: writing the NCCL id file " + tmp);
  }
  close(fd);
  if (rename(tmp.c_str(), path.c_str()) != 0) {
    const int err = errno;
    unlink(tmp.c_str());
    return ErrnoToStatus(err, "NcclComm: renaming " + tmp + " to " + path);
  }
  return Status::OK();
}

Result<ncclUniqueId> ReadIdFile(const std::string& path, int rank, double timeout_seconds) {
  const auto deadline = Clock::now() + Seconds(timeout_seconds);
  for (;;) {
    const int fd = open(path.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd >= 0) {
      ncclUniqueId id;
      const ssize_t n = read(fd, &id, sizeof(id));
      close(fd);
      // Written whole and renamed into place, so a short file is not this job's.
      if (n == static_cast<ssize_t>(sizeof(id))) return id;
      return Status::Corruption("NcclComm rank " + std::to_string(rank) + ": the NCCL id file " +
                                path + " holds " + std::to_string(n) + " bytes, not " +
                                std::to_string(sizeof(id)));
    }
    if (errno != ENOENT) {
      return ErrnoToStatus(errno, "NcclComm: opening the NCCL id file " + path);
    }
    if (Clock::now() >= deadline) {
      return Status::FailedPrecondition(
          "NcclComm rank " + std::to_string(rank) + ": rank 0 did not write the NCCL id file " +
          path + " within " + SecondsText(timeout_seconds) +
          "; check that rank 0 started and that every rank sees the same folder "
          "(ZINF_NCCL_ID_FILE)");
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
}

// ---- NcclComm -------------------------------------------------------------------------------

class NcclComm final : public Communicator {
 public:
  NcclComm(CudaDevice* device, const NcclCommOptions& options)
      : device_(device), options_(options) {}

  // (After the watchdog is joined no other thread touches the fields: no analysis.)
  ~NcclComm() override NO_THREAD_SAFETY_ANALYSIS {
    {
      MutexLock lock(&mu_);
      stopping_ = true;
    }
    cv_.NotifyAll();
    if (watchdog_.joinable()) watchdog_.join();
    if (!MakeCurrent(device_->ordinal()).ok()) return;
    for (const Pending& p : pending_) (void)cudaEventDestroy(p.event);
    for (cudaEvent_t e : free_events_) (void)cudaEventDestroy(e);
    if (barrier_buf_ != nullptr) (void)cudaFree(barrier_buf_);
    if (comm_ == nullptr || aborted_) return;
    // Finalize flushes the collectives still queued; polled so a dead peer cannot hang us.
    ncclResult_t r = ncclCommFinalize(comm_);
    if (r == ncclSuccess || r == ncclInProgress) r = Poll(comm_, options_.timeout_seconds);
    if (r == ncclSuccess) {
      (void)ncclCommDestroy(comm_);
    } else {
      LogWarning("NcclComm rank " + std::to_string(options_.rank) +
                 ": finalizing the communicator failed (" + NcclErrorText(r, comm_) +
                 "); aborting it");
      (void)ncclCommAbort(comm_);
    }
  }

  Status Init() {
    ZINF_RETURN_IF_ERROR(MakeCurrent(device_->ordinal()));
    const int rank = options_.rank;
    ncclUniqueId id;
    if (rank == 0) {
      ncclResult_t r = ncclGetUniqueId(&id);
      if (r != ncclSuccess) {
        return Status::Internal("NcclComm rank 0: ncclGetUniqueId failed: " +
                                NcclErrorText(r, nullptr));
      }
      if (options_.store != nullptr) {
        ZINF_RETURN_IF_ERROR(options_.store->Set(
            options_.store_key, std::string(reinterpret_cast<const char*>(&id), sizeof(id))));
      } else if (!options_.unique_id_file.empty()) {
        ZINF_RETURN_IF_ERROR(WriteIdFile(options_.unique_id_file, id));
      }
    } else if (options_.store != nullptr) {
      const auto wait =
          std::chrono::milliseconds(static_cast<int64_t>(options_.timeout_seconds * 1000));
      ZINF_ASSIGN_OR_RETURN(std::string bytes, options_.store->Get(options_.store_key, wait));
      if (bytes.size() != sizeof(id)) {
        return Status::Corruption("NcclComm rank " + std::to_string(rank) +
                                  ": the unique id in the "
                                  "store under '" +
                                  options_.store_key + "' has " + std::to_string(bytes.size()) +
                                  " bytes, not " + std::to_string(sizeof(id)));
      }
      std::memcpy(&id, bytes.data(), sizeof(id));
    } else {
      ZINF_ASSIGN_OR_RETURN(id,
                            ReadIdFile(options_.unique_id_file, rank, options_.timeout_seconds));
    }
    ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
    config.blocking = 0;
    ncclResult_t r = ncclCommInitRankConfig(&comm_, options_.world_size, id, rank, &config);
    if (r == ncclSuccess || r == ncclInProgress) r = Poll(comm_, options_.timeout_seconds);
    if (r != ncclSuccess) {
      const std::string why = r == ncclInProgress
                                  ? "timed out after " + SecondsText(options_.timeout_seconds) +
                                        " waiting for the other ranks to join"
                                  : NcclErrorText(r, comm_);
      if (comm_ != nullptr) (void)ncclCommAbort(comm_);
      comm_ = nullptr;
      return Status::FailedPrecondition("NcclComm rank " + std::to_string(rank) +
                                        ": creating the communicator (world size " +
                                        std::to_string(options_.world_size) + ") failed: " + why);
    }
    return Start();
  }

  // A sub-group's communicator: `comm` comes from ncclCommSplit, settled.
  Status Adopt(ncclComm_t comm) {
    comm_ = comm;
    return Start();
  }

  // What every communicator needs once comm_ is made: the barrier's stream and buffer, and the
  // watchdog.
  Status Start() {
    ZINF_RETURN_IF_ERROR(MakeCurrent(device_->ordinal()));
    ZINF_ASSIGN_OR_RETURN(Stream * s, device_->CreateStream("nccl-barrier"));
    ZINF_ASSIGN_OR_RETURN(barrier_stream_, device_->OwnStream(s, "NcclComm"));
    ZINF_CUDA_CHECK(cudaMalloc(&barrier_buf_, sizeof(float)));
    // On the barrier's own stream, not the legacy default stream (which would synchronise
    // with every other blocking stream of the device).
    ZINF_CUDA_CHECK(cudaMemsetAsync(barrier_buf_, 0, sizeof(float), barrier_stream_->handle()));
    ZINF_CUDA_CHECK(cudaStreamSynchronize(barrier_stream_->handle()));
    watchdog_ = std::thread([this] { WatchdogMain(); });
    return Status::OK();
  }

  int rank() const override { return options_.rank; }
  int world_size() const override { return options_.world_size; }

  Status AllGather(const void* send, void* recv, size_t bytes_per_rank, Stream* stream) override {
    const std::string what = "AllGather of " + std::to_string(bytes_per_rank) + " bytes per rank";
    if (bytes_per_rank == 0) return Status::OK();
    ZINF_RETURN_IF_ERROR(CheckBuffers(what, send != nullptr, recv != nullptr));
    return Issue(what, stream, [&](cudaStream_t s) {
      return ncclAllGather(send, recv, bytes_per_rank, ncclUint8, comm_, s);
    });
  }

  Status AllToAll(const void* send, void* recv, size_t bytes_per_rank, Stream* stream) override {
    const std::string what = "AllToAll of " + std::to_string(bytes_per_rank) + " bytes per rank";
    if (bytes_per_rank == 0) return Status::OK();
    ZINF_RETURN_IF_ERROR(CheckBuffers(what, send != nullptr, recv != nullptr));
    const int n = options_.world_size;
    return Issue(what, stream, [&](cudaStream_t s) {
      // One send and one receive per peer, grouped: NCCL runs them as one operation. (The
      // communicator is non-blocking: a call inside the group may say ncclInProgress, which is
      // no failure; stopping there would launch half a group.)
      auto going = [](ncclResult_t x) { return x == ncclSuccess || x == ncclInProgress; };
      ncclResult_t r = ncclGroupStart();
      for (int peer = 0; peer < n && going(r); ++peer) {
        r = ncclSend(static_cast<const char*>(send) + peer * bytes_per_rank, bytes_per_rank,
                     ncclUint8, peer, comm_, s);
        if (going(r)) {
          r = ncclRecv(static_cast<char*>(recv) + peer * bytes_per_rank, bytes_per_rank, ncclUint8,
                       peer, comm_, s);
        }
      }
      const ncclResult_t end = ncclGroupEnd();
      return going(r) ? end : r;
    });
  }

  Status ReduceScatterSum(const float* send, float* recv, size_t count_per_rank,
                          Stream* stream) override {
    const std::string what =
        "ReduceScatterSum of " + std::to_string(count_per_rank) + " floats per rank";
    if (count_per_rank == 0) return Status::OK();
    ZINF_RETURN_IF_ERROR(CheckBuffers(what, send != nullptr, recv != nullptr));
    return Issue(what, stream, [&](cudaStream_t s) {
      return ncclReduceScatter(send, recv, count_per_rank, ncclFloat32, ncclSum, comm_, s);
    });
  }

  Status AllReduceSum(float* buf, size_t count, Stream* stream) override {
    const std::string what = "AllReduceSum of " + std::to_string(count) + " floats";
    if (count == 0) return Status::OK();
    ZINF_RETURN_IF_ERROR(CheckBuffers(what, buf != nullptr, buf != nullptr));
    return Issue(what, stream, [&](cudaStream_t s) {
      return ncclAllReduce(buf, buf, count, ncclFloat32, ncclSum, comm_, s);
    });
  }

  Status Broadcast(void* buf, size_t bytes, int root, Stream* stream) override {
    const std::string what =
        "Broadcast of " + std::to_string(bytes) + " bytes from root " + std::to_string(root);
    if (root < 0 || root >= world_size()) {
      return Status::InvalidArgument(Prefix() + what + ": root is not a rank of a world of " +
                                     std::to_string(world_size()));
    }
    if (bytes == 0) return Status::OK();
    ZINF_RETURN_IF_ERROR(CheckBuffers(what, buf != nullptr, buf != nullptr));
    return Issue(what, stream, [&](cudaStream_t s) {
      return ncclBroadcast(buf, buf, bytes, ncclUint8, root, comm_, s);
    });
  }

  // The colors go round with an AllGather (so a bad color fails every rank alike), then
  // ncclCommSplit makes the sub-group, keyed by this rank (members keep their order).
  Result<std::unique_ptr<Communicator>> Split(int color, Stream* stream) override {
    const int n = options_.world_size;
    const std::string who = "NcclComm rank " + std::to_string(options_.rank);
    std::vector<int32_t> colors(n, 0);
    colors[options_.rank] = color;
    ZINF_ASSIGN_OR_RETURN(void* buf, device_->Alloc(n * sizeof(int32_t)));
    int32_t* dev = static_cast<int32_t*>(buf);
    Status s = device_->CopyHostToDevice(dev + options_.rank, &colors[options_.rank],
                                         sizeof(int32_t), stream);
    if (s.ok()) s = AllGather(dev + options_.rank, dev, sizeof(int32_t), stream);
    if (s.ok()) s = device_->CopyDeviceToHost(colors.data(), dev, n * sizeof(int32_t), stream);
    if (s.ok()) s = device_->SynchronizeStream(stream);
    if (s.ok()) {
      device_->Free(buf);
    } else {
      // The stream may still hold the copies: the buffer stays (a few bytes) rather than be
      // freed under them.
      return s;
    }
    ZINF_ASSIGN_OR_RETURN(const std::vector<int> members, SplitMembers(colors, options_.rank, who));
    const int index = static_cast<int>(std::find(members.begin(), members.end(), options_.rank) -
                                       members.begin());
    ncclComm_t sub = nullptr;
    ncclResult_t r = ncclSuccess;
    bool was_aborted = false;
    {
      MutexLock comm_lock(&comm_mu_);
      was_aborted = aborted_;
      if (!was_aborted) {
        ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
        config.blocking = 0;
        r = ncclCommSplit(comm_, color, options_.rank, &sub, &config);
        if ((r == ncclSuccess || r == ncclInProgress) && sub != nullptr) {
          r = Poll(sub, options_.timeout_seconds);
        }
      }
    }
    if (was_aborted) {
      MutexLock lock(&mu_);
      return broken_;
    }
    if (r != ncclSuccess || sub == nullptr) {
      if (sub != nullptr) (void)ncclCommAbort(sub);
      return Status::FailedPrecondition(
          who + ": ncclCommSplit into the sub-group of color " + std::to_string(color) + " (" +
          std::to_string(members.size()) + " ranks) failed: " +
          (sub == nullptr && (r == ncclSuccess || r == ncclInProgress)
               ? std::string("it gave no communicator")
           : r == ncclInProgress ? "timed out after " + SecondsText(options_.timeout_seconds)
                                 : NcclErrorText(r, sub)));
    }
    NcclCommOptions o = options_;
    o.rank = index;
    o.world_size = static_cast<int>(members.size());
    o.store.reset();
    o.unique_id_file.clear();
    auto comm = std::make_unique<NcclComm>(device_, o);
    ZINF_RETURN_IF_ERROR(comm->Adopt(sub));
    return std::unique_ptr<Communicator>(std::move(comm));
  }

  // An all-reduce of one float on a stream of the communicator's own, waited for with the
  // deadline.
  Status Barrier() override {
    ZINF_RETURN_IF_ERROR(Issue("Barrier", barrier_stream_, [&](cudaStream_t s) {
      // Max of zeros: the buffer never changes (a sum grew by world_size every call).
      return ncclAllReduce(barrier_buf_, barrier_buf_, 1, ncclFloat32, ncclMax, comm_, s);
    }));
    const auto deadline = Clock::now() + Seconds(options_.timeout_seconds);
    cudaEvent_t done = nullptr;
    ZINF_CUDA_CHECK(cudaEventCreateWithFlags(&done, cudaEventDisableTiming));
    const cudaError_t rec = cudaEventRecord(done, barrier_stream_->handle());
    Status result;
    if (rec != cudaSuccess) {
      result = cuda_internal::CudaCallStatus(rec, "cudaEventRecord(done, barrier stream)", __FILE__,
                                             __LINE__);
    }
    while (result.ok()) {
      const cudaError_t q = cudaEventQuery(done);
      if (q == cudaSuccess) break;
      // NotReady is no error: drop it as the thread's last error (launch checks read that).
      if (q == cudaErrorNotReady) (void)cudaGetLastError();  // safe: clears NotReady only
      if (q != cudaErrorNotReady) {
        result = cuda_internal::CudaCallStatus(q, "cudaEventQuery(barrier)", __FILE__, __LINE__);
        break;
      }
      {
        MutexLock lock(&mu_);
        if (!broken_.ok()) result = broken_;
      }
      if (result.ok() && Clock::now() >= deadline) {
        result = Fail("Barrier timed out after " + SecondsText(options_.timeout_seconds) +
                      " waiting for the other ranks; a rank stopped issuing collectives or "
                      "issued them in a different order");
      }
      if (result.ok()) std::this_thread::sleep_for(std::chrono::microseconds(200));
    }
    (void)cudaEventDestroy(done);
    if (result.ok()) result = barrier_stream_->error();
    return result;
  }

 private:
  struct Pending {
    cudaEvent_t event;
    CudaStream* stream;
    std::string what;
    Clock::time_point deadline;
  };

  std::string Prefix() const { return "NcclComm rank " + std::to_string(options_.rank) + ": "; }

  Status CheckBuffers(const std::string& what, bool send_ok, bool recv_ok) const {
    if (send_ok && recv_ok) return Status::OK();
    // The peers cannot be told (unlike LocalComm's hub): their matching collective fails on
    // the watchdog's timeout.
    return Status::InvalidArgument(Prefix() + what + ": " +
                                   (send_ok ? "receive buffer" : "send buffer") + " is null");
  }

  // Polls `comm` until it leaves ncclInProgress or `seconds` pass (then ncclInProgress is
  // returned).
  static ncclResult_t Poll(ncclComm_t comm, double seconds) {
    const auto deadline = Clock::now() + Seconds(seconds);
    for (;;) {
      ncclResult_t state = ncclSuccess;
      const ncclResult_t r = ncclCommGetAsyncError(comm, &state);
      if (r != ncclSuccess) return r;
      if (state != ncclInProgress) return state;
      if (Clock::now() >= deadline) return ncclInProgress;
      std::this_thread::sleep_for(std::chrono::microseconds(100));
    }
  }

  // Breaks the group: aborts the communicator (once) and fails every pending collective's
  // stream. Returns the group's Status.
  Status Fail(const std::string& why) EXCLUDES(mu_) {
    MutexLock lock(&mu_);
    return FailLocked(why);
  }
  Status FailLocked(const std::string& why) REQUIRES(mu_) {
    if (!broken_.ok()) return broken_;
    broken_ = Status::FailedPrecondition(Prefix() + why + " (world size " +
                                         std::to_string(options_.world_size) +
                                         "). The communicator was aborted; the group is unusable.");
    {
      // Waits for an enqueue in flight on another thread (it is polled, so it ends).
      MutexLock comm_lock(&comm_mu_);
      if (comm_ != nullptr && !aborted_) {
        aborted_ = true;
        (void)ncclCommAbort(comm_);
      }
    }
    for (const Pending& p : pending_) p.stream->SetError(broken_);
    cv_.NotifyAll();
    return broken_;
  }

  // Enqueues one collective on `stream` (which must be of this communicator's device), settles
  // the non-blocking call and hands its completion to the watchdog.
  Status Issue(const std::string& what, Stream* stream,
               const std::function<ncclResult_t(cudaStream_t)>& enqueue) {
    {
      MutexLock lock(&mu_);
      if (!broken_.ok()) return broken_;
    }
    ZINF_ASSIGN_OR_RETURN(CudaStream * cs,
                          device_->OwnStream(stream, ("NcclComm " + what).c_str()));
    ncclResult_t r = ncclSuccess;
    bool was_aborted = false;
    {
      MutexLock comm_lock(&comm_mu_);
      was_aborted = aborted_;
      if (!was_aborted) {
        r = enqueue(cs->handle());
        if (r == ncclSuccess || r == ncclInProgress) r = Poll(comm_, options_.timeout_seconds);
      }
    }
    if (was_aborted) {
      MutexLock lock(&mu_);
      return broken_;
    }
    if (r != ncclSuccess) {
      return Fail(what + (r == ncclInProgress ? " could not be enqueued within " +
                                                    SecondsText(options_.timeout_seconds)
                                              : " failed: " + NcclErrorText(r, comm_)));
    }
    MutexLock lock(&mu_);
    cudaEvent_t event = nullptr;
    if (!free_events_.empty()) {
      event = free_events_.back();
      free_events_.pop_back();
    } else {
      ZINF_CUDA_CHECK(cudaEventCreateWithFlags(&event, cudaEventDisableTiming));
    }
    const cudaError_t rec = cudaEventRecord(event, cs->handle());
    if (rec != cudaSuccess) {
      free_events_.push_back(event);
      return cuda_internal::CudaCallStatus(rec, "cudaEventRecord(after collective)", __FILE__,
                                           __LINE__);
    }
    pending_.push_back(Pending{event, cs, what, Clock::now() + Seconds(options_.timeout_seconds)});
    cv_.NotifyAll();
    return Status::OK();
  }

  void WatchdogMain() EXCLUDES(mu_, comm_mu_) {
    const bool current = MakeCurrent(device_->ordinal()).ok();
    MutexLock lock(&mu_);
    while (!stopping_) {
      if (pending_.empty() || !broken_.ok()) {
        while (!(stopping_ || (!pending_.empty() && broken_.ok()))) cv_.Wait(&mu_);
        continue;
      }
      // Completed collectives leave in order; stop at the first one still running.
      while (current && !pending_.empty()) {
        const cudaError_t q = cudaEventQuery(pending_.front().event);
        if (q == cudaErrorNotReady) break;
        free_events_.push_back(pending_.front().event);
        pending_.pop_front();
      }
      // try_lock: an enqueue being settled on the issuing thread holds comm_mu_ (and polls the
      // same error); the deadline is still checked.
      if (!pending_.empty()) {
        ncclResult_t state = ncclSuccess;
        ncclResult_t r = ncclSuccess;
        if (comm_mu_.TryLock()) {
          if (!aborted_) r = ncclCommGetAsyncError(comm_, &state);
          comm_mu_.Unlock();
        }
        if (r != ncclSuccess || (state != ncclSuccess && state != ncclInProgress)) {
          const ncclResult_t bad = r != ncclSuccess ? r : state;
          (void)FailLocked(pending_.front().what +
                           " failed asynchronously: " + NcclErrorText(bad, comm_));
        } else if (Clock::now() >= pending_.front().deadline) {
          (void)FailLocked(pending_.front().what + " did not complete within " +
                           SecondsText(options_.timeout_seconds) +
                           "; a peer is dead or stuck, or ranks issued collectives in different "
                           "orders");
        }
      }
      cv_.WaitUntil(&mu_, Clock::now() + std::chrono::milliseconds(1));
    }
  }

  CudaDevice* const device_;
  const NcclCommOptions options_;
  ncclComm_t comm_ = nullptr;
  CudaStream* barrier_stream_ = nullptr;  // owned by device_
  void* barrier_buf_ = nullptr;           // one float, cudaMalloc'ed at creation

  Mutex mu_;
  CondVar cv_;
  std::deque<Pending> pending_ GUARDED_BY(mu_);  // collectives not yet seen complete
  std::vector<cudaEvent_t> free_events_ GUARDED_BY(mu_);
  Status broken_ GUARDED_BY(mu_);
  // Lock order: mu_, then comm_mu_. comm_mu_ is held around every use of comm_ that may race
  // with ncclCommAbort (which frees it): enqueue + settle, the watchdog's error poll, abort.
  Mutex comm_mu_;
  bool aborted_ GUARDED_BY(comm_mu_) = false;
  bool stopping_ GUARDED_BY(mu_) = false;
  std::thread watchdog_;
};

}  // namespace

Result<std::unique_ptr<Communicator>> NewNcclComm(Device* device, const NcclCommOptions& options) {
  auto* cuda_device = dynamic_cast<CudaDevice*>(device);
  if (cuda_device == nullptr) {
    return Status::InvalidArgument("NewNcclComm: " +
                                   (device == nullptr
                                        ? std::string("the device is null")
                                        : "device '" + device->Name() + "' is not a CudaDevice") +
                                   "; NCCL runs on CUDA device memory (NewCudaDevice)");
  }
  if (options.world_size < 1 || options.rank < 0 || options.rank >= options.world_size) {
    return Status::InvalidArgument("NewNcclComm: rank " + std::to_string(options.rank) +
                                   " is not a rank of a world of " +
                                   std::to_string(options.world_size));
  }
  if (!(options.timeout_seconds > 0)) {
    return Status::InvalidArgument("NewNcclComm: timeout_seconds must be positive");
  }
  if (options.world_size > 1 && options.unique_id_file.empty() && options.store == nullptr) {
    return Status::InvalidArgument(
        "NewNcclComm: world size " + std::to_string(options.world_size) +
        " needs a rendezvous store or unique_id_file (a path every rank can read; rank 0 writes "
        "the NCCL id there)");
  }
  auto comm = std::make_unique<NcclComm>(cuda_device, options);
  ZINF_RETURN_IF_ERROR(comm->Init());
  return std::unique_ptr<Communicator>(std::move(comm));
}

}  // namespace zinf
