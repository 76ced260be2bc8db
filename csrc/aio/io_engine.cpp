#include "aio/io_engine.h"

#include <algorithm>
#include <cstddef>
#include <mutex>
#include <stdexcept>
#include <utility>

#include "aio/aligned_buffer.h"
#include "aio/io_error.h"

namespace zc::aio {

void validate(const EngineOptions& o) {
  if (o.block_size < kAlign || o.block_size % kAlign != 0 || o.block_size > (1ull << 30)) {
    throw std::invalid_argument("block_size must be a multiple of 4096 between 4096 and 1 GiB, got " +
                                std::to_string(o.block_size));
  }
  if (o.queue_depth < 1 || o.queue_depth > 4096) {
    throw std::invalid_argument("queue_depth must be between 1 and 4096, got " + std::to_string(o.queue_depth));
  }
  if (o.threads < 1 || o.threads > 1024) {
    throw std::invalid_argument("threads must be between 1 and 1024, got " + std::to_string(o.threads));
  }
}

Engine::Engine(const EngineOptions& opt) : opt_(opt) {
  validate(opt_);
  WorkerOptions w{opt_.block_size, opt_.queue_depth, opt_.backend, opt_.single_submit, opt_.overlap_events};
  workers_.reserve(static_cast<size_t>(opt_.threads));
  for (int i = 0; i < opt_.threads; ++i) {
    workers_.push_back(std::make_unique<Worker>(w, [this](const std::shared_ptr<Request>& r) { task_done(r); }));
  }
}

Engine::~Engine() {
  std::unique_lock<std::mutex> lk(mu_);
  cv_.wait(lk, [&] { return pending_ == 0; });
  lk.unlock();
  workers_.clear();
}

std::shared_ptr<Request> Engine::start(bool write, bool sync, void* buf, uint64_t nbytes, const std::string& path,
                                       int64_t offset, std::shared_ptr<void> keepalive, SubmitInfo* info) {
  if (offset < 0) throw std::invalid_argument("offset must be >= 0, got " + std::to_string(offset));
  if (buf == nullptr && nbytes > 0) throw std::invalid_argument("buffer is null");
  if (path.empty()) throw std::invalid_argument("path is empty");
  const uint64_t off = static_cast<uint64_t>(offset), end = off + nbytes;
  const bool need_edges = nbytes > 0 && (off % kAlign != 0 || end % kAlign != 0);

  auto r = std::make_shared<Request>();
  r->write = write;
  r->sync = sync;
  r->buf = static_cast<char*>(buf);
  r->nbytes = nbytes;
  r->offset = offset;
  r->keepalive = std::move(keepalive);
  r->file = open_file(path, write, opt_.direct, need_edges, offset, nbytes, simulate_no_direct_.load());

  // Direct I/O moves whole aligned blocks [ms, me); the unaligned rest goes through the page
  // cache. Without O_DIRECT everything is "middle" and nothing needs aligning.
  std::vector<Task> tasks;
  uint64_t ms = off, me = end;
  if (r->file->direct && nbytes > 0) {
    ms = align_up(off);
    me = align_down(end);
    if (ms >= me) {
      tasks.push_back(Task{r, off, end, true});
      ms = me = 0;
    } else {
      if (off < ms) tasks.push_back(Task{r, off, ms, true});
      if (me < end) tasks.push_back(Task{r, me, end, true});
    }
  }
  if (me > ms) {
    const uint64_t bs = opt_.block_size;
    const uint64_t blocks = (me - ms + bs - 1) / bs;
    const uint64_t slices = std::min<uint64_t>(static_cast<uint64_t>(opt_.threads), blocks);
    for (uint64_t i = 0; i < slices; ++i) {
      const uint64_t b0 = ms + blocks * i / slices * bs;
      const uint64_t b1 = i + 1 == slices ? me : ms + blocks * (i + 1) / slices * bs;
      tasks.push_back(Task{r, b0, b1, false});
    }
  }
  if (info) {
    info->direct = r->file->direct;
    info->bounced = r->file->direct && me > ms && !is_aligned(r->ptr_at(ms));
  }

  r->tasks_left.store(static_cast<int>(tasks.size()), std::memory_order_relaxed);
  if (!sync) {
    std::lock_guard<std::mutex> lk(mu_);
    ++pending_;
  }
  if (tasks.empty()) {
    finish(r);
    return r;
  }
  const uint32_t first = next_worker_.fetch_add(1, std::memory_order_relaxed);
  for (size_t i = 0; i < tasks.size(); ++i) {
    workers_[(first + i) % workers_.size()]->push(std::move(tasks[i]));
  }
  return r;
}

SubmitInfo Engine::submit(bool write, void* buf, uint64_t nbytes, const std::string& path, int64_t offset,
                          std::shared_ptr<void> keepalive) {
  SubmitInfo info{};
  start(write, false, buf, nbytes, path, offset, std::move(keepalive), &info);
  return info;
}

SubmitInfo Engine::run(bool write, void* buf, uint64_t nbytes, const std::string& path, int64_t offset) {
  SubmitInfo info{};
  std::shared_ptr<Request> r = start(write, true, buf, nbytes, path, offset, nullptr, &info);
  std::unique_lock<std::mutex> lk(mu_);
  cv_.wait(lk, [&] { return r->done; });
  lk.unlock();
  if (r->error) std::rethrow_exception(r->error);
  return info;
}

void Engine::task_done(const std::shared_ptr<Request>& r) {
  if (r->tasks_left.fetch_sub(1, std::memory_order_acq_rel) == 1) finish(r);
}

void Engine::finish(const std::shared_ptr<Request>& r) {
  {
    std::lock_guard<std::mutex> lk(mu_);
    r->done = true;
    if (!r->sync) {
      --pending_;
      ++completed_;
      if (r->error && !first_error_) first_error_ = r->error;
      if (r->keepalive) released_.push_back(std::move(r->keepalive));
    }
  }
  cv_.notify_all();
}

int64_t Engine::wait(std::vector<std::shared_ptr<void>>* released) {
  std::unique_lock<std::mutex> lk(mu_);
  cv_.wait(lk, [&] { return pending_ == 0; });
  const int64_t n = std::exchange(completed_, 0);
  std::exception_ptr err = std::exchange(first_error_, nullptr);
  std::vector<std::shared_ptr<void>> rel = std::exchange(released_, {});
  lk.unlock();
  if (released) *released = std::move(rel);
  if (err) std::rethrow_exception(err);
  return n;
}

int64_t Engine::pending() const {
  std::lock_guard<std::mutex> lk(mu_);
  return pending_;
}

}  // namespace zc::aio
