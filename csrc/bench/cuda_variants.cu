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
// - Adam (zc::cuda::adam_step_multi), fp32, 100M parameters as one tensor and as 200 tensors of
//   lognormal sizes (gpu_proof.py's layout): device time between events around the call (the
//   call's host work is the C++ launch planning only). On the 200 tensors also the same kernel
//   (csrc/cuda/adam_kernel.cuh) with another block -> tensor lookup or occupancy bound: the binary
//   search of the production table (launched here, to check this launch path times as the call
//   does), a coarse index (HintedAdamTable: two dependent reads instead of log2(200) ~ 8), and each
//   of them with __launch_bounds__(256, 8) (registers capped at 32: 8 blocks per SM instead of 6).
//   Each variant's p, m and v after one step are compared byte for byte with the production
//   kernel's from the same state: a variant computing something else is reported WRONG.
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
  const int64_t params = 100'000'000;
  float* pool;
  CK(cudaMalloc(&pool, params * 4 * 4 + 4096 * 4 * 4));
  std::vector<float> init(params);
  for (auto& x : init) x = std::uniform_real_distribution<float>(-1e-2f, 1e-2f)(rng);
  for (int k = 0; k < 4; ++k) CK(cudaMemcpy(pool + k * (params + 4096), init.data(), params * 4, cudaMemcpyHostToDevice));
  const zc::AdamScalars sc = zc::adam_scalars(1e-4, 0.9, 0.999, 1e-8, 0.01, 10, true, 1.0);
  auto tensors_of = [&](const std::vector<int64_t>& sizes) {
    std::vector<zc::AdamTensor> ts;
    int64_t off = 0;
    for (int64_t sz : sizes) {
      zc::AdamTensor t{};
      t.param = pool + off;
      t.grad = pool + (params + 4096) + off;
      t.exp_avg = pool + 2 * (params + 4096) + off;
      t.exp_avg_sq = pool + 3 * (params + 4096) + off;
      t.grad_dtype = zc::DType::F32;
      t.numel = sz;
      t.s = sc;
      ts.push_back(t);
      off += (sz + 3) / 4 * 4;  // 16-byte aligned, as separate allocations are
    }
    return ts;
  };
  auto flat = tensors_of({params});
  auto many = tensors_of(lognormal_sizes(params - 200 * 4, 200, 0));
  std::vector<std::pair<const char*, std::function<void()>>> adams = {
      {"adam_fp32_flat", [&] { zc::cuda::adam_step_multi(flat.data(), 1, nullptr, 0, nullptr); }},
      {"adam_fp32_200_tensors", [&] {
         zc::cuda::adam_step_multi(many.data(), static_cast<int64_t>(many.size()), nullptr, 0, nullptr);
       }}};
  const std::vector<zc::cuda::AdamLaunch> plan =
      zc::cuda::plan_adam(many.data(), static_cast<int64_t>(many.size()), zc::cuda::kAdamTableLarge);
  const bool one_launch = zc::cuda::large_kernel_params() && plan.size() == 1;
  if (one_launch) {
    adams.push_back({"adam_200_search", adam_variant<Searched, 0>(many, plan[0])});
    adams.push_back({"adam_200_search_occ8", adam_variant<Searched, 8>(many, plan[0])});
    adams.push_back({"adam_200_hinted", adam_variant<Hinted, 0>(many, plan[0])});
    adams.push_back({"adam_200_hinted_occ8", adam_variant<Hinted, 8>(many, plan[0])});
  }
  // correctness: every variant steps the same state once; its p, m, v must equal the production call's
  const size_t state_bytes = static_cast<size_t>(params + 4096) * 4;
  std::vector<float> want_state, got_state;
  auto reset = [&] {
    CK(cudaMemcpy(pool, init.data(), params * 4, cudaMemcpyHostToDevice));                        // p
    CK(cudaMemcpy(pool + 2 * (params + 4096), init.data(), params * 4, cudaMemcpyHostToDevice));  // m
    CK(cudaMemcpy(pool + 3 * (params + 4096), init.data(), params * 4, cudaMemcpyHostToDevice));  // v
  };
  auto state = [&](std::vector<float>& to) {
    CK(cudaDeviceSynchronize());
    to.resize(3 * (params + 4096));
    for (int k : {0, 2, 3})
      CK(cudaMemcpy(to.data() + (k == 0 ? 0 : k - 1) * (params + 4096), pool + k * (params + 4096), state_bytes,
                    cudaMemcpyDeviceToHost));
  };
  std::vector<std::string> adam_ok(adams.size(), "device time");
  for (size_t k = 1; k < adams.size(); ++k) {
    reset();
    adams[k].second();
    CK(cudaGetLastError());
    state(k == 1 ? want_state : got_state);
    if (k > 1) adam_ok[k] = got_state == want_state ? "device time, bit-exact" : "WRONG";
  }
  std::vector<std::function<void()>> afs;
  for (auto& a : adams) afs.push_back(a.second);
  const std::vector<double> am = timed(afs, rounds);
  for (size_t k = 0; k < adams.size(); ++k) row(adams[k].first, am[k], 28.0 * params, adam_ok[k].c_str());
  if (!one_launch) std::printf("(lookup variants not run: the 200 tensors are not one launch of the large table)\n");
  CK(cudaFree(pool));
  std::printf("%s}\n", json.c_str());
  return 0;
}
