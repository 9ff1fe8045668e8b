// CUDA implementations of the diffcurr_fast_C ops: argument checks, output and scratch allocation, and a launch
// on the current stream of the inputs' device (kernels in csrc/cuda/kernels.cu). Built only with CUDA
// (DIFFCURR_WITH_CUDA); the schemas are defined in csrc/ops.cpp.
#if defined(DIFFCURR_WITH_CUDA)

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>

#include "checks.h"
#include "cuda/launch.h"

namespace dcf {
namespace {

#define DC_CUDA_OK(op, expr)                                                                       \
  do {                                                                                             \
    const int dc_err_ = (expr);                                                                    \
    TORCH_CHECK(dc_err_ == 0, "diffcurr_fast_C::", op, ": CUDA error: ", cuda::error_string(dc_err_)); \
  } while (0)

void check_cuda(const at::Tensor& t, const char* op, const char* name) {
  TORCH_CHECK(t.device().is_cuda(), "diffcurr_fast_C::", op, " (CUDA kernel): ", name,
              " must be a CUDA tensor, got ", t.device());
}

void* stream_of(const at::Tensor& t) { return c10::cuda::getCurrentCUDAStream(t.device().index()).stream(); }

at::Tensor f32_contig(const at::Tensor& t) { return t.to(at::kFloat).contiguous(); }

at::Tensor randn_like_cuda(const at::Tensor& like, int64_t seed) {
  check_cuda(like, "randn_like", "like");
  const c10::cuda::CUDAGuard guard(like.device());
  at::Tensor out = at::empty(like.sizes(), like.options().dtype(at::kFloat));
  DC_CUDA_OK("randn_like", cuda::randn(static_cast<uint64_t>(seed), out.numel(), out.mutable_data_ptr<float>(),
                                       stream_of(like)));
  return out;
}

at::Tensor q_sample_cuda(const at::Tensor& x0_in, const at::Tensor& a_in, const at::Tensor& c_in,
                         const c10::optional<at::Tensor>& noise_in, int64_t seed) {
  const char* op = "q_sample";
  check_cuda(x0_in, op, "x0");
  const int64_t B = check_batched(x0_in, op, "x0");
  const int dt = dtype_code(x0_in, op, "x0");
  check_per_sample(a_in, x0_in, B, op, "a");
  check_per_sample(c_in, x0_in, B, op, "c");
  check_noise(noise_in, x0_in, op);
  const c10::cuda::CUDAGuard guard(x0_in.device());
  const at::Tensor x0 = x0_in.contiguous(), a = a_in.contiguous(), c = c_in.contiguous();
  at::Tensor noise;
  if (noise_in.has_value()) noise = noise_in->contiguous();
  at::Tensor out = at::empty(x0.sizes(), x0.options());
  if (x0.numel() == 0) return out;
  const int64_t M = x0.numel() / B;
  DC_CUDA_OK(op, cuda::q_sample(dt, x0.const_data_ptr(), noise.defined() ? dtype_code(noise, op, "noise") : 0,
                                noise.defined() ? noise.const_data_ptr() : nullptr, a.const_data_ptr<float>(),
                                c.const_data_ptr<float>(), out.mutable_data_ptr(), B, M, static_cast<uint64_t>(seed),
                                stream_of(x0)));
  return out;
}

std::tuple<at::Tensor, at::Tensor> diffusion_loss_fwd_cuda(const at::Tensor& pred_in, const at::Tensor& x0_in,
                                                           const c10::optional<at::Tensor>& noise_in, int64_t seed,
                                                           const at::Tensor& p_in, const at::Tensor& q_in,
                                                           const at::Tensor& w_in, bool with_grad) {
  const char* op = "diffusion_loss_fwd";
  check_cuda(pred_in, op, "pred");
  const int64_t B = check_batched(pred_in, op, "pred");
  const int dt = dtype_code(pred_in, op, "pred");
  check_like(x0_in, pred_in, op, "x0", "pred");
  check_per_sample(p_in, pred_in, B, op, "p");
  check_per_sample(q_in, pred_in, B, op, "q");
  check_per_sample(w_in, pred_in, B, op, "w");
  check_noise(noise_in, x0_in, op);
  const c10::cuda::CUDAGuard guard(pred_in.device());
  const at::Tensor pred = pred_in.contiguous(), x0 = x0_in.contiguous();
  const at::Tensor p = p_in.contiguous(), q = q_in.contiguous(), w = w_in.contiguous();
  at::Tensor noise;
  if (noise_in.has_value()) noise = noise_in->contiguous();
  at::Tensor loss = at::empty({B}, pred.options().dtype(at::kFloat));
  at::Tensor grad = with_grad ? at::empty(pred.sizes(), pred.options()) : at::empty({0}, pred.options());
  if (B == 0) return {loss, grad};
  const int64_t M = pred.numel() / B;
  at::Tensor scratch = at::empty({cuda::loss_scratch_size(B, M)}, pred.options().dtype(at::kFloat));
  DC_CUDA_OK(op, cuda::loss_fwd(dt, pred.const_data_ptr(), x0.const_data_ptr(),
                                noise.defined() ? dtype_code(noise, op, "noise") : 0,
                                noise.defined() ? noise.const_data_ptr() : nullptr, p.const_data_ptr<float>(),
                                q.const_data_ptr<float>(), w.const_data_ptr<float>(),
                                with_grad ? grad.mutable_data_ptr() : nullptr, loss.mutable_data_ptr<float>(),
                                scratch.mutable_data_ptr<float>(), B, M, static_cast<uint64_t>(seed), stream_of(pred)));
  return {loss, grad};
}

std::tuple<at::Tensor, at::Tensor> sample_timesteps_cuda(const at::Tensor& weights_in, int64_t batch_size,
                                                         int64_t seed) {
  const char* op = "sample_timesteps";
  check_cuda(weights_in, op, "weights");
  check_weights(weights_in, op);
  TORCH_CHECK(batch_size >= 0, "diffcurr_fast_C::sample_timesteps: batch_size must be >= 0, got ", batch_size);
  const c10::cuda::CUDAGuard guard(weights_in.device());
  const at::Tensor weights = weights_in.contiguous();
  const int64_t T = weights.size(0);
  at::Tensor t = at::empty({batch_size}, weights.options().dtype(at::kLong));
  at::Tensor imp = at::empty({batch_size}, weights.options().dtype(at::kFloat));
  at::Tensor cdf = at::empty({T}, weights.options().dtype(at::kDouble));
  at::Tensor last = at::empty({1}, weights.options().dtype(at::kInt));
  DC_CUDA_OK(op, cuda::sample_timesteps(weights.scalar_type() == at::kDouble, weights.const_data_ptr(), T,
                                        cdf.mutable_data_ptr<double>(), last.mutable_data_ptr<int>(), batch_size,
                                        static_cast<uint64_t>(seed), t.mutable_data_ptr<int64_t>(),
                                        imp.mutable_data_ptr<float>(), stream_of(weights)));
  return {t, imp};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> adaln_modulate_fwd_cuda(const at::Tensor& x_in,
                                                                       const at::Tensor& shift_in,
                                                                       const at::Tensor& scale_in, double eps) {
  const char* op = "adaln_modulate_fwd";
  check_cuda(x_in, op, "x");
  check_bnd(x_in, op, "x");
  const int dt = dtype_code(x_in, op, "x");
  check_bd(shift_in, x_in, op, "shift");
  check_bd(scale_in, x_in, op, "scale");
  TORCH_CHECK(std::isfinite(eps) && eps >= 0.0, "diffcurr_fast_C::adaln_modulate_fwd: eps must be finite and >= 0, got ",
              eps);
  const c10::cuda::CUDAGuard guard(x_in.device());
  const at::Tensor x = x_in.contiguous(), shift = f32_contig(shift_in), scale = f32_contig(scale_in);
  const int64_t B = x.size(0), N = x.size(1), D = x.size(2);
  at::Tensor y = at::empty(x.sizes(), x.options());
  at::Tensor mean = at::empty({B, N}, x.options().dtype(at::kFloat));
  at::Tensor rstd = at::empty({B, N}, x.options().dtype(at::kFloat));
  if (D == 0 && mean.numel() > 0) {
    mean.zero_();
    rstd.fill_(1.0 / std::sqrt(eps));
    return {y, mean, rstd};
  }
  DC_CUDA_OK(op, cuda::adaln_fwd(dt, x.const_data_ptr(), shift.const_data_ptr<float>(), scale.const_data_ptr<float>(),
                                 y.mutable_data_ptr(), mean.mutable_data_ptr<float>(), rstd.mutable_data_ptr<float>(), B,
                                 N, D, static_cast<float>(eps), stream_of(x)));
  return {y, mean, rstd};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> adaln_modulate_bwd_cuda(const at::Tensor& gy_in,
                                                                       const at::Tensor& x_in,
                                                                       const at::Tensor& scale_in,
                                                                       const at::Tensor& mean_in,
                                                                       const at::Tensor& rstd_in, bool affine_grads) {
  const char* op = "adaln_modulate_bwd";
  check_cuda(x_in, op, "x");
  check_bnd(x_in, op, "x");
  const int dt = dtype_code(x_in, op, "x");
  check_like(gy_in, x_in, op, "grad_y", "x");
  check_bd(scale_in, x_in, op, "scale");
  check_bn_stats(mean_in, x_in, op, "mean");
  check_bn_stats(rstd_in, x_in, op, "rstd");
  const c10::cuda::CUDAGuard guard(x_in.device());
  const at::Tensor x = x_in.contiguous(), gy = gy_in.contiguous(), scale = f32_contig(scale_in);
  const at::Tensor mean = mean_in.contiguous(), rstd = rstd_in.contiguous();
  const int64_t B = x.size(0), N = x.size(1), D = x.size(2);
  at::Tensor gx = at::empty(x.sizes(), x.options());
  // affine_grads == false: grad_x only; gshift and gscale come back empty (shape (0,))
  const int64_t rows = affine_grads ? B : 0;
  at::Tensor gshift = at::empty({rows, D}, x.options().dtype(at::kFloat));
  at::Tensor gscale = at::empty({rows, D}, x.options().dtype(at::kFloat));
  DC_CUDA_OK(op, cuda::adaln_bwd(dt, gy.const_data_ptr(), x.const_data_ptr(), scale.const_data_ptr<float>(),
                                 mean.const_data_ptr<float>(), rstd.const_data_ptr<float>(), gx.mutable_data_ptr(),
                                 affine_grads ? gshift.mutable_data_ptr<float>() : nullptr,
                                 affine_grads ? gscale.mutable_data_ptr<float>() : nullptr, B, N, D, stream_of(x)));
  if (!affine_grads) return {gx, at::empty({0}, scale_in.options()), at::empty({0}, scale_in.options())};
  return {gx, gshift.to(scale_in.scalar_type()), gscale.to(scale_in.scalar_type())};
}

at::Tensor gated_residual_fwd_cuda(const at::Tensor& x_in, const at::Tensor& gate_in, const at::Tensor& y_in) {
  const char* op = "gated_residual_fwd";
  check_cuda(x_in, op, "x");
  check_bnd(x_in, op, "x");
  const int dt = dtype_code(x_in, op, "x");
  check_bd(gate_in, x_in, op, "gate");
  check_like(y_in, x_in, op, "y", "x");
  const c10::cuda::CUDAGuard guard(x_in.device());
  const at::Tensor x = x_in.contiguous(), y = y_in.contiguous(), gate = f32_contig(gate_in);
  at::Tensor out = at::empty(x.sizes(), x.options());
  DC_CUDA_OK(op, cuda::gated_fwd(dt, x.const_data_ptr(), gate.const_data_ptr<float>(), y.const_data_ptr(),
                                 out.mutable_data_ptr(), x.size(0), x.size(1), x.size(2), stream_of(x)));
  return out;
}

// grad_x of gated_residual is grad_out itself: the caller passes it through, so no copy is made here.
std::tuple<at::Tensor, at::Tensor> gated_residual_bwd_cuda(const at::Tensor& go_in, const at::Tensor& gate_in,
                                                           const at::Tensor& y_in) {
  const char* op = "gated_residual_bwd";
  check_cuda(y_in, op, "y");
  check_bnd(y_in, op, "y");
  const int dt = dtype_code(y_in, op, "y");
  check_like(go_in, y_in, op, "grad_out", "y");
  check_bd(gate_in, y_in, op, "gate");
  const c10::cuda::CUDAGuard guard(y_in.device());
  const at::Tensor go = go_in.contiguous(), y = y_in.contiguous(), gate = f32_contig(gate_in);
  const int64_t B = y.size(0), N = y.size(1), D = y.size(2);
  at::Tensor gy = at::empty(y.sizes(), y.options());
  at::Tensor ggate = at::empty({B, D}, y.options().dtype(at::kFloat));
  DC_CUDA_OK(op, cuda::gated_bwd(dt, go.const_data_ptr(), gate.const_data_ptr<float>(), y.const_data_ptr(),
                                 gy.mutable_data_ptr(), ggate.mutable_data_ptr<float>(), B, N, D, stream_of(y)));
  return {ggate.to(gate_in.scalar_type()), gy};
}

}  // namespace
}  // namespace dcf

TORCH_LIBRARY_IMPL(diffcurr_fast_C, CUDA, m) {
  m.impl("randn_like", &dcf::randn_like_cuda);
  m.impl("q_sample", &dcf::q_sample_cuda);
  m.impl("diffusion_loss_fwd", &dcf::diffusion_loss_fwd_cuda);
  m.impl("sample_timesteps", &dcf::sample_timesteps_cuda);
  m.impl("adaln_modulate_fwd", &dcf::adaln_modulate_fwd_cuda);
  m.impl("adaln_modulate_bwd", &dcf::adaln_modulate_bwd_cuda);
  m.impl("gated_residual_fwd", &dcf::gated_residual_fwd_cuda);
  m.impl("gated_residual_bwd", &dcf::gated_residual_bwd_cuda);
}

#endif  // DIFFCURR_WITH_CUDA
