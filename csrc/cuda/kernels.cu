// CUDA kernels of diffcurr_fast (definitions: docs/ops.md). Raw pointers only (no torch headers) for a short
// compile; launched by csrc/ops_cuda.cpp on the current stream. Noise is regenerated in-kernel with Philox
// (csrc/dc_math.h), per-sample and per-row reductions use warp shuffles and finish in a fixed order
// (deterministic), and nothing here synchronises with the host.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <initializer_list>

#include "cuda/launch.h"
#include "dc_math.h"

namespace dcf::cuda {
namespace {

constexpr int kThreads = 256;
constexpr int kWarp = 32;
constexpr int kLossElemsPerBlock = kThreads * 16;  // elements of one row handled by one loss block

struct CF32 {
  using S = float;
  static __device__ __forceinline__ float load(S v) { return v; }
  static __device__ __forceinline__ S store(float v) { return v; }
};
struct CBF16 {
  using S = uint16_t;
  static __device__ __forceinline__ float load(S v) { return __bfloat162float(__ushort_as_bfloat16(v)); }
  static __device__ __forceinline__ S store(float v) { return __bfloat16_as_ushort(__float2bfloat16_rn(v)); }
};
struct CF16 {
  using S = uint16_t;
  static __device__ __forceinline__ float load(S v) { return __half2float(__ushort_as_half(v)); }
  static __device__ __forceinline__ S store(float v) { return __half_as_ushort(__float2half_rn(v)); }
};

// Four consecutive elements starting at a multiple of 4 (one 16-byte load for float, 8 bytes for 16-bit types).
template <class T>
__device__ __forceinline__ void load4(const typename T::S* p, float v[4]) {
  if constexpr (sizeof(typename T::S) == 4) {
    const float4 q = *reinterpret_cast<const float4*>(p);
    v[0] = q.x, v[1] = q.y, v[2] = q.z, v[3] = q.w;
  } else {
    const ushort4 q = *reinterpret_cast<const ushort4*>(p);
    v[0] = T::load(q.x), v[1] = T::load(q.y), v[2] = T::load(q.z), v[3] = T::load(q.w);
  }
}

template <class T>
__device__ __forceinline__ void store4(typename T::S* p, const float v[4]) {
  if constexpr (sizeof(typename T::S) == 4) {
    *reinterpret_cast<float4*>(p) = make_float4(v[0], v[1], v[2], v[3]);
  } else {
    *reinterpret_cast<ushort4*>(p) = make_ushort4(T::store(v[0]), T::store(v[1]), T::store(v[2]), T::store(v[3]));
  }
}

// V consecutive elements in one 16-byte access: V = 4 for float, 8 for 16-bit types (V = 1: scalar).
template <class T>
constexpr int kVec = 16 / static_cast<int>(sizeof(typename T::S));

template <class T, int V>
__device__ __forceinline__ void loadv(const typename T::S* p, float v[V]) {
  if constexpr (V == 1) {
    v[0] = T::load(*p);
  } else if constexpr (sizeof(typename T::S) == 4) {
    static_assert(V == 4, "float vectors hold 4");
    const float4 q = *reinterpret_cast<const float4*>(p);
    v[0] = q.x, v[1] = q.y, v[2] = q.z, v[3] = q.w;
  } else {
    static_assert(V == 8, "16-bit vectors hold 8");
    union {
      uint4 u;
      typename T::S h[8];
    } q;
    q.u = *reinterpret_cast<const uint4*>(p);
#pragma unroll
    for (int k = 0; k < 8; ++k) v[k] = T::load(q.h[k]);
  }
}

template <class T, int V>
__device__ __forceinline__ void storev(typename T::S* p, const float v[V]) {
  if constexpr (V == 1) {
    *p = T::store(v[0]);
  } else if constexpr (sizeof(typename T::S) == 4) {
    *reinterpret_cast<float4*>(p) = make_float4(v[0], v[1], v[2], v[3]);
  } else {
    union {
      uint4 u;
      typename T::S h[8];
    } q;
#pragma unroll
    for (int k = 0; k < 8; ++k) q.h[k] = T::store(v[k]);
    *reinterpret_cast<uint4*>(p) = q.u;
  }
}

// V float32 values (the per-sample shift / scale / gate rows), as float4 loads when V >= 4.
template <int V>
__device__ __forceinline__ void loadf(const float* p, float v[V]) {
  if constexpr (V == 1) {
    v[0] = *p;
  } else {
#pragma unroll
    for (int k = 0; k < V; k += 4) {
      const float4 q = *reinterpret_cast<const float4*>(p + k);
      v[k] = q.x, v[k + 1] = q.y, v[k + 2] = q.z, v[k + 3] = q.w;
    }
  }
}

__host__ __device__ __forceinline__ bool aligned(const void* p, int bytes) {
  return (reinterpret_cast<uintptr_t>(p) % static_cast<uintptr_t>(bytes)) == 0;
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = kWarp / 2; o > 0; o /= 2) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

// Sum over the block (blockDim.x a multiple of 32, <= 1024); the result is valid in thread 0.
__device__ __forceinline__ float block_sum(float v) {
  __shared__ float partial[32];
  const int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp;
  v = warp_sum(v);
  if (lane == 0) partial[warp] = v;
  __syncthreads();
  const int nwarps = blockDim.x / kWarp;
  v = (threadIdx.x < nwarps) ? partial[threadIdx.x] : 0.0f;
  if (warp == 0) v = warp_sum(v);
  return v;
}

int64_t blocks_for(int64_t work, int64_t per_block) {
  int64_t blocks = (work + per_block - 1) / per_block;
  if (blocks < 1) blocks = 1;
  if (blocks > 65536) blocks = 65536;  // grid-stride loops cover the rest
  return blocks;
}

int finish() { return static_cast<int>(cudaGetLastError()); }

// ---------------------------------------------------------------- randn
__global__ void randn_kernel(uint64_t seed, int64_t n, float* __restrict__ out) {
  const int64_t ncounters = (n + 3) / 4;
  const bool vec = aligned(out, 16);
  for (int64_t c = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; c < ncounters;
       c += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    float v[4];
    normal4(seed, static_cast<uint64_t>(c), v);
    const int64_t i = 4 * c;
    if (vec && i + 4 <= n) {
      *reinterpret_cast<float4*>(out + i) = make_float4(v[0], v[1], v[2], v[3]);
    } else {
      for (int k = 0; k < 4 && i + k < n; ++k) out[i + k] = v[k];
    }
  }
}

// ---------------------------------------------------------------- q_sample
// One thread per Philox counter: flat elements 4c .. 4c + 3 (they may straddle rows when M % 4 != 0). The row of
// element i is kept as (b, r = i - b M) and advanced by the grid stride's own quotient and remainder: two 64-bit
// divisions per thread instead of one per counter (a 64-bit division is a software routine of ~70 instructions).
template <class T, class NT, bool kHasNoise>
__global__ void q_sample_kernel(const typename T::S* __restrict__ x0, const typename NT::S* __restrict__ noise,
                                const float* __restrict__ a, const float* __restrict__ c,
                                typename T::S* __restrict__ out, int64_t M, int64_t total, uint64_t seed) {
  const int64_t ncounters = (total + 3) / 4;
  const bool vec = (M % 4 == 0) && aligned(x0, 4 * sizeof(typename T::S)) && aligned(out, 4 * sizeof(typename T::S)) &&
                   (!kHasNoise || aligned(noise, 4 * sizeof(typename NT::S)));
  const int64_t first = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int64_t step_b = 4 * stride / M, step_r = 4 * stride - step_b * M;  // the stride in elements: (rows, rest)
  int64_t b = 4 * first / M, r = 4 * first - b * M;                          // element i = b M + r, 0 <= r < M
  for (int64_t ctr = first; ctr < ncounters; ctr += stride) {
    const int64_t i = 4 * ctr;
    float nz[4];
    if constexpr (!kHasNoise) normal4(seed, static_cast<uint64_t>(ctr), nz);
    if (vec && i + 4 <= total) {  // the 4 elements share row b
      float xv[4], o[4];
      load4<T>(x0 + i, xv);
      if constexpr (kHasNoise) load4<NT>(noise + i, nz);
      const float av = a[b], cv = c[b];
#pragma unroll
      for (int k = 0; k < 4; ++k) o[k] = av * xv[k] + cv * nz[k];  // Ho et al. Eq. 4
      store4<T>(out + i, o);
    } else {
      int64_t bk = b, rk = r;
      for (int k = 0; k < 4 && i + k < total; ++k, ++rk) {
        while (rk >= M) rk -= M, ++bk;  // at most 3 rows on: M >= 1 and k < 4
        const float nk = kHasNoise ? NT::load(noise[i + k]) : nz[k];
        out[i + k] = T::store(a[bk] * T::load(x0[i + k]) + c[bk] * nk);
      }
    }
    b += step_b, r += step_r;
    if (r >= M) r -= M, ++b;
  }
}

// ---------------------------------------------------------------- diffusion loss
// Block (b, part) covers the Philox counters of row b's columns [part * E, (part + 1) * E), E =
// kLossElemsPerBlock; each thread handles whole counters (4 elements), keeping those inside the row. Row b of
// pred starts at b * pred_stride (pred_stride >= M: a view of the first channels of a wider output).
template <class T, class NT, bool kHasNoise, bool kGrad>
__global__ void loss_kernel(const typename T::S* __restrict__ pred, int64_t pred_stride,
                            const typename T::S* __restrict__ x0, const typename NT::S* __restrict__ noise,
                            const float* __restrict__ p, const float* __restrict__ q, const float* __restrict__ w,
                            typename T::S* __restrict__ grad, float* __restrict__ partial, int64_t M, int64_t parts,
                            uint64_t seed, float grad_scale) {
  const int64_t b = blockIdx.x / parts;
  const int64_t part = blockIdx.x % parts;
  const int64_t row0 = b * M;
  pred += b * (pred_stride - M);  // pred[row0 + j] is element j of row b
  const int64_t j_begin = part * kLossElemsPerBlock;
  const int64_t j_end = (j_begin + kLossElemsPerBlock < M) ? j_begin + kLossElemsPerBlock : M;
  const int64_t lo = row0 + j_begin, hi = row0 + j_end;  // flat element range of this block
  const float pv = p[b], qv = q[b];
  const float sc = w[b] * (2.0f / static_cast<float>(M)) * grad_scale;
  const bool read_x0 = pv != 0.0f;  // the eps target never reads x0 (uniform per block)
  const bool vec = aligned(pred, 16) && aligned(x0, 16) && (!kGrad || aligned(grad, 16)) &&
                   (!kHasNoise || aligned(noise, 16));
  float acc = 0.0f;
  for (int64_t ctr = lo / 4 + threadIdx.x; 4 * ctr < hi; ctr += blockDim.x) {
    const int64_t i = 4 * ctr;
    float nz[4];
    if constexpr (!kHasNoise) normal4(seed, static_cast<uint64_t>(ctr), nz);
    if (vec && i >= lo && i + 4 <= hi) {
      float pr[4], xv[4], g[4];
      load4<T>(pred + i, pr);
      if (read_x0) {
        load4<T>(x0 + i, xv);
      } else {
        xv[0] = xv[1] = xv[2] = xv[3] = 0.0f;
      }
      if constexpr (kHasNoise) load4<NT>(noise + i, nz);
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        const float d = pr[k] - (pv * xv[k] + qv * nz[k]);
        acc += d * d;
        g[k] = sc * d;
      }
      if constexpr (kGrad) store4<T>(grad + i, g);
    } else {
      for (int k = 0; k < 4; ++k) {
        const int64_t e = i + k;
        if (e < lo || e >= hi) continue;
        const float nk = kHasNoise ? NT::load(noise[e]) : nz[k];
        const float xk = read_x0 ? T::load(x0[e]) : 0.0f;
        const float d = T::load(pred[e]) - (pv * xk + qv * nk);
        acc += d * d;
        if constexpr (kGrad) grad[e] = T::store(sc * d);
      }
    }
  }
  acc = block_sum(acc);
  if (threadIdx.x == 0) partial[blockIdx.x] = acc;
}

// loss[b] = w[b] * (1/M) * sum_j (pred - tgt)^2, summing the parts of row b in a fixed order.
__global__ void loss_finish_kernel(const float* __restrict__ partial, const float* __restrict__ w,
                                   float* __restrict__ loss, int64_t B, int64_t M, int64_t parts) {
  const int64_t b = blockIdx.x;
  if (b >= B) return;
  float acc = 0.0f;
  for (int64_t k = threadIdx.x; k < parts; k += blockDim.x) acc += partial[b * parts + k];
  acc = block_sum(acc);
  if (threadIdx.x == 0) loss[b] = w[b] * (acc / static_cast<float>(M));
}

// ---------------------------------------------------------------- sample_timesteps
// One block: inclusive scan of the weights in float64 (thread-contiguous chunks + a block scan of chunk sums).
template <class W>
__global__ void cdf_kernel(const W* __restrict__ w, int64_t T, double* __restrict__ cdf) {
  __shared__ double sums[1024];
  const int tid = threadIdx.x, nt = blockDim.x;
  const int64_t chunk = (T + nt - 1) / nt;
  const int64_t k0 = tid * chunk;
  const int64_t k1 = (k0 + chunk < T) ? k0 + chunk : T;
  double s = 0.0;
  for (int64_t k = k0; k < k1; ++k) s += static_cast<double>(w[k]);
  sums[tid] = s;
  __syncthreads();
  // Hillis-Steele inclusive scan of the chunk sums.
  for (int off = 1; off < nt; off *= 2) {
    const double add = tid >= off ? sums[tid - off] : 0.0;
    __syncthreads();
    sums[tid] += add;
    __syncthreads();
  }
  double run = tid > 0 ? sums[tid - 1] : 0.0;
  for (int64_t k = k0; k < k1; ++k) {
    run += static_cast<double>(w[k]);
    cdf[k] = run;  // cdf[k] = sum_{j <= k} w[j]
  }
}

template <class W>
__global__ void sample_kernel(const W* __restrict__ w, int64_t T, const double* __restrict__ cdf,
                              int64_t batch, uint64_t seed, int64_t* __restrict__ t,
                              float* __restrict__ imp) {
  const double total = cdf[T - 1];
  for (int64_t b = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; b < batch;
       b += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    if (!(total > 0.0)) {  // no positive weight
      t[b] = -1;
      imp[b] = __int_as_float(0x7fc00000);
      continue;
    }
    uint32_t r[4];
    philox4x32_10(static_cast<uint32_t>(b), static_cast<uint32_t>(static_cast<uint64_t>(b) >> 32), 0u, 0u,
                  static_cast<uint32_t>(seed), static_cast<uint32_t>(seed >> 32), r);
    const double target = static_cast<double>(uniform01(r[0])) * total;
    // t_b = smallest k with cdf[k] > u_b * cdf[T-1]: lo < T with w[lo] > 0, since u_b <= 1 - 2^-24 (the scan's
    // rounding, about T * 2^-53 of cdf[T-1], is far below that margin)
    int64_t lo = 0, hi = T;
    while (lo < hi) {
      const int64_t mid = (lo + hi) / 2;
      if (cdf[mid] > target) {
        hi = mid;
      } else {
        lo = mid + 1;
      }
    }
    t[b] = lo;
    imp[b] = static_cast<float>((total / static_cast<double>(T)) / static_cast<double>(w[lo]));  // (cdf/T) / w[t]
  }
}

// ---------------------------------------------------------------- adaLN / RMSNorm modulate
// Fast path: one warp per row, the row held in registers (read once), 16-byte vector loads. Lane l holds the
// vectors l, l + 32, ..., l + 32 (K - 1) of the row (V elements each); needs D % V == 0, 16-byte aligned data
// and D <= 32 K V. Rows are a grid-stride loop over B * N (no grid-dimension limit); b = r / N once per row.
// kRms: RMSNorm-modulate instead (no mean: xhat = x * rstd, times the weight w when w != nullptr; mean unused).
template <class T, int V, int K, bool kRms>
__global__ void adaln_fwd_reg_kernel(const typename T::S* __restrict__ x, const float* __restrict__ shift,
                                     const float* __restrict__ scale, const float* __restrict__ w,
                                     typename T::S* __restrict__ y, float* __restrict__ mean,
                                     float* __restrict__ rstd, int64_t rows, int64_t N, int D, float eps) {
  const int lane = threadIdx.x % kWarp;
  const int nv = D / V;
  const int64_t warps = static_cast<int64_t>(gridDim.x) * (blockDim.x / kWarp);
  const float inv_d = 1.0f / static_cast<float>(D);
  for (int64_t r = blockIdx.x * static_cast<int64_t>(blockDim.x / kWarp) + threadIdx.x / kWarp; r < rows;
       r += warps) {
    const int64_t b = r / N;
    const typename T::S* xr = x + r * D;
    float v[K][V];
    float s = 0.0f;
#pragma unroll
    for (int k = 0; k < K; ++k) {
      const int j = lane + k * kWarp;
      if (j < nv) {
        loadv<T, V>(xr + j * V, v[k]);
#pragma unroll
        for (int e = 0; e < V; ++e) s += v[k][e];
      }
    }
    const float mu = kRms ? 0.0f : warp_sum(s) * inv_d;
    float q = 0.0f;
#pragma unroll
    for (int k = 0; k < K; ++k) {
      if (lane + k * kWarp < nv) {
#pragma unroll
        for (int e = 0; e < V; ++e) q += (v[k][e] - mu) * (v[k][e] - mu);
      }
    }
    const float rs = rsqrtf(warp_sum(q) * inv_d + eps);
    typename T::S* yr = y + r * D;
#pragma unroll
    for (int k = 0; k < K; ++k) {
      const int j = lane + k * kWarp;
      if (j < nv) {
        float sh[V], sc[V], o[V];
        loadf<V>(shift + b * D + j * V, sh);
        loadf<V>(scale + b * D + j * V, sc);
        if (kRms && w != nullptr) {
          float wv[V];
          loadf<V>(w + j * V, wv);
#pragma unroll
          for (int e = 0; e < V; ++e) sc[e] = (1.0f + sc[e]) * wv[e] - 1.0f;
        }
#pragma unroll
        for (int e = 0; e < V; ++e) o[e] = (v[k][e] - mu) * rs * (1.0f + sc[e]) + sh[e];  // adaLN-Zero modulate
        storev<T, V>(yr + j * V, o);
      }
    }
    if (lane == 0) {
      if (!kRms) mean[r] = mu;
      rstd[r] = rs;
    }
  }
}

// grad_x of the fast path: the scaled grad_y row in registers; the x row is read twice (the second read hits the
// cache the first one filled), so that a lane holds K V values of the row, not 2 K V (registers, occupancy).
template <class T, int V, int K, bool kRms>
__global__ void adaln_bwd_dx_reg_kernel(const typename T::S* __restrict__ gyp, const typename T::S* __restrict__ x,
                                        const float* __restrict__ scale, const float* __restrict__ w,
                                        const float* __restrict__ mean, const float* __restrict__ rstd,
                                        typename T::S* __restrict__ gx, int64_t rows, int64_t N, int D) {
  const int lane = threadIdx.x % kWarp;
  const int nv = D / V;
  const int64_t warps = static_cast<int64_t>(gridDim.x) * (blockDim.x / kWarp);
  const float inv_d = 1.0f / static_cast<float>(D);
  for (int64_t r = blockIdx.x * static_cast<int64_t>(blockDim.x / kWarp) + threadIdx.x / kWarp; r < rows;
       r += warps) {
    const int64_t b = r / N;
    const float mu = kRms ? 0.0f : mean[r], rs = rstd[r];
    const typename T::S* xr = x + r * D;
    float g[K][V];
    float s1 = 0.0f, s2 = 0.0f;
#pragma unroll
    for (int k = 0; k < K; ++k) {
      const int j = lane + k * kWarp;
      if (j < nv) {
        float sc[V], xv[V];
        loadv<T, V>(gyp + r * D + j * V, g[k]);
        loadv<T, V>(xr + j * V, xv);
        loadf<V>(scale + b * D + j * V, sc);
        if (kRms && w != nullptr) {
          float wv[V];
          loadf<V>(w + j * V, wv);
#pragma unroll
          for (int e = 0; e < V; ++e) sc[e] = (1.0f + sc[e]) * wv[e] - 1.0f;
        }
#pragma unroll
        for (int e = 0; e < V; ++e) {
          g[k][e] *= 1.0f + sc[e];  // gy = grad_y * (1 + scale) (* w)
          s1 += g[k][e];
          s2 += g[k][e] * ((xv[e] - mu) * rs);  // gy * xhat
        }
      }
    }
    const float m1 = kRms ? 0.0f : warp_sum(s1) * inv_d, m2 = warp_sum(s2) * inv_d;
#pragma unroll
    for (int k = 0; k < K; ++k) {
      const int j = lane + k * kWarp;
      if (j < nv) {
        float xv[V], o[V];
        loadv<T, V>(xr + j * V, xv);
#pragma unroll
        for (int e = 0; e < V; ++e) o[e] = rs * (g[k][e] - m1 - ((xv[e] - mu) * rs) * m2);
        storev<T, V>(gx + r * D + j * V, o);
      }
    }
  }
}

// Fallback (D % V != 0, unaligned data, or rows longer than the register path holds): one warp per row of D
// elements, scalar loads, three passes over the row; 8 rows per block.
template <class T, bool kRms>
__global__ void adaln_fwd_kernel(const typename T::S* __restrict__ x, const float* __restrict__ shift,
                                 const float* __restrict__ scale, const float* __restrict__ w,
                                 typename T::S* __restrict__ y, float* __restrict__ mean, float* __restrict__ rstd,
                                 int64_t rows, int64_t N, int64_t D, float eps) {
  const int lane = threadIdx.x % kWarp;
  const int64_t warps = static_cast<int64_t>(gridDim.x) * (blockDim.x / kWarp);
  const float inv_d = 1.0f / static_cast<float>(D);
  for (int64_t r = blockIdx.x * static_cast<int64_t>(blockDim.x / kWarp) + threadIdx.x / kWarp; r < rows;
       r += warps) {
    const int64_t b = r / N;
    const typename T::S* xr = x + r * D;
    float s = 0.0f;
    if (!kRms) {
      for (int64_t d = lane; d < D; d += kWarp) s += T::load(xr[d]);
    }
    const float mu = kRms ? 0.0f : warp_sum(s) * inv_d;
    float v = 0.0f;
    for (int64_t d = lane; d < D; d += kWarp) {
      const float t = T::load(xr[d]) - mu;
      v += t * t;
    }
    const float rs = rsqrtf(warp_sum(v) * inv_d + eps);
    const float* sh = shift + b * D;
    const float* scl = scale + b * D;
    typename T::S* yr = y + r * D;
    for (int64_t d = lane; d < D; d += kWarp) {
      const float m = (kRms && w != nullptr) ? (1.0f + scl[d]) * w[d] : 1.0f + scl[d];
      yr[d] = T::store((T::load(xr[d]) - mu) * rs * m + sh[d]);  // adaLN-Zero modulate
    }
    if (lane == 0) {
      if (!kRms) mean[r] = mu;
      rstd[r] = rs;
    }
  }
}

// grad_x = rstd * (gy - mean_d(gy) - xhat * mean_d(gy * xhat)), gy = grad_y * (1 + scale); warp per row.
template <class T, bool kRms>
__global__ void adaln_bwd_dx_kernel(const typename T::S* __restrict__ gyp, const typename T::S* __restrict__ x,
                                    const float* __restrict__ scale, const float* __restrict__ w,
                                    const float* __restrict__ mean, const float* __restrict__ rstd,
                                    typename T::S* __restrict__ gx, int64_t rows, int64_t N, int64_t D) {
  const int lane = threadIdx.x % kWarp;
  const int64_t warps = static_cast<int64_t>(gridDim.x) * (blockDim.x / kWarp);
  const float inv_d = 1.0f / static_cast<float>(D);
  for (int64_t r = blockIdx.x * static_cast<int64_t>(blockDim.x / kWarp) + threadIdx.x / kWarp; r < rows;
       r += warps) {
    const int64_t b = r / N;
    const typename T::S* xr = x + r * D;
    const typename T::S* gr = gyp + r * D;
    const float* scl = scale + b * D;
    const float mu = kRms ? 0.0f : mean[r], rs = rstd[r];
    auto mul = [&](int64_t d) { return (kRms && w != nullptr) ? (1.0f + scl[d]) * w[d] : 1.0f + scl[d]; };
    float s1 = 0.0f, s2 = 0.0f;
    for (int64_t d = lane; d < D; d += kWarp) {
      const float g = T::load(gr[d]) * mul(d);
      s1 += g;
      s2 += g * ((T::load(xr[d]) - mu) * rs);
    }
    const float m1 = kRms ? 0.0f : warp_sum(s1) * inv_d, m2 = warp_sum(s2) * inv_d;
    typename T::S* gxr = gx + r * D;
    for (int64_t d = lane; d < D; d += kWarp) {
      const float g = T::load(gr[d]) * mul(d);
      const float xh = (T::load(xr[d]) - mu) * rs;
      gxr[d] = T::store(rs * (g - m1 - xh * m2));
    }
  }
}

// Column sums over n for each (b, d): block (32 x 8) per (b, 32 V columns), each lane V consecutive columns with
// one 16-byte load per row (V = 1: scalar loads, for D % V != 0 or unaligned data); with kLayerNorm the second
// output is sum_n g * xhat (grad_scale; xhat = (other - mean) rstd, or other * rstd when mean is null: RMSNorm),
// otherwise sum_n g * other (grad_gate) and only that one is written.
template <class T, int V, bool kLayerNorm>
__global__ void column_sums_kernel(const typename T::S* __restrict__ g, const typename T::S* __restrict__ other,
                                   const float* __restrict__ mean, const float* __restrict__ rstd,
                                   float* __restrict__ out_sum, float* __restrict__ out_prod, int64_t N, int64_t D,
                                   int64_t col_blocks) {
  __shared__ float s_sum[kLayerNorm ? 8 : 1][V][kWarp + 1];  // [warp][element][lane]: no bank conflicts
  __shared__ float s_prod[8][V][kWarp + 1];
  const int64_t b = blockIdx.x / col_blocks;
  const int64_t d0 = ((blockIdx.x % col_blocks) * kWarp + threadIdx.x) * V;  // D % V == 0 when V > 1
  float acc_s[V], acc_p[V];
#pragma unroll
  for (int e = 0; e < V; ++e) acc_s[e] = acc_p[e] = 0.0f;
  if (d0 < D) {
    for (int64_t n = threadIdx.y; n < N; n += blockDim.y) {
      const int64_t r = b * N + n;
      float gv[V], o[V];
      loadv<T, V>(g + r * D + d0, gv);
      loadv<T, V>(other + r * D + d0, o);
      float mu = 0.0f, rs = 1.0f;
      if constexpr (kLayerNorm) mu = mean != nullptr ? mean[r] : 0.0f, rs = rstd[r];  // no mean: RMSNorm
#pragma unroll
      for (int e = 0; e < V; ++e) {
        if constexpr (kLayerNorm) o[e] = (o[e] - mu) * rs;
        acc_s[e] += gv[e];
        acc_p[e] += gv[e] * o[e];
      }
    }
  }
#pragma unroll
  for (int e = 0; e < V; ++e) {
    if constexpr (kLayerNorm) s_sum[threadIdx.y][e][threadIdx.x] = acc_s[e];
    s_prod[threadIdx.y][e][threadIdx.x] = acc_p[e];
  }
  __syncthreads();
  if (threadIdx.y == 0 && d0 < D) {
#pragma unroll
    for (int e = 0; e < V; ++e) {
      float ts = 0.0f, tp = 0.0f;
      for (int k = 0; k < static_cast<int>(blockDim.y); ++k) {
        if constexpr (kLayerNorm) ts += s_sum[k][e][threadIdx.x];
        tp += s_prod[k][e][threadIdx.x];
      }
      if constexpr (kLayerNorm) out_sum[b * D + d0 + e] = ts;  // grad_shift = sum_n grad_y
      out_prod[b * D + d0 + e] = tp;
    }
  }
}

// ---------------------------------------------------------------- gated residual
// Forward: out = x + gate * y. Backward (a = grad_out, y unused): out = grad_y = gate * grad_out.
// One warp per row (grid-stride over B * N rows), V elements per access along the row: b = r / N once per
// row, no division per element. V = kVec<T> (16-byte accesses) when D % V == 0 and the data is aligned.
template <class T, int V, bool kBackward>
__global__ void gated_kernel(const typename T::S* __restrict__ a, const float* __restrict__ gate,
                             const typename T::S* __restrict__ y, typename T::S* __restrict__ out, int64_t rows,
                             int64_t N, int64_t D) {
  const int lane = threadIdx.x % kWarp;
  const int64_t nv = D / V;
  const int64_t warps = static_cast<int64_t>(gridDim.x) * (blockDim.x / kWarp);
  for (int64_t r = blockIdx.x * static_cast<int64_t>(blockDim.x / kWarp) + threadIdx.x / kWarp; r < rows;
       r += warps) {
    const float* gr = gate + (r / N) * D;
    for (int64_t j = lane; j < nv; j += kWarp) {
      const int64_t i = r * D + j * V;
      float av[V], gv[V], o[V];
      loadv<T, V>(a + i, av);
      loadf<V>(gr + j * V, gv);
      if constexpr (kBackward) {
#pragma unroll
        for (int e = 0; e < V; ++e) o[e] = gv[e] * av[e];  // grad_y = gate * grad_out
      } else {
        float yv[V];
        loadv<T, V>(y + i, yv);
#pragma unroll
        for (int e = 0; e < V; ++e) o[e] = av[e] + gv[e] * yv[e];  // out = x + gate * y
      }
      storev<T, V>(out + i, o);
    }
  }
}

template <class T, bool kBackward>
void launch_gated(const typename T::S* a, const float* gate, const typename T::S* y, typename T::S* out, int64_t B,
                  int64_t N, int64_t D, cudaStream_t s) {
  constexpr int V = kVec<T>;
  const int64_t rows = B * N;
  const int64_t blocks = blocks_for(rows, kThreads / kWarp);
  const bool vec = D % V == 0 && aligned(a, 16) && aligned(gate, 16) && aligned(out, 16) &&
                   (kBackward || aligned(y, 16));
  if (vec) {
    gated_kernel<T, V, kBackward><<<blocks, kThreads, 0, s>>>(a, gate, y, out, rows, N, D);
  } else {
    gated_kernel<T, 1, kBackward><<<blocks, kThreads, 0, s>>>(a, gate, y, out, rows, N, D);
  }
}

// Column sums of (g, other) per (b, d) with 16-byte loads when D % V == 0 and both are aligned, else scalar loads.
template <class T, bool kLayerNorm>
void launch_column_sums(const typename T::S* g, const typename T::S* other, const float* mean, const float* rstd,
                        float* out_sum, float* out_prod, int64_t B, int64_t N, int64_t D, cudaStream_t s) {
  constexpr int V = kVec<T>;
  const dim3 block(kWarp, 8);
  if (D % V == 0 && aligned(g, 16) && aligned(other, 16)) {
    const int64_t col_blocks = (D + kWarp * V - 1) / (kWarp * V);
    column_sums_kernel<T, V, kLayerNorm><<<static_cast<unsigned>(B * col_blocks), block, 0, s>>>(
        g, other, mean, rstd, out_sum, out_prod, N, D, col_blocks);
  } else {
    const int64_t col_blocks = (D + kWarp - 1) / kWarp;
    column_sums_kernel<T, 1, kLayerNorm><<<static_cast<unsigned>(B * col_blocks), block, 0, s>>>(
        g, other, mean, rstd, out_sum, out_prod, N, D, col_blocks);
  }
}

// Register-path dispatch of the adaLN kernels: K = vectors per lane, the smallest power of two with K V <= 64
// (at most 64 values of a row per lane: D <= 2048) that holds the row; 0: use the fallback.
template <class T>
int reg_vectors(int64_t D, const void* p0, const void* p1, const void* p2, const void* p3) {
  constexpr int V = kVec<T>;
  if (D % V != 0 || !aligned(p0, 16) || !aligned(p1, 16) || !aligned(p2, 16) || !aligned(p3, 16)) return 0;
  for (int k = 1; k * V <= 64; k *= 2) {
    if (D <= static_cast<int64_t>(kWarp) * k * V) return k;
  }
  return 0;
}

// ---------------------------------------------------------------- QK-norm + 2-D RoPE
// One part (q, k or v) of the packed projection per grid row (blockIdx.y). G lanes per row of Dh channels (G =
// the smallest power of two >= Dh, at most 32: a warp holds 32 / G rows); lane l of a group owns the channels
// l, l + G, ... (coalesced loads along the row), a channel's pair partner is the neighbouring lane (__shfl_xor 1)
// and the row sums are shuffles within the group. Two passes over the row (the second read hits the cache the first
// one filled). The backward's weight gradient is summed per lane in registers (at most kQkLaneChannels channels a
// lane: Dh <= 32 kQkLaneChannels), then per block in a fixed order, then over the blocks by qk_weight_grad_kernel
// (deterministic). Rows are (b, h, n) with the strides of each tensor: the forward reads the packed projection and
// writes the heads layout, the backward the reverse. Without a weight there is no norm; without `rope` no
// rotation; neither: v's copy.
constexpr int kQkLaneChannels = 8;
constexpr int kQkMaxHeadDim = kWarp * kQkLaneChannels;

__device__ __forceinline__ float group_sum(float v, int G) {
  for (int o = G / 2; o > 0; o /= 2) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

template <class T, bool kBackward>
__global__ void qk_norm_rope_kernel(QkCall a, int G) {
  using S = typename T::S;
  __shared__ float s_gw[kThreads * kQkLaneChannels];  // [group][channel] of the block's weight gradient
  // the block's part, selected field by field (an indexed parameter would be copied to local memory)
  const QkPart p = blockIdx.y == 0 ? a.part[0] : (blockIdx.y == 1 ? a.part[1] : a.part[2]);
  const int l = threadIdx.x % G, group = threadIdx.x / G, groups = blockDim.x / G;
  const int64_t Dh = a.Dh, half = Dh / 2, R = a.B * a.H * a.N;
  const int nk = static_cast<int>((Dh + G - 1) / G);
  const float inv_d = 1.0f / static_cast<float>(Dh);
  const auto* src = static_cast<const S*>(p.src);
  const auto* xs = static_cast<const S*>(p.x);
  auto* dst = static_cast<S*>(p.dst);
  const bool norm = p.w != nullptr, rope = p.rope != 0;
  float acc[kQkLaneChannels];
#pragma unroll
  for (int k = 0; k < kQkLaneChannels; ++k) acc[k] = 0.0f;
  // every thread of the block runs every iteration (the shuffles need the whole warp); rows past R read zeros
  for (int64_t r0 = static_cast<int64_t>(blockIdx.x) * groups; r0 < R; r0 += static_cast<int64_t>(gridDim.x) * groups) {
    const int64_t r = r0 + group;
    const bool valid = r < R;
    const int64_t n = r % a.N, h = (r / a.N) % a.H, b = r / (a.N * a.H);
    const S* sr = src + b * p.sb + h * p.sh + n * p.sn;
    S* dr = dst + b * p.db + h * p.dh + n * p.dn;
    const float* c = rope ? a.cos + b * a.tab_b + n * half : nullptr;
    const float* sn = rope ? a.sin + b * a.tab_b + n * half : nullptr;
    // the value of channel d from the rows read: the rotation applied (forward) or its transpose (backward)
    auto turned = [&](int64_t d, bool in, float v) {
      if (!rope) return v;
      const float partner = __shfl_xor_sync(0xffffffffu, v, 1);
      const float cm = in ? c[d / 2] : 0.0f, sm = in ? sn[d / 2] : 0.0f;
      const bool even = d % 2 == 0;
      if (kBackward) return even ? v * cm + partner * sm : v * cm - partner * sm;
      return even ? v * cm - partner * sm : v * cm + partner * sm;
    };
    if (!kBackward) {
      float rs = 1.0f;
      if (norm) {
        float ss = 0.0f;
        for (int k = 0; k < nk; ++k) {
          const int64_t d = l + static_cast<int64_t>(k) * G;
          const float v = valid && d < Dh ? T::load(sr[d]) : 0.0f;
          ss += v * v;
        }
        rs = rsqrtf(group_sum(ss, G) * inv_d + a.eps);
      }
      for (int k = 0; k < nk; ++k) {
        const int64_t d = l + static_cast<int64_t>(k) * G;
        const bool in = valid && d < Dh;
        float v = in ? T::load(sr[d]) : 0.0f;
        if (norm) v *= rs * (d < Dh ? p.w[d] : 0.0f);
        v = turned(d, in, v);  // after the norm: RoFormer Eq. 34
        if (in) dr[d] = T::store(v);
      }
      continue;
    }
    const S* xr = xs + b * p.xb + h * p.xh + n * p.xn;
    float ss = 0.0f, dot = 0.0f;
    for (int k = 0; k < nk; ++k) {
      const int64_t d = l + static_cast<int64_t>(k) * G;
      const bool in = valid && d < Dh;
      const float gr = turned(d, in, in ? T::load(sr[d]) : 0.0f);
      if (!norm) {
        if (in) dr[d] = T::store(gr);
        continue;
      }
      const float v = in ? T::load(xr[d]) : 0.0f;
      ss += v * v;
      dot += gr * (d < Dh ? p.w[d] : 0.0f) * v;
    }
    if (!norm) continue;
    const float rs = rsqrtf(group_sum(ss, G) * inv_d + a.eps);
    const float m2 = group_sum(dot, G) * rs * inv_d;  // mean_d(gh * xhat), gh = gr * w
#pragma unroll
    for (int k = 0; k < kQkLaneChannels; ++k) {
      if (k < nk) {
        const int64_t d = l + static_cast<int64_t>(k) * G;
        const bool in = valid && d < Dh;
        const float gr = turned(d, in, in ? T::load(sr[d]) : 0.0f);
        const float xh = (in ? T::load(xr[d]) : 0.0f) * rs;
        if (in) dr[d] = T::store(rs * (gr * p.w[d] - xh * m2));
        acc[k] += gr * xh;
      }
    }
  }
  if (!kBackward || a.scratch == nullptr || p.w == nullptr || blockIdx.y > 1) return;
  // the block's weight gradient: each (group, channel) slot written by one thread, summed over groups in order
#pragma unroll
  for (int k = 0; k < kQkLaneChannels; ++k) {
    const int64_t d = l + static_cast<int64_t>(k) * G;
    if (k < nk && d < Dh) s_gw[group * Dh + d] = acc[k];
  }
  __syncthreads();
  float* out = a.scratch + (static_cast<int64_t>(blockIdx.y) * gridDim.x + blockIdx.x) * Dh;
  for (int64_t d = threadIdx.x; d < Dh; d += blockDim.x) {
    float t = 0.0f;
    for (int gi = 0; gi < groups; ++gi) t += s_gw[gi * Dh + d];
    out[d] = t;
  }
}

// gw[t, d] = sum over the blocks of partial[t, blk, d] in block order (t: q, k).
__global__ void qk_weight_grad_kernel(const float* __restrict__ partial, float* __restrict__ gwq,
                                      float* __restrict__ gwk, int64_t blocks, int64_t Dh) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < 2 * Dh;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t t = i / Dh, d = i % Dh;
    float acc = 0.0f;
    for (int64_t blk = 0; blk < blocks; ++blk) acc += partial[(t * blocks + blk) * Dh + d];
    (t == 0 ? gwq : gwk)[d] = acc;
  }
}

// ---------------------------------------------------------------- SwiGLU
// One warp per row of x (R, 2H) (grid-stride over rows), V elements per access along the halves a and b: 16-byte
// accesses (V = kVec<T>) when H % V == 0 and the data are aligned, else scalar. Forward y = silu(a) b; backward
// grad_a = grad_y b s (1 + a (1 - s)), grad_b = grad_y a s, s = sigmoid(a).
template <class T, int V, bool kBackward>
__global__ void swiglu_kernel(const typename T::S* __restrict__ x, const typename T::S* __restrict__ gy,
                              typename T::S* __restrict__ out, int64_t rows, int64_t H) {
  const int lane = threadIdx.x % kWarp;
  const int64_t nv = H / V;
  const int64_t warps = static_cast<int64_t>(gridDim.x) * (blockDim.x / kWarp);
  for (int64_t r = blockIdx.x * static_cast<int64_t>(blockDim.x / kWarp) + threadIdx.x / kWarp; r < rows;
       r += warps) {
    for (int64_t j = lane; j < nv; j += kWarp) {
      float av[V], bv[V], o[V];
      loadv<T, V>(x + r * 2 * H + j * V, av);
      loadv<T, V>(x + r * 2 * H + H + j * V, bv);
      if constexpr (kBackward) {
        float gv[V], ob[V];
        loadv<T, V>(gy + r * H + j * V, gv);
#pragma unroll
        for (int e = 0; e < V; ++e) {
          const float s = 1.0f / (1.0f + expf(-av[e]));
          o[e] = gv[e] * bv[e] * s * (1.0f + av[e] * (1.0f - s));
          ob[e] = gv[e] * av[e] * s;
        }
        storev<T, V>(out + r * 2 * H + j * V, o);
        storev<T, V>(out + r * 2 * H + H + j * V, ob);
      } else {
#pragma unroll
        for (int e = 0; e < V; ++e) o[e] = av[e] / (1.0f + expf(-av[e])) * bv[e];  // silu(a) b, Shazeer Eq. 6
        storev<T, V>(out + r * H + j * V, o);
      }
    }
  }
}

// ---------------------------------------------------------------- token routing
// Row copies, one warp per row (grid-stride over rows), in words W: 16 bytes (uint4) when a row's bytes are a
// multiple of 16 and every pointer is 16-byte aligned, else 4 or 2 bytes. No arithmetic, so one instance per word
// size serves every dtype.
__global__ void token_positions_kernel(const int64_t* __restrict__ idx, int32_t* __restrict__ pos, int64_t n,
                                       int64_t T, int64_t K) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t t = idx[i];
    if (t >= 0 && t < T) pos[(i / K) * T + t] = static_cast<int32_t>(i % K);
  }
}

template <class W>
__global__ void token_gather_kernel(const W* __restrict__ x, const int64_t* __restrict__ idx, W* __restrict__ out,
                                    int64_t rows, int64_t T, int64_t K, int64_t rw) {
  const int lane = threadIdx.x % kWarp;
  const int64_t warps = static_cast<int64_t>(gridDim.x) * (blockDim.x / kWarp);
  for (int64_t r = blockIdx.x * static_cast<int64_t>(blockDim.x / kWarp) + threadIdx.x / kWarp; r < rows;
       r += warps) {
    const int64_t t = idx[r];
    const bool valid = t >= 0 && t < T;
    const W* s = x + ((r / K) * T + (valid ? t : 0)) * rw;  // out[b, k] = x[b, idx[b, k]]
    for (int64_t j = lane; j < rw; j += kWarp) out[r * rw + j] = valid ? s[j] : W{};
  }
}

template <class W, bool kBase>
__global__ void token_scatter_kernel(const W* __restrict__ base, const int32_t* __restrict__ pos,
                                     const W* __restrict__ src, W* __restrict__ out, int64_t rows, int64_t T,
                                     int64_t K, int64_t rw) {
  const int lane = threadIdx.x % kWarp;
  const int64_t warps = static_cast<int64_t>(gridDim.x) * (blockDim.x / kWarp);
  for (int64_t r = blockIdx.x * static_cast<int64_t>(blockDim.x / kWarp) + threadIdx.x / kWarp; r < rows;
       r += warps) {
    const int32_t k = pos[r];
    const W* s = k >= 0 ? src + ((r / T) * K + k) * rw : (kBase ? base + r * rw : nullptr);
    for (int64_t j = lane; j < rw; j += kWarp) out[r * rw + j] = s != nullptr ? s[j] : W{};
  }
}

template <class W>
__global__ void token_scatter_bwd_kernel(const W* __restrict__ go, const int32_t* __restrict__ pos,
                                         W* __restrict__ gbase, W* __restrict__ gsrc, int64_t rows, int64_t T,
                                         int64_t K, int64_t rw) {
  const int lane = threadIdx.x % kWarp;
  const int64_t warps = static_cast<int64_t>(gridDim.x) * (blockDim.x / kWarp);
  for (int64_t r = blockIdx.x * static_cast<int64_t>(blockDim.x / kWarp) + threadIdx.x / kWarp; r < rows;
       r += warps) {
    const int32_t k = pos[r];
    W* kept = k >= 0 ? gsrc + ((r / T) * K + k) * rw : nullptr;
    for (int64_t j = lane; j < rw; j += kWarp) {
      const W g = go[r * rw + j];
      gbase[r * rw + j] = kept != nullptr ? W{} : g;  // grad_base: grad_out with the kept rows zeroed
      if (kept != nullptr) kept[j] = g;              // grad_src[b, k] = grad_out[b, idx[b, k]]
    }
  }
}

// fn(W{}, words per row) with the widest word that the rows (row_bytes) and every pointer allow.
template <class Fn>
int with_row_words(int64_t row_bytes, std::initializer_list<const void*> ptrs, Fn&& fn) {
  bool a16 = row_bytes % 16 == 0, a4 = row_bytes % 4 == 0;
  for (const void* p : ptrs) {
    if (p == nullptr) continue;
    a16 = a16 && aligned(p, 16);
    a4 = a4 && aligned(p, 4);
  }
  if (a16) return fn(uint4{}, row_bytes / 16);
  if (a4) return fn(uint32_t{}, row_bytes / 4);
  return fn(uint16_t{}, row_bytes / 2);
}

// ---------------------------------------------------------------- dispatch helpers
template <class Fn>
int with_type(int dt, Fn&& fn) {
  if (dt == 0) return fn(CF32{});
  if (dt == 1) return fn(CBF16{});
  return fn(CF16{});
}

template <class T, class Fn>
int with_noise_type(int dt, int noise_dt, bool has_noise, Fn&& fn) {
  if (!has_noise || noise_dt == 0 || dt == 0) return fn(CF32{});
  return fn(T{});
}

}  // namespace

const char* error_string(int code) { return cudaGetErrorString(static_cast<cudaError_t>(code)); }

int randn(uint64_t seed, int64_t n, float* out, void* stream) {
  if (n == 0) return 0;
  const auto s = static_cast<cudaStream_t>(stream);
  randn_kernel<<<blocks_for((n + 3) / 4, kThreads), kThreads, 0, s>>>(seed, n, out);
  return finish();
}

int q_sample(int dt, const void* x0, int noise_dt, const void* noise, const float* a, const float* c, void* out,
             int64_t B, int64_t M, uint64_t seed, void* stream) {
  const int64_t total = B * M;
  if (total == 0) return 0;
  const auto s = static_cast<cudaStream_t>(stream);
  const int64_t blocks = blocks_for((total + 3) / 4, kThreads);
  return with_type(dt, [&](auto t) {
    using T = decltype(t);
    return with_noise_type<T>(dt, noise_dt, noise != nullptr, [&](auto nt) {
      using NT = decltype(nt);
      const auto* xp = static_cast<const typename T::S*>(x0);
      const auto* np = static_cast<const typename NT::S*>(noise);
      auto* op = static_cast<typename T::S*>(out);
      if (noise != nullptr) {
        q_sample_kernel<T, NT, true><<<blocks, kThreads, 0, s>>>(xp, np, a, c, op, M, total, seed);
      } else {
        q_sample_kernel<T, NT, false><<<blocks, kThreads, 0, s>>>(xp, np, a, c, op, M, total, seed);
      }
      return finish();
    });
  });
}

int64_t loss_scratch_size(int64_t B, int64_t M) {
  const int64_t parts = M > 0 ? (M + kLossElemsPerBlock - 1) / kLossElemsPerBlock : 1;
  return B * parts;
}

int loss_fwd(int dt, const void* pred, int64_t pred_stride, const void* x0, int noise_dt, const void* noise,
             const float* p, const float* q, const float* w, float grad_scale, void* grad, float* loss,
             float* scratch, int64_t B, int64_t M, uint64_t seed, void* stream) {
  if (B == 0) return 0;
  const auto s = static_cast<cudaStream_t>(stream);
  if (M == 0) return static_cast<int>(cudaMemsetAsync(loss, 0, sizeof(float) * B, s));
  const int64_t parts = (M + kLossElemsPerBlock - 1) / kLossElemsPerBlock;
  const int err = with_type(dt, [&](auto t) {
    using T = decltype(t);
    return with_noise_type<T>(dt, noise_dt, noise != nullptr, [&](auto nt) {
      using NT = decltype(nt);
      const auto* pp = static_cast<const typename T::S*>(pred);
      const auto* xp = static_cast<const typename T::S*>(x0);
      const auto* np = static_cast<const typename NT::S*>(noise);
      auto* gp = static_cast<typename T::S*>(grad);
      const auto blocks = static_cast<unsigned>(B * parts);
      const auto launch = [&](auto kernel) {
        kernel<<<blocks, kThreads, 0, s>>>(pp, pred_stride, xp, np, p, q, w, gp, scratch, M, parts, seed, grad_scale);
      };
      if (noise != nullptr && grad != nullptr) {
        launch(loss_kernel<T, NT, true, true>);
      } else if (noise != nullptr) {
        launch(loss_kernel<T, NT, true, false>);
      } else if (grad != nullptr) {
        launch(loss_kernel<T, NT, false, true>);
      } else {
        launch(loss_kernel<T, NT, false, false>);
      }
      return finish();
    });
  });
  if (err != 0) return err;
  loss_finish_kernel<<<static_cast<unsigned>(B), 128, 0, s>>>(scratch, w, loss, B, M, parts);
  return finish();
}

int sample_timesteps(bool w_double, const void* w, int64_t T, double* cdf, int64_t batch,
                     uint64_t seed, int64_t* t, float* imp, void* stream) {
  const auto s = static_cast<cudaStream_t>(stream);
  const int64_t blocks = blocks_for(batch, kThreads);
  if (w_double) {
    cdf_kernel<double><<<1, 1024, 0, s>>>(static_cast<const double*>(w), T, cdf);
    if (batch > 0) {
      sample_kernel<double><<<blocks, kThreads, 0, s>>>(static_cast<const double*>(w), T, cdf, batch,
                                                        seed, t, imp);
    }
  } else {
    cdf_kernel<float><<<1, 1024, 0, s>>>(static_cast<const float*>(w), T, cdf);
    if (batch > 0) {
      sample_kernel<float><<<blocks, kThreads, 0, s>>>(static_cast<const float*>(w), T, cdf, batch,
                                                       seed, t, imp);
    }
  }
  return finish();
}

namespace {

// The adaLN (kRms false) and RMSNorm (kRms true) modulate launches: the register path when the row fits, the
// scalar fallback otherwise.
template <bool kRms>
int norm_fwd(int dt, const void* x, const float* shift, const float* scale, const float* w, void* y, float* mean,
             float* rstd, int64_t B, int64_t N, int64_t D, float eps, cudaStream_t s) {
  const int64_t rows = B * N;
  if (rows == 0 || D == 0) return 0;
  const int64_t blocks = blocks_for(rows, kThreads / kWarp);
  return with_type(dt, [&](auto t) {
    using T = decltype(t);
    constexpr int V = kVec<T>;
    const auto* xp = static_cast<const typename T::S*>(x);
    auto* yp = static_cast<typename T::S*>(y);
    const int k = w == nullptr || aligned(w, 16) ? reg_vectors<T>(D, x, y, shift, scale) : 0;
    const int d = static_cast<int>(D);
    if (k == 1) adaln_fwd_reg_kernel<T, V, 1, kRms><<<blocks, kThreads, 0, s>>>(xp, shift, scale, w, yp, mean, rstd, rows, N, d, eps);
    if (k == 2) adaln_fwd_reg_kernel<T, V, 2, kRms><<<blocks, kThreads, 0, s>>>(xp, shift, scale, w, yp, mean, rstd, rows, N, d, eps);
    if (k == 4) adaln_fwd_reg_kernel<T, V, 4, kRms><<<blocks, kThreads, 0, s>>>(xp, shift, scale, w, yp, mean, rstd, rows, N, d, eps);
    if (k == 8) adaln_fwd_reg_kernel<T, V, 8, kRms><<<blocks, kThreads, 0, s>>>(xp, shift, scale, w, yp, mean, rstd, rows, N, d, eps);
    if constexpr (V * 16 <= 64) {
      if (k == 16) adaln_fwd_reg_kernel<T, V, 16, kRms><<<blocks, kThreads, 0, s>>>(xp, shift, scale, w, yp, mean, rstd, rows, N, d, eps);
    }
    if (k == 0) adaln_fwd_kernel<T, kRms><<<blocks, kThreads, 0, s>>>(xp, shift, scale, w, yp, mean, rstd, rows, N, D, eps);
    return finish();
  });
}

template <bool kRms>
int norm_bwd(int dt, const void* grad_y, const void* x, const float* scale, const float* w, const float* mean,
             const float* rstd, void* gx, float* gshift, float* gscale, int64_t B, int64_t N, int64_t D,
             cudaStream_t s) {
  const int64_t rows = B * N;
  if (B == 0 || D == 0) return 0;
  return with_type(dt, [&](auto t) {
    using T = decltype(t);
    const auto* gp = static_cast<const typename T::S*>(grad_y);
    const auto* xp = static_cast<const typename T::S*>(x);
    if (rows > 0) {
      constexpr int V = kVec<T>;
      auto* gxp = static_cast<typename T::S*>(gx);
      const int64_t blocks = blocks_for(rows, kThreads / kWarp);
      const int k = w == nullptr || aligned(w, 16) ? reg_vectors<T>(D, gp, xp, gx, scale) : 0;
      const int d = static_cast<int>(D);
      if (k == 1) adaln_bwd_dx_reg_kernel<T, V, 1, kRms><<<blocks, kThreads, 0, s>>>(gp, xp, scale, w, mean, rstd, gxp, rows, N, d);
      if (k == 2) adaln_bwd_dx_reg_kernel<T, V, 2, kRms><<<blocks, kThreads, 0, s>>>(gp, xp, scale, w, mean, rstd, gxp, rows, N, d);
      if (k == 4) adaln_bwd_dx_reg_kernel<T, V, 4, kRms><<<blocks, kThreads, 0, s>>>(gp, xp, scale, w, mean, rstd, gxp, rows, N, d);
      if (k == 8) adaln_bwd_dx_reg_kernel<T, V, 8, kRms><<<blocks, kThreads, 0, s>>>(gp, xp, scale, w, mean, rstd, gxp, rows, N, d);
      if constexpr (V * 16 <= 64) {
        if (k == 16) adaln_bwd_dx_reg_kernel<T, V, 16, kRms><<<blocks, kThreads, 0, s>>>(gp, xp, scale, w, mean, rstd, gxp, rows, N, d);
      }
      if (k == 0) adaln_bwd_dx_kernel<T, kRms><<<blocks, kThreads, 0, s>>>(gp, xp, scale, w, mean, rstd, gxp, rows, N, D);
    }
    if (gshift != nullptr) launch_column_sums<T, true>(gp, xp, mean, rstd, gshift, gscale, B, N, D, s);
    return finish();
  });
}

// RMSNorm's affine gradients from S = sum_n grad_y * xhat (in gscale on entry): grad_w[d] = sum_b (1 + scale) S
// (b in order) and grad_scale = S * w, one thread per column.
__global__ void rms_affine_kernel(const float* __restrict__ scale, const float* __restrict__ w,
                                  float* __restrict__ gscale, float* __restrict__ gw, int64_t B, int64_t D) {
  for (int64_t d = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; d < D;
       d += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    float acc = 0.0f;
    const float wd = w[d];
    for (int64_t b = 0; b < B; ++b) {
      const float sv = gscale[b * D + d];
      acc += (1.0f + scale[b * D + d]) * sv;
      gscale[b * D + d] = sv * wd;
    }
    gw[d] = acc;
  }
}

}  // namespace

int adaln_fwd(int dt, const void* x, const float* shift, const float* scale, void* y, float* mean, float* rstd,
              int64_t B, int64_t N, int64_t D, float eps, void* stream) {
  return norm_fwd<false>(dt, x, shift, scale, nullptr, y, mean, rstd, B, N, D, eps, static_cast<cudaStream_t>(stream));
}

int adaln_bwd(int dt, const void* grad_y, const void* x, const float* scale, const float* mean, const float* rstd,
              void* gx, float* gshift, float* gscale, int64_t B, int64_t N, int64_t D, void* stream) {
  return norm_bwd<false>(dt, grad_y, x, scale, nullptr, mean, rstd, gx, gshift, gscale, B, N, D,
                         static_cast<cudaStream_t>(stream));
}

int rmsnorm_fwd(int dt, const void* x, const float* shift, const float* scale, const float* w, void* y, float* rstd,
                int64_t B, int64_t N, int64_t D, float eps, void* stream) {
  return norm_fwd<true>(dt, x, shift, scale, w, y, nullptr, rstd, B, N, D, eps, static_cast<cudaStream_t>(stream));
}

int rmsnorm_bwd(int dt, const void* grad_y, const void* x, const float* scale, const float* w, const float* rstd,
                void* gx, float* gshift, float* gscale, float* gw, int64_t B, int64_t N, int64_t D, void* stream) {
  const auto s = static_cast<cudaStream_t>(stream);
  const int err = norm_bwd<true>(dt, grad_y, x, scale, w, nullptr, rstd, gx, gshift, gscale, B, N, D, s);
  if (err != 0 || gshift == nullptr || w == nullptr || B == 0 || D == 0) return err;
  rms_affine_kernel<<<blocks_for(D, kThreads), kThreads, 0, s>>>(scale, w, gscale, gw, B, D);
  return finish();
}

namespace {

int qk_group(int64_t Dh) {
  int G = 1;
  while (G < Dh && G < kWarp) G *= 2;
  return G;
}

}  // namespace

int64_t qk_norm_rope_scratch_size(int64_t B, int64_t H, int64_t N, int64_t Dh) {
  return 2 * blocks_for(B * H * N, kThreads / qk_group(Dh)) * Dh;
}

int qk_norm_rope(const QkCall& c, void* stream) {
  const int64_t R = c.B * c.H * c.N;
  if (R == 0 || c.Dh == 0) return 0;
  if (c.Dh > kQkMaxHeadDim) return static_cast<int>(cudaErrorInvalidValue);
  const auto s = static_cast<cudaStream_t>(stream);
  const int G = qk_group(c.Dh);
  const int64_t blocks = blocks_for(R, kThreads / G);
  const dim3 grid(static_cast<unsigned>(blocks), 3);
  const int err = with_type(c.dt, [&](auto t) {
    using T = decltype(t);
    if (c.backward) {
      qk_norm_rope_kernel<T, true><<<grid, kThreads, 0, s>>>(c, G);
    } else {
      qk_norm_rope_kernel<T, false><<<grid, kThreads, 0, s>>>(c, G);
    }
    return finish();
  });
  if (err != 0 || !c.backward || c.gwq == nullptr) return err;
  qk_weight_grad_kernel<<<blocks_for(2 * c.Dh, kThreads), kThreads, 0, s>>>(c.scratch, c.gwq, c.gwk, blocks, c.Dh);
  return finish();
}

int swiglu(int dt, const void* x, const void* grad_y, void* out, int64_t R, int64_t H, void* stream) {
  if (R * H == 0) return 0;
  const auto s = static_cast<cudaStream_t>(stream);
  const int64_t blocks = blocks_for(R, kThreads / kWarp);
  return with_type(dt, [&](auto t) {
    using T = decltype(t);
    constexpr int V = kVec<T>;
    const auto* xp = static_cast<const typename T::S*>(x);
    const auto* gp = static_cast<const typename T::S*>(grad_y);
    auto* op = static_cast<typename T::S*>(out);
    const bool vec = H % V == 0 && aligned(x, 16) && aligned(out, 16) && (grad_y == nullptr || aligned(grad_y, 16));
    if (grad_y != nullptr) {
      if (vec) swiglu_kernel<T, V, true><<<blocks, kThreads, 0, s>>>(xp, gp, op, R, H);
      else swiglu_kernel<T, 1, true><<<blocks, kThreads, 0, s>>>(xp, gp, op, R, H);
    } else {
      if (vec) swiglu_kernel<T, V, false><<<blocks, kThreads, 0, s>>>(xp, gp, op, R, H);
      else swiglu_kernel<T, 1, false><<<blocks, kThreads, 0, s>>>(xp, gp, op, R, H);
    }
    return finish();
  });
}

int gated_fwd(int dt, const void* x, const float* gate, const void* y, void* out, int64_t B, int64_t N, int64_t D,
              void* stream) {
  const int64_t total = B * N * D;
  if (total == 0) return 0;
  const auto s = static_cast<cudaStream_t>(stream);
  return with_type(dt, [&](auto t) {
    using T = decltype(t);
    launch_gated<T, false>(static_cast<const typename T::S*>(x), gate, static_cast<const typename T::S*>(y),
                           static_cast<typename T::S*>(out), B, N, D, s);
    return finish();
  });
}

int gated_bwd(int dt, const void* grad_out, const float* gate, const void* y, void* gy, float* ggate, int64_t B,
              int64_t N, int64_t D, void* stream) {
  const int64_t total = B * N * D;
  if (B == 0 || D == 0) return 0;
  const auto s = static_cast<cudaStream_t>(stream);
  return with_type(dt, [&](auto t) {
    using T = decltype(t);
    const auto* gp = static_cast<const typename T::S*>(grad_out);
    const auto* yp = static_cast<const typename T::S*>(y);
    if (total > 0) {
      launch_gated<T, true>(gp, gate, nullptr, static_cast<typename T::S*>(gy), B, N, D, s);
    }
    launch_column_sums<T, false>(gp, yp, nullptr, nullptr, nullptr, ggate, B, N, D, s);  // grad_gate = sum_n grad_out * y
    return finish();
  });
}

int token_positions(const int64_t* idx, int32_t* pos, int64_t B, int64_t T, int64_t K, void* stream) {
  const auto s = static_cast<cudaStream_t>(stream);
  if (B * T == 0) return 0;
  const int err = static_cast<int>(cudaMemsetAsync(pos, 0xff, sizeof(int32_t) * B * T, s));  // all -1
  if (err != 0 || B * K == 0) return err;
  token_positions_kernel<<<blocks_for(B * K, kThreads), kThreads, 0, s>>>(idx, pos, B * K, T, K);
  return finish();
}

int token_gather(int elem_bytes, const void* x, const int64_t* idx, void* out, int64_t B, int64_t T, int64_t K,
                 int64_t D, void* stream) {
  const int64_t rows = B * K;
  if (rows == 0 || D == 0) return 0;
  const auto s = static_cast<cudaStream_t>(stream);
  return with_row_words(D * elem_bytes, {x, out}, [&](auto w, int64_t rw) {
    using W = decltype(w);
    token_gather_kernel<W><<<blocks_for(rows, kThreads / kWarp), kThreads, 0, s>>>(
        static_cast<const W*>(x), idx, static_cast<W*>(out), rows, T, K, rw);
    return finish();
  });
}

int token_scatter(int elem_bytes, const void* base, const int32_t* pos, const void* src, void* out, int64_t B,
                  int64_t T, int64_t K, int64_t D, void* stream) {
  const int64_t rows = B * T;
  if (rows == 0 || D == 0) return 0;
  const auto s = static_cast<cudaStream_t>(stream);
  return with_row_words(D * elem_bytes, {base, src, out}, [&](auto w, int64_t rw) {
    using W = decltype(w);
    const auto* bp = static_cast<const W*>(base);
    const auto* sp = static_cast<const W*>(src);
    auto* op = static_cast<W*>(out);
    const int64_t blocks = blocks_for(rows, kThreads / kWarp);
    if (base != nullptr) {
      token_scatter_kernel<W, true><<<blocks, kThreads, 0, s>>>(bp, pos, sp, op, rows, T, K, rw);
    } else {
      token_scatter_kernel<W, false><<<blocks, kThreads, 0, s>>>(bp, pos, sp, op, rows, T, K, rw);
    }
    return finish();
  });
}

int token_scatter_bwd(int elem_bytes, const void* grad_out, const int32_t* pos, void* grad_base, void* grad_src,
                      int64_t B, int64_t T, int64_t K, int64_t D, void* stream) {
  const int64_t rows = B * T;
  if (rows == 0 || D == 0) return 0;
  const auto s = static_cast<cudaStream_t>(stream);
  return with_row_words(D * elem_bytes, {grad_out, grad_base, grad_src}, [&](auto w, int64_t rw) {
    using W = decltype(w);
    token_scatter_bwd_kernel<W><<<blocks_for(rows, kThreads / kWarp), kThreads, 0, s>>>(
        static_cast<const W*>(grad_out), pos, static_cast<W*>(grad_base), static_cast<W*>(grad_src), rows, T, K,
        rw);
    return finish();
  });
}

}  // namespace dcf::cuda
