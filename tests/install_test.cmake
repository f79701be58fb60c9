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
file(WRITE "${consumer}/src/CMakeLists.txt" "
cmake_minimum_required(VERSION 3.25)
project(consumer CXX)
find_package(zinf REQUIRED)
add_executable(consumer main.cc)
target_link_libraries(consumer PRIVATE zinf::zinf)
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
execute_process(COMMAND ${CMAKE_COMMAND} -S "${consumer}/src" -B "${consumer}/build" -G Ninja
                        "-DCMAKE_PREFIX_PATH=${prefix}" RESULT_VARIABLE rc)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "configuring the consumer with find_package(zinf) failed")
endif()
execute_process(COMMAND ${CMAKE_COMMAND} --build "${consumer}/build" RESULT_VARIABLE rc)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "building the consumer against zinf failed")
endif()
execute_process(COMMAND "${consumer}/build/consumer" RESULT_VARIABLE rc OUTPUT_VARIABLE out)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "the consumer failed (${rc}): ${out}")
endif()
message(STATUS "consumer ran: ${out}")
