// The C API over the C++ components (include/zinf/zinf.h).
#include <cstdlib>
#include <cstring>
#include <deque>
#include <new>
#include <string>
#include <utility>

#include "c_api/c_api_internal.h"
#include "common/thread_annotations.h"
#include "zinf/swap.h"
#include "zinf/zinf.h"

namespace zinf::capi {
namespace {
thread_local std::string g_last_error;
}  // namespace

int Fail(const std::string& message) {
  g_last_error = message;
  return -1;
}

int FromStatus(const Status& status) {
  if (status.ok()) return Succeed();
  return Fail(status.ToString());
}

int Succeed() {
  g_last_error.clear();
  return 0;
}

void RetireHandle(void* shell, void (*free_shell)(void*)) {
  // Never destroyed (like leveldb's NoDestructor): the kept shells stay reachable until the
  // process ends, so they are neither freed under a late caller nor reported as leaks.
  static Mutex* mu = new Mutex;
  static auto* kept = new std::deque<std::pair<void*, void (*)(void*)>>;  // under *mu
  MutexLock lock(mu);
  kept->emplace_back(shell, free_shell);
  while (kept->size() > 4096) {
    kept->front().second(kept->front().first);
    kept->pop_front();
  }
}

}  // namespace zinf::capi

using zinf::capi::Fail;
using zinf::capi::FromStatus;
using zinf::capi::Succeed;

struct zinf_swap_store {
  uint64_t magic = zinf::capi::kSwapStoreMagic;
  std::unique_ptr<zinf::SwapStore> store;
};

namespace {

// Whether `s` is a live swap store handle (else the failure is recorded for `fn`).
bool LiveStore(const zinf_swap_store* s, const char* fn) {
  if (s != nullptr && s->magic == zinf::capi::kSwapStoreMagic) return true;
  Fail(std::string(fn) + (s == nullptr ? ": store is NULL"
                                       : ": not a live swap store (closed already, or not a "
                                         "zinf_swap_store*)"));
  return false;
}

}  // namespace

extern "C" {

const char* zinf_last_error(void) { return zinf::capi::g_last_error.c_str(); }

void* zinf_alloc_aligned(size_t size) {
  if (size > SIZE_MAX - 4095) {
    Fail("zinf_alloc_aligned: " + std::to_string(size) + " bytes is more than any memory");
    return nullptr;
  }
  size_t rounded = zinf::RoundUp(size == 0 ? 1 : size, 4096);
  void* p = std::aligned_alloc(4096, rounded);
  if (p == nullptr) {
    Fail("zinf_alloc_aligned: out of memory for " + std::to_string(rounded) + " bytes");
  }
  return p;
}

void zinf_free_aligned(void* ptr) { std::free(ptr); }

void zinf_swap_options_init(zinf_swap_options* options) {
  if (options == nullptr) return;
  std::memset(options, 0, sizeof(*options));
}

int zinf_swap_open(const zinf_swap_options* options, zinf_swap_store** out) {
  return zinf::capi::Guarded("zinf_swap_open", [&] {
    if (options == nullptr || out == nullptr)
      return Fail("zinf_swap_open: options and out must not be NULL");
    if (options->paths == nullptr || options->num_paths == 0) {
      return Fail("zinf_swap_open: no paths given (options->paths, options->num_paths)");
    }
    zinf::SwapStoreOptions o;
    for (size_t i = 0; i < options->num_paths; ++i) {
      if (options->paths[i] == nullptr)
        return Fail("zinf_swap_open: paths[" + std::to_string(i) + "] is NULL");
      o.paths.emplace_back(options->paths[i]);
    }
    o.capacity_per_path = options->capacity_per_path;
    o.max_capacity_per_path = options->max_capacity_per_path;
    if (options->chunk_size) o.chunk_size = options->chunk_size;
    if (options->block_size) {
      if (options->block_size > (1u << 30)) return Fail("zinf_swap_open: block_size above 1 GiB");
      o.block_size = static_cast<uint32_t>(options->block_size);
    }
    if (options->queue_depth) o.backend_options.queue_depth = options->queue_depth;
    if (options->backend != nullptr) {
      zinf::Result<zinf::IoBackendKind> kind = zinf::ParseIoBackendKind(options->backend);
      if (!kind.ok()) return FromStatus(kind.status());
      o.backend = kind.value();
    }
    o.checksums = options->checksums != 0;
    o.reopen = options->reopen != 0;
    o.overwrite = options->overwrite != 0;
    zinf::Result<std::unique_ptr<zinf::SwapStore>> store = zinf::SwapStore::Open(o);
    if (!store.ok()) return FromStatus(store.status());
    auto* handle = new (std::nothrow) zinf_swap_store;
    if (handle == nullptr) return Fail("zinf_swap_open: out of memory");
    handle->store = std::move(store).value();
    *out = handle;
    return Succeed();
  });
}

int zinf_swap_write(zinf_swap_store* store, const char* key, const void* buf, size_t size,
                    size_t capacity, uint64_t* ticket) {
  if (!LiveStore(store, "zinf_swap_write")) return -1;
  if (key == nullptr || ticket == nullptr) {
    return Fail("zinf_swap_write: key and ticket must not be NULL");
  }
  return zinf::capi::Guarded("zinf_swap_write", [&] {
    zinf::Result<zinf::Ticket> t = store->store->Write(key, buf, size, capacity);
    if (!t.ok()) return FromStatus(t.status());
    *ticket = t.value();
    return Succeed();
  });
}

int zinf_swap_read(zinf_swap_store* store, const char* key, void* buf, size_t capacity,
                   uint64_t* ticket) {
  if (!LiveStore(store, "zinf_swap_read")) return -1;
  if (key == nullptr || ticket == nullptr) {
    return Fail("zinf_swap_read: key and ticket must not be NULL");
  }
  return zinf::capi::Guarded("zinf_swap_read", [&] {
    zinf::Result<zinf::Ticket> t = store->store->Read(key, buf, capacity);
    if (!t.ok()) return FromStatus(t.status());
    *ticket = t.value();
    return Succeed();
  });
}

int zinf_swap_wait(zinf_swap_store* store, uint64_t ticket) {
  if (!LiveStore(store, "zinf_swap_wait")) return -1;
  return zinf::capi::Guarded("zinf_swap_wait",
                             [&] { return FromStatus(store->store->Wait(ticket)); });
}

int64_t zinf_swap_size(zinf_swap_store* store, const char* key) {
  if (!LiveStore(store, "zinf_swap_size")) return -1;
  if (key == nullptr) {
    Fail("zinf_swap_size: key must not be NULL");
    return -1;
  }
  zinf::Result<uint64_t> size = store->store->Size(key);
  if (!size.ok()) {
    FromStatus(size.status());
    return -1;
  }
  Succeed();
  return static_cast<int64_t>(size.value());
}

int zinf_swap_remove(zinf_swap_store* store, const char* key) {
  if (!LiveStore(store, "zinf_swap_remove")) return -1;
  if (key == nullptr) return Fail("zinf_swap_remove: key must not be NULL");
  return FromStatus(store->store->Remove(key));
}

size_t zinf_swap_alignment(const zinf_swap_store* store) {
  return store == nullptr || store->magic != zinf::capi::kSwapStoreMagic
             ? 4096
             : store->store->alignment();
}

int zinf_swap_close(zinf_swap_store* store) {
  if (store == nullptr) return Succeed();
  if (!LiveStore(store, "zinf_swap_close")) return -1;
  zinf::Status s = store->store->Close();
  store->magic = 0;  // a second close, or a use after this one, is refused
  store->store.reset();
  zinf::capi::RetireHandle(store, [](void* p) { delete static_cast<zinf_swap_store*>(p); });
  return FromStatus(s);
}

}  // extern "C"
