#include "nvme/swap_tickets.h"

namespace zinf {

Ticket TicketTable::Open(int parts) {
  const Ticket t = next_++;
  tickets_[t].remaining = parts;
  if (in_flight_++ == 0) busy_since_ = std::chrono::steady_clock::now();
  return t;
}

bool TicketTable::PartDone(Ticket t, const Status& s) {
  State& st = tickets_[t];
  if (!s.ok() && st.status.ok()) st.status = s;
  if (--st.remaining > 0) return false;
  if (--in_flight_ == 0) {
    busy_seconds_ +=
        std::chrono::duration<double>(std::chrono::steady_clock::now() - busy_since_).count();
  }
  return true;
}

bool TicketTable::Ended(Ticket t) const {
  auto it = tickets_.find(t);
  return it == tickets_.end() || it->second.remaining == 0;
}

Status TicketTable::Take(Ticket t) {
  auto it = tickets_.find(t);
  if (it == tickets_.end()) {
    return Status::InvalidArgument("unknown swap ticket " + std::to_string(t) +
                                   " (never issued, or already waited for)");
  }
  Status result = std::move(it->second.status);
  tickets_.erase(it);
  return result;
}

HashWorker::HashWorker() : thread_([this] { Loop(); }) {}

HashWorker::~HashWorker() {
  {
    MutexLock lock(&mu_);
    stop_ = true;
  }
  cv_.NotifyAll();
  thread_.join();
}

void HashWorker::Post(std::function<void()> task, bool read_check) {
  {
    MutexLock lock(&mu_);
    (read_check ? reads_ : writes_).push_back(std::move(task));
  }
  cv_.NotifyAll();
}

void HashWorker::Loop() {
  for (;;) {
    std::function<void()> task;
    {
      MutexLock lock(&mu_);
      while (!stop_ && reads_.empty() && writes_.empty()) cv_.Wait(&mu_);
      if (reads_.empty() && writes_.empty()) return;  // stopping, and drained
      std::deque<std::function<void()>>& lane = reads_.empty() ? writes_ : reads_;
      task = std::move(lane.front());
      lane.pop_front();
    }
    task();
  }
}

}  // namespace zinf
