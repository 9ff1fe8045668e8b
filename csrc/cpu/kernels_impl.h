// Implementation of the raw CPU kernels (csrc/cpu/kernels.h), included once per instruction set by
// kernels_generic.cpp / kernels_avx2.cpp / kernels_avx512.cpp inside `namespace dcf::cpu::<isa>`, after the
// file has selected its target. Everything here has internal linkage. The inner loops are written over
// fixed-size lane blocks so that gcc -O3 vectorises them (Philox over lanes with 32x32->64 multiplies, the
// polynomial log/sin/cos, and the fused element loops with per-lane partial sums).
#pragma once

#include <cstring>
#include <type_traits>

#include "dc_math.h"

// An always-inlined lambda (called per vector of a short row: a call would cost as much as its arithmetic).
#define DC_LAMBDA_INLINE __attribute__((always_inline))

// 64-byte generic vectors are passed in registers only after inlining (always done here); gcc 12 also warns
// about an intentionally undefined register inside avx512fintrin.h.
#pragma GCC diagnostic ignored "-Wpsabi"
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"

#if defined(DC_KERNELS_AVX512) || defined(DC_KERNELS_AVX2)
#include <immintrin.h>
#elif defined(__x86_64__) && defined(__SSE2__)
#define DC_KERNELS_SSE2 1
#include <emmintrin.h>
#endif

namespace {

using dcf::bf16_to_f32;
using dcf::f16_to_f32;
using dcf::f32_to_bf16;
using dcf::f32_to_f16;

constexpr int64_t kTileCounters = 64;               // Philox counters per noise tile
constexpr int64_t kTileElems = 4 * kTileCounters;  // normals per noise tile
constexpr int kAcc = 16;                            // partial sums per reduction (one AVX-512 register)

struct F32 {
  using storage = float;
  static inline float load(float v) { return v; }
  static inline float store(float v) { return v; }
};
struct BF16 {
  using storage = uint16_t;
  static inline float load(uint16_t v) { return bf16_to_f32(v); }
  static inline uint16_t store(float v) { return f32_to_bf16(v); }
};
struct F16 {
  using storage = uint16_t;
  static inline float load(uint16_t v) { return f16_to_f32(v); }
  static inline uint16_t store(float v) { return f32_to_f16(v); }
};

inline int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }

// Philox over 16 lanes in generic vectors. The two 32x32->64 multiplies of a round use the even/odd lane
// trick: a 64-bit lane holds two counters, and mul_epu32 multiplies the low halves of each 64-bit lane.
typedef uint32_t v16u32 __attribute__((vector_size(64)));
typedef uint64_t v8u64 __attribute__((vector_size(64)));

DC_INLINE v8u64 mul_even32(v8u64 a, v8u64 b) {  // (a & 0xffffffff) * (b & 0xffffffff) per 64-bit lane
#if defined(DC_KERNELS_AVX512)
  return (v8u64)_mm512_mul_epu32((__m512i)a, (__m512i)b);
#elif defined(DC_KERNELS_AVX2)
  union {
    v8u64 v;
    __m256i h[2];
  } ua{a}, ub{b}, r;
  r.h[0] = _mm256_mul_epu32(ua.h[0], ub.h[0]);
  r.h[1] = _mm256_mul_epu32(ua.h[1], ub.h[1]);
  return r.v;
#elif defined(DC_KERNELS_SSE2)
  union {
    v8u64 v;
    __m128i q[4];
  } ua{a}, ub{b}, r;
  for (int k = 0; k < 4; ++k) r.q[k] = _mm_mul_epu32(ua.q[k], ub.q[k]);
  return r.v;
#else
  return (a & 0xffffffffULL) * (b & 0xffffffffULL);
#endif
}

// hi / lo 32 bits of m * a for each 32-bit lane of a.
DC_INLINE void mulhilo16(v16u32 a, uint32_t m, v16u32& hi, v16u32& lo) {
  const v8u64 va = (v8u64)a;
  const v8u64 vm = (v8u64){} + static_cast<uint64_t>(m);
  const v8u64 pe = mul_even32(va, vm);        // products of the even lanes
  const v8u64 po = mul_even32(va >> 32, vm);  // products of the odd lanes
  hi = (v16u32)((pe >> 32) | (po & 0xffffffff00000000ULL));
  lo = (v16u32)((pe & 0xffffffffULL) | (po << 32));
}

// r0..r3[0 .. 64) = Philox4x32-10 of the counters c0 + l, l < 64 (64-bit counter with carry).
inline void philox_tile(uint64_t seed, uint64_t c0, uint32_t* __restrict r0, uint32_t* __restrict r1,
                        uint32_t* __restrict r2, uint32_t* __restrict r3) {
  const v16u32 iota = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
  const uint32_t base_lo = static_cast<uint32_t>(c0);
  const v16u32 bl = (v16u32){} + base_lo;
  const v16u32 bh = (v16u32){} + static_cast<uint32_t>(c0 >> 32);
  for (int g = 0; g < static_cast<int>(kTileCounters) / 16; ++g) {
    v16u32 x0 = bl + (iota + static_cast<uint32_t>(16 * g));
    v16u32 x1 = bh - (v16u32)(x0 < bl);  // carry into the high word
    v16u32 x2 = (v16u32){}, x3 = (v16u32){};
    v16u32 k0 = (v16u32){} + static_cast<uint32_t>(seed);
    v16u32 k1 = (v16u32){} + static_cast<uint32_t>(seed >> 32);
    DC_UNROLL
    for (int round = 0; round < 10; ++round) {
      v16u32 h0, l0, h1, l1;
      mulhilo16(x0, dcf::kPhiloxM0, h0, l0);
      mulhilo16(x2, dcf::kPhiloxM1, h1, l1);
      x0 = h1 ^ x1 ^ k0;
      x2 = h0 ^ x3 ^ k1;
      x1 = l1;
      x3 = l0;
      k0 += dcf::kPhiloxW0;
      k1 += dcf::kPhiloxW1;
    }
    __builtin_memcpy(r0 + 16 * g, &x0, sizeof(x0));
    __builtin_memcpy(r1 + 16 * g, &x1, sizeof(x1));
    __builtin_memcpy(r2 + 16 * g, &x2, sizeof(x2));
    __builtin_memcpy(r3 + 16 * g, &x3, sizeof(x3));
  }
}

// buf[0 .. 4 * nc) = noise of Philox counters [c0, c0 + nc), nc <= kTileCounters.
inline void gen_tile(uint64_t seed, uint64_t c0, int64_t nc, float* __restrict buf) {
  alignas(64) uint32_t r0[kTileCounters], r1[kTileCounters], r2[kTileCounters], r3[kTileCounters];
  alignas(64) float n0[kTileCounters], n1[kTileCounters], n2[kTileCounters], n3[kTileCounters];
  philox_tile(seed, c0, r0, r1, r2, r3);
  for (int64_t l = 0; l < nc; ++l) {
    const uint32_t r[4] = {r0[l], r1[l], r2[l], r3[l]};
    float n[4];
    dcf::box_muller4(r, n);
    n0[l] = n[0];
    n1[l] = n[1];
    n2[l] = n[2];
    n3[l] = n[3];
  }
  for (int64_t l = 0; l < nc; ++l) {
    buf[4 * l + 0] = n0[l];
    buf[4 * l + 1] = n1[l];
    buf[4 * l + 2] = n2[l];
    buf[4 * l + 3] = n3[l];
  }
}

// Calls fn(i, i_end, nz) for consecutive pieces of the flat range [i, end), where nz[k - i] is noise[k] for
// k in [i, i_end). Pieces never cross a multiple of kTileElems.
template <class Fn>
inline void for_noise_tiles(uint64_t seed, int64_t i, int64_t end, Fn&& fn) {
  alignas(64) float buf[kTileElems];
  while (i < end) {
    const int64_t c0 = i / 4;
    const int64_t t_end = min64((c0 + kTileCounters) * 4, end);
    const int64_t nc = (t_end - 1) / 4 - c0 + 1;
    gen_tile(seed, static_cast<uint64_t>(c0), nc, buf);
    fn(i, t_end, buf + (i - 4 * c0));
    i = t_end;
  }
}

void randn_impl(uint64_t seed, int64_t i0, int64_t n, float* out) {
  for_noise_tiles(seed, i0, i0 + n, [&](int64_t i, int64_t i_end, const float* nz) {
    float* __restrict o = out + (i - i0);
    for (int64_t k = 0; k < i_end - i; ++k) o[k] = nz[k];
  });
}

template <class T, class NT>
void q_sample_t(const void* x0_, const void* noise_, const float* a, const float* c, void* out_, int64_t M,
                uint64_t seed, int64_t i0, int64_t n) {
  using S = typename T::storage;
  using NS = typename NT::storage;
  const S* __restrict x0 = static_cast<const S*>(x0_);
  const NS* __restrict noise = static_cast<const NS*>(noise_);
  S* __restrict out = static_cast<S*>(out_);
  int64_t i = i0;
  const int64_t end = i0 + n;
  while (i < end) {
    const int64_t b = i / M;
    const int64_t row_end = min64((b + 1) * M, end);
    const float av = a[b], cv = c[b];
    if (noise != nullptr) {
      for (int64_t k = i; k < row_end; ++k) out[k] = T::store(av * T::load(x0[k]) + cv * NT::load(noise[k]));
    } else {
      for_noise_tiles(seed, i, row_end, [&](int64_t s, int64_t e, const float* __restrict nz) {
        const S* __restrict xs = x0 + s;
        S* __restrict os = out + s;
        for (int64_t k = 0; k < e - s; ++k) os[k] = T::store(av * T::load(xs[k]) + cv * nz[k]);
      });
    }
    i = row_end;
  }
}

// Sum of (pred - p x0 - q noise)^2 over a piece, with the optional gradient write. kX0 / kEps: whether the
// target reads x0 / the noise (false when its coefficient is zero, so that input is never loaded).
template <class T, bool kGrad, bool kX0, bool kEps>
inline double loss_piece(const typename T::storage* __restrict pr, const typename T::storage* __restrict xs,
                         const float* __restrict nz, typename T::storage* __restrict g, int64_t len, float pv,
                         float qv, float sc) {
  alignas(64) float acc[kAcc] = {};
  auto diff = [&](int64_t k) {
    float tgt = 0.0f;
    if constexpr (kX0) tgt = pv * T::load(xs[k]);
    if constexpr (kEps) tgt = kX0 ? tgt + qv * nz[k] : qv * nz[k];
    return T::load(pr[k]) - tgt;
  };
  int64_t k = 0;
  for (; k + kAcc <= len; k += kAcc) {
    for (int l = 0; l < kAcc; ++l) {
      const float d = diff(k + l);
      acc[l] += d * d;
      if constexpr (kGrad) g[k + l] = T::store(sc * d);
    }
  }
  for (int l = 0; k < len; ++k, ++l) {
    const float d = diff(k);
    acc[l] += d * d;
    if constexpr (kGrad) g[k] = T::store(sc * d);
  }
  double total = 0.0;
  for (int l = 0; l < kAcc; ++l) total += acc[l];
  return total;
}

template <class T, class NT, bool kGrad, bool kX0, bool kEps>
double loss_rows(const typename T::storage* __restrict pred, const typename T::storage* __restrict x0,
                 const typename NT::storage* __restrict noise, typename T::storage* __restrict grad, float pv,
                 float qv, float sc, uint64_t seed, int64_t i0, int64_t n) {
  double total = 0.0;
  if constexpr (!kEps) {
    total = loss_piece<T, kGrad, kX0, false>(pred + i0, x0 + i0, nullptr, kGrad ? grad + i0 : nullptr, n, pv, qv, sc);
  } else if (noise != nullptr) {
    if constexpr (std::is_same_v<NT, F32>) {  // float32 noise is read in place
      total = loss_piece<T, kGrad, kX0, true>(pred + i0, x0 + i0, noise + i0, kGrad ? grad + i0 : nullptr, n, pv,
                                              qv, sc);
    } else {
      alignas(64) float buf[kTileElems];
      for (int64_t s = i0; s < i0 + n; s += kTileElems) {
        const int64_t len = min64(kTileElems, i0 + n - s);
        for (int64_t k = 0; k < len; ++k) buf[k] = NT::load(noise[s + k]);
        total += loss_piece<T, kGrad, kX0, true>(pred + s, x0 + s, buf, kGrad ? grad + s : nullptr, len, pv, qv, sc);
      }
    }
  } else {
    for_noise_tiles(seed, i0, i0 + n, [&](int64_t s, int64_t e, const float* nz) {
      total += loss_piece<T, kGrad, kX0, true>(pred + s, x0 + s, nz, kGrad ? grad + s : nullptr, e - s, pv, qv, sc);
    });
  }
  return total;
}

template <class T, class NT, bool kGrad>
double loss_t(const void* pred_, int64_t pstride, const void* x0_, const void* noise_, const float* p,
              const float* q, const float* w, float gscale, void* grad_, int64_t M, uint64_t seed, int64_t b,
              int64_t j0, int64_t n) {
  using S = typename T::storage;
  using NS = typename NT::storage;
  // shifted so that pred + b * M + j is element j of row b, which starts at b * pstride (pstride >= M)
  const S* pred = static_cast<const S*>(pred_) + b * (pstride - M);
  const S* x0 = static_cast<const S*>(x0_);
  const NS* noise = static_cast<const NS*>(noise_);
  S* grad = static_cast<S*>(grad_);
  const float pv = p[b], qv = q[b];
  const float sc = w[b] * (2.0f / static_cast<float>(M)) * gscale;
  const int64_t i0 = b * M + j0;
  // a zero coefficient drops its input from the target: eps prediction never reads x0, x0 prediction (and EDM's
  // denoiser target) never reads or regenerates the noise
  if (pv == 0.0f) return loss_rows<T, NT, kGrad, false, true>(pred, x0, noise, grad, pv, qv, sc, seed, i0, n);
  if (qv == 0.0f) return loss_rows<T, NT, kGrad, true, false>(pred, x0, noise, grad, pv, qv, sc, seed, i0, n);
  return loss_rows<T, NT, kGrad, true, true>(pred, x0, noise, grad, pv, qv, sc, seed, i0, n);
}

// The sum of kAcc per-lane partial sums as a fixed tree (halves added lane-wise): a few vector adds instead of a
// chain of kAcc dependent scalar adds, which would dominate a short row.
static_assert(kAcc == 16, "lane_sum adds 16 lanes");
DC_INLINE float lane_sum(const float* __restrict acc) {
  float t8[8], t4[4];
  for (int l = 0; l < 8; ++l) t8[l] = acc[l] + acc[l + 8];
  for (int l = 0; l < 4; ++l) t4[l] = t8[l] + t8[l + 4];
  return (t4[0] + t4[2]) + (t4[1] + t4[3]);
}

// Per-lane partial sums of a row, reduced in a fixed order.
template <class Fn>
inline float row_sum(int64_t D, Fn&& term) {
  alignas(64) float acc[kAcc] = {};
  int64_t d = 0;
  for (; d + kAcc <= D; d += kAcc) {
    for (int l = 0; l < kAcc; ++l) acc[l] += term(d + l);
  }
  for (int l = 0; d < D; ++d, ++l) acc[l] += term(d);
  return lane_sum(acc);
}

template <class T>
void adaln_fwd_t(const void* x_, const float* shift, const float* scale, void* y_, float* mean, float* rstd,
                 int64_t N, int64_t D, float eps, int64_t r0, int64_t nrows) {
  using S = typename T::storage;
  const S* __restrict x = static_cast<const S*>(x_);
  S* __restrict y = static_cast<S*>(y_);
  const float inv_d = 1.0f / static_cast<float>(D);
  for (int64_t r = r0; r < r0 + nrows; ++r) {
    const int64_t b = r / N;
    const S* __restrict xr = x + r * D;
    S* __restrict yr = y + r * D;
    const float* __restrict sh = shift + b * D;
    const float* __restrict scl = scale + b * D;
    const float mu = row_sum(D, [&](int64_t d) { return T::load(xr[d]); }) * inv_d;
    const float var = row_sum(D, [&](int64_t d) {
                        const float v = T::load(xr[d]) - mu;
                        return v * v;
                      }) *
                      inv_d;
    const float rs = 1.0f / __builtin_sqrtf(var + eps);
    for (int64_t d = 0; d < D; ++d) yr[d] = T::store((T::load(xr[d]) - mu) * rs * (1.0f + scl[d]) + sh[d]);
    mean[r] = mu;
    rstd[r] = rs;
  }
}

// Local pointers do not carry `restrict` for gcc's alias analysis, so the fused element loops below are marked
// `GCC ivdep` (their output rows never overlap their input rows) to vectorise without run-time alias checks.
template <class T, bool kAffine>
void adaln_bwd_t(const void* gy_, const void* x_, const float* scale, const float* mean, const float* rstd,
                 void* gx_, float* gshift_acc, float* gscale_acc, int64_t N, int64_t D, int64_t b, int64_t n0,
                 int64_t nrows) {
  using S = typename T::storage;
  const S* __restrict gyp = static_cast<const S*>(gy_);
  const S* __restrict x = static_cast<const S*>(x_);
  S* __restrict gx = static_cast<S*>(gx_);
  const float* __restrict scl = scale + b * D;
  float* __restrict gsh = gshift_acc;
  float* __restrict gsc = gscale_acc;
  const float inv_d = 1.0f / static_cast<float>(D);
  for (int64_t n = n0; n < n0 + nrows; ++n) {
    const int64_t r = b * N + n;
    const S* __restrict xr = x + r * D;
    const S* __restrict gr = gyp + r * D;
    S* __restrict gxr = gx + r * D;
    const float mu = mean[r], rs = rstd[r];
    // one pass for mean_d(gh) and mean_d(gh * xhat), gh = grad_y * (1 + scale), in kAcc fixed lanes
    alignas(64) float a1[kAcc] = {}, a2[kAcc] = {};
    int64_t d = 0;
    for (; d + kAcc <= D; d += kAcc) {
      for (int l = 0; l < kAcc; ++l) {
        const float gh = T::load(gr[d + l]) * (1.0f + scl[d + l]);
        a1[l] += gh;
        a2[l] += gh * ((T::load(xr[d + l]) - mu) * rs);
      }
    }
    for (int l = 0; d < D; ++d, ++l) {
      const float gh = T::load(gr[d]) * (1.0f + scl[d]);
      a1[l] += gh;
      a2[l] += gh * ((T::load(xr[d]) - mu) * rs);
    }
    const float m1 = lane_sum(a1) * inv_d, m2 = lane_sum(a2) * inv_d;
    // grad_x = rstd * (gh - mean(gh) - xhat * mean(gh * xhat)); column sums of grad_y and grad_y * xhat
#pragma GCC ivdep
    for (int64_t k = 0; k < D; ++k) {
      const float g = T::load(gr[k]);
      const float xh = (T::load(xr[k]) - mu) * rs;
      gxr[k] = T::store(rs * (g * (1.0f + scl[k]) - m1 - xh * m2));
      if constexpr (kAffine) {
        gsh[k] += g;
        gsc[k] += g * xh;
      }
    }
  }
}

template <class T>
void gated_fwd_t(const void* x_, const float* gate, const void* y_, void* out_, int64_t N, int64_t D, int64_t r0,
                 int64_t nrows) {
  using S = typename T::storage;
  const S* __restrict x = static_cast<const S*>(x_);
  const S* __restrict y = static_cast<const S*>(y_);
  S* __restrict out = static_cast<S*>(out_);
  for (int64_t r = r0; r < r0 + nrows; ++r) {
    const float* __restrict gt = gate + (r / N) * D;
    const S* __restrict xr = x + r * D;
    const S* __restrict yr = y + r * D;
    S* __restrict outr = out + r * D;
    for (int64_t d = 0; d < D; ++d) outr[d] = T::store(T::load(xr[d]) + gt[d] * T::load(yr[d]));
  }
}

template <class T>
void gated_bwd_t(const void* go_, const float* gate, const void* y_, void* gy_, float* ggate_acc, int64_t N,
                 int64_t D, int64_t b, int64_t n0, int64_t nrows) {
  using S = typename T::storage;
  const S* __restrict go = static_cast<const S*>(go_);
  const S* __restrict y = static_cast<const S*>(y_);
  S* __restrict gy = static_cast<S*>(gy_);
  const float* __restrict gt = gate + b * D;
  float* __restrict gg = ggate_acc;
  for (int64_t n = n0; n < n0 + nrows; ++n) {
    const int64_t r = b * N + n;
    const S* __restrict gor = go + r * D;
    const S* __restrict yr = y + r * D;
    S* __restrict gyr = gy + r * D;
    // grad_y = gate * grad_out, then the column sums of grad_out * y (grad_gate); two short loops over the
    // L1-resident row run faster than one loop with two stores per element
#pragma GCC ivdep
    for (int64_t d = 0; d < D; ++d) gyr[d] = T::store(gt[d] * T::load(gor[d]));
#pragma GCC ivdep
    for (int64_t d = 0; d < D; ++d) gg[d] += T::load(gor[d]) * T::load(yr[d]);
  }
}

// ---- type dispatch (dt: the tensors' type; noise_dt: kF32 or dt) ----

void q_sample_entry(int dt, const void* x0, int noise_dt, const void* noise, const float* a, const float* c,
                    void* out, int64_t M, uint64_t seed, int64_t i0, int64_t n) {
  const bool nf = noise == nullptr || noise_dt == dcf::cpu::kF32;
  if (dt == dcf::cpu::kF32) return q_sample_t<F32, F32>(x0, noise, a, c, out, M, seed, i0, n);
  if (dt == dcf::cpu::kBF16) {
    return nf ? q_sample_t<BF16, F32>(x0, noise, a, c, out, M, seed, i0, n)
              : q_sample_t<BF16, BF16>(x0, noise, a, c, out, M, seed, i0, n);
  }
  return nf ? q_sample_t<F16, F32>(x0, noise, a, c, out, M, seed, i0, n)
            : q_sample_t<F16, F16>(x0, noise, a, c, out, M, seed, i0, n);
}

template <class T, class NT>
double loss_grad_dispatch(bool with_grad, const void* pred, int64_t ps, const void* x0, const void* noise,
                          const float* p, const float* q, const float* w, float gs, void* grad, int64_t M,
                          uint64_t seed, int64_t b, int64_t j0, int64_t n) {
  return with_grad ? loss_t<T, NT, true>(pred, ps, x0, noise, p, q, w, gs, grad, M, seed, b, j0, n)
                   : loss_t<T, NT, false>(pred, ps, x0, noise, p, q, w, gs, grad, M, seed, b, j0, n);
}

double loss_entry(int dt, const void* pred, int64_t ps, const void* x0, int noise_dt, const void* noise,
                  const float* p, const float* q, const float* w, float gs, void* grad, int64_t M, uint64_t seed,
                  int64_t b, int64_t j0, int64_t n) {
  const bool nf = noise == nullptr || noise_dt == dcf::cpu::kF32;
  const bool g = grad != nullptr;
  if (dt == dcf::cpu::kF32) {
    return loss_grad_dispatch<F32, F32>(g, pred, ps, x0, noise, p, q, w, gs, grad, M, seed, b, j0, n);
  }
  if (dt == dcf::cpu::kBF16) {
    return nf ? loss_grad_dispatch<BF16, F32>(g, pred, ps, x0, noise, p, q, w, gs, grad, M, seed, b, j0, n)
              : loss_grad_dispatch<BF16, BF16>(g, pred, ps, x0, noise, p, q, w, gs, grad, M, seed, b, j0, n);
  }
  return nf ? loss_grad_dispatch<F16, F32>(g, pred, ps, x0, noise, p, q, w, gs, grad, M, seed, b, j0, n)
            : loss_grad_dispatch<F16, F16>(g, pred, ps, x0, noise, p, q, w, gs, grad, M, seed, b, j0, n);
}

void adaln_fwd_entry(int dt, const void* x, const float* shift, const float* scale, void* y, float* mean,
                     float* rstd, int64_t N, int64_t D, float eps, int64_t r0, int64_t nrows) {
  if (dt == dcf::cpu::kF32) return adaln_fwd_t<F32>(x, shift, scale, y, mean, rstd, N, D, eps, r0, nrows);
  if (dt == dcf::cpu::kBF16) return adaln_fwd_t<BF16>(x, shift, scale, y, mean, rstd, N, D, eps, r0, nrows);
  return adaln_fwd_t<F16>(x, shift, scale, y, mean, rstd, N, D, eps, r0, nrows);
}

template <bool kAffine>
void adaln_bwd_dispatch(int dt, const void* gy, const void* x, const float* scale, const float* mean,
                        const float* rstd, void* gx, float* gsh, float* gsc, int64_t N, int64_t D, int64_t b,
                        int64_t n0, int64_t nrows) {
  if (dt == dcf::cpu::kF32) {
    return adaln_bwd_t<F32, kAffine>(gy, x, scale, mean, rstd, gx, gsh, gsc, N, D, b, n0, nrows);
  }
  if (dt == dcf::cpu::kBF16) {
    return adaln_bwd_t<BF16, kAffine>(gy, x, scale, mean, rstd, gx, gsh, gsc, N, D, b, n0, nrows);
  }
  return adaln_bwd_t<F16, kAffine>(gy, x, scale, mean, rstd, gx, gsh, gsc, N, D, b, n0, nrows);
}

void adaln_bwd_entry(int dt, const void* gy, const void* x, const float* scale, const float* mean,
                     const float* rstd, void* gx, float* gsh, float* gsc, int64_t N, int64_t D, int64_t b,
                     int64_t n0, int64_t nrows) {
  if (gsh == nullptr) return adaln_bwd_dispatch<false>(dt, gy, x, scale, mean, rstd, gx, gsh, gsc, N, D, b, n0, nrows);
  return adaln_bwd_dispatch<true>(dt, gy, x, scale, mean, rstd, gx, gsh, gsc, N, D, b, n0, nrows);
}

void gated_fwd_entry(int dt, const void* x, const float* gate, const void* y, void* out, int64_t N, int64_t D,
                     int64_t r0, int64_t nrows) {
  if (dt == dcf::cpu::kF32) return gated_fwd_t<F32>(x, gate, y, out, N, D, r0, nrows);
  if (dt == dcf::cpu::kBF16) return gated_fwd_t<BF16>(x, gate, y, out, N, D, r0, nrows);
  return gated_fwd_t<F16>(x, gate, y, out, N, D, r0, nrows);
}

void gated_bwd_entry(int dt, const void* go, const float* gate, const void* y, void* gy, float* gg, int64_t N,
                     int64_t D, int64_t b, int64_t n0, int64_t nrows) {
  if (dt == dcf::cpu::kF32) return gated_bwd_t<F32>(go, gate, y, gy, gg, N, D, b, n0, nrows);
  if (dt == dcf::cpu::kBF16) return gated_bwd_t<BF16>(go, gate, y, gy, gg, N, D, b, n0, nrows);
  return gated_bwd_t<F16>(go, gate, y, gy, gg, N, D, b, n0, nrows);
}

// ---- tanh-GELU ------------------------------------------------------------------------------------------
// Vectors of the instruction set's native width: gcc lowers wider generic vectors badly for this code on AVX2.
#if defined(DC_KERNELS_AVX512)
constexpr int kGeluLanes = 16;
#elif defined(DC_KERNELS_AVX2)
constexpr int kGeluLanes = 8;
#else
constexpr int kGeluLanes = 4;
#endif
typedef float vgf __attribute__((vector_size(4 * kGeluLanes)));
typedef int32_t vgi __attribute__((vector_size(4 * kGeluLanes)));

// e^x per lane: x = n ln2 + r with |r| <= ln2 / 2 (ln2 split in two for an exact product), a degree-7
// polynomial for e^r, 2^n from the exponent bits. Relative error below 2 ulp; the input is clamped to
// [-87, 88], where 2^n stays a normal float.
DC_INLINE vgf exp_lanes(vgf x) {
  x = x < -87.0f ? -87.0f + (vgf){} : x;
  x = x > 88.0f ? 88.0f + (vgf){} : x;
  const vgf magic = (vgf){} + 12582912.0f;  // 1.5 * 2^23: adding and subtracting it rounds to an integer
  const vgf n = (x * 1.44269504088896341f + magic) - magic;
  vgf r = x - n * 0.693145751953125f;
  r = r - n * 1.428606765330187045e-06f;
  vgf p = (vgf){} + 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = (p * r) * r + r + 1.0f;
  const vgi bits = (__builtin_convertvector(n, vgi) + 127) << 23;
  return p * (vgf)bits;
}

constexpr float kGeluK0 = 0.7978845608028654f;  // sqrt(2 / pi)
constexpr float kGeluK1 = 0.044715f;

// s = sigmoid(2u) = (1 + tanh u) / 2 per lane; y = x s, and dy/dx = s + 2 x s (1 - s) du/dx.
template <bool kGrad>
DC_INLINE vgf gelu_lanes(vgf v) {
  const vgf u = kGeluK0 * (v + kGeluK1 * v * v * v);
  const vgf s = 1.0f / (1.0f + exp_lanes(-2.0f * u));
  if constexpr (kGrad) return s + 2.0f * v * s * (1.0f - s) * (kGeluK0 * (1.0f + 3.0f * kGeluK1 * v * v));
  return v * s;
}

// out[l] = (kGrad ? g[l] : 1) * gelu_lanes<kGrad>(x[l]) for m <= kGeluLanes elements (the tail is padded).
template <class T, bool kGrad>
DC_INLINE void gelu_block(const typename T::storage* __restrict g, const typename T::storage* __restrict x,
                          typename T::storage* __restrict out, int64_t m) {
  float xs[kGeluLanes] = {}, gs[kGeluLanes] = {}, rs[kGeluLanes];  // arrays: gcc vectorises these copies
  for (int64_t l = 0; l < m; ++l) xs[l] = T::load(x[l]);
  if constexpr (kGrad) {
    for (int64_t l = 0; l < m; ++l) gs[l] = T::load(g[l]);
  }
  vgf v, gv;
  std::memcpy(&v, xs, sizeof v);
  std::memcpy(&gv, gs, sizeof gv);
  vgf r = gelu_lanes<kGrad>(v);
  if constexpr (kGrad) r *= gv;
  std::memcpy(rs, &r, sizeof r);
  for (int64_t l = 0; l < m; ++l) out[l] = T::store(rs[l]);
}

template <class T, bool kGrad>
void gelu_t(const void* g_, const void* x_, void* out_, int64_t i0, int64_t n) {
  const auto* x = static_cast<const typename T::storage*>(x_) + i0;
  const auto* g = kGrad ? static_cast<const typename T::storage*>(g_) + i0 : nullptr;
  auto* out = static_cast<typename T::storage*>(out_) + i0;
  int64_t k = 0;
  for (; k + kGeluLanes <= n; k += kGeluLanes) {
    gelu_block<T, kGrad>(kGrad ? g + k : nullptr, x + k, out + k, kGeluLanes);
  }
  if (k < n) gelu_block<T, kGrad>(kGrad ? g + k : nullptr, x + k, out + k, n - k);
}

void gelu_fwd_entry(int dt, const void* x, void* y, int64_t i0, int64_t n) {
  if (dt == dcf::cpu::kF32) return gelu_t<F32, false>(nullptr, x, y, i0, n);
  if (dt == dcf::cpu::kBF16) return gelu_t<BF16, false>(nullptr, x, y, i0, n);
  return gelu_t<F16, false>(nullptr, x, y, i0, n);
}

void gelu_bwd_entry(int dt, const void* gy, const void* x, void* gx, int64_t i0, int64_t n) {
  if (dt == dcf::cpu::kF32) return gelu_t<F32, true>(gy, x, gx, i0, n);
  if (dt == dcf::cpu::kBF16) return gelu_t<BF16, true>(gy, x, gx, i0, n);
  return gelu_t<F16, true>(gy, x, gx, i0, n);
}

// ---- RMSNorm-modulate ------------------------------------------------------------------------------------
template <class T, bool kW>
void rmsnorm_fwd_t(const void* x_, const float* shift, const float* scale, const float* w_, void* y_, float* rstd,
                   int64_t N, int64_t D, float eps, int64_t r0, int64_t nrows) {
  using S = typename T::storage;
  const S* __restrict x = static_cast<const S*>(x_);
  S* __restrict y = static_cast<S*>(y_);
  const float* __restrict w = w_;
  const float inv_d = 1.0f / static_cast<float>(D);
  for (int64_t r = r0; r < r0 + nrows; ++r) {
    const int64_t b = r / N;
    const S* __restrict xr = x + r * D;
    S* __restrict yr = y + r * D;
    const float* __restrict sh = shift + b * D;
    const float* __restrict scl = scale + b * D;
    const float ms = row_sum(D, [&](int64_t d) {
                       const float v = T::load(xr[d]);
                       return v * v;
                     }) *
                     inv_d;
    const float rs = 1.0f / __builtin_sqrtf(ms + eps);
    for (int64_t d = 0; d < D; ++d) {
      float xh = T::load(xr[d]) * rs;
      if constexpr (kW) xh *= w[d];
      yr[d] = T::store(xh * (1.0f + scl[d]) + sh[d]);
    }
    rstd[r] = rs;
  }
}

// grad_x = rstd * (gh - xhat * mean_d(gh * xhat)), gh = grad_y * (1 + scale) * w; the column sums of grad_y and
// grad_y * xhat (grad_shift, and the sum grad_scale and grad_w are formed from).
template <class T, bool kAffine, bool kW>
void rmsnorm_bwd_t(const void* gy_, const void* x_, const float* scale, const float* w_, const float* rstd,
                   void* gx_, float* gshift_acc, float* gxhat_acc, int64_t N, int64_t D, int64_t b, int64_t n0,
                   int64_t nrows) {
  using S = typename T::storage;
  const S* __restrict gyp = static_cast<const S*>(gy_);
  const S* __restrict x = static_cast<const S*>(x_);
  S* __restrict gx = static_cast<S*>(gx_);
  const float* __restrict scl = scale + b * D;
  const float* __restrict w = w_;
  float* __restrict gsh = gshift_acc;
  float* __restrict gsx = gxhat_acc;
  const float inv_d = 1.0f / static_cast<float>(D);
  for (int64_t n = n0; n < n0 + nrows; ++n) {
    const int64_t r = b * N + n;
    const S* __restrict xr = x + r * D;
    const S* __restrict gr = gyp + r * D;
    S* __restrict gxr = gx + r * D;
    const float rs = rstd[r];
    const float dot = row_sum(D, [&](int64_t d) {
      float gh = T::load(gr[d]) * (1.0f + scl[d]);
      if constexpr (kW) gh *= w[d];
      return gh * T::load(xr[d]);
    });
    const float m2 = dot * rs * inv_d;  // mean_d(gh * xhat)
#pragma GCC ivdep
    for (int64_t k = 0; k < D; ++k) {
      const float g = T::load(gr[k]);
      const float xh = T::load(xr[k]) * rs;
      float gh = g * (1.0f + scl[k]);
      if constexpr (kW) gh *= w[k];
      gxr[k] = T::store(rs * (gh - xh * m2));
      if constexpr (kAffine) {
        gsh[k] += g;
        gsx[k] += g * xh;
      }
    }
  }
}

void rmsnorm_fwd_entry(int dt, const void* x, const float* shift, const float* scale, const float* w, void* y,
                       float* rstd, int64_t N, int64_t D, float eps, int64_t r0, int64_t nrows) {
  auto run = [&](auto t, auto has_w) {
    rmsnorm_fwd_t<decltype(t), decltype(has_w)::value>(x, shift, scale, w, y, rstd, N, D, eps, r0, nrows);
  };
  const bool hw = w != nullptr;
  if (dt == dcf::cpu::kF32) return hw ? run(F32{}, std::true_type{}) : run(F32{}, std::false_type{});
  if (dt == dcf::cpu::kBF16) return hw ? run(BF16{}, std::true_type{}) : run(BF16{}, std::false_type{});
  return hw ? run(F16{}, std::true_type{}) : run(F16{}, std::false_type{});
}

template <class T>
void rmsnorm_bwd_typed(const void* gy, const void* x, const float* scale, const float* w, const float* rstd,
                       void* gx, float* gsh, float* gsx, int64_t N, int64_t D, int64_t b, int64_t n0,
                       int64_t nrows) {
  if (gsh == nullptr) {
    if (w == nullptr) return rmsnorm_bwd_t<T, false, false>(gy, x, scale, w, rstd, gx, gsh, gsx, N, D, b, n0, nrows);
    return rmsnorm_bwd_t<T, false, true>(gy, x, scale, w, rstd, gx, gsh, gsx, N, D, b, n0, nrows);
  }
  if (w == nullptr) return rmsnorm_bwd_t<T, true, false>(gy, x, scale, w, rstd, gx, gsh, gsx, N, D, b, n0, nrows);
  return rmsnorm_bwd_t<T, true, true>(gy, x, scale, w, rstd, gx, gsh, gsx, N, D, b, n0, nrows);
}

void rmsnorm_bwd_entry(int dt, const void* gy, const void* x, const float* scale, const float* w, const float* rstd,
                       void* gx, float* gsh, float* gsx, int64_t N, int64_t D, int64_t b, int64_t n0,
                       int64_t nrows) {
  if (dt == dcf::cpu::kF32) return rmsnorm_bwd_typed<F32>(gy, x, scale, w, rstd, gx, gsh, gsx, N, D, b, n0, nrows);
  if (dt == dcf::cpu::kBF16) return rmsnorm_bwd_typed<BF16>(gy, x, scale, w, rstd, gx, gsh, gsx, N, D, b, n0, nrows);
  return rmsnorm_bwd_typed<F16>(gy, x, scale, w, rstd, gx, gsh, gsx, N, D, b, n0, nrows);
}

// ---- QK-norm + 2-D RoPE ----------------------------------------------------------------------------------
// A row is one head's Dh channels of one token, processed in vectors of kGeluLanes channels (the instruction set's
// width; the tail padded with zeros). Forward: xn = x * rstd * w (rstd over the row), then each pair (xn_{2m},
// xn_{2m+1}) turns by the token's angle m: out = xn * ce + swap(xn) * se with the tables expanded to one entry per
// channel (ce = cos_m at 2m and 2m + 1, se = -sin_m at 2m and +sin_m at 2m + 1) and swap exchanging the channels
// of each pair (a vector shuffle). Backward: gr = g * ce - swap(g) * se (the rotation's transpose), then the
// RMSNorm backward of gr with rstd recomputed from the row. Without a weight there is no norm, without tables no
// rotation, without either (v of the packed projection) the row is copied.

// Calls fn(r, b, h, n) for the rows r in [r0, r0 + nrows) of (B, H, N) in order, its indices counted up (a
// division per row would cost as much as a short row's arithmetic).
template <class Fn>
DC_INLINE void for_rows(const dcf::cpu::RowLayout& l, int64_t r0, int64_t nrows, Fn&& fn) {
  int64_t b = r0 / (l.H * l.N), h = (r0 / l.N) % l.H, n = r0 % l.N;
  for (int64_t r = r0; r < r0 + nrows; ++r) {
    fn(r, b, h, n);
    if (++n == l.N) {
      n = 0;
      if (++h == l.H) h = 0, ++b;
    }
  }
}

// m <= kGeluLanes elements as a vector (the rest zero), and back.
template <class T>
DC_INLINE vgf load_lanes(const typename T::storage* __restrict p, int64_t m) {
  float a[kGeluLanes] = {};
  for (int64_t l = 0; l < m; ++l) a[l] = T::load(p[l]);
  vgf v;
  std::memcpy(&v, a, sizeof v);
  return v;
}

template <class T>
DC_INLINE void store_lanes(typename T::storage* __restrict p, vgf v, int64_t m) {
  float a[kGeluLanes];
  std::memcpy(a, &v, sizeof a);
  for (int64_t l = 0; l < m; ++l) p[l] = T::store(a[l]);
}

// The channels of each pair exchanged: (v1, v0, v3, v2, ...).
DC_INLINE vgf swap_pairs(vgf v) {
#if defined(DC_KERNELS_AVX512)
  const vgi mask = {1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14};
#elif defined(DC_KERNELS_AVX2)
  const vgi mask = {1, 0, 3, 2, 5, 4, 7, 6};
#else
  const vgi mask = {1, 0, 3, 2};
#endif
  return __builtin_shuffle(v, mask);
}

// a[0] = the sum of a[0 .. 2W), halves added lane-wise (a fixed order for an instruction set).
template <int W>
DC_INLINE void fold_halves(float* __restrict a) {
  for (int l = 0; l < W; ++l) a[l] += a[l + W];
  if constexpr (W > 1) fold_halves<W / 2>(a);
}

// The sum of the lanes of v.
DC_INLINE float sum_lanes(vgf v) {
  float a[kGeluLanes];
  std::memcpy(a, &v, sizeof a);
  fold_halves<kGeluLanes / 2>(a);
  return a[0];
}

// Calls fn(d, m) for the vectors [d, d + m) of a row of D channels: full ones (m = kGeluLanes), then the tail.
template <class Fn>
DC_INLINE void for_lanes(int64_t D, Fn&& fn) {
  int64_t d = 0;
  for (; d + kGeluLanes <= D; d += kGeluLanes) fn(d, static_cast<int64_t>(kGeluLanes));
  if (d < D) fn(d, D - d);
}

template <class T, bool kNorm, bool kRope>
void qk_rope_fwd_t(const void* x_, const dcf::cpu::RowLayout& xl, const float* w_, const float* ce_,
                   const float* se_, int64_t tab_b, void* out_, const dcf::cpu::RowLayout& ol, float eps, int64_t r0,
                   int64_t nrows) {
  using S = typename T::storage;
  const S* x = static_cast<const S*>(x_);
  S* out = static_cast<S*>(out_);
  const int64_t Dh = xl.Dh;
  const float inv_d = 1.0f / static_cast<float>(Dh);
  for_rows(xl, r0, nrows, [&](int64_t, int64_t b, int64_t h, int64_t n) {
    const S* __restrict xr = x + b * xl.sb + h * xl.sh + n * xl.sn;
    S* __restrict o = out + b * ol.sb + h * ol.sh + n * ol.sn;
    if constexpr (!kNorm && !kRope) {
      for (int64_t d = 0; d < Dh; ++d) o[d] = xr[d];
      return;
    }
    float rs = 1.0f;
    if constexpr (kNorm) {
      vgf ss = {};
      for_lanes(Dh, [&](int64_t d, int64_t m) DC_LAMBDA_INLINE {
        const vgf v = load_lanes<T>(xr + d, m);
        ss += v * v;
      });
      rs = 1.0f / __builtin_sqrtf(sum_lanes(ss) * inv_d + eps);
    }
    const float* ce = kRope ? ce_ + b * tab_b + n * Dh : nullptr;
    const float* se = kRope ? se_ + b * tab_b + n * Dh : nullptr;
    for_lanes(Dh, [&](int64_t d, int64_t m) DC_LAMBDA_INLINE {
      vgf v = load_lanes<T>(xr + d, m);
      if constexpr (kNorm) v *= rs * load_lanes<F32>(w_ + d, m);
      if constexpr (kRope) v = v * load_lanes<F32>(ce + d, m) + swap_pairs(v) * load_lanes<F32>(se + d, m);
      store_lanes<T>(o + d, v, m);  // RoFormer Eq. 34 after the norm
    });
  });
}

template <class T, bool kNorm, bool kRope, bool kWGrad>
void qk_rope_bwd_t(const void* g_, const dcf::cpu::RowLayout& gl, const void* x_, const dcf::cpu::RowLayout& xl,
                   const float* w_, const float* ce_, const float* se_, int64_t tab_b, void* gx_,
                   const dcf::cpu::RowLayout& ol, float* gw_acc, float eps, int64_t r0, int64_t nrows) {
  using S = typename T::storage;
  const S* g = static_cast<const S*>(g_);
  const S* x = static_cast<const S*>(x_);
  S* gx = static_cast<S*>(gx_);
  const int64_t Dh = xl.Dh;
  const float inv_d = 1.0f / static_cast<float>(Dh);
  for_rows(xl, r0, nrows, [&](int64_t, int64_t b, int64_t h, int64_t n) {
    const S* __restrict xr = x + b * xl.sb + h * xl.sh + n * xl.sn;
    const S* __restrict gr = g + b * gl.sb + h * gl.sh + n * gl.sn;
    S* __restrict o = gx + b * ol.sb + h * ol.sh + n * ol.sn;
    const float* ce = kRope ? ce_ + b * tab_b + n * Dh : nullptr;
    const float* se = kRope ? se_ + b * tab_b + n * Dh : nullptr;
    // the gradient of the normed row: grad_out turned back by the rotation (its transpose)
    auto unrot = [&](int64_t d, int64_t m) DC_LAMBDA_INLINE {
      const vgf v = load_lanes<T>(gr + d, m);
      if constexpr (kRope) return v * load_lanes<F32>(ce + d, m) - swap_pairs(v) * load_lanes<F32>(se + d, m);
      return v;
    };
    if constexpr (!kNorm) {
      if constexpr (kRope) {
        for_lanes(Dh, [&](int64_t d, int64_t m) DC_LAMBDA_INLINE { store_lanes<T>(o + d, unrot(d, m), m); });
      } else {
        for (int64_t d = 0; d < Dh; ++d) o[d] = gr[d];
      }
      return;
    }
    vgf ss = {}, dot = {};  // sum x^2 and sum gr * w * x
    for_lanes(Dh, [&](int64_t d, int64_t m) DC_LAMBDA_INLINE {
      const vgf v = load_lanes<T>(xr + d, m);
      ss += v * v;
      dot += unrot(d, m) * load_lanes<F32>(w_ + d, m) * v;
    });
    const float rs = 1.0f / __builtin_sqrtf(sum_lanes(ss) * inv_d + eps);
    const float m2 = sum_lanes(dot) * rs * inv_d;  // mean_d(gh * xhat), gh = gr * w
    for_lanes(Dh, [&](int64_t d, int64_t m) DC_LAMBDA_INLINE {
      const vgf grv = unrot(d, m);
      const vgf xh = load_lanes<T>(xr + d, m) * rs;
      store_lanes<T>(o + d, rs * (grv * load_lanes<F32>(w_ + d, m) - xh * m2), m);
      if constexpr (kWGrad) {  // the weight gradient's sum over rows: one vector add (the tail lane by lane)
        const vgf add = grv * xh;
        if (m == kGeluLanes) {
          vgf acc;
          std::memcpy(&acc, gw_acc + d, sizeof acc);
          acc += add;
          std::memcpy(gw_acc + d, &acc, sizeof acc);
        } else {
          float a[kGeluLanes];
          std::memcpy(a, &add, sizeof a);
          for (int64_t l = 0; l < m; ++l) gw_acc[d + l] += a[l];
        }
      }
    });
  });
}

template <class T>
void qk_rope_fwd_typed(const void* x, const dcf::cpu::RowLayout& xl, const float* w, const float* c, const float* s,
                       int64_t tab_b, void* out, const dcf::cpu::RowLayout& ol, float eps, int64_t r0, int64_t nrows) {
  if (w == nullptr && c == nullptr) return qk_rope_fwd_t<T, false, false>(x, xl, w, c, s, tab_b, out, ol, eps, r0, nrows);
  if (w == nullptr) return qk_rope_fwd_t<T, false, true>(x, xl, w, c, s, tab_b, out, ol, eps, r0, nrows);
  if (c == nullptr) return qk_rope_fwd_t<T, true, false>(x, xl, w, c, s, tab_b, out, ol, eps, r0, nrows);
  return qk_rope_fwd_t<T, true, true>(x, xl, w, c, s, tab_b, out, ol, eps, r0, nrows);
}

void qk_rope_fwd_entry(int dt, const void* x, const dcf::cpu::RowLayout& xl, const float* w, const float* c,
                       const float* s, int64_t tab_b, void* out, const dcf::cpu::RowLayout& ol, float eps, int64_t r0,
                       int64_t nrows) {
  if (dt == dcf::cpu::kF32) return qk_rope_fwd_typed<F32>(x, xl, w, c, s, tab_b, out, ol, eps, r0, nrows);
  if (dt == dcf::cpu::kBF16) return qk_rope_fwd_typed<BF16>(x, xl, w, c, s, tab_b, out, ol, eps, r0, nrows);
  return qk_rope_fwd_typed<F16>(x, xl, w, c, s, tab_b, out, ol, eps, r0, nrows);
}

template <class T, bool kNorm, bool kRope>
void qk_rope_bwd_wgrad(const void* g, const dcf::cpu::RowLayout& gl, const void* x, const dcf::cpu::RowLayout& xl,
                       const float* w, const float* c, const float* s, int64_t tab_b, void* gx,
                       const dcf::cpu::RowLayout& ol, float* gw, float eps, int64_t r0, int64_t nrows) {
  if (kNorm && gw != nullptr) return qk_rope_bwd_t<T, kNorm, kRope, true>(g, gl, x, xl, w, c, s, tab_b, gx, ol, gw, eps, r0, nrows);
  return qk_rope_bwd_t<T, kNorm, kRope, false>(g, gl, x, xl, w, c, s, tab_b, gx, ol, gw, eps, r0, nrows);
}

template <class T>
void qk_rope_bwd_typed(const void* g, const dcf::cpu::RowLayout& gl, const void* x, const dcf::cpu::RowLayout& xl,
                       const float* w, const float* c, const float* s, int64_t tab_b, void* gx,
                       const dcf::cpu::RowLayout& ol, float* gw, float eps, int64_t r0, int64_t nrows) {
  if (w == nullptr && c == nullptr) return qk_rope_bwd_wgrad<T, false, false>(g, gl, x, xl, w, c, s, tab_b, gx, ol, gw, eps, r0, nrows);
  if (w == nullptr) return qk_rope_bwd_wgrad<T, false, true>(g, gl, x, xl, w, c, s, tab_b, gx, ol, gw, eps, r0, nrows);
  if (c == nullptr) return qk_rope_bwd_wgrad<T, true, false>(g, gl, x, xl, w, c, s, tab_b, gx, ol, gw, eps, r0, nrows);
  return qk_rope_bwd_wgrad<T, true, true>(g, gl, x, xl, w, c, s, tab_b, gx, ol, gw, eps, r0, nrows);
}

void qk_rope_bwd_entry(int dt, const void* g, const dcf::cpu::RowLayout& gl, const void* x,
                       const dcf::cpu::RowLayout& xl, const float* w, const float* c, const float* s, int64_t tab_b,
                       void* gx, const dcf::cpu::RowLayout& ol, float* gw, float eps, int64_t r0, int64_t nrows) {
  if (dt == dcf::cpu::kF32) return qk_rope_bwd_typed<F32>(g, gl, x, xl, w, c, s, tab_b, gx, ol, gw, eps, r0, nrows);
  if (dt == dcf::cpu::kBF16) return qk_rope_bwd_typed<BF16>(g, gl, x, xl, w, c, s, tab_b, gx, ol, gw, eps, r0, nrows);
  return qk_rope_bwd_typed<F16>(g, gl, x, xl, w, c, s, tab_b, gx, ol, gw, eps, r0, nrows);
}

// ---- SwiGLU ------------------------------------------------------------------------------------------------
// y = silu(a) b = a s b with s = sigmoid(a) = 1 / (1 + e^-a) (the exp of the tanh-GELU, exp_lanes); backward
// grad_a = grad_y b s (1 + a (1 - s)), grad_b = grad_y a s. a and b are the two halves of a row of x.
template <class T, bool kGrad>
DC_INLINE void swiglu_block(const typename T::storage* __restrict g, const typename T::storage* __restrict a,
                            const typename T::storage* __restrict bp, typename T::storage* __restrict out_a,
                            typename T::storage* __restrict out_b, int64_t m) {
  float as[kGeluLanes] = {}, bs[kGeluLanes] = {}, gs[kGeluLanes] = {}, ra[kGeluLanes], rb[kGeluLanes];
  for (int64_t l = 0; l < m; ++l) as[l] = T::load(a[l]);
  for (int64_t l = 0; l < m; ++l) bs[l] = T::load(bp[l]);
  if constexpr (kGrad) {
    for (int64_t l = 0; l < m; ++l) gs[l] = T::load(g[l]);
  }
  vgf va, vb, vg;
  std::memcpy(&va, as, sizeof va);
  std::memcpy(&vb, bs, sizeof vb);
  std::memcpy(&vg, gs, sizeof vg);
  const vgf s = 1.0f / (1.0f + exp_lanes(-va));
  if constexpr (kGrad) {
    const vgf ga = vg * vb * s * (1.0f + va * (1.0f - s));
    const vgf gb = vg * va * s;
    std::memcpy(ra, &ga, sizeof ra);
    std::memcpy(rb, &gb, sizeof rb);
    for (int64_t l = 0; l < m; ++l) out_a[l] = T::store(ra[l]);
    for (int64_t l = 0; l < m; ++l) out_b[l] = T::store(rb[l]);
  } else {
    const vgf y = va * s * vb;
    std::memcpy(ra, &y, sizeof ra);
    for (int64_t l = 0; l < m; ++l) out_a[l] = T::store(ra[l]);
  }
}

template <class T, bool kGrad>
void swiglu_t(const void* g_, const void* x_, void* out_, int64_t H, int64_t r0, int64_t nrows) {
  using S = typename T::storage;
  const S* x = static_cast<const S*>(x_);
  const S* g = static_cast<const S*>(g_);
  S* out = static_cast<S*>(out_);
  for (int64_t r = r0; r < r0 + nrows; ++r) {
    const S* a = x + r * 2 * H;
    const S* gr = kGrad ? g + r * H : nullptr;
    S* oa = kGrad ? out + r * 2 * H : out + r * H;  // grad_x (R, 2H) or y (R, H)
    S* ob = kGrad ? oa + H : nullptr;
    auto block = [&](int64_t k, int64_t m) DC_LAMBDA_INLINE {
      swiglu_block<T, kGrad>(kGrad ? gr + k : nullptr, a + k, a + H + k, oa + k, kGrad ? ob + k : nullptr, m);
    };
    if (H < kGeluLanes) {
      block(0, H);  // a short row: one padded vector
      continue;
    }
    int64_t k = 0;
    for (; k + kGeluLanes <= H; k += kGeluLanes) block(k, kGeluLanes);
    // the tail as the row's last full vector, overlapping the one before it: its elements are computed again, to
    // the same values (an elementwise function), instead of a padded vector through memory
    if (k < H) block(H - kGeluLanes, kGeluLanes);
  }
}

void swiglu_fwd_entry(int dt, const void* x, void* y, int64_t H, int64_t r0, int64_t nrows) {
  if (dt == dcf::cpu::kF32) return swiglu_t<F32, false>(nullptr, x, y, H, r0, nrows);
  if (dt == dcf::cpu::kBF16) return swiglu_t<BF16, false>(nullptr, x, y, H, r0, nrows);
  return swiglu_t<F16, false>(nullptr, x, y, H, r0, nrows);
}

void swiglu_bwd_entry(int dt, const void* gy, const void* x, void* gx, int64_t H, int64_t r0, int64_t nrows) {
  if (dt == dcf::cpu::kF32) return swiglu_t<F32, true>(gy, x, gx, H, r0, nrows);
  if (dt == dcf::cpu::kBF16) return swiglu_t<BF16, true>(gy, x, gx, H, r0, nrows);
  return swiglu_t<F16, true>(gy, x, gx, H, r0, nrows);
}

// ---- token routing: row copies --------------------------------------------------------------------------
// A row is n bytes (D elements of 2 or 4 bytes); rows never overlap. The copies move 64-byte blocks through
// generic vectors, which gcc lowers to the instruction set's widest loads and stores (one zmm, two ymm or four
// xmm), then the tail of fewer than 64 bytes.
// gcc would turn these loops into calls of memmove (-ftree-loop-distribute-patterns); a call per row of 1.5 KB
// costs more than the copy's inline vector moves, so the pattern is off for this section.
#pragma GCC push_options
#pragma GCC optimize("no-tree-loop-distribute-patterns")
typedef uint8_t v64u8 __attribute__((vector_size(64)));

DC_INLINE void copy_row(const uint8_t* __restrict s, uint8_t* __restrict d, int64_t n) {
  int64_t i = 0;
  for (; i + 64 <= n; i += 64) {
    v64u8 v;
    __builtin_memcpy(&v, s + i, 64);
    __builtin_memcpy(d + i, &v, 64);
  }
  for (; i < n; ++i) d[i] = s[i];
}

DC_INLINE void zero_row(uint8_t* __restrict d, int64_t n) {
  const v64u8 z = {};
  int64_t i = 0;
  for (; i + 64 <= n; i += 64) __builtin_memcpy(d + i, &z, 64);
  for (; i < n; ++i) d[i] = 0;
}

inline int64_t elem_bytes(int dt) { return dt == dcf::cpu::kF32 ? 4 : 2; }

void token_gather_entry(int dt, const void* x_, const int64_t* idx, void* out_, int64_t T, int64_t K, int64_t D,
                        int64_t r0, int64_t nrows) {
  const int64_t n = D * elem_bytes(dt);
  const auto* x = static_cast<const uint8_t*>(x_);
  auto* out = static_cast<uint8_t*>(out_);
  for (int64_t r = r0; r < r0 + nrows; ++r) {
    const int64_t b = r / K;
    copy_row(x + (b * T + idx[r]) * n, out + r * n, n);  // out[b, k] = x[b, idx[b, k]]
  }
}

void token_scatter_entry(int dt, const void* base_, const int32_t* pos, const void* src_, void* out_, int64_t T,
                         int64_t K, int64_t D, int64_t r0, int64_t nrows) {
  const int64_t n = D * elem_bytes(dt);
  const auto* base = static_cast<const uint8_t*>(base_);
  const auto* src = static_cast<const uint8_t*>(src_);
  auto* out = static_cast<uint8_t*>(out_);
  for (int64_t r = r0; r < r0 + nrows; ++r) {
    const int32_t k = pos[r];
    if (k >= 0) {
      copy_row(src + ((r / T) * K + k) * n, out + r * n, n);  // a kept token: its row of src
    } else if (base != nullptr) {
      copy_row(base + r * n, out + r * n, n);  // a token not kept: its value before the route
    } else {
      zero_row(out + r * n, n);
    }
  }
}

void token_scatter_bwd_entry(int dt, const void* go_, const int32_t* pos, void* gbase_, void* gsrc_, int64_t T,
                             int64_t K, int64_t D, int64_t r0, int64_t nrows) {
  const int64_t n = D * elem_bytes(dt);
  const auto* go = static_cast<const uint8_t*>(go_);
  auto* gbase = static_cast<uint8_t*>(gbase_);
  auto* gsrc = static_cast<uint8_t*>(gsrc_);
  for (int64_t r = r0; r < r0 + nrows; ++r) {
    const int32_t k = pos[r];
    if (k >= 0) {
      copy_row(go + r * n, gsrc + ((r / T) * K + k) * n, n);  // grad_src[b, k] = grad_out[b, idx[b, k]]
      zero_row(gbase + r * n, n);
    } else {
      copy_row(go + r * n, gbase + r * n, n);
    }
  }
}

#pragma GCC pop_options

}  // namespace

#define DC_DEFINE_KERNEL_TABLE(NAME, ISA_STRING)                                                          \
  extern const ::dcf::cpu::KernelTable NAME;                                                              \
  const ::dcf::cpu::KernelTable NAME = {                                                                  \
      ISA_STRING,        &randn_impl,        &q_sample_entry,    &loss_entry,          &adaln_fwd_entry,   \
      &adaln_bwd_entry,  &gated_fwd_entry,   &gated_bwd_entry,   &gelu_fwd_entry,      &gelu_bwd_entry,    \
      &rmsnorm_fwd_entry, &rmsnorm_bwd_entry, &qk_rope_fwd_entry, &qk_rope_bwd_entry,   &swiglu_fwd_entry,  \
      &swiglu_bwd_entry, &token_gather_entry, &token_scatter_entry, &token_scatter_bwd_entry};
