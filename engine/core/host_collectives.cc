#include "engine/core/host_collectives.h"

namespace zinf {

Result<std::unique_ptr<HostCollectives>> HostCollectives::Create(Device* device, Communicator* comm,
                                                                 DeviceBudget* budget,
                                                                 Stream* stream) {
  std::unique_ptr<HostCollectives> c(new HostCollectives(device, comm, budget, stream));
  ZINF_ASSIGN_OR_RETURN(c->small_scratch_, budget->Alloc(kSmallScratchBytes, "small collectives"));
  budget->Plan(kSmallScratchBytes);
  return c;
}

HostCollectives::~HostCollectives() {
  if (small_scratch_ != nullptr) budget_->Free(small_scratch_, kSmallScratchBytes);
}

Status HostCollectives::AllReduceSum(float* values, size_t count, Stream* stream,
                                     const std::string& what) {
  const size_t bytes = count * sizeof(float);
  const bool small = bytes <= kSmallScratchBytes;
  void* dev = small_scratch_;
  if (!small) {
    ZINF_ASSIGN_OR_RETURN(dev, budget_->Alloc(bytes, what));
  }
  Status st = device_->CopyHostToDevice(dev, values, bytes, stream);
  if (st.ok()) st = comm_->AllReduceSum(static_cast<float*>(dev), count, stream);
  if (st.ok()) st = device_->CopyDeviceToHost(values, dev, bytes, stream);
  if (st.ok()) st = device_->SynchronizeStream(stream);
  if (!small) budget_->Free(dev, bytes);
  return st.WithContext(what);
}

Status HostCollectives::AllGather(const void* send, void* recv, size_t bytes_per_rank,
                                  const std::string& what) {
  const size_t all = bytes_per_rank * static_cast<size_t>(comm_->world_size());
  const bool small = all + bytes_per_rank <= kSmallScratchBytes;
  void* dev = small_scratch_;
  if (!small) {
    ZINF_ASSIGN_OR_RETURN(dev, budget_->Alloc(all + bytes_per_rank, what));
  }
  char* full = static_cast<char*>(dev);
  char* slot = full + all;
  Status st = device_->CopyHostToDevice(slot, send, bytes_per_rank, stream_);
  if (st.ok()) st = comm_->AllGather(slot, full, bytes_per_rank, stream_);
  if (st.ok()) st = device_->CopyDeviceToHost(recv, full, all, stream_);
  if (st.ok()) st = device_->SynchronizeStream(stream_);
  if (!small) budget_->Free(dev, all + bytes_per_rank);
  return st.WithContext(what);
}

Status HostCollectives::Agree(const Status& local, const std::string& what) {
  float failed = local.ok() ? 0.0f : 1.0f;
  Status st = AllReduceSum(&failed, 1, device_->ComputeStream(), what);
  if (!st.ok()) return st;
  if (!local.ok()) return local;
  if (failed > 0) {
    return Status::FailedPrecondition(what + ": another rank failed (its error names the cause)");
  }
  return Status::OK();
}

}  // namespace zinf
