#include "aio/aligned_buffer.h"

#include <sys/mman.h>

#include <new>
#include <utility>

namespace zc::aio {

void* alloc_aligned(uint64_t bytes, bool lock, bool* locked, uint64_t* capacity) {
  const uint64_t cap = align_up(bytes == 0 ? 1 : bytes);
  void* p = mmap(nullptr, cap, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED) throw std::bad_alloc();
  const bool ok = lock && mlock(p, cap) == 0;  // best effort: unlocked memory still works
  if (locked) *locked = ok;
  if (capacity) *capacity = cap;
  return p;
}

void free_aligned(void* p, uint64_t capacity) noexcept {
  if (p) munmap(p, capacity);  // also drops the lock
}

AlignedBuffer::AlignedBuffer(uint64_t bytes, bool lock) { ptr_ = alloc_aligned(bytes, lock, &locked_, &capacity_); }

AlignedBuffer::AlignedBuffer(AlignedBuffer&& o) noexcept
    : ptr_(std::exchange(o.ptr_, nullptr)), capacity_(std::exchange(o.capacity_, 0)), locked_(o.locked_) {}

AlignedBuffer& AlignedBuffer::operator=(AlignedBuffer&& o) noexcept {
  if (this != &o) {
    reset();
    ptr_ = std::exchange(o.ptr_, nullptr);
    capacity_ = std::exchange(o.capacity_, 0);
    locked_ = o.locked_;
  }
  return *this;
}

void AlignedBuffer::reset() noexcept {
  free_aligned(ptr_, capacity_);
  ptr_ = nullptr;
  capacity_ = 0;
  locked_ = false;
}

}  // namespace zc::aio
