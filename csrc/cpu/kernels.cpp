// Run-time choice of the instruction set for the raw CPU kernels (csrc/cpu/kernels.h).
#include "cpu/kernels.h"

#include <atomic>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

namespace dcf::cpu {

extern const KernelTable kTableGeneric;
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define DC_HAS_X86_VARIANTS 1
extern const KernelTable kTableAvx2;
extern const KernelTable kTableAvx512;
#endif

namespace {

bool supports_avx2() {
#if defined(DC_HAS_X86_VARIANTS)
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c") &&
         __builtin_cpu_supports("bmi2");
#else
  return false;
#endif
}

bool supports_avx512() {
#if defined(DC_HAS_X86_VARIANTS)
  return supports_avx2() && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
#else
  return false;
#endif
}

const KernelTable* best() {
#if defined(DC_HAS_X86_VARIANTS)
  if (supports_avx512()) return &kTableAvx512;
  if (supports_avx2()) return &kTableAvx2;
#endif
  return &kTableGeneric;
}

}  // namespace

const KernelTable* kernels_for(const char* isa) {
  if (isa == nullptr) return nullptr;
  if (std::strcmp(isa, "generic") == 0) return &kTableGeneric;
#if defined(DC_HAS_X86_VARIANTS)
  if (std::strcmp(isa, "avx2") == 0 && supports_avx2()) return &kTableAvx2;
  if (std::strcmp(isa, "avx512") == 0 && supports_avx512()) return &kTableAvx512;
#endif
  return nullptr;
}

namespace {

std::atomic<const KernelTable*>& chosen() {
  static std::atomic<const KernelTable*> table{[] {
    const KernelTable* forced = kernels_for(std::getenv("DIFFCURR_CPU_ISA"));
    return forced != nullptr ? forced : best();
  }()};
  return table;
}

}  // namespace

const KernelTable& kernels() { return *chosen().load(std::memory_order_relaxed); }

const KernelTable* set_kernels(const char* isa) {
  const KernelTable* table = kernels_for(isa);
  if (table == nullptr) return nullptr;
  return chosen().exchange(table, std::memory_order_relaxed);
}

std::vector<std::string> supported_isas() {
  std::vector<std::string> out;
  for (const char* isa : {"generic", "avx2", "avx512"}) {
    if (kernels_for(isa) != nullptr) out.emplace_back(isa);
  }
  return out;
}

}  // namespace dcf::cpu
