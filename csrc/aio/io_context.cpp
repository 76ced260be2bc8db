#include "aio/io_context.h"

#include <exception>

#include "aio/io_error.h"

namespace zc::aio {

const char* backend_name(Backend b) { return b == Backend::IoUring ? "io_uring" : "libaio"; }

std::unique_ptr<IoContext> make_context(Backend b, int depth) {
  if (b == Backend::LibAio) return make_libaio_context(depth);
#ifdef ZEROCORE_WITH_URING
  return make_uring_context(depth);
#else
  throw IoError(0, "", "the io_uring backend is not built into this zerocore (liburing was not found at build "
                       "time; install liburing-dev and rebuild)");
#endif
}

bool backend_available(Backend b, std::string* why) {
  try {
    make_context(b, 2);
    return true;
  } catch (const std::exception& e) {
    if (why) *why = e.what();
    return false;
  }
}

}  // namespace zc::aio
