// Native unit tests of the torch-free kernels, run by ctest. The checks that matter most:
// the half conversions against independent references (exhaustive where possible), every
// ISA path bit-identical to the scalar path, Adam against a double-precision reference,
// pack/unpack gaps and bounds.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

#include "adam/adam.h"
#include "tests/check.h"
#include "cast/cast.h"
#include "common/half.h"
#include "flatten/flatten.h"
#include "isa/dispatch.h"
#include "norm/norm.h"

namespace {


const int64_t kSizes[] = {1, 7, 15, 16, 17, 63, 1000, (1 << 16) + 5, (1 << 20) + 3};

bool is_nan32(float f) { return (zc::f32_bits(f) & 0x7fffffffu) > 0x7f800000u; }

// Values that stress rounding: random across the whole exponent range, ties, specials.
std::vector<float> nasty_floats(int64_t n, std::mt19937& rng) {
  std::vector<float> v(static_cast<size_t>(n));
  std::uniform_int_distribution<uint32_t> bits;
  std::normal_distribution<float> normal(0.0f, 1.0f);
  const float specials[] = {0.0f, -0.0f, INFINITY, -INFINITY, NAN, -NAN, 65504.0f, 65519.0f, 65520.0f,
                            6.1035156e-05f, 5.9604645e-08f, 2.9802322e-08f, 3.3895314e38f, 1e-40f};
  for (int64_t i = 0; i < n; ++i) {
    const int kind = static_cast<int>(i % 4);
    if (kind == 0) v[i] = zc::bits_f32(bits(rng));
    else if (kind == 1) v[i] = specials[(i / 4) % (sizeof(specials) / sizeof(float))];
    else if (kind == 2) v[i] = zc::bits_f32((bits(rng) & 0xffff0000u) | 0x8000u);  // bf16 ties
    else v[i] = normal(rng);
  }
  return v;
}

void test_half_scalar() {
  // Every 16-bit pattern: widen, narrow back, same bits (NaNs come back quieted).
  for (uint32_t h = 0; h < 65536; ++h) {
    const uint16_t hb = static_cast<uint16_t>(h);
    const float fb = zc::bf16_bits_to_f32(hb);
    const uint16_t back_b = zc::f32_to_bf16_bits(fb);
    CHECK(is_nan32(fb) ? back_b == (hb | 0x40) : back_b == hb, "bf16 %04x -> %04x", h, back_b);
    const float fh = zc::f16_bits_to_f32(hb);
    const uint16_t back_h = zc::f32_to_f16_bits(fh);
    CHECK(is_nan32(fh) ? back_h == (hb | 0x200) : back_h == hb, "f16 %04x -> %04x", h, back_h);
    // Independent value check of the f16 decode.
    const int e = (h >> 10) & 0x1f, m = h & 0x3ff;
    const double sign = (h & 0x8000) ? -1.0 : 1.0;
    if (e != 0x1f) {
      const double want = e == 0 ? sign * m * std::ldexp(1.0, -24) : sign * (1.0 + m / 1024.0) * std::ldexp(1.0, e - 15);
      CHECK(static_cast<double>(fh) == want, "f16 %04x decodes to %g, want %g", h, fh, want);
    }
  }
  // Narrowing against the compiler's own IEEE conversion (_Float16, round-to-nearest-even)
  // and a double-arithmetic nearest-even reference for bf16.
  std::mt19937 rng(1);
  for (float f : nasty_floats(400000, rng)) {
    if (is_nan32(f)) continue;
    _Float16 want = static_cast<_Float16>(f);
    uint16_t want_bits;
    std::memcpy(&want_bits, &want, 2);
    CHECK(zc::f32_to_f16_bits(f) == want_bits, "f16(%a) = %04x, want %04x", f, zc::f32_to_f16_bits(f), want_bits);
    const uint32_t x = zc::f32_bits(f);
    const uint16_t lo = static_cast<uint16_t>(x >> 16);
    const uint16_t hi = static_cast<uint16_t>(lo + 1);
    const double dlo = zc::bf16_bits_to_f32(lo), dx = f;
    const double dhi = (lo & 0x7fff) == 0x7f7f ? std::copysign(std::ldexp(1.0, 128), dx) : zc::bf16_bits_to_f32(hi);
    uint16_t ref = lo;
    if ((x & 0xffff) != 0 && (lo & 0x7fff) != 0x7f80) {
      const double dl = std::fabs(dx - dlo), dh = std::fabs(dhi - dx);
      ref = (dh < dl || (dh == dl && (lo & 1))) ? hi : lo;
    }
    CHECK(zc::f32_to_bf16_bits(f) == ref, "bf16(%a) = %04x, want %04x", f, zc::f32_to_bf16_bits(f), ref);
  }
}

template <class T>
std::vector<uint8_t> bytes_of(const std::vector<T>& v) {
  std::vector<uint8_t> out(v.size() * sizeof(T));
  std::memcpy(out.data(), v.data(), out.size());
  return out;
}

void test_cast_isas() {
  std::mt19937 rng(2);
  const zc::DType dts[] = {zc::DType::F32, zc::DType::BF16, zc::DType::F16};
  for (int64_t n : kSizes) {
    std::vector<float> src32 = nasty_floats(n, rng);
    for (zc::DType sdt : dts)
      for (zc::DType ddt : dts) {
        if (sdt == ddt) continue;
        std::vector<uint8_t> src(static_cast<size_t>(n) * zc::dtype_size(sdt));
        zc::set_isa("scalar");
        zc::cast(src32.data(), zc::DType::F32, src.data(), sdt, n, 1);  // source in sdt
        std::vector<uint8_t> want(static_cast<size_t>(n) * zc::dtype_size(ddt), 0xAB);
        zc::cast(src.data(), sdt, want.data(), ddt, n, 1);
        for (const std::string& isa : zc::supported_isas()) {
          zc::set_isa(isa);
          std::vector<uint8_t> got(want.size(), 0xCD);  // poisoned
          zc::cast(src.data(), sdt, got.data(), ddt, n, 2);
          CHECK(got == want, "cast %s->%s n=%lld isa=%s differs from scalar", zc::dtype_name(sdt),
                zc::dtype_name(ddt), static_cast<long long>(n), isa.c_str());
        }
      }
  }
}

struct AdamCase {
  std::vector<float> p, m, v;
  std::vector<uint8_t> g, out;
};

void test_adam() {
  std::mt19937 rng(3);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  const zc::DType gdts[] = {zc::DType::F32, zc::DType::BF16, zc::DType::F16};
  const zc::DType odts[] = {zc::DType::F32 /* = no out */, zc::DType::BF16, zc::DType::F16};
  for (int64_t n : kSizes) {
    for (zc::DType gdt : gdts)
      for (zc::DType odt : odts)
        for (bool adamw : {true, false}) {
          AdamCase base;
          std::vector<float> g32(static_cast<size_t>(n));
          for (int64_t i = 0; i < n; ++i) {
            base.p.push_back(normal(rng));
            base.m.push_back(0.1f * normal(rng));
            base.v.push_back(std::fabs(0.01f * normal(rng)) + 1e-6f);
            g32[i] = normal(rng);
          }
          base.g.resize(static_cast<size_t>(n) * zc::dtype_size(gdt));
          zc::set_isa("scalar");
          zc::cast(g32.data(), zc::DType::F32, base.g.data(), gdt, n, 1);
          const double lr = 1e-3, b1 = 0.9, b2 = 0.999, eps = 1e-8, wd = 0.01, gs = 0.5;
          const int64_t step = 7;
          const zc::AdamScalars s = zc::adam_scalars(lr, b1, b2, eps, wd, step, adamw, gs);
          auto run = [&](const std::string& isa) {
            AdamCase c = base;
            c.out.assign(odt == zc::DType::F32 ? 0 : static_cast<size_t>(n) * 2, 0xEE);
            zc::set_isa(isa);
            zc::AdamTensor t{c.p.data(), c.g.data(), c.m.data(), c.v.data(),
                             c.out.empty() ? nullptr : c.out.data(), n, gdt, odt, s};
            zc::adam_step_multi(&t, 1, 2);
            return c;
          };
          const AdamCase want = run("scalar");
          // Scalar path against a double-precision evaluation of the same formula.
          double worst = 0.0;
          for (int64_t i = 0; i < n; ++i) {
            float gf;
            zc::cast(base.g.data() + i * zc::dtype_size(gdt), gdt, &gf, zc::DType::F32, 1, 1);
            double g = gf * gs, p = base.p[i];
            if (!adamw) g += wd * p;
            const double m = b1 * base.m[i] + (1 - b1) * g;
            const double v = b2 * base.v[i] + (1 - b2) * g * g;
            if (adamw) p *= 1 - lr * wd;
            p -= lr / (1 - std::pow(b1, step)) * m / (std::sqrt(v) / std::sqrt(1 - std::pow(b2, step)) + eps);
            // Allowed: a few fp32 ulps of p plus a 1e-5 fraction of the step (lr-sized); a relative
            // bound alone would blow up for parameters near zero.
            worst = std::max(worst, std::fabs(p - want.p[i]) / (4 * 1.2e-7 * std::fabs(p) + 1e-5 * lr));
          }
          CHECK(worst <= 1.0, "adam scalar vs double: error %g x allowed (n=%lld)", worst, static_cast<long long>(n));
          if (odt != zc::DType::F32) {
            std::vector<uint8_t> cast_p(want.out.size());
            zc::cast(want.p.data(), zc::DType::F32, cast_p.data(), odt, n, 1);
            CHECK(cast_p == want.out, "adam param_out is not the RNE cast of the fp32 result");
          }
          for (const std::string& isa : zc::supported_isas()) {
            const AdamCase got = run(isa);
            CHECK(bytes_of(got.p) == bytes_of(want.p) && bytes_of(got.m) == bytes_of(want.m) &&
                      bytes_of(got.v) == bytes_of(want.v) && got.out == want.out,
                  "adam isa=%s n=%lld grad=%s out=%d adamw=%d differs from scalar", isa.c_str(),
                  static_cast<long long>(n), zc::dtype_name(gdt), static_cast<int>(odt), adamw);
          }
        }
  }
  bool threw = false;
  try {
    zc::adam_scalars(NAN, 0.9, 0.999, 1e-8, 0, 1, true, 1);
  } catch (const std::invalid_argument&) {
    threw = true;
  }
  CHECK(threw, "NaN lr must be rejected");
}

void test_sum_squares() {
  std::mt19937 rng(4);
  std::normal_distribution<float> normal(0.0f, 3.0f);
  for (int64_t n : kSizes) {
    std::vector<float> x(static_cast<size_t>(n));
    double want = 0.0;
    for (auto& f : x) {
      f = normal(rng);
      want += static_cast<double>(f) * f;
    }
    for (const std::string& isa : zc::supported_isas()) {
      zc::set_isa(isa);
      const zc::SumSquares r = zc::sum_squares(x.data(), zc::DType::F32, n, 2);
      CHECK(std::fabs(r.sum_sq - want) <= 1e-12 * want && !r.nonfinite, "sumsq isa=%s n=%lld: %g vs %g",
            isa.c_str(), static_cast<long long>(n), r.sum_sq, want);
      std::vector<float> bad = x;
      bad[static_cast<size_t>(n) - 1] = (n % 2) ? NAN : -INFINITY;
      CHECK(zc::sum_squares(bad.data(), zc::DType::F32, n, 2).nonfinite, "sumsq must flag Inf/NaN (isa=%s)",
            isa.c_str());
    }
  }
}

void test_pack_unpack() {
  std::mt19937 rng(5);
  std::vector<std::vector<float>> ts = {std::vector<float>(7), std::vector<float>(1 << 19), std::vector<float>(1)};
  for (auto& t : ts)
    for (auto& f : t) f = static_cast<float>(rng() % 1000) + 1.0f;
  const int64_t offs[] = {3, 20, (1 << 19) + 40};
  const int64_t total = (1 << 19) + 64;
  std::vector<float> flat(static_cast<size_t>(total), NAN);  // poison: gaps must become 0
  std::vector<zc::Segment> segs;
  for (size_t i = 0; i < ts.size(); ++i)
    segs.push_back({ts[i].data(), offs[i] * 4, static_cast<int64_t>(ts[i].size()) * 4});
  zc::pack(segs.data(), 3, flat.data(), total * 4, 2);
  std::vector<float> want(static_cast<size_t>(total), 0.0f);
  for (size_t i = 0; i < ts.size(); ++i) std::memcpy(&want[offs[i]], ts[i].data(), ts[i].size() * 4);
  CHECK(bytes_of(flat) == bytes_of(want), "pack result wrong");
  std::vector<std::vector<float>> back = {std::vector<float>(7, -1), std::vector<float>(1 << 19, -1),
                                          std::vector<float>(1, -1)};
  for (size_t i = 0; i < back.size(); ++i) segs[i].data = back[i].data();
  zc::unpack(flat.data(), total * 4, segs.data(), 3, 2);
  CHECK(back == ts, "unpack result wrong");
  bool threw = false;
  segs[1].offset_bytes = 4 * 5;  // overlaps tensor 0 at [3, 10)
  try {
    zc::pack(segs.data(), 3, flat.data(), total * 4, 1);
  } catch (const std::invalid_argument&) {
    threw = true;
  }
  CHECK(threw, "overlapping segments must be rejected");
}

}  // namespace

int main() {
  std::printf("ISAs on this CPU:");
  for (const auto& s : zc::supported_isas()) std::printf(" %s", s.c_str());
  std::printf("\n");
  test_half_scalar();
  test_cast_isas();
  test_adam();
  test_sum_squares();
  test_pack_unpack();
  return zc_test::summary();
}
