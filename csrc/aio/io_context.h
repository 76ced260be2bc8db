// One submission/completion queue used by one worker thread: libaio (io_setup / io_submit /
// io_getevents), io_uring, or a pool of threads doing blocking pread/pwrite (built everywhere:
// the fallback where neither kernel interface was built or is allowed), behind the same calls.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace zc::aio {

enum class Backend { LibAio, IoUring, ThreadPool };

// Every backend, in the order reported to users.
inline constexpr Backend kAllBackends[] = {Backend::LibAio, Backend::IoUring, Backend::ThreadPool};

const char* backend_name(Backend b);

struct IoOp {
  int fd;
  bool write;
  void* buf;
  uint64_t len;
  int64_t offset;
  uint64_t tag;  // returned with the completion
};

struct IoDone {
  uint64_t tag;
  int64_t res;  // bytes transferred, or -errno
};

class IoContext {
 public:
  virtual ~IoContext() = default;
  // Queues ops[0..n) (n <= the depth given at creation minus what is in flight). Returns how
  // many were queued (> 0), or -errno when ops[0] could not be (nothing queued then).
  virtual int submit(const IoOp* ops, int n) = 0;
  // Waits for at least min_nr completions and returns up to max_nr of them in out (the count),
  // or -errno when the queue itself failed.
  virtual int reap(IoDone* out, int min_nr, int max_nr) = 0;
};

// Creates a queue for up to `depth` ops in flight. Throws IoError naming the syscall when
// the kernel refuses (e.g. io_uring disabled by policy or seccomp).
std::unique_ptr<IoContext> make_context(Backend b, int depth);

// Whether the backend is compiled in and the kernel accepts it here; when not, *why says so.
bool backend_available(Backend b, std::string* why);

#ifdef ZEROCORE_WITH_LIBAIO
std::unique_ptr<IoContext> make_libaio_context(int depth);
#endif
std::unique_ptr<IoContext> make_threadpool_context(int depth);
#ifdef ZEROCORE_WITH_URING
std::unique_ptr<IoContext> make_uring_context(int depth);
#endif

namespace testing {
// Tests: when non-zero, the thread-pool backend moves at most this many bytes per pread/pwrite
// call, so every op is a chain of short transfers that must be continued to completion.
extern std::atomic<uint64_t> threadpool_max_syscall_bytes;
}  // namespace testing

}  // namespace zc::aio
