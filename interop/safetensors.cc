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

Status SaveFromEngine(Engine* engine, const std::vector<std::pair<ParamId, std::string>>& mapping,
                      const std::string& dir, uint64_t shard_bytes, DType dtype,
                      const std::map<std::string, std::string>& metadata,
                      const std::vector<HostTensor>& extra) {
  namespace fs = std::filesystem;
  if (engine == nullptr) return Status::InvalidArgument("SaveFromEngine: no engine");
  if (dtype != DType::kF32 && dtype != DType::kBF16) {
    return Status::InvalidArgument(std::string("export dtype ") + DTypeName(dtype) +
                                   ": F32 or BF16");
  }
  if (shard_bytes == 0) return Status::InvalidArgument("the shard size must be positive");
  const size_t esize = DTypeSize(dtype);
  // Shards: consecutive tensors up to shard_bytes of data each. Entry i < mapping.size() is
  // a parameter, the rest are the `extra` host tensors.
  struct Shard {
    std::vector<size_t> entries;
    uint64_t bytes = 0;
  };
  std::vector<Shard> shards;
  std::set<std::string> names;
  size_t largest = 0;
  auto numel_of = [](const std::vector<int64_t>& shape) {
    uint64_t n = 1;
    for (int64_t d : shape) n *= static_cast<uint64_t>(d);
    return n;
  };
  for (const HostTensor& t : extra) {
    for (int64_t d : t.shape) {
      if (d < 0) return Status::InvalidArgument("tensor '" + t.name + "': a negative dimension");
    }
    if (t.data == nullptr && numel_of(t.shape) > 0) {
      return Status::InvalidArgument("tensor '" + t.name + "': no data");
    }
  }
  for (size_t i = 0; i < mapping.size() + extra.size(); ++i) {
    const bool param = i < mapping.size();
    const std::string& name = param ? mapping[i].second : extra[i - mapping.size()].name;
    if (param && mapping[i].first >= engine->num_params()) {
      return Status::InvalidArgument("unknown parameter id " + std::to_string(mapping[i].first));
    }
    if (name.empty() || name == "__metadata__" || !names.insert(name).second) {
      return Status::InvalidArgument("tensor name '" + name + "' is empty, reserved or repeated");
    }
    const HostTensor* host = param ? nullptr : &extra[i - mapping.size()];
    const uint64_t bytes = param ? engine->param(mapping[i].first).numel * esize
                                 : numel_of(host->shape) * DTypeSize(host->dtype);
    if (param) largest = std::max<size_t>(largest, engine->param(mapping[i].first).numel);
    if (shards.empty() ||
        (shards.back().bytes + bytes > shard_bytes && !shards.back().entries.empty())) {
      shards.emplace_back();
    }
    shards.back().entries.push_back(i);
    shards.back().bytes += bytes;
  }
  const bool writer = engine->rank() == 0;
  std::vector<std::string> files;
  for (size_t k = 0; k < shards.size(); ++k) {
    char name[64];
    std::snprintf(name, sizeof(name), "model-%05zu-of-%05zu.safetensors", k + 1, shards.size());
    files.push_back(shards.size() == 1 ? "model.safetensors" : name);
  }
  Status local;
  if (writer) {
    std::error_code ec;
    fs::create_directories(dir, ec);
    if (ec) local = Status::IoError("creating " + dir + ": " + ec.message());
    // A checkpoint already there is replaced only when zinf wrote it (its files carry the
    // marker); its index (or single file) goes first, so that an export that fails part-way
    // never leaves an index over a mix of old and new shards.
    if (local.ok()) local = PrepareExportFolder(dir);
  }
  std::vector<float> values(std::max<size_t>(largest, 1));
  std::vector<uint16_t> half(dtype == DType::kBF16 ? values.size() : 0);
  uint64_t total = 0;
  for (size_t k = 0; k < shards.size(); ++k) {
    AtomicFile out;
    uint64_t data_start = 0;
    if (writer && local.ok()) {
      json header = json::object();
      header["__metadata__"] = metadata;
      header["__metadata__"][kExportMarker] = "1";
      uint64_t at = 0;
      for (size_t i : shards[k].entries) {
        if (i >= mapping.size()) {
          const HostTensor& t = extra[i - mapping.size()];
          const uint64_t bytes = numel_of(t.shape) * DTypeSize(t.dtype);
          header[t.name] = {{"dtype", DTypeName(t.dtype)},
                            {"shape", t.shape},
                            {"data_offsets", {at, at + bytes}}};
          at += bytes;
          continue;
        }
        const ParamInfo& p = engine->param(mapping[i].first);
        header[mapping[i].second] = {{"dtype", DTypeName(dtype)},
                                     {"shape", p.shape},
                                     {"data_offsets", {at, at + p.numel * esize}}};
        at += p.numel * esize;
      }
      std::string text;
      try {
        text = header.dump();
      } catch (const json::exception& e) {
        local = Status::InvalidArgument(std::string("a tensor name or metadata string is not "
                                                    "valid UTF-8 (") +
                                        e.what() + ")");
      }
      text.resize((text.size() + 7) / 8 * 8, ' ');  // data 8-byte aligned
      unsigned char len[8];
      for (int b = 0; b < 8; ++b) len[b] = static_cast<unsigned char>(text.size() >> (8 * b));
      if (local.ok()) local = out.Create(dir + "/" + files[k]);
      if (local.ok()) local = PwriteAll(out.fd(), len, 8, 0, out.tmp());
      if (local.ok()) local = PwriteAll(out.fd(), text.data(), text.size(), 8, out.tmp());
      data_start = 8 + text.size();
    }
    uint64_t at = data_start;
    for (size_t i : shards[k].entries) {
      if (i >= mapping.size()) {
        const HostTensor& t = extra[i - mapping.size()];
        const uint64_t bytes = numel_of(t.shape) * DTypeSize(t.dtype);
        if (!writer || !local.ok()) continue;
        if (bytes > 0) local = PwriteAll(out.fd(), t.data, bytes, at, out.tmp());
        at += bytes;
        continue;
      }
      const auto& [id, name] = mapping[i];
      const size_t n = engine->param(id).numel;
      // Collective: every rank gathers, whatever happened to rank 0's file.
      Status g = engine->GatherMasterParameter(id, values.data());
      if (!g.ok()) return g.WithContext("exporting '" + name + "'");
      if (!writer || !local.ok()) continue;
      const void* src = values.data();
      if (dtype == DType::kBF16) {
        for (size_t e = 0; e < n; ++e) half[e] = Fp32ToBf16(values[e]);
        src = half.data();
      }
      local = PwriteAll(out.fd(), src, n * esize, at, out.tmp());
      at += n * esize;
    }
    if (writer && local.ok()) local = out.Commit();
    total += shards[k].bytes;
  }
  if (!writer || !local.ok()) return local;
  if (shards.size() > 1) {
    json index;
    index["metadata"] = {{"total_size", total}};
    index["weight_map"] = json::object();
    for (size_t k = 0; k < shards.size(); ++k) {
      for (size_t i : shards[k].entries) {
        const std::string& name =
            i < mapping.size() ? mapping[i].second : extra[i - mapping.size()].name;
        index["weight_map"][name] = files[k];
      }
    }
    AtomicFile out;
    std::string text;
    try {
      text = index.dump(2) + "\n";
    } catch (const json::exception& e) {
      return Status::InvalidArgument(std::string("a tensor name is not valid UTF-8 (") + e.what() +
                                     ")");
    }
    ZINF_RETURN_IF_ERROR(out.Create(dir + "/model.safetensors.index.json"));
    ZINF_RETURN_IF_ERROR(PwriteAll(out.fd(), text.data(), text.size(), 0, out.tmp()));
    ZINF_RETURN_IF_ERROR(out.Commit());
  }
  // Shards of an earlier zinf export that this one does not consist of: removed.
  std::set<std::string> keep(files.begin(), files.end());
  for (const std::string& n : ExportFilesIn(dir)) {
    if (keep.count(n) != 0 || n == "model.safetensors.index.json") continue;
    std::error_code rm;
    fs::remove(dir + "/" + n, rm);
    if (rm) LogWarning("could not remove the stale export file " + dir + "/" + n);
  }
  return FsyncPath(dir, /*directory=*/true);
}

}  // namespace zinf::safetensors
