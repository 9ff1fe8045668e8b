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

// RMSNorm-modulate of x (B, N, D) with float32 shift/scale (B, D) and weight w (D,) (nullptr: none); rstd (B, N).
int rmsnorm_fwd(int dt, const void* x, const float* shift, const float* scale, const float* w, void* y, float* rstd,
                int64_t B, int64_t N, int64_t D, float eps, void* stream);

// Backward of rmsnorm_fwd: gx like x; gshift, gscale (B, D) and gw (D,) float32 (gshift == nullptr: gx only;
// gw is written only with a weight).
int rmsnorm_bwd(int dt, const void* grad_y, const void* x, const float* scale, const float* w, const float* rstd,
                void* gx, float* gshift, float* gscale, float* gw, int64_t B, int64_t N, int64_t D, void* stream);

// QK-norm + 2-D RoPE (docs/ops.md). One part of the packed projection: the rows (b, h, n) of head_dim Dh read
// at src + b * sb + h * sh + n * sn (unit stride along Dh) and written at dst with (db, dh, dn); the backward
// also reads the norm's input at x with (xb, xh, xn). w == nullptr: no norm; rope == 0: no rotation.
struct QkPart {
  const void* src;
  int64_t sb, sh, sn;
  const void* x;
  int64_t xb, xh, xn;
  void* dst;
  int64_t db, dh, dn;
  const float* w;
  int rope;
};

// The three parts q, k, v; tables cos / sin (float32, row b * tab_b + n of Dh / 2 entries) or nullptr. The
// backward writes grad_q_weight / grad_k_weight into gwq / gwk (float32, Dh) when they are not null, through
// scratch (qk_norm_rope_scratch_size floats).
struct QkCall {
  int dt;
  bool backward;
  QkPart part[3];
  const float* cos;
  const float* sin;
  int64_t tab_b, B, H, N, Dh;
  float eps;
  float* scratch;
  float* gwq;
  float* gwk;
};

// Floats of scratch that the backward with weight gradients needs; head dims up to 256 (longer rows: an error).
int64_t qk_norm_rope_scratch_size(int64_t B, int64_t H, int64_t N, int64_t Dh);
int qk_norm_rope(const QkCall& call, void* stream);

// SwiGLU over rows of x (R, 2H): grad_y == nullptr: out (R, H) = silu(a) * b; else out (R, 2H) = grad_x.
int swiglu(int dt, const void* x, const void* grad_y, void* out, int64_t R, int64_t H, void* stream);

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
