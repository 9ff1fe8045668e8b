// Argument checks shared by the CPU (ops.cpp) and CUDA (ops_cuda.cpp) torch wrappers of diffcurr_fast_C.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>
#include <c10/util/Optional.h>

#include <cmath>
#include <cstdint>

namespace dcf {

// Element type code of the raw kernels: 0 float32, 1 bfloat16, 2 float16.
inline int dtype_code(const at::Tensor& t, const char* op, const char* name) {
  switch (t.scalar_type()) {
    case at::kFloat:
      return 0;
    case at::kBFloat16:
      return 1;
    case at::kHalf:
      return 2;
    default:
      TORCH_CHECK(false, "diffcurr_fast_C::", op, ": ", name, " must be float32, bfloat16 or float16, got ",
                  t.scalar_type());
  }
  return 0;
}

inline void check_device(const at::Tensor& t, const at::Tensor& ref, const char* op, const char* name) {
  TORCH_CHECK(t.device() == ref.device(), "diffcurr_fast_C::", op, ": ", name, " is on ", t.device(),
              " but the inputs are on ", ref.device());
}

// A per-sample float32 vector of shape (B,).
inline void check_per_sample(const at::Tensor& t, const at::Tensor& ref, int64_t B, const char* op,
                             const char* name) {
  check_device(t, ref, op, name);
  TORCH_CHECK(t.scalar_type() == at::kFloat, "diffcurr_fast_C::", op, ": ", name, " must be float32, got ",
              t.scalar_type());
  TORCH_CHECK(t.dim() == 1 && t.size(0) == B, "diffcurr_fast_C::", op, ": ", name, " must have shape (", B,
              ",), got ", t.sizes());
}

// A (B, ...) tensor with the same shape, dtype and device as ref.
inline void check_like(const at::Tensor& t, const at::Tensor& ref, const char* op, const char* name,
                       const char* ref_name) {
  check_device(t, ref, op, name);
  TORCH_CHECK(t.sizes() == ref.sizes(), "diffcurr_fast_C::", op, ": ", name, " must have the shape of ", ref_name,
              " ", ref.sizes(), ", got ", t.sizes());
  TORCH_CHECK(t.scalar_type() == ref.scalar_type(), "diffcurr_fast_C::", op, ": ", name, " must have the dtype of ",
              ref_name, " (", ref.scalar_type(), "), got ", t.scalar_type());
}

// Optional noise: the shape of x0, dtype float32 or x0's dtype.
inline void check_noise(const c10::optional<at::Tensor>& noise, const at::Tensor& x0, const char* op) {
  if (!noise.has_value()) return;
  const at::Tensor& n = *noise;
  check_device(n, x0, op, "noise");
  TORCH_CHECK(n.sizes() == x0.sizes(), "diffcurr_fast_C::", op, ": noise must have the shape of x0 ", x0.sizes(),
              ", got ", n.sizes());
  TORCH_CHECK(n.scalar_type() == at::kFloat || n.scalar_type() == x0.scalar_type(), "diffcurr_fast_C::", op,
              ": noise must be float32 or the dtype of x0 (", x0.scalar_type(), "), got ", n.scalar_type());
}

inline int64_t check_batched(const at::Tensor& x, const char* op, const char* name) {
  TORCH_CHECK(x.dim() >= 1, "diffcurr_fast_C::", op, ": ", name, " must have a batch dimension, got a scalar");
  return x.size(0);
}

// (B, N, D) activations and (B, D) modulation vectors (float32 or the activations' dtype).
inline void check_bnd(const at::Tensor& x, const char* op, const char* name) {
  TORCH_CHECK(x.dim() == 3, "diffcurr_fast_C::", op, ": ", name, " must have shape (B, N, D), got ", x.sizes());
}

inline void check_bd(const at::Tensor& v, const at::Tensor& x, const char* op, const char* name) {
  check_device(v, x, op, name);
  TORCH_CHECK(v.dim() == 2 && v.size(0) == x.size(0) && v.size(1) == x.size(2), "diffcurr_fast_C::", op, ": ",
              name, " must have shape (", x.size(0), ", ", x.size(2), "), got ", v.sizes());
  TORCH_CHECK(v.scalar_type() == at::kFloat || v.scalar_type() == x.scalar_type(), "diffcurr_fast_C::", op, ": ",
              name, " must be float32 or the dtype of x (", x.scalar_type(), "), got ", v.scalar_type());
}

inline void check_bn_stats(const at::Tensor& s, const at::Tensor& x, const char* op, const char* name) {
  check_device(s, x, op, name);
  TORCH_CHECK(s.scalar_type() == at::kFloat, "diffcurr_fast_C::", op, ": ", name, " must be float32, got ",
              s.scalar_type());
  TORCH_CHECK(s.dim() == 2 && s.size(0) == x.size(0) && s.size(1) == x.size(1), "diffcurr_fast_C::", op, ": ",
              name, " must have shape (", x.size(0), ", ", x.size(1), "), got ", s.sizes());
}

inline void check_weights(const at::Tensor& w, const char* op) {
  TORCH_CHECK(w.dim() == 1 && w.size(0) >= 1, "diffcurr_fast_C::", op,
              ": weights must have shape (T,) with T >= 1, got ", w.sizes());
  TORCH_CHECK(w.scalar_type() == at::kFloat || w.scalar_type() == at::kDouble, "diffcurr_fast_C::", op,
              ": weights must be float32 or float64, got ", w.scalar_type());
}

inline at::Tensor f32_contig(const at::Tensor& t) { return t.to(at::kFloat).contiguous(); }

// ---- Checked, contiguous arguments of each op, shared by the CPU and CUDA wrappers --------------------------
// (each wrapper first checks the device of its first input, then calls one of these).

inline at::Tensor optional_contig(const c10::optional<at::Tensor>& t) {
  return t.has_value() ? t->contiguous() : at::Tensor();
}

// q_sample: x_t = a * x0 + c * noise; noise undefined when it is generated from the seed.
struct QSampleArgs {
  at::Tensor x0, a, c, noise;
  int64_t B, M;
  int dt, ndt;
  const void* noise_ptr() const { return noise.defined() ? noise.const_data_ptr() : nullptr; }
};

inline QSampleArgs q_sample_args(const at::Tensor& x0, const at::Tensor& a, const at::Tensor& c,
                                 const c10::optional<at::Tensor>& noise, const char* op) {
  const int64_t B = check_batched(x0, op, "x0");
  const int dt = dtype_code(x0, op, "x0");
  check_per_sample(a, x0, B, op, "a");
  check_per_sample(c, x0, B, op, "c");
  check_noise(noise, x0, op);
  QSampleArgs r{x0.contiguous(), a.contiguous(), c.contiguous(), optional_contig(noise), B, 0, dt, 0};
  r.M = B ? x0.numel() / B : 0;
  r.ndt = r.noise.defined() ? dtype_code(r.noise, op, "noise") : 0;
  return r;
}

// diffusion_loss_fwd: target = p * x0 + q * noise, per-sample weight w.
struct LossArgs {
  at::Tensor pred, x0, noise, p, q, w;
  int64_t B, M;
  int64_t pred_stride;  // elements from one sample of pred to the next (M when contiguous)
  int dt, ndt;
  const void* noise_ptr() const { return noise.defined() ? noise.const_data_ptr() : nullptr; }
};

// A (B, ...) tensor whose samples are each contiguous and do not overlap (a batch stride >= M, e.g. the first
// C channels of a (B, 2C, H, W) network output) is read in place; anything else is made contiguous.
inline at::Tensor sample_rows(const at::Tensor& t, int64_t M, int64_t* stride) {
  const int64_t B = t.size(0);
  bool rows = B > 0 && M > 0;
  int64_t expect = 1;
  for (int64_t d = t.dim() - 1; rows && d >= 1; --d) {
    if (t.size(d) != 1 && t.stride(d) != expect) rows = false;
    expect *= t.size(d);
  }
  if (rows && (B == 1 || t.stride(0) >= M)) {
    *stride = B == 1 ? M : t.stride(0);
    return t;
  }
  *stride = M;
  return t.contiguous();
}

inline LossArgs loss_args(const at::Tensor& pred, const at::Tensor& x0, const c10::optional<at::Tensor>& noise,
                          const at::Tensor& p, const at::Tensor& q, const at::Tensor& w, const char* op) {
  const int64_t B = check_batched(pred, op, "pred");
  const int dt = dtype_code(pred, op, "pred");
  check_like(x0, pred, op, "x0", "pred");
  check_per_sample(p, pred, B, op, "p");
  check_per_sample(q, pred, B, op, "q");
  check_per_sample(w, pred, B, op, "w");
  check_noise(noise, x0, op);
  const int64_t M = B ? pred.numel() / B : 0;
  int64_t stride = M;
  at::Tensor rows = sample_rows(pred, M, &stride);
  LossArgs r{rows, x0.contiguous(), optional_contig(noise), p.contiguous(), q.contiguous(), w.contiguous(),
             B, M, stride, dt, 0};
  r.ndt = r.noise.defined() ? dtype_code(r.noise, op, "noise") : 0;
  return r;
}

// The DiT block ops: x-like (B, N, D) tensors and float32 (B, D) modulation vectors.
struct BlockArgs {
  at::Tensor x, other, v1, v2;  // other: the second (B, N, D) input; v1, v2: (B, D) vectors as float32
  int64_t B, N, D;
  int dt;
};

// adaln_modulate_fwd(x, shift, scale, eps): other undefined, v1 = shift, v2 = scale.
inline BlockArgs adaln_fwd_args(const at::Tensor& x, const at::Tensor& shift, const at::Tensor& scale, double eps,
                                const char* op) {
  check_bnd(x, op, "x");
  const int dt = dtype_code(x, op, "x");
  check_bd(shift, x, op, "shift");
  check_bd(scale, x, op, "scale");
  TORCH_CHECK(std::isfinite(eps) && eps >= 0.0, "diffcurr_fast_C::", op, ": eps must be finite and >= 0, got ", eps);
  return {x.contiguous(), at::Tensor(), f32_contig(shift), f32_contig(scale), x.size(0), x.size(1), x.size(2), dt};
}

// adaln_modulate_bwd(grad_y, x, scale, mean, rstd); scale as float32, mean and rstd (B, N) float32.
struct AdalnBwdArgs {
  at::Tensor x, gy, scale, mean, rstd;
  int64_t B, N, D;
  int dt;
};

inline AdalnBwdArgs adaln_bwd_args(const at::Tensor& gy, const at::Tensor& x, const at::Tensor& scale,
                                   const at::Tensor& mean, const at::Tensor& rstd, const char* op) {
  check_bnd(x, op, "x");
  const int dt = dtype_code(x, op, "x");
  check_like(gy, x, op, "grad_y", "x");
  check_bd(scale, x, op, "scale");
  check_bn_stats(mean, x, op, "mean");
  check_bn_stats(rstd, x, op, "rstd");
  return {x.contiguous(), gy.contiguous(), f32_contig(scale), mean.contiguous(), rstd.contiguous(),
          x.size(0), x.size(1), x.size(2), dt};
}

// gated_residual_fwd(x, gate, y): other = y, v1 = gate.
inline BlockArgs gated_fwd_args(const at::Tensor& x, const at::Tensor& gate, const at::Tensor& y, const char* op) {
  check_bnd(x, op, "x");
  const int dt = dtype_code(x, op, "x");
  check_bd(gate, x, op, "gate");
  check_like(y, x, op, "y", "x");
  return {x.contiguous(), y.contiguous(), f32_contig(gate), at::Tensor(), x.size(0), x.size(1), x.size(2), dt};
}

// gated_residual_bwd(grad_out, gate, y): x = y, other = grad_out, v1 = gate.
inline BlockArgs gated_bwd_args(const at::Tensor& go, const at::Tensor& gate, const at::Tensor& y, const char* op) {
  check_bnd(y, op, "y");
  const int dt = dtype_code(y, op, "y");
  check_like(go, y, op, "grad_out", "y");
  check_bd(gate, y, op, "gate");
  return {y.contiguous(), go.contiguous(), f32_contig(gate), at::Tensor(), y.size(0), y.size(1), y.size(2), dt};
}

// rmsnorm_modulate_fwd(x, shift, scale, weight, eps) / _bwd(grad_y, x, scale, weight, rstd): x-like (B, N, D),
// (B, D) vectors and the optional (D,) weight as float32 (undefined when absent); rstd (B, N) float32.
struct RmsArgs {
  at::Tensor x, gy, shift, scale, weight, rstd;
  int64_t B, N, D;
  int dt;
  const float* weight_ptr() const { return weight.defined() ? weight.const_data_ptr<float>() : nullptr; }
};

inline at::Tensor optional_weight(const c10::optional<at::Tensor>& w, const at::Tensor& x, int64_t D, const char* op,
                                  const char* name) {
  if (!w.has_value()) return at::Tensor();
  check_device(*w, x, op, name);
  TORCH_CHECK(w->dim() == 1 && w->size(0) == D, "diffcurr_fast_C::", op, ": ", name, " must have shape (", D,
              ",), got ", w->sizes());
  TORCH_CHECK(w->scalar_type() == at::kFloat || w->scalar_type() == x.scalar_type(), "diffcurr_fast_C::", op, ": ",
              name, " must be float32 or the dtype of x (", x.scalar_type(), "), got ", w->scalar_type());
  return f32_contig(*w);
}

inline void check_eps(double eps, const char* op) {
  TORCH_CHECK(std::isfinite(eps) && eps >= 0.0, "diffcurr_fast_C::", op, ": eps must be finite and >= 0, got ", eps);
}

inline RmsArgs rms_fwd_args(const at::Tensor& x, const at::Tensor& shift, const at::Tensor& scale,
                            const c10::optional<at::Tensor>& weight, double eps, const char* op) {
  check_bnd(x, op, "x");
  const int dt = dtype_code(x, op, "x");
  check_bd(shift, x, op, "shift");
  check_bd(scale, x, op, "scale");
  check_eps(eps, op);
  return {x.contiguous(), at::Tensor(), f32_contig(shift), f32_contig(scale), optional_weight(weight, x, x.size(2), op, "weight"),
          at::Tensor(), x.size(0), x.size(1), x.size(2), dt};
}

inline RmsArgs rms_bwd_args(const at::Tensor& gy, const at::Tensor& x, const at::Tensor& scale,
                            const c10::optional<at::Tensor>& weight, const at::Tensor& rstd, const char* op) {
  check_bnd(x, op, "x");
  const int dt = dtype_code(x, op, "x");
  check_like(gy, x, op, "grad_y", "x");
  check_bd(scale, x, op, "scale");
  check_bn_stats(rstd, x, op, "rstd");
  return {x.contiguous(), gy.contiguous(), at::Tensor(), f32_contig(scale), optional_weight(weight, x, x.size(2), op, "weight"),
          rstd.contiguous(), x.size(0), x.size(1), x.size(2), dt};
}

// qk_norm_rope_fwd / _bwd: the packed projection qkv (B, N, 3 H Dh), [q; k; v] of H heads of Dh channels along its
// last dimension (read in place when that has unit stride), the optional (Dh,) weights as float32 (both or
// neither) and the optional rotary tables as float32 (both or neither): (N, Dh / 2), one for the batch, or
// (B, N, Dh / 2), one per sample.
struct QkArgs {
  at::Tensor qkv, wq, wk, cos, sin;
  int64_t B, H, N, Dh, tab_b;
  int dt;
  const float* ptr(const at::Tensor& t) const { return t.defined() ? t.const_data_ptr<float>() : nullptr; }
};

// t with unit stride along its last dimension (a view of it when it has one, else a contiguous copy).
inline at::Tensor unit_last(const at::Tensor& t) { return t.size(-1) <= 1 || t.stride(-1) == 1 ? t : t.contiguous(); }

inline QkArgs qk_args(const at::Tensor& qkv, int64_t heads, const c10::optional<at::Tensor>& wq,
                      const c10::optional<at::Tensor>& wk, const c10::optional<at::Tensor>& cos,
                      const c10::optional<at::Tensor>& sin, double eps, const char* op) {
  TORCH_CHECK(qkv.dim() == 3, "diffcurr_fast_C::", op, ": qkv must have shape (B, N, 3 * heads * head_dim), got ",
              qkv.sizes());
  const int dt = dtype_code(qkv, op, "qkv");
  TORCH_CHECK(heads >= 1 && qkv.size(2) % (3 * heads) == 0, "diffcurr_fast_C::", op,
              ": qkv's last dimension must be 3 * heads * head_dim with heads >= 1, got ", qkv.size(2), " for ",
              heads, " heads");
  check_eps(eps, op);
  const int64_t B = qkv.size(0), N = qkv.size(1), H = heads, Dh = qkv.size(2) / (3 * heads);
  TORCH_CHECK(wq.has_value() == wk.has_value(), "diffcurr_fast_C::", op,
              ": give both q_weight and k_weight (QK-norm) or neither");
  TORCH_CHECK(cos.has_value() == sin.has_value(), "diffcurr_fast_C::", op, ": give both cos and sin (RoPE) or neither");
  QkArgs r{unit_last(qkv), optional_weight(wq, qkv, Dh, op, "q_weight"), optional_weight(wk, qkv, Dh, op, "k_weight"),
           at::Tensor(), at::Tensor(), B, H, N, Dh, 0, dt};
  if (cos.has_value()) {
    TORCH_CHECK(Dh % 2 == 0, "diffcurr_fast_C::", op, ": the rotation needs an even head dim, got ", Dh);
    for (const at::Tensor* t : {&*cos, &*sin}) {
      check_device(*t, qkv, op, "cos / sin");
      const bool shared = t->dim() == 2 && t->size(0) == N && t->size(1) == Dh / 2;
      const bool per_sample = t->dim() == 3 && t->size(0) == B && t->size(1) == N && t->size(2) == Dh / 2;
      TORCH_CHECK(shared || per_sample, "diffcurr_fast_C::", op, ": cos and sin must have shape (", N, ", ", Dh / 2,
                  ") or (", B, ", ", N, ", ", Dh / 2, "), got ", t->sizes());
      TORCH_CHECK(t->scalar_type() == at::kFloat || t->scalar_type() == qkv.scalar_type(), "diffcurr_fast_C::", op,
                  ": cos and sin must be float32 or the dtype of qkv, got ", t->scalar_type());
    }
    TORCH_CHECK(cos->sizes() == sin->sizes(), "diffcurr_fast_C::", op, ": cos ", cos->sizes(), " and sin ",
                sin->sizes(), " must have one shape");
    r.cos = f32_contig(*cos);
    r.sin = f32_contig(*sin);
    r.tab_b = cos->dim() == 3 ? N * (Dh / 2) : 0;
  }
  return r;
}

// swiglu_fwd(x) / swiglu_bwd(grad_y, x): x (..., 2H) with its two halves a, b along the last dimension.
inline int64_t swiglu_half(const at::Tensor& x, const char* op) {
  TORCH_CHECK(x.dim() >= 1 && x.size(-1) % 2 == 0, "diffcurr_fast_C::", op,
              ": x must have an even last dimension (the two halves a, b), got ", x.sizes());
  return x.size(-1) / 2;
}

// Token routing: rows (B, T, D) of a kernel dtype and idx (B, K) int64 on their device, K <= T.
struct RouteArgs {
  at::Tensor rows, idx;  // rows: x of token_gather, src of token_scatter, grad_out of token_scatter_bwd
  int64_t B, T, K, D;
  int dt;
};

inline void check_route_idx(const at::Tensor& idx, const at::Tensor& ref, int64_t B, int64_t T, const char* op) {
  check_device(idx, ref, op, "idx");
  TORCH_CHECK(idx.scalar_type() == at::kLong, "diffcurr_fast_C::", op, ": idx must be int64, got ", idx.scalar_type());
  TORCH_CHECK(idx.dim() == 2 && idx.size(0) == B && idx.size(1) <= T, "diffcurr_fast_C::", op,
              ": idx must have shape (", B, ", K <= ", T, "), got ", idx.sizes());
  TORCH_CHECK(T <= INT32_MAX, "diffcurr_fast_C::", op, ": at most 2^31 - 1 tokens, got ", T);
}

// token_gather(x, idx): x (B, T, D).
inline RouteArgs token_gather_args(const at::Tensor& x, const at::Tensor& idx, const char* op) {
  TORCH_CHECK(x.dim() == 3, "diffcurr_fast_C::", op, ": x must have shape (B, T, D), got ", x.sizes());
  const int dt = dtype_code(x, op, "x");
  check_route_idx(idx, x, x.size(0), x.size(1), op);
  return {x.contiguous(), idx.contiguous(), x.size(0), x.size(1), idx.size(1), x.size(2), dt};
}

// token_scatter(base, idx, src, tokens): src (B, K, D); base (B, tokens, D) like src, or none (zeros).
inline RouteArgs token_scatter_args(const c10::optional<at::Tensor>& base, const at::Tensor& idx,
                                    const at::Tensor& src, int64_t tokens, const char* op) {
  TORCH_CHECK(src.dim() == 3, "diffcurr_fast_C::", op, ": src must have shape (B, K, D), got ", src.sizes());
  const int dt = dtype_code(src, op, "src");
  TORCH_CHECK(tokens >= src.size(1), "diffcurr_fast_C::", op, ": tokens must be >= K = ", src.size(1), ", got ",
              tokens);
  check_route_idx(idx, src, src.size(0), tokens, op);
  TORCH_CHECK(idx.size(1) == src.size(1), "diffcurr_fast_C::", op, ": idx ", idx.sizes(), " and src ", src.sizes(),
              " must have the same K");
  if (base.has_value()) {
    check_device(*base, src, op, "base");
    TORCH_CHECK(base->scalar_type() == src.scalar_type(), "diffcurr_fast_C::", op, ": base must have the dtype of src (",
                src.scalar_type(), "), got ", base->scalar_type());
    TORCH_CHECK(base->dim() == 3 && base->size(0) == src.size(0) && base->size(1) == tokens &&
                    base->size(2) == src.size(2),
                "diffcurr_fast_C::", op, ": base must have shape (", src.size(0), ", ", tokens, ", ", src.size(2),
                "), got ", base->sizes());
  }
  return {src.contiguous(), idx.contiguous(), src.size(0), tokens, src.size(1), src.size(2), dt};
}

// token_scatter_bwd(grad_out, idx): grad_out (B, T, D).
inline RouteArgs token_scatter_bwd_args(const at::Tensor& go, const at::Tensor& idx, const char* op) {
  TORCH_CHECK(go.dim() == 3, "diffcurr_fast_C::", op, ": grad_out must have shape (B, T, D), got ", go.sizes());
  const int dt = dtype_code(go, op, "grad_out");
  check_route_idx(idx, go, go.size(0), go.size(1), op);
  return {go.contiguous(), idx.contiguous(), go.size(0), go.size(1), idx.size(1), go.size(2), dt};
}

}  // namespace dcf
