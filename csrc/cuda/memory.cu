// Pinned host buffer pool and async host<->device copies, for offload.
//
// Blocks come from cudaHostAlloc (portable, mapped: usable by every device and by kernels
// through UVA), page aligned. A released block is kept for reuse; it is handed out again only
// when every event recorded on it (one per copy queued through it, see record_use) has
// completed, so callers may release a buffer right after queueing a copy from it. Sizes are
// rounded to at most 1/8 above the request (and to 4 KiB), not to the next power of two as
// torch's pinned allocator does: offload buffers are large, and doubling them wastes RAM.
#include <cstddef>
#include <cstdint>
#include <map>
#include <mutex>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "common.cuh"

namespace zc {
namespace cuda {

int64_t pinned_block_bytes(int64_t nbytes) {
  if (nbytes <= 4096) return 4096;
  int64_t p = 1;
  while (p <= nbytes / 2) p <<= 1;  // largest power of two <= nbytes
  const int64_t granule = p / 8 > 4096 ? p / 8 : 4096;
  return ceil_div(nbytes, granule) * granule;
}

struct PinnedPool::Impl {
  struct Block {
    int64_t bytes = 0;
    bool in_use = false;
    std::vector<cudaEvent_t> events;  // copies queued through the block, not yet seen done
  };
  std::mutex mu;
  std::map<uintptr_t, Block> blocks;               // by address
  std::multimap<int64_t, uintptr_t> idle;          // by size
  int64_t limit = 0, reserved = 0, in_use = 0, peak = 0, hits = 0, misses = 0;
  bool cache = true;  // keep released blocks for reuse (else free them once their copies are done)

  // Drops the completed events; true when none is pending.
  static bool done(Block& b) {
    size_t keep = 0;
    for (cudaEvent_t ev : b.events) {
      const cudaError_t st = cudaEventQuery(ev);
      if (st == cudaSuccess) {
        (void)cudaEventDestroy(ev);
      } else if (st == cudaErrorNotReady) {
        b.events[keep++] = ev;
      } else {
        throw_cuda(st, "cudaEventQuery (pinned pool)");
      }
    }
    b.events.resize(keep);
    return keep == 0;
  }

  Block* containing(const void* ptr) {
    const uintptr_t a = reinterpret_cast<uintptr_t>(ptr);
    auto it = blocks.upper_bound(a);
    if (it == blocks.begin()) return nullptr;
    --it;
    return a < it->first + static_cast<uintptr_t>(it->second.bytes) ? &it->second : nullptr;
  }

  int64_t trim_locked() {
    int64_t freed = 0;
    for (auto it = idle.begin(); it != idle.end();) {
      Block& b = blocks.at(it->second);
      if (!done(b)) {
        ++it;
        continue;
      }
      ZC_CUDA_CHECK(cudaFreeHost(reinterpret_cast<void*>(it->second)));
      freed += b.bytes;
      reserved -= b.bytes;
      blocks.erase(it->second);
      it = idle.erase(it);
    }
    return freed;
  }
};

PinnedPool::PinnedPool(int64_t limit_bytes, bool cache) : impl_(new Impl) {
  if (limit_bytes < 0) throw std::invalid_argument("PinnedPool: limit_bytes must be >= 0 (0: no limit)");
  impl_->limit = limit_bytes;
  impl_->cache = cache;
}

PinnedPool::~PinnedPool() {
  // Never throws: may run at interpreter exit, after the CUDA runtime began to unload.
  for (auto& kv : impl_->blocks) {
    for (cudaEvent_t ev : kv.second.events) {
      (void)cudaEventSynchronize(ev);
      (void)cudaEventDestroy(ev);
    }
    (void)cudaFreeHost(reinterpret_cast<void*>(kv.first));
  }
  (void)cudaGetLastError();
}

void* PinnedPool::acquire(int64_t nbytes) {
  if (nbytes < 0) throw std::invalid_argument("PinnedPool.acquire: negative size");
  std::lock_guard<std::mutex> lock(impl_->mu);
  Impl& m = *impl_;
  const int64_t size = m.cache ? pinned_block_bytes(nbytes) : ceil_div(nbytes > 0 ? nbytes : 1, int64_t{4096}) * 4096;
  for (auto it = m.idle.lower_bound(size); it != m.idle.end() && it->first <= size + size / 8; ++it) {
    Impl::Block& b = m.blocks.at(it->second);
    if (!Impl::done(b)) continue;
    const uintptr_t addr = it->second;
    m.idle.erase(it);
    b.in_use = true;
    m.in_use += b.bytes;
    ++m.hits;
    return reinterpret_cast<void*>(addr);
  }
  if (m.limit > 0 && m.reserved + size > m.limit) m.trim_locked();
  if (m.limit > 0 && m.reserved + size > m.limit)
    throw std::runtime_error("PinnedPool: a " + std::to_string(size) + "-byte buffer would exceed the pool's limit of " +
                             std::to_string(m.limit) + " bytes (" + std::to_string(m.reserved) + " reserved, " +
                             std::to_string(m.in_use) + " in use)");
  void* p = nullptr;
  const cudaError_t st = cudaHostAlloc(&p, static_cast<size_t>(size), cudaHostAllocPortable | cudaHostAllocMapped);
  if (st != cudaSuccess) {
    (void)cudaGetLastError();
    throw std::runtime_error("PinnedPool: cudaHostAlloc of " + std::to_string(size) + " bytes failed (" +
                             cudaGetErrorString(st) + "); " + std::to_string(m.reserved) +
                             " bytes already pinned by this pool. Lower the offload buffer sizes or raise the "
                             "locked-memory limit (ulimit -l).");
  }
  Impl::Block b;
  b.bytes = size;
  b.in_use = true;
  m.blocks.emplace(reinterpret_cast<uintptr_t>(p), std::move(b));
  m.reserved += size;
  m.in_use += size;
  if (m.reserved > m.peak) m.peak = m.reserved;
  ++m.misses;
  return p;
}

void PinnedPool::release(void* ptr) {
  std::lock_guard<std::mutex> lock(impl_->mu);
  Impl& m = *impl_;
  auto it = m.blocks.find(reinterpret_cast<uintptr_t>(ptr));
  if (it == m.blocks.end() || !it->second.in_use)
    throw std::invalid_argument("PinnedPool.release: pointer is not a buffer handed out by this pool");
  it->second.in_use = false;
  m.in_use -= it->second.bytes;
  if (!m.cache && Impl::done(it->second)) {  // back to the system now (cudaFreeHost waits for the device)
    (void)cudaFreeHost(reinterpret_cast<void*>(it->first));
    (void)cudaGetLastError();  // (at interpreter exit the runtime may be unloading: nothing to do then)
    m.reserved -= it->second.bytes;
    m.blocks.erase(it);
    return;
  }
  m.idle.emplace(it->second.bytes, it->first);
}

bool PinnedPool::record_use(const void* ptr, int device, cudaStream_t stream) {
  std::lock_guard<std::mutex> lock(impl_->mu);
  Impl::Block* b = impl_->containing(ptr);
  if (b == nullptr) return false;
  DeviceGuard guard(device);  // an event belongs to the device current when it is created
  cudaEvent_t ev;
  ZC_CUDA_CHECK(cudaEventCreateWithFlags(&ev, cudaEventDisableTiming));
  const cudaError_t st = cudaEventRecord(ev, stream);
  if (st != cudaSuccess) {
    (void)cudaEventDestroy(ev);
    throw_cuda(st, "cudaEventRecord (pinned pool)");
  }
  b->events.push_back(ev);
  return true;
}

int64_t PinnedPool::trim() {
  std::lock_guard<std::mutex> lock(impl_->mu);
  return impl_->trim_locked();
}

int64_t PinnedPool::capacity(const void* ptr) {
  std::lock_guard<std::mutex> lock(impl_->mu);
  Impl::Block* b = impl_->containing(ptr);
  return b ? b->bytes : 0;
}

PinnedPool::Stats PinnedPool::stats() {
  std::lock_guard<std::mutex> lock(impl_->mu);
  const Impl& m = *impl_;
  return Stats{m.reserved, m.in_use, m.peak, m.limit, static_cast<int64_t>(m.blocks.size()), m.hits, m.misses};
}

void memcpy_async(void* dst, const void* src, int64_t nbytes, int device, cudaStream_t stream) {
  if (nbytes < 0) throw std::invalid_argument("memcpy_async: negative size");
  if (nbytes == 0) return;
  DeviceGuard guard(device);
  ZC_CUDA_CHECK(cudaMemcpyAsync(dst, src, static_cast<size_t>(nbytes), cudaMemcpyDefault, stream));
}

bool is_pinned_host(const void* ptr) {
  cudaPointerAttributes attr;
  if (cudaPointerGetAttributes(&attr, ptr) != cudaSuccess) {
    (void)cudaGetLastError();
    return false;
  }
  return attr.type == cudaMemoryTypeHost;
}

}  // namespace cuda
}  // namespace zc
