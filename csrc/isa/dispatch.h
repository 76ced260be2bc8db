// Run-time ISA choice: the widest path this CPU supports, unless ZEROCORE_CPU_ISA (or
// set_isa, for tests) forces one. Never -march=native: one binary runs on any x86-64.
#pragma once
#include <string>
#include <vector>
#include "kernel_table.h"

namespace zc {

// ISAs this CPU (and OS) can run, narrowest first: always "scalar", then "avx2", "avx512".
std::vector<std::string> supported_isas();
// Forces an ISA ("auto" = widest supported). Throws std::invalid_argument for an unknown
// name or one this CPU lacks, naming what it lacks. Returns the ISA now active.
std::string set_isa(const std::string& name);
// The active table; chosen on first use from ZEROCORE_CPU_ISA, else the widest supported.
const KernelTable& active_kernels();

}  // namespace zc
