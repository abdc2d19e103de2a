// Argument checks whose messages never stream a number through std::ostream.
//
// On a torch 2.11 build whose process had loaded another libstdc++ than the extension's, a
// failed TORCH_CHECK whose message streamed an integer crashed the process (SIGSEGV) instead
// of raising; messages made only of strings raised normally. MAGICUBE_CHECK formats every
// piece itself (std::to_string for numbers) and hands TORCH_CHECK one string.
#pragma once

#include <string>
#include <type_traits>

#include <c10/core/Device.h>
#include <c10/core/ScalarType.h>
#include <c10/util/ArrayRef.h>
#include <c10/util/Exception.h>

namespace magicube {

template <typename T>
std::string message_piece(const T& x) {
  if constexpr (std::is_same_v<T, bool>) {
    return x ? "true" : "false";
  } else if constexpr (std::is_arithmetic_v<T>) {
    return std::to_string(x);
  } else if constexpr (std::is_same_v<T, c10::ScalarType>) {
    return c10::toString(x);
  } else if constexpr (std::is_same_v<T, c10::Device>) {
    return x.str();
  } else if constexpr (std::is_same_v<T, c10::IntArrayRef>) {  // sizes or strides: [a, b, c]
    std::string s = "[";
    for (size_t i = 0; i < x.size(); ++i) s += (i ? ", " : "") + std::to_string(x[i]);
    return s + "]";
  } else {
    return std::string(x);
  }
}

template <typename... Ts>
std::string message(const Ts&... pieces) {
  return (std::string() + ... + message_piece(pieces));
}

}  // namespace magicube

#define MAGICUBE_CHECK(cond, ...) TORCH_CHECK(cond, ::magicube::message(__VA_ARGS__))
