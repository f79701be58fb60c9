// HasFields<T, N>: whether the aggregate T has exactly N fields, at compile time, so that a
// visitor written beside a struct (VisitStepStats, VisitEngineConfig) stops compiling when a
// field is added without a visit: static_assert(HasFields<T, N>, "...").
#pragma once

#include <cstddef>
#include <utility>

namespace zinf {

#if __cplusplus >= 202002L  // a requires-expression; the checks run in every C++20 build
namespace internal {
// Converts to any field type: T{AnyField{}...} compiles with at most as many values as T has
// fields (each initializes one whole field: no brace elision, as it converts to anything).
struct AnyField {
  template <typename T>
  operator T() const;
};
template <typename T, size_t... I>
constexpr bool BraceInitializable(std::index_sequence<I...>) {
  return requires { T{(static_cast<void>(I), AnyField{})...}; };
}
}  // namespace internal

template <typename T, size_t N>
constexpr bool HasFields = internal::BraceInitializable<T>(std::make_index_sequence<N>()) &&
                           !internal::BraceInitializable<T>(std::make_index_sequence<N + 1>());
#define ZINF_HAS_FIELD_COUNT_CHECK 1
#endif

}  // namespace zinf
