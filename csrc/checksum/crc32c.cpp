#include "checksum/crc32c.h"

#include <cstring>

namespace zc {
namespace {

constexpr uint32_t kPoly = 0x82F63B78u;  // reflected Castagnoli polynomial

struct Table {
  uint32_t t[256];
  Table() {
    for (uint32_t i = 0; i < 256; ++i) {
      uint32_t c = i;
      for (int k = 0; k < 8; ++k) c = (c & 1) ? (c >> 1) ^ kPoly : c >> 1;
      t[i] = c;
    }
  }
};
const Table kTable;

// Polynomial arithmetic mod P in the reflected representation (bit 31 is x^0): what combining
// the CRCs of consecutive pieces needs. crc(A || B) = mul(x^(8|B|), crc(A)) ^ crc(B) on the
// raw register (no pre/post inversion).
uint32_t multmodp(uint32_t a, uint32_t b) {
  uint32_t m = 1u << 31, p = 0;
  for (;;) {
    if (a & m) {
      p ^= b;
      if ((a & (m - 1)) == 0) break;
    }
    m >>= 1;
    b = (b & 1) ? (b >> 1) ^ kPoly : b >> 1;
  }
  return p;
}

struct PowTable {  // x^(2^k) mod P
  uint32_t t[64];
  PowTable() {
    uint32_t p = 1u << 30;  // x^1
    t[0] = p;
    for (int k = 1; k < 64; ++k) t[k] = p = multmodp(p, p);
  }
};
const PowTable kPow;

uint32_t x8n(uint64_t n) {  // x^(8n) mod P
  uint32_t p = 1u << 31;
  for (unsigned k = 3; n; n >>= 1, ++k)
    if (n & 1) p = multmodp(kPow.t[k & 63], p);
  return p;
}

uint32_t raw_scalar(const unsigned char* p, int64_t n, uint32_t c) {
  for (int64_t i = 0; i < n; ++i) c = kTable.t[(c ^ p[i]) & 0xFF] ^ (c >> 8);
  return c;
}

#if defined(__x86_64__) || defined(_M_X64)
// Raw register over n bytes, copying them to dst when it is not null. Large inputs run as three
// independent streams (the instruction has a 3-cycle latency and a 1-cycle throughput, so one
// stream leaves two thirds of it idle), combined at the end; the copy rides in the same pass, so
// checksumming what is copied costs about what the copy alone costs.
template <bool kCopy>
__attribute__((target("sse4.2"))) uint32_t raw_sse42(const unsigned char* p, unsigned char* dst, int64_t n,
                                                     uint32_t crc) {
  uint64_t c = crc;
  constexpr int64_t kSplit = 3 * 4096;
  if (n >= kSplit) {
    const int64_t len = n / 24 * 8;  // bytes per stream, a multiple of 8
    const unsigned char *pa = p, *pb = p + len, *pc = p + 2 * len;
    uint64_t a = c, b = 0, d = 0;
    for (int64_t i = 0; i < len; i += 8) {
      uint64_t va, vb, vc;
      std::memcpy(&va, pa + i, 8);
      std::memcpy(&vb, pb + i, 8);
      std::memcpy(&vc, pc + i, 8);
      if (kCopy) {
        std::memcpy(dst + i, &va, 8);
        std::memcpy(dst + len + i, &vb, 8);
        std::memcpy(dst + 2 * len + i, &vc, 8);
      }
      a = __builtin_ia32_crc32di(a, va);
      b = __builtin_ia32_crc32di(b, vb);
      d = __builtin_ia32_crc32di(d, vc);
    }
    c = multmodp(x8n(2 * len), static_cast<uint32_t>(a)) ^ multmodp(x8n(len), static_cast<uint32_t>(b)) ^
        static_cast<uint32_t>(d);
    p += 3 * len;
    if (kCopy) dst += 3 * len;
    n -= 3 * len;
  }
  while (n >= 8) {
    uint64_t v;
    std::memcpy(&v, p, 8);
    if (kCopy) {
      std::memcpy(dst, &v, 8);
      dst += 8;
    }
    c = __builtin_ia32_crc32di(c, v);
    p += 8;
    n -= 8;
  }
  uint32_t c32 = static_cast<uint32_t>(c);
  while (n-- > 0) {
    if (kCopy) *dst++ = *p;
    c32 = __builtin_ia32_crc32qi(c32, *p++);
  }
  return c32;
}
bool have_sse42() { return __builtin_cpu_supports("sse4.2"); }
#else
template <bool kCopy>
uint32_t raw_sse42(const unsigned char*, unsigned char*, int64_t, uint32_t crc) { return crc; }
bool have_sse42() { return false; }
#endif

const bool kHardware = have_sse42();

}  // namespace

uint32_t crc32c_scalar(const void* data, int64_t n, uint32_t crc) {
  return ~raw_scalar(static_cast<const unsigned char*>(data), n, ~crc);
}

uint32_t crc32c(const void* data, int64_t n, uint32_t crc) {
  if (!kHardware) return crc32c_scalar(data, n, crc);
  return ~raw_sse42<false>(static_cast<const unsigned char*>(data), nullptr, n, ~crc);
}

uint32_t copy_crc32c(const void* src, void* dst, int64_t n, uint32_t crc) {
  if (!kHardware) {
    std::memcpy(dst, src, static_cast<size_t>(n));
    return crc32c_scalar(dst, n, crc);
  }
  return ~raw_sse42<true>(static_cast<const unsigned char*>(src), static_cast<unsigned char*>(dst), n, ~crc);
}

uint32_t crc32c_combine(uint32_t crc1, uint32_t crc2, uint64_t len2) { return multmodp(x8n(len2), crc1) ^ crc2; }

bool crc32c_hardware() { return kHardware; }

}  // namespace zc
