// io_uring backend (liburing). Compiled only when build_spec finds liburing. submit() only
// fills submission entries and tells the kernel; reap() submits whatever is still queued and
// waits, so an interrupted or refused io_uring_submit never loses an entry.
#include <liburing.h>

#include <cerrno>
#include <cstdint>
#include <memory>
#include <string>

#include "aio/io_context.h"
#include "aio/io_error.h"

namespace zc::aio {
namespace {

class UringContext final : public IoContext {
 public:
  explicit UringContext(int depth) {
    const int r = io_uring_queue_init(static_cast<unsigned>(depth), &ring_, 0);
    if (r < 0) {
      throw IoError(-r, "", "io_uring_queue_init(" + std::to_string(depth) + ") failed: " + errno_text(-r) +
                                " (io_uring may be disabled here: see /proc/sys/kernel/io_uring_disabled)");
    }
  }
  ~UringContext() override { io_uring_queue_exit(&ring_); }

  int submit(const IoOp* ops, int n) override {
    int queued = 0;
    for (; queued < n; ++queued) {
      io_uring_sqe* sqe = io_uring_get_sqe(&ring_);
      if (!sqe) break;
      const IoOp& o = ops[queued];
      if (o.write) io_uring_prep_write(sqe, o.fd, o.buf, static_cast<unsigned>(o.len), static_cast<uint64_t>(o.offset));
      else io_uring_prep_read(sqe, o.fd, o.buf, static_cast<unsigned>(o.len), static_cast<uint64_t>(o.offset));
      io_uring_sqe_set_data(sqe, reinterpret_cast<void*>(o.tag));
    }
    if (queued == 0) return -EAGAIN;
    const int r = io_uring_submit(&ring_);
    (void)r;  // entries the kernel did not take yet stay queued; reap() submits them again
    return queued;
  }

  int reap(IoDone* out, int min_nr, int max_nr) override {
    int r;
    do r = io_uring_submit_and_wait(&ring_, static_cast<unsigned>(min_nr));
    while (r == -EINTR || r == -EAGAIN || r == -EBUSY);
    if (r < 0) return r;
    int got = 0;
    while (got < max_nr) {
      io_uring_cqe* cqe = nullptr;
      const int w = got < min_nr ? io_uring_wait_cqe(&ring_, &cqe) : io_uring_peek_cqe(&ring_, &cqe);
      if (w == -EINTR) continue;
      if (w < 0 || !cqe) {
        if (got >= min_nr || w == -EAGAIN) break;
        return w;
      }
      out[got].tag = reinterpret_cast<uint64_t>(io_uring_cqe_get_data(cqe));
      out[got].res = cqe->res;
      io_uring_cqe_seen(&ring_, cqe);
      ++got;
    }
    return got;
  }

 private:
  io_uring ring_{};
};

}  // namespace

std::unique_ptr<IoContext> make_uring_context(int depth) { return std::make_unique<UringContext>(depth); }

}  // namespace zc::aio
