#include "aio/worker.h"

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstring>
#include <exception>
#include <mutex>
#include <new>
#include <string>
#include <thread>
#include <utility>

#include "aio/io_error.h"

namespace zc::aio {

Worker::Worker(const WorkerOptions& opt, DoneFn on_task_done)
    : opt_(opt), on_done_(std::move(on_task_done)), ctx_(make_context(opt.backend, opt.queue_depth)) {
  slots_.resize(static_cast<size_t>(opt_.queue_depth));
  for (int i = opt_.queue_depth - 1; i >= 0; --i) free_slots_.push_back(i);
  batch_.reserve(slots_.size());
  events_.resize(slots_.size());
  thread_ = std::thread([this] { loop(); });
}

Worker::~Worker() {
  {
    std::lock_guard<std::mutex> lk(mu_);
    stop_ = true;
  }
  cv_.notify_one();
  if (thread_.joinable()) thread_.join();
}

void Worker::push(Task t) {
  {
    std::lock_guard<std::mutex> lk(mu_);
    queue_.push_back(std::move(t));
  }
  cv_.notify_one();
}

void Worker::loop() {
  std::deque<Task> incoming;
  for (;;) {
    {
      std::unique_lock<std::mutex> lk(mu_);
      if (inflight_ == 0 && active_.empty() && retry_.empty()) {
        cv_.wait(lk, [&] { return stop_ || !queue_.empty(); });
        if (queue_.empty()) return;  // stop_ and nothing left
      }
      incoming.swap(queue_);
    }
    for (Task& t : incoming) {
      if (t.page_cache) {
        run_page_cache(t);
      } else {
        Active a;
        a.cursor = t.begin;
        a.task = std::move(t);
        active_.push_back(std::move(a));
      }
    }
    incoming.clear();

    if (opt_.overlap_events || inflight_ == 0) {
      build_batch();
      submit_batch();
    }
    finish_idle_tasks();
    if (inflight_ > 0 && ctx_) {
      const int n = ctx_->reap(events_.data(), opt_.overlap_events ? 1 : inflight_, static_cast<int>(events_.size()));
      if (n < 0) {
        queue_failed(-n);
      } else {
        for (int i = 0; i < n; ++i) complete(static_cast<int>(events_[i].tag), events_[i].res);
      }
      finish_idle_tasks();
    }
  }
}

void Worker::run_page_cache(Task& t) {
  Request& r = *t.req;
  if (!r.failed.load(std::memory_order_acquire)) {
    try {
      const int fd = r.file->edge_fd >= 0 ? r.file->edge_fd : r.file->io_fd;
      const int64_t off = static_cast<int64_t>(t.begin);
      if (r.write) write_full(fd, r.file->path, r.ptr_at(t.begin), t.end - t.begin, off);
      else read_full(fd, r.file->path, r.ptr_at(t.begin), t.end - t.begin, off);
    } catch (...) {
      r.fail(std::current_exception());
    }
  }
  on_done_(t.req);
}

IoOp Worker::make_op(int s) const {
  const Slot& sl = slots_[static_cast<size_t>(s)];
  const Request& r = *sl.owner->task.req;
  char* base = sl.bounce ? sl.bounce : sl.user;
  return IoOp{r.file->io_fd, r.write, base + sl.done, sl.len - sl.done,
              static_cast<int64_t>(sl.file_off + sl.done), static_cast<uint64_t>(s)};
}

// Takes the next block of the oldest task that has one, into a free slot.
bool Worker::issue_block(IoOp* op) {
  if (free_slots_.empty()) return false;
  for (Active& a : active_) {
    Request& r = *a.task.req;
    if (a.cursor >= a.task.end || r.failed.load(std::memory_order_acquire)) continue;
    const int s = free_slots_.back();
    Slot& sl = slots_[static_cast<size_t>(s)];
    sl.owner = &a;
    sl.file_off = a.cursor;
    sl.len = std::min<uint64_t>(opt_.block_size, a.task.end - a.cursor);
    sl.done = 0;
    sl.user = r.ptr_at(a.cursor);
    sl.bounce = nullptr;
    if (r.file->direct && !is_aligned(sl.user)) {
      if (!bounce_.data()) {
        try {
          bounce_ = AlignedBuffer(opt_.block_size * slots_.size());
        } catch (const std::bad_alloc&) {
          r.fail(std::make_exception_ptr(IoError(ENOMEM, r.file->path,
                                                 "could not allocate the aligned bounce buffer for an unaligned "
                                                 "tensor: " + errno_text(ENOMEM))));
          continue;
        }
      }
      sl.bounce = bounce_.data() + static_cast<uint64_t>(s) * opt_.block_size;
      if (r.write) std::memcpy(sl.bounce, sl.user, sl.len);
    }
    free_slots_.pop_back();
    a.cursor += sl.len;
    ++a.inflight;
    *op = make_op(s);
    return true;
  }
  return false;
}

void Worker::build_batch() {
  batch_.clear();
  for (int s : retry_) {
    Slot& sl = slots_[static_cast<size_t>(s)];
    if (sl.owner->task.req->failed.load(std::memory_order_acquire)) release(s);
    else batch_.push_back(make_op(s));
  }
  retry_.clear();
  IoOp op;
  while (batch_.size() < slots_.size() && issue_block(&op)) batch_.push_back(op);
}

void Worker::submit_batch() {
  const int n = static_cast<int>(batch_.size());
  int i = 0;
  if (!ctx_) {  // the queue could not be recreated after a failure: every op fails
    for (; i < n; ++i) {
      const int s = static_cast<int>(batch_[static_cast<size_t>(i)].tag);
      ++inflight_;
      slots_[static_cast<size_t>(s)].in_kernel = true;
      complete(s, -EIO);
    }
    return;
  }
  while (i < n) {
    const int want = opt_.single_submit ? 1 : n - i;
    const int r = ctx_->submit(&batch_[static_cast<size_t>(i)], want);
    if (r > 0) {
      for (int k = i; k < i + r; ++k) slots_[static_cast<size_t>(batch_[static_cast<size_t>(k)].tag)].in_kernel = true;
      inflight_ += r;
      i += r;
      continue;
    }
    if ((r == -EAGAIN || r == 0) && inflight_ > 0) {  // kernel queue full: retry after a completion
      for (; i < n; ++i) retry_.push_back(static_cast<int>(batch_[static_cast<size_t>(i)].tag));
      break;
    }
    const int s = static_cast<int>(batch_[static_cast<size_t>(i)].tag);
    ++inflight_;  // complete() counts it back out
    slots_[static_cast<size_t>(s)].in_kernel = true;
    complete(s, r == 0 ? -EAGAIN : r);
    ++i;
  }
}

void Worker::release(int s) {
  Slot& sl = slots_[static_cast<size_t>(s)];
  --sl.owner->inflight;
  sl.owner = nullptr;
  free_slots_.push_back(s);
}

void Worker::complete(int s, int64_t res) {
  Slot& sl = slots_[static_cast<size_t>(s)];
  sl.in_kernel = false;
  --inflight_;
  Request& r = *sl.owner->task.req;
  const uint64_t want = sl.len - sl.done;
  const int64_t at = static_cast<int64_t>(sl.file_off + sl.done);
  const char* what = r.write ? "pwrite" : "pread";
  if (res < 0) {
    r.fail(std::make_exception_ptr(io_error(static_cast<int>(-res), r.file->path, what, at, want)));
  } else if (res == 0) {
    r.fail(std::make_exception_ptr(IoError(
        0, r.file->path,
        std::string(what) + " at offset " + std::to_string(at) + " (" + std::to_string(want) + " bytes) " +
            (r.write ? "wrote nothing" : "met the end of the file (was it truncated?)"))));
  } else {
    sl.done += static_cast<uint64_t>(res) < want ? static_cast<uint64_t>(res) : want;
    if (sl.done < sl.len && !r.failed.load(std::memory_order_acquire)) {
      retry_.push_back(s);  // short transfer: the rest goes again
      return;
    }
    if (sl.done == sl.len && sl.bounce && !r.write) std::memcpy(sl.user, sl.bounce, sl.len);
  }
  release(s);
}

// The queue itself failed (not one op): drain it by recreating it (the old one is destroyed
// only once its ops are finished) and fail every op that was inside.
void Worker::queue_failed(int err) {
  std::unique_ptr<IoContext> fresh;
  try {
    ctx_.reset();
    fresh = make_context(opt_.backend, opt_.queue_depth);
  } catch (...) {
  }
  for (size_t s = 0; s < slots_.size(); ++s) {
    Slot& sl = slots_[s];
    if (!sl.in_kernel) continue;
    Request& r = *sl.owner->task.req;
    sl.in_kernel = false;
    --inflight_;
    r.fail(std::make_exception_ptr(IoError(err, r.file->path,
                                           std::string("the ") + backend_name(opt_.backend) +
                                               " completion queue failed: " + errno_text(err))));
    release(static_cast<int>(s));
  }
  if (fresh) {
    ctx_ = std::move(fresh);
  } else {  // no queue any more: fail everything that is left, so no caller waits forever
    ctx_ = nullptr;
    for (Active& a : active_) {
      a.task.req->fail(std::make_exception_ptr(IoError(err, a.task.req->file->path, "the I/O queue is gone")));
    }
  }
}

void Worker::finish_idle_tasks() {
  for (auto it = active_.begin(); it != active_.end();) {
    const bool failed = it->task.req->failed.load(std::memory_order_acquire);
    if (it->inflight == 0 && (it->cursor >= it->task.end || failed)) {
      std::shared_ptr<Request> req = std::move(it->task.req);
      it = active_.erase(it);
      on_done_(req);
    } else {
      ++it;
    }
  }
}

}  // namespace zc::aio
