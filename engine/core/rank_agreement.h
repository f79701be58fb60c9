// Ranks agree before they train: what must be equal on every rank (the parameters in
// registration order, the optimizer and its hyperparameters, dtypes, tiers, clipping,
// accumulation, a trainer's own settings, the initial values) is compared across the ranks
// before any other collective, so that ranks started differently are refused with the first
// difference named instead of training each by its own rules, aborting inside the
// communicator (collectives of different sizes) or waiting for the collective timeout.
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "engine/core/host_collectives.h"
#include "engine/core/layout.h"
#include "zinf/config.h"

namespace zinf {

// "name: value" lines: the settings of `config` that change the math, the layout or the
// collectives a rank issues; `extra` (a trainer's own settings); then the parameters of
// `layout` in registration order (name, shape, trainable). Budgets, paths, thread counts and
// timeouts may differ between ranks and are left out.
std::string DescribeForAgreement(const EngineConfig& config, const Layout& layout,
                                 const std::vector<std::pair<std::string, std::string>>& extra);

// "the initial value of 'name' (xxh3): <hex>" per parameter whose hash is not 0.
std::string DescribeValues(const Layout& layout, const std::vector<uint64_t>& hashes);

// Compares `text` ("name: value" lines) across the ranks: a 16-byte digest first (the common
// case costs one small all-gather), the texts themselves only when the digests differ. Every
// rank returns the same result: OK, or FailedPrecondition "the ranks disagree on <what>:
// <first differing line, rank 0's value and the other rank's>. <remedy>". Every rank must
// call it at the same point (it issues collectives); trainer thread.
Status AgreeAcrossRanks(HostCollectives* collectives, int world, const std::string& what,
                        const std::string& text, const std::string& remedy);

// The message for two texts that differ (exposed for tests): the first differing line.
std::string FirstDifference(const std::string& rank0, int other_rank, const std::string& other);

}  // namespace zinf
