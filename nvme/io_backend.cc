#include <algorithm>
#include <chrono>
#include <deque>
#include <thread>
#include <unordered_map>

#include "common/thread_annotations.h"
#include "zinf/io.h"

namespace zinf {

const char* IoOpName(IoOp op) { return op == IoOp::kRead ? "read" : "write"; }

const char* IoBackendKindName(IoBackendKind kind) {
  switch (kind) {
    case IoBackendKind::kIoUring:
      return "io_uring";
    case IoBackendKind::kLibaio:
      return "libaio";
    case IoBackendKind::kPsync:
      return "psync";
  }
  return "unknown";
}

Result<IoBackendKind> ParseIoBackendKind(const std::string& name) {
  if (name == "io_uring" || name == "uring" || name.empty()) return IoBackendKind::kIoUring;
  if (name == "libaio" || name == "aio") return IoBackendKind::kLibaio;
  if (name == "psync" || name == "sync") return IoBackendKind::kPsync;
  return Status::InvalidArgument("unknown I/O backend '" + name +
                                 "': choose io_uring, libaio or psync");
}

Result<std::unique_ptr<IoBackend>> NewIoBackend(IoBackendKind kind,
                                                const IoBackendOptions& options) {
  if (options.queue_depth == 0 || options.queue_depth > 4096) {
    return Status::InvalidArgument("I/O queue depth " + std::to_string(options.queue_depth) +
                                   " is out of range: use 1..4096");
  }
  switch (kind) {
    case IoBackendKind::kIoUring:
      return NewIoUringBackend(options);
    case IoBackendKind::kLibaio:
      return NewLibaioBackend(options);
    case IoBackendKind::kPsync:
      return NewPsyncBackend(options);
  }
  return Status::InvalidArgument("unknown I/O backend kind");
}

// ---- FaultPlan / FaultyBackend ----

struct FaultPlan::State {
  mutable Mutex mu;
  std::vector<IoFault> faults GUARDED_BY(mu);
  uint64_t requests GUARDED_BY(mu) = 0;
  uint64_t fired GUARDED_BY(mu) = 0;
};

FaultPlan::FaultPlan() : state_(std::make_unique<State>()) {}
FaultPlan::~FaultPlan() = default;

void FaultPlan::Add(const IoFault& fault) {
  MutexLock lock(&state_->mu);
  state_->faults.push_back(fault);
}

uint64_t FaultPlan::AddAhead(IoFault fault, uint64_t ahead) {
  MutexLock lock(&state_->mu);
  fault.first = state_->requests + ahead;
  state_->faults.push_back(fault);
  return fault.first;
}

void FaultPlan::Clear() {
  MutexLock lock(&state_->mu);
  state_->faults.clear();
}

uint64_t FaultPlan::requests() const {
  MutexLock lock(&state_->mu);
  return state_->requests;
}

uint64_t FaultPlan::fired() const {
  MutexLock lock(&state_->mu);
  return state_->fired;
}

bool FaultPlan::Next(IoOp op, IoFault* fault) {
  MutexLock lock(&state_->mu);
  uint64_t index = state_->requests++;
  for (const IoFault& f : state_->faults) {
    if (index >= f.first && index - f.first < f.count && (f.any_op || f.op == op)) {
      *fault = f;
      ++state_->fired;
      return true;
    }
  }
  return false;
}

namespace {

class FaultyBackend final : public IoBackend {
 public:
  FaultyBackend(std::unique_ptr<IoBackend> inner, std::shared_ptr<FaultPlan> plan)
      : inner_(std::move(inner)), plan_(std::move(plan)) {}

  const char* Name() const override { return inner_->Name(); }
  std::string Features() const override { return inner_->Features() + " faulty"; }
  int InFlight() const override { return inner_->InFlight() + static_cast<int>(synthetic_.size()); }
  int QueueDepth() const override { return inner_->QueueDepth(); }
  void Wake() override { inner_->Wake(); }

  Status Start(const std::vector<IoFile>& files,
               const std::vector<MemoryRegion>& regions) override {
    return inner_->Start(files, regions);
  }
  Status SetBuffersRegistered(bool registered) override {
    return inner_->SetBuffersRegistered(registered);
  }

  Result<int> Submit(const IoRequest* reqs, int n) override {
    int room = QueueDepth() - InFlight();
    int accepted = 0;
    for (; accepted < n && accepted < room; ++accepted) {
      IoRequest r = reqs[accepted];
      IoFault fault;
      if (!plan_->Next(r.op, &fault)) {
        ZINF_RETURN_IF_ERROR(Pass(r));
        continue;
      }
      switch (fault.kind) {
        case IoFault::Kind::kError:
          synthetic_.push_back({r.tag, -static_cast<int64_t>(fault.errno_value)});
          break;
        case IoFault::Kind::kShort:
          r.len = std::min(r.len, fault.short_bytes);
          ZINF_RETURN_IF_ERROR(Pass(r));
          break;
        case IoFault::Kind::kTorn:
          if (r.op == IoOp::kWrite && fault.short_bytes < r.len) {
            torn_[r.tag] = r.len;
            r.len = fault.short_bytes;
          }
          ZINF_RETURN_IF_ERROR(Pass(r));
          break;
        case IoFault::Kind::kDelay:
          delayed_[r.tag] =
              std::chrono::steady_clock::now() + std::chrono::microseconds(fault.delay_us);
          ZINF_RETURN_IF_ERROR(Pass(r));
          break;
      }
    }
    return accepted;
  }

  Result<int> Reap(IoCompletion* out, int max, bool wait) override {
    int got = 0;
    while (got < max && !synthetic_.empty()) {
      out[got++] = synthetic_.front();
      synthetic_.pop_front();
    }
    if (got == max || inner_->InFlight() == 0) return got;
    ZINF_ASSIGN_OR_RETURN(int n, inner_->Reap(out + got, max - got, wait && got == 0));
    for (int i = got; i < got + n; ++i) {
      auto torn = torn_.find(out[i].tag);
      if (torn != torn_.end()) {
        // Report the whole write as done although only part of it reached the file.
        if (out[i].res >= 0) out[i].res = torn->second;
        torn_.erase(torn);
      }
      auto delayed = delayed_.find(out[i].tag);
      if (delayed != delayed_.end()) {
        std::this_thread::sleep_until(delayed->second);  // a slow device stalls the queue
        delayed_.erase(delayed);
      }
    }
    return got + n;
  }

 private:
  Status Pass(const IoRequest& r) {
    ZINF_ASSIGN_OR_RETURN(int n, inner_->Submit(&r, 1));
    if (n != 1) return Status::Internal("faulty backend: inner backend refused a request");
    return Status::OK();
  }

  std::unique_ptr<IoBackend> inner_;
  std::shared_ptr<FaultPlan> plan_;
  std::deque<IoCompletion> synthetic_;
  std::unordered_map<uint64_t, uint32_t> torn_;
  std::unordered_map<uint64_t, std::chrono::steady_clock::time_point> delayed_;
};

}  // namespace

std::unique_ptr<IoBackend> NewFaultyBackend(std::unique_ptr<IoBackend> inner,
                                            std::shared_ptr<FaultPlan> plan) {
  return std::make_unique<FaultyBackend>(std::move(inner), std::move(plan));
}

}  // namespace zinf
