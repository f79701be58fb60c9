// NewHostRuntime and HostDeviceBudget (zinf/runtime.h): a rank on the host device, and the
// device budget a host run can afford.
#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <utility>
#include <vector>

#include "zinf/log.h"
#include "zinf/runtime.h"

namespace zinf {

Result<Runtime> NewHostRuntime(const HostDeviceOptions& options, const ProcessGroupOptions& group) {
  Runtime rank;
  rank.device = NewHostDevice(options);
  if (group.world_size > 1) {
    ZINF_ASSIGN_OR_RETURN(rank.comm, NewGlooComm(rank.device.get(), group));
    return rank;
  }
  ZINF_ASSIGN_OR_RETURN(std::vector<std::unique_ptr<Communicator>> comms,
                        NewLocalComms({rank.device.get()}));
  rank.comm = std::move(comms[0]);
  return rank;
}

namespace {

// What the process maps besides the budgets: the program and its libraries, thread stacks
// (8 MiB each), OpenBLAS's buffers, the allocator's arenas, the data.
constexpr uint64_t kAddressSpaceMargin = uint64_t{3} << 30;

}  // namespace

Result<uint64_t> HostDeviceBudget(uint64_t device_budget_bytes, uint64_t pinned_budget_bytes,
                                  const BudgetNames& names) {
  const uint64_t phys = static_cast<uint64_t>(sysconf(_SC_PHYS_PAGES)) * sysconf(_SC_PAGESIZE);
  rlimit as{};
  if (getrlimit(RLIMIT_AS, &as) != 0 || as.rlim_cur == RLIM_INFINITY) {
    return device_budget_bytes != 0 ? device_budget_bytes : phys;
  }
  const uint64_t limit = as.rlim_cur;
  const uint64_t fixed = pinned_budget_bytes + kAddressSpaceMargin;
  const auto refuse = [&](uint64_t budget) {
    return Status::InvalidArgument(
        "the address-space limit (ulimit -v) is " + FormatBytes(limit) + ", but this run maps " +
        FormatBytes(2 * budget + fixed) + ": the host device reserves twice its budget (2 x " +
        FormatBytes(budget) + "), the pinned arena " + FormatBytes(pinned_budget_bytes) +
        ", the program about " + FormatBytes(kAddressSpaceMargin) +
        ". Raise the limit (ulimit -v unlimited) or lower " + names.device + " / " + names.pinned);
  };
  if (device_budget_bytes != 0) {
    if (2 * device_budget_bytes + fixed > limit) return refuse(device_budget_bytes);
    return device_budget_bytes;
  }
  const uint64_t min_budget = uint64_t{256} << 20;
  if (limit < fixed + 2 * min_budget) return refuse(min_budget);
  const uint64_t fit = (limit - fixed) / 2;
  if (fit < phys) {
    LogWarning("the address-space limit (ulimit -v) is " + FormatBytes(limit) +
               ": the host device's budget is " + FormatBytes(fit) + " instead of the machine's " +
               FormatBytes(phys) + " (raise the limit, or set " + names.device + ")");
  }
  return std::min(fit, phys);
}

}  // namespace zinf
