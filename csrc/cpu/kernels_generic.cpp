// Raw CPU kernels compiled for: baseline x86-64 (SSE2) or the native target on other architectures.
// Chosen at run time by kernels.cpp; see kernels_impl.h for the code.



#include "cpu/kernels.h"
#include "cpu/kernels_impl.h"

namespace dcf::cpu {
DC_DEFINE_KERNEL_TABLE(kTableGeneric, "generic")
}  // namespace dcf::cpu

