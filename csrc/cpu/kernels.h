// Raw CPU kernels of diffcurr_fast (no torch dependency): single-threaded range functions over contiguous
// buffers. The torch layer (csrc/ops.cpp) checks inputs, allocates outputs and splits the work over threads.
// Each kernel is compiled for several instruction sets (generic x86-64, AVX2+FMA, AVX-512); `kernels()` picks
// the best one the running CPU supports.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace dcf::cpu {

// Element type of a tensor buffer. Arithmetic is always float32.
enum DType : int { kF32 = 0, kBF16 = 1, kF16 = 2 };

// Rows of head_dim Dh of a (B, H, N, Dh) tensor: element strides of b, h and n (Dh has unit stride).
struct RowLayout {
  int64_t H, N, Dh;
  int64_t sb, sh, sn;
};

struct KernelTable {
  const char* isa;

  // out[k] = noise[i0 + k] for k < n (flat Philox index, docs/ops.md).
  void (*randn)(uint64_t seed, int64_t i0, int64_t n, float* out);

  // xt = a[b] * x0 + c[b] * noise over flat elements [i0, i0 + n) of a (B, M) matrix (Ho et al. Eq. 4).
  // noise == nullptr: regenerate it from seed.
  void (*q_sample)(int dt, const void* x0, int noise_dt, const void* noise, const float* a, const float* c,
                   void* out, int64_t M, uint64_t seed, int64_t i0, int64_t n);

  // Row b, columns [j0, j0 + n): returns sum_j (pred - tgt)^2 (tgt = p[b] x0 + q[b] noise), and writes
  // grad = grad_scale * w[b] * (2 / M) * (pred - tgt) when grad != nullptr. A zero p[b] (q[b]) leaves x0 (the
  // noise) unread. Row b of pred starts at b * pred_stride (pred_stride >= M); x0, noise and grad are (B, M).
  double (*loss)(int dt, const void* pred, int64_t pred_stride, const void* x0, int noise_dt, const void* noise,
                 const float* p, const float* q, const float* w, float grad_scale, void* grad, int64_t M,
                 uint64_t seed, int64_t b, int64_t j0, int64_t n);

  // adaLN-Zero modulate of rows [r0, r0 + nrows) of x viewed as (B * N, D).
  void (*adaln_fwd)(int dt, const void* x, const float* shift, const float* scale, void* y, float* mean,
                    float* rstd, int64_t N, int64_t D, float eps, int64_t r0, int64_t nrows);

  // Backward for rows [n0, n0 + nrows) of sample b: writes gx and ADDS sum_n grad_y and sum_n grad_y * xhat
  // into gshift_acc / gscale_acc (D floats each); gshift_acc == nullptr: gx only (both sums skipped).
  void (*adaln_bwd)(int dt, const void* grad_y, const void* x, const float* scale, const float* mean,
                    const float* rstd, void* gx, float* gshift_acc, float* gscale_acc, int64_t N, int64_t D,
                    int64_t b, int64_t n0, int64_t nrows);

  // out = x + gate[b] * y for rows [r0, r0 + nrows) of (B * N, D).
  void (*gated_fwd)(int dt, const void* x, const float* gate, const void* y, void* out, int64_t N, int64_t D,
                    int64_t r0, int64_t nrows);

  // Backward for rows [n0, n0 + nrows) of sample b: gy = gate[b] * grad_out, and ADDS sum_n grad_out * y into
  // ggate_acc (D floats). grad_x is grad_out itself and is not written.
  void (*gated_bwd)(int dt, const void* grad_out, const float* gate, const void* y, void* gy, float* ggate_acc,
                    int64_t N, int64_t D, int64_t b, int64_t n0, int64_t nrows);

  // tanh-GELU over flat elements [i0, i0 + n): y = x sigmoid(2u), u = sqrt(2/pi) (x + 0.044715 x^3), which is
  // 0.5 x (1 + tanh u) (Hendrycks & Gimpel 2016, Sec. 2).
  void (*gelu_tanh_fwd)(int dt, const void* x, void* y, int64_t i0, int64_t n);

  // gx = grad_y * dy/dx over flat elements [i0, i0 + n).
  void (*gelu_tanh_bwd)(int dt, const void* grad_y, const void* x, void* gx, int64_t i0, int64_t n);

  // RMSNorm-modulate of rows [r0, r0 + nrows) of x viewed as (B * N, D): y = x * rstd * w * (1 + scale[b]) +
  // shift[b], rstd = 1 / sqrt(mean_d x^2 + eps) written per row; w == nullptr: no weight (1).
  void (*rmsnorm_fwd)(int dt, const void* x, const float* shift, const float* scale, const float* w, void* y,
                      float* rstd, int64_t N, int64_t D, float eps, int64_t r0, int64_t nrows);

  // Backward for rows [n0, n0 + nrows) of sample b: writes gx and ADDS sum_n grad_y and sum_n grad_y * xhat
  // (xhat = x * rstd) into gshift_acc / gxhat_acc (D floats each); gshift_acc == nullptr: gx only.
  void (*rmsnorm_bwd)(int dt, const void* grad_y, const void* x, const float* scale, const float* w,
                      const float* rstd, void* gx, float* gshift_acc, float* gxhat_acc, int64_t N, int64_t D,
                      int64_t b, int64_t n0, int64_t nrows);

  // QK-norm + 2-D RoPE over rows [r0, r0 + nrows) of the flat (B * H * N) rows of head_dim Dh (docs/ops.md): the
  // row (b, h, n) of x at b * sb + h * sh + n * sn of xl (unit stride along Dh), written at the same place of ol.
  // w == nullptr: no normalisation; cos == nullptr: no rotation; neither: a copy. The rotary tables come expanded
  // to one entry per channel, rows of Dh: cos[2m] = cos[2m + 1] = cos_m, sin[2m] = -sin_m, sin[2m + 1] = sin_m;
  // the row of (b, n) starts at b * tab_b + n * Dh (tab_b 0: one table for the batch).
  void (*qk_rope_fwd)(int dt, const void* x, const RowLayout& xl, const float* w, const float* cos,
                      const float* sin, int64_t tab_b, void* out, const RowLayout& ol, float eps, int64_t r0,
                      int64_t nrows);

  // Backward over the same rows: gx (laid out as ol) from grad_out (gl) and x (xl); ADDS the rows' sum of
  // grad_normed * xhat into gw_acc (Dh floats) when gw_acc != nullptr and w != nullptr.
  void (*qk_rope_bwd)(int dt, const void* grad_out, const RowLayout& gl, const void* x, const RowLayout& xl,
                      const float* w, const float* cos, const float* sin, int64_t tab_b, void* gx,
                      const RowLayout& ol, float* gw_acc, float eps, int64_t r0, int64_t nrows);

  // SwiGLU over rows [r0, r0 + nrows) of x (R, 2H): y (R, H) = silu(x[:, :H]) * x[:, H:].
  void (*swiglu_fwd)(int dt, const void* x, void* y, int64_t H, int64_t r0, int64_t nrows);

  // Its backward over the same rows: gx (R, 2H) from grad_y (R, H) and x.
  void (*swiglu_bwd)(int dt, const void* grad_y, const void* x, void* gx, int64_t H, int64_t r0, int64_t nrows);

  // Token routing (docs/ops.md): row copies, no arithmetic (dt only sets the element size). Indices are checked
  // by the caller: idx[b, k] in [0, T); pos is the inverse map of idx, (B, T) with pos[b, idx[b, k]] = k and -1
  // at the tokens not kept.
  // Rows [r0, r0 + nrows) of out (B * K, D): out[b, k] = x[b, idx[b, k]], for x (B, T, D).
  void (*token_gather)(int dt, const void* x, const int64_t* idx, void* out, int64_t T, int64_t K, int64_t D,
                       int64_t r0, int64_t nrows);

  // Rows [r0, r0 + nrows) of out (B * T, D): out[b, t] = src[b, pos[b, t]] where pos[b, t] >= 0, else base[b, t]
  // (zero when base == nullptr: the backward of token_gather), for src (B, K, D).
  void (*token_scatter)(int dt, const void* base, const int32_t* pos, const void* src, void* out, int64_t T,
                        int64_t K, int64_t D, int64_t r0, int64_t nrows);

  // Backward of token_scatter over rows [r0, r0 + nrows) of grad_out (B * T, D): where pos[b, t] >= 0,
  // grad_src[b, pos[b, t]] = grad_out[b, t] and grad_base[b, t] = 0; elsewhere grad_base[b, t] = grad_out[b, t].
  void (*token_scatter_bwd)(int dt, const void* grad_out, const int32_t* pos, void* grad_base, void* grad_src,
                            int64_t T, int64_t K, int64_t D, int64_t r0, int64_t nrows);
};

// The table in use: at first the best instruction set of this CPU; DIFFCURR_CPU_ISA=generic|avx2|avx512
// forces one (an unsupported choice falls back to the best available).
const KernelTable& kernels();

// Switch the table in use to a named instruction set; returns the previous table, or nullptr (and switches
// nothing) when that set is not compiled in or not supported by the CPU. For tests and benchmarks that run
// every variant in one process: switch between ops, not while an op runs on other threads.
const KernelTable* set_kernels(const char* isa);

// The instruction sets this build and this CPU can run, from the baseline up.
std::vector<std::string> supported_isas();

// The table for a named instruction set, or nullptr if it is not compiled in or not supported by the CPU.
const KernelTable* kernels_for(const char* isa);

}  // namespace dcf::cpu
