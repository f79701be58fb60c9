// The CUDA backends (zinf/cuda.h): CudaDevice memory, copies, streams and events; the device
// kernels against the CPU reference, bit for bit; NcclComm with one rank. Labelled "gpu":
// every test skips when no CUDA device is visible (or the build has no CUDA), so the suite
// passes on CPU-only CI. Run the real thing with bench/gpu_check.sh.
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <memory>
#include <random>
#include <span>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "tests/test_util.h"
#include "zinf/comm.h"
#include "zinf/cpu_adam.h"
#include "zinf/cuda.h"
#include "zinf/device.h"

namespace zinf {
namespace {

// Page-aligned host memory of whole pages (std::aligned_alloc), freed on scope exit.
class PageBuffer {
 public:
  explicit PageBuffer(size_t bytes)
      : data_(static_cast<unsigned char*>(std::aligned_alloc(4096, bytes))) {}
  ~PageBuffer() { std::free(data_); }
  PageBuffer(const PageBuffer&) = delete;
  PageBuffer& operator=(const PageBuffer&) = delete;
  unsigned char* data() const { return data_; }

 private:
  unsigned char* data_;
};

constexpr size_t kMiB = size_t{1} << 20;

uint32_t Bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  return u;
}

float FromBits(uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
}

// Every test starts from a fresh device with a 256 MiB budget; skips without a GPU.
class CudaTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (CudaDeviceCount() == 0) {
      GTEST_SKIP() << "no CUDA device visible (built without CUDA, no driver, or "
                      "CUDA_VISIBLE_DEVICES hides every GPU)";
    }
    CudaDeviceOptions options;
    options.memory_budget = 256 * kMiB;
    auto device = NewCudaDevice(options);
    ASSERT_TRUE(device.ok()) << device.status().ToString();
    device_ = std::move(*device);
    stream_ = device_->ComputeStream();
  }

  // n elements of T in device memory, freed with the device.
  template <typename T>
  T* DeviceBuffer(size_t n) {
    auto p = device_->Alloc(n * sizeof(T));
    EXPECT_TRUE(p.ok()) << p.status().ToString();
    return p.ok() ? static_cast<T*>(*p) : nullptr;
  }
  template <typename T>
  T* Upload(const std::vector<T>& host) {
    T* d = DeviceBuffer<T>(host.size());
    EXPECT_TRUE(device_->CopyHostToDevice(d, host.data(), host.size() * sizeof(T), stream_).ok());
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

  std::unique_ptr<Device> device_;
  Stream* stream_ = nullptr;
};

TEST_F(CudaTest, IdentifiesAsCuda) {
  EXPECT_FALSE(device_->IsHost());
  EXPECT_NE(device_->Name().find("cuda:0"), std::string::npos) << device_->Name();
  EXPECT_NE(CudaStreamOf(stream_), nullptr);
  EXPECT_EQ(device_->MemoryInfo().budget, 256 * kMiB);
}

TEST_F(CudaTest, ABudgetAboveTheFreeMemoryIsRefused) {
  CudaDeviceOptions options;
  options.memory_budget = std::numeric_limits<size_t>::max() / 2;
  auto device = NewCudaDevice(options);
  ASSERT_FALSE(device.ok());
  EXPECT_EQ(device.status().code(), StatusCode::kResourceExhausted) << device.status().ToString();
  options.memory_budget = 0;
  options.device = CudaDeviceCount();
  EXPECT_EQ(NewCudaDevice(options).status().code(), StatusCode::kInvalidArgument);
}

TEST_F(CudaTest, CopiesRoundTripPinnedAndPageable) {
  auto copy_stream = device_->CreateStream("copy");
  ASSERT_TRUE(copy_stream.ok());
  const size_t n = 8 * kMiB + 123;
  // Two registrations must not share a page (cudaErrorHostMemoryAlreadyRegistered): each
  // buffer page-aligned and padded to whole pages, as the engine's pinned arena is.
  const size_t padded = (n + 4095) / 4096 * 4096;
  PageBuffer src_buf(padded), out_buf(padded);
  ASSERT_TRUE(src_buf.data() != nullptr && out_buf.data() != nullptr);
  std::span<unsigned char> src(src_buf.data(), n), pinned_out(out_buf.data(), n);
  testing::FillRandom(src.data(), n, 42);
  std::fill(pinned_out.begin(), pinned_out.end(), 0);
  ASSERT_TRUE(device_->RegisterHostMemory(src_buf.data(), padded).ok());
  ASSERT_TRUE(device_->RegisterHostMemory(out_buf.data(), padded).ok());
  auto* a = DeviceBuffer<unsigned char>(n);
  auto* b = DeviceBuffer<unsigned char>(n);
  ASSERT_TRUE(device_->CopyHostToDevice(a, src.data(), n, *copy_stream).ok());
  ASSERT_TRUE(device_->CopyDeviceToDevice(b, a, n, *copy_stream).ok());
  ASSERT_TRUE(device_->CopyDeviceToHost(pinned_out.data(), b, n, *copy_stream).ok());
  ASSERT_TRUE(device_->SynchronizeStream(*copy_stream).ok());
  EXPECT_TRUE(std::equal(pinned_out.begin(), pinned_out.end(), src.begin()));
  EXPECT_TRUE(device_->UnregisterHostMemory(src_buf.data()).ok());
  EXPECT_TRUE(device_->UnregisterHostMemory(out_buf.data()).ok());
  // Pageable memory works too (slower, staged by the driver).
  std::vector<unsigned char> pageable(n, 0);
  ASSERT_TRUE(device_->CopyDeviceToHost(pageable.data(), a, n, *copy_stream).ok());
  ASSERT_TRUE(device_->SynchronizeStream(*copy_stream).ok());
  EXPECT_TRUE(std::equal(pageable.begin(), pageable.end(), src.begin()));
}

TEST_F(CudaTest, AnEventIsNotDoneWhileItsStreamIsBlocked) {
  auto s = device_->CreateStream("blocked");
  ASSERT_TRUE(s.ok());
  std::atomic<bool> release{false};
  ASSERT_TRUE(device_
                  ->LaunchHostFunc(*s,
                                   [&] {
                                     while (!release.load()) std::this_thread::yield();
                                   })
                  .ok());
  auto event = device_->CreateEvent();
  ASSERT_TRUE(event.ok());
  ASSERT_TRUE(device_->RecordEvent(event->get(), *s).ok());
  std::this_thread::sleep_for(std::chrono::milliseconds(20));
  EXPECT_FALSE(device_->EventDone(event->get()));
  release = true;
  EXPECT_TRUE(device_->SynchronizeEvent(event->get()).ok());
  EXPECT_TRUE(device_->EventDone(event->get()));
}

TEST_F(CudaTest, AHostFunctionExceptionIsTheStreamsStickyError) {
  auto s = device_->CreateStream("throws");
  ASSERT_TRUE(s.ok());
  ASSERT_TRUE(device_->LaunchHostFunc(*s, [] { throw std::runtime_error("boom"); }).ok());
  bool later_ran = false;
  ASSERT_TRUE(device_->LaunchHostFunc(*s, [&] { later_ran = true; }).ok());
  Status st = device_->SynchronizeStream(*s);
  EXPECT_EQ(st.code(), StatusCode::kInternal);
  EXPECT_NE(st.message().find("boom"), std::string::npos) << st.ToString();
  EXPECT_NE(st.message().find("throws"), std::string::npos) << st.ToString();
  EXPECT_TRUE(later_ran);
  EXPECT_FALSE(device_->SynchronizeStream(*s).ok());  // sticky
}

TEST_F(CudaTest, ArgumentErrors) {
  auto other = NewCudaDevice(CudaDeviceOptions{0, 16 * kMiB});
  ASSERT_TRUE(other.ok());
  void* d = DeviceBuffer<char>(16);
  char host[16] = {};
  EXPECT_EQ(device_->CopyHostToDevice(d, host, 16, nullptr).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(device_->CopyHostToDevice(d, host, 16, (*other)->ComputeStream()).code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(device_->CopyHostToDevice(nullptr, host, 16, stream_).code(),
            StatusCode::kInvalidArgument);
  EXPECT_TRUE(device_->CopyHostToDevice(nullptr, nullptr, 0, stream_).ok());
  EXPECT_EQ(device_->LaunchHostFunc(stream_, nullptr).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(device_->RecordEvent(nullptr, stream_).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(cuda::Scale(nullptr, 4, 2.0f, stream_).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(CudaStreamOf(nullptr), nullptr);
}

// ---- Kernels ----------------------------------------------------------------------------------

TEST_F(CudaTest, Bf16ToF32IsExactOnEveryPattern) {
  std::vector<uint16_t> all(65536);
  for (uint32_t i = 0; i < 65536; ++i) all[i] = static_cast<uint16_t>(i);
  uint16_t* src = Upload(all);
  float* dst = DeviceBuffer<float>(all.size());
  ASSERT_TRUE(cuda::CastBf16ToF32(src, dst, all.size(), stream_).ok());
  std::vector<float> got = Download(dst, all.size());
  for (uint32_t i = 0; i < 65536; ++i) {
    ASSERT_EQ(Bits(got[i]), Bits(Bf16ToFp32(all[i]))) << "pattern " << i;
  }
}

// The engine bench's compute: busy for the time asked, back to back on one stream, timed by
// the GPU's global timer.
TEST_F(CudaTest, SpinKeepsTheStreamBusyAndTimesItself) {
  uint64_t* times = DeviceBuffer<uint64_t>(4);
  const auto t0 = std::chrono::steady_clock::now();
  ASSERT_TRUE(cuda::Spin(0.02, times, stream_).ok());
  ASSERT_TRUE(cuda::Spin(0.01, times + 2, stream_).ok());
  std::vector<uint64_t> got = Download(times, 4);
  const double host_s =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  EXPECT_GE(got[1] - got[0], 20'000'000u);
  EXPECT_LT(got[1] - got[0], 1'000'000'000u);  // (a sanity bound: the GPU may be shared)
  EXPECT_GE(got[2], got[1]);                   // stream order
  EXPECT_GE(got[3] - got[2], 10'000'000u);
  EXPECT_GE(host_s, 0.03);
  EXPECT_EQ(cuda::Spin(-1, times, stream_).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(cuda::Spin(0.01, nullptr, stream_).code(), StatusCode::kInvalidArgument);
}

TEST_F(CudaTest, Scale) {
  std::vector<float> x(100001);
  for (size_t i = 0; i < x.size(); ++i) x[i] = static_cast<float>(i) * 0.37f - 11.0f;
  float* d = Upload(x);
  ASSERT_TRUE(cuda::Scale(d, x.size(), 0.125f, stream_).ok());
  std::vector<float> got = Download(d, x.size());
  for (size_t i = 0; i < x.size(); ++i) ASSERT_EQ(Bits(got[i]), Bits(x[i] * 0.125f)) << i;
}

TEST_F(CudaTest, SumSquaresMatchesACpuDoubleSumAndIsDeterministic) {
  std::mt19937 rng(3);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (size_t n : {size_t{0}, size_t{1}, size_t{1000}, size_t{3} * 1000 * 1000 + 17}) {
    std::vector<float> x(n);
    double expected = 0.0;
    for (float& v : x) {
      v = normal(rng);
      expected += static_cast<double>(v) * v;
    }
    float* d = n > 0 ? Upload(x) : nullptr;
    double sum1 = -1, sum2 = -1;
    bool bad1 = true, bad2 = true;
    ASSERT_TRUE(cuda::SumSquares(d, n, &sum1, &bad1, stream_).ok());
    ASSERT_TRUE(cuda::SumSquares(d, n, &sum2, &bad2, stream_).ok());
    ASSERT_TRUE(device_->SynchronizeStream(stream_).ok());
    EXPECT_NEAR(sum1, expected, 1e-12 * expected + 1e-300) << "n = " << n;
    EXPECT_EQ(sum1, sum2) << "two runs differ, n = " << n;
    EXPECT_FALSE(bad1);
    if (n > 0) device_->Free(d);
  }
  for (float special :
       {std::numeric_limits<float>::infinity(), -std::numeric_limits<float>::infinity(),
        std::numeric_limits<float>::quiet_NaN()}) {
    std::vector<float> x(5000, 1.0f);
    x[4321] = special;
    float* d = Upload(x);
    double sum = 0;
    bool bad = false;
    ASSERT_TRUE(cuda::SumSquares(d, x.size(), &sum, &bad, stream_).ok());
    ASSERT_TRUE(device_->SynchronizeStream(stream_).ok());
    EXPECT_TRUE(bad) << special;
    device_->Free(d);
  }
}

struct AdamCase {
  OptimizerKind kind;
  GradType grad_type;
  ParamCopyType copy_type;
  float weight_decay;
};

// The CUDA step against the CPU scalar reference, bit for bit, over several steps (so the
// states feed back) and the awkward values: zeros, huge and tiny gradients, subnormals.
TEST_F(CudaTest, AdamStepIsBitIdenticalToTheCpuScalarReference) {
  CpuOptimizer::Options cpu_options;
  cpu_options.isa = CpuIsa::kScalar;
  cpu_options.num_threads = 1;
  auto cpu = CpuOptimizer::Create(cpu_options);
  ASSERT_TRUE(cpu.ok()) << cpu.status().ToString();
  const size_t n = 100003;
  std::vector<AdamCase> cases;
  for (OptimizerKind kind : {OptimizerKind::kAdam, OptimizerKind::kAdamW}) {
    for (GradType g : {GradType::kF32, GradType::kBf16, GradType::kF16}) {
      for (ParamCopyType c : {ParamCopyType::kNone, ParamCopyType::kBf16, ParamCopyType::kF16}) {
        for (float wd : {0.0f, 0.01f}) cases.push_back({kind, g, c, wd});
      }
    }
  }
  for (const AdamCase& tc : cases) {
    SCOPED_TRACE(std::string(OptimizerKindName(tc.kind)) + " grad " + GradTypeName(tc.grad_type) +
                 " copy " + ParamCopyTypeName(tc.copy_type) + " wd " +
                 std::to_string(tc.weight_decay));
    std::mt19937 rng(11);
    std::normal_distribution<float> normal(0.0f, 1.0f);
    std::vector<float> param(n), m(n, 0.0f), v(n, 0.0f);
    for (float& p : param) p = normal(rng);
    param[0] = 0.0f;
    param[1] = 1e-40f;  // subnormal
    param[2] = -3e38f;
    const size_t grad_size = GradTypeSize(tc.grad_type);
    const size_t copy_size = ParamCopyTypeSize(tc.copy_type);
    std::vector<unsigned char> grad(n * grad_size);
    float* d_param = Upload(param);
    float* d_m = Upload(m);
    float* d_v = Upload(v);
    auto* d_grad = DeviceBuffer<unsigned char>(grad.size());
    auto* d_copy = copy_size > 0 ? DeviceBuffer<unsigned char>(n * copy_size) : nullptr;
    std::vector<unsigned char> copy(n * copy_size);
    for (int step = 1; step <= 3; ++step) {
      for (size_t i = 0; i < n; ++i) {
        float g = normal(rng) * (i % 7 == 0 ? 1e-20f : (i % 11 == 0 ? 1e4f : 1.0f));
        if (i == 3) g = 0.0f;
        if (i == 4) g = 1e-42f;
        if (tc.grad_type == GradType::kF32) {
          std::memcpy(&grad[i * 4], &g, 4);
        } else {
          const uint16_t h = tc.grad_type == GradType::kBf16 ? Fp32ToBf16(g) : Fp32ToFp16(g);
          std::memcpy(&grad[i * 2], &h, 2);
        }
      }
      ASSERT_TRUE(device_->CopyHostToDevice(d_grad, grad.data(), grad.size(), stream_).ok());
      OptimizerHyperParams hp;
      hp.kind = tc.kind;
      hp.step = step;
      hp.lr = 1e-3f;
      hp.weight_decay = tc.weight_decay;
      hp.grad_scale = 0.5f;
      OptimizerTensors cpu_t;
      cpu_t.param = param.data();
      cpu_t.grad = grad.data();
      cpu_t.grad_type = tc.grad_type;
      cpu_t.exp_avg = m.data();
      cpu_t.exp_avg_sq = v.data();
      cpu_t.param_copy = copy_size > 0 ? copy.data() : nullptr;
      cpu_t.param_copy_type = tc.copy_type;
      cpu_t.n = n;
      OptimizerTensors gpu_t = cpu_t;
      gpu_t.param = d_param;
      gpu_t.grad = d_grad;
      gpu_t.exp_avg = d_m;
      gpu_t.exp_avg_sq = d_v;
      gpu_t.param_copy = d_copy;
      ASSERT_TRUE((*cpu)->Step(hp, cpu_t).ok());
      Status s = cuda::AdamStep(hp, gpu_t, stream_);
      ASSERT_TRUE(s.ok()) << s.ToString();
    }
    std::vector<float> g_param = Download(d_param, n);
    std::vector<float> g_m = Download(d_m, n);
    std::vector<float> g_v = Download(d_v, n);
    for (size_t i = 0; i < n; ++i) {
      ASSERT_EQ(Bits(g_param[i]), Bits(param[i])) << "param " << i;
      ASSERT_EQ(Bits(g_m[i]), Bits(m[i])) << "exp_avg " << i;
      ASSERT_EQ(Bits(g_v[i]), Bits(v[i])) << "exp_avg_sq " << i;
    }
    if (copy_size > 0) {
      std::vector<unsigned char> g_copy = Download(d_copy, n * copy_size);
      ASSERT_EQ(g_copy, copy);
    }
    for (void* p : {static_cast<void*>(d_param), static_cast<void*>(d_m), static_cast<void*>(d_v),
                    static_cast<void*>(d_grad), static_cast<void*>(d_copy)}) {
      device_->Free(p);
    }
  }
}

TEST_F(CudaTest, AdamStepRejectsOtherOptimizersAndBadArguments) {
  OptimizerHyperParams hp;
  hp.kind = OptimizerKind::kLion;
  OptimizerTensors t;
  EXPECT_EQ(cuda::AdamStep(hp, t, stream_).code(), StatusCode::kNotSupported);
  hp.kind = OptimizerKind::kAdamW;
  t.n = 16;  // null buffers
  EXPECT_EQ(cuda::AdamStep(hp, t, stream_).code(), StatusCode::kInvalidArgument);
  // Compressed states (zinf.optimizer_state_dtype): the GPU kernel keeps fp32 states only, and
  // says so instead of reading the fp32 pointers, which are null then.
  t.n = 256;
  t.param = DeviceBuffer<float>(256);
  float* grad = DeviceBuffer<float>(256);
  t.grad = grad;
  t.state_type = StateType::kInt8;
  t.state1 = DeviceBuffer<float>(StateBytes(StateType::kInt8, 256) / sizeof(float));
  t.state2 = DeviceBuffer<float>(StateBytes(StateType::kInt8, 256) / sizeof(float));
  Status s = cuda::AdamStep(hp, t, stream_);
  EXPECT_EQ(s.code(), StatusCode::kNotSupported) << s.ToString();
  EXPECT_NE(s.message().find("int8"), std::string::npos) << s.ToString();
}

// ---- NcclComm, one rank --------------------------------------------------------------------

TEST_F(CudaTest, NcclCommWithOneRank) {
  testing::TempDir dir;
  ASSERT_TRUE(dir.ok());
  NcclCommOptions options;
  options.unique_id_file = dir.path() + "/nccl-id";
  options.timeout_seconds = 60;
  auto comm = NewNcclComm(device_.get(), options);
  ASSERT_TRUE(comm.ok()) << comm.status().ToString();
  Communicator* c = comm->get();
  EXPECT_EQ(c->rank(), 0);
  EXPECT_EQ(c->world_size(), 1);
  auto s = device_->CreateStream("comm");
  ASSERT_TRUE(s.ok());

  std::vector<float> x = {1.5f, -2.0f, 3.25f, 0.0f, 7.0f};
  float* buf = Upload(x);
  ASSERT_TRUE(device_->SynchronizeStream(stream_).ok());
  ASSERT_TRUE(c->AllReduceSum(buf, x.size(), *s).ok());
  float* gathered = DeviceBuffer<float>(x.size());
  ASSERT_TRUE(c->AllGather(buf, gathered, x.size() * sizeof(float), *s).ok());
  float* scattered = DeviceBuffer<float>(x.size());
  ASSERT_TRUE(c->ReduceScatterSum(gathered, scattered, x.size(), *s).ok());
  ASSERT_TRUE(c->Broadcast(scattered, x.size() * sizeof(float), 0, *s).ok());
  ASSERT_TRUE(device_->SynchronizeStream(*s).ok());
  EXPECT_EQ(Download(buf, x.size()), x);
  EXPECT_EQ(Download(gathered, x.size()), x);
  EXPECT_EQ(Download(scattered, x.size()), x);
  EXPECT_TRUE(c->Barrier().ok());

  EXPECT_EQ(c->AllReduceSum(nullptr, 4, *s).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(c->Broadcast(buf, 4, 1, *s).code(), StatusCode::kInvalidArgument);
  EXPECT_TRUE(c->AllReduceSum(nullptr, 0, *s).ok());
  // The id file was written whole by rank 0.
  struct stat st {};
  ASSERT_EQ(stat(options.unique_id_file.c_str(), &st), 0);
  EXPECT_EQ(st.st_size, 128);
}

TEST_F(CudaTest, NcclCommRejectsBadOptions) {
  NcclCommOptions options;
  options.world_size = 2;
  options.rank = 2;
  EXPECT_EQ(NewNcclComm(device_.get(), options).status().code(), StatusCode::kInvalidArgument);
  options.rank = 1;  // world 2 without an id file
  EXPECT_EQ(NewNcclComm(device_.get(), options).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(NewNcclComm(nullptr, NcclCommOptions{}).status().code(), StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace zinf
