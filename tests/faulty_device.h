// Failure injection around a Device and a Communicator (next to nvme's FaultyBackend): a
// chosen call of a chosen kind, optionally on a named stream, fails with an injected error;
// every other call goes to the wrapped object.
#pragma once

#include <atomic>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <utility>

#include "zinf/comm.h"
#include "zinf/device.h"

namespace zinf {
namespace testing {

enum class DeviceOp {
  kCopyHostToDevice,
  kCopyDeviceToHost,
  kCopyDeviceToDevice,
  kLaunchHostFunc,
  kRecordEvent,
  kStreamWaitEvent,
  kSynchronizeEvent,
  kSynchronizeStream,
  kConvertToBf16,
  kAddInto,
  kSumSquares,
  kQuantizeInt8,
  kDequantizeInt8,
};

class FaultyDevice : public Device {
 public:
  explicit FaultyDevice(std::unique_ptr<Device> inner) : inner_(std::move(inner)) {}

  // From now on, calls of kind `op` (on the stream named `stream`, when not empty) are
  // counted; the one after `skip` of them fails once with IoError naming the injection.
  void FailAfter(DeviceOp op, const std::string& stream, int skip) {
    std::lock_guard<std::mutex> lock(mu_);
    armed_ = true;
    op_ = op;
    stream_ = stream;
    left_ = skip;
  }
  int injected() const { return injected_.load(); }
  // Calls of kind `op` made on the stream named `stream` (armed or not), for tests of where
  // the engine issues its work.
  int calls(DeviceOp op, const std::string& stream) const {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = calls_.find({op, stream});
    return it == calls_.end() ? 0 : it->second;
  }

  std::string Name() const override { return "faulty " + inner_->Name(); }
  DeviceCaps Caps() const override { return inner_->Caps(); }
  Result<void*> Alloc(size_t bytes) override { return inner_->Alloc(bytes); }
  void Free(void* ptr) override { inner_->Free(ptr); }
  DeviceMemoryInfo MemoryInfo() const override { return inner_->MemoryInfo(); }
  Status TrimMemory() override { return inner_->TrimMemory(); }
  Status RestoreMemory() override { return inner_->RestoreMemory(); }
  Stream* ComputeStream() override { return inner_->ComputeStream(); }
  Result<Stream*> CreateStream(const std::string& name) override {
    return inner_->CreateStream(name);
  }
  Status CopyHostToDevice(void* dst, const void* src, size_t bytes, Stream* s) override {
    ZINF_RETURN_IF_ERROR(Inject(DeviceOp::kCopyHostToDevice, s));
    return inner_->CopyHostToDevice(dst, src, bytes, s);
  }
  Status CopyDeviceToHost(void* dst, const void* src, size_t bytes, Stream* s) override {
    ZINF_RETURN_IF_ERROR(Inject(DeviceOp::kCopyDeviceToHost, s));
    return inner_->CopyDeviceToHost(dst, src, bytes, s);
  }
  Status CopyDeviceToDevice(void* dst, const void* src, size_t bytes, Stream* s) override {
    ZINF_RETURN_IF_ERROR(Inject(DeviceOp::kCopyDeviceToDevice, s));
    return inner_->CopyDeviceToDevice(dst, src, bytes, s);
  }
  Status LaunchHostFunc(Stream* s, std::function<void()> fn) override {
    ZINF_RETURN_IF_ERROR(Inject(DeviceOp::kLaunchHostFunc, s));
    return inner_->LaunchHostFunc(s, std::move(fn));
  }
  Result<std::unique_ptr<Event>> CreateEvent() override { return inner_->CreateEvent(); }
  Status RecordEvent(Event* e, Stream* s) override {
    ZINF_RETURN_IF_ERROR(Inject(DeviceOp::kRecordEvent, s));
    return inner_->RecordEvent(e, s);
  }
  Status StreamWaitEvent(Stream* s, Event* e) override {
    ZINF_RETURN_IF_ERROR(Inject(DeviceOp::kStreamWaitEvent, s));
    return inner_->StreamWaitEvent(s, e);
  }
  Status SynchronizeEvent(Event* e) override {
    ZINF_RETURN_IF_ERROR(Inject(DeviceOp::kSynchronizeEvent, nullptr));
    return inner_->SynchronizeEvent(e);
  }
  bool EventDone(Event* e) override { return inner_->EventDone(e); }
  Status SynchronizeStream(Stream* s) override {
    ZINF_RETURN_IF_ERROR(Inject(DeviceOp::kSynchronizeStream, s));
    return inner_->SynchronizeStream(s);
  }
  Status RegisterHostMemory(void* ptr, size_t bytes) override {
    return inner_->RegisterHostMemory(ptr, bytes);
  }
  Status UnregisterHostMemory(void* ptr) override { return inner_->UnregisterHostMemory(ptr); }
  Status ConvertToBf16(uint16_t* dst, const float* src, size_t n, Stream* s) override {
    ZINF_RETURN_IF_ERROR(Inject(DeviceOp::kConvertToBf16, s));
    return inner_->ConvertToBf16(dst, src, n, s);
  }
  Status AddInto(float* dst, const float* src, size_t n, Stream* s) override {
    ZINF_RETURN_IF_ERROR(Inject(DeviceOp::kAddInto, s));
    return inner_->AddInto(dst, src, n, s);
  }
  Status QuantizeInt8(void* dst, const void* src, ParamCopyType type, size_t n, size_t block,
                      Stream* s) override {
    ZINF_RETURN_IF_ERROR(Inject(DeviceOp::kQuantizeInt8, s));
    return inner_->QuantizeInt8(dst, src, type, n, block, s);
  }
  Status DequantizeInt8(void* dst, ParamCopyType type, const void* src, size_t n, size_t block,
                        Stream* s) override {
    ZINF_RETURN_IF_ERROR(Inject(DeviceOp::kDequantizeInt8, s));
    return inner_->DequantizeInt8(dst, type, src, n, block, s);
  }
  Status QuantizeInt4(void* dst, const float* src, size_t n, size_t block, Stream* s) override {
    ZINF_RETURN_IF_ERROR(Inject(DeviceOp::kQuantizeInt8, s));  // (the same kind of kernel)
    return inner_->QuantizeInt4(dst, src, n, block, s);
  }
  Status DequantizeInt4(float* dst, const void* src, size_t n, size_t block, Stream* s) override {
    ZINF_RETURN_IF_ERROR(Inject(DeviceOp::kDequantizeInt8, s));
    return inner_->DequantizeInt4(dst, src, n, block, s);
  }
  Status SumSquares(const float* x, size_t n, GradStats* out_host, Stream* s) override {
    ZINF_RETURN_IF_ERROR(Inject(DeviceOp::kSumSquares, s));
    return inner_->SumSquares(x, n, out_host, s);
  }
  Status OptimizerStep(const OptimizerHyperParams& hp, const OptimizerTensors& t,
                       Stream* s) override {
    return inner_->OptimizerStep(hp, t, s);
  }

 private:
  Status Inject(DeviceOp op, Stream* s) {
    std::lock_guard<std::mutex> lock(mu_);
    ++calls_[{op, s == nullptr ? std::string() : s->name()}];
    if (!armed_ || op != op_) return Status::OK();
    if (!stream_.empty() && (s == nullptr || s->name() != stream_)) return Status::OK();
    if (left_-- > 0) return Status::OK();
    armed_ = false;
    ++injected_;
    return Status::IoError("injected device failure (test)");
  }

  std::unique_ptr<Device> inner_;
  mutable std::mutex mu_;
  std::map<std::pair<DeviceOp, std::string>, int> calls_;  // guarded by mu_
  bool armed_ = false;
  DeviceOp op_ = DeviceOp::kLaunchHostFunc;
  std::string stream_;
  int left_ = 0;
  std::atomic<int> injected_{0};
};

enum class CommOp { kAllGather, kReduceScatterSum, kAllReduceSum, kAllToAll };

// Fails the collective after `skip` calls of kind `op` on this rank, once, without taking part
// in it (the other ranks wait for it until their communicator's timeout).
class FaultyComm : public Communicator {
 public:
  explicit FaultyComm(std::unique_ptr<Communicator> inner) : inner_(std::move(inner)) {}
  void FailAfter(CommOp op, int skip) {
    armed_ = true;
    op_ = op;
    left_ = skip;
  }
  int injected() const { return injected_; }

  int rank() const override { return inner_->rank(); }
  int world_size() const override { return inner_->world_size(); }
  Status AllGather(const void* send, void* recv, size_t bytes, Stream* s) override {
    ZINF_RETURN_IF_ERROR(Inject(CommOp::kAllGather));
    return inner_->AllGather(send, recv, bytes, s);
  }
  Status AllToAll(const void* send, void* recv, size_t bytes, Stream* s) override {
    ZINF_RETURN_IF_ERROR(Inject(CommOp::kAllToAll));
    return inner_->AllToAll(send, recv, bytes, s);
  }
  Status ReduceScatterSum(const float* send, float* recv, size_t count, Stream* s) override {
    ZINF_RETURN_IF_ERROR(Inject(CommOp::kReduceScatterSum));
    return inner_->ReduceScatterSum(send, recv, count, s);
  }
  Status AllReduceSum(float* buf, size_t count, Stream* s) override {
    ZINF_RETURN_IF_ERROR(Inject(CommOp::kAllReduceSum));
    return inner_->AllReduceSum(buf, count, s);
  }
  Status Broadcast(void* buf, size_t bytes, int root, Stream* s) override {
    return inner_->Broadcast(buf, bytes, root, s);
  }
  Status Barrier() override { return inner_->Barrier(); }

 private:
  Status Inject(CommOp op) {
    if (!armed_ || op != op_) return Status::OK();
    if (left_-- > 0) return Status::OK();
    armed_ = false;
    ++injected_;
    return Status::IoError("injected collective failure on rank " + std::to_string(rank()) +
                           " (test)");
  }

  std::unique_ptr<Communicator> inner_;
  bool armed_ = false;  // the rank's own thread only
  CommOp op_ = CommOp::kAllGather;
  int left_ = 0;
  int injected_ = 0;
};

}  // namespace testing
}  // namespace zinf
