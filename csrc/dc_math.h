// Scalar building blocks shared by the CPU and CUDA kernels of diffcurr_fast (no torch dependency).
//
// Counter-based Gaussian noise as defined in docs/ops.md:
//   Philox4x32-10 (Salmon et al. 2011, "Parallel random numbers: as easy as 1, 2, 3"), the int32 -> [0, 1)
//   uniform mapping of triton.language.uint_to_uniform_float, and the Box-Muller transform in float32.
// log / sin / cos are polynomial (Cephes single precision), the same code on every backend and CPU instruction
// set, and gcc can vectorise loops calling them. Results agree to a few ulp, not bit for bit: the compilers may
// contract a * b + c into an FMA (nvcc by default, gcc where the AVX2 / AVX-512 kernels enable FMA). The CUDA
// sources are built without --use_fast_math (no approximate division or square root, no flushed denormals);
// the square roots here are explicitly correctly rounded.
//
// All functions have internal linkage (static inline) so that translation units compiled for different
// instruction sets never share a copy.
#pragma once

#include <cstdint>

#if defined(__CUDACC__)
#define DC_HD __host__ __device__
#define DC_INLINE __forceinline__
#else
#define DC_HD
#define DC_INLINE inline __attribute__((always_inline))
#endif

#if defined(__CUDA_ARCH__)
#define DC_UNROLL _Pragma("unroll")
#elif defined(__GNUC__) && !defined(__clang__) && !defined(__CUDACC__)
#define DC_UNROLL _Pragma("GCC unroll 10")
#else
#define DC_UNROLL
#endif

namespace dcf {

constexpr uint32_t kPhiloxM0 = 0xD2511F53u;  // round multiplier A
constexpr uint32_t kPhiloxM1 = 0xCD9E8D57u;  // round multiplier B
constexpr uint32_t kPhiloxW0 = 0x9E3779B9u;  // Weyl key increment (golden ratio)
constexpr uint32_t kPhiloxW1 = 0xBB67AE85u;  // Weyl key increment (sqrt(3) - 1)
constexpr float kUniformScale = 4.6566127342e-10f;  // ~2^-31, as in triton's uint_to_uniform_float
constexpr float kTwoPi = 6.283185307179586f;
constexpr float kMinUniform = 1e-7f;

static DC_HD DC_INLINE uint32_t f2u(float x) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(x);
#else
  return __builtin_bit_cast(uint32_t, x);
#endif
}

static DC_HD DC_INLINE float u2f(uint32_t x) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(x);
#else
  return __builtin_bit_cast(float, x);
#endif
}

// Correctly rounded float32 square root.
static DC_HD DC_INLINE float sqrt_rn(float x) {
#if defined(__CUDA_ARCH__)
  return __fsqrt_rn(x);
#else
  return __builtin_sqrtf(x);
#endif
}

// cond ? a : b as bit operations: keeps the kernels free of branches so that loops over lanes vectorise.
static DC_HD DC_INLINE uint32_t mask_of(bool cond) { return 0u - static_cast<uint32_t>(cond); }

static DC_HD DC_INLINE float select_f(uint32_t mask, float a, float b) {
  return u2f((f2u(a) & mask) | (f2u(b) & ~mask));
}

// Philox4x32-10 (Random123): ten rounds of two 32x32->64 multiplies, key bumped between rounds.
static DC_HD DC_INLINE void philox4x32_10(uint32_t c0, uint32_t c1, uint32_t c2, uint32_t c3, uint32_t k0,
                                          uint32_t k1, uint32_t out[4]) {
  DC_UNROLL
  for (int round = 0; round < 10; ++round) {
#if defined(__CUDA_ARCH__)
    const uint32_t n0 = __umulhi(kPhiloxM1, c2) ^ c1 ^ k0;
    const uint32_t n2 = __umulhi(kPhiloxM0, c0) ^ c3 ^ k1;
    c1 = kPhiloxM1 * c2;
    c3 = kPhiloxM0 * c0;
#else
    const uint64_t p0 = static_cast<uint64_t>(kPhiloxM0) * c0;
    const uint64_t p1 = static_cast<uint64_t>(kPhiloxM1) * c2;
    const uint32_t n0 = static_cast<uint32_t>(p1 >> 32) ^ c1 ^ k0;
    const uint32_t n2 = static_cast<uint32_t>(p0 >> 32) ^ c3 ^ k1;
    c1 = static_cast<uint32_t>(p1);
    c3 = static_cast<uint32_t>(p0);
#endif
    c0 = n0;
    c2 = n2;
    k0 += kPhiloxW0;
    k1 += kPhiloxW1;
  }
  out[0] = c0;
  out[1] = c1;
  out[2] = c2;
  out[3] = c3;
}

// u(r) = float32(r as int32 < 0 ? -r - 1 : r) * 4.6566127342e-10, in [0, 1].
static DC_HD DC_INLINE float uniform01(uint32_t r) {
  const int32_t s = static_cast<int32_t>(r);
  const int32_t m = s ^ (s >> 31);  // == (s < 0 ? -s - 1 : s)
  return static_cast<float>(m) * kUniformScale;
}

// Natural log for x in [1e-7, 1] (normal, positive): Cephes logf, ~1 ulp.
static DC_HD DC_INLINE float log_pos(float x) {
  const uint32_t ix = f2u(x);
  int32_t e = static_cast<int32_t>(ix >> 23) - 126;        // x = m * 2^e, m in [0.5, 1)
  float m = u2f((ix & 0x007fffffu) | 0x3f000000u);
  const uint32_t lo = mask_of(m < 0.707106781186547524f);
  e = e + static_cast<int32_t>(lo);                         // e - 1 where m < sqrt(1/2)
  m = select_f(lo, m + m, m) - 1.0f;                       // m in [sqrt(1/2) - 1, sqrt(2) - 1)
  const float z = m * m;
  float y = 7.0376836292e-2f;
  y = y * m - 1.1514610310e-1f;
  y = y * m + 1.1676998740e-1f;
  y = y * m - 1.2420140846e-1f;
  y = y * m + 1.4249322787e-1f;
  y = y * m - 1.6668057665e-1f;
  y = y * m + 2.0000714765e-1f;
  y = y * m - 2.4999993993e-1f;
  y = y * m + 3.3333331174e-1f;
  y = y * m * z;
  const float fe = static_cast<float>(e);
  y = y + (-2.12194440e-4f) * fe;
  y = y - 0.5f * z;
  return (m + y) + 0.693359375f * fe;
}

// sin and cos of th in [0, 2*pi] (Cephes sinf/cosf polynomials after a 3-part Cody-Waite reduction by pi/2).
static DC_HD DC_INLINE void sincos_2pi(float th, float* s_out, float* c_out) {
  const int32_t q = static_cast<int32_t>(th * 0.636619772367581343f + 0.5f);  // nearest quadrant, 0..4
  const float fq = static_cast<float>(q);
  const float r = ((th - fq * 1.5703125f) - fq * 4.837512969970703125e-4f) - fq * 7.54978995489188216e-8f;
  const float z = r * r;
  float s = -1.9515295891e-4f;
  s = s * z + 8.3321608736e-3f;
  s = s * z - 1.6666654611e-1f;
  s = s * z * r + r;
  float c = 2.443315711809948e-5f;
  c = c * z - 1.388731625493765e-3f;
  c = c * z + 4.166664568298827e-2f;
  c = c * z * z - 0.5f * z + 1.0f;
  const uint32_t swap = 0u - static_cast<uint32_t>(q & 1);
  const float sv = select_f(swap, c, s);
  const float cv = select_f(swap, s, c);
  const uint32_t s_sign = static_cast<uint32_t>(q & 2) << 30;        // quadrants 2, 3: sin < 0
  const uint32_t c_sign = static_cast<uint32_t>((q + 1) & 2) << 30;  // quadrants 1, 2: cos < 0
  *s_out = u2f(f2u(sv) ^ s_sign);
  *c_out = u2f(f2u(cv) ^ c_sign);
}

// Four standard normals from one Philox output (Box-Muller on the pairs (r0, r1) and (r2, r3)).
static DC_HD DC_INLINE void box_muller4(const uint32_t r[4], float n[4]) {
  const float ua = uniform01(r[0]);
  const float ub = uniform01(r[2]);
  const float rad_a = sqrt_rn(-2.0f * log_pos(select_f(mask_of(ua > kMinUniform), ua, kMinUniform)));
  const float rad_b = sqrt_rn(-2.0f * log_pos(select_f(mask_of(ub > kMinUniform), ub, kMinUniform)));
  float sa, ca, sb, cb;
  sincos_2pi(kTwoPi * uniform01(r[1]), &sa, &ca);
  sincos_2pi(kTwoPi * uniform01(r[3]), &sb, &cb);
  n[0] = rad_a * ca;
  n[1] = rad_a * sa;
  n[2] = rad_b * cb;
  n[3] = rad_b * sb;
}

// noise[4 * counter + k], k = 0..3, for a 64-bit seed.
static DC_HD DC_INLINE void normal4(uint64_t seed, uint64_t counter, float n[4]) {
  uint32_t r[4];
  philox4x32_10(static_cast<uint32_t>(counter), static_cast<uint32_t>(counter >> 32), 0u, 0u,
                static_cast<uint32_t>(seed), static_cast<uint32_t>(seed >> 32), r);
  box_muller4(r, n);
}

// bfloat16 / float16 <-> float32 by bit manipulation (round to nearest even), identical on every backend.
static DC_HD DC_INLINE float bf16_to_f32(uint16_t h) { return u2f(static_cast<uint32_t>(h) << 16); }

static DC_HD DC_INLINE uint16_t f32_to_bf16(float f) {
  const uint32_t u = f2u(f);
  const uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
  const bool nan = (u & 0x7fffffffu) > 0x7f800000u;
  return static_cast<uint16_t>(nan ? ((u >> 16) | 0x40u) : rounded);
}

static DC_HD DC_INLINE float f16_to_f32(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t em = h & 0x7fffu;
  // normal and subnormal: scale the shifted bits by 2^112 (exact); inf/nan: force the float exponent.
  const float mag = u2f(em << 13) * 5.192296858534828e+33f;
  const uint32_t bits = em >= 0x7c00u ? (0x7f800000u | (em << 13)) : f2u(mag);
  return u2f(sign | bits);
}

static DC_HD DC_INLINE uint16_t f32_to_f16(float f) {
  const uint32_t u = f2u(f);
  const uint32_t sign = (u >> 16) & 0x8000u;
  const uint32_t a = u & 0x7fffffffu;
  uint32_t out;
  if (a > 0x7f800000u) {
    out = 0x7e00u;  // nan
  } else if (a >= 0x477ff000u) {
    out = 0x7c00u;  // overflow (>= 65520 rounds to inf) or inf
  } else if (a < 0x38800000u) {
    // subnormal half (or zero): let the float adder round: add 0.5 (2^-1) and take the low mantissa bits.
    const float sub = u2f(a) + 0.5f;
    out = f2u(sub) - 0x3f000000u;
  } else {
    const uint32_t mant_odd = (a >> 13) & 1u;
    out = (a + (static_cast<uint32_t>(15 - 127) << 23) + 0xfffu + mant_odd) >> 13;
  }
  return static_cast<uint16_t>(out | sign);
}

}  // namespace dcf
