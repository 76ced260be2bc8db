// One I/O thread with its own kernel queue (libaio context or io_uring): cuts its tasks into
// blocks, keeps up to queue_depth of them in flight, copies through its aligned bounce
// buffers when the caller's memory is not aligned, and resubmits short transfers.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <list>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include "aio/aligned_buffer.h"
#include "aio/io_context.h"
#include "aio/request.h"

namespace zc::aio {

struct WorkerOptions {
  uint64_t block_size = 1 << 20;
  int queue_depth = 8;
  Backend backend = Backend::LibAio;
  bool single_submit = false;   // one op per submit call instead of a batch
  bool overlap_events = true;   // refill as each op completes instead of after the whole batch
};

class Worker {
 public:
  using DoneFn = std::function<void(const std::shared_ptr<Request>&)>;
  // Creates the kernel queue (throws IoError when refused) and starts the thread.
  Worker(const WorkerOptions& opt, DoneFn on_task_done);
  ~Worker();  // finishes what was queued, then joins
  Worker(const Worker&) = delete;
  Worker& operator=(const Worker&) = delete;

  void push(Task t);

 private:
  struct Active {
    Task task;
    uint64_t cursor = 0;  // next file offset to issue
    int inflight = 0;     // blocks issued and not finished (including ones awaiting resubmission)
  };
  struct Slot {
    Active* owner = nullptr;
    uint64_t file_off = 0, len = 0, done = 0;
    char* user = nullptr;    // caller's memory for file_off
    char* bounce = nullptr;  // aligned copy used for the transfer, or null
    bool in_kernel = false;
  };

  void loop();
  void run_page_cache(Task& t);
  void build_batch();
  bool issue_block(IoOp* op);
  IoOp make_op(int slot) const;
  void submit_batch();
  void complete(int slot, int64_t res);
  void release(int slot);
  void queue_failed(int err);
  void finish_idle_tasks();

  WorkerOptions opt_;
  DoneFn on_done_;
  std::unique_ptr<IoContext> ctx_;
  AlignedBuffer bounce_;  // queue_depth blocks, allocated on first need

  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Task> queue_;
  bool stop_ = false;

  // Owned by the worker thread.
  std::list<Active> active_;
  std::vector<Slot> slots_;
  std::vector<int> free_slots_;
  std::vector<int> retry_;
  std::vector<IoOp> batch_;
  std::vector<IoDone> events_;
  int inflight_ = 0;  // ops inside the kernel

  std::thread thread_;  // last: starts after everything above exists
};

}  // namespace zc::aio
