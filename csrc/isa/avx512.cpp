// AVX-512 F/BW/VL/DQ path (Skylake-SP, Ice Lake, Zen 4 and later).
// Every kernel body is instantiated here for one ISA. All headers with external-linkage
// inline functions are included *before* the target pragma, and the bodies sit in an
// anonymous namespace, so no code compiled for this ISA can leak into another path.
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#include <cstdint>
#include "../common/dtype.h"
#include "../common/half.h"
#include "kernel_table.h"

// GCC 12's AVX-512 headers trip -Wmaybe-uninitialized on their own _mm*_undefined_*()
// placeholders (GCC bug 105593); the warning is about the headers, not this code.
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")

namespace {
#include "simd_scalar.inc"
#include "simd_avx512.inc"
#include "../adam/adam_body.inc"
#include "../cast/cast_body.inc"
#include "../norm/norm_body.inc"
#include "../bench/stream_body.inc"

const zc::KernelTable kTable = {"avx512", adam_entry<Avx512>, cast_entry<Avx512>, sumsq_entry<Avx512>, stream_entry<Avx512>};
}  // namespace

const zc::KernelTable* zc::kernels_avx512() { return &kTable; }

#else  // not x86: the dispatcher never selects this path; keep the symbol for linking.
#include "kernel_table.h"
const zc::KernelTable* zc::kernels_avx512() { return zc::kernels_scalar(); }
#endif
