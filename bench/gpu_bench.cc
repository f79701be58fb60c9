// zinf-gpu-bench: host <-> GPU copy bandwidth through the CudaDevice seam, pinned (a
// PinnedArena registered with RegisterHostMemory, as the engine does) against pageable
// memory, and NVMe -> GPU: a SwapStore tensor read into the registered arena, then copied to
// the device, serially and as a chunked double-buffered pipeline (read chunk i+1 while chunk i
// is copied).
//
// One JSON line per measurement on stdout; notes on stderr. Exits 2 without a CUDA device.
#include <CLI/CLI.hpp>
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "common/cli.h"
#include "zinf/cuda.h"
#include "zinf/device.h"
#include "zinf/log.h"
#include "zinf/swap.h"

namespace zinf {
namespace {

using Clock = std::chrono::steady_clock;
using nlohmann::json;

double Since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

void Emit(json j) {
  std::printf("%s\n", j.dump().c_str());
  std::fflush(stdout);
}

[[noreturn]] void Die(const Status& s, const std::string& what) {
  std::fprintf(stderr, "zinf-gpu-bench: %s: %s\n", what.c_str(), s.ToString().c_str());
  std::exit(1);
}

#define BENCH_CHECK(expr, what)              \
  do {                                       \
    ::zinf::Status bench_s_ = (expr);        \
    if (!bench_s_.ok()) Die(bench_s_, what); \
  } while (0)

// Times `iters` runs of `copy` (enqueue + synchronize); returns {best, mean} GB/s.
std::pair<double, double> TimeCopies(Device* device, Stream* stream, size_t bytes, int iters,
                                     const std::function<Status()>& copy) {
  BENCH_CHECK(copy(), "warm-up copy");
  BENCH_CHECK(device->SynchronizeStream(stream), "warm-up sync");
  double best = 0, total = 0;
  for (int i = 0; i < iters; ++i) {
    const auto t0 = Clock::now();
    BENCH_CHECK(copy(), "copy");
    BENCH_CHECK(device->SynchronizeStream(stream), "sync");
    const double gbps = static_cast<double>(bytes) / Since(t0) / 1e9;
    best = std::max(best, gbps);
    total += gbps;
  }
  return {best, total / iters};
}

int Main(int argc, char** argv) {
  CLI::App app{"zinf-gpu-bench: host<->GPU and NVMe->GPU bandwidth through CudaDevice"};
  size_t mib = 1024;
  int iters = 5;
  int device_index = 0;
  std::string nvme;
  size_t chunk_mib = 64;
  app.add_option("--mib", mib, "bytes per copy, in MiB (default 1024)")
      ->check(CLI::Range(1, 1 << 20));
  app.add_option("--iters", iters, "timed repetitions")->check(CLI::Range(1, 1000));
  app.add_option("--device", device_index, "CUDA device ordinal")->check(CLI::Range(0, 1023));
  app.add_option("--nvme", nvme, "a folder on the NVMe to measure; empty: skip NVMe -> GPU");
  app.add_option("--chunk-mib", chunk_mib, "pipeline chunk for NVMe -> GPU")
      ->check(CLI::Range(1, 4096));
  if (int rc = ParseCommandLine(app, argc, argv); rc >= 0) return rc;
  const size_t bytes = mib << 20;
  chunk_mib = std::min(chunk_mib, mib);
  const size_t chunk = chunk_mib << 20;

  if (CudaDeviceCount() == 0) {
    std::fprintf(stderr, "zinf-gpu-bench: no CUDA device visible\n");
    return 2;
  }
  CudaDeviceOptions device_options;
  device_options.device = device_index;
  device_options.memory_budget = bytes + (64u << 20);
  auto device_or = NewCudaDevice(device_options);
  if (!device_or.ok()) Die(device_or.status(), "NewCudaDevice");
  std::unique_ptr<Device> device = std::move(*device_or);
  std::fprintf(stderr, "device: %s\n", device->Name().c_str());
  auto stream_or = device->CreateStream("bench");
  if (!stream_or.ok()) Die(stream_or.status(), "CreateStream");
  Stream* stream = *stream_or;
  auto dev_or = device->Alloc(bytes);
  if (!dev_or.ok()) Die(dev_or.status(), "Alloc");
  void* dev = *dev_or;

  // Pinned: the arena registered with CUDA, like the engine's.
  PinnedArenaOptions arena_options;
  arena_options.bytes = bytes + 2 * chunk;
  auto arena_or = PinnedArena::Create(arena_options);
  if (!arena_or.ok()) Die(arena_or.status(), "PinnedArena::Create");
  std::unique_ptr<PinnedArena> arena = std::move(*arena_or);
  const MemoryRegion region = arena->region();
  BENCH_CHECK(device->RegisterHostMemory(region.base, region.len), "RegisterHostMemory");
  auto pinned_or = arena->Allocate(bytes);
  if (!pinned_or.ok()) Die(pinned_or.status(), "arena Allocate");
  PinnedBuffer pinned = std::move(*pinned_or);
  std::memset(pinned.data(), 0x5a, bytes);

  std::vector<unsigned char> pageable(bytes, 0x33);

  struct Case {
    const char* direction;
    const char* memory;
    std::function<Status()> copy;
  };
  std::vector<Case> cases = {
      {"h2d", "pinned",
       [&] { return device->CopyHostToDevice(dev, pinned.data(), bytes, stream); }},
      {"d2h", "pinned",
       [&] { return device->CopyDeviceToHost(pinned.data(), dev, bytes, stream); }},
      {"h2d", "pageable",
       [&] { return device->CopyHostToDevice(dev, pageable.data(), bytes, stream); }},
      {"d2h", "pageable",
       [&] { return device->CopyDeviceToHost(pageable.data(), dev, bytes, stream); }},
  };
  for (const Case& c : cases) {
    auto [best, mean] = TimeCopies(device.get(), stream, bytes, iters, c.copy);
    Emit({{"bench", "copy"},
          {"direction", c.direction},
          {"memory", c.memory},
          {"bytes", bytes},
          {"iters", iters},
          {"gbps_best", best},
          {"gbps_mean", mean}});
  }

  // Both directions at once on two streams (PCIe / NVLink-C2C is full duplex), pinned: the
  // arena's first half up, the device buffer's second half down.
  {
    auto up_or = device->CreateStream("bench-up");
    if (!up_or.ok()) Die(up_or.status(), "CreateStream");
    const size_t half = bytes / 2;
    auto* host = static_cast<unsigned char*>(pinned.data());
    auto* d = static_cast<unsigned char*>(dev);
    double best = 0;
    for (int i = 0; i < iters; ++i) {
      const auto t0 = Clock::now();
      BENCH_CHECK(device->CopyHostToDevice(d, host, half, *up_or), "h2d");
      BENCH_CHECK(device->CopyDeviceToHost(host + half, d + half, half, stream), "d2h");
      BENCH_CHECK(device->SynchronizeStream(*up_or), "sync");
      BENCH_CHECK(device->SynchronizeStream(stream), "sync");
      best = std::max(best, static_cast<double>(2 * half) / Since(t0) / 1e9);
    }
    Emit({{"bench", "copy"},
          {"direction", "bidirectional"},
          {"memory", "pinned"},
          {"bytes", 2 * half},
          {"iters", iters},
          {"gbps_best", best}});
  }

  if (!nvme.empty()) {
    SwapStoreOptions swap_options;
    swap_options.paths = {nvme};
    swap_options.registered_regions = {region};
    auto store_or = SwapStore::Open(swap_options);
    if (!store_or.ok()) Die(store_or.status(), "SwapStore::Open " + nvme);
    std::unique_ptr<SwapStore> store = std::move(*store_or);
    std::fprintf(stderr, "swap store: %s, direct I/O %s\n", store->backend_features().c_str(),
                 store->direct_io() ? "on" : "off (numbers include the page cache)");
    // The tensor as chunks, so the pipeline can read one while the previous is copied.
    const size_t chunks = (bytes + chunk - 1) / chunk;
    auto* host = static_cast<unsigned char*>(pinned.data());
    std::vector<Ticket> tickets;
    for (size_t i = 0; i < chunks; ++i) {
      const size_t len = std::min(chunk, bytes - i * chunk);
      auto t = store->Write("gpu-bench-" + std::to_string(i), host + i * chunk, len, chunk);
      if (!t.ok()) Die(t.status(), "SwapStore::Write");
      tickets.push_back(*t);
    }
    for (Ticket t : tickets) BENCH_CHECK(store->Wait(t), "write");
    BENCH_CHECK(store->Flush(), "Flush");

    // Serial: read everything into the arena, then one copy.
    double best_read = 0, best_h2d = 0, best_total = 0;
    for (int it = 0; it < iters; ++it) {
      const auto t0 = Clock::now();
      tickets.clear();
      for (size_t i = 0; i < chunks; ++i) {
        auto t = store->Read("gpu-bench-" + std::to_string(i), host + i * chunk, chunk);
        if (!t.ok()) Die(t.status(), "SwapStore::Read");
        tickets.push_back(*t);
      }
      for (Ticket t : tickets) BENCH_CHECK(store->Wait(t), "read");
      const double read_s = Since(t0);
      const auto t1 = Clock::now();
      BENCH_CHECK(device->CopyHostToDevice(dev, host, bytes, stream), "h2d");
      BENCH_CHECK(device->SynchronizeStream(stream), "sync");
      const double h2d_s = Since(t1);
      best_read = std::max(best_read, bytes / read_s / 1e9);
      best_h2d = std::max(best_h2d, bytes / h2d_s / 1e9);
      best_total = std::max(best_total, bytes / (read_s + h2d_s) / 1e9);
    }
    Emit({{"bench", "nvme_to_gpu"},
          {"mode", "serial"},
          {"bytes", bytes},
          {"iters", iters},
          {"nvme_read_gbps_best", best_read},
          {"h2d_gbps_best", best_h2d},
          {"end_to_end_gbps_best", best_total}});

    // Pipelined: two staging chunks of the arena; chunk i+1 is read while chunk i is copied.
    auto stage0 = arena->Allocate(chunk);
    auto stage1 = arena->Allocate(chunk);
    if (!stage0.ok() || !stage1.ok()) Die(stage0.status(), "arena Allocate (staging)");
    unsigned char* stage[2] = {static_cast<unsigned char*>(stage0->data()),
                               static_cast<unsigned char*>(stage1->data())};
    auto copied = device->CreateEvent();
    auto copied_other = device->CreateEvent();
    if (!copied.ok() || !copied_other.ok()) Die(copied.status(), "CreateEvent");
    Event* done[2] = {copied->get(), copied_other->get()};
    double best_pipe = 0;
    for (int it = 0; it < iters; ++it) {
      const auto t0 = Clock::now();
      auto read = [&](size_t i) {
        auto t = store->Read("gpu-bench-" + std::to_string(i), stage[i % 2], chunk);
        if (!t.ok()) Die(t.status(), "SwapStore::Read");
        return *t;
      };
      Ticket next = read(0);
      for (size_t i = 0; i < chunks; ++i) {
        BENCH_CHECK(store->Wait(next), "read");
        const size_t len = std::min(chunk, bytes - i * chunk);
        BENCH_CHECK(device->CopyHostToDevice(static_cast<unsigned char*>(dev) + i * chunk,
                                             stage[i % 2], len, stream),
                    "h2d");
        BENCH_CHECK(device->RecordEvent(done[i % 2], stream), "RecordEvent");
        if (i + 1 < chunks) {
          // The other staging chunk is free once its previous copy is done.
          BENCH_CHECK(device->SynchronizeEvent(done[(i + 1) % 2]), "SynchronizeEvent");
          next = read(i + 1);
        }
      }
      BENCH_CHECK(device->SynchronizeStream(stream), "sync");
      best_pipe = std::max(best_pipe, bytes / Since(t0) / 1e9);
    }
    Emit({{"bench", "nvme_to_gpu"},
          {"mode", "pipelined"},
          {"bytes", bytes},
          {"chunk_bytes", chunk},
          {"iters", iters},
          {"end_to_end_gbps_best", best_pipe}});
    for (size_t i = 0; i < chunks; ++i) (void)store->Remove("gpu-bench-" + std::to_string(i));
    BENCH_CHECK(store->Close(), "SwapStore::Close");
  } else {
    std::fprintf(stderr, "NVMe -> GPU skipped (no --nvme folder)\n");
  }

  pinned.Reset();
  BENCH_CHECK(device->UnregisterHostMemory(region.base), "UnregisterHostMemory");
  device->Free(dev);
  return 0;
}

}  // namespace
}  // namespace zinf

int main(int argc, char** argv) { return zinf::Main(argc, argv); }
