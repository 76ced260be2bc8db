// Portable path: any x86-64 (and any other CPU) runs it.
// Every kernel body is instantiated here for one ISA. All headers with external-linkage
// inline functions are included *before* the target pragma, and the bodies sit in an
// anonymous namespace, so no code compiled for this ISA can leak into another path.

#include <cstdint>
#include "../common/dtype.h"
#include "../common/half.h"
#include "kernel_table.h"



namespace {
#include "simd_scalar.inc"
#include "../adam/adam_body.inc"
#include "../cast/cast_body.inc"
#include "../norm/norm_body.inc"
#include "../bench/stream_body.inc"

const zc::KernelTable kTable = {"scalar", adam_entry<Scalar>, cast_entry<Scalar>, sumsq_entry<Scalar>, stream_entry<Scalar>};
}  // namespace

const zc::KernelTable* zc::kernels_scalar() { return &kTable; }
