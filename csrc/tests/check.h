// The native tests' one assertion macro: counts checks, prints the first failures with a
// printf-style message, and lets main() report "N checks, M failed" and the exit code.
#pragma once
#include <cstdio>

namespace zc_test {
inline int failures = 0;
inline int checks = 0;
constexpr int kPrintedFailures = 30;

inline int summary() {
  std::printf("%d checks, %d failed\n", checks, failures);
  return failures == 0 ? 0 : 1;
}
}  // namespace zc_test

#define CHECK(cond, ...)                                             \
  do {                                                               \
    ++zc_test::checks;                                               \
    if (!(cond)) {                                                   \
      if (++zc_test::failures <= zc_test::kPrintedFailures) {        \
        std::printf("FAIL %s:%d: %s: ", __FILE__, __LINE__, #cond);  \
        std::printf(__VA_ARGS__);                                    \
        std::printf("\n");                                           \
      }                                                              \
    }                                                                \
  } while (0)
