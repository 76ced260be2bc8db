// Page-aligned, page-locked (best effort) host memory: what O_DIRECT needs from a buffer.
// Memory comes from mmap so its size is whole pages and unmapping it also unlocks it.
#pragma once

#include <cstdint>

namespace zc::aio {

// File offsets, lengths and buffer addresses of O_DIRECT I/O are multiples of this. 4096 is a
// multiple of every logical block size in use (512 or 4096) and is the page size.
constexpr uint64_t kAlign = 4096;

inline uint64_t align_down(uint64_t x) { return x & ~(kAlign - 1); }
inline uint64_t align_up(uint64_t x) { return (x + kAlign - 1) & ~(kAlign - 1); }
inline bool is_aligned(const void* p) { return (reinterpret_cast<uintptr_t>(p) & (kAlign - 1)) == 0; }

// Allocates at least `bytes` (rounded up to whole pages, at least one page) of zeroed,
// page-aligned memory and tries to mlock it; `*locked` says whether that worked (it needs
// CAP_IPC_LOCK or enough RLIMIT_MEMLOCK). Throws std::bad_alloc when mmap fails.
void* alloc_aligned(uint64_t bytes, bool lock, bool* locked, uint64_t* capacity);
void free_aligned(void* p, uint64_t capacity) noexcept;

// Owning handle of one such allocation.
class AlignedBuffer {
 public:
  AlignedBuffer() = default;
  explicit AlignedBuffer(uint64_t bytes, bool lock = true);
  ~AlignedBuffer() { reset(); }
  AlignedBuffer(AlignedBuffer&& o) noexcept;
  AlignedBuffer& operator=(AlignedBuffer&& o) noexcept;
  AlignedBuffer(const AlignedBuffer&) = delete;
  AlignedBuffer& operator=(const AlignedBuffer&) = delete;

  char* data() const { return static_cast<char*>(ptr_); }
  uint64_t capacity() const { return capacity_; }
  bool locked() const { return locked_; }
  void reset() noexcept;

 private:
  void* ptr_ = nullptr;
  uint64_t capacity_ = 0;
  bool locked_ = false;
};

}  // namespace zc::aio
