// libaio backend. The kernel copies each iocb during io_submit, so one preallocated array is
// reused for every batch; completions are matched by the tag stored in iocb.data.
//
// io_getevents is called as the raw syscall: libaio.a defines it with two symbol versions
// (LIBAIO_0.1 and 0.4), which cannot be linked into a shared object without libaio's version
// script; for a blocking wait libaio's own version makes the same syscall.
#include <libaio.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cerrno>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "aio/io_context.h"
#include "aio/io_error.h"

namespace zc::aio {
namespace {

class LibAioContext final : public IoContext {
 public:
  explicit LibAioContext(int depth) : cbs_(depth), ptrs_(depth), events_(depth) {
    const int r = io_setup(depth, &ctx_);  // libaio returns -errno
    if (r < 0) {
      throw IoError(-r, "", "io_setup(" + std::to_string(depth) + ") failed: " + errno_text(-r) +
                                " (see /proc/sys/fs/aio-max-nr)");
    }
    for (int i = 0; i < depth; ++i) ptrs_[i] = &cbs_[i];
  }
  ~LibAioContext() override { io_destroy(ctx_); }  // waits for anything still in flight

  int submit(const IoOp* ops, int n) override {
    if (n > static_cast<int>(cbs_.size())) n = static_cast<int>(cbs_.size());
    for (int i = 0; i < n; ++i) {
      const IoOp& o = ops[i];
      if (o.write) io_prep_pwrite(&cbs_[i], o.fd, o.buf, o.len, o.offset);
      else io_prep_pread(&cbs_[i], o.fd, o.buf, o.len, o.offset);
      cbs_[i].data = reinterpret_cast<void*>(o.tag);
    }
    int r;
    do r = io_submit(ctx_, n, ptrs_.data());
    while (r == -EINTR);
    return r;
  }

  int reap(IoDone* out, int min_nr, int max_nr) override {
    if (max_nr > static_cast<int>(events_.size())) max_nr = static_cast<int>(events_.size());
    int r;
    do {
      r = static_cast<int>(syscall(SYS_io_getevents, ctx_, static_cast<long>(min_nr), static_cast<long>(max_nr),
                                   events_.data(), nullptr));
      if (r < 0) r = -errno;
    } while (r == -EINTR);
    if (r < 0) return r;
    for (int i = 0; i < r; ++i) {
      out[i].tag = reinterpret_cast<uint64_t>(events_[i].data);
      out[i].res = static_cast<int64_t>(static_cast<long>(events_[i].res));  // -errno arrives as unsigned
    }
    return r;
  }

 private:
  io_context_t ctx_ = nullptr;
  std::vector<iocb> cbs_;
  std::vector<iocb*> ptrs_;
  std::vector<io_event> events_;
};

}  // namespace

std::unique_ptr<IoContext> make_libaio_context(int depth) { return std::make_unique<LibAioContext>(depth); }

}  // namespace zc::aio
