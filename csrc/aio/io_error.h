// The one error type of the I/O engine: a failed syscall or a short transfer, carrying the
// errno (0 when the failure is not a syscall error, e.g. a file shorter than the request) and
// the path, so the binding can raise the matching OSError subclass (FileNotFoundError, ...).
#pragma once

#include <cstdint>
#include <stdexcept>
#include <string>

namespace zc::aio {

class IoError : public std::runtime_error {
 public:
  IoError(int err, std::string path, std::string detail);
  int err() const noexcept { return err_; }
  const std::string& path() const noexcept { return path_; }
  // The message without the path (Python's OSError appends the file name itself).
  const std::string& detail() const noexcept { return detail_; }

 private:
  int err_;
  std::string path_;
  std::string detail_;
};

std::string errno_text(int err);

// "<what> at offset <offset> (<len> bytes) failed: <strerror>"
IoError io_error(int err, const std::string& path, const char* what, int64_t offset, uint64_t len);

}  // namespace zc::aio
