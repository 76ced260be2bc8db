// Pack many tensors into one flat device buffer (gaps zeroed, as zc::pack does) and unpack
// it back, in one launch for the whole bucket.
//
// The host turns the segments into a sorted list of pieces (for pack they tile the whole
// buffer, gaps included), which the binding copies to device memory. The grid tiles the flat
// buffer in kTileBytes pieces; each block binary-searches the first piece that reaches its
// tile and copies every piece overlapping the tile. Copies use the widest unit (16, 8, 4, 2
// or 1 bytes) that source and destination share modulo 16, after a byte-wise head that
// aligns the destination, so tensors at any offset work and aligned ones move 16 bytes per
// access. Byte-based: every dtype.
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <numeric>
#include <stdexcept>
#include <string>
#include <vector>

#include "common.cuh"

namespace zc {
namespace cuda {
namespace {

constexpr int kPackThreads = 256;

__device__ __forceinline__ int64_t imin(int64_t a, int64_t b) { return a < b ? a : b; }
__device__ __forceinline__ int64_t imax(int64_t a, int64_t b) { return a > b ? a : b; }
constexpr int64_t kTileBytes = 16384;

template <int U>
struct Unit;
template <> struct Unit<16> { using T = uint4; };
template <> struct Unit<8> { using T = uint2; };
template <> struct Unit<4> { using T = uint32_t; };
template <> struct Unit<2> { using T = uint16_t; };
template <> struct Unit<1> { using T = uint8_t; };

// The block copies n bytes; src and dst are congruent modulo U.
template <int U>
__device__ __forceinline__ void block_copy(char* dst, const char* src, int64_t n) {
  using T = typename Unit<U>::T;
  const int64_t head = imin(n, (U - static_cast<int64_t>(reinterpret_cast<uintptr_t>(dst) & (U - 1))) & (U - 1));
  if (threadIdx.x < head) dst[threadIdx.x] = src[threadIdx.x];
  const int64_t units = (n - head) / U;
  T* d = reinterpret_cast<T*>(dst + head);
  const T* s = reinterpret_cast<const T*>(src + head);
  for (int64_t i = threadIdx.x; i < units; i += kPackThreads) d[i] = s[i];
  const int64_t done = head + units * U;
  if (done + threadIdx.x < n) dst[done + threadIdx.x] = src[done + threadIdx.x];
}

__device__ __forceinline__ void block_zero(char* dst, int64_t n) {
  const int64_t head = imin(n, (16 - static_cast<int64_t>(reinterpret_cast<uintptr_t>(dst) & 15)) & 15);
  if (threadIdx.x < head) dst[threadIdx.x] = 0;
  const int64_t units = (n - head) / 16;
  uint4* d = reinterpret_cast<uint4*>(dst + head);
  for (int64_t i = threadIdx.x; i < units; i += kPackThreads) d[i] = make_uint4(0, 0, 0, 0);
  const int64_t done = head + units * 16;
  if (done + threadIdx.x < n) dst[done + threadIdx.x] = 0;
}

__device__ __forceinline__ void block_copy_any(char* dst, const char* src, int64_t n) {
  const uintptr_t diff = reinterpret_cast<uintptr_t>(dst) ^ reinterpret_cast<uintptr_t>(src);
  if ((diff & 15) == 0) block_copy<16>(dst, src, n);
  else if ((diff & 7) == 0) block_copy<8>(dst, src, n);
  else if ((diff & 3) == 0) block_copy<4>(dst, src, n);
  else if ((diff & 1) == 0) block_copy<2>(dst, src, n);
  else block_copy<1>(dst, src, n);
}

// The block's tile of the flat buffer: every piece overlapping it.
template <bool kPack>
__device__ __forceinline__ void pack_tile(const PackPiece* __restrict__ pieces, int64_t count, char* flat,
                                          int64_t flat_bytes) {
  const int64_t tile_begin = static_cast<int64_t>(blockIdx.x) * kTileBytes;
  const int64_t tile_end = imin(tile_begin + kTileBytes, flat_bytes);
  // First piece ending after tile_begin.
  int64_t lo = 0, hi = count;
  while (lo < hi) {
    const int64_t mid = (lo + hi) >> 1;
    if (pieces[mid].flat_offset + pieces[mid].nbytes <= tile_begin) lo = mid + 1;
    else hi = mid;
  }
  for (int64_t k = lo; k < count; ++k) {
    const PackPiece pc = pieces[k];
    if (pc.flat_offset >= tile_end) break;
    const int64_t b = imax(pc.flat_offset, tile_begin);
    const int64_t e = imin(pc.flat_offset + pc.nbytes, tile_end);
    if (e <= b) continue;
    char* tensor = static_cast<char*>(pc.data);
    if (kPack) {
      if (tensor == nullptr) block_zero(flat + b, e - b);
      else block_copy_any(flat + b, tensor + (b - pc.flat_offset), e - b);
    } else {
      block_copy_any(tensor + (b - pc.flat_offset), flat + b, e - b);
    }
  }
}

// The piece table in device memory (staged there by the binding): any number of pieces.
template <bool kPack>
__global__ void __launch_bounds__(kPackThreads) pack_kernel(const PackPiece* __restrict__ pieces, int64_t count,
                                                             char* flat, int64_t flat_bytes) {
  pack_tile<kPack>(pieces, count, flat, flat_bytes);
}

// The piece table passed by value in the kernel's parameters (the usual bucket: no host
// allocation, no host-to-device copy, no event). __grid_constant__: the blocks read the
// parameter in place instead of each thread copying it to local memory. N: kPackInlineSmall
// (under the 4 KB limit of every CUDA version) or kPackInlineLarge (32 KB, CUDA >= 12.1).
template <int N>
struct PackInline {
  PackPiece pieces[N];
  int64_t count;
};
static_assert(sizeof(PackInline<kPackInlineSmall>) + sizeof(char*) + sizeof(int64_t) <= 4000,
              "pack kernel arguments must stay under the 4 KB parameter limit");
#if ZC_LARGE_KERNEL_PARAMS
static_assert(sizeof(PackInline<kPackInlineLarge>) + sizeof(char*) + sizeof(int64_t) <= kLargeKernelParamBytes,
              "the large pack table must stay under the 32,764-byte parameter limit of CUDA >= 12.1");
#endif

template <bool kPack, int N>
__global__ void __launch_bounds__(kPackThreads) pack_kernel_inline(const __grid_constant__ PackInline<N> table,
                                                                    char* flat, int64_t flat_bytes) {
  pack_tile<kPack>(table.pieces, table.count, flat, flat_bytes);
}

template <int N>
void launch_inline(const PackPiece* host_pieces, int64_t num_pieces, char* flat, int64_t flat_bytes, bool pack,
                   int64_t tiles, cudaStream_t stream) {
  PackInline<N> table;
  std::copy(host_pieces, host_pieces + num_pieces, table.pieces);
  table.count = num_pieces;
  if (pack)
    pack_kernel_inline<true, N><<<static_cast<unsigned>(tiles), kPackThreads, 0, stream>>>(table, flat, flat_bytes);
  else
    pack_kernel_inline<false, N><<<static_cast<unsigned>(tiles), kPackThreads, 0, stream>>>(table, flat, flat_bytes);
}

}  // namespace

std::vector<PackPiece> plan_pack(const Segment* s, int64_t n, int64_t flat_bytes, bool pack) {
  const char* op = pack ? "pack (CUDA)" : "unpack (CUDA)";
  if (flat_bytes < 0) throw std::invalid_argument(std::string(op) + ": negative flat buffer size");
  std::vector<int64_t> order(static_cast<size_t>(n));
  std::iota(order.begin(), order.end(), 0);
  for (int64_t i = 0; i < n; ++i) {
    if (s[i].offset_bytes < 0 || s[i].nbytes < 0 || s[i].offset_bytes > flat_bytes - s[i].nbytes)
      throw std::invalid_argument(std::string(op) + ": tensor " + std::to_string(i) + " at byte offset " +
                                  std::to_string(s[i].offset_bytes) + " with " + std::to_string(s[i].nbytes) +
                                  " bytes does not fit in the flat buffer of " + std::to_string(flat_bytes) + " bytes");
    if (s[i].nbytes > 0 && s[i].data == nullptr)
      throw std::invalid_argument(std::string(op) + ": tensor " + std::to_string(i) + " has a null data pointer");
  }
  std::stable_sort(order.begin(), order.end(),
                   [&](int64_t a, int64_t b) { return s[a].offset_bytes < s[b].offset_bytes; });
  // The same overlap rule as the CPU zc::pack: neighbours in offset order may not overlap.
  for (size_t k = 1; k < order.size(); ++k) {
    const Segment& prev = s[order[k - 1]];
    if (prev.offset_bytes + prev.nbytes > s[order[k]].offset_bytes)
      throw std::invalid_argument(std::string(op) + ": tensors " + std::to_string(order[k - 1]) + " and " +
                                  std::to_string(order[k]) + " overlap in the flat buffer");
  }
  std::vector<PackPiece> pieces;
  int64_t cursor = 0;
  for (int64_t i : order) {
    const Segment& seg = s[i];
    if (seg.nbytes == 0) continue;
    if (pack && seg.offset_bytes > cursor) pieces.push_back({cursor, seg.offset_bytes - cursor, nullptr});
    pieces.push_back({seg.offset_bytes, seg.nbytes, seg.data});
    cursor = seg.offset_bytes + seg.nbytes;
  }
  if (pack && flat_bytes > cursor) pieces.push_back({cursor, flat_bytes - cursor, nullptr});
  return pieces;
}

void pack_pieces(const PackPiece* device_pieces, int64_t num_pieces, void* flat, int64_t flat_bytes, bool pack,
                 int device, cudaStream_t stream) {
  if (flat_bytes <= 0 || num_pieces <= 0) return;
  const int64_t tiles = ceil_div(flat_bytes, kTileBytes);
  if (tiles > 0x7fffffff) throw std::invalid_argument("pack (CUDA): flat buffer too large for one launch");
  DeviceGuard guard(device);
  if (pack)
    pack_kernel<true><<<static_cast<unsigned>(tiles), kPackThreads, 0, stream>>>(device_pieces, num_pieces,
                                                                                  static_cast<char*>(flat), flat_bytes);
  else
    pack_kernel<false><<<static_cast<unsigned>(tiles), kPackThreads, 0, stream>>>(device_pieces, num_pieces,
                                                                                   static_cast<char*>(flat), flat_bytes);
  ZC_LAUNCH_CHECK("pack_kernel");
}

int pack_inline_capacity() { return large_kernel_params() ? kPackInlineLarge : kPackInlineSmall; }

void pack_pieces_inline(const PackPiece* host_pieces, int64_t num_pieces, void* flat, int64_t flat_bytes, bool pack,
                        int device, cudaStream_t stream) {
  if (flat_bytes <= 0 || num_pieces <= 0) return;
  if (num_pieces > pack_inline_capacity())
    throw std::invalid_argument("pack (CUDA): " + std::to_string(num_pieces) + " pieces do not fit the inline table of " +
                                std::to_string(pack_inline_capacity()));
  const int64_t tiles = ceil_div(flat_bytes, kTileBytes);
  if (tiles > 0x7fffffff) throw std::invalid_argument("pack (CUDA): flat buffer too large for one launch");
  DeviceGuard guard(device);
  char* f = static_cast<char*>(flat);
#if ZC_LARGE_KERNEL_PARAMS
  if (num_pieces > kPackInlineSmall) {  // a small bucket keeps the small table: fewer parameter bytes per launch
    launch_inline<kPackInlineLarge>(host_pieces, num_pieces, f, flat_bytes, pack, tiles, stream);
    ZC_LAUNCH_CHECK("pack_kernel_inline");
    return;
  }
#endif
  launch_inline<kPackInlineSmall>(host_pieces, num_pieces, f, flat_bytes, pack, tiles, stream);
  ZC_LAUNCH_CHECK("pack_kernel_inline");
}

}  // namespace cuda
}  // namespace zc
