// A swap store's requests in flight: the tickets callers wait on (each the sum of its chunk
// transfers and chunk hashes, with the first error), the busy time they add up to, and the hash
// worker that checksums written chunks and verifies read ones off the callers' and the I/O
// thread's paths. Private to nvme/.
#pragma once

#include <chrono>
#include <deque>
#include <functional>
#include <string>
#include <thread>
#include <unordered_map>

#include "common/thread_annotations.h"
#include "zinf/status.h"

namespace zinf {

using Ticket = uint64_t;

// Not thread-safe: the store calls it with its own lock held.
class TicketTable {
 public:
  // A ticket that ends after `parts` calls of PartDone.
  Ticket Open(int parts);
  // One part ended with `s` (the first error is the ticket's). True when it was the last:
  // the ticket has ended (Wait may return it).
  bool PartDone(Ticket t, const Status& s);
  bool Known(Ticket t) const { return tickets_.count(t) != 0; }
  // Ended, or unknown (which Take reports).
  bool Ended(Ticket t) const;
  // The first error of a known ticket's parts so far (OK when none).
  const Status& status(Ticket t) const { return tickets_.at(t).status; }
  // The ended ticket's outcome; the ticket is forgotten. InvalidArgument for an unknown one.
  // REQUIRES: Ended(t).
  Status Take(Ticket t);
  int in_flight() const { return in_flight_; }
  // Seconds with at least one ticket in flight, so far.
  double busy_seconds() const { return busy_seconds_; }

 private:
  struct State {
    int remaining = 0;
    Status status;
  };
  std::unordered_map<Ticket, State> tickets_;
  Ticket next_ = 1;
  int in_flight_ = 0;
  std::chrono::steady_clock::time_point busy_since_;
  double busy_seconds_ = 0;
};

// One thread that hashes written chunks while they are written and verifies read chunks as they
// land, so that hashing overlaps the I/O instead of adding to it. Read checks go first (a
// trainer or the optimizer waits on them; a write's hash only delays the end of its ticket),
// each lane FIFO; drained and joined at destruction. Thread-safe.
class HashWorker {
 public:
  HashWorker();
  ~HashWorker();
  HashWorker(const HashWorker&) = delete;
  HashWorker& operator=(const HashWorker&) = delete;
  void Post(std::function<void()> task, bool read_check) EXCLUDES(mu_);

 private:
  void Loop() EXCLUDES(mu_);
  Mutex mu_;
  CondVar cv_;
  std::deque<std::function<void()>> reads_ GUARDED_BY(mu_);
  std::deque<std::function<void()>> writes_ GUARDED_BY(mu_);
  bool stop_ GUARDED_BY(mu_) = false;
  std::thread thread_;  // last: starts once the rest is ready
};

}  // namespace zinf
