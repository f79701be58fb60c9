#include "python/src/activation_swap.h"

#include <algorithm>
#include <utility>

#include "python/src/binding_util.h"
#include "zinf/align.h"
#include "zinf/log.h"

namespace zinf::python {
namespace {

// An arena block handed to torch; freeing the tensor returns it to the arena.
struct Block {
  std::shared_ptr<PinnedArena> arena;  // declared first: outlives the buffer
  PinnedBuffer buffer;
  int64_t shape[1] = {0};
  DLManagedTensor managed{};
};

}  // namespace

ActivationSwap::ActivationSwap(const std::vector<std::string>& paths, uint64_t buffer_bytes,
                               const std::string& backend, uint32_t block_size,
                               uint32_t queue_depth) {
  PinnedArenaOptions ao;
  ao.bytes = buffer_bytes;
  arena_ = std::shared_ptr<PinnedArena>(Take(PinnedArena::Create(ao)));
  SwapStoreOptions so;
  so.paths = paths;
  so.remove_on_close = true;
  so.backend = Take(ParseIoBackendKind(backend));
  so.backend_options.queue_depth = queue_depth;
  so.block_size = block_size;
  so.chunk_size = std::max<uint64_t>(RoundUp(block_size, 4096), 4096);
  so.registered_regions = {arena_->region()};
  store_ = Take(SwapStore::Open(so));
}

ActivationSwap::~ActivationSwap() {
  if (store_) {
    Status s = store_->Close();
    if (!s.ok()) LogWarning("closing the activation swap store: " + s.ToString());
  }
}

void ActivationSwap::Close() {
  std::unique_ptr<SwapStore> store = std::move(store_);
  if (store) WithoutGil([&] { return store->Close(); });
}

py::object ActivationSwap::Buffer(uint64_t bytes) {
  Result<PinnedBuffer> got = arena_->Allocate(std::max<uint64_t>(bytes, 1));
  if (!got.ok()) {
    if (got.status().code() == StatusCode::kResourceExhausted) return py::none();
    Throw(got.status());
  }
  auto* block = new Block;
  block->arena = arena_;
  block->buffer = std::move(got).value();
  block->shape[0] = static_cast<int64_t>(block->buffer.capacity());
  block->managed.manager_ctx = block;
  block->managed.deleter = [](DLManagedTensor* self) {
    delete static_cast<Block*>(self->manager_ctx);  // the block returns to the arena
  };
  return MakeCapsule(&block->managed, block->buffer.data(), DLDevice{1, 0},
                     DLDataType{1, 8, 1} /* kDLUInt */, block->shape);
}

Ticket ActivationSwap::Write(const std::string& key, uintptr_t ptr, uint64_t size,
                             uint64_t capacity) {
  Open();
  return WithoutGil(
      [&] { return store_->Write(key, reinterpret_cast<const void*>(ptr), size, capacity); });
}

Ticket ActivationSwap::Read(const std::string& key, uintptr_t ptr, uint64_t capacity, bool urgent) {
  Open();
  return WithoutGil(
      [&] { return store_->Read(key, reinterpret_cast<void*>(ptr), capacity, urgent); });
}

void ActivationSwap::Wait(Ticket ticket) {
  Open();
  WithoutGil([&] { return store_->Wait(ticket); });
}

bool ActivationSwap::Done(Ticket ticket) {
  Open();
  return store_->Done(ticket);
}

void ActivationSwap::Remove(const std::string& key) {
  Open();
  Check(store_->Remove(key));
}

uint64_t ActivationSwap::alignment() {
  Open();
  return store_->alignment();
}

py::dict ActivationSwap::Stats() {
  Open();
  const SwapStoreStats st = store_->stats();
  py::dict d;
  d["bytes_written"] = st.bytes_written;
  d["bytes_read"] = st.bytes_read;
  d["file_bytes"] = st.file_bytes;
  d["tensors"] = st.tensors;
  return d;
}

void ActivationSwap::Open() const {
  if (!store_) Throw(Status::FailedPrecondition("the activation swap store was closed"));
}

}  // namespace zinf::python
