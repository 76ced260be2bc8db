// The CUDA kernels' C++ face: raw pointers, sizes, a device index and a cudaStream_t.
//
// This header includes neither torch nor the CUDA runtime headers, so the binding
// (csrc/bindings_cuda.cpp) compiles against any torch build, the CPU one included: streams
// arrive from Python as integers (torch.cuda.current_stream().cuda_stream) and are cast to
// cudaStream_t here. Only the .cu files see the CUDA runtime.
//
// Errors: bad arguments throw std::invalid_argument (ValueError in Python); CUDA failures
// throw std::runtime_error naming the call and cudaGetErrorString (RuntimeError).
#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "../adam/adam.h"
#include "../common/dtype.h"
#include "../flatten/flatten.h"

// Exactly the CUDA runtime's own typedef (driver_types.h), so both may be seen in one TU.
struct CUstream_st;
typedef struct CUstream_st* cudaStream_t;

namespace zc {
namespace cuda {

// ---- Device and build information (never throw) -------------------------------------
// Number of CUDA devices the runtime sees; 0 when there is no driver or no device.
int device_count();
// Human-readable reason device_count() is 0 ("" when it is not).
std::string device_error();
// The virtual architectures the kernels were compiled for (80, 90, ...), from nvcc.
std::vector<int> compiled_archs();
// CUDA runtime version the kernels were compiled against, e.g. 13000.
int runtime_version_compiled();
// For `device`: the binary (SASS) and PTX version the Adam kernel would run with, e.g.
// {90, 90}; throws if no kernel image suits the device.
std::vector<int> kernel_versions(int device);

// ---- Multi-tensor Adam / AdamW --------------------------------------------------------
// One launch carries a table of its tensors (addresses, sizes and the index of each tensor's
// first chunk) in its kernel arguments; one block per chunk of kAdamChunkElems elements, any
// number of chunks per tensor. The table holds kAdamTableLarge tensors where the kernels were
// compiled with CUDA >= 12.1 and the driver is >= 12.1 (32 KB of kernel parameters), else
// kAdamTableSmall (the 4 KB limit of older ones): adam_table_capacity() says which. Tensors
// with different gradient / output dtypes or different scalars (e.g. step counts) go to
// different launches; more tensors than the table holds take several launches.
constexpr int kAdamTableSmall = 64;
constexpr int kAdamTableLarge = 512;
constexpr int64_t kAdamChunkElems = 4096;
constexpr int kAdamThreads = 256;
// kAdamTableLarge or kAdamTableSmall (see above); never throws.
int adam_table_capacity();

struct AdamLaunch {
  std::vector<int64_t> tensors;  // indices into the caller's array, in order
  int64_t chunks = 0;            // chunks of its tensors on the plain grid (the launch adds at most one a tensor: adam.cu)
};
// How adam_step_multi will split `n` tensors into launches of at most `max_tensors` each
// (kAdamTableSmall or kAdamTableLarge; adam_step_multi passes adam_table_capacity()). Host
// only; for tests.
std::vector<AdamLaunch> plan_adam(const AdamTensor* tensors, int64_t n, int max_tensors);

// Steps the tensors in place, like zc::adam_step_multi (same AdamScalars, same operation
// order, bit-identical results). `device_grad_scale`: nullptr, or a device float that
// multiplies every tensor's folded grad_scale (clip coefficient computed on the device,
// no host sync).
void adam_step_multi(const AdamTensor* tensors, int64_t n, const float* device_grad_scale, int device,
                     cudaStream_t stream);

// ---- Pack / unpack ---------------------------------------------------------------------
// A byte range of the flat buffer and where its bytes come from / go to. For pack, gaps
// between tensors are pieces with data == nullptr (zero-filled).
struct PackPiece {
  int64_t flat_offset;
  int64_t nbytes;
  void* data;
};
// Validates the segments (bounds, no overlap: std::invalid_argument naming them) and
// returns the pieces sorted by offset; for pack they cover [0, flat_bytes) exactly.
std::vector<PackPiece> plan_pack(const Segment* segments, int64_t n, int64_t flat_bytes, bool pack);
// One launch over the whole flat buffer. `pieces` is plan_pack's result copied to device
// memory (the binding stages it through pinned memory on the same stream).
void pack_pieces(const PackPiece* device_pieces, int64_t num_pieces, void* flat, int64_t flat_bytes, bool pack,
                 int device, cudaStream_t stream);
// Up to pack_inline_capacity() pieces travel in the kernel's parameters by value:
// pack_pieces_inline takes plan_pack's result in host memory and launches at once, with no
// device copy of the table. kPackInlineLarge (a 600-tensor bucket with its gaps) where large
// kernel parameters work (CUDA >= 12.1, as adam_table_capacity), else kPackInlineSmall (63
// tensors with gaps, the 4 KB limit of older ones).
constexpr int kPackInlineSmall = 128;
constexpr int kPackInlineLarge = 1280;
int pack_inline_capacity();  // never throws
void pack_pieces_inline(const PackPiece* host_pieces, int64_t num_pieces, void* flat, int64_t flat_bytes, bool pack,
                        int device, cudaStream_t stream);

// ---- Casts -----------------------------------------------------------------------------
// fp32 <-> bf16 / fp16 (and bf16 <-> fp16, equal dtypes copy), round-to-nearest-even, NaN
// and Inf kept bit for bit as csrc/common/half.h does. Either side may be pinned host memory
// (the kernel reads or writes it over the bus: a cast fused with the copy).
void cast(const void* src, DType src_dtype, void* dst, DType dst_dtype, int64_t n, int device,
          cudaStream_t stream);
// Device address of pinned host memory (UVA); throws if `host` is not pinned.
void* host_device_pointer(const void* host);

// ---- Sum of squares + Inf/NaN flag ----------------------------------------------------
// Doubles of workspace sum_squares needs for n elements.
int64_t sum_squares_workspace(int64_t n);
// Writes the sum of squares (accumulated in double) to *out_sum and whether any element is
// Inf/NaN to *out_nonfinite, both in device memory: no host sync. Deterministic for a given
// n (the block count depends on n only; partial sums are added in a fixed order).
void sum_squares(const void* src, DType dtype, int64_t n, double* workspace, double* out_sum,
                 bool* out_nonfinite, int device, cudaStream_t stream);

// ---- Pinned host memory and async copies --------------------------------------------
// Page-locked host buffers, cached for reuse. A buffer returned to the pool is handed out
// again only once every copy recorded on it (record_use) has finished, so a buffer can be
// released right after queueing a copy. Sizes are rounded up to 4 KiB pages (blocks are
// page aligned, as O_DIRECT needs) and to at most 1/8 above the request, never to the next
// power of two. limit_bytes > 0 caps what the pool holds. cache = false: for long-lived buffers
// (offloaded optimizer state), sizes are rounded to pages only and a released block whose
// copies are done goes back to the system at once (one with copies pending waits for trim()).
class PinnedPool {
 public:
  explicit PinnedPool(int64_t limit_bytes = 0, bool cache = true);
  ~PinnedPool();
  PinnedPool(const PinnedPool&) = delete;
  PinnedPool& operator=(const PinnedPool&) = delete;

  // Returns at least nbytes of pinned memory; throws std::runtime_error when the limit or
  // the system refuses.
  void* acquire(int64_t nbytes);
  // Back to the pool (reused when its recorded copies are done).
  void release(void* ptr);
  // Work queued on `stream` (of `device`) reads or writes the block containing ptr: the
  // block is not handed out again before that work is done. Returns false if ptr is not
  // pool memory.
  bool record_use(const void* ptr, int device, cudaStream_t stream);
  // Frees the cached blocks that are idle and whose copies are done; returns bytes freed.
  int64_t trim();
  // Capacity of the block containing ptr (0 if not pool memory).
  int64_t capacity(const void* ptr);

  struct Stats {
    int64_t reserved_bytes, in_use_bytes, peak_reserved_bytes, limit_bytes;
    int64_t blocks, hits, misses;
  };
  Stats stats();

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};
// Rounds a request the way the pool does (for tests and sizing).
int64_t pinned_block_bytes(int64_t nbytes);

// cudaMemcpyAsync(dst, src, nbytes, cudaMemcpyDefault, stream) on `device`.
void memcpy_async(void* dst, const void* src, int64_t nbytes, int device, cudaStream_t stream);
// Whether ptr is page-locked host memory the runtime knows (cudaHostAlloc / registered).
bool is_pinned_host(const void* ptr);

}  // namespace cuda
}  // namespace zc
