#include "nvme/io_queue.h"

#include <algorithm>
#include <cerrno>

namespace zinf {

struct IoQueue::Job {
  Transfer t;
  TransferDone done;
  uint64_t issued = 0;     // bytes handed to pieces
  uint64_t completed = 0;  // bytes confirmed by completions
  int outstanding = 0;     // pieces in flight or waiting to be resubmitted
  Status status;
};

struct IoQueue::Piece {
  Job* job = nullptr;
  uint64_t offset = 0;  // file offset
  char* buf = nullptr;
  uint32_t len = 0;
  uint32_t retries = 0;
};

Result<std::unique_ptr<IoQueue>> IoQueue::Start(std::unique_ptr<IoBackend> backend,
                                                std::vector<IoFile> files,
                                                std::vector<MemoryRegion> regions,
                                                const IoQueueOptions& options) {
  if (options.block_size == 0 || options.block_size % 4096 != 0) {
    return Status::InvalidArgument("I/O block size " + std::to_string(options.block_size) +
                                   " must be a positive multiple of 4096");
  }
  std::unique_ptr<IoQueue> q(
      new IoQueue(std::move(backend), std::move(files), std::move(regions), options));
  std::promise<Status> started;
  std::future<Status> result = started.get_future();
  q->thread_ = std::thread([&q, &started] { q->ThreadMain(&started); });
  Status s = result.get();
  if (!s.ok()) {
    q->thread_.join();
    q->thread_ = std::thread();
    return s;
  }
  return q;
}

IoQueue::IoQueue(std::unique_ptr<IoBackend> backend, std::vector<IoFile> files,
                 std::vector<MemoryRegion> regions, const IoQueueOptions& options)
    : backend_(std::move(backend)),
      files_(std::move(files)),
      regions_(std::move(regions)),
      options_(options),
      backend_name_(backend_->Name()) {}

IoQueue::~IoQueue() {
  {
    MutexLock lock(&mu_);
    stopping_ = true;
    if (in_reap_) backend_->Wake();
  }
  cv_.NotifyAll();
  if (thread_.joinable()) thread_.join();
  MutexLock lock(&mu_);
  for (Control& c : controls_)
    c.done.set_value(Status::FailedPrecondition("the I/O queue stopped"));
  controls_.clear();
}

Status IoQueue::RunWhenIdle(std::function<Status(IoBackend*)> fn) {
  std::future<Status> result;
  {
    MutexLock lock(&mu_);
    if (stopping_) return Status::FailedPrecondition("the I/O queue is stopping");
    controls_.push_back(Control{std::move(fn), {}});
    result = controls_.back().done.get_future();
    if (in_reap_) backend_->Wake();
  }
  cv_.NotifyOne();
  return result.get();
}

void IoQueue::RunControls() {
  std::deque<Control> controls;
  {
    MutexLock lock(&mu_);
    controls.swap(controls_);
  }
  for (Control& c : controls) c.done.set_value(c.fn(backend_.get()));
}

void IoQueue::Submit(const Transfer& t, TransferDone done) {
  auto job = std::make_unique<Job>();
  job->t = t;
  job->done = std::move(done);
  MutexLock lock(&mu_);
  ZINF_CHECK_MSG(!stopping_, "IoQueue::Submit after destruction began");
  incoming_.push_back(std::move(job));
  if (in_reap_) {
    backend_->Wake();
  } else {
    cv_.NotifyOne();
  }
}

IoQueueStats IoQueue::Stats() const {
  MutexLock lock(&mu_);
  return stats_;
}

void IoQueue::ThreadMain(std::promise<Status>* started) {
  Status s = backend_->Start(files_, regions_);
  if (s.ok()) {
    features_ = backend_->Features();
    pieces_.resize(backend_->QueueDepth());
    for (uint32_t i = static_cast<uint32_t>(pieces_.size()); i > 0; --i) {
      free_pieces_.push_back(i - 1);
    }
  }
  bool ok = s.ok();
  started->set_value(std::move(s));  // `started` dies after this
  if (ok) Loop();
}

bool IoQueue::TakeIncoming(bool block) {
  std::vector<std::unique_ptr<Job>> empty_jobs;
  {
    MutexLock lock(&mu_);
    if (block) {
      while (!stopping_ && incoming_.empty() && controls_.empty()) cv_.Wait(&mu_);
    }
    if (incoming_.empty()) return !(stopping_ && block);
    while (!incoming_.empty()) {
      auto& job = incoming_.front();
      if (job->t.len == 0) {
        empty_jobs.push_back(std::move(job));
      } else if (job->t.urgent) {
        // After the urgent jobs already queued, before the first normal one.
        auto at = std::find_if(active_.begin(), active_.end(),
                               [](const std::unique_ptr<Job>& j) { return !j->t.urgent; });
        active_.insert(at, std::move(job));
      } else {
        active_.push_back(std::move(job));
      }
      incoming_.pop_front();
    }
  }
  for (auto& job : empty_jobs) job->done(Status::OK());
  return true;
}

void IoQueue::Loop() {
  std::vector<IoCompletion> completions(pieces_.size());
  for (;;) {
    bool idle = active_.empty() && backend_->InFlight() == 0;
    if (idle) RunControls();
    if (!TakeIncoming(/*block=*/idle)) return;
    if (fatal_.ok()) {
      Status s = FillQueue();
      if (!s.ok()) fatal_ = s;
    }
    if (!fatal_.ok() && backend_->InFlight() == 0) {
      // Nothing of ours is in the kernel any more: fail what is left.
      while (!resubmit_.empty()) {
        Piece* p = &pieces_[resubmit_.front()];
        resubmit_.pop_front();
        FailJob(p->job, fatal_);
        FinishPiece(p);
      }
      while (!active_.empty()) {
        Job* job = active_.front().get();
        ZINF_CHECK(job->outstanding == 0);
        FailJob(job, fatal_);
        job->issued = job->t.len;
        std::unique_ptr<Job> owned = std::move(active_.front());
        active_.pop_front();
        owned->done(owned->status);
      }
      continue;
    }
    if (backend_->InFlight() == 0) continue;
    {
      MutexLock lock(&mu_);
      if (!incoming_.empty()) continue;  // new work first: fill the queue before waiting
      in_reap_ = true;
    }
    Result<int> n = backend_->Reap(completions.data(), static_cast<int>(completions.size()),
                                   /*wait=*/true);
    {
      MutexLock lock(&mu_);
      in_reap_ = false;
    }
    if (!n.ok()) {
      fatal_ = n.status();
      // The backend can no longer tell us about the requests it holds; give up on them.
      for (Piece& p : pieces_) {
        if (p.job != nullptr) {
          FailJob(p.job, fatal_);
          FinishPiece(&p);
        }
      }
      resubmit_.clear();
      continue;
    }
    for (int i = 0; i < n.value(); ++i) OnCompletion(completions[i]);
  }
}

Status IoQueue::FillQueue() {
  std::vector<IoRequest> reqs;
  std::vector<uint32_t> ids;
  int room = backend_->QueueDepth() - backend_->InFlight();
  while (room > 0 && !resubmit_.empty()) {
    uint32_t id = resubmit_.front();
    resubmit_.pop_front();
    ids.push_back(id);
    --room;
  }
  for (auto& owned : active_) {
    Job* job = owned.get();
    while (room > 0 && job->status.ok() && job->issued < job->t.len && !free_pieces_.empty()) {
      uint32_t id = free_pieces_.back();
      free_pieces_.pop_back();
      Piece& p = pieces_[id];
      uint64_t len = std::min<uint64_t>(options_.block_size, job->t.len - job->issued);
      p.job = job;
      p.offset = job->t.offset + job->issued;
      p.buf = static_cast<char*>(job->t.buf) + job->issued;
      p.len = static_cast<uint32_t>(len);
      p.retries = 0;
      job->issued += len;
      ++job->outstanding;
      ids.push_back(id);
      --room;
    }
    if (room == 0 || free_pieces_.empty()) break;
  }
  if (ids.empty()) return Status::OK();
  reqs.reserve(ids.size());
  for (uint32_t id : ids) {
    const Piece& p = pieces_[id];
    IoRequest r;
    r.tag = id;
    r.op = p.job->t.op;
    r.file = p.job->t.file;
    r.offset = p.offset;
    r.buf = p.buf;
    r.len = p.len;
    reqs.push_back(r);
  }
  size_t done = 0;
  while (done < reqs.size()) {
    Result<int> n = backend_->Submit(reqs.data() + done, static_cast<int>(reqs.size() - done));
    if (!n.ok()) {
      for (size_t i = reqs.size(); i > done; --i) resubmit_.push_front(ids[i - 1]);
      return n.status();
    }
    if (n.value() == 0) break;
    done += n.value();
  }
  // Whatever the backend could not take now goes first next time.
  for (size_t i = reqs.size(); i > done; --i) resubmit_.push_front(ids[i - 1]);
  MutexLock lock(&mu_);
  stats_.requests += done;
  return Status::OK();
}

std::string IoQueue::Describe(const Job& job, uint64_t offset, uint64_t len) const {
  return std::string(IoOpName(job.t.op)) + " of " + files_[job.t.file].path + " at offset " +
         std::to_string(offset) + ", length " + std::to_string(len);
}

void IoQueue::FailJob(Job* job, Status status) {
  if (job->status.ok()) job->status = std::move(status);
}

void IoQueue::OnCompletion(const IoCompletion& c) {
  ZINF_CHECK(c.tag < pieces_.size());
  Piece* p = &pieces_[c.tag];
  Job* job = p->job;
  ZINF_CHECK(job != nullptr);
  if (c.res < 0) {
    int err = static_cast<int>(-c.res);
    if ((err == EAGAIN || err == EINTR) && p->retries < options_.max_retries) {
      ++p->retries;
      resubmit_.push_back(static_cast<uint32_t>(c.tag));
      MutexLock lock(&mu_);
      ++stats_.retries;
      return;
    }
    FailJob(job, ErrnoToStatus(err, Describe(*job, p->offset, p->len)));
    FinishPiece(p);
    return;
  }
  uint64_t res = static_cast<uint64_t>(c.res);
  if (res == 0) {
    FailJob(job,
            Status::IoError(Describe(*job, p->offset, p->len) + ": the device transferred 0 bytes" +
                            (job->t.op == IoOp::kRead ? " (read past the end of the file?)"
                                                      : " (device full?)")));
    FinishPiece(p);
    return;
  }
  if (res > p->len) {
    FailJob(job, Status::Internal(Describe(*job, p->offset, p->len) + ": backend reported " +
                                  std::to_string(res) + " bytes"));
    FinishPiece(p);
    return;
  }
  {
    MutexLock lock(&mu_);
    (job->t.op == IoOp::kRead ? stats_.bytes_read : stats_.bytes_written) += res;
    if (res < p->len) ++stats_.short_resubmits;
  }
  job->completed += res;
  if (res < p->len && job->status.ok()) {
    p->offset += res;
    p->buf += res;
    p->len -= static_cast<uint32_t>(res);
    resubmit_.push_back(static_cast<uint32_t>(c.tag));
    return;
  }
  FinishPiece(p);
}

void IoQueue::FinishPiece(Piece* p) {
  Job* job = p->job;
  p->job = nullptr;
  free_pieces_.push_back(static_cast<uint32_t>(p - pieces_.data()));
  --job->outstanding;
  bool ended = job->outstanding == 0 && (!job->status.ok() || job->issued == job->t.len);
  if (!ended) return;
  auto it = std::find_if(active_.begin(), active_.end(),
                         [job](const std::unique_ptr<Job>& j) { return j.get() == job; });
  ZINF_CHECK(it != active_.end());
  std::unique_ptr<Job> owned = std::move(*it);
  active_.erase(it);
  owned->done(owned->status);
}

}  // namespace zinf
