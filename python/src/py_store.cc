#include "python/src/py_store.h"

#include <pybind11/chrono.h>
#include <pybind11/stl.h>

#include <utility>

#include "python/src/binding_util.h"

namespace zinf::python {
namespace {

// Calls into the Python store under the GIL (the callers are NewGlooComm / NcclComm's
// bootstrap, on the thread that creates the engine); a Python exception becomes a Status.
class PyStore final : public KeyValueStore {
 public:
  explicit PyStore(py::object store) : store_(std::move(store)) {}
  ~PyStore() override {
    py::gil_scoped_acquire gil;
    store_ = py::object();
  }

  Status Set(const std::string& key, const std::string& value) override {
    py::gil_scoped_acquire gil;
    try {
      store_.attr("set")(key, py::bytes(value));
      return Status::OK();
    } catch (const py::error_already_set& e) {
      return Status::FailedPrecondition("rendezvous store: setting '" + key +
                                        "' failed: " + e.what());
    }
  }

  Result<std::string> Get(const std::string& key, std::chrono::milliseconds timeout) override {
    py::gil_scoped_acquire gil;
    try {
      py::list keys;
      keys.append(key);
      store_.attr("wait")(keys, timeout);
      return store_.attr("get")(key).cast<std::string>();
    } catch (const py::error_already_set& e) {
      return Status::FailedPrecondition(
          "rendezvous store: waiting " + std::to_string(timeout.count() / 1000.0) + " s for '" +
          key + "' failed (is every rank of the group started?): " + e.what());
    }
  }

 private:
  py::object store_;
};

}  // namespace

ProcessGroupOptions GroupFromPython(const py::object& group) {
  ProcessGroupOptions o;
  if (group.is_none()) return o;
  const py::dict d = group.cast<py::dict>();
  o.rank = d["rank"].cast<int>();
  o.world_size = d["world_size"].cast<int>();
  if (d.contains("local_rank")) o.local_rank = d["local_rank"].cast<int>();
  if (d.contains("local_world_size")) o.local_world_size = d["local_world_size"].cast<int>();
  if (d.contains("prefix")) o.prefix = d["prefix"].cast<std::string>();
  if (d.contains("timeout_seconds")) {
    o.timeout =
        std::chrono::milliseconds(static_cast<int64_t>(d["timeout_seconds"].cast<double>() * 1000));
  }
  if (d.contains("master_addr")) o.master_addr = d["master_addr"].cast<std::string>();
  if (d.contains("listen_addr")) o.listen_addr = d["listen_addr"].cast<std::string>();
  if (d.contains("store") && !d["store"].is_none()) {
    o.store = std::make_shared<PyStore>(py::reinterpret_borrow<py::object>(d["store"]));
  } else if (o.world_size > 1) {
    Throw(Status::InvalidArgument("a group of " + std::to_string(o.world_size) +
                                  " processes needs a rendezvous store"));
  }
  return o;
}

}  // namespace zinf::python
