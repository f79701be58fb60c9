# Installs zinf into a temporary prefix and builds a small outside project against it with
# find_package(zinf): the package config, the exported targets and the C API link.
set(prefix "${ZINF_BINARY_DIR}/install-test/prefix")
set(consumer "${ZINF_BINARY_DIR}/install-test/consumer")
file(REMOVE_RECURSE "${ZINF_BINARY_DIR}/install-test")
execute_process(COMMAND ${CMAKE_COMMAND} --install "${ZINF_BINARY_DIR}" --prefix "${prefix}"
                RESULT_VARIABLE rc OUTPUT_QUIET)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "cmake --install failed (${rc})")
endif()
file(MAKE_DIRECTORY "${consumer}/src")
# One program per exported library, each linking only its short name.
file(WRITE "${consumer}/src/CMakeLists.txt" "
cmake_minimum_required(VERSION 3.25)
project(consumer CXX)
set(CMAKE_CXX_STANDARD 20)
find_package(zinf REQUIRED)
add_executable(consumer main.cc)
target_link_libraries(consumer PRIVATE zinf::zinf)
add_executable(use_nvme nvme.cc)
target_link_libraries(use_nvme PRIVATE zinf::nvme)
add_executable(use_cpu_adam cpu_adam.cc)
target_link_libraries(use_cpu_adam PRIVATE zinf::cpu_adam)
add_executable(use_engine engine.cc)
target_link_libraries(use_engine PRIVATE zinf::engine zinf::host_backends zinf::safetensors)
add_executable(use_cuda cuda.cc)
target_link_libraries(use_cuda PRIVATE zinf::cuda_backends)
")
file(WRITE "${consumer}/src/main.cc" "
#include <zinf/zinf.h>
#include <cstdio>
int main() {
  zinf_swap_options o;
  zinf_swap_options_init(&o);
  zinf_swap_store* s = nullptr;
  if (zinf_swap_open(&o, &s) == 0) return 1;  // no paths: must fail with a message
  std::printf(\"%s\\\\n\", zinf_last_error());
  return zinf_last_error()[0] != 0 ? 0 : 1;
}
")
file(WRITE "${consumer}/src/nvme.cc" "
#include <zinf/swap.h>
int main() {
  zinf::PinnedArenaOptions o;
  o.bytes = 1 << 20;
  o.lock_memory = false;
  auto arena = zinf::PinnedArena::Create(o);
  return arena.ok() && (*arena)->Allocate(4096).ok() ? 0 : 1;
}
")
file(WRITE "${consumer}/src/cpu_adam.cc" "
#include <zinf/cpu_adam.h>
#include <vector>
int main() {
  auto opt = zinf::CpuOptimizer::Create();
  if (!opt.ok()) return 1;
  std::vector<float> p(64, 1.0f), g(64, 0.5f), m(64, 0.0f), v(64, 0.0f);
  zinf::OptimizerHyperParams hp;
  zinf::OptimizerTensors t;
  t.param = p.data();
  t.grad = g.data();
  t.exp_avg = m.data();
  t.exp_avg_sq = v.data();
  t.n = p.size();
  return (*opt)->Step(hp, t).ok() && p[0] < 1.0f ? 0 : 1;
}
")
file(WRITE "${consumer}/src/engine.cc" "
#include <zinf/comm.h>
#include <zinf/device.h>
#include <zinf/engine.h>
#include <zinf/plan.h>
#include <zinf/safetensors.h>
#include <zinf/safetensors_engine.h>
int main() {
  auto device = zinf::NewHostDevice(zinf::HostDeviceOptions{});
  auto comms = zinf::NewLocalComms({device.get()});
  if (!comms.ok()) return 1;
  zinf::EngineConfig c;
  c.offload_param.tier = zinf::Tier::kCpu;
  c.offload_optimizer.tier = zinf::Tier::kCpu;
  c.pinned_budget_bytes = 16 << 20;
  auto e = zinf::Engine::Create(c, device.get(), (*comms)[0].get());
  if (!e.ok()) return 2;
  zinf::ParamSpec spec;
  spec.name = \"w\";
  spec.shape = {256};
  spec.init = [](float* d, size_t n) { for (size_t i = 0; i < n; ++i) d[i] = 1.0f; };
  if (zinf::NvmeBytesNeeded(c, 256) != 0) return 6;  // no NVMe tier: nothing needed
  if (!(*e)->RegisterParameter(spec).ok() || !(*e)->FinishRegistration().ok()) return 3;
  std::vector<float> out(256);
  if (!(*e)->GatherMasterParameter(0, out.data()).ok() || out[7] != 1.0f) return 4;
  return zinf::safetensors::OpenCheckpoint(\"/nonexistent.safetensors\").ok() ? 5 : 0;
}
")
file(WRITE "${consumer}/src/cuda.cc" "
#include <zinf/cuda.h>
#include <cstdio>
int main() {
  // Without a GPU (or built without CUDA) this is an error with a reason, not a crash.
  auto d = zinf::NewCudaDevice(zinf::CudaDeviceOptions{});
  std::printf(\"%s\\\\n\", d.ok() ? \"cuda device\" : d.status().ToString().c_str());
  return 0;
}
")
execute_process(COMMAND ${CMAKE_COMMAND} -S "${consumer}/src" -B "${consumer}/build" -G Ninja
                        "-DCMAKE_PREFIX_PATH=${prefix}" RESULT_VARIABLE rc)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "configuring the consumer with find_package(zinf) failed")
endif()
execute_process(COMMAND ${CMAKE_COMMAND} --build "${consumer}/build" RESULT_VARIABLE rc)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "building the consumer against zinf failed")
endif()
foreach(program consumer use_nvme use_cpu_adam use_engine use_cuda)
  execute_process(COMMAND "${consumer}/build/${program}" RESULT_VARIABLE rc OUTPUT_VARIABLE out
                  ERROR_VARIABLE err)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "the consumer ${program} failed (${rc}): ${out} ${err}")
  endif()
  message(STATUS "${program} ran: ${out}")
endforeach()
