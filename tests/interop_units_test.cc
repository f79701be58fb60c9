// The units a framework front end builds on (interop/): the zinf.Init spill file, the view
// ledger that gates each Release, and the StepStats / safetensors-dtype tables the bindings
// use instead of copying field by field.
#include <dirent.h>
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <map>
#include <set>
#include <string>
#include <thread>
#include <type_traits>
#include <vector>

#include "interop/spill_file.h"
#include "interop/view_ledger.h"
#include "tests/test_util.h"
#include "zinf/cpu_adam.h"
#include "zinf/engine_types.h"
#include "zinf/safetensors.h"

namespace zinf {
namespace {

using testing::TempDir;

int EntriesIn(const std::string& dir) {
  int n = 0;
  DIR* d = opendir(dir.c_str());
  if (d == nullptr) return -1;
  while (dirent* e = readdir(d)) {
    if (std::strcmp(e->d_name, ".") != 0 && std::strcmp(e->d_name, "..") != 0) ++n;
  }
  closedir(d);
  return n;
}

std::vector<float> Ramp(size_t n, float scale) {
  std::vector<float> v(n);
  for (size_t i = 0; i < n; ++i) v[i] = scale * static_cast<float>(i) - 7.25f;
  return v;
}

TEST(SpillFile, ValuesOfEachTypeReadBackExactlyAtTheirOffsets) {
  TempDir dir;
  ASSERT_TRUE(dir.ok());
  auto spill = SpillFile::Create(dir.path());
  ASSERT_TRUE(spill.ok()) << spill.status().ToString();
  SpillFile& f = **spill;
  // The file is unlinked: nothing appears in the folder, however much is written.
  EXPECT_EQ(EntriesIn(dir.path()), 0);

  const std::vector<float> f32 = Ramp(1000, 0.5f);
  std::vector<uint16_t> bf16(777), f16(333);
  for (size_t i = 0; i < bf16.size(); ++i) bf16[i] = Fp32ToBf16(0.125f * i - 3);
  for (size_t i = 0; i < f16.size(); ++i) f16[i] = Fp32ToFp16(0.25f * i - 9);

  auto a = f.Append(f32.data(), HostValueType::kF32, f32.size());
  auto b = f.Append(bf16.data(), HostValueType::kBf16, bf16.size());
  auto c = f.Append(f16.data(), HostValueType::kF16, f16.size());
  ASSERT_TRUE(a.ok() && b.ok() && c.ok());
  EXPECT_EQ(*a, 0u);
  EXPECT_EQ(*b, 4u * f32.size());
  EXPECT_EQ(*c, 4u * (f32.size() + bf16.size()));
  EXPECT_EQ(f.bytes(), 4u * (f32.size() + bf16.size() + f16.size()));
  EXPECT_EQ(EntriesIn(dir.path()), 0);

  std::vector<float> got(1000);
  ASSERT_TRUE(f.Read(*a, got.data(), f32.size()).ok());
  EXPECT_EQ(std::memcmp(got.data(), f32.data(), f32.size() * 4), 0);
  ASSERT_TRUE(f.Read(*b, got.data(), bf16.size()).ok());
  for (size_t i = 0; i < bf16.size(); ++i) ASSERT_EQ(got[i], Bf16ToFp32(bf16[i])) << i;
  ASSERT_TRUE(f.Read(*c, got.data(), f16.size()).ok());
  for (size_t i = 0; i < f16.size(); ++i) ASSERT_EQ(got[i], Fp16ToFp32(f16[i])) << i;
}

TEST(SpillFile, AnAppendLargerThanOneConversionBlockIsWhole) {
  TempDir dir;
  ASSERT_TRUE(dir.ok());
  auto spill = SpillFile::Create(dir.path());
  ASSERT_TRUE(spill.ok());
  // 2^20 values per write inside Append: 2^20 + 3 spans two writes.
  std::vector<uint16_t> bf16((1u << 20) + 3);
  for (size_t i = 0; i < bf16.size(); ++i) bf16[i] = static_cast<uint16_t>(0x3f80 + (i % 97));
  auto off = (*spill)->Append(bf16.data(), HostValueType::kBf16, bf16.size());
  ASSERT_TRUE(off.ok());
  std::vector<float> got(bf16.size());
  ASSERT_TRUE((*spill)->Read(*off, got.data(), got.size()).ok());
  for (size_t i = 0; i < bf16.size(); i += 4099) ASSERT_EQ(got[i], Bf16ToFp32(bf16[i])) << i;
  EXPECT_EQ(got.back(), Bf16ToFp32(bf16.back()));
}

// The blocks the unlinked spill file holds on disk, found through this process's descriptors.
uint64_t SpillBlocks(const std::string& dir) {
  uint64_t bytes = 0;
  DIR* fds = opendir("/proc/self/fd");
  if (fds == nullptr) return 0;
  while (dirent* e = readdir(fds)) {
    char target[4096];
    const std::string link = std::string("/proc/self/fd/") + e->d_name;
    const ssize_t n = readlink(link.c_str(), target, sizeof(target) - 1);
    if (n <= 0) continue;
    target[n] = 0;
    struct stat st {};
    if (std::string(target).rfind(dir, 0) == 0 && stat(link.c_str(), &st) == 0) {
      bytes += static_cast<uint64_t>(st.st_blocks) * 512;
    }
  }
  closedir(fds);
  return bytes;
}

// Values handed over (the engine read them) give their disk blocks back, and are never read
// again as zeros: a second read is refused with what to do.
TEST(SpillFile, ReleasedValuesFreeTheirBlocksAndAreNotReadAgain) {
  TempDir dir;
  ASSERT_TRUE(dir.ok());
  auto spill = SpillFile::Create(dir.path());
  ASSERT_TRUE(spill.ok());
  std::vector<float> a(1 << 20, 1.5f), b(1 << 20, -2.0f);
  auto oa = (*spill)->Append(a.data(), HostValueType::kF32, a.size());
  auto ob = (*spill)->Append(b.data(), HostValueType::kF32, b.size());
  ASSERT_TRUE(oa.ok() && ob.ok());
  const uint64_t before = SpillBlocks(dir.path());
  std::vector<float> got(a.size());
  ASSERT_TRUE((*spill)->Read(*oa, got.data(), got.size()).ok());
  (*spill)->Release(*oa, a.size());
  const uint64_t after = SpillBlocks(dir.path());
  Status again = (*spill)->Read(*oa, got.data(), got.size());
  EXPECT_EQ(again.code(), StatusCode::kFailedPrecondition);
  EXPECT_NE(again.message().find("build the model again"), std::string::npos) << again.ToString();
  ASSERT_TRUE((*spill)->Read(*ob, got.data(), got.size()).ok());
  EXPECT_EQ(got, b);
  // 4 MiB given back where the file system punches holes (tmpfs, ext4 and xfs do).
  if (before >= 8u << 20) EXPECT_LE(after, before - (4u << 20)) << before << " -> " << after;
}

TEST(SpillFile, ReadingPastTheEndIsCorruptionNamingTheFolder) {
  TempDir dir;
  ASSERT_TRUE(dir.ok());
  auto spill = SpillFile::Create(dir.path());
  ASSERT_TRUE(spill.ok());
  std::vector<float> v = Ramp(10, 1);
  ASSERT_TRUE((*spill)->Append(v.data(), HostValueType::kF32, v.size()).ok());
  std::vector<float> got(11);
  Status s = (*spill)->Read(0, got.data(), 11);
  EXPECT_EQ(s.code(), StatusCode::kCorruption);
  EXPECT_NE(s.message().find(dir.path()), std::string::npos) << s.ToString();
}

TEST(SpillFile, AFolderThatCannotHoldItIsAnErrorNamingIt) {
  const std::string missing = "/var/tmp/zinf-no-such-folder-for-spill/inner";
  auto spill = SpillFile::Create(missing);
  ASSERT_FALSE(spill.ok());
  EXPECT_NE(spill.status().message().find(missing), std::string::npos);
  EXPECT_NE(spill.status().message().find("writable folder"), std::string::npos);
}

TEST(SpillFile, ConcurrentAppendsGetDisjointRanges) {
  TempDir dir;
  ASSERT_TRUE(dir.ok());
  auto spill = SpillFile::Create(dir.path());
  ASSERT_TRUE(spill.ok());
  constexpr int kThreads = 4, kPerThread = 50, kN = 1000;
  std::vector<std::vector<uint64_t>> offsets(kThreads);
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      std::vector<float> v(kN, static_cast<float>(t));
      for (int k = 0; k < kPerThread; ++k) {
        auto off = (*spill)->Append(v.data(), HostValueType::kF32, v.size());
        offsets[t].push_back(off.ok() ? *off : UINT64_MAX);
      }
    });
  }
  for (auto& th : threads) th.join();
  std::set<uint64_t> all;
  std::vector<float> got(kN);
  for (int t = 0; t < kThreads; ++t) {
    for (uint64_t off : offsets[t]) {
      ASSERT_NE(off, UINT64_MAX);
      ASSERT_EQ(off % (kN * 4), 0u);
      all.insert(off);
      ASSERT_TRUE((*spill)->Read(off, got.data(), kN).ok());
      for (float x : got) ASSERT_EQ(x, static_cast<float>(t));
    }
  }
  EXPECT_EQ(all.size(), static_cast<size_t>(kThreads * kPerThread));
  EXPECT_EQ((*spill)->bytes(), uint64_t{kThreads} * kPerThread * kN * 4);
}

TEST(HostValueType, TorchNamesParseAndOthersAreRefused) {
  EXPECT_EQ(*ParseHostValueType("float32"), HostValueType::kF32);
  EXPECT_EQ(*ParseHostValueType("bfloat16"), HostValueType::kBf16);
  EXPECT_EQ(*ParseHostValueType("float16"), HostValueType::kF16);
  auto bad = ParseHostValueType("float64");
  ASSERT_FALSE(bad.ok());
  EXPECT_EQ(bad.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(bad.status().message().find("float64"), std::string::npos);
}

TEST(ViewLedger, AReleaseIsDueOnlyOnceNoViewRemains) {
  ViewLedger ledger;
  ledger.Resize(3);
  ASSERT_TRUE(ledger.AddView(1).ok());
  ASSERT_TRUE(ledger.AddView(1).ok());
  ASSERT_TRUE(ledger.AddView(2).ok());
  ASSERT_TRUE(ledger.OweRelease({1, 2, 0}).ok());
  // 0 has no views: due at once; 1 and 2 wait for torch.
  EXPECT_EQ(ledger.TakeDue(), std::vector<ParamId>({0}));
  EXPECT_EQ(ledger.TakeDue(), std::vector<ParamId>());
  ASSERT_TRUE(ledger.DropView(1).ok());
  EXPECT_EQ(ledger.TakeDue(), std::vector<ParamId>());
  ASSERT_TRUE(ledger.DropView(2).ok());
  EXPECT_EQ(ledger.TakeDue(), std::vector<ParamId>({2}));
  EXPECT_EQ(ledger.Views(), (std::map<ParamId, int64_t>{{1, 1}}));
  EXPECT_EQ(ledger.Owed(), (std::map<ParamId, int64_t>{{1, 1}}));
  ASSERT_TRUE(ledger.DropView(1).ok());
  EXPECT_EQ(ledger.TakeDue(), std::vector<ParamId>({1}));
  EXPECT_TRUE(ledger.Views().empty());
  EXPECT_TRUE(ledger.Owed().empty());
}

TEST(ViewLedger, EachOwedReleaseIsIssuedOnce) {
  ViewLedger ledger;
  ledger.Resize(2);
  ASSERT_TRUE(ledger.OweRelease({1}).ok());
  ASSERT_TRUE(ledger.OweRelease({1, 1}).ok());
  EXPECT_EQ(ledger.TakeDue(), std::vector<ParamId>({1, 1, 1}));
  EXPECT_EQ(ledger.TakeDue(), std::vector<ParamId>());
}

TEST(ViewLedger, UnknownIdsAndExtraFreesAreRefusedWithoutChangingCounts) {
  ViewLedger ledger;
  ledger.Resize(2);
  Status s = ledger.OweRelease({0, 5});
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("5"), std::string::npos);
  EXPECT_TRUE(ledger.Owed().empty()) << "all or nothing: 0 is not owed";
  EXPECT_EQ(ledger.AddView(2).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(ledger.DropView(0).code(), StatusCode::kFailedPrecondition);
  EXPECT_TRUE(ledger.Views().empty());
  ledger.Resize(1);  // never shrinks
  EXPECT_TRUE(ledger.AddView(1).ok());
}

TEST(ViewLedger, ViewsFreedOnOtherThreadsAreCountedExactly) {
  // Torch frees tensors on whatever thread drops the last reference.
  ViewLedger ledger;
  ledger.Resize(4);
  constexpr int kThreads = 4, kViews = 20000;
  for (int i = 0; i < kThreads * kViews; ++i) ASSERT_TRUE(ledger.AddView(i % 4).ok());
  ASSERT_TRUE(ledger.OweRelease({0, 1, 2, 3}).ok());
  std::atomic<int> failures{0};
  std::vector<std::thread> threads;
  std::vector<ParamId> due;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      for (int i = 0; i < kViews; ++i) {
        if (!ledger.DropView((t + i) % 4).ok()) ++failures;
      }
    });
  }
  for (int k = 0; k < 1000; ++k) {
    for (ParamId id : ledger.TakeDue()) due.push_back(id);
  }
  for (auto& th : threads) th.join();
  for (ParamId id : ledger.TakeDue()) due.push_back(id);
  EXPECT_EQ(failures.load(), 0);
  std::sort(due.begin(), due.end());
  EXPECT_EQ(due, std::vector<ParamId>({0, 1, 2, 3}));
  EXPECT_TRUE(ledger.Views().empty());
}

TEST(StepStatsVisit, EveryFieldIsVisitedOnceWithItsValue) {
  StepStats st;
  st.step = 1;
  st.optimizer_ran = true;
  st.step_seconds = 2.5;
  st.nvme_read_bytes = 3;
  st.nvme_write_bytes = 4;
  st.h2d_bytes = 5;
  st.d2h_bytes = 6;
  st.nvme_busy_seconds = 7.5;
  st.copy_busy_seconds = 8.5;
  st.optimizer_busy_seconds = 9.5;
  st.acquire_wait_seconds = 10.5;
  st.optimizer_wait_seconds = 11.5;
  st.peak_device_bytes = 12;
  st.peak_pinned_bytes = 13;
  st.nvme_bytes = 14;
  st.overlap_efficiency = 15.5;
  st.grad_norm = 16.5;
  st.prefetch_hits = 17;
  st.prefetch_misses = 18;
  st.trace_valid = true;
  st.cpu_seconds_total = 19.5;
  st.cpu_seconds_trainer = 20.5;
  st.cpu_seconds_optimizer = 21.5;
  st.speculated_groups = 22;
  st.kept_groups = 23;
  st.redone_groups = 24;
  st.rolled_back_groups = 25;
  st.speculation_redo_seconds = 26.5;
  st.landing_groups = 27;
  st.loss_scale = 28.5;
  st.skipped_steps = 29;
  std::vector<std::string> names;
  double sum = 0;
  int bools = 0;
  VisitStepStats(st, [&](const char* name, auto value) {
    names.push_back(name);
    if constexpr (std::is_same_v<decltype(value), bool>) {
      bools += value ? 1 : 0;
    } else {
      sum += static_cast<double>(value);
    }
  });
  EXPECT_EQ(names.size(), 31u);
  EXPECT_EQ(std::set<std::string>(names.begin(), names.end()).size(), names.size());
  EXPECT_EQ(bools, 2);
  // 1 + 2.5 + 3 + ... : each value counted once.
  EXPECT_DOUBLE_EQ(sum, 1 + 2.5 + 3 + 4 + 5 + 6 + 7.5 + 8.5 + 9.5 + 10.5 + 11.5 + 12 + 13 + 14 +
                            15.5 + 16.5 + 17 + 18 + 19.5 + 20.5 + 21.5 + 22 + 23 + 24 + 25 + 26.5 +
                            27 + 28.5 + 29);
  // That the visit covers every field is checked where it is defined (engine_types.h: the
  // field count); here, that each of the 31 is visited once with its own value.
}

TEST(SafetensorsDType, EveryNameRoundTripsAndOthersAreNone) {
  using safetensors::DType;
  int n = 0;
  for (DType d : {DType::kBool, DType::kU8, DType::kI8, DType::kF8E5M2, DType::kF8E4M3, DType::kI16,
                  DType::kU16, DType::kF16, DType::kBF16, DType::kI32, DType::kU32, DType::kF32,
                  DType::kF64, DType::kI64, DType::kU64}) {
    auto back = safetensors::DTypeByName(safetensors::DTypeName(d));
    ASSERT_TRUE(back.has_value()) << safetensors::DTypeName(d);
    EXPECT_EQ(*back, d);
    ++n;
  }
  EXPECT_EQ(n, 15);
  EXPECT_FALSE(safetensors::DTypeByName("f32").has_value());
  EXPECT_FALSE(safetensors::DTypeByName("").has_value());
}

}  // namespace
}  // namespace zinf
