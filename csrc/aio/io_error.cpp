#include "aio/io_error.h"

#include <cstring>
#include <stdexcept>
#include <utility>

namespace zc::aio {

IoError::IoError(int err, std::string path, std::string detail)
    : std::runtime_error(path.empty() ? detail : "'" + path + "': " + detail),
      err_(err),
      path_(std::move(path)),
      detail_(std::move(detail)) {}

std::string errno_text(int err) {
  char buf[256];
  // GNU strerror_r: returns a pointer to the text (maybe not buf).
  const char* s = strerror_r(err, buf, sizeof(buf));
  return std::string(s);
}

IoError io_error(int err, const std::string& path, const char* what, int64_t offset, uint64_t len) {
  return IoError(err, path,
                 std::string(what) + " at offset " + std::to_string(offset) + " (" + std::to_string(len) +
                     " bytes) failed: " + errno_text(err));
}

}  // namespace zc::aio
