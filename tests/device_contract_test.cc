// The Device contract (include/zinf/device.h), one suite run against every backend built:
// the host device, the host device in strict mode, the fault-injecting wrapper with no fault
// armed, and, in device_contract_cuda_test (label gpu), a CudaDevice when a GPU is visible
// (ggml's test-backend-ops is the model). What the engine relies on of a device is checked
// here once; the backends' own tests keep only what is theirs (the host device's link cap and
// strict-mode specifics, CUDA's pageable copies and NCCL).
#include <gtest/gtest.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cfloat>
#include <chrono>
#include <cmath>
#include <cstring>
#include <functional>
#include <future>
#include <limits>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "tests/device_test_util.h"
#include "tests/faulty_device.h"
#include "zinf/cpu_adam.h"
#include "zinf/device.h"
#ifdef ZINF_CONTRACT_CUDA
#include "zinf/cuda.h"
#endif

namespace zinf {
namespace {

constexpr size_t kMiB = size_t{1} << 20;
constexpr size_t kBudget = 64 * kMiB;

uint32_t Bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  return u;
}

struct Backend {
  std::string name;
  std::function<Result<std::unique_ptr<Device>>()> make;
  std::string skip;  // why it cannot run here ("" when it can)
};

std::vector<Backend> Backends() {
  std::vector<Backend> out;
#ifdef ZINF_CONTRACT_CUDA
  Backend cuda{"cuda",
               [] {
                 CudaDeviceOptions o;
                 o.memory_budget = kBudget;
                 return NewCudaDevice(o);
               },
               ""};
  if (CudaDeviceCount() == 0) {
    cuda.skip =
        "no CUDA device visible (built without CUDA, no driver, or CUDA_VISIBLE_DEVICES "
        "hides every GPU)";
  }
  out.push_back(cuda);
#else
  auto host = [](bool strict) {
    return [strict]() -> Result<std::unique_ptr<Device>> {
      HostDeviceOptions o;
      o.memory_budget = kBudget;
      o.strict = strict;
      o.strict_seed = 20261204;
      return NewHostDevice(o);
    };
  };
  out.push_back({"host", host(false), ""});
  out.push_back({"host_strict", host(true), ""});
  out.push_back({"faulty_host",
                 []() -> Result<std::unique_ptr<Device>> {
                   HostDeviceOptions o;
                   o.memory_budget = kBudget;
                   return std::unique_ptr<Device>(new testing::FaultyDevice(NewHostDevice(o)));
                 },
                 ""});
#endif
  return out;
}

class DeviceContract : public ::testing::TestWithParam<Backend> {
 protected:
  void SetUp() override {
    if (!GetParam().skip.empty()) GTEST_SKIP() << GetParam().skip;
    Result<std::unique_ptr<Device>> d = GetParam().make();
    ASSERT_TRUE(d.ok()) << d.status().ToString();
    device_ = std::move(d).value();
    Result<Stream*> s = device_->CreateStream("contract");
    ASSERT_TRUE(s.ok()) << s.status().ToString();
    stream_ = *s;
    buffers_.Reset(device_.get(), stream_);
  }
  template <typename T>
  T* Buffer(size_t n) {
    return buffers_.Buffer<T>(n);
  }
  template <typename T>
  T* Upload(const std::vector<T>& host) {
    return buffers_.Upload(host);
  }
  template <typename T>
  std::vector<T> Download(const T* d, size_t n) {
    return buffers_.Download(d, n);
  }

  std::unique_ptr<Device> device_;
  Stream* stream_ = nullptr;
  testing::DeviceBuffers buffers_;  // after device_: freed before it goes
};

using testing::Gate;

TEST_P(DeviceContract, CapabilitiesAreConsistent) {
  const DeviceCaps caps = device_->Caps();
  EXPECT_FALSE(device_->Name().empty());
  EXPECT_EQ(device_->IsHost(), caps.host_memory);
  EXPECT_EQ(device_->ComputeRunsInline(), caps.compute_inline);
  // A device that runs compute inline is a host device.
  if (caps.compute_inline) EXPECT_TRUE(caps.host_memory);
  EXPECT_NE(caps.step_kinds, 0u) << "every backend steps at least Adam/AdamW";
  EXPECT_TRUE(caps.Steps(OptimizerKind::kAdamW));
}

TEST_P(DeviceContract, TheBudgetIsEnforcedAndAccounted) {
  const DeviceMemoryInfo start = device_->MemoryInfo();
  EXPECT_EQ(start.budget, kBudget);
  Result<void*> a = device_->Alloc(8 * kMiB);
  ASSERT_TRUE(a.ok()) << a.status().ToString();
  EXPECT_GE(device_->MemoryInfo().used, start.used + 8 * kMiB);
  Result<void*> too_much = device_->Alloc(kBudget);
  ASSERT_FALSE(too_much.ok());
  EXPECT_EQ(too_much.status().code(), StatusCode::kResourceExhausted)
      << too_much.status().ToString();
  device_->Free(*a);
  EXPECT_EQ(device_->MemoryInfo().used, start.used);
  EXPECT_GE(device_->MemoryInfo().peak, start.used + 8 * kMiB);
}

// TrimMemory gives back the memory no allocation holds (offload_states' way of returning
// device memory to the driver): `committed` drops, what a live allocation holds keeps its
// values, and an allocation after it is backed again and works.
TEST_P(DeviceContract, TrimGivesBackWhatNoAllocationHolds) {
  const DeviceMemoryInfo start = device_->MemoryInfo();
  ASSERT_EQ(start.used, 0u);
  const size_t a_bytes = 40 * kMiB, b_n = 2 * kMiB / 4;  // B: 8 MiB of uint32
  Result<void*> a = device_->Alloc(a_bytes);
  ASSERT_TRUE(a.ok()) << a.status().ToString();
  if (GetParam().name == "host_strict") {
    // Memory never handed out before reads NaN too (the fill when a chunk is backed; the
    // kernel's fresh pages would read 0).
    std::vector<uint32_t> seen = Download(static_cast<const uint32_t*>(*a), a_bytes / 4);
    EXPECT_EQ(std::count(seen.begin(), seen.end(), 0xFFFFFFFFu), static_cast<long>(seen.size()));
  }
  std::vector<uint32_t> pattern(b_n);
  std::mt19937 rng(41);
  for (auto& x : pattern) x = rng();
  uint32_t* b = Upload(pattern);
  const DeviceMemoryInfo held = device_->MemoryInfo();
  EXPECT_GE(held.committed, held.used);
  EXPECT_GE(held.committed, a_bytes + b_n * 4);
  device_->Free(*a);
  EXPECT_EQ(device_->MemoryInfo().committed, held.committed) << "Free alone keeps the memory";
  ASSERT_TRUE(device_->TrimMemory().ok());
  const DeviceMemoryInfo trimmed = device_->MemoryInfo();
  // Every backend here trims (CUDA through the driver's virtual memory management): at least
  // one of its chunks (2 MiB on the host, 32 MiB on CUDA) lay wholly inside A.
  EXPECT_LE(trimmed.committed, held.committed - 32 * kMiB);
  EXPECT_GE(trimmed.committed, trimmed.used);
  if (GetParam().name == "host") {
    // The pages are gone from the process (the host's "driver" is the kernel).
    const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
    std::vector<unsigned char> resident(a_bytes / page);
    ASSERT_EQ(mincore(*a, 32 * kMiB, resident.data()), 0) << std::strerror(errno);
    size_t in = 0;
    for (size_t i = 0; i < 32 * kMiB / page; ++i) in += resident[i] & 1;
    EXPECT_EQ(in, 0u) << "pages of the trimmed buffer still resident";
  }
  EXPECT_EQ(Download(b, b_n), pattern) << "a live allocation kept its values";
  // Backed again on demand.
  uint32_t* fresh = Buffer<uint32_t>(a_bytes / 4);
  ASSERT_NE(fresh, nullptr);
  if (GetParam().name == "host_strict") {
    // Memory backed again reads NaN until written, as a freed buffer does.
    std::vector<uint32_t> seen = Download(fresh, a_bytes / 4);
    EXPECT_EQ(std::count(seen.begin(), seen.end(), 0xFFFFFFFFu), static_cast<long>(seen.size()));
  }
  std::vector<uint32_t> again(a_bytes / 4);
  for (auto& x : again) x = rng();
  ASSERT_TRUE(device_->CopyHostToDevice(fresh, again.data(), a_bytes, stream_).ok());
  EXPECT_EQ(Download(fresh, again.size()), again);
  const DeviceMemoryInfo last = device_->MemoryInfo();
  EXPECT_GE(last.committed, last.used);
  EXPECT_GE(last.committed, a_bytes + b_n * 4);
}

// Copies on one stream run in issue order: host -> device, device -> device, device -> host
// give back the bytes, with a later copy into a buffer seeing the earlier one's data.
TEST_P(DeviceContract, CopiesRoundTripInStreamOrder) {
  const size_t n = 1 << 20;
  std::vector<uint32_t> a(n), b(n);
  std::mt19937 rng(3);
  for (auto& x : a) x = rng();
  for (auto& x : b) x = rng();
  uint32_t* d1 = Upload(a);
  uint32_t* d2 = Buffer<uint32_t>(n);
  ASSERT_TRUE(device_->CopyDeviceToDevice(d2, d1, n * 4, stream_).ok());
  // Overwrite the source after the device copy was issued: the copy saw the first data.
  ASSERT_TRUE(device_->CopyHostToDevice(d1, b.data(), n * 4, stream_).ok());
  EXPECT_EQ(Download(d2, n), a);
  EXPECT_EQ(Download(d1, n), b);
  // A zero-byte copy is nothing to do.
  EXPECT_TRUE(device_->CopyDeviceToDevice(nullptr, nullptr, 0, stream_).ok());
}

// A host function runs after the work before it on its stream, and the work after it waits
// for it to return (cudaLaunchHostFunc's contract).
TEST_P(DeviceContract, AHostFunctionIsOrderedOnItsStream) {
  std::atomic<int> order{0};
  int first = -1, second = -1;
  ASSERT_TRUE(device_->LaunchHostFunc(stream_, [&] { first = order++; }).ok());
  ASSERT_TRUE(device_->LaunchHostFunc(stream_, [&] { second = order++; }).ok());
  ASSERT_TRUE(device_->SynchronizeStream(stream_).ok());
  EXPECT_EQ(first, 0);
  EXPECT_EQ(second, 1);
}

// An event orders work across streams: work queued on B after StreamWaitEvent waits for what
// A had queued before the event; the event is not done while A is held.
TEST_P(DeviceContract, AnEventOrdersWorkAcrossStreams) {
  Result<Stream*> b = device_->CreateStream("contract-b");
  ASSERT_TRUE(b.ok());
  Result<std::unique_ptr<Event>> ev = device_->CreateEvent();
  ASSERT_TRUE(ev.ok());
  Gate gate;
  std::atomic<bool> ran{false};
  ASSERT_TRUE(device_->LaunchHostFunc(stream_, gate.Task()).ok());
  ASSERT_TRUE(device_->RecordEvent(ev->get(), stream_).ok());
  ASSERT_TRUE(device_->StreamWaitEvent(*b, ev->get()).ok());
  ASSERT_TRUE(device_->LaunchHostFunc(*b, [&] { ran = true; }).ok());
  std::this_thread::sleep_for(std::chrono::milliseconds(20));
  EXPECT_FALSE(device_->EventDone(ev->get()));
  EXPECT_FALSE(ran.load());
  gate.Open();
  ASSERT_TRUE(device_->SynchronizeEvent(ev->get()).ok());
  EXPECT_TRUE(device_->EventDone(ev->get()));
  ASSERT_TRUE(device_->SynchronizeStream(*b).ok());
  EXPECT_TRUE(ran.load());
  // A never recorded event counts as completed.
  Result<std::unique_ptr<Event>> fresh = device_->CreateEvent();
  ASSERT_TRUE(fresh.ok());
  EXPECT_TRUE(device_->EventDone(fresh->get()));
  EXPECT_TRUE(device_->StreamWaitEvent(stream_, fresh->get()).ok());
  EXPECT_TRUE(device_->SynchronizeEvent(fresh->get()).ok());
}

TEST_P(DeviceContract, SynchronizeStreamWaitsForEverythingQueued) {
  Gate gate;
  std::atomic<int> done{0};
  ASSERT_TRUE(device_->LaunchHostFunc(stream_, gate.Task()).ok());
  for (int i = 0; i < 8; ++i) ASSERT_TRUE(device_->LaunchHostFunc(stream_, [&] { ++done; }).ok());
  std::thread opener([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    gate.Open();
  });
  ASSERT_TRUE(device_->SynchronizeStream(stream_).ok());
  EXPECT_EQ(done.load(), 8);
  opener.join();
}

TEST_P(DeviceContract, ArgumentErrorsAreRefusedAtTheCall) {
  void* d = Buffer<char>(16);
  char host[16] = {};
  EXPECT_EQ(device_->CopyHostToDevice(d, host, 16, nullptr).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(device_->CopyHostToDevice(nullptr, host, 16, stream_).code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(device_->CopyDeviceToHost(host, nullptr, 16, stream_).code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(device_->LaunchHostFunc(stream_, nullptr).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(device_->RecordEvent(nullptr, stream_).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(device_->ConvertToBf16(nullptr, nullptr, 4, stream_).code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(device_->AddInto(nullptr, static_cast<float*>(d), 4, stream_).code(),
            StatusCode::kInvalidArgument);
  GradStats stats;
  EXPECT_EQ(device_->SumSquares(nullptr, 4, &stats, stream_).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(device_->SumSquares(static_cast<float*>(d), 4, nullptr, stream_).code(),
            StatusCode::kInvalidArgument);
  // A stream of another device is not this device's.
  Result<std::unique_ptr<Device>> other = GetParam().make();
  ASSERT_TRUE(other.ok());
  Result<Stream*> foreign = (*other)->CreateStream("foreign");
  ASSERT_TRUE(foreign.ok());
  EXPECT_EQ(device_->CopyHostToDevice(d, host, 16, *foreign).code(), StatusCode::kInvalidArgument);
}

// fp32 -> bf16 on the device is the CPU reference's rounding (Fp32ToBf16) on every case:
// ties to even, just above and below, denormals to signed zero, infinities and NaN.
TEST_P(DeviceContract, ConvertToBf16IsTheCpuReference) {
  std::vector<float> in;
  for (uint32_t hi = 0; hi < 65536; hi += 3) {
    for (uint32_t low : {0x0000u, 0x0001u, 0x7fffu, 0x8000u, 0x8001u, 0xffffu}) {
      const uint32_t bits = (hi << 16) | low;
      float f;
      std::memcpy(&f, &bits, sizeof(f));
      in.push_back(f);
    }
  }
  const float* src = Upload(in);
  uint16_t* dst = Buffer<uint16_t>(in.size());
  ASSERT_TRUE(device_->ConvertToBf16(dst, src, in.size(), stream_).ok());
  std::vector<uint16_t> got = Download(dst, in.size());
  for (size_t i = 0; i < in.size(); ++i) ASSERT_EQ(got[i], Fp32ToBf16(in[i])) << "input " << i;
}

// n >= 7 blocks of kB values for the quantization tests: ordinary blocks, then a zero, a tiny
// (below 127 x FLT_MIN), a huge (near FLT_MAX), a NaN, a NaN with a payload and an inf block.
std::vector<float> EveryKindOfBlock(size_t n, size_t kB) {
  std::vector<float> x(n);
  for (size_t i = 0; i < n; ++i) x[i] = std::sin(0.3f * static_cast<float>(i)) * (1 + i % 9);
  for (size_t i = kB; i < 2 * kB; ++i) x[i] = 0.0f;
  for (size_t i = 2 * kB; i < 3 * kB; ++i) x[i] = FLT_MIN * static_cast<float>(i % 5);
  for (size_t i = 3 * kB; i < 4 * kB; ++i) x[i] = (i % 2 ? -FLT_MAX : FLT_MAX) / (1 + i % 3);
  x[4 * kB + 9] = std::numeric_limits<float>::quiet_NaN();
  uint32_t payload = 0xffc12345u;
  std::memcpy(&x[5 * kB + 1], &payload, sizeof(payload));
  x[6 * kB + kB / 2 - 3] = -std::numeric_limits<float>::infinity();
  return x;
}

// Every block size zinf.quantization_block_size takes at its ends and its default.
constexpr size_t kQuantBlocks[] = {kMinQuantBlock, kInt8StateBlock, kMaxQuantBlock};

// The quantized gather's encoding and decoding are the CPU functions' bytes (QuantizeParamsInt8,
// DequantizeParamsInt8) for every dtype and block size, on every kind of block: ordinary, zero,
// tiny (below 127 x FLT_MIN), huge (near FLT_MAX), a NaN (with and without a payload), an inf,
// a failed read's 0xFF bytes (decoding), several blocks and a partial one.
TEST_P(DeviceContract, QuantizeInt8IsTheCpuFunctions) {
  for (size_t kB : kQuantBlocks) {
    SCOPED_TRACE("block " + std::to_string(kB));
    const size_t n = 7 * kB + 45;
    std::vector<float> x = EveryKindOfBlock(n, kB);
    for (ParamCopyType type : {ParamCopyType::kNone, ParamCopyType::kBf16, ParamCopyType::kF16}) {
      SCOPED_TRACE(ParamCopyTypeName(type));
      const size_t elem = type == ParamCopyType::kNone ? 4 : 2;
      std::vector<uint8_t> src(n * elem);
      for (size_t i = 0; i < n; ++i) {
        if (type == ParamCopyType::kNone) {
          std::memcpy(&src[i * 4], &x[i], 4);
        } else {
          const uint16_t v = Fp32ToParamCopy(type, x[i]);
          std::memcpy(&src[i * 2], &v, 2);
        }
      }
      const size_t qbytes = Int8Bytes(n, kB);
      uint8_t* dq = Buffer<uint8_t>(qbytes);
      uint8_t* dback = Buffer<uint8_t>(src.size());
      ASSERT_TRUE(device_->QuantizeInt8(dq, Upload(src), type, n, kB, stream_).ok());
      ASSERT_TRUE(device_->DequantizeInt8(dback, type, dq, n, kB, stream_).ok());
      std::vector<uint8_t> want_q(qbytes), want_back(src.size());
      QuantizeParamsInt8(src.data(), type, n, want_q.data(), kB);
      DequantizeParamsInt8(want_q.data(), n, type, want_back.data(), kB);
      EXPECT_EQ(Download(dq, qbytes), want_q);
      EXPECT_EQ(Download(dback, src.size()), want_back);
      // A failed read's blocks (every byte 0xFF: a NaN scale with a sign and payload) decode to
      // the CPU's NaN bits too.
      std::vector<uint8_t> ff(qbytes, 0xFF), want_ff(src.size());
      DequantizeParamsInt8(ff.data(), n, type, want_ff.data(), kB);
      ASSERT_TRUE(device_->DequantizeInt8(dback, type, Upload(ff), n, kB, stream_).ok());
      EXPECT_EQ(Download(dback, src.size()), want_ff);
    }
  }
  // Misaligned blocks are refused at the call (a misaligned read would stop a GPU's context),
  // as are block sizes a GPU's thread block cannot encode.
  uint8_t* d = Buffer<uint8_t>(1024);
  const ParamCopyType f32 = ParamCopyType::kNone;
  EXPECT_EQ(device_->QuantizeInt8(d + 1, d + 512, f32, 4, 256, stream_).code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(device_->DequantizeInt8(d + 512, f32, d + 2, 4, 256, stream_).code(),
            StatusCode::kInvalidArgument);
  for (size_t bad : {0, 32, 100, 2048}) {
    EXPECT_EQ(device_->QuantizeInt8(d, d + 512, f32, 4, bad, stream_).code(),
              StatusCode::kInvalidArgument)
        << bad;
    EXPECT_EQ(device_->DequantizeInt8(d + 512, f32, d, 4, bad, stream_).code(),
              StatusCode::kInvalidArgument)
        << bad;
  }
}

// The int4 gradient blocks (QuantizeInt4, DequantizeInt4) are the CPU functions' bytes
// (QuantizeGradsInt4, DequantizeGradsInt4) on the same kinds of block and block sizes, ties
// included (a block whose largest magnitude is 7: codes round(x), to even), 0xFF blocks decoding
// to the CPU's NaN.
TEST_P(DeviceContract, QuantizeInt4IsTheCpuFunctions) {
  for (size_t kB : kQuantBlocks) {
    SCOPED_TRACE("block " + std::to_string(kB));
    const size_t n = 8 * kB + 45;
    std::vector<float> x = EveryKindOfBlock(n, kB);
    for (size_t i = 7 * kB; i < 8 * kB; ++i) x[i] = static_cast<float>(i % 15) * 0.5f - 3.5f;
    x[7 * kB] = 7.0f;
    const size_t qbytes = Int4Bytes(n, kB);
    uint8_t* dq = Buffer<uint8_t>(qbytes);
    float* dback = Buffer<float>(n);
    ASSERT_TRUE(device_->QuantizeInt4(dq, Upload(x), n, kB, stream_).ok());
    ASSERT_TRUE(device_->DequantizeInt4(dback, dq, n, kB, stream_).ok());
    std::vector<uint8_t> want_q(qbytes);
    std::vector<float> want_back(n);
    QuantizeGradsInt4(x.data(), n, want_q.data(), kB);
    DequantizeGradsInt4(want_q.data(), n, want_back.data(), kB);
    EXPECT_EQ(Download(dq, qbytes), want_q);
    const std::vector<float> back = Download(dback, n);
    EXPECT_EQ(std::memcmp(back.data(), want_back.data(), n * sizeof(float)), 0);
    std::vector<uint8_t> ff(qbytes, 0xFF);
    DequantizeGradsInt4(ff.data(), n, want_back.data(), kB);
    ASSERT_TRUE(device_->DequantizeInt4(dback, Upload(ff), n, kB, stream_).ok());
    const std::vector<float> nan = Download(dback, n);
    EXPECT_EQ(std::memcmp(nan.data(), want_back.data(), n * sizeof(float)), 0);
  }
  uint8_t* d = Buffer<uint8_t>(1024);
  float* f = reinterpret_cast<float*>(d + 512);
  EXPECT_EQ(device_->QuantizeInt4(d + 1, f, 4, 256, stream_).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(device_->DequantizeInt4(f, d + 2, 4, 256, stream_).code(),
            StatusCode::kInvalidArgument);
  for (size_t bad : {0, 32, 100, 2048}) {
    EXPECT_EQ(device_->QuantizeInt4(d, f, 4, bad, stream_).code(), StatusCode::kInvalidArgument)
        << bad;
    EXPECT_EQ(device_->DequantizeInt4(f, d, 4, bad, stream_).code(), StatusCode::kInvalidArgument)
        << bad;
  }
}

// AddInto is one correctly rounded addition per element (the host's a += b); SumSquares is
// the sum of squares in double, within the rounding of any order of additions, deterministic,
// with the non-finite flag.
TEST_P(DeviceContract, AddIntoAndSumSquares) {
  const size_t n = 200003;
  std::vector<float> a(n), b(n);
  for (size_t i = 0; i < n; ++i) {
    a[i] = std::sin(static_cast<float>(i)) * 3.0f;
    b[i] = std::cos(static_cast<float>(i) * 0.7f) * 1e-3f;
  }
  float* da = Upload(a);
  float* db = Upload(b);
  ASSERT_TRUE(device_->AddInto(da, db, n, stream_).ok());
  GradStats s1, s2;
  ASSERT_TRUE(device_->SumSquares(da, n, &s1, stream_).ok());
  ASSERT_TRUE(device_->SumSquares(da, n, &s2, stream_).ok());
  std::vector<float> got = Download(da, n);
  double exact = 0;
  for (size_t i = 0; i < n; ++i) {
    ASSERT_EQ(Bits(got[i]), Bits(a[i] + b[i])) << i;
    exact += static_cast<double>(got[i]) * got[i];
  }
  EXPECT_NEAR(s1.sum_squares, exact, exact * 1e-12);
  EXPECT_EQ(s1.sum_squares, s2.sum_squares) << "not deterministic";
  EXPECT_FALSE(s1.has_inf_or_nan);
  for (float bad : {std::numeric_limits<float>::infinity(), std::nanf("")}) {
    std::vector<float> c = a;
    c[n / 2] = bad;
    GradStats sc;
    ASSERT_TRUE(device_->SumSquares(Upload(c), n, &sc, stream_).ok());
    ASSERT_TRUE(device_->SynchronizeStream(stream_).ok());
    EXPECT_TRUE(sc.has_inf_or_nan);
  }
}

// The optimizer step is the CPU scalar reference, bit for bit, for every optimizer the device
// says it steps, on fp32 states (and compressed ones where it says so); NotSupported for
// those it does not.
TEST_P(DeviceContract, OptimizerStepIsTheCpuScalarReference) {
  CpuOptimizer::Options cpu_options;
  cpu_options.isa = CpuIsa::kScalar;
  cpu_options.num_threads = 1;
  auto cpu = CpuOptimizer::Create(cpu_options);
  ASSERT_TRUE(cpu.ok()) << cpu.status().ToString();
  const DeviceCaps caps = device_->Caps();
  const size_t n = 40013;
  for (OptimizerKind kind : {OptimizerKind::kAdam, OptimizerKind::kAdamW, OptimizerKind::kAdagrad,
                             OptimizerKind::kLion}) {
    SCOPED_TRACE(OptimizerKindName(kind));
    std::mt19937 rng(static_cast<unsigned>(kind) + 5);
    std::normal_distribution<float> normal(0.0f, 1.0f);
    std::vector<float> param(n), m(n, 0.0f), v(n, 0.0f), grad(n);
    for (float& p : param) p = normal(rng);
    param[1] = 1e-40f;  // subnormal
    float* d_param = Upload(param);
    float* d_m = Upload(m);
    float* d_v = Upload(v);
    float* d_grad = Buffer<float>(n);
    uint16_t* d_copy = Buffer<uint16_t>(n);
    std::vector<uint16_t> copy(n);
    const bool sum_state = kind == OptimizerKind::kAdagrad;
    const bool one_state = kind == OptimizerKind::kLion || sum_state;
    for (int step = 1; step <= 3; ++step) {
      for (float& g : grad) g = normal(rng);
      grad[3] = 0.0f;
      ASSERT_TRUE(device_->CopyHostToDevice(d_grad, grad.data(), n * 4, stream_).ok());
      OptimizerHyperParams hp;
      hp.kind = kind;
      hp.step = step;
      hp.lr = 1e-3f;
      hp.weight_decay = 0.01f;
      hp.grad_scale = 0.5f;
      OptimizerTensors cpu_t;
      cpu_t.param = param.data();
      cpu_t.grad = grad.data();
      cpu_t.grad_type = GradType::kF32;
      if (sum_state) {
        cpu_t.sum = m.data();
      } else {
        cpu_t.exp_avg = m.data();
        if (!one_state) cpu_t.exp_avg_sq = v.data();
      }
      cpu_t.param_copy = copy.data();
      cpu_t.param_copy_type = ParamCopyType::kBf16;
      cpu_t.n = n;
      OptimizerTensors dev_t = cpu_t;
      dev_t.param = d_param;
      dev_t.grad = d_grad;
      if (sum_state) {
        dev_t.sum = d_m;
      } else {
        dev_t.exp_avg = d_m;
        if (!one_state) dev_t.exp_avg_sq = d_v;
      }
      dev_t.param_copy = d_copy;
      Status s = device_->OptimizerStep(hp, dev_t, stream_);
      if (!caps.Steps(kind)) {
        EXPECT_EQ(s.code(), StatusCode::kNotSupported) << s.ToString();
        break;
      }
      ASSERT_TRUE(s.ok()) << s.ToString();
      ASSERT_TRUE((*cpu)->Step(hp, cpu_t).ok());
      // The copy of `grad` reads it when it runs: done before the next step rewrites it.
      ASSERT_TRUE(device_->SynchronizeStream(stream_).ok());
    }
    if (!caps.Steps(kind)) continue;
    std::vector<float> g_param = Download(d_param, n), g_m = Download(d_m, n);
    for (size_t i = 0; i < n; ++i) {
      ASSERT_EQ(Bits(g_param[i]), Bits(param[i])) << "param " << i;
      ASSERT_EQ(Bits(g_m[i]), Bits(m[i])) << "state " << i;
    }
    if (!one_state) {
      std::vector<float> g_v = Download(d_v, n);
      for (size_t i = 0; i < n; ++i) ASSERT_EQ(Bits(g_v[i]), Bits(v[i])) << "exp_avg_sq " << i;
    }
    EXPECT_EQ(Download(d_copy, n), copy);
  }
  // Compressed states: bit-identical where the device keeps them, NotSupported elsewhere.
  std::vector<float> param(4096, 0.5f), grad(4096, 0.25f);
  std::vector<unsigned char> s1(StateBytes(StateType::kInt8, 4096), 0),
      s2(StateBytes(StateType::kInt8, 4096), 0);
  OptimizerHyperParams hp;
  hp.kind = OptimizerKind::kAdamW;
  OptimizerTensors cpu_t;
  cpu_t.param = param.data();
  cpu_t.grad = grad.data();
  cpu_t.n = param.size();
  cpu_t.state_type = StateType::kInt8;
  cpu_t.state1 = s1.data();
  cpu_t.state2 = s2.data();
  OptimizerTensors dev_t = cpu_t;
  dev_t.param = Upload(param);
  dev_t.grad = Upload(grad);
  dev_t.state1 = Upload(s1);
  dev_t.state2 = Upload(s2);
  Status s = device_->OptimizerStep(hp, dev_t, stream_);
  if (!caps.step_compressed_states) {
    EXPECT_EQ(s.code(), StatusCode::kNotSupported) << s.ToString();
    return;
  }
  ASSERT_TRUE(s.ok()) << s.ToString();
  ASSERT_TRUE((*cpu)->Step(hp, cpu_t).ok());
  EXPECT_EQ(Download(static_cast<float*>(dev_t.param), param.size()), param);
  EXPECT_EQ(Download(static_cast<unsigned char*>(dev_t.state1), s1.size()), s1);
  EXPECT_EQ(Download(static_cast<unsigned char*>(dev_t.state2), s2.size()), s2);
}

INSTANTIATE_TEST_SUITE_P(Backends, DeviceContract, ::testing::ValuesIn(Backends()),
                         [](const ::testing::TestParamInfo<Backend>& info) {
                           return info.param.name;
                         });

}  // namespace
}  // namespace zinf
