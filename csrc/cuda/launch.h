// Host launchers of the raw CUDA kernels of diffcurr_fast (csrc/cuda/kernels.cu). Plain C++ with raw pointers
// so that the .cu file needs no torch headers; csrc/ops_cuda.cpp checks the tensors, allocates outputs and
// scratch, and passes the current stream. Every launcher returns a cudaError_t code (0 on success); element
// types use the codes of csrc/cpu/kernels.h (0 float32, 1 bfloat16, 2 float16).
#pragma once

#include <cstdint>

namespace dcf::cuda {

// Message of a cudaError_t code returned by a launcher.
const char* error_string(int code);

// out[i] = noise[i] for i < n (docs/ops.md).
int randn(uint64_t seed, int64_t n, float* out, void* stream);

// xt = a[b] * x0 + c[b] * noise over a (B, M) matrix; noise == nullptr: regenerate from seed.
int q_sample(int dt, const void* x0, int noise_dt, const void* noise, const float* a, const float* c, void* out,
             int64_t B, int64_t M, uint64_t seed, void* stream);

// Floats of scratch that loss_fwd needs for a (B, M) problem.
int64_t loss_scratch_size(int64_t B, int64_t M);

// loss[b] = w[b] * mean_j (pred - p x0 - q noise)^2 and, when grad != nullptr,
// grad = grad_scale * w (2/M) (pred - tgt). A zero p[b] leaves row b of x0 unread. Row b of pred starts at
// b * pred_stride (pred_stride >= M); x0, noise and grad are (B, M).
int loss_fwd(int dt, const void* pred, int64_t pred_stride, const void* x0, int noise_dt, const void* noise,
             const float* p, const float* q, const float* w, float grad_scale, void* grad, float* loss,
             float* scratch, int64_t B, int64_t M, uint64_t seed, void* stream);

// t[b], imp[b] for b < batch from weights w (T,) (float64 if w_double else float32). Scratch: cdf (T doubles)
// only. No host synchronisation: weights with no positive entry give t = -1 and imp = NaN.
int sample_timesteps(bool w_double, const void* w, int64_t T, double* cdf, int64_t batch,
                     uint64_t seed, int64_t* t, float* imp, void* stream);

// adaLN-Zero modulate of x (B, N, D) with float32 shift/scale (B, D); mean/rstd (B, N) float32.
int adaln_fwd(int dt, const void* x, const float* shift, const float* scale, void* y, float* mean, float* rstd,
              int64_t B, int64_t N, int64_t D, float eps, void* stream);

// Backward of adaln_fwd: gx like x; gshift, gscale (B, D) float32 (gshift == nullptr: gx only).
int adaln_bwd(int dt, const void* grad_y, const void* x, const float* scale, const float* mean, const float* rstd,
              void* gx, float* gshift, float* gscale, int64_t B, int64_t N, int64_t D, void* stream);

// out = x + gate[b] * y.
int gated_fwd(int dt, const void* x, const float* gate, const void* y, void* out, int64_t B, int64_t N, int64_t D,
              void* stream);

// gy = gate[b] * grad_out, ggate (B, D) float32 = sum_n grad_out * y (grad_x is grad_out and is not written).
int gated_bwd(int dt, const void* grad_out, const float* gate, const void* y, void* gy, float* ggate, int64_t B,
              int64_t N, int64_t D, void* stream);

// Token routing (row copies of elem_bytes-sized elements, no arithmetic). Nothing is checked on the device (no
// host synchronisation): an index outside [0, T) moves no row (its gathered row is zero), and duplicate indices of
// one sample leave which source a row takes unspecified.
// pos (B, T) int32 scratch := the inverse map of idx (B, K): pos[b, idx[b, k]] = k, -1 at the tokens not kept.
int token_positions(const int64_t* idx, int32_t* pos, int64_t B, int64_t T, int64_t K, void* stream);

// out (B, K, D) = x[b, idx[b, k]] for x (B, T, D).
int token_gather(int elem_bytes, const void* x, const int64_t* idx, void* out, int64_t B, int64_t T, int64_t K,
                 int64_t D, void* stream);

// out (B, T, D): src[b, pos[b, t]] where pos >= 0, else base[b, t] (zero when base == nullptr).
int token_scatter(int elem_bytes, const void* base, const int32_t* pos, const void* src, void* out, int64_t B,
                  int64_t T, int64_t K, int64_t D, void* stream);

// Backward of token_scatter: grad_base (B, T, D) = grad_out with the kept rows zeroed, grad_src (B, K, D) =
// grad_out at the kept rows.
int token_scatter_bwd(int elem_bytes, const void* grad_out, const int32_t* pos, void* grad_base, void* grad_src,
                      int64_t B, int64_t T, int64_t K, int64_t D, void* stream);

}  // namespace dcf::cuda
