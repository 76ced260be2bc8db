// Which compiler and C++ standard library built the extension, as the preprocessor saw them
// while compiling it: true for a pip build, a wheel and a JIT build alike, whatever PATH says
// now. `zerocore env` shows it, so a report of a build or ABI problem names the toolchain.
#pragma once
#include <map>
#include <string>

namespace zc {

inline std::map<std::string, std::string> compiler_info() {
  std::map<std::string, std::string> info;
#if defined(__clang__)
  info["compiler"] = std::string("clang ") + __clang_version__;
#elif defined(__GNUC__)
  info["compiler"] = std::string("gcc ") + __VERSION__;
#else
  info["compiler"] = "unknown";
#endif
  // Defined by <bits/c++config.h>, which <map> and <string> above bring in.
#if defined(_GLIBCXX_RELEASE)
  info["stdlib"] = "libstdc++ " + std::to_string(_GLIBCXX_RELEASE) + " (" + std::to_string(__GLIBCXX__) + ")";
#elif defined(_LIBCPP_VERSION)
  info["stdlib"] = "libc++ " + std::to_string(_LIBCPP_VERSION);
#else
  info["stdlib"] = "unknown";
#endif
  info["cplusplus"] = std::to_string(__cplusplus);
  return info;
}

}  // namespace zc
