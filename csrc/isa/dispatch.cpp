#include "dispatch.h"

#include <atomic>
#include <cstdlib>
#include <stdexcept>

namespace zc {
namespace {

bool cpu_has_avx2() {
#if defined(__x86_64__) || defined(__i386__)
  // __builtin_cpu_supports consults libgcc's cpuid probe, which also checks that the OS
  // saves the wide registers (XCR0), so a hypervisor that hides AVX state is respected.
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
         __builtin_cpu_supports("f16c");
#else
  return false;
#endif
}

bool cpu_has_avx512() {
#if defined(__x86_64__) || defined(__i386__)
  return cpu_has_avx2() && __builtin_cpu_supports("avx512f") &&
         __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl") &&
         __builtin_cpu_supports("avx512dq");
#else
  return false;
#endif
}

const KernelTable* table_for(const std::string& name) {
  if (name == "scalar") return kernels_scalar();
  if (name == "avx2") {
    if (!cpu_has_avx2()) throw std::invalid_argument("CPU ISA 'avx2' requested but this CPU lacks AVX2/FMA/F16C");
    return kernels_avx2();
  }
  if (name == "avx512") {
    if (!cpu_has_avx512())
      throw std::invalid_argument("CPU ISA 'avx512' requested but this CPU lacks AVX-512 F/BW/VL/DQ");
    return kernels_avx512();
  }
  if (name == "auto" || name.empty())
    return cpu_has_avx512() ? kernels_avx512() : (cpu_has_avx2() ? kernels_avx2() : kernels_scalar());
  throw std::invalid_argument("unknown CPU ISA '" + name + "': expected one of auto, scalar, avx2, avx512");
}

std::atomic<const KernelTable*> g_active{nullptr};

}  // namespace

std::vector<std::string> supported_isas() {
  std::vector<std::string> out{"scalar"};
  if (cpu_has_avx2()) out.push_back("avx2");
  if (cpu_has_avx512()) out.push_back("avx512");
  return out;
}

std::string set_isa(const std::string& name) {
  const KernelTable* t = table_for(name);
  g_active.store(t);
  return t->isa;
}

const KernelTable& active_kernels() {
  const KernelTable* t = g_active.load();
  if (t == nullptr) {
    const char* env = std::getenv("ZEROCORE_CPU_ISA");
    // A bad value must not crash a kernel call deep in training: fall back to auto here;
    // zerocore.ops applies the variable at import time and raises a clear error instead.
    try {
      t = table_for(env ? env : "auto");
    } catch (const std::invalid_argument&) {
      t = table_for("auto");
    }
    g_active.store(t);
  }
  return *t;
}

}  // namespace zc
