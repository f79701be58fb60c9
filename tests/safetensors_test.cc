// safetensors: headers checked as hostile input, sharded checkpoints opened, tensors loaded
// into an engine (all checks before any change) and exported from it, exactly.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "device/host/local_comm.h"
#include "tests/engine_test_model.h"
#include "tests/test_util.h"
#include "zinf/cpu_adam.h"
#include "zinf/device.h"
#include "zinf/safetensors_engine.h"

namespace zinf::safetensors {
namespace {

using testing::TempDir;

// A file: the 8-byte length, `header` verbatim, then `data`.
std::string WriteRaw(const std::string& path, const std::string& header, const std::string& data) {
  std::ofstream f(path, std::ios::binary | std::ios::trunc);
  uint64_t n = header.size();
  for (int b = 0; b < 8; ++b) f.put(static_cast<char>(n >> (8 * b)));
  f << header << data;
  return path;
}

std::string Bytes(const std::vector<float>& v) {
  return std::string(reinterpret_cast<const char*>(v.data()), v.size() * sizeof(float));
}

TEST(SafetensorsHeader, AValidFileIsIndexed) {
  TempDir dir;
  std::vector<float> a = {1, 2, 3, 4, 5, 6};
  std::vector<uint16_t> b = {Fp32ToBf16(0.5f), Fp32ToBf16(-2.0f)};
  std::string data = Bytes(a) + std::string(reinterpret_cast<const char*>(b.data()), 4);
  const std::string header =
      R"({"b":{"dtype":"BF16","shape":[2,1],"data_offsets":[24,28]},)"
      R"("__metadata__":{"format":"pt"},"a":{"dtype":"F32","shape":[2,3],"data_offsets":[0,24]}}   )";
  const std::string path = WriteRaw(dir.path() + "/m.safetensors", header, data);
  Result<Checkpoint> ck = OpenCheckpoint(path);
  ASSERT_TRUE(ck.ok()) << ck.status().ToString();
  ASSERT_EQ(ck->tensors.size(), 2u);
  EXPECT_EQ(ck->files[0].metadata.at("format"), "pt");
  const TensorInfo& ta = ck->tensors.at("a");
  EXPECT_EQ(ta.shape, (std::vector<int64_t>{2, 3}));
  EXPECT_EQ(ta.offset, 8 + header.size());
  std::vector<float> out(6);
  ASSERT_TRUE(ReadTensorF32(*ck, ta, out.data()).ok());
  EXPECT_EQ(out, a);
  std::vector<float> outb(2);
  // One element per block: the block loop is exercised.
  ASSERT_TRUE(ReadTensorF32(*ck, ck->tensors.at("b"), outb.data(), 2).ok());
  EXPECT_EQ(outb, (std::vector<float>{0.5f, -2.0f}));
}

TEST(SafetensorsHeader, HostileHeadersAreErrorsNamingTheProblem) {
  TempDir dir;
  const std::string four(16, '\0');  // 16 bytes of data
  struct Case {
    std::string header;
    std::string data;
    std::string expect;
  };
  const std::vector<Case> cases = {
      {"[1,2]", four, "does not start with '{'"},
      {"{\"a\":", four, "not valid JSON"},
      {R"({"a":{"dtype":"F32","shape":[4],"data_offsets":[0,16]},"a":{"dtype":"F32","shape":[4],"data_offsets":[0,16]}})",
       four, "appears twice"},
      {R"({"a":{"dtype":"F31","shape":[4],"data_offsets":[0,16]}})", four, "unknown dtype"},
      {R"({"a":{"dtype":"F32","shape":[-4],"data_offsets":[0,16]}})", four, "non-negative"},
      {R"({"a":{"dtype":"F32","shape":[5],"data_offsets":[0,16]}})", four,
       "16 bytes of data for 5"},
      {R"({"a":{"dtype":"F32","shape":[4],"data_offsets":[0,20]}})", four, "outside"},
      {R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[8,16]}})", four, "a hole before it"},
      {R"({"a":{"dtype":"F32","shape":[3],"data_offsets":[0,12]},"b":{"dtype":"F32","shape":[2],"data_offsets":[8,16]}})",
       four, "overlaps"},
      {R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})", four, "truncated or padded"},
      {R"({"a":{"dtype":"F32","shape":[4294967296,4294967296,16],"data_offsets":[0,16]}})", four,
       "overflows"},
      {R"({"__metadata__":{"x":1},"a":{"dtype":"F32","shape":[4],"data_offsets":[0,16]}})", four,
       "must be a string"},
      {R"({"a":{"dtype":"F32","shape":[4]}})", four, "data_offsets"},
      {R"({"a":7})", four, "expected an object"},
  };
  for (size_t i = 0; i < cases.size(); ++i) {
    const std::string path = WriteRaw(dir.path() + "/c" + std::to_string(i) + ".safetensors",
                                      cases[i].header, cases[i].data);
    Result<FileHeader> h = ReadHeader(path);
    ASSERT_FALSE(h.ok()) << "case " << i << " was accepted";
    EXPECT_NE(h.status().message().find(cases[i].expect), std::string::npos)
        << "case " << i << ": " << h.status().ToString();
    EXPECT_NE(h.status().message().find(path), std::string::npos) << h.status().ToString();
  }
  // A length larger than the file, and a file shorter than the length field.
  {
    const std::string path = dir.path() + "/long.safetensors";
    std::ofstream f(path, std::ios::binary);
    const uint64_t n = 1000;
    f.write(reinterpret_cast<const char*>(&n), 8);
    f << "{}";
    f.close();
    Result<FileHeader> h = ReadHeader(path);
    ASSERT_FALSE(h.ok());
    EXPECT_NE(h.status().message().find("truncated"), std::string::npos) << h.status().ToString();
  }
  {
    const std::string path = dir.path() + "/short.safetensors";
    std::ofstream(path, std::ios::binary) << "abc";
    Result<FileHeader> h = ReadHeader(path);
    ASSERT_FALSE(h.ok());
    EXPECT_NE(h.status().message().find("too short"), std::string::npos);
  }
  {
    const std::string path = dir.path() + "/huge.safetensors";
    std::ofstream f(path, std::ios::binary);
    const uint64_t n = uint64_t{1} << 40;
    f.write(reinterpret_cast<const char*>(&n), 8);
    f << "{}";
    f.close();
    Result<FileHeader> h = ReadHeader(path);
    ASSERT_FALSE(h.ok());
    EXPECT_NE(h.status().message().find("at most 100 MiB"), std::string::npos);
  }
}

TEST(SafetensorsIndex, MissingAndInconsistentShardsAreNamed) {
  TempDir dir;
  std::vector<float> a = {1, 2};
  WriteRaw(dir.path() + "/s1.safetensors",
           R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})", Bytes(a));
  WriteRaw(dir.path() + "/s2.safetensors",
           R"({"b":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})", Bytes(a));
  auto index = [&](const std::string& map) {
    std::ofstream(dir.path() + "/model.safetensors.index.json")
        << "{\"metadata\":{},\"weight_map\":" << map << "}";
  };
  index(R"({"a":"s1.safetensors","b":"s2.safetensors"})");
  Result<Checkpoint> ok = OpenCheckpoint(dir.path());
  ASSERT_TRUE(ok.ok()) << ok.status().ToString();
  EXPECT_EQ(ok->files.size(), 2u);
  EXPECT_EQ(ok->tensors.at("b").file, 1u);

  index(R"({"a":"s1.safetensors","b":"s3.safetensors"})");
  Result<Checkpoint> missing = OpenCheckpoint(dir.path());
  ASSERT_FALSE(missing.ok());
  EXPECT_EQ(missing.status().code(), StatusCode::kNotFound);
  EXPECT_NE(missing.status().message().find("s3.safetensors"), std::string::npos);

  index(R"({"a":"s2.safetensors","b":"s2.safetensors"})");
  Result<Checkpoint> wrong = OpenCheckpoint(dir.path());
  ASSERT_FALSE(wrong.ok());
  EXPECT_NE(wrong.status().message().find("does not hold it"), std::string::npos);

  index(R"({"a":"../s1.safetensors"})");
  EXPECT_FALSE(OpenCheckpoint(dir.path()).ok());

  WriteRaw(dir.path() + "/s2.safetensors",
           R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})", Bytes(a));
  index(R"({"a":"s1.safetensors","b":"s2.safetensors"})");
  Result<Checkpoint> twice = OpenCheckpoint(dir.path());
  ASSERT_FALSE(twice.ok());
  EXPECT_NE(twice.status().message().find("in both"), std::string::npos);

  EXPECT_EQ(OpenCheckpoint(dir.path() + "/nothing-here").status().code(), StatusCode::kNotFound);
}

// ---- With an engine ---------------------------------------------------------------------------

struct Rig {
  std::unique_ptr<Device> device;
  std::vector<std::unique_ptr<Communicator>> comms;
  std::unique_ptr<Engine> engine;
  std::vector<ParamId> ids;
  std::vector<std::vector<int64_t>> shapes = {{30, 20}, {20}, {7, 1, 5}, {1000}};

  explicit Rig(const std::string& nvme, bool bf16 = false, float scale = 1.0f) {
    HostDeviceOptions ho;
    ho.memory_budget = 16 << 20;
    device = NewHostDevice(ho);
    comms = std::move(NewLocalComms({device.get()})).value();
    EngineConfig c;
    c.offload_param.tier = Tier::kNvme;
    c.offload_param.nvme_paths = {nvme};
    c.offload_optimizer.tier = Tier::kNvme;
    c.offload_optimizer.nvme_paths = {nvme};
    c.sub_group_size = 4096;
    c.bf16 = bf16;
    c.pinned_budget_bytes = 4 << 20;
    c.optimizer_threads = 1;
    engine = std::move(Engine::Create(c, device.get(), comms[0].get())).value();
    for (size_t p = 0; p < shapes.size(); ++p) {
      ParamSpec spec;
      spec.name = "p" + std::to_string(p);
      spec.shape = shapes[p];
      spec.init = [p, scale](float* d, size_t n) {
        for (size_t i = 0; i < n; ++i) d[i] = scale * testing::HashUniform(77, p, i);
      };
      ids.push_back(engine->RegisterParameter(spec).value());
    }
    EXPECT_TRUE(engine->FinishRegistration().ok());
  }
  std::vector<float> Master(size_t p) {
    std::vector<float> v(engine->param(ids[p]).numel);
    EXPECT_TRUE(engine->GatherMasterParameter(ids[p], v.data()).ok());
    return v;
  }
  std::vector<std::pair<ParamId, std::string>> Mapping(const std::string& prefix = "m.") {
    std::vector<std::pair<ParamId, std::string>> m;
    for (size_t p = 0; p < ids.size(); ++p) m.push_back({ids[p], prefix + std::to_string(p)});
    return m;
  }
};

TEST(SafetensorsEngine, ExportShardsAndLoadBackExactly) {
  TempDir dir;
  Rig src(dir.path());
  const std::string out = dir.path() + "/export";
  // 2,500-byte shards: p0 (2,400 bytes) and p1 (80) together, p2 (140) and p3 (4,000) alone.
  Status s =
      SaveFromEngine(src.engine.get(), src.Mapping(), out, 2500, DType::kF32, {{"format", "pt"}});
  ASSERT_TRUE(s.ok()) << s.ToString();
  for (const char* f : {"model-00001-of-00003.safetensors", "model-00002-of-00003.safetensors",
                        "model-00003-of-00003.safetensors", "model.safetensors.index.json"}) {
    struct stat st {};
    ASSERT_EQ(stat((out + "/" + f).c_str(), &st), 0) << f;
    EXPECT_EQ(st.st_mode & 0777, 0600u) << f;
  }
  Result<Checkpoint> ck = OpenCheckpoint(out);
  ASSERT_TRUE(ck.ok()) << ck.status().ToString();
  EXPECT_EQ(ck->files.size(), 3u);
  EXPECT_EQ(ck->files[0].metadata.at("format"), "pt");
  EXPECT_EQ(ck->tensors.at("m.2").shape, (std::vector<int64_t>{7, 1, 5}));
  EXPECT_EQ(ck->files[0].data_start % 8, 0u) << "data 8-byte aligned";
  TempDir dir2;
  Rig dst(dir2.path(), false, 0.25f);
  ASSERT_NE(dst.Master(0), src.Master(0));
  s = LoadIntoEngine(dst.engine.get(), *ck, dst.Mapping());
  ASSERT_TRUE(s.ok()) << s.ToString();
  for (size_t p = 0; p < src.ids.size(); ++p) EXPECT_EQ(dst.Master(p), src.Master(p)) << p;

  // BF16: round to nearest even of the masters; a re-export as one file removes the shards.
  s = SaveFromEngine(src.engine.get(), src.Mapping(), out, 1 << 20, DType::kBF16);
  ASSERT_TRUE(s.ok()) << s.ToString();
  EXPECT_FALSE(std::filesystem::exists(out + "/model.safetensors.index.json"));
  EXPECT_FALSE(std::filesystem::exists(out + "/model-00001-of-00003.safetensors"));
  Result<Checkpoint> one = OpenCheckpoint(out);
  ASSERT_TRUE(one.ok()) << one.status().ToString();
  EXPECT_EQ(one->tensors.at("m.3").dtype, DType::kBF16);
  std::vector<float> got(1000);
  ASSERT_TRUE(ReadTensorF32(*one, one->tensors.at("m.3"), got.data()).ok());
  std::vector<float> want = src.Master(3);
  for (float& x : want) x = Bf16ToFp32(Fp32ToBf16(x));
  EXPECT_EQ(got, want);
}

TEST(SafetensorsEngine, HostTensorsAreWrittenAfterTheParametersAsTheyAre) {
  // A model's buffers: an F32 running mean and an I64 counter, in the shard after the last
  // parameter; the header keeps their dtypes and the bytes are the ones given.
  TempDir dir;
  Rig src(dir.path());
  const std::string out = dir.path() + "/export";
  std::vector<float> mean = {0.5f, -1.25f, 3.0f};
  int64_t count = 7;
  std::vector<HostTensor> extra = {{"bn.running_mean", DType::kF32, {3}, mean.data()},
                                   {"bn.num_batches_tracked", DType::kI64, {}, &count}};
  Status s = SaveFromEngine(src.engine.get(), src.Mapping(), out, 2500, DType::kF32, {}, extra);
  ASSERT_TRUE(s.ok()) << s.ToString();
  Result<Checkpoint> ck = OpenCheckpoint(out);
  ASSERT_TRUE(ck.ok()) << ck.status().ToString();
  const TensorInfo& m = ck->tensors.at("bn.running_mean");
  const TensorInfo& c = ck->tensors.at("bn.num_batches_tracked");
  EXPECT_EQ(m.dtype, DType::kF32);
  EXPECT_EQ(c.dtype, DType::kI64);
  EXPECT_TRUE(c.shape.empty());
  // After the last parameter: p3 (4,000 bytes) fills a shard, so the buffers get the fourth.
  EXPECT_EQ(ck->files[m.file].path, out + "/model-00004-of-00004.safetensors");
  EXPECT_EQ(ck->files[c.file].path, out + "/model-00004-of-00004.safetensors");
  std::vector<float> got(3);
  ASSERT_TRUE(ReadTensorF32(*ck, m, got.data()).ok());
  EXPECT_EQ(got, mean);
  int64_t back = 0;
  const int fd = open(ck->files[c.file].path.c_str(), O_RDONLY);
  ASSERT_GE(fd, 0);
  ASSERT_EQ(pread(fd, &back, 8, static_cast<off_t>(c.offset)), 8);
  close(fd);
  EXPECT_EQ(back, 7);
  // A name used twice (a buffer named like a parameter) is refused before anything is written.
  extra[0].name = "m.1";
  s = SaveFromEngine(src.engine.get(), src.Mapping(), dir.path() + "/twice", 2500, DType::kF32, {},
                     extra);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_FALSE(std::filesystem::exists(dir.path() + "/twice"));
}

TEST(SafetensorsEngine, BadCheckpointsAreOneErrorAndChangeNothing) {
  TempDir dir;
  Rig src(dir.path());
  const std::string out = dir.path() + "/export";
  ASSERT_TRUE(SaveFromEngine(src.engine.get(), src.Mapping(), out, 2500, DType::kF32).ok());
  TempDir dir2;
  Rig dst(dir2.path(), false, 0.25f);
  std::vector<std::vector<float>> before;
  for (size_t p = 0; p < dst.ids.size(); ++p) before.push_back(dst.Master(p));
  Result<Checkpoint> ck = OpenCheckpoint(out);
  ASSERT_TRUE(ck.ok());

  // A name the checkpoint lacks.
  auto mapping = dst.Mapping();
  mapping[3].second = "m.99";
  Status s = LoadIntoEngine(dst.engine.get(), *ck, mapping);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("'m.99'"), std::string::npos) << s.ToString();
  // Another shape: p1 ([20]) from m.0 ([30, 20]).
  mapping = dst.Mapping();
  mapping[1].second = "m.0";
  s = LoadIntoEngine(dst.engine.get(), *ck, mapping);
  EXPECT_NE(s.message().find("[30, 20]"), std::string::npos) << s.ToString();
  EXPECT_NE(s.message().find("[20]"), std::string::npos) << s.ToString();
  // An integer tensor.
  const std::string ints = dir.path() + "/ints.safetensors";
  WriteRaw(ints, R"({"m.1":{"dtype":"I64","shape":[20],"data_offsets":[0,160]}})",
           std::string(160, '\0'));
  Result<Checkpoint> ick = OpenCheckpoint(ints);
  ASSERT_TRUE(ick.ok());
  s = LoadIntoEngine(dst.engine.get(), *ick, {{dst.ids[1], "m.1"}});
  EXPECT_NE(s.message().find("I64"), std::string::npos) << s.ToString();
  // A shard truncated after the headers were read: the load stops with the error naming the
  // file (the engine then refuses to train: values may be half-loaded).
  for (size_t p = 0; p < dst.ids.size(); ++p) EXPECT_EQ(dst.Master(p), before[p]) << p;
  const std::string shard3 = out + "/model-00003-of-00003.safetensors";
  ASSERT_EQ(truncate(shard3.c_str(), 100), 0);
  Result<Checkpoint> torn = OpenCheckpoint(out);
  ASSERT_FALSE(torn.ok()) << "a truncated shard must fail at open";
  EXPECT_NE(torn.status().message().find("model-00003-of-00003"), std::string::npos)
      << torn.status().ToString();
  s = LoadIntoEngine(dst.engine.get(), *ck, dst.Mapping());
  EXPECT_FALSE(s.ok());
  EXPECT_NE(s.message().find("'p3'"), std::string::npos) << s.ToString();
}

TEST(SafetensorsEngine, TheTemporaryFileNeverFollowsAPlantedLink) {
  TempDir dir;
  Rig src(dir.path());
  const std::string out = dir.path() + "/export";
  ASSERT_EQ(mkdir(out.c_str(), 0700), 0);
  const std::string victim = dir.path() + "/victim.txt";
  std::ofstream(victim) << "precious";
  ASSERT_EQ(symlink(victim.c_str(), (out + "/model.safetensors.tmp").c_str()), 0);
  ASSERT_TRUE(SaveFromEngine(src.engine.get(), src.Mapping(), out, 1 << 20, DType::kF32).ok());
  std::ifstream in(victim);
  std::string text;
  in >> text;
  EXPECT_EQ(text, "precious");
  EXPECT_TRUE(OpenCheckpoint(out).ok());
}

}  // namespace
}  // namespace zinf::safetensors

namespace zinf::safetensors {
namespace {

TEST(SafetensorsEngine, AnExportNeverReplacesACheckpointZinfDidNotWrite) {
  TempDir dir;
  Rig src(dir.path());
  const std::string out = dir.path() + "/hf";
  ASSERT_EQ(mkdir(out.c_str(), 0700), 0);
  std::vector<float> a = {1, 2};
  WriteRaw(out + "/model-00001-of-00002.safetensors",
           R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})", Bytes(a));
  Status s = SaveFromEngine(src.engine.get(), src.Mapping(), out, 2500, DType::kF32);
  EXPECT_EQ(s.code(), StatusCode::kFailedPrecondition) << s.ToString();
  EXPECT_NE(s.message().find("model-00001-of-00002.safetensors"), std::string::npos);
  EXPECT_TRUE(std::filesystem::exists(out + "/model-00001-of-00002.safetensors"));
  // A file of another name is not ours to touch either way.
  const std::string mine = dir.path() + "/mine";
  ASSERT_EQ(mkdir(mine.c_str(), 0700), 0);
  std::ofstream(mine + "/model-notes.safetensors") << "x";
  ASSERT_TRUE(SaveFromEngine(src.engine.get(), src.Mapping(), mine, 2500, DType::kF32).ok());
  ASSERT_TRUE(SaveFromEngine(src.engine.get(), src.Mapping(), mine, 1 << 20, DType::kF32).ok());
  EXPECT_TRUE(std::filesystem::exists(mine + "/model-notes.safetensors"));
  Result<Checkpoint> ck = OpenCheckpoint(mine);
  ASSERT_TRUE(ck.ok()) << ck.status().ToString();
  EXPECT_EQ(ck->files.size(), 1u);
  EXPECT_EQ(ck->files[0].metadata.at("zinf_export"), "1");
}

}  // namespace
}  // namespace zinf::safetensors

namespace zinf::safetensors {
namespace {

// A weight that is NaN or infinite would train into NaN and reach every checkpoint: the load
// is refused naming the tensor, the element and what it holds (it used to load silently).
TEST(SafetensorsEngine, NonFiniteValuesAreRefusedNamingTheTensor) {
  TempDir dir;
  Rig dst(dir.path(), false, 0.25f);
  for (float bad : {std::nanf(""), INFINITY, -INFINITY}) {
    std::vector<float> values(20, 0.5f);
    values[7] = bad;
    const std::string path = dir.path() + "/bad.safetensors";
    WriteRaw(path, R"({"m.1":{"dtype":"F32","shape":[20],"data_offsets":[0,80]}})", Bytes(values));
    Result<Checkpoint> ck = OpenCheckpoint(path);
    ASSERT_TRUE(ck.ok()) << ck.status().ToString();
    Status s = LoadIntoEngine(dst.engine.get(), *ck, {{dst.ids[1], "m.1"}});
    EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << s.ToString();
    EXPECT_NE(s.message().find("'m.1'"), std::string::npos) << s.ToString();
    EXPECT_NE(s.message().find("element 7"), std::string::npos) << s.ToString();
    EXPECT_NE(s.message().find(std::isnan(bad) ? "NaN" : (bad > 0 ? "is inf" : "-inf")),
              std::string::npos)
        << s.ToString();
  }
}

// A FIFO named like a safetensors file is refused at once, never read (a read would block).
TEST(SafetensorsHeader, AFifoIsRefusedNotReadFrom) {
  TempDir dir;
  const std::string fifo = dir.path() + "/model.safetensors";
  ASSERT_EQ(mkfifo(fifo.c_str(), 0600), 0);
  Result<Checkpoint> ck = OpenCheckpoint(fifo);
  ASSERT_FALSE(ck.ok());
  EXPECT_EQ(ck.status().code(), StatusCode::kInvalidArgument) << ck.status().ToString();
  EXPECT_NE(ck.status().message().find("FIFO"), std::string::npos) << ck.status().ToString();
}

}  // namespace
}  // namespace zinf::safetensors
