// Clang thread-safety annotations and the engine's annotated mutex (leveldb's port::Mutex in
// spirit): a clang build with -Wthread-safety checks that every field marked GUARDED_BY is
// touched only with its lock held. Other compilers ignore the annotations.
#pragma once

#include <chrono>
#include <condition_variable>
#include <mutex>

#if defined(__clang__)
#define ZINF_THREAD_ANNOTATION(x) __attribute__((x))
#else
#define ZINF_THREAD_ANNOTATION(x)
#endif

#define CAPABILITY(x) ZINF_THREAD_ANNOTATION(capability(x))
#define SCOPED_CAPABILITY ZINF_THREAD_ANNOTATION(scoped_lockable)
#define GUARDED_BY(x) ZINF_THREAD_ANNOTATION(guarded_by(x))
#define PT_GUARDED_BY(x) ZINF_THREAD_ANNOTATION(pt_guarded_by(x))
#define REQUIRES(...) ZINF_THREAD_ANNOTATION(requires_capability(__VA_ARGS__))
#define ACQUIRE(...) ZINF_THREAD_ANNOTATION(acquire_capability(__VA_ARGS__))
#define RELEASE(...) ZINF_THREAD_ANNOTATION(release_capability(__VA_ARGS__))
#define EXCLUDES(...) ZINF_THREAD_ANNOTATION(locks_excluded(__VA_ARGS__))
#define TRY_ACQUIRE(...) ZINF_THREAD_ANNOTATION(try_acquire_capability(__VA_ARGS__))
#define NO_THREAD_SAFETY_ANALYSIS ZINF_THREAD_ANNOTATION(no_thread_safety_analysis)

namespace zinf {

class CondVar;

class CAPABILITY("mutex") Mutex {
 public:
  Mutex() = default;
  Mutex(const Mutex&) = delete;
  Mutex& operator=(const Mutex&) = delete;
  void Lock() ACQUIRE() { mu_.lock(); }
  void Unlock() RELEASE() { mu_.unlock(); }
  bool TryLock() TRY_ACQUIRE(true) { return mu_.try_lock(); }

 private:
  friend class CondVar;
  std::mutex mu_;
};

// Holds a Mutex for its scope.
class SCOPED_CAPABILITY MutexLock {
 public:
  explicit MutexLock(Mutex* mu) ACQUIRE(mu) : mu_(mu) { mu_->Lock(); }
  ~MutexLock() RELEASE() { mu_->Unlock(); }
  MutexLock(const MutexLock&) = delete;
  MutexLock& operator=(const MutexLock&) = delete;

 private:
  Mutex* const mu_;
};

// A condition variable waited on with a Mutex held (released while waiting).
class CondVar {
 public:
  void Wait(Mutex* mu) REQUIRES(mu) {
    std::unique_lock<std::mutex> lock(mu->mu_, std::adopt_lock);
    cv_.wait(lock);
    lock.release();  // still held: the caller's
  }
  // False when `deadline` passed.
  bool WaitUntil(Mutex* mu, std::chrono::steady_clock::time_point deadline) REQUIRES(mu) {
    std::unique_lock<std::mutex> lock(mu->mu_, std::adopt_lock);
    const bool woken = cv_.wait_until(lock, deadline) == std::cv_status::no_timeout;
    lock.release();
    return woken;
  }
  void NotifyAll() { cv_.notify_all(); }
  void NotifyOne() { cv_.notify_one(); }

 private:
  std::condition_variable cv_;
};

}  // namespace zinf
