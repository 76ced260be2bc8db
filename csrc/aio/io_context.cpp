#include "aio/io_context.h"

#include <exception>

#include "aio/io_error.h"

namespace zc::aio {

const char* backend_name(Backend b) {
  switch (b) {
    case Backend::LibAio: return "libaio";
    case Backend::IoUring: return "io_uring";
    case Backend::ThreadPool: return "threadpool";
  }
  return "unknown";
}

std::unique_ptr<IoContext> make_context(Backend b, int depth) {
  switch (b) {
    case Backend::LibAio:
#ifdef ZEROCORE_WITH_LIBAIO
      return make_libaio_context(depth);
#else
      throw IoError(0, "", "the libaio backend is not built into this zerocore (libaio.h or libaio.a was not "
                           "found at build time; install libaio-dev and rebuild)");
#endif
    case Backend::IoUring:
#ifdef ZEROCORE_WITH_URING
      return make_uring_context(depth);
#else
      throw IoError(0, "", "the io_uring backend is not built into this zerocore (liburing was not found at build "
                           "time; install liburing-dev and rebuild)");
#endif
    case Backend::ThreadPool:
      return make_threadpool_context(depth);
  }
  throw IoError(0, "", "unknown I/O backend");
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
