// AVX2 + FMA + F16C path (Haswell and later).
// Every kernel body is instantiated here for one ISA. All headers with external-linkage
// inline functions are included *before* the target pragma, and the bodies sit in an
// anonymous namespace, so no code compiled for this ISA can leak into another path.
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#include <cstdint>
#include "../common/dtype.h"
#include "../common/half.h"
#include "kernel_table.h"

#pragma GCC target("avx2,fma,f16c")

namespace {
#include "simd_scalar.inc"
#include "simd_avx2.inc"
#include "../adam/adam_body.inc"
#include "../cast/cast_body.inc"
#include "../norm/norm_body.inc"
#include "../bench/stream_body.inc"

const zc::KernelTable kTable = {"avx2", adam_entry<Avx2>, cast_entry<Avx2>, sumsq_entry<Avx2>, stream_entry<Avx2>};
}  // namespace

const zc::KernelTable* zc::kernels_avx2() { return &kTable; }

#else  // not x86: the dispatcher never selects this path; keep the symbol for linking.
#include "kernel_table.h"
const zc::KernelTable* zc::kernels_avx2() { return zc::kernels_scalar(); }
#endif
