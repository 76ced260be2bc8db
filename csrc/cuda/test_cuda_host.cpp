// Native test of the CUDA part, run by ctest wherever nvcc built it.
//
// Everywhere (no GPU needed): the device-side element math of elementwise.h, compiled here
// for the host, against the CPU kernels bit for bit (the 16-bit conversions over every high
// half-word with the rounding-critical low bits, the Adam element on random data of every
// dtype combination); the launch planning of pack/unpack (the multi-tensor Adam's planning is
// test_adam_plan_host.cpp's, run from main() here); the pinned pool's size rounding; and that
// every entry point fails with an exception, not a crash, when there is no device.
//
// Where a device exists: the kernels themselves against the CPU kernels (Adam and casts bit
// for bit, sum of squares to 1e-12, pack/unpack exactly), on raw cudaMalloc memory, no
// torch involved; and the pinned pool's reuse rule.
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <exception>
#include <memory>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

#include "adam/adam.h"
#include "tests/check.h"
#include "cast/cast.h"
#include "common/half.h"
#include "cuda/api.h"
#include "cuda/elementwise.h"
#include "cuda/test_adam_plan_host.h"
#include "flatten/flatten.h"
#include "norm/norm.h"

#include <cuda_runtime_api.h>

namespace {
constexpr cudaMemcpyKind kMemcpyDefault = cudaMemcpyDefault;


uint32_t bits(float f) { return zc::f32_bits(f); }

// ---- element math against the CPU kernels -----------------------------------------------
void test_conversions() {
  for (uint32_t h = 0; h < 0x10000u; ++h) {
    const uint16_t x = static_cast<uint16_t>(h);
    CHECK(bits(zc::cuda::bf16_to_f32(x)) == bits(zc::bf16_bits_to_f32(x)), "bf16 %04x", h);
    CHECK(bits(zc::cuda::f16_to_f32(x)) == bits(zc::f16_bits_to_f32(x)), "f16 %04x", h);
  }
  // Every high half-word with the low bits that decide the rounding (bf16 drops 16 bits,
  // fp16 drops 13 plus the exponent re-bias and the subnormal range).
  const uint32_t lows[] = {0x0000, 0x0001, 0x0fff, 0x1000, 0x1001, 0x1fff, 0x2000, 0x3000, 0x5000,
                           0x7fff, 0x8000, 0x8001, 0x9000, 0xbfff, 0xc000, 0xefff, 0xf000, 0xffff};
  int64_t bad16 = 0, badbf = 0;
  for (uint32_t hi = 0; hi < 0x10000u; ++hi)
    for (uint32_t lo : lows) {
      const float f = zc::bits_f32((hi << 16) | lo);
      badbf += zc::cuda::f32_to_bf16(f) != zc::f32_to_bf16_bits(f);
      bad16 += zc::cuda::f32_to_f16(f) != zc::f32_to_f16_bits(f);
    }
  std::mt19937 rng(11);
  std::uniform_int_distribution<uint32_t> any;
  for (int i = 0; i < 4000000; ++i) {
    const float f = zc::bits_f32(any(rng));
    badbf += zc::cuda::f32_to_bf16(f) != zc::f32_to_bf16_bits(f);
    bad16 += zc::cuda::f32_to_f16(f) != zc::f32_to_f16_bits(f);
  }
  CHECK(badbf == 0, "%lld fp32->bf16 mismatches", static_cast<long long>(badbf));
  CHECK(bad16 == 0, "%lld fp32->fp16 mismatches", static_cast<long long>(bad16));
}

struct AdamData {
  std::vector<float> p, m, v;
  std::vector<uint8_t> g, out;
};

AdamData random_adam(int64_t n, zc::DType gdt, std::mt19937& rng) {
  std::normal_distribution<float> normal(0.0f, 1.0f);
  AdamData d;
  std::vector<float> g32(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) {
    d.p.push_back(normal(rng));
    d.m.push_back(0.1f * normal(rng));
    d.v.push_back(std::fabs(0.01f * normal(rng)) + 1e-7f);
    g32[i] = normal(rng) * (i % 97 == 0 ? 1e3f : 1.0f);  // finite in fp16: NaN bits differ CPU vs GPU
  }
  d.g.resize(static_cast<size_t>(n) * zc::dtype_size(gdt));
  zc::cast(g32.data(), zc::DType::F32, d.g.data(), gdt, n, 1);
  return d;
}

float load_any(const uint8_t* g, zc::DType dt, int64_t i) {
  uint16_t h;
  switch (dt) {
    case zc::DType::F32: { float f; std::memcpy(&f, g + 4 * i, 4); return zc::cuda::load_f(&f); }
    case zc::DType::BF16: std::memcpy(&h, g + 2 * i, 2); return zc::cuda::bf16_to_f32(h);
    case zc::DType::F16: std::memcpy(&h, g + 2 * i, 2); return zc::cuda::f16_to_f32(h);
  }
  return 0.0f;
}

void test_adam_element() {
  std::mt19937 rng(5);
  const int64_t n = 4099;
  for (zc::DType gdt : {zc::DType::F32, zc::DType::BF16, zc::DType::F16})
    for (zc::DType odt : {zc::DType::BF16, zc::DType::F16})
      for (bool adamw : {true, false})
        for (double wd : {0.0, 0.05}) {
          const zc::AdamScalars s = zc::adam_scalars(3e-3, 0.9, 0.95, 1e-8, wd, 11, adamw, 0.25);
          const AdamData base = random_adam(n, gdt, rng);
          AdamData cpu = base;
          cpu.out.assign(static_cast<size_t>(n) * 2, 0);
          zc::AdamTensor t{cpu.p.data(), cpu.g.data(), cpu.m.data(), cpu.v.data(), cpu.out.data(), n, gdt, odt, s};
          zc::adam_step_multi(&t, 1, 2);
          int64_t bad = 0;
          for (int64_t i = 0; i < n; ++i) {
            float p = base.p[i], m = base.m[i], v = base.v[i];
            const float g = load_any(base.g.data(), gdt, i);
            if (s.l2_wd != 0.0f) zc::cuda::adam_element<true>(p, g, m, v, s.grad_scale, s);
            else zc::cuda::adam_element<false>(p, g, m, v, s.grad_scale, s);
            uint16_t o = odt == zc::DType::BF16 ? zc::cuda::f32_to_bf16(p) : zc::cuda::f32_to_f16(p), co;
            std::memcpy(&co, cpu.out.data() + 2 * i, 2);
            bad += bits(p) != bits(cpu.p[i]) || bits(m) != bits(cpu.m[i]) || bits(v) != bits(cpu.v[i]) || o != co;
          }
          CHECK(bad == 0, "adam element: %lld of %lld differ (gdt %d odt %d adamw %d wd %g)",
                static_cast<long long>(bad), static_cast<long long>(n), static_cast<int>(gdt), static_cast<int>(odt),
                adamw, wd);
        }
}

// ---- planning (the multi-tensor Adam's: test_adam_plan_host.cpp) ------------------------

void test_plan_pack() {
  char buf[64];
  std::vector<zc::Segment> segs = {{buf, 40, 8}, {buf, 0, 10}, {buf, 10, 0}, {buf, 12, 20}};
  const auto p = zc::cuda::plan_pack(segs.data(), 4, 64, true);
  // 0-10 data, 10-12 gap, 12-32 data, 32-40 gap, 40-48 data, 48-64 gap
  const int64_t want[][3] = {{0, 10, 1}, {10, 2, 0}, {12, 20, 1}, {32, 8, 0}, {40, 8, 1}, {48, 16, 0}};
  bool ok = p.size() == 6;
  for (size_t i = 0; ok && i < 6; ++i)
    ok = p[i].flat_offset == want[i][0] && p[i].nbytes == want[i][1] && (p[i].data != nullptr) == (want[i][2] == 1);
  CHECK(ok, "plan_pack pieces (%zu)", p.size());
  const auto u = zc::cuda::plan_pack(segs.data(), 4, 64, false);
  CHECK(u.size() == 3 && u[0].flat_offset == 0 && u[1].flat_offset == 12 && u[2].flat_offset == 40, "plan unpack");
  const auto empty = zc::cuda::plan_pack(nullptr, 0, 100, true);
  CHECK(empty.size() == 1 && empty[0].nbytes == 100 && empty[0].data == nullptr, "plan_pack of no tensors zeroes");
  auto throws = [](std::vector<zc::Segment> s, int64_t flat) {
    try { zc::cuda::plan_pack(s.data(), static_cast<int64_t>(s.size()), flat, true); } catch (const std::invalid_argument&) { return true; }
    return false;
  };
  CHECK(throws({{buf, 0, 10}, {buf, 9, 4}}, 64), "overlap not caught");
  CHECK(throws({{buf, 60, 8}}, 64), "out of bounds not caught");
  CHECK(throws({{buf, -2, 1}}, 64), "negative offset not caught");
  CHECK(throws({{buf, INT64_MAX - 1, 8}}, 64), "offset overflow not caught");
}

void test_pool_rounding() {
  bool ok = true;
  for (int64_t n : {int64_t(0), int64_t(1), int64_t(4096), int64_t(4097), int64_t(100000), int64_t(1) << 20,
                    (int64_t(1) << 20) + 1, int64_t(123456789), int64_t(3) << 33}) {
    const int64_t b = zc::cuda::pinned_block_bytes(n);
    ok &= b >= n && b % 4096 == 0 && (n <= 4096 ? b == 4096 : b <= n + n / 8 + 4096);
  }
  CHECK(ok, "pinned_block_bytes rounding");
}

void test_build_info() {
  const std::vector<int> archs = zc::cuda::compiled_archs();
  std::string s;
  for (int a : archs) s += std::to_string(a) + " ";
  std::printf("CUDA part compiled for virtual archs: %s(runtime %d)\n", s.c_str(), zc::cuda::runtime_version_compiled());
  CHECK(!archs.empty(), "no __CUDA_ARCH_LIST__");
}

template <class F>
bool throws_runtime(F f) {
  try { f(); } catch (const std::runtime_error&) { return true; } catch (...) { return false; }
  return false;
}

void test_without_device() {
  CHECK(!zc::cuda::device_error().empty(), "device_error empty without a device");
  const zc::AdamScalars s = zc::adam_scalars(1e-3, 0.9, 0.999, 1e-8, 0.0, 1, true, 1.0);
  float x[8] = {};
  zc::AdamTensor t{x, x, x, x, nullptr, 8, zc::DType::F32, zc::DType::F32, s};
  CHECK(throws_runtime([&] { zc::cuda::adam_step_multi(&t, 1, nullptr, 0, nullptr); }), "adam without a device");
  CHECK(throws_runtime([&] { zc::cuda::cast(x, zc::DType::F32, x, zc::DType::BF16, 8, 0, nullptr); }), "cast");
  CHECK(throws_runtime([&] { zc::cuda::memcpy_async(x, x, 8, 0, nullptr); }), "memcpy_async");
  CHECK(throws_runtime([&] { zc::cuda::PinnedPool pool; pool.acquire(100); }), "pinned pool");
  CHECK(!zc::cuda::is_pinned_host(x), "is_pinned_host");
}

// ---- with a device: the kernels themselves ------------------------------------------------
struct Dev {
  void* p = nullptr;
  explicit Dev(size_t n) { if (cudaMalloc(&p, n ? n : 1) != cudaSuccess) throw std::runtime_error("cudaMalloc"); }
  ~Dev() { cudaFree(p); }
  template <class T> T* as(size_t byte_offset = 0) { return reinterpret_cast<T*>(static_cast<char*>(p) + byte_offset); }
};
void h2d(void* d, const void* h, size_t n) { cudaMemcpy(d, h, n, kMemcpyDefault); }
void d2h(void* h, const void* d, size_t n) { cudaMemcpy(h, d, n, kMemcpyDefault); }

void test_device_adam() {
  std::mt19937 rng(21);
  // 150 tensors (one launch with the large table, three with the small one), odd sizes, some
  // misaligned by one element; and 600 fp32 ones (more than the large table holds).
  struct Case { zc::DType gdt; bool with_out; int nt; };
  std::vector<Case> cases;
  for (zc::DType gdt : {zc::DType::F32, zc::DType::BF16, zc::DType::F16})
    for (bool with_out : {false, true}) cases.push_back({gdt, with_out, 150});
  cases.push_back({zc::DType::F32, false, 600});
  std::printf("adam table capacity: %d tensors per launch\n", zc::cuda::adam_table_capacity());
  for (const Case& c : cases) {
    const zc::DType gdt = c.gdt;
    const bool with_out = c.with_out;
    const int nt = c.nt;
    std::vector<AdamData> host;
    std::vector<int64_t> sizes;
    std::uniform_int_distribution<int64_t> size(1, 40000);
    for (int i = 0; i < nt; ++i) {
      sizes.push_back(i == 3 ? 3 * zc::cuda::kAdamChunkElems + 5 : size(rng));
      host.push_back(random_adam(sizes.back(), gdt, rng));
    }
    const zc::AdamScalars s = zc::adam_scalars(1e-3, 0.9, 0.999, 1e-8, 0.1, 3, gdt != zc::DType::F16, 0.5);
    std::vector<std::unique_ptr<Dev>> mem;
    std::vector<zc::AdamTensor> dts, cts;
    std::vector<AdamData> cpu = host;
    for (int i = 0; i < nt; ++i) {
      const int64_t n = sizes[i];
      const size_t shift = (i % 4 == 1) ? 4 : 0;  // misaligned fp32 arrays: the scalar path
      const int gsz = zc::dtype_size(gdt);
      mem.emplace_back(new Dev(static_cast<size_t>(n) * (12 + gsz + 2) + 64));
      Dev& d = *mem.back();
      float* p = d.as<float>(shift);
      float* m = p + n;
      float* v = m + n;
      uint8_t* g = reinterpret_cast<uint8_t*>(v + n);
      uint8_t* o = g + n * gsz;
      h2d(p, host[i].p.data(), n * 4);
      h2d(m, host[i].m.data(), n * 4);
      h2d(v, host[i].v.data(), n * 4);
      h2d(g, host[i].g.data(), n * gsz);
      dts.push_back({p, g, m, v, with_out ? o : nullptr, n, gdt, zc::DType::BF16, s});
      cpu[i].out.assign(static_cast<size_t>(n) * 2, 0);
      cts.push_back({cpu[i].p.data(), cpu[i].g.data(), cpu[i].m.data(), cpu[i].v.data(),
                     with_out ? cpu[i].out.data() : nullptr, n, gdt, zc::DType::BF16, s});
    }
    zc::cuda::adam_step_multi(dts.data(), nt, nullptr, 0, nullptr);
    zc::adam_step_multi(cts.data(), nt, 2);
    cudaDeviceSynchronize();
    int64_t bad = 0;
    for (int i = 0; i < nt; ++i) {
      const int64_t n = sizes[i];
      std::vector<float> p(n), m(n), v(n);
      std::vector<uint8_t> o(static_cast<size_t>(n) * 2);
      d2h(p.data(), dts[i].param, n * 4);
      d2h(m.data(), dts[i].exp_avg, n * 4);
      d2h(v.data(), dts[i].exp_avg_sq, n * 4);
      if (with_out) d2h(o.data(), dts[i].param_out, n * 2);
      bad += std::memcmp(p.data(), cpu[i].p.data(), n * 4) != 0;
      bad += std::memcmp(m.data(), cpu[i].m.data(), n * 4) != 0;
      bad += std::memcmp(v.data(), cpu[i].v.data(), n * 4) != 0;
      if (with_out) bad += std::memcmp(o.data(), cpu[i].out.data(), n * 2) != 0;
    }
    CHECK(bad == 0, "device adam: %lld arrays differ from the CPU kernel (gdt %d, out %d, %d tensors)",
          static_cast<long long>(bad), static_cast<int>(gdt), with_out, nt);
  }
}

void test_device_cast_norm_pack() {
  std::mt19937 rng(31);
  std::uniform_int_distribution<uint32_t> any;
  for (int64_t n : {int64_t(1), int64_t(7), int64_t(1000003)}) {
    std::vector<float> src(static_cast<size_t>(n));
    for (auto& f : src) f = zc::bits_f32(any(rng));
    for (zc::DType dt : {zc::DType::BF16, zc::DType::F16}) {
      Dev ds(n * 4 + 16), dd(n * 2 + 16);
      h2d(ds.p, src.data(), n * 4);
      zc::cuda::cast(ds.p, zc::DType::F32, dd.p, dt, n, 0, nullptr);
      std::vector<uint16_t> got(n), want(n);
      cudaDeviceSynchronize();
      d2h(got.data(), dd.p, n * 2);
      zc::cast(src.data(), zc::DType::F32, want.data(), dt, n, 2);
      CHECK(got == want, "device cast fp32->%d n=%lld", static_cast<int>(dt), static_cast<long long>(n));
      // and back, from an odd element offset (scalar path)
      std::vector<float> back(n), back_want(n);
      Dev db(n * 4 + 16);
      h2d(dd.as<char>(2), want.data(), n * 2);
      zc::cuda::cast(dd.as<char>(2), dt, db.p, zc::DType::F32, n, 0, nullptr);
      cudaDeviceSynchronize();
      d2h(back.data(), db.p, n * 4);
      zc::cast(want.data(), dt, back_want.data(), zc::DType::F32, n, 1);
      CHECK(std::memcmp(back.data(), back_want.data(), n * 4) == 0, "device cast back n=%lld", static_cast<long long>(n));
    }
    // sum of squares of normal data (and with one Inf)
    std::normal_distribution<float> normal;
    for (auto& f : src) f = normal(rng);
    Dev dx(n * 4), ws(zc::cuda::sum_squares_workspace(n) * 8), out(16);
    h2d(dx.p, src.data(), n * 4);
    zc::cuda::sum_squares(dx.p, zc::DType::F32, n, ws.as<double>(), out.as<double>(), out.as<bool>(8), 0, nullptr);
    double got = 0;
    bool flag = true;
    cudaDeviceSynchronize();
    d2h(&got, out.p, 8);
    d2h(&flag, out.as<char>(8), 1);
    const zc::SumSquares want = zc::sum_squares(src.data(), zc::DType::F32, n, 2);
    CHECK(std::fabs(got - want.sum_sq) <= 1e-12 * want.sum_sq && !flag, "device sum_squares %g vs %g", got, want.sum_sq);
  }
  // pack / unpack against the CPU pack, tensors at odd byte offsets
  std::vector<int64_t> sizes = {5, 1, 300000, 17, 4096, 3};
  std::vector<int64_t> offs = {0, 7, 10, 300013, 300032, 304200};
  const int64_t flat_bytes = 304220;
  std::vector<std::vector<uint8_t>> host;
  std::vector<std::unique_ptr<Dev>> dev;
  std::vector<zc::Segment> hseg, dseg;
  for (size_t i = 0; i < sizes.size(); ++i) {
    host.emplace_back(sizes[i]);
    for (auto& b : host.back()) b = static_cast<uint8_t>(any(rng));
    dev.emplace_back(new Dev(sizes[i] + 16));
    uint8_t* d = dev.back()->as<uint8_t>(i % 3);
    h2d(d, host.back().data(), sizes[i]);
    hseg.push_back({host.back().data(), offs[i], sizes[i]});
    dseg.push_back({d, offs[i], sizes[i]});
  }
  std::vector<uint8_t> want(flat_bytes, 0xAB), got(flat_bytes);
  zc::pack(hseg.data(), static_cast<int64_t>(hseg.size()), want.data(), flat_bytes, 1);
  const auto pieces = zc::cuda::plan_pack(dseg.data(), static_cast<int64_t>(dseg.size()), flat_bytes, true);
  Dev dflat(flat_bytes), dpieces(pieces.size() * sizeof(zc::cuda::PackPiece));
  std::vector<uint8_t> junk(flat_bytes, 0xAB);
  h2d(dflat.p, junk.data(), flat_bytes);
  h2d(dpieces.p, pieces.data(), pieces.size() * sizeof(zc::cuda::PackPiece));
  zc::cuda::pack_pieces(dpieces.as<zc::cuda::PackPiece>(), static_cast<int64_t>(pieces.size()), dflat.p, flat_bytes,
                        true, 0, nullptr);
  cudaDeviceSynchronize();
  d2h(got.data(), dflat.p, flat_bytes);
  CHECK(got == want, "device pack differs from the CPU pack");
  h2d(dflat.p, junk.data(), flat_bytes);  // the same with the table passed by value
  zc::cuda::pack_pieces_inline(pieces.data(), static_cast<int64_t>(pieces.size()), dflat.p, flat_bytes, true, 0,
                               nullptr);
  cudaDeviceSynchronize();
  d2h(got.data(), dflat.p, flat_bytes);
  CHECK(got == want, "device pack with the inline table differs from the CPU pack");
  // unpack into zeroed tensors and compare
  for (size_t i = 0; i < sizes.size(); ++i) {
    std::vector<uint8_t> zero(sizes[i], 0);
    h2d(dseg[i].data, zero.data(), sizes[i]);
  }
  const auto upieces = zc::cuda::plan_pack(dseg.data(), static_cast<int64_t>(dseg.size()), flat_bytes, false);
  h2d(dpieces.p, upieces.data(), upieces.size() * sizeof(zc::cuda::PackPiece));
  zc::cuda::pack_pieces(dpieces.as<zc::cuda::PackPiece>(), static_cast<int64_t>(upieces.size()), dflat.p, flat_bytes,
                        false, 0, nullptr);
  cudaDeviceSynchronize();
  bool ok = true;
  for (size_t i = 0; i < sizes.size(); ++i) {
    std::vector<uint8_t> back(sizes[i]);
    d2h(back.data(), dseg[i].data, sizes[i]);
    ok &= back == host[i];
  }
  CHECK(ok, "device unpack does not give the tensors back");
  for (size_t i = 0; i < sizes.size(); ++i) {  // again, the table by value
    std::vector<uint8_t> zero(sizes[i], 0);
    h2d(dseg[i].data, zero.data(), sizes[i]);
  }
  zc::cuda::pack_pieces_inline(upieces.data(), static_cast<int64_t>(upieces.size()), dflat.p, flat_bytes, false, 0,
                               nullptr);
  cudaDeviceSynchronize();
  ok = true;
  for (size_t i = 0; i < sizes.size(); ++i) {
    std::vector<uint8_t> back(sizes[i]);
    d2h(back.data(), dseg[i].data, sizes[i]);
    ok &= back == host[i];
  }
  CHECK(ok, "device unpack with the inline table does not give the tensors back");
  bool refused = false;
  std::printf("pack inline table: %d pieces\n", zc::cuda::pack_inline_capacity());
  std::vector<zc::cuda::PackPiece> many(zc::cuda::pack_inline_capacity() + 1, zc::cuda::PackPiece{0, 0, nullptr});
  try {
    zc::cuda::pack_pieces_inline(many.data(), static_cast<int64_t>(many.size()), dflat.p, flat_bytes, true, 0, nullptr);
  } catch (const std::invalid_argument&) {
    refused = true;
  }
  CHECK(refused, "an inline table over pack_inline_capacity() is refused");
}

void test_device_pool() {
  zc::cuda::PinnedPool pool(int64_t(64) << 20);
  void* a = pool.acquire(1000000);
  CHECK(zc::cuda::is_pinned_host(a), "pool memory is not pinned");
  CHECK(reinterpret_cast<uintptr_t>(a) % 4096 == 0, "pool block not page aligned");
  Dev d(1000000);
  zc::cuda::memcpy_async(d.p, a, 1000000, 0, nullptr);
  CHECK(pool.record_use(static_cast<char*>(a) + 10, 0, nullptr), "record_use inside a block");
  pool.release(a);
  cudaDeviceSynchronize();
  void* b = pool.acquire(1000000);
  CHECK(b == a, "a finished block is reused");
  bool threw = false;
  try { pool.acquire(int64_t(100) << 20); } catch (const std::runtime_error&) { threw = true; }
  CHECK(threw, "pool limit not enforced");
  pool.release(b);
  CHECK(pool.trim() > 0 && pool.stats().reserved_bytes == 0, "trim frees idle blocks");
}

}  // namespace

int main() {
  test_conversions();
  test_adam_element();
  zc_cuda_test::test_plan_adam();
  zc_cuda_test::test_adam_table_lookups();
  zc_cuda_test::test_line_aligned_spans();
  test_plan_pack();
  test_pool_rounding();
  test_build_info();
  const int devices = zc::cuda::device_count();
  if (devices == 0) {
    std::printf("no CUDA device (%s): host-side checks only\n", zc::cuda::device_error().c_str());
    test_without_device();
  } else {
    std::printf("%d CUDA device(s): running the kernels\n", devices);
    try {
      test_device_adam();
      test_device_cast_norm_pack();
      test_device_pool();
    } catch (const std::exception& e) {
      ++zc_test::failures;
      std::printf("FAIL: exception: %s\n", e.what());
    }
  }
  return zc_test::summary();
}
