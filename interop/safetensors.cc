#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <set>

#include "common/file_io.h"
#include "formats/safetensors_format.h"
#include "zinf/cpu_adam.h"
#include "zinf/log.h"
#include "zinf/safetensors_engine.h"

namespace zinf::safetensors {
namespace {

using nlohmann::json;

// Far above any real header (the reference implementation allows 100 MB).
constexpr uint64_t kMaxHeaderBytes = 100ull << 20;
constexpr uint64_t kMaxIndexBytes = 64ull << 20;

// Closes a file descriptor on scope exit.
struct Fd {
  int fd = -1;
  ~Fd() {
    if (fd >= 0) close(fd);
  }
};

bool PlainFileName(const std::string& name) {
  return !name.empty() && name.find('/') == std::string::npos && name != "." && name != ".." &&
         name.find('\0') == std::string::npos;
}

std::string Dirname(const std::string& path) {
  const size_t slash = path.rfind('/');
  return slash == std::string::npos ? "." : (slash == 0 ? "/" : path.substr(0, slash));
}

// A new file at `path` written through `tmp` (exclusive, no symbolic link, 0600), fsync'ed and
// renamed into place.
class AtomicFile {
 public:
  ~AtomicFile() {
    if (fd_ >= 0) {
      close(fd_);
      unlink(tmp_.c_str());
    }
  }
  Status Create(const std::string& path) {
    path_ = path;
    tmp_ = path + ".tmp";
    for (int attempt = 0; attempt < 2; ++attempt) {
      fd_ = open(tmp_.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0600);
      if (fd_ >= 0) return Status::OK();
      // A leftover of an interrupted export (or anything planted there): remove the name
      // itself (unlink never follows a symbolic link) and try once more.
      if (errno != EEXIST || unlink(tmp_.c_str()) != 0) break;
    }
    return ErrnoToStatus(errno, "creating " + tmp_);
  }
  int fd() const { return fd_; }
  const std::string& tmp() const { return tmp_; }
  Status Commit() {
    if (fsync(fd_) != 0) return ErrnoToStatus(errno, "fsync of " + tmp_);
    if (close(fd_) != 0) {
      fd_ = -1;
      return ErrnoToStatus(errno, "closing " + tmp_);
    }
    fd_ = -1;
    if (rename(tmp_.c_str(), path_.c_str()) != 0) {
      Status s = ErrnoToStatus(errno, "renaming " + tmp_ + " to " + path_);
      unlink(tmp_.c_str());
      return s;
    }
    return Status::OK();
  }

 private:
  std::string path_, tmp_;
  int fd_ = -1;
};

// In every exported file's "__metadata__": the file was written by SaveFromEngine.
constexpr const char* kExportMarker = "zinf_export";

// The names of the folder's files an export consists of: model.safetensors,
// model-NNNNN-of-NNNNN.safetensors, model.safetensors.index.json.
std::vector<std::string> ExportFilesIn(const std::string& dir) {
  namespace fs = std::filesystem;
  std::vector<std::string> out;
  std::error_code ec;
  for (const fs::directory_entry& e : fs::directory_iterator(dir, ec)) {
    const std::string n = e.path().filename().string();
    bool shard = n.size() == 32 && n.compare(0, 6, "model-") == 0 &&
                 n.compare(11, 4, "-of-") == 0 && n.compare(20, 12, ".safetensors") == 0;
    for (size_t i : {6, 7, 8, 9, 10, 15, 16, 17, 18, 19}) {
      shard = shard && n[i] >= '0' && n[i] <= '9';
    }
    if (shard || n == "model.safetensors" || n == "model.safetensors.index.json") {
      out.push_back(n);
    }
  }
  return out;
}

Status PrepareExportFolder(const std::string& dir) {
  const std::vector<std::string> present = ExportFilesIn(dir);
  for (const std::string& n : present) {
    if (n == "model.safetensors.index.json") continue;
    Result<FileHeader> h = ReadHeader(dir + "/" + n);
    if (!h.ok() || h->metadata.count(kExportMarker) == 0) {
      return Status::FailedPrecondition(
          dir + " holds " + n + ", a safetensors checkpoint zinf did not write" +
          (h.ok() ? "" : " (" + h.status().message() + ")") +
          "; export into an empty folder (or one that holds an earlier zinf export)");
    }
  }
  for (const char* first : {"model.safetensors.index.json", "model.safetensors"}) {
    const std::string path = dir + "/" + first;
    if (unlink(path.c_str()) != 0 && errno != ENOENT) {
      return ErrnoToStatus(errno, "removing the earlier export's " + path);
    }
  }
  return Status::OK();
}

std::vector<int64_t> WithoutOnes(const std::vector<int64_t>& shape) {
  std::vector<int64_t> out;
  for (int64_t d : shape) {
    if (d != 1) out.push_back(d);
  }
  return out;
}

std::string ShapeText(const std::vector<int64_t>& shape) {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + "]";
}

// A weight that is NaN or infinite would train into NaN and reach every checkpoint: refused,
// naming the tensor, the first such element and how many there are.
Status CheckFinite(const TensorInfo& t, const std::string& path, const float* v) {
  uint64_t bad = 0, first = 0;
  for (uint64_t i = 0; i < t.numel; ++i) {
    if (!std::isfinite(v[i])) {
      if (bad++ == 0) first = i;
    }
  }
  if (bad == 0) return Status::OK();
  return Status::InvalidArgument(
      "tensor '" + t.name + "' in " + path + " holds " + std::to_string(bad) +
      " non-finite value(s) (element " + std::to_string(first) + " is " +
      (std::isnan(v[first]) ? "NaN" : (v[first] > 0 ? "inf" : "-inf")) +
      "); a model trained from it would compute NaN: repair or re-export the checkpoint");
}

}  // namespace

Result<FileHeader> ReadHeader(const std::string& path) {
  Fd f;
  uint64_t size = 0;
  ZINF_ASSIGN_OR_RETURN(f.fd, OpenRegularFile(path, "safetensors file", &size));
  if (size < 8) {
    return Status::Corruption(path + ": " + std::to_string(size) +
                              " bytes, too short for a safetensors header (a truncated file)");
  }
  unsigned char len_bytes[8];
  ZINF_RETURN_IF_ERROR(PreadAll(f.fd, len_bytes, 8, 0, path, "a truncated file"));
  uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = n << 8 | len_bytes[i];
  if (n > kMaxHeaderBytes) {
    return Status::Corruption(path + ": a header of " + std::to_string(n) +
                              " bytes (at most 100 MiB; not a safetensors file?)");
  }
  if (8 + n > size) {
    return Status::Corruption(path + ": the header claims " + std::to_string(n) +
                              " bytes but the file has " + std::to_string(size) +
                              " (a truncated file)");
  }
  std::string header(static_cast<size_t>(n), '\0');
  ZINF_RETURN_IF_ERROR(PreadAll(f.fd, header.data(), header.size(), 8, path, "a truncated file"));
  return ParseHeader(header, size, path);
}

Result<Checkpoint> OpenCheckpoint(const std::string& input) {
  namespace fs = std::filesystem;
  std::string path = input;
  std::error_code ec;
  if (fs::is_directory(path, ec)) {
    if (fs::exists(path + "/model.safetensors.index.json", ec)) {
      path += "/model.safetensors.index.json";
    } else if (fs::exists(path + "/model.safetensors", ec)) {
      path += "/model.safetensors";
    } else {
      return Status::NotFound(input +
                              " holds neither model.safetensors.index.json nor "
                              "model.safetensors");
    }
  }
  Checkpoint ckpt;
  auto add_file = [&](const std::string& file) -> Status {
    ZINF_ASSIGN_OR_RETURN(FileHeader h, ReadHeader(file));
    const size_t index = ckpt.files.size();
    for (TensorInfo& t : h.tensors) {
      t.file = index;
      auto [it, inserted] = ckpt.tensors.emplace(t.name, t);
      if (!inserted) {
        return Status::Corruption("tensor '" + t.name + "' is in both " +
                                  ckpt.files[it->second.file].path + " and " + file);
      }
    }
    ckpt.files.push_back(std::move(h));
    return Status::OK();
  };
  const bool is_index = path.size() >= 5 && path.compare(path.size() - 5, 5, ".json") == 0;
  if (!is_index) {
    ZINF_RETURN_IF_ERROR(add_file(path));
    return ckpt;
  }
  ZINF_ASSIGN_OR_RETURN(std::string text, ReadSmallFile(path, kMaxIndexBytes));
  ZINF_ASSIGN_OR_RETURN(json j, ParseJsonObject(text, path));
  auto map = j.find("weight_map");
  if (map == j.end() || !map->is_object()) {
    return Status::Corruption(path + ": \"weight_map\" must be an object (tensor -> file)");
  }
  const std::string dir = Dirname(path);
  std::vector<std::string> order;
  std::map<std::string, std::string> wanted;  // tensor -> file
  for (auto it = map->begin(); it != map->end(); ++it) {
    if (!it.value().is_string() || !PlainFileName(it.value().get<std::string>())) {
      return Status::Corruption(path + ": weight_map[\"" + it.key() +
                                "\"] must be a file name in the index's folder");
    }
    const std::string file = it.value().get<std::string>();
    if (std::find(order.begin(), order.end(), file) == order.end()) order.push_back(file);
    wanted[it.key()] = file;
  }
  for (const std::string& file : order) {
    Status s = add_file(dir + "/" + file);
    if (s.code() == StatusCode::kNotFound) {
      return Status::NotFound(path + " lists the shard " + file + ", which is missing (" +
                              s.message() + ")");
    }
    ZINF_RETURN_IF_ERROR(s);
  }
  for (const auto& [tensor, file] : wanted) {
    auto it = ckpt.tensors.find(tensor);
    if (it == ckpt.tensors.end() || ckpt.files[it->second.file].path != dir + "/" + file) {
      return Status::Corruption(path + " places tensor '" + tensor + "' in " + file +
                                ", which does not hold it");
    }
  }
  return ckpt;
}

Status ReadTensorF32(const Checkpoint& ckpt, const TensorInfo& t, float* out, size_t block_bytes) {
  if (!IsFloatDType(t.dtype)) {
    return Status::InvalidArgument("tensor '" + t.name + "' is " + DTypeName(t.dtype) +
                                   "; only F32, BF16 and F16 tensors load into parameters");
  }
  if (t.file >= ckpt.files.size()) return Status::InvalidArgument("tensor of another checkpoint");
  const std::string& path = ckpt.files[t.file].path;
  Fd f;
  ZINF_ASSIGN_OR_RETURN(f.fd, OpenRegularFile(path, "safetensors file"));
  const size_t esize = DTypeSize(t.dtype);
  if (t.dtype == DType::kF32) {
    ZINF_RETURN_IF_ERROR(PreadAll(f.fd, out, t.bytes, t.offset, path, "a truncated file")
                             .WithContext("tensor '" + t.name + "'"));
    return CheckFinite(t, path, out);
  }
  const size_t per_block = std::max<size_t>(block_bytes / esize, 1);
  std::vector<uint16_t> block(std::min<uint64_t>(per_block, t.numel));
  for (uint64_t done = 0; done < t.numel;) {
    const size_t n = static_cast<size_t>(std::min<uint64_t>(per_block, t.numel - done));
    ZINF_RETURN_IF_ERROR(
        PreadAll(f.fd, block.data(), n * esize, t.offset + done * esize, path, "a truncated file")
            .WithContext("tensor '" + t.name + "'"));
    for (size_t i = 0; i < n; ++i) {
      out[done + i] = t.dtype == DType::kBF16 ? Bf16ToFp32(block[i]) : Fp16ToFp32(block[i]);
    }
    done += n;
  }
  return CheckFinite(t, path, out);
}

Status LoadIntoEngine(Engine* engine, const Checkpoint& ckpt,
                      const std::vector<std::pair<ParamId, std::string>>& mapping,
                      bool allow_reshape) {
  if (engine == nullptr) return Status::InvalidArgument("LoadIntoEngine: no engine");
  std::map<ParamId, const TensorInfo*> source;
  std::vector<ParamId> ids;
  for (const auto& [id, name] : mapping) {
    if (id >= engine->num_params()) {
      return Status::InvalidArgument("unknown parameter id " + std::to_string(id));
    }
    const ParamInfo& p = engine->param(id);
    auto it = ckpt.tensors.find(name);
    if (it == ckpt.tensors.end()) {
      return Status::InvalidArgument("the checkpoint has no tensor '" + name + "' for parameter '" +
                                     p.name + "'");
    }
    const TensorInfo& t = it->second;
    if (!IsFloatDType(t.dtype)) {
      return Status::InvalidArgument("tensor '" + name + "' is " + DTypeName(t.dtype) +
                                     ", parameter '" + p.name +
                                     "' holds floats (F32, BF16 or F16 load)");
    }
    const bool same_shape = t.shape == p.shape || WithoutOnes(t.shape) == WithoutOnes(p.shape);
    if (t.numel != p.numel || (!same_shape && !allow_reshape)) {
      return Status::InvalidArgument("tensor '" + name + "' has shape " + ShapeText(t.shape) +
                                     ", parameter '" + p.name + "' has shape " +
                                     ShapeText(p.shape) + " (a checkpoint of another model?)");
    }
    if (!source.emplace(id, &t).second) {
      return Status::InvalidArgument("parameter '" + p.name + "' is mapped twice");
    }
    ids.push_back(id);
  }
  return engine->SetParameterValues(
      ids, [&](ParamId id, float* data) { return ReadTensorF32(ckpt, *source.at(id), data); });
}

namespace {

// The tensors of one export: entry i < mapping.size() is parameter mapping[i], the rest are
// the `extra` host tensors.
struct ExportEntries {
  Engine* engine;
  const std::vector<std::pair<ParamId, std::string>>& mapping;
  const std::vector<HostTensor>& extra;
  DType dtype;   // the parameters' dtype in the files
  size_t esize;  // and its size

  size_t size() const { return mapping.size() + extra.size(); }
  bool is_param(size_t i) const { return i < mapping.size(); }
  const HostTensor& host(size_t i) const { return extra[i - mapping.size()]; }
  const std::string& name(size_t i) const { return is_param(i) ? mapping[i].second : host(i).name; }
};

// Consecutive entries of an export, up to the shard size of data (or one larger tensor).
struct ExportShard {
  std::vector<size_t> entries;
  uint64_t bytes = 0;
};

// How an export is cut into files.
struct ShardPlan {
  std::vector<ExportShard> shards;
  std::vector<std::string> files;  // shard k's file name
  size_t largest = 0;              // the most elements of one parameter
};

// The elements of a tensor of `shape` (1 for a scalar).
uint64_t NumelOf(const std::vector<int64_t>& shape) {
  uint64_t n = 1;
  for (int64_t d : shape) n *= static_cast<uint64_t>(d);
  return n;
}

// Refuses a host tensor with a negative dimension, or with elements but no data.
Status CheckHostTensors(const std::vector<HostTensor>& extra) {
  for (const HostTensor& t : extra) {
    for (int64_t d : t.shape) {
      if (d < 0) return Status::InvalidArgument("tensor '" + t.name + "': a negative dimension");
    }
    if (t.data == nullptr && NumelOf(t.shape) > 0) {
      return Status::InvalidArgument("tensor '" + t.name + "': no data");
    }
  }
  return Status::OK();
}

// Checks each entry's parameter id and name (non-empty, not reserved, not repeated) and cuts
// the entries, in order, into shards of up to `shard_bytes` of data, each with its file name.
Result<ShardPlan> PlanShards(const ExportEntries& e, uint64_t shard_bytes) {
  ShardPlan plan;
  std::set<std::string> names;
  for (size_t i = 0; i < e.size(); ++i) {
    const bool param = e.is_param(i);
    const std::string& name = e.name(i);
    if (param && e.mapping[i].first >= e.engine->num_params()) {
      return Status::InvalidArgument("unknown parameter id " + std::to_string(e.mapping[i].first));
    }
    if (name.empty() || name == "__metadata__" || !names.insert(name).second) {
      return Status::InvalidArgument("tensor name '" + name + "' is empty, reserved or repeated");
    }
    const uint64_t bytes = param ? e.engine->param(e.mapping[i].first).numel * e.esize
                                 : NumelOf(e.host(i).shape) * DTypeSize(e.host(i).dtype);
    if (param) {
      plan.largest = std::max<size_t>(plan.largest, e.engine->param(e.mapping[i].first).numel);
    }
    std::vector<ExportShard>& shards = plan.shards;
    if (shards.empty() ||
        (shards.back().bytes + bytes > shard_bytes && !shards.back().entries.empty())) {
      shards.emplace_back();
    }
    shards.back().entries.push_back(i);
    shards.back().bytes += bytes;
  }
  for (size_t k = 0; k < plan.shards.size(); ++k) {
    char name[64];
    std::snprintf(name, sizeof(name), "model-%05zu-of-%05zu.safetensors", k + 1,
                  plan.shards.size());
    plan.files.push_back(plan.shards.size() == 1 ? "model.safetensors" : name);
  }
  return plan;
}

// Rank 0: creates `dir` and readies it for the export.
Status CreateExportFolder(const std::string& dir) {
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  if (ec) return Status::IoError("creating " + dir + ": " + ec.message());
  // A checkpoint already there is replaced only when zinf wrote it (its files carry the
  // marker); its index (or single file) goes first, so that an export that fails part-way
  // never leaves an index over a mix of old and new shards.
  return PrepareExportFolder(dir);
}

// The safetensors header of `shard` (its tensors' dtypes, shapes and offsets; `metadata` with
// the export marker), padded with spaces so that the data is 8-byte aligned.
Result<std::string> ShardHeaderText(const ExportEntries& e, const ExportShard& shard,
                                    const std::map<std::string, std::string>& metadata) {
  json header = json::object();
  header["__metadata__"] = metadata;
  header["__metadata__"][kExportMarker] = "1";
  uint64_t at = 0;
  for (size_t i : shard.entries) {
    if (!e.is_param(i)) {
      const HostTensor& t = e.host(i);
      const uint64_t bytes = NumelOf(t.shape) * DTypeSize(t.dtype);
      header[t.name] = {
          {"dtype", DTypeName(t.dtype)}, {"shape", t.shape}, {"data_offsets", {at, at + bytes}}};
      at += bytes;
      continue;
    }
    const ParamInfo& p = e.engine->param(e.mapping[i].first);
    header[e.mapping[i].second] = {{"dtype", DTypeName(e.dtype)},
                                   {"shape", p.shape},
                                   {"data_offsets", {at, at + p.numel * e.esize}}};
    at += p.numel * e.esize;
  }
  std::string text;
  try {
    text = header.dump();
  } catch (const json::exception& ex) {
    return Status::InvalidArgument(std::string("a tensor name or metadata string is not "
                                               "valid UTF-8 (") +
                                   ex.what() + ")");
  }
  text.resize((text.size() + 7) / 8 * 8, ' ');  // data 8-byte aligned
  return text;
}

// Writes an export's shard files. Every rank gathers each parameter (a collective, whatever
// happened to rank 0's files); only the writer (rank 0) writes, and its first failure stops
// the writing but not the gathers, so that no rank is left waiting.
class ShardWriter {
 public:
  // `status`: the writer's so far (its folder's preparation); `largest`: the most elements of
  // one parameter (the gather buffer's size).
  ShardWriter(const ExportEntries& entries, const std::string& dir, bool writer, size_t largest,
              Status status)
      : e_(entries),
        dir_(dir),
        writer_(writer),
        status_(std::move(status)),
        values_(std::max<size_t>(largest, 1)),
        half_(entries.dtype == DType::kBF16 ? values_.size() : 0) {}

  // The writer's first failure (OK on the other ranks).
  const Status& status() const { return status_; }

  // Writes `shard` into `file` in the export folder, renamed into place once complete. Returns
  // a gather's failure, which ends the export on every rank; a write's goes to status().
  Status WriteShard(const ExportShard& shard, const std::string& file,
                    const std::map<std::string, std::string>& metadata) {
    AtomicFile out;
    uint64_t data_start = 0;
    if (writing()) data_start = StartFile(shard, file, metadata, &out);
    ZINF_RETURN_IF_ERROR(WriteTensors(shard, data_start, &out));
    if (writing()) status_ = out.Commit();
    return Status::OK();
  }

 private:
  bool writing() const { return writer_ && status_.ok(); }

  // Creates `file` and writes the header length and the header; returns where the data
  // starts. A failure goes to status_.
  uint64_t StartFile(const ExportShard& shard, const std::string& file,
                     const std::map<std::string, std::string>& metadata, AtomicFile* out) {
    Result<std::string> text = ShardHeaderText(e_, shard, metadata);
    if (!text.ok()) {
      status_ = text.status();
      return 0;  // nothing is written from here on
    }
    unsigned char len[8];
    for (int b = 0; b < 8; ++b) len[b] = static_cast<unsigned char>(text->size() >> (8 * b));
    status_ = out->Create(dir_ + "/" + file);
    if (status_.ok()) status_ = PwriteAll(out->fd(), len, 8, 0, out->tmp());
    if (status_.ok()) status_ = PwriteAll(out->fd(), text->data(), text->size(), 8, out->tmp());
    return 8 + text->size();
  }

  // The data of `shard`'s tensors, from `at` in `out`: each parameter gathered on every rank
  // (the gather's failure returned), written in the export dtype while writing() holds.
  Status WriteTensors(const ExportShard& shard, uint64_t at, AtomicFile* out) {
    for (size_t i : shard.entries) {
      if (!e_.is_param(i)) {
        const HostTensor& t = e_.host(i);
        const uint64_t bytes = NumelOf(t.shape) * DTypeSize(t.dtype);
        if (!writing()) continue;
        if (bytes > 0) status_ = PwriteAll(out->fd(), t.data, bytes, at, out->tmp());
        at += bytes;
        continue;
      }
      const auto& [id, name] = e_.mapping[i];
      const size_t n = e_.engine->param(id).numel;
      // Collective: every rank gathers, whatever happened to rank 0's file.
      Status g = e_.engine->GatherMasterParameter(id, values_.data());
      if (!g.ok()) return g.WithContext("exporting '" + name + "'");
      if (!writing()) continue;
      const void* src = values_.data();
      if (e_.dtype == DType::kBF16) {
        for (size_t k = 0; k < n; ++k) half_[k] = Fp32ToBf16(values_[k]);
        src = half_.data();
      }
      status_ = PwriteAll(out->fd(), src, n * e_.esize, at, out->tmp());
      at += n * e_.esize;
    }
    return Status::OK();
  }

  const ExportEntries& e_;
  const std::string dir_;
  const bool writer_;
  Status status_;
  std::vector<float> values_;   // one gathered parameter
  std::vector<uint16_t> half_;  // and converted to bf16
};

// Rank 0, for an export of several shards: model.safetensors.index.json, naming each tensor's
// file and the total data size.
Status WriteShardIndex(const ExportEntries& e, const ShardPlan& plan, const std::string& dir) {
  uint64_t total = 0;
  for (const ExportShard& shard : plan.shards) total += shard.bytes;
  json index;
  index["metadata"] = {{"total_size", total}};
  index["weight_map"] = json::object();
  for (size_t k = 0; k < plan.shards.size(); ++k) {
    for (size_t i : plan.shards[k].entries) index["weight_map"][e.name(i)] = plan.files[k];
  }
  AtomicFile out;
  std::string text;
  try {
    text = index.dump(2) + "\n";
  } catch (const json::exception& ex) {
    return Status::InvalidArgument(std::string("a tensor name is not valid UTF-8 (") + ex.what() +
                                   ")");
  }
  ZINF_RETURN_IF_ERROR(out.Create(dir + "/model.safetensors.index.json"));
  ZINF_RETURN_IF_ERROR(PwriteAll(out.fd(), text.data(), text.size(), 0, out.tmp()));
  return out.Commit();
}

// Rank 0: removes the shards of an earlier zinf export in `dir` that this one (`files`) does
// not consist of; one that cannot be removed is only logged.
void RemoveStaleExportFiles(const std::string& dir, const std::vector<std::string>& files) {
  std::set<std::string> keep(files.begin(), files.end());
  for (const std::string& n : ExportFilesIn(dir)) {
    if (keep.count(n) != 0 || n == "model.safetensors.index.json") continue;
    std::error_code rm;
    std::filesystem::remove(dir + "/" + n, rm);
    if (rm) LogWarning("could not remove the stale export file " + dir + "/" + n);
  }
}

}  // namespace

Status SaveFromEngine(Engine* engine, const std::vector<std::pair<ParamId, std::string>>& mapping,
                      const std::string& dir, uint64_t shard_bytes, DType dtype,
                      const std::map<std::string, std::string>& metadata,
                      const std::vector<HostTensor>& extra) {
  if (engine == nullptr) return Status::InvalidArgument("SaveFromEngine: no engine");
  if (dtype != DType::kF32 && dtype != DType::kBF16) {
    return Status::InvalidArgument(std::string("export dtype ") + DTypeName(dtype) +
                                   ": F32 or BF16");
  }
  if (shard_bytes == 0) return Status::InvalidArgument("the shard size must be positive");
  const ExportEntries entries{engine, mapping, extra, dtype, DTypeSize(dtype)};
  ZINF_RETURN_IF_ERROR(CheckHostTensors(extra));
  ZINF_ASSIGN_OR_RETURN(const ShardPlan plan, PlanShards(entries, shard_bytes));
  const bool writer = engine->rank() == 0;
  Status local;
  if (writer) local = CreateExportFolder(dir);
  // Every rank gathers the parameters; rank 0 alone writes, its first failure returned here.
  ShardWriter shard_writer(entries, dir, writer, plan.largest, std::move(local));
  for (size_t k = 0; k < plan.shards.size(); ++k) {
    ZINF_RETURN_IF_ERROR(shard_writer.WriteShard(plan.shards[k], plan.files[k], metadata));
  }
  if (!writer || !shard_writer.status().ok()) return shard_writer.status();
  if (plan.shards.size() > 1) ZINF_RETURN_IF_ERROR(WriteShardIndex(entries, plan, dir));
  RemoveStaleExportFiles(dir, plan.files);
  return FsyncPath(dir, /*directory=*/true);
}

}  // namespace zinf::safetensors
