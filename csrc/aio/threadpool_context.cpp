// Thread-pool backend: `depth` helper threads each doing blocking pread/pwrite on the
// (O_DIRECT) descriptor, behind the same submit/reap contract as libaio and io_uring. It needs
// no kernel AIO interface and no headers beyond POSIX, so it is always built: the engine works
// on machines without libaio/liburing (slower: one thread and one syscall per block in flight).
//
// A short transfer is continued inside the helper until the op is complete, so the worker sees
// a short result only when the kernel stopped early (end of file: 0 more bytes) or failed after
// some progress; the worker resubmits the rest, which then reports the error with its errno.
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <system_error>
#include <thread>
#include <vector>

#include "aio/io_context.h"
#include "aio/io_error.h"

namespace zc::aio {

namespace testing {
std::atomic<uint64_t> threadpool_max_syscall_bytes{0};
}

namespace {

// One pread/pwrite loop: bytes transferred (possibly short at end of file), or -errno when the
// first syscall failed.
int64_t transfer(const IoOp& o) {
  const uint64_t cap = testing::threadpool_max_syscall_bytes.load(std::memory_order_relaxed);
  char* p = static_cast<char*>(o.buf);
  uint64_t done = 0;
  while (done < o.len) {
    uint64_t want = o.len - done;
    if (cap && want > cap) want = cap;
    const ssize_t r = o.write ? pwrite(o.fd, p + done, want, o.offset + static_cast<int64_t>(done))
                              : pread(o.fd, p + done, want, o.offset + static_cast<int64_t>(done));
    if (r < 0) {
      if (errno == EINTR) continue;
      return done ? static_cast<int64_t>(done) : -static_cast<int64_t>(errno);
    }
    if (r == 0) break;  // end of file (read) or a device that takes nothing more (write)
    done += static_cast<uint64_t>(r);
  }
  return static_cast<int64_t>(done);
}

class ThreadPoolContext final : public IoContext {
 public:
  explicit ThreadPoolContext(int depth) : depth_(depth) {
    helpers_.reserve(static_cast<size_t>(depth));
    try {
      for (int i = 0; i < depth; ++i) helpers_.emplace_back([this] { serve(); });
    } catch (const std::system_error& e) {
      stop_helpers();
      throw IoError(e.code().value(), "", "could not start the I/O thread pool (" + std::to_string(depth) +
                                              " threads): " + e.what());
    }
  }
  ~ThreadPoolContext() override { stop_helpers(); }  // finishes every queued op first, like io_destroy

  int submit(const IoOp* ops, int n) override {
    std::lock_guard<std::mutex> lk(mu_);
    const int room = depth_ - in_flight_;
    if (room <= 0) return -EAGAIN;
    if (n > room) n = room;
    for (int i = 0; i < n; ++i) todo_.push_back(ops[i]);
    in_flight_ += n;
    work_cv_.notify_all();
    return n;
  }

  int reap(IoDone* out, int min_nr, int max_nr) override {
    std::unique_lock<std::mutex> lk(mu_);
    if (min_nr > in_flight_ + static_cast<int>(done_.size())) min_nr = in_flight_ + static_cast<int>(done_.size());
    done_cv_.wait(lk, [&] { return static_cast<int>(done_.size()) >= min_nr; });
    int got = 0;
    while (got < max_nr && !done_.empty()) {
      out[got++] = done_.front();
      done_.pop_front();
    }
    return got;
  }

 private:
  void serve() {
    std::unique_lock<std::mutex> lk(mu_);
    for (;;) {
      work_cv_.wait(lk, [&] { return stop_ || !todo_.empty(); });
      if (todo_.empty()) return;  // stop_ and nothing left
      const IoOp op = todo_.front();
      todo_.pop_front();
      lk.unlock();
      const int64_t res = transfer(op);
      lk.lock();
      done_.push_back(IoDone{op.tag, res});
      --in_flight_;
      done_cv_.notify_one();
    }
  }

  void stop_helpers() {
    {
      std::lock_guard<std::mutex> lk(mu_);
      stop_ = true;
    }
    work_cv_.notify_all();
    for (std::thread& t : helpers_) t.join();
    helpers_.clear();
  }

  const int depth_;
  std::mutex mu_;
  std::condition_variable work_cv_, done_cv_;
  std::deque<IoOp> todo_;
  std::deque<IoDone> done_;
  int in_flight_ = 0;  // submitted and not yet finished by a helper
  bool stop_ = false;
  std::vector<std::thread> helpers_;  // last: started once everything above exists
};

}  // namespace

std::unique_ptr<IoContext> make_threadpool_context(int depth) { return std::make_unique<ThreadPoolContext>(depth); }

}  // namespace zc::aio
