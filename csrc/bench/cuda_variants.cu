// Device-time measurements of zerocore's CUDA kernels beside alternative launch layouts, with no
// torch and no Python in the timed region (benchmarks/cuda_variants.py builds and runs it on a GPU
// machine). For issue 35's kernel targets, where gpu_proof.py's per-call timing also counts the
// host's argument checks:
//
// - fp32 -> bf16 cast, 256M elements: zerocore's kernel (zc::cuda::cast; since issue 35's second H100
//   session one float4 per thread over a covering grid, like cast_vec4_flat, which measured 3,045 GB/s
//   against 2,831 for its earlier resident-grid layout) beside layouts a cast
//   could take: one float4 per thread over a grid covering the array (torch's elementwise style),
//   K float4 per thread at warp-contiguous positions of a block tile (K = 2, 4), and the last with
//   the hardware conversion (cvt.rn.bf16x2.f32) plus a NaN fix-up (the CPU kernels keep the NaN
//   payload's top bits, the instruction returns a canonical NaN). Every variant's output is
//   compared byte for byte with zerocore's on random bit patterns (NaNs, Inf, subnormals among
//   them): a faster variant that computes something else is reported as wrong, not timed.
// - references: cudaMemcpyAsync of the same fp32 array (8 bytes moved per element) and of its
//   bf16 half (4 bytes per element).
// - Adam (zc::cuda::adam_step_multi), fp32, 100M parameters: one tensor, and 200 tensors of lognormal
//   sizes (gpu_proof.py's) in three layouts: packed at 16 bytes (the only one before stop 44), at 512
//   bytes (separate tensors from torch's caching allocator: what users' parameter lists are), and
//   rounded up to whole 16 KB chunks (no partial chunk, every block's range line-aligned: what is left
//   of the gap to one tensor is the block -> tensor lookup). Device time between events around the
//   call (its host work is the C++ launch planning only). On the 512-byte layout also the same
//   kernel (csrc/cuda/adam_kernel.cuh) with another lookup or occupancy bound: the binary search of
//   the plain table (the production one with every shift 0, as on this layout), a coarse
//   index (HintedAdamTable: two dependent reads instead of log2(200) ~ 8), each of them with
//   __launch_bounds__(256, 8) (registers capped at 32: 8 blocks per SM instead of 6), and the
//   resident grid (adam_kernel_resident: a contiguous run of chunks per block, the search paid once
//   per block, not per chunk) at 6 and 8 blocks per SM. On the packed layout, the production grid
//   (each tensor's chunks moved onto 128-byte lines, LineAlignedAdamTable: adam.cu's launch grid, chosen
//   when it measured 94.1% of the copy rate there against the plain grid's 85.5%) launched here, and
//   the plain grid (chunks from each tensor's first element). Each variant's p,
//   m and v after one step are compared byte for byte with the production call's on the same layout
//   from the same state: a variant computing something else is reported WRONG. (Stop 43's check
//   compared floats from a state with negative second moments: NaNs, never equal to themselves, so
//   every variant read WRONG whatever it wrote.)
//
// Output: one line per measurement, `name  median_ms  GB/s  ok`, and a JSON object on the last
// line (the Python driver parses it).
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "adam/adam.h"
#include "cuda/adam_kernel.cuh"
#include "cuda/api.h"
#include "cuda/elementwise.h"

namespace {

#define CK(call)                                                                            \
  do {                                                                                      \
    cudaError_t e_ = (call);                                                                \
    if (e_ != cudaSuccess) {                                                                \
      std::fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #call, cudaGetErrorString(e_)); \
      std::exit(2);                                                                         \
    }                                                                                       \
  } while (0)

constexpr int kThreads = 256;

__device__ __forceinline__ uint32_t pack2(float a, float b) {
  return static_cast<uint32_t>(zc::cuda::f32_to_bf16(a)) | (static_cast<uint32_t>(zc::cuda::f32_to_bf16(b)) << 16);
}

// The hardware conversion of two floats, NaN payloads kept as the software conversion keeps them.
__device__ __forceinline__ uint32_t pack2_hw(float a, float b) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  if (a != a || b != b) return pack2(a, b);  // rare: the software path for NaNs
  const __nv_bfloat162 h = __floats2bfloat162_rn(a, b);
  uint32_t u;
  std::memcpy(&u, &h, 4);
  return u;
#else
  return pack2(a, b);
#endif
}

// One float4 per thread, the grid covering the array (n a multiple of 4).
__global__ void __launch_bounds__(kThreads) cast_vec4_flat(const float4* __restrict__ s, uint2* __restrict__ d,
                                                           int64_t nv) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  if (i >= nv) return;
  const float4 v = s[i];
  d[i] = make_uint2(pack2(v.x, v.y), pack2(v.z, v.w));
}

// K float4 per thread at warp-contiguous positions of a tile of K * kThreads float4: all loads
// first, then the stores.
template <int K, bool HW>
__global__ void __launch_bounds__(kThreads) cast_vec4_tile(const float4* __restrict__ s, uint2* __restrict__ d,
                                                           int64_t nv) {
  const int64_t base = static_cast<int64_t>(blockIdx.x) * K * kThreads + threadIdx.x;
  float4 v[K];
#pragma unroll
  for (int k = 0; k < K; ++k) {
    const int64_t i = base + k * kThreads;
    if (i < nv) v[k] = s[i];
  }
#pragma unroll
  for (int k = 0; k < K; ++k) {
    const int64_t i = base + k * kThreads;
    if (i < nv)
      d[i] = HW ? make_uint2(pack2_hw(v[k].x, v[k].y), pack2_hw(v[k].z, v[k].w))
                : make_uint2(pack2(v[k].x, v[k].y), pack2(v[k].z, v[k].w));
  }
}

struct Timer {
  cudaEvent_t a, b;
  Timer() {
    CK(cudaEventCreate(&a));
    CK(cudaEventCreate(&b));
  }
  float ms(const std::function<void()>& f) {
    CK(cudaEventRecord(a));
    f();
    CK(cudaEventRecord(b));
    CK(cudaEventSynchronize(b));
    float t = 0;
    CK(cudaEventElapsedTime(&t, a, b));
    return t;
  }
};

// Median ms of each variant over `rounds`, the variants interleaved (a fresh rotation per round).
std::vector<double> timed(const std::vector<std::function<void()>>& fs, int rounds) {
  Timer t;
  for (int w = 0; w < 3; ++w)
    for (auto& f : fs) f();
  CK(cudaDeviceSynchronize());
  std::vector<std::vector<float>> ms(fs.size());
  for (int r = 0; r < rounds; ++r)
    for (size_t k = 0; k < fs.size(); ++k) {
      const size_t j = (k + r) % fs.size();
      ms[j].push_back(t.ms(fs[j]));
    }
  std::vector<double> med;
  for (auto& v : ms) {
    std::sort(v.begin(), v.end());
    med.push_back(v[v.size() / 2]);
  }
  return med;
}

std::vector<int64_t> lognormal_sizes(int64_t total, int count, unsigned seed) {
  std::mt19937 rng(seed);
  std::lognormal_distribution<double> dist(0.0, 2.0);
  std::vector<double> w(count);
  double sum = 0;
  for (auto& x : w) sum += (x = dist(rng));
  std::vector<int64_t> sizes(count);
  int64_t got = 0;
  for (int i = 0; i < count; ++i) got += (sizes[i] = std::max<int64_t>(1, static_cast<int64_t>(w[i] * total / sum)));
  sizes[0] += total - got;
  return sizes;
}


// The production Adam kernel (csrc/cuda/adam_kernel.cuh) launched with another table lookup or
// occupancy bound, fp32 gradients, AdamW, no 16-bit output: one planned launch of the large table.
using Searched = zc::cuda::AdamTable<zc::cuda::kAdamTableLarge>;
using Hinted = zc::cuda::HintedAdamTable<zc::cuda::kAdamTableLarge, 2048>;
static_assert(sizeof(Hinted) + sizeof(zc::AdamScalars) + sizeof(float*) <= 32764,
              "the hinted table must stay under the 32,764-byte parameter limit of CUDA >= 12.1");

template <class Table, int MIN_BLOCKS>
std::function<void()> adam_variant(const std::vector<zc::AdamTensor>& ts, const zc::cuda::AdamLaunch& l) {
  auto tab = std::make_shared<Table>();
  zc::cuda::fill_adam_table(*tab, ts.data(), l);
  const zc::AdamScalars s = ts[l.tensors[0]].s;
  const unsigned blocks = static_cast<unsigned>(l.chunks);
  return [tab, s, blocks] {
    zc::cuda::adam_kernel<float, zc::no_out_t, false, Table, MIN_BLOCKS>
        <<<blocks, zc::cuda::kAdamThreads>>>(*tab, s, nullptr);
  };
}

// The line-aligned chunk grid (adam_table.h's LineAlignedAdamTable) with the production kernel: its own
// chunk count (one more than the plan's for some tensors).
using LineAligned = zc::cuda::LineAlignedAdamTable<zc::cuda::kAdamTableLarge>;
static_assert(sizeof(LineAligned) + sizeof(zc::AdamScalars) + sizeof(float*) <= 32764,
              "the line-aligned table must stay under the 32,764-byte parameter limit of CUDA >= 12.1");

std::function<void()> adam_line_aligned(const std::vector<zc::AdamTensor>& ts, const zc::cuda::AdamLaunch& l) {
  auto tab = std::make_shared<LineAligned>();
  zc::cuda::fill_adam_table(*tab, ts.data(), l);
  const zc::AdamScalars s = ts[l.tensors[0]].s;
  const unsigned blocks = static_cast<unsigned>(tab->chunks);
  return [tab, s, blocks] {
    zc::cuda::adam_kernel<float, zc::no_out_t, false, LineAligned, 0><<<blocks, zc::cuda::kAdamThreads>>>(*tab, s,
                                                                                                        nullptr);
  };
}

// The resident-grid candidate (adam_kernel.cuh's adam_kernel_resident): as many blocks as the device
// holds at once (the occupancy query), each a contiguous run of chunks.
template <class Table, int MIN_BLOCKS>
std::function<void()> adam_resident(const std::vector<zc::AdamTensor>& ts, const zc::cuda::AdamLaunch& l) {
  auto tab = std::make_shared<Table>();
  zc::cuda::fill_adam_table(*tab, ts.data(), l);
  const zc::AdamScalars s = ts[l.tensors[0]].s;
  const auto kernel = zc::cuda::adam_kernel_resident<float, zc::no_out_t, false, Table, MIN_BLOCKS>;
  int per_sm = 0, sms = 0;
  CK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, zc::cuda::kAdamThreads, 0));
  CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  const unsigned blocks = static_cast<unsigned>(std::min<int64_t>(l.chunks, static_cast<int64_t>(per_sm) * sms));
  std::printf("resident grid (min blocks %d): %d blocks/SM x %d SMs -> %u blocks for %lld chunks\n", MIN_BLOCKS,
              per_sm, sms, blocks, static_cast<long long>(l.chunks));
  const int32_t chunks = static_cast<int32_t>(l.chunks);
  return [tab, s, blocks, chunks, kernel] { kernel<<<blocks, zc::cuda::kAdamThreads>>>(*tab, chunks, s, nullptr); };
}
}  // namespace

int main(int argc, char** argv) {
  const int rounds = argc > 1 ? std::atoi(argv[1]) : 20;
  const int64_t n = int64_t(256) << 20;  // fp32 elements cast
  std::string json = "{";
  auto row = [&](const char* name, double ms, double bytes, const char* ok) {
    std::printf("%-28s %9.3f ms %8.0f GB/s  %s\n", name, ms, bytes / (ms * 1e-3) / 1e9, ok);
    char buf[256];
    std::snprintf(buf, sizeof buf, "%s\"%s\": {\"median_ms\": %.5f, \"gbps\": %.1f, \"ok\": \"%s\"}",
                  json.size() > 1 ? ", " : "", name, ms, bytes / (ms * 1e-3) / 1e9, ok);
    json += buf;
  };

  // ---- cast -------------------------------------------------------------------------------
  std::vector<uint32_t> host(n);
  std::mt19937 rng(7);
  for (auto& x : host) x = rng();  // random bit patterns: NaNs, Infs and subnormals included
  float* src;
  uint16_t *ref, *out;
  CK(cudaMalloc(&src, n * 4));
  CK(cudaMalloc(&ref, n * 2));
  CK(cudaMalloc(&out, n * 2));
  CK(cudaMemcpy(src, host.data(), n * 4, cudaMemcpyHostToDevice));
  zc::cuda::cast(src, zc::DType::F32, ref, zc::DType::BF16, n, 0, nullptr);
  CK(cudaDeviceSynchronize());
  std::vector<uint16_t> want(n), got(n);
  CK(cudaMemcpy(want.data(), ref, n * 2, cudaMemcpyDeviceToHost));
  const int64_t nv = n / 4;
  const auto s4 = reinterpret_cast<const float4*>(src);
  auto d2 = reinterpret_cast<uint2*>(out);
  const unsigned flat_blocks = static_cast<unsigned>((nv + kThreads - 1) / kThreads);
  auto tile_blocks = [&](int k) { return static_cast<unsigned>((nv + k * kThreads - 1) / (k * kThreads)); };
  std::vector<std::pair<const char*, std::function<void()>>> casts = {
      {"cast_zerocore", [&] { zc::cuda::cast(src, zc::DType::F32, out, zc::DType::BF16, n, 0, nullptr); }},
      {"cast_vec4_flat", [&] { cast_vec4_flat<<<flat_blocks, kThreads>>>(s4, d2, nv); }},
      {"cast_vec4_x2", [&] { cast_vec4_tile<2, false><<<tile_blocks(2), kThreads>>>(s4, d2, nv); }},
      {"cast_vec4_x4", [&] { cast_vec4_tile<4, false><<<tile_blocks(4), kThreads>>>(s4, d2, nv); }},
      {"cast_vec4_x4_hwcvt", [&] { cast_vec4_tile<4, true><<<tile_blocks(4), kThreads>>>(s4, d2, nv); }},
  };
  float* copy_dst;
  CK(cudaMalloc(&copy_dst, n * 4));
  std::vector<std::function<void()>> fs;
  std::vector<std::string> ok;
  for (auto& c : casts) {
    CK(cudaMemset(out, 0xAB, n * 2));  // poisoned: every element must be written
    c.second();
    CK(cudaGetLastError());
    CK(cudaDeviceSynchronize());
    CK(cudaMemcpy(got.data(), out, n * 2, cudaMemcpyDeviceToHost));
    ok.push_back(got == want ? "bit-exact" : "WRONG");
    fs.push_back(c.second);
  }
  fs.push_back([&] { CK(cudaMemcpyAsync(copy_dst, src, n * 4, cudaMemcpyDeviceToDevice)); });
  fs.push_back([&] { CK(cudaMemcpyAsync(out, ref, n * 2, cudaMemcpyDeviceToDevice)); });
  const std::vector<double> med = timed(fs, rounds);
  for (size_t k = 0; k < casts.size(); ++k) row(casts[k].first, med[k], 6.0 * n, ok[k].c_str());
  row("memcpy_fp32_array", med[casts.size()], 8.0 * n, "reference");
  row("memcpy_bf16_array", med[casts.size() + 1], 4.0 * n, "reference");
  CK(cudaFree(copy_dst));
  CK(cudaFree(src));
  CK(cudaFree(ref));
  CK(cudaFree(out));

  // ---- Adam -------------------------------------------------------------------------------
  // One pool of four arrays (p, g, m, v), each with room for the layouts' padding. Values from a hash
  // of the index (fast to make for 400M floats); v >= 0 as a second moment is (a negative v makes NaNs,
  // and the stop-43 check compared floats, where NaN != NaN: every variant read WRONG).
  const int64_t params = 100'000'000;
  const int64_t C = zc::cuda::kAdamChunkElems;
  const int64_t stride = params + 201 * C;
  float* pool;
  CK(cudaMalloc(&pool, stride * 4 * sizeof(float)));
  float* const P = pool;
  float* const G = pool + stride;
  float* const M = pool + 2 * stride;
  float* const V = pool + 3 * stride;
  auto unit = [](uint64_t i, uint64_t salt) {  // splitmix64 -> [0, 1)
    uint64_t z = (i + 1) * 0x9E3779B97F4A7C15ull ^ salt;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return static_cast<float>((z ^ (z >> 31)) >> 40) * (1.0f / 16777216.0f);
  };
  std::vector<float> init_p(stride), init_g(stride), init_m(stride), init_v(stride);
  for (int64_t i = 0; i < stride; ++i) {
    init_p[i] = 2.0f * unit(i, 1) - 1.0f;
    init_g[i] = 0.02f * unit(i, 2) - 0.01f;
    init_m[i] = 0.02f * unit(i, 3) - 0.01f;
    init_v[i] = 1e-4f * unit(i, 4) + 1e-8f;
  }
  CK(cudaMemcpy(G, init_g.data(), stride * 4, cudaMemcpyHostToDevice));
  auto reset = [&] {
    CK(cudaMemcpy(P, init_p.data(), stride * 4, cudaMemcpyHostToDevice));
    CK(cudaMemcpy(M, init_m.data(), stride * 4, cudaMemcpyHostToDevice));
    CK(cudaMemcpy(V, init_v.data(), stride * 4, cudaMemcpyHostToDevice));
  };
  const zc::AdamScalars sc = zc::adam_scalars(1e-4, 0.9, 0.999, 1e-8, 0.01, 10, true, 1.0);
  // The layouts: each tensor starts at a multiple of `align` elements; whole_chunks rounds each size up
  // to whole chunks (no partial last chunk). Returns the tensors and the elements they span.
  auto tensors_of = [&](const std::vector<int64_t>& sizes, int64_t align, bool whole_chunks) {
    std::vector<zc::AdamTensor> ts;
    int64_t off = 0;
    for (int64_t sz : sizes) {
      off = (off + align - 1) / align * align;
      zc::AdamTensor t{};
      t.param = P + off;
      t.grad = G + off;
      t.exp_avg = M + off;
      t.exp_avg_sq = V + off;
      t.grad_dtype = zc::DType::F32;
      t.numel = whole_chunks ? (sz + C - 1) / C * C : sz;
      t.s = sc;
      ts.push_back(t);
      off += t.numel;
    }
    if (off > stride) {
      std::fprintf(stderr, "cuda_variants: a layout spans %lld elements, more than the pool's %lld\n",
                   static_cast<long long>(off), static_cast<long long>(stride));
      std::exit(2);
    }
    return std::make_pair(ts, off);
  };
  const std::vector<int64_t> sizes200 = lognormal_sizes(params - 200 * 4, 200, 0);
  struct Layout {
    const char* name;
    std::vector<zc::AdamTensor> ts;
    int64_t span;
  };
  std::vector<Layout> layouts;
  auto add_layout = [&](const char* name, const std::vector<int64_t>& sizes, int64_t align, bool whole) {
    auto [ts, span] = tensors_of(sizes, align, whole);
    layouts.push_back({name, ts, span});
  };
  add_layout("flat", {params}, 4, false);
  add_layout("packed16", sizes200, 4, false);      // 16-byte aligned, packed: earlier sessions' only 200 layout
  add_layout("aligned512", sizes200, 128, false);  // 512-byte aligned: separate tensors from torch's allocator
  add_layout("whole_chunks", sizes200, C, true);   // whole 16 KB chunks: what is left is the lookup
  const Layout& real = layouts[2];

  struct AdamRun {
    const char* name;
    const Layout* layout;
    std::function<void()> f;
    bool production;  // zc::cuda::adam_step_multi itself: its layout's reference
  };
  auto production = [](const Layout& L) {
    return [&L] { zc::cuda::adam_step_multi(L.ts.data(), static_cast<int64_t>(L.ts.size()), nullptr, 0, nullptr); };
  };
  std::vector<AdamRun> adams = {
      {"adam_fp32_flat", &layouts[0], production(layouts[0]), true},
      {"adam_fp32_200_tensors", &layouts[1], production(layouts[1]), true},
      {"adam_fp32_200_aligned512", &layouts[2], production(layouts[2]), true},
      {"adam_fp32_200_whole_chunks", &layouts[3], production(layouts[3]), true}};
  const std::vector<zc::cuda::AdamLaunch> plan =
      zc::cuda::plan_adam(real.ts.data(), static_cast<int64_t>(real.ts.size()), zc::cuda::kAdamTableLarge);
  const Layout& packed = layouts[1];
  const std::vector<zc::cuda::AdamLaunch> packed_plan =
      zc::cuda::plan_adam(packed.ts.data(), static_cast<int64_t>(packed.ts.size()), zc::cuda::kAdamTableLarge);
  const bool one_launch = zc::cuda::large_kernel_params() && plan.size() == 1 && packed_plan.size() == 1;
  if (one_launch) {
    // on the packed layout: the production grid (each tensor's chunks moved onto 128-byte lines) launched
    // here, and the plain grid (chunks from each tensor's first element: what adam.cu launched before)
    adams.push_back({"adam_200_packed_line_aligned", &packed, adam_line_aligned(packed.ts, packed_plan[0]), false});
    adams.push_back({"adam_200_packed_plain_grid", &packed, adam_variant<Searched, 0>(packed.ts, packed_plan[0]), false});
    // on the 512-byte layout (every shift 0: the two grids are one) the lookups and occupancy bounds
    adams.push_back({"adam_200_search", &real, adam_variant<Searched, 0>(real.ts, plan[0]), false});
    adams.push_back({"adam_200_search_occ8", &real, adam_variant<Searched, 8>(real.ts, plan[0]), false});
    adams.push_back({"adam_200_hinted", &real, adam_variant<Hinted, 0>(real.ts, plan[0]), false});
    adams.push_back({"adam_200_hinted_occ8", &real, adam_variant<Hinted, 8>(real.ts, plan[0]), false});
    adams.push_back({"adam_200_resident_occ6", &real, adam_resident<Searched, 6>(real.ts, plan[0]), false});
    adams.push_back({"adam_200_resident_occ8", &real, adam_resident<Searched, 8>(real.ts, plan[0]), false});
  }
  // correctness: each variant steps its layout's state once from the same values; its p, m and v must
  // be the production call's bytes on that layout
  auto state = [&](const Layout& L) {
    CK(cudaDeviceSynchronize());
    std::vector<float> to(3 * static_cast<size_t>(L.span));
    float* const arrays[3] = {P, M, V};
    for (int k = 0; k < 3; ++k)
      CK(cudaMemcpy(to.data() + k * L.span, arrays[k], L.span * 4, cudaMemcpyDeviceToHost));
    return to;
  };
  std::vector<std::string> adam_ok;
  for (const AdamRun& a : adams) {
    if (a.production) {
      adam_ok.push_back("device time");
      continue;
    }
    const AdamRun* ref = nullptr;
    for (const AdamRun& r : adams)
      if (r.production && r.layout == a.layout) ref = &r;
    reset();
    ref->f();
    CK(cudaGetLastError());
    const std::vector<float> want_state = state(*a.layout);
    reset();
    a.f();
    CK(cudaGetLastError());
    const std::vector<float> got_state = state(*a.layout);
    const bool same = std::memcmp(want_state.data(), got_state.data(), want_state.size() * sizeof(float)) == 0;
    adam_ok.push_back(same ? "device time, bit-exact" : "WRONG");
  }
  std::vector<std::function<void()>> afs;
  for (auto& a : adams) afs.push_back(a.f);
  const std::vector<double> am = timed(afs, rounds);
  for (size_t k = 0; k < adams.size(); ++k) {
    int64_t numel = 0;
    for (const zc::AdamTensor& t : adams[k].layout->ts) numel += t.numel;
    row(adams[k].name, am[k], 28.0 * static_cast<double>(numel), adam_ok[k].c_str());
  }
  if (!one_launch) std::printf("(lookup variants not run: the 200 tensors are not one launch of the large table)\n");
  CK(cudaFree(pool));
  std::printf("%s}\n", json.c_str());
  return 0;
}
