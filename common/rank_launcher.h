// `--nproc N` of the programs (zinf-train, zinf-engine-bench): the program's command line
// (without --nproc) as N rank processes of one group on this machine, supervised.
#pragma once

namespace zinf {

// Runs argv (without --nproc N / --nproc=N) as N processes of /proc/self/exe with RANK,
// WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE and ZINF_STORE_FOLDER (a fresh rendezvous folder)
// set, and supervises them: 0 when all succeed; when one fails, its exit code (128 + signal
// when a signal ended it), after the others got 30 s to fail by themselves (their collectives
// break at once) and were then ended by pid. No rank outlives the supervisor
// (PR_SET_PDEATHSIG); SIGINT / SIGTERM are passed on. Refused (2) under a launcher that set
// RANK already. `program` prefixes the messages.
int LaunchRanks(const char* program, int argc, char** argv, int nproc);

}  // namespace zinf
