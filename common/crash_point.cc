#include "zinf/crash_point.h"

#include <signal.h>
#include <unistd.h>

#include <atomic>
#include <cstdlib>
#include <cstring>
#include <string>

namespace zinf {
namespace {

struct CrashSpec {
  bool armed = false;
  std::string name;
  long count = 0;
  std::atomic<long> hits{0};
};

CrashSpec& Spec() {
  static CrashSpec* spec = [] {
    auto* s = new CrashSpec;
    const char* env = std::getenv("ZINF_CRASH_AT");
    if (env != nullptr) {
      const char* colon = std::strrchr(env, ':');
      if (colon != nullptr && colon != env) {
        s->name.assign(env, colon - env);
        s->count = std::strtol(colon + 1, nullptr, 10);
        s->armed = s->count > 0;
      }
    }
    // ZINF_CRASH_RANK=r: only the process whose RANK is r (one rank of a group) is killed.
    const char* only = std::getenv("ZINF_CRASH_RANK");
    if (s->armed && only != nullptr && *only != '\0') {
      const char* rank = std::getenv("RANK");
      s->armed = rank != nullptr && std::strcmp(rank, only) == 0;
    }
    return s;
  }();
  return *spec;
}

}  // namespace

void CrashPoint(const char* name) {
  CrashSpec& s = Spec();
  if (!s.armed || s.name != name) return;
  if (s.hits.fetch_add(1) + 1 == s.count) {
    static const char kMsg[] = "zinf: ZINF_CRASH_AT reached, killing the process\n";
    (void)!write(2, kMsg, sizeof(kMsg) - 1);
    kill(getpid(), SIGKILL);
  }
}

}  // namespace zinf
