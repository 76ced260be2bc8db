// One transfer as the engine tracks it, and the pieces (tasks) it is cut into for the workers.
#pragma once

#include <atomic>
#include <cstdint>
#include <exception>
#include <memory>
#include <mutex>
#include <utility>

#include "aio/file.h"

namespace zc::aio {

struct Request {
  bool write = false;
  bool sync = false;
  char* buf = nullptr;  // memory of file offset `offset`
  uint64_t nbytes = 0;
  int64_t offset = 0;
  std::shared_ptr<OpenFile> file;
  std::shared_ptr<void> keepalive;  // whatever owns `buf` (the tensor), released by wait()
  std::atomic<int> tasks_left{0};
  std::atomic<bool> failed{false};  // set on the first error: other tasks stop issuing blocks
  std::mutex error_mu;
  std::exception_ptr error;  // the first error
  bool done = false;         // guarded by the engine's mutex

  char* ptr_at(uint64_t file_offset) const { return buf + (file_offset - static_cast<uint64_t>(offset)); }

  void fail(std::exception_ptr e) noexcept {
    std::lock_guard<std::mutex> lk(error_mu);
    if (!error) error = std::move(e);
    failed.store(true, std::memory_order_release);
  }
};

struct Task {
  std::shared_ptr<Request> req;
  uint64_t begin = 0, end = 0;  // absolute file offsets
  // true: an unaligned head/tail, moved with plain pread/pwrite through the page cache;
  // false: whole aligned blocks through the worker's kernel queue.
  bool page_cache = false;
};

}  // namespace zc::aio
