// Crash points: named places where a test can have the process killed (SIGKILL), to prove that
// a crash at that exact point loses nothing that was committed.
//
//   ZINF_CRASH_AT=<name>:<n>   kills the process at the n-th time (1-based) the point <name>
//                              is reached. Unset (the normal case): one predictable branch.
//   ZINF_CRASH_RANK=<r>        with it, only the process whose RANK is r (one rank of a
//                              group of processes).
//
// Points: "swap.write" (a swap write was submitted, not yet complete), "optimizer.group" (a
// sub-group was stepped, the next not yet), "checkpoint.files" (rank files written, not
// committed), "checkpoint.renamed" (the folder has its final name, `latest` not yet
// updated), "checkpoint.latest" (`latest` replaced, older checkpoints not yet removed),
// "train.backward" (zinf-train, between two layers of the backward).
#pragma once

namespace zinf {

void CrashPoint(const char* name);

}  // namespace zinf
