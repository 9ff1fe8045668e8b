// Raw CPU kernels compiled for: AVX-512 F/BW/VL/DQ (Skylake-X and later).
// Chosen at run time by kernels.cpp; see kernels_impl.h for the code.
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c,bmi2")

#define DC_KERNELS_AVX512 1
#include "cpu/kernels.h"
#include "cpu/kernels_impl.h"

namespace dcf::cpu {
DC_DEFINE_KERNEL_TABLE(kTableAvx512, "avx512")
}  // namespace dcf::cpu
#endif
