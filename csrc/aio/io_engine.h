// The NVMe I/O engine: asynchronous reads and writes of whole host buffers to files, cut into
// blocks spread over `threads` workers, each keeping up to `queue_depth` blocks in flight on
// an O_DIRECT descriptor. Unaligned memory goes through aligned bounce buffers; an unaligned
// head or tail of the file range goes through the page cache, so any size at any offset works
// and the file ends exactly where the data does. Torch-free: raw pointers and sizes.
//
// Errors: bad options throw std::invalid_argument; everything the file system says no to
// (open, a missing file, a read past the end) throws IoError from submit()/run(); failures
// during the transfer are collected and the first one is thrown by wait().
//
// Requests in flight together run concurrently and in no particular order: two requests that
// overlap in the same file must be separated by wait().
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <exception>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "aio/file.h"
#include "aio/io_context.h"
#include "aio/request.h"
#include "aio/worker.h"

namespace zc::aio {

struct EngineOptions {
  uint64_t block_size = 1 << 20;  // multiple of 4096
  int queue_depth = 8;            // blocks in flight per worker
  int threads = 1;                // workers, each with its own kernel queue
  Backend backend = Backend::LibAio;
  bool single_submit = false;
  bool overlap_events = true;
  DirectMode direct = DirectMode::Auto;
};

// Throws std::invalid_argument naming the option.
void validate(const EngineOptions& o);

struct SubmitInfo {
  bool direct;   // O_DIRECT was used (false: the file system refused it, page cache instead)
  bool bounced;  // the memory was not 4096-aligned: blocks are copied through bounce buffers
};

class Engine {
 public:
  explicit Engine(const EngineOptions& opt);
  ~Engine();  // waits for what is in flight (errors dropped), then stops the workers
  Engine(const Engine&) = delete;
  Engine& operator=(const Engine&) = delete;

  // Starts moving [buf, buf+nbytes) to/from [offset, offset+nbytes) of `path`. `keepalive`
  // is held until wait() hands it back, so whatever owns buf outlives the transfer.
  SubmitInfo submit(bool write, void* buf, uint64_t nbytes, const std::string& path, int64_t offset,
                    std::shared_ptr<void> keepalive);
  // The same, and waits for it; throws its error. Independent of wait()'s count.
  SubmitInfo run(bool write, void* buf, uint64_t nbytes, const std::string& path, int64_t offset);
  // Waits for every submitted request; returns how many completed since the last wait and
  // throws the first error among them. `released` receives their keepalives (so the caller
  // chooses the thread that drops them).
  int64_t wait(std::vector<std::shared_ptr<void>>* released = nullptr);
  int64_t pending() const;

  const EngineOptions& options() const { return opt_; }
  // Tests: behave as if every file system refused O_DIRECT.
  void set_simulate_no_direct(bool v) { simulate_no_direct_.store(v); }

 private:
  std::shared_ptr<Request> start(bool write, bool sync, void* buf, uint64_t nbytes, const std::string& path,
                                 int64_t offset, std::shared_ptr<void> keepalive, SubmitInfo* info);
  void task_done(const std::shared_ptr<Request>& r);
  void finish(const std::shared_ptr<Request>& r);

  EngineOptions opt_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  int64_t pending_ = 0;
  int64_t completed_ = 0;
  std::exception_ptr first_error_;
  std::vector<std::shared_ptr<void>> released_;
  std::atomic<uint32_t> next_worker_{0};
  std::atomic<bool> simulate_no_direct_{false};
  std::vector<std::unique_ptr<Worker>> workers_;  // last: destroyed first
};

}  // namespace zc::aio
