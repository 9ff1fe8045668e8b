// Raw CPU kernels compiled for: AVX2 + FMA (Haswell and later).
// Chosen at run time by kernels.cpp; see kernels_impl.h for the code.
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#pragma GCC target("avx2,fma,f16c,bmi2")

#define DC_KERNELS_AVX2 1
#include "cpu/kernels.h"
#include "cpu/kernels_impl.h"

namespace dcf::cpu {
DC_DEFINE_KERNEL_TABLE(kTableAvx2, "avx2")
}  // namespace dcf::cpu
#endif
