// CUDA implementations of the diffcurr_fast_C ops: argument checks, output and scratch allocation, and a launch
// on the current stream of the inputs' device (kernels in csrc/cuda/kernels.cu). Built only with CUDA
// (DIFFCURR_WITH_CUDA); the schemas are defined in csrc/ops.cpp.
#if defined(DIFFCURR_WITH_CUDA)

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>
#include <vector>

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
  const c10::cuda::CUDAGuard guard(x0_in.device());
  const QSampleArgs g = q_sample_args(x0_in, a_in, c_in, noise_in, op);
  at::Tensor out = at::empty(g.x0.sizes(), g.x0.options());
  if (g.x0.numel() == 0) return out;
  DC_CUDA_OK(op, cuda::q_sample(g.dt, g.x0.const_data_ptr(), g.ndt, g.noise_ptr(), g.a.const_data_ptr<float>(),
                                g.c.const_data_ptr<float>(), out.mutable_data_ptr(), g.B, g.M,
                                static_cast<uint64_t>(seed), stream_of(g.x0)));
  return out;
}

std::tuple<at::Tensor, at::Tensor> diffusion_loss_fwd_cuda(const at::Tensor& pred_in, const at::Tensor& x0_in,
                                                           const c10::optional<at::Tensor>& noise_in, int64_t seed,
                                                           const at::Tensor& p_in, const at::Tensor& q_in,
                                                           const at::Tensor& w_in, bool with_grad,
                                                           double grad_scale) {
  const char* op = "diffusion_loss_fwd";
  check_cuda(pred_in, op, "pred");
  const c10::cuda::CUDAGuard guard(pred_in.device());
  const LossArgs g = loss_args(pred_in, x0_in, noise_in, p_in, q_in, w_in, op);
  const int64_t B = g.B, M = g.M;
  const at::Tensor& pred = g.pred;
  at::Tensor loss = at::empty({B}, pred.options().dtype(at::kFloat));
  at::Tensor grad = with_grad ? at::empty(pred.sizes(), pred.options()) : at::empty({0}, pred.options());
  if (B == 0) return {loss, grad};
  at::Tensor scratch = at::empty({cuda::loss_scratch_size(B, M)}, pred.options().dtype(at::kFloat));
  DC_CUDA_OK(op, cuda::loss_fwd(g.dt, pred.const_data_ptr(), g.pred_stride, g.x0.const_data_ptr(), g.ndt,
                                g.noise_ptr(), g.p.const_data_ptr<float>(), g.q.const_data_ptr<float>(),
                                g.w.const_data_ptr<float>(), static_cast<float>(grad_scale),
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
  DC_CUDA_OK(op, cuda::sample_timesteps(weights.scalar_type() == at::kDouble, weights.const_data_ptr(), T,
                                        cdf.mutable_data_ptr<double>(), batch_size,
                                        static_cast<uint64_t>(seed), t.mutable_data_ptr<int64_t>(),
                                        imp.mutable_data_ptr<float>(), stream_of(weights)));
  return {t, imp};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> adaln_modulate_fwd_cuda(const at::Tensor& x_in,
                                                                       const at::Tensor& shift_in,
                                                                       const at::Tensor& scale_in, double eps) {
  const char* op = "adaln_modulate_fwd";
  check_cuda(x_in, op, "x");
  const c10::cuda::CUDAGuard guard(x_in.device());
  const BlockArgs g = adaln_fwd_args(x_in, shift_in, scale_in, eps, op);
  const at::Tensor &x = g.x, &shift = g.v1, &scale = g.v2;
  const int64_t B = g.B, N = g.N, D = g.D;
  const int dt = g.dt;
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
  const c10::cuda::CUDAGuard guard(x_in.device());
  const AdalnBwdArgs g = adaln_bwd_args(gy_in, x_in, scale_in, mean_in, rstd_in, op);
  const at::Tensor &x = g.x, &gy = g.gy, &scale = g.scale, &mean = g.mean, &rstd = g.rstd;
  const int64_t B = g.B, N = g.N, D = g.D;
  const int dt = g.dt;
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
  const c10::cuda::CUDAGuard guard(x_in.device());
  const BlockArgs g = gated_fwd_args(x_in, gate_in, y_in, op);
  at::Tensor out = at::empty(g.x.sizes(), g.x.options());
  DC_CUDA_OK(op, cuda::gated_fwd(g.dt, g.x.const_data_ptr(), g.v1.const_data_ptr<float>(), g.other.const_data_ptr(),
                                 out.mutable_data_ptr(), g.B, g.N, g.D, stream_of(g.x)));
  return out;
}

// grad_x of gated_residual is grad_out itself: the caller passes it through, so no copy is made here.
std::tuple<at::Tensor, at::Tensor> gated_residual_bwd_cuda(const at::Tensor& go_in, const at::Tensor& gate_in,
                                                           const at::Tensor& y_in) {
  const char* op = "gated_residual_bwd";
  check_cuda(y_in, op, "y");
  const c10::cuda::CUDAGuard guard(y_in.device());
  const BlockArgs g = gated_bwd_args(go_in, gate_in, y_in, op);
  const at::Tensor &y = g.x, &go = g.other, &gate = g.v1;
  const int64_t B = g.B, N = g.N, D = g.D;
  const int dt = g.dt;
  at::Tensor gy = at::empty(y.sizes(), y.options());
  at::Tensor ggate = at::empty({B, D}, y.options().dtype(at::kFloat));
  DC_CUDA_OK(op, cuda::gated_bwd(dt, go.const_data_ptr(), gate.const_data_ptr<float>(), y.const_data_ptr(),
                                 gy.mutable_data_ptr(), ggate.mutable_data_ptr<float>(), B, N, D, stream_of(y)));
  return {ggate.to(gate_in.scalar_type()), gy};
}

// ---- the modern block: RMSNorm-modulate, QK-norm + 2-D RoPE, SwiGLU --------------------------------------
std::tuple<at::Tensor, at::Tensor> rmsnorm_modulate_fwd_cuda(const at::Tensor& x_in, const at::Tensor& shift_in,
                                                             const at::Tensor& scale_in,
                                                             const c10::optional<at::Tensor>& weight_in, double eps) {
  const char* op = "rmsnorm_modulate_fwd";
  check_cuda(x_in, op, "x");
  const c10::cuda::CUDAGuard guard(x_in.device());
  const RmsArgs g = rms_fwd_args(x_in, shift_in, scale_in, weight_in, eps, op);
  at::Tensor y = at::empty(g.x.sizes(), g.x.options());
  at::Tensor rstd = at::empty({g.B, g.N}, g.x.options().dtype(at::kFloat));
  if (g.D == 0 && rstd.numel() > 0) {
    rstd.fill_(1.0 / std::sqrt(eps));
    return {y, rstd};
  }
  DC_CUDA_OK(op, cuda::rmsnorm_fwd(g.dt, g.x.const_data_ptr(), g.shift.const_data_ptr<float>(),
                                   g.scale.const_data_ptr<float>(), g.weight_ptr(), y.mutable_data_ptr(),
                                   rstd.mutable_data_ptr<float>(), g.B, g.N, g.D, static_cast<float>(eps), stream_of(g.x)));
  return {y, rstd};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> rmsnorm_modulate_bwd_cuda(
    const at::Tensor& gy_in, const at::Tensor& x_in, const at::Tensor& scale_in,
    const c10::optional<at::Tensor>& weight_in, const at::Tensor& rstd_in, bool affine_grads) {
  const char* op = "rmsnorm_modulate_bwd";
  check_cuda(x_in, op, "x");
  const c10::cuda::CUDAGuard guard(x_in.device());
  const RmsArgs g = rms_bwd_args(gy_in, x_in, scale_in, weight_in, rstd_in, op);
  at::Tensor gx = at::empty(g.x.sizes(), g.x.options());
  auto none = [&] { return at::empty({0}, scale_in.options()); };  // a fresh one each (outputs never alias)
  const int64_t rows = affine_grads ? g.B : 0;
  at::Tensor gshift = at::empty({rows, g.D}, g.x.options().dtype(at::kFloat));
  at::Tensor gscale = at::empty({rows, g.D}, g.x.options().dtype(at::kFloat));
  const bool with_w = affine_grads && g.weight.defined();
  at::Tensor gw = at::zeros({with_w ? g.D : 0}, g.x.options().dtype(at::kFloat));
  DC_CUDA_OK(op, cuda::rmsnorm_bwd(g.dt, g.gy.const_data_ptr(), g.x.const_data_ptr(), g.scale.const_data_ptr<float>(),
                                   g.weight_ptr(), g.rstd.const_data_ptr<float>(), gx.mutable_data_ptr(),
                                   affine_grads ? gshift.mutable_data_ptr<float>() : nullptr,
                                   affine_grads ? gscale.mutable_data_ptr<float>() : nullptr,
                                   with_w ? gw.mutable_data_ptr<float>() : nullptr, g.B, g.N, g.D, stream_of(g.x)));
  if (!affine_grads) return {gx, none(), none(), none()};
  return {gx, gshift.to(scale_in.scalar_type()), gscale.to(scale_in.scalar_type()),
          with_w ? gw.to(weight_in->scalar_type()) : none()};
}

// The rows of part p (0 q, 1 k, 2 v) of a packed (B, N, 3 H Dh) tensor: its data pointer and its strides of b, h, n.
const void* packed_part(const at::Tensor& t, int64_t p, int64_t H, int64_t Dh) {
  return static_cast<const char*>(t.const_data_ptr()) + p * H * Dh * t.element_size();
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> qk_norm_rope_fwd_cuda(
    const at::Tensor& qkv_in, int64_t heads, const c10::optional<at::Tensor>& wq_in,
    const c10::optional<at::Tensor>& wk_in, const c10::optional<at::Tensor>& cos_in,
    const c10::optional<at::Tensor>& sin_in, double eps) {
  const char* op = "qk_norm_rope_fwd";
  check_cuda(qkv_in, op, "qkv");
  const c10::cuda::CUDAGuard guard(qkv_in.device());
  const QkArgs g = qk_args(qkv_in, heads, wq_in, wk_in, cos_in, sin_in, eps, op);
  TORCH_CHECK(g.Dh <= 256, "diffcurr_fast_C::", op, ": the CUDA kernel takes head dims up to 256, got ", g.Dh);
  at::Tensor outs[3];
  for (at::Tensor& o : outs) o = at::empty({g.B, g.H, g.N, g.Dh}, g.qkv.options());
  cuda::QkCall c{};
  c.dt = g.dt;
  c.backward = false;
  const float* w[3] = {g.ptr(g.wq), g.ptr(g.wk), nullptr};
  for (int64_t p = 0; p < 3; ++p) {
    c.part[p] = cuda::QkPart{packed_part(g.qkv, p, g.H, g.Dh), g.qkv.stride(0), g.Dh, g.qkv.stride(1), nullptr, 0, 0, 0,
                             outs[p].mutable_data_ptr(), outs[p].stride(0), outs[p].stride(1), outs[p].stride(2),
                             w[p], p < 2 && g.cos.defined() ? 1 : 0};
  }
  c.cos = g.ptr(g.cos);
  c.sin = g.ptr(g.sin);
  c.tab_b = g.tab_b;
  c.B = g.B;
  c.H = g.H;
  c.N = g.N;
  c.Dh = g.Dh;
  c.eps = static_cast<float>(eps);
  DC_CUDA_OK(op, cuda::qk_norm_rope(c, stream_of(g.qkv)));
  return {outs[0], outs[1], outs[2]};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> qk_norm_rope_bwd_cuda(
    const at::Tensor& gq_in, const at::Tensor& gk_in, const at::Tensor& gv_in, const at::Tensor& qkv_in,
    int64_t heads, const c10::optional<at::Tensor>& wq_in, const c10::optional<at::Tensor>& wk_in,
    const c10::optional<at::Tensor>& cos_in, const c10::optional<at::Tensor>& sin_in, double eps, bool weight_grads) {
  const char* op = "qk_norm_rope_bwd";
  check_cuda(qkv_in, op, "qkv");
  const c10::cuda::CUDAGuard guard(qkv_in.device());
  const QkArgs g = qk_args(qkv_in, heads, wq_in, wk_in, cos_in, sin_in, eps, op);
  TORCH_CHECK(g.Dh <= 256, "diffcurr_fast_C::", op, ": the CUDA kernel takes head dims up to 256, got ", g.Dh);
  const at::Tensor like = at::empty({g.B, g.H, g.N, g.Dh}, g.qkv.options());
  const at::Tensor* given[3] = {&gq_in, &gk_in, &gv_in};
  const char* names[3] = {"grad_q", "grad_k", "grad_v"};
  at::Tensor grads[3];
  for (int p = 0; p < 3; ++p) {
    check_like(*given[p], like, op, names[p], "(B, heads, N, head_dim) of qkv");
    grads[p] = unit_last(*given[p]);
  }
  at::Tensor gqkv = at::empty({g.B, g.N, 3 * g.H * g.Dh}, g.qkv.options());
  const bool wgrad = weight_grads && g.wq.defined();
  const auto fopts = g.qkv.options().dtype(at::kFloat);
  at::Tensor gwq = at::zeros({wgrad ? g.Dh : 0}, fopts), gwk = at::zeros({wgrad ? g.Dh : 0}, fopts);
  at::Tensor scratch = at::empty({wgrad ? cuda::qk_norm_rope_scratch_size(g.B, g.H, g.N, g.Dh) : 0}, fopts);
  cuda::QkCall c{};
  c.dt = g.dt;
  c.backward = true;
  const float* w[3] = {g.ptr(g.wq), g.ptr(g.wk), nullptr};
  for (int64_t p = 0; p < 3; ++p) {
    c.part[p] = cuda::QkPart{grads[p].const_data_ptr(), grads[p].stride(0), grads[p].stride(1), grads[p].stride(2),
                             packed_part(g.qkv, p, g.H, g.Dh), g.qkv.stride(0), g.Dh, g.qkv.stride(1),
                             static_cast<char*>(gqkv.mutable_data_ptr()) + p * g.H * g.Dh * gqkv.element_size(),
                             gqkv.stride(0), g.Dh, gqkv.stride(1), w[p], p < 2 && g.cos.defined() ? 1 : 0};
  }
  c.cos = g.ptr(g.cos);
  c.sin = g.ptr(g.sin);
  c.tab_b = g.tab_b;
  c.B = g.B;
  c.H = g.H;
  c.N = g.N;
  c.Dh = g.Dh;
  c.eps = static_cast<float>(eps);
  c.scratch = wgrad ? scratch.mutable_data_ptr<float>() : nullptr;
  c.gwq = wgrad ? gwq.mutable_data_ptr<float>() : nullptr;
  c.gwk = wgrad ? gwk.mutable_data_ptr<float>() : nullptr;
  DC_CUDA_OK(op, cuda::qk_norm_rope(c, stream_of(g.qkv)));
  if (!wgrad) return {gqkv, at::empty({0}, qkv_in.options()), at::empty({0}, qkv_in.options())};
  return {gqkv, gwq.to(wq_in->scalar_type()), gwk.to(wk_in->scalar_type())};
}

at::Tensor swiglu_fwd_cuda(const at::Tensor& x_in) {
  const char* op = "swiglu_fwd";
  check_cuda(x_in, op, "x");
  const c10::cuda::CUDAGuard guard(x_in.device());
  const int64_t H = swiglu_half(x_in, op);
  const int dt = dtype_code(x_in, op, "x");
  const at::Tensor x = x_in.contiguous();
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = H;
  at::Tensor y = at::empty(shape, x.options());
  const int64_t R = H > 0 ? y.numel() / H : 0;
  DC_CUDA_OK(op, cuda::swiglu(dt, x.const_data_ptr(), nullptr, y.mutable_data_ptr(), R, H, stream_of(x)));
  return y;
}

at::Tensor swiglu_bwd_cuda(const at::Tensor& gy_in, const at::Tensor& x_in) {
  const char* op = "swiglu_bwd";
  check_cuda(x_in, op, "x");
  const c10::cuda::CUDAGuard guard(x_in.device());
  const int64_t H = swiglu_half(x_in, op);
  const int dt = dtype_code(x_in, op, "x");
  check_device(gy_in, x_in, op, "grad_y");
  std::vector<int64_t> shape(x_in.sizes().begin(), x_in.sizes().end());
  shape.back() = H;
  TORCH_CHECK(gy_in.sizes() == c10::IntArrayRef(shape) && gy_in.scalar_type() == x_in.scalar_type(),
              "diffcurr_fast_C::", op, ": grad_y must have shape ", c10::IntArrayRef(shape), " and dtype ",
              x_in.scalar_type(), ", got ", gy_in.sizes(), " ", gy_in.scalar_type());
  const at::Tensor x = x_in.contiguous(), gy = gy_in.contiguous();
  at::Tensor gx = at::empty(x.sizes(), x.options());
  const int64_t R = H > 0 ? gy.numel() / H : 0;
  DC_CUDA_OK(op, cuda::swiglu(dt, x.const_data_ptr(), gy.const_data_ptr(), gx.mutable_data_ptr(), R, H, stream_of(x)));
  return gx;
}

// ---- token routing: nothing is checked on the device (launch.h); the position map is a (B, T) int32 scratch
int64_t elem_bytes(const RouteArgs& g) { return g.dt == 0 ? 4 : 2; }

at::Tensor route_positions(const RouteArgs& g, const char* op) {
  at::Tensor pos = at::empty({g.B, g.T}, g.idx.options().dtype(at::kInt));
  DC_CUDA_OK(op, cuda::token_positions(g.idx.const_data_ptr<int64_t>(), pos.mutable_data_ptr<int32_t>(), g.B, g.T,
                                       g.K, stream_of(g.idx)));
  return pos;
}

at::Tensor token_gather_cuda(const at::Tensor& x_in, const at::Tensor& idx_in) {
  const char* op = "token_gather";
  check_cuda(x_in, op, "x");
  const c10::cuda::CUDAGuard guard(x_in.device());
  const RouteArgs g = token_gather_args(x_in, idx_in, op);
  at::Tensor out = at::empty({g.B, g.K, g.D}, g.rows.options());
  DC_CUDA_OK(op, cuda::token_gather(elem_bytes(g), g.rows.const_data_ptr(), g.idx.const_data_ptr<int64_t>(),
                                    out.mutable_data_ptr(), g.B, g.T, g.K, g.D, stream_of(g.rows)));
  return out;
}

at::Tensor token_scatter_cuda(const c10::optional<at::Tensor>& base_in, const at::Tensor& idx_in,
                              const at::Tensor& src_in, int64_t tokens) {
  const char* op = "token_scatter";
  check_cuda(src_in, op, "src");
  const c10::cuda::CUDAGuard guard(src_in.device());
  const RouteArgs g = token_scatter_args(base_in, idx_in, src_in, tokens, op);
  const at::Tensor base = optional_contig(base_in);
  at::Tensor out = at::empty({g.B, g.T, g.D}, g.rows.options());
  const at::Tensor pos = route_positions(g, op);
  DC_CUDA_OK(op, cuda::token_scatter(elem_bytes(g), base.defined() ? base.const_data_ptr() : nullptr,
                                     pos.const_data_ptr<int32_t>(), g.rows.const_data_ptr(), out.mutable_data_ptr(),
                                     g.B, g.T, g.K, g.D, stream_of(g.rows)));
  return out;
}

std::tuple<at::Tensor, at::Tensor> token_scatter_bwd_cuda(const at::Tensor& go_in, const at::Tensor& idx_in) {
  const char* op = "token_scatter_bwd";
  check_cuda(go_in, op, "grad_out");
  const c10::cuda::CUDAGuard guard(go_in.device());
  const RouteArgs g = token_scatter_bwd_args(go_in, idx_in, op);
  at::Tensor gbase = at::empty({g.B, g.T, g.D}, g.rows.options());
  at::Tensor gsrc = at::empty({g.B, g.K, g.D}, g.rows.options());
  const at::Tensor pos = route_positions(g, op);
  DC_CUDA_OK(op, cuda::token_scatter_bwd(elem_bytes(g), g.rows.const_data_ptr(), pos.const_data_ptr<int32_t>(),
                                         gbase.mutable_data_ptr(), gsrc.mutable_data_ptr(), g.B, g.T, g.K, g.D,
                                         stream_of(g.rows)));
  return {gbase, gsrc};
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
  m.impl("rmsnorm_modulate_fwd", &dcf::rmsnorm_modulate_fwd_cuda);
  m.impl("rmsnorm_modulate_bwd", &dcf::rmsnorm_modulate_bwd_cuda);
  m.impl("qk_norm_rope_fwd", &dcf::qk_norm_rope_fwd_cuda);
  m.impl("qk_norm_rope_bwd", &dcf::qk_norm_rope_bwd_cuda);
  m.impl("swiglu_fwd", &dcf::swiglu_fwd_cuda);
  m.impl("swiglu_bwd", &dcf::swiglu_bwd_cuda);
  m.impl("token_gather", &dcf::token_gather_cuda);
  m.impl("token_scatter", &dcf::token_scatter_cuda);
  m.impl("token_scatter_bwd", &dcf::token_scatter_bwd_cuda);
}

#endif  // DIFFCURR_WITH_CUDA
