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

struct Flags {
  size_t mib = 1024;
  int iters = 5;
  int device_index = 0;
  std::string nvme;
  size_t chunk_mib = 64;
};

// What every measurement shares: its sizes, the device with a stream and `bytes` of device
// memory, and `bytes` of pinned memory in an arena registered with the device.
struct GpuBench {
  size_t bytes = 0;
  size_t chunk = 0;  // the NVMe -> GPU pipeline's chunk
  int iters = 0;
  std::unique_ptr<Device> device;
  Stream* stream = nullptr;
  void* dev = nullptr;
  std::unique_ptr<PinnedArena> arena;
  MemoryRegion region;
  PinnedBuffer pinned;
};

GpuBench OpenGpuBench(const Flags& f) {
  GpuBench b;
  b.bytes = f.mib << 20;
  b.chunk = std::min(f.chunk_mib, f.mib) << 20;
  b.iters = f.iters;
  CudaDeviceOptions device_options;
  device_options.device = f.device_index;
  device_options.memory_budget = b.bytes + (64u << 20);
  auto device_or = NewCudaDevice(device_options);
  if (!device_or.ok()) Die(device_or.status(), "NewCudaDevice");
  b.device = std::move(*device_or);
  std::fprintf(stderr, "device: %s\n", b.device->Name().c_str());
  auto stream_or = b.device->CreateStream("bench");
  if (!stream_or.ok()) Die(stream_or.status(), "CreateStream");
  b.stream = *stream_or;
  auto dev_or = b.device->Alloc(b.bytes);
  if (!dev_or.ok()) Die(dev_or.status(), "Alloc");
  b.dev = *dev_or;

  // Pinned: the arena registered with CUDA, like the engine's.
  PinnedArenaOptions arena_options;
  arena_options.bytes = b.bytes + 2 * b.chunk;
  auto arena_or = PinnedArena::Create(arena_options);
  if (!arena_or.ok()) Die(arena_or.status(), "PinnedArena::Create");
  b.arena = std::move(*arena_or);
  b.region = b.arena->region();
  BENCH_CHECK(b.device->RegisterHostMemory(b.region.base, b.region.len), "RegisterHostMemory");
  auto pinned_or = b.arena->Allocate(b.bytes);
  if (!pinned_or.ok()) Die(pinned_or.status(), "arena Allocate");
  b.pinned = std::move(*pinned_or);
  std::memset(b.pinned.data(), 0x5a, b.bytes);
  return b;
}

// One direction at a time, pinned and pageable.
void MeasureCopies(GpuBench& b) {
  std::vector<unsigned char> pageable(b.bytes, 0x33);
  Device* device = b.device.get();
  struct Case {
    const char* direction;
    const char* memory;
    std::function<Status()> copy;
  };
  std::vector<Case> cases = {
      {"h2d", "pinned",
       [&] { return device->CopyHostToDevice(b.dev, b.pinned.data(), b.bytes, b.stream); }},
      {"d2h", "pinned",
       [&] { return device->CopyDeviceToHost(b.pinned.data(), b.dev, b.bytes, b.stream); }},
      {"h2d", "pageable",
       [&] { return device->CopyHostToDevice(b.dev, pageable.data(), b.bytes, b.stream); }},
      {"d2h", "pageable",
       [&] { return device->CopyDeviceToHost(pageable.data(), b.dev, b.bytes, b.stream); }},
  };
  for (const Case& c : cases) {
    auto [best, mean] = TimeCopies(device, b.stream, b.bytes, b.iters, c.copy);
    Emit({{"bench", "copy"},
          {"direction", c.direction},
          {"memory", c.memory},
          {"bytes", b.bytes},
          {"iters", b.iters},
          {"gbps_best", best},
          {"gbps_mean", mean}});
  }
}

// Both directions at once on two streams (PCIe / NVLink-C2C is full duplex), pinned: the
// arena's first half up, the device buffer's second half down.
void MeasureBidirectional(GpuBench& b) {
  Device* device = b.device.get();
  auto up_or = device->CreateStream("bench-up");
  if (!up_or.ok()) Die(up_or.status(), "CreateStream");
  const size_t half = b.bytes / 2;
  auto* host = static_cast<unsigned char*>(b.pinned.data());
  auto* d = static_cast<unsigned char*>(b.dev);
  double best = 0;
  for (int i = 0; i < b.iters; ++i) {
    const auto t0 = Clock::now();
    BENCH_CHECK(device->CopyHostToDevice(d, host, half, *up_or), "h2d");
    BENCH_CHECK(device->CopyDeviceToHost(host + half, d + half, half, b.stream), "d2h");
    BENCH_CHECK(device->SynchronizeStream(*up_or), "sync");
    BENCH_CHECK(device->SynchronizeStream(b.stream), "sync");
    best = std::max(best, static_cast<double>(2 * half) / Since(t0) / 1e9);
  }
  Emit({{"bench", "copy"},
        {"direction", "bidirectional"},
        {"memory", "pinned"},
        {"bytes", 2 * half},
        {"iters", b.iters},
        {"gbps_best", best}});
}

std::string ChunkName(size_t i) { return "gpu-bench-" + std::to_string(i); }

// The tensor as chunks, so the pipeline can read one while the previous is copied.
size_t ChunkCount(const GpuBench& b) { return (b.bytes + b.chunk - 1) / b.chunk; }

// Writes the pinned buffer to the store, one key per chunk, and flushes.
void WriteChunks(GpuBench& b, SwapStore& store) {
  const size_t chunks = ChunkCount(b);
  auto* host = static_cast<unsigned char*>(b.pinned.data());
  std::vector<Ticket> tickets;
  for (size_t i = 0; i < chunks; ++i) {
    const size_t len = std::min(b.chunk, b.bytes - i * b.chunk);
    auto t = store.Write(ChunkName(i), host + i * b.chunk, len, b.chunk);
    if (!t.ok()) Die(t.status(), "SwapStore::Write");
    tickets.push_back(*t);
  }
  for (Ticket t : tickets) BENCH_CHECK(store.Wait(t), "write");
  BENCH_CHECK(store.Flush(), "Flush");
}

// Serial: read everything into the arena, then one copy.
void MeasureSerialNvmeToGpu(GpuBench& b, SwapStore& store) {
  Device* device = b.device.get();
  const size_t bytes = b.bytes;
  const size_t chunks = ChunkCount(b);
  auto* host = static_cast<unsigned char*>(b.pinned.data());
  std::vector<Ticket> tickets;
  double best_read = 0, best_h2d = 0, best_total = 0;
  for (int it = 0; it < b.iters; ++it) {
    const auto t0 = Clock::now();
    tickets.clear();
    for (size_t i = 0; i < chunks; ++i) {
      auto t = store.Read(ChunkName(i), host + i * b.chunk, b.chunk);
      if (!t.ok()) Die(t.status(), "SwapStore::Read");
      tickets.push_back(*t);
    }
    for (Ticket t : tickets) BENCH_CHECK(store.Wait(t), "read");
    const double read_s = Since(t0);
    const auto t1 = Clock::now();
    BENCH_CHECK(device->CopyHostToDevice(b.dev, host, bytes, b.stream), "h2d");
    BENCH_CHECK(device->SynchronizeStream(b.stream), "sync");
    const double h2d_s = Since(t1);
    best_read = std::max(best_read, bytes / read_s / 1e9);
    best_h2d = std::max(best_h2d, bytes / h2d_s / 1e9);
    best_total = std::max(best_total, bytes / (read_s + h2d_s) / 1e9);
  }
  Emit({{"bench", "nvme_to_gpu"},
        {"mode", "serial"},
        {"bytes", bytes},
        {"iters", b.iters},
        {"nvme_read_gbps_best", best_read},
        {"h2d_gbps_best", best_h2d},
        {"end_to_end_gbps_best", best_total}});
}

// Pipelined: two staging chunks of the arena; chunk i+1 is read while chunk i is copied.
void MeasurePipelinedNvmeToGpu(GpuBench& b, SwapStore& store) {
  Device* device = b.device.get();
  const size_t bytes = b.bytes;
  const size_t chunk = b.chunk;
  const size_t chunks = ChunkCount(b);
  auto stage0 = b.arena->Allocate(chunk);
  auto stage1 = b.arena->Allocate(chunk);
  if (!stage0.ok() || !stage1.ok()) Die(stage0.status(), "arena Allocate (staging)");
  unsigned char* stage[2] = {static_cast<unsigned char*>(stage0->data()),
                             static_cast<unsigned char*>(stage1->data())};
  auto copied = device->CreateEvent();
  auto copied_other = device->CreateEvent();
  if (!copied.ok() || !copied_other.ok()) Die(copied.status(), "CreateEvent");
  Event* done[2] = {copied->get(), copied_other->get()};
  double best_pipe = 0;
  for (int it = 0; it < b.iters; ++it) {
    const auto t0 = Clock::now();
    auto read = [&](size_t i) {
      auto t = store.Read(ChunkName(i), stage[i % 2], chunk);
      if (!t.ok()) Die(t.status(), "SwapStore::Read");
      return *t;
    };
    Ticket next = read(0);
    for (size_t i = 0; i < chunks; ++i) {
      BENCH_CHECK(store.Wait(next), "read");
      const size_t len = std::min(chunk, bytes - i * chunk);
      BENCH_CHECK(device->CopyHostToDevice(static_cast<unsigned char*>(b.dev) + i * chunk,
                                           stage[i % 2], len, b.stream),
                  "h2d");
      BENCH_CHECK(device->RecordEvent(done[i % 2], b.stream), "RecordEvent");
      if (i + 1 < chunks) {
        // The other staging chunk is free once its previous copy is done.
        BENCH_CHECK(device->SynchronizeEvent(done[(i + 1) % 2]), "SynchronizeEvent");
        next = read(i + 1);
      }
    }
    BENCH_CHECK(device->SynchronizeStream(b.stream), "sync");
    best_pipe = std::max(best_pipe, bytes / Since(t0) / 1e9);
  }
  Emit({{"bench", "nvme_to_gpu"},
        {"mode", "pipelined"},
        {"bytes", bytes},
        {"chunk_bytes", chunk},
        {"iters", b.iters},
        {"end_to_end_gbps_best", best_pipe}});
}

// NVMe -> GPU through a SwapStore in `folder`, which registers the pinned arena.
void MeasureNvmeToGpu(GpuBench& b, const std::string& folder) {
  SwapStoreOptions swap_options;
  swap_options.paths = {folder};
  swap_options.registered_regions = {b.region};
  auto store_or = SwapStore::Open(swap_options);
  if (!store_or.ok()) Die(store_or.status(), "SwapStore::Open " + folder);
  std::unique_ptr<SwapStore> store = std::move(*store_or);
  std::fprintf(stderr, "swap store: %s, direct I/O %s\n", store->backend_features().c_str(),
               store->direct_io() ? "on" : "off (numbers include the page cache)");
  WriteChunks(b, *store);
  MeasureSerialNvmeToGpu(b, *store);
  MeasurePipelinedNvmeToGpu(b, *store);
  // A chunk left behind only costs scratch space; Close reports what matters.
  for (size_t i = 0; i < ChunkCount(b); ++i) (void)store->Remove(ChunkName(i));
  BENCH_CHECK(store->Close(), "SwapStore::Close");
}

int Main(int argc, char** argv) {
  CLI::App app{"zinf-gpu-bench: host<->GPU and NVMe->GPU bandwidth through CudaDevice"};
  Flags f;
  app.add_option("--mib", f.mib, "bytes per copy, in MiB (default 1024)")
      ->check(CLI::Range(1, 1 << 20));
  app.add_option("--iters", f.iters, "timed repetitions")->check(CLI::Range(1, 1000));
  app.add_option("--device", f.device_index, "CUDA device ordinal")->check(CLI::Range(0, 1023));
  app.add_option("--nvme", f.nvme, "a folder on the NVMe to measure; empty: skip NVMe -> GPU");
  app.add_option("--chunk-mib", f.chunk_mib, "pipeline chunk for NVMe -> GPU")
      ->check(CLI::Range(1, 4096));
  if (int rc = ParseCommandLine(app, argc, argv); rc >= 0) return rc;

  if (CudaDeviceCount() == 0) {
    std::fprintf(stderr, "zinf-gpu-bench: no CUDA device visible\n");
    return 2;
  }
  GpuBench b = OpenGpuBench(f);
  MeasureCopies(b);
  MeasureBidirectional(b);
  if (!f.nvme.empty()) {
    MeasureNvmeToGpu(b, f.nvme);
  } else {
    std::fprintf(stderr, "NVMe -> GPU skipped (no --nvme folder)\n");
  }

  b.pinned.Reset();
  BENCH_CHECK(b.device->UnregisterHostMemory(b.region.base), "UnregisterHostMemory");
  b.device->Free(b.dev);
  return 0;
}

}  // namespace
}  // namespace zinf

int main(int argc, char** argv) { return zinf::Main(argc, argv); }
