// The engine suite under the strict host device (HostDeviceOptions::strict): with
// ZINF_TEST_STRICT_DEVICE=1 in the environment, every host device a test makes through
// NewTestHostDevice is strict, seeded from ZINF_TEST_STRICT_SEED (a decimal number; when
// unset, one drawn at start). The seed is printed at start and after every failure. It fixes
// each stream's sequence of delays, not the operating system's scheduling, so a rerun with it
// replays the same pressure, not necessarily the same interleaving:
// ZINF_TEST_STRICT_DEVICE=1 ZINF_TEST_STRICT_SEED=<seed>.
//
// Under strict mode the compute stream is asynchronous: a test reads what the engine handed it
// (Acquire's buffers) only after SynchronizeStream(ComputeStream()), as a GPU trainer's kernels
// would run after the engine's waits on that stream (HostReadable below).
#pragma once

#include <gtest/gtest.h>

#include <atomic>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <random>
#include <string>

#include "zinf/device.h"
#include "zinf/status.h"

namespace zinf {
namespace testing {

struct StrictDeviceSetting {
  bool on = false;
  uint64_t seed = 0;
};

inline StrictDeviceSetting ReadStrictDeviceSetting() {
  StrictDeviceSetting s;
  const char* on = std::getenv("ZINF_TEST_STRICT_DEVICE");
  s.on = on != nullptr && std::string(on) == "1";
  if (!s.on) return s;
  const char* seed = std::getenv("ZINF_TEST_STRICT_SEED");
  if (seed != nullptr && *seed != '\0') {
    char* end = nullptr;
    s.seed = std::strtoull(seed, &end, 10);
    if (end == nullptr || *end != '\0') {
      std::fprintf(stderr, "ZINF_TEST_STRICT_SEED='%s' is not a decimal number\n", seed);
      std::exit(2);
    }
  } else {
    s.seed = std::random_device{}();
  }
  return s;
}

// Prints the seed after every failed assertion of a strict run.
class StrictSeedPrinter : public ::testing::EmptyTestEventListener {
 public:
  explicit StrictSeedPrinter(uint64_t seed) : seed_(seed) {}
  void OnTestPartResult(const ::testing::TestPartResult& r) override {
    if (!r.failed()) return;
    std::printf(
        "[strict host device] seed %llu: rerun with ZINF_TEST_STRICT_DEVICE=1 "
        "ZINF_TEST_STRICT_SEED=%llu\n",
        static_cast<unsigned long long>(seed_), static_cast<unsigned long long>(seed_));
  }

 private:
  const uint64_t seed_;
};

inline const StrictDeviceSetting& StrictDevice() {
  static const StrictDeviceSetting setting = [] {
    StrictDeviceSetting s = ReadStrictDeviceSetting();
    if (s.on) {
      // (To stderr: stdout may be the test list that ctest's discovery parses.)
      std::fprintf(stderr, "[strict host device] on, seed %llu\n",
                   static_cast<unsigned long long>(s.seed));
      ::testing::UnitTest::GetInstance()->listeners().Append(new StrictSeedPrinter(s.seed));
    }
    return s;
  }();
  return setting;
}

// Read once at start-up (so the seed is printed before the first test runs).
inline const bool kStrictDeviceRead = (StrictDevice(), true);

// A host device with `options`, strict when the suite runs strict. Every device of a process
// gets its own seed derived from the run's seed and the number of devices made before it.
inline std::unique_ptr<Device> NewTestHostDevice(HostDeviceOptions options = {}) {
  static std::atomic<uint64_t> made{0};
  const StrictDeviceSetting& s = StrictDevice();
  options.strict = s.on;
  options.strict_seed = s.seed + 0x51ED270B27F1D9ull * made.fetch_add(1);
  return NewHostDevice(options);
}

// Makes what the compute stream produced (Acquire's buffers, after the engine's waits)
// readable by host code: a no-op outside strict mode, where the compute stream is the caller.
inline Status HostReadable(Device* device) {
  return device->SynchronizeStream(device->ComputeStream());
}

}  // namespace testing
}  // namespace zinf
