// Helpers of the device tests (the contract suite and the backends' own tests): a host task
// that holds a stream until opened, and device buffers filled from and read back to host
// vectors on one stream.
#pragma once

#include <gtest/gtest.h>

#include <atomic>
#include <functional>
#include <future>
#include <vector>

#include "zinf/device.h"

namespace zinf::testing {

// A host task that blocks its stream until Open(): makes "slow work" deterministic.
class Gate {
 public:
  Gate() : future_(promise_.get_future().share()) {}
  ~Gate() { Open(); }  // never leave a stream blocked behind a failed assertion
  std::function<void()> Task() const {
    return [f = future_] { f.wait(); };
  }
  void Open() {
    if (!opened_.exchange(true)) promise_.set_value();
  }

 private:
  std::promise<void> promise_;
  std::shared_future<void> future_;
  std::atomic<bool> opened_{false};
};

// Device buffers of one device, freed with this object; copies on `stream`.
class DeviceBuffers {
 public:
  DeviceBuffers() = default;
  DeviceBuffers(Device* device, Stream* stream) : device_(device), stream_(stream) {}
  ~DeviceBuffers() {
    for (void* p : allocated_) device_->Free(p);
  }
  void Reset(Device* device, Stream* stream) {
    device_ = device;
    stream_ = stream;
  }
  template <typename T>
  T* Buffer(size_t n) {
    Result<void*> p = device_->Alloc(std::max<size_t>(n, 1) * sizeof(T));
    EXPECT_TRUE(p.ok()) << p.status().ToString();
    if (!p.ok()) return nullptr;
    allocated_.push_back(*p);
    return static_cast<T*>(*p);
  }
  // A copy reads its source when it runs: Upload waits for it, so the caller may change
  // `host` right after.
  template <typename T>
  T* Upload(const std::vector<T>& host) {
    T* d = Buffer<T>(host.size());
    EXPECT_TRUE(device_->CopyHostToDevice(d, host.data(), host.size() * sizeof(T), stream_).ok());
    EXPECT_TRUE(device_->SynchronizeStream(stream_).ok());
    return d;
  }
  template <typename T>
  std::vector<T> Download(const T* d, size_t n) {
    std::vector<T> host(n);
    EXPECT_TRUE(device_->CopyDeviceToHost(host.data(), d, n * sizeof(T), stream_).ok());
    Status s = device_->SynchronizeStream(stream_);
    EXPECT_TRUE(s.ok()) << s.ToString();
    return host;
  }

 private:
  Device* device_ = nullptr;
  Stream* stream_ = nullptr;
  std::vector<void*> allocated_;
};

}  // namespace zinf::testing
