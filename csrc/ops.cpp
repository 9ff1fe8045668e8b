// The raw ops of diffcurr_fast (schemas in the `diffcurr_fast_C` torch library) and their CPU implementations.
// Definitions: docs/ops.md. No autograd here: the Python layer (diffcurr_fast/ops) wraps these ops.
// Work is split over at::parallel_for; the fused, vectorised loops are in csrc/cpu/kernels_impl.h.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "checks.h"
#include "cpu/kernels.h"
#include "dc_math.h"

namespace dcf {
namespace {

constexpr int64_t kElemGrain = 32768;  // elements per parallel task for elementwise ops
constexpr int64_t kLossSegment = 16384;  // columns per partial sum of the loss
constexpr int64_t kRowChunk = 64;        // rows per partial sum of the (B, D) gradients

const cpu::KernelTable& K() { return cpu::kernels(); }

void check_cpu(const at::Tensor& t, const char* op, const char* name) {
  TORCH_CHECK(t.device().is_cpu(), "diffcurr_fast_C::", op, " (CPU kernel): ", name, " must be a CPU tensor, got ",
              t.device());
}

at::Tensor randn_cpu(int64_t seed, c10::IntArrayRef shape) {
  for (int64_t s : shape) {
    TORCH_CHECK(s >= 0, "diffcurr_fast_C::randn: shape must be non-negative, got ", shape);
  }
  at::Tensor out = at::empty(shape, at::TensorOptions().dtype(at::kFloat));
  const int64_t n = out.numel();
  float* o = out.data_ptr<float>();
  const auto useed = static_cast<uint64_t>(seed);
  at::parallel_for(0, n, kElemGrain, [&](int64_t begin, int64_t end) { K().randn(useed, begin, end - begin, o + begin); });
  return out;
}

at::Tensor randn_like_cpu(const at::Tensor& like, int64_t seed) {
  check_cpu(like, "randn_like", "like");
  return randn_cpu(seed, like.sizes());
}

at::Tensor q_sample_cpu(const at::Tensor& x0_in, const at::Tensor& a_in, const at::Tensor& c_in,
                        const c10::optional<at::Tensor>& noise_in, int64_t seed) {
  check_cpu(x0_in, "q_sample", "x0");
  const QSampleArgs g = q_sample_args(x0_in, a_in, c_in, noise_in, "q_sample");
  at::Tensor out = at::empty(g.x0.sizes(), g.x0.options());
  const int64_t total = g.x0.numel();
  if (total == 0) return out;
  const void* np = g.noise_ptr();
  const void* xp = g.x0.const_data_ptr();
  void* op_ = out.mutable_data_ptr();
  const float* ap = g.a.const_data_ptr<float>();
  const float* cp = g.c.const_data_ptr<float>();
  const auto useed = static_cast<uint64_t>(seed);
  at::parallel_for(0, total, kElemGrain, [&](int64_t begin, int64_t end) {
    K().q_sample(g.dt, xp, g.ndt, np, ap, cp, op_, g.M, useed, begin, end - begin);
  });
  return out;
}

std::tuple<at::Tensor, at::Tensor> diffusion_loss_fwd_cpu(const at::Tensor& pred_in, const at::Tensor& x0_in,
                                                          const c10::optional<at::Tensor>& noise_in, int64_t seed,
                                                          const at::Tensor& p_in, const at::Tensor& q_in,
                                                          const at::Tensor& w_in, bool with_grad,
                                                          double grad_scale) {
  check_cpu(pred_in, "diffusion_loss_fwd", "pred");
  const LossArgs g = loss_args(pred_in, x0_in, noise_in, p_in, q_in, w_in, "diffusion_loss_fwd");
  const int64_t B = g.B, M = g.M;
  const at::Tensor& pred = g.pred;
  at::Tensor loss = at::empty({B}, pred.options().dtype(at::kFloat));
  at::Tensor grad = with_grad ? at::empty(pred.sizes(), pred.options()) : at::empty({0}, pred.options());
  if (B == 0) return {loss, grad};
  if (M == 0) {
    loss.zero_();
    return {loss, grad};
  }
  const int64_t nseg = (M + kLossSegment - 1) / kLossSegment;
  std::vector<double> partial(static_cast<size_t>(B * nseg), 0.0);
  const void* np = g.noise_ptr();
  const void* pp = pred.const_data_ptr();
  const void* xp = g.x0.const_data_ptr();
  void* gp = with_grad ? grad.mutable_data_ptr() : nullptr;
  const float* pv = g.p.const_data_ptr<float>();
  const float* qv = g.q.const_data_ptr<float>();
  const float* wv = g.w.const_data_ptr<float>();
  const auto useed = static_cast<uint64_t>(seed);
  const auto gs = static_cast<float>(grad_scale);
  const int64_t grain = std::max<int64_t>(1, kElemGrain / std::min(M, kLossSegment));
  at::parallel_for(0, B * nseg, grain, [&](int64_t begin, int64_t end) {
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / nseg;
      const int64_t j0 = (task % nseg) * kLossSegment;
      const int64_t n = std::min(kLossSegment, M - j0);
      partial[static_cast<size_t>(task)] = K().loss(g.dt, pp, g.pred_stride, xp, g.ndt, np, pv, qv, wv, gs, gp, M, useed, b, j0, n);
    }
  });
  // loss[b] = w[b] * (1/M) sum_j (pred - tgt)^2   (docs/ops.md, diffusion_loss)
  float* lp = loss.mutable_data_ptr<float>();
  for (int64_t b = 0; b < B; ++b) {
    double s = 0.0;
    for (int64_t k = 0; k < nseg; ++k) s += partial[static_cast<size_t>(b * nseg + k)];
    lp[b] = static_cast<float>(static_cast<double>(wv[b]) * s / static_cast<double>(M));
  }
  return {loss, grad};
}

template <class W>
void sample_timesteps_impl(const W* w, int64_t T, int64_t batch, uint64_t seed, int64_t* t_out, float* imp_out) {
  std::vector<double> cdf(static_cast<size_t>(T));
  double acc = 0.0;
  for (int64_t k = 0; k < T; ++k) {
    const double v = static_cast<double>(w[k]);
    TORCH_CHECK(std::isfinite(v) && v >= 0.0, "diffcurr_fast_C::sample_timesteps: weights must be finite and >= 0, got ",
                v, " at index ", k);
    acc += v;
    cdf[static_cast<size_t>(k)] = acc;
  }
  TORCH_CHECK(acc > 0.0, "diffcurr_fast_C::sample_timesteps: weights must have a positive sum, got ", acc);
  const double total = acc;
  const double mean_w = total / static_cast<double>(T);
  at::parallel_for(0, batch, 4096, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) {
      uint32_t r[4];
      philox4x32_10(static_cast<uint32_t>(b), static_cast<uint32_t>(static_cast<uint64_t>(b) >> 32), 0u, 0u,
                    static_cast<uint32_t>(seed), static_cast<uint32_t>(seed >> 32), r);
      const double target = static_cast<double>(uniform01(r[0])) * total;
      // t_b = smallest k with cdf[k] > u_b * cdf[T-1]: k < T with w[k] > 0, since u_b <= 1 - 2^-24
      const int64_t k = std::upper_bound(cdf.begin(), cdf.end(), target) - cdf.begin();
      t_out[b] = k;
      imp_out[b] = static_cast<float>(mean_w / static_cast<double>(w[k]));  // imp_b = (cdf[T-1] / T) / w[t_b]
    }
  });
}

std::tuple<at::Tensor, at::Tensor> sample_timesteps_cpu(const at::Tensor& weights_in, int64_t batch_size,
                                                        int64_t seed) {
  const char* op = "sample_timesteps";
  check_cpu(weights_in, op, "weights");
  check_weights(weights_in, op);
  TORCH_CHECK(batch_size >= 0, "diffcurr_fast_C::sample_timesteps: batch_size must be >= 0, got ", batch_size);
  const at::Tensor weights = weights_in.contiguous();
  at::Tensor t = at::empty({batch_size}, weights.options().dtype(at::kLong));
  at::Tensor imp = at::empty({batch_size}, weights.options().dtype(at::kFloat));
  const int64_t T = weights.size(0);
  const auto useed = static_cast<uint64_t>(seed);
  if (weights.scalar_type() == at::kDouble) {
    sample_timesteps_impl(weights.const_data_ptr<double>(), T, batch_size, useed, t.mutable_data_ptr<int64_t>(),
                          imp.mutable_data_ptr<float>());
  } else {
    sample_timesteps_impl(weights.const_data_ptr<float>(), T, batch_size, useed, t.mutable_data_ptr<int64_t>(),
                          imp.mutable_data_ptr<float>());
  }
  return {t, imp};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> adaln_modulate_fwd_cpu(const at::Tensor& x_in,
                                                                      const at::Tensor& shift_in,
                                                                      const at::Tensor& scale_in, double eps) {
  check_cpu(x_in, "adaln_modulate_fwd", "x");
  const BlockArgs g = adaln_fwd_args(x_in, shift_in, scale_in, eps, "adaln_modulate_fwd");
  const at::Tensor &x = g.x, &shift = g.v1, &scale = g.v2;
  const int64_t B = g.B, N = g.N, D = g.D;
  const int dt = g.dt;
  at::Tensor y = at::empty(x.sizes(), x.options());
  at::Tensor mean = at::empty({B, N}, x.options().dtype(at::kFloat));
  at::Tensor rstd = at::empty({B, N}, x.options().dtype(at::kFloat));
  if (x.numel() == 0) {
    if (mean.numel() > 0) {
      mean.zero_();
      rstd.fill_(1.0 / std::sqrt(eps));
    }
    return {y, mean, rstd};
  }
  const void* xp = x.const_data_ptr();
  const float* shp = shift.const_data_ptr<float>();
  const float* scp = scale.const_data_ptr<float>();
  void* yp = y.mutable_data_ptr();
  float* mp = mean.mutable_data_ptr<float>();
  float* rp = rstd.mutable_data_ptr<float>();
  const auto feps = static_cast<float>(eps);
  at::parallel_for(0, B * N, std::max<int64_t>(1, kElemGrain / D), [&](int64_t begin, int64_t end) {
    K().adaln_fwd(dt, xp, shp, scp, yp, mp, rp, N, D, feps, begin, end - begin);
  });
  return {y, mean, rstd};
}

// Runs body(b, n0, nrows, acc) over (sample, chunk of kRowChunk rows) tasks in parallel, each with its own
// zeroed accumulator of nout * D floats, then writes the sums over chunks (fixed order, so independent of the
// thread count) into nout separate float32 (B, D) tensors: output k holds acc[k * D .. (k + 1) * D).
template <class Body>
std::vector<at::Tensor> chunked_row_reduce(int64_t B, int64_t N, int64_t D, int64_t nout, Body&& body) {
  const int64_t width = nout * D;
  const int64_t nchunk = std::max<int64_t>(1, (N + kRowChunk - 1) / kRowChunk);
  std::vector<float> part(static_cast<size_t>(B * nchunk * width), 0.0f);
  at::parallel_for(0, B * nchunk, 1, [&](int64_t begin, int64_t end) {
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / nchunk;
      const int64_t n0 = (task % nchunk) * kRowChunk;
      const int64_t nrows = std::min(kRowChunk, N - n0);
      if (nrows > 0) body(b, n0, nrows, part.data() + task * width);
    }
  });
  std::vector<at::Tensor> outs;
  outs.reserve(static_cast<size_t>(nout));
  for (int64_t k = 0; k < nout; ++k) {
    at::Tensor out = at::empty({B, D}, at::TensorOptions().dtype(at::kFloat));
    float* o = out.mutable_data_ptr<float>();
    for (int64_t b = 0; b < B; ++b) {
      float* ob = o + b * D;
      const float* src = part.data() + b * nchunk * width + k * D;
      for (int64_t d = 0; d < D; ++d) ob[d] = src[d];
      for (int64_t c = 1; c < nchunk; ++c) {
        const float* pc = src + c * width;
        for (int64_t d = 0; d < D; ++d) ob[d] += pc[d];
      }
    }
    outs.push_back(std::move(out));
  }
  return outs;
}

// affine_grads == false: grad_x only; gshift and gscale come back empty (shape (0,)).
std::tuple<at::Tensor, at::Tensor, at::Tensor> adaln_modulate_bwd_cpu(const at::Tensor& gy_in, const at::Tensor& x_in,
                                                                      const at::Tensor& scale_in,
                                                                      const at::Tensor& mean_in,
                                                                      const at::Tensor& rstd_in, bool affine_grads) {
  check_cpu(x_in, "adaln_modulate_bwd", "x");
  const AdalnBwdArgs g = adaln_bwd_args(gy_in, x_in, scale_in, mean_in, rstd_in, "adaln_modulate_bwd");
  const at::Tensor &x = g.x, &gy = g.gy, &scale = g.scale, &mean = g.mean, &rstd = g.rstd;
  const int64_t B = g.B, N = g.N, D = g.D;
  const int dt = g.dt;
  at::Tensor gx = at::empty(x.sizes(), x.options());
  const void* gyp = gy.const_data_ptr();
  const void* xp = x.const_data_ptr();
  const float* scp = scale.const_data_ptr<float>();
  const float* mp = mean.const_data_ptr<float>();
  const float* rp = rstd.const_data_ptr<float>();
  void* gxp = gx.mutable_data_ptr();
  // grad_shift = sum_n grad_y, grad_scale = sum_n grad_y * xhat   (docs/ops.md, adaLN backward)
  if (!affine_grads) {
    const int64_t nchunk = (N + kRowChunk - 1) / kRowChunk;
    at::parallel_for(0, B * nchunk, 1, [&](int64_t begin, int64_t end) {
      for (int64_t task = begin; task < end; ++task) {
        const int64_t n0 = (task % nchunk) * kRowChunk;
        K().adaln_bwd(dt, gyp, xp, scp, mp, rp, gxp, nullptr, nullptr, N, D, task / nchunk, n0,
                      std::min(kRowChunk, N - n0));
      }
    });
    return {gx, at::empty({0}, scale_in.options()), at::empty({0}, scale_in.options())};
  }
  // grad_shift and grad_scale are separate buffers (never views of one allocation)
  const std::vector<at::Tensor> sums =
      chunked_row_reduce(B, N, D, 2, [&](int64_t b, int64_t n0, int64_t nrows, float* acc) {
        K().adaln_bwd(dt, gyp, xp, scp, mp, rp, gxp, acc, acc + D, N, D, b, n0, nrows);
      });
  return {gx, sums[0].to(scale_in.scalar_type()), sums[1].to(scale_in.scalar_type())};
}

at::Tensor gated_residual_fwd_cpu(const at::Tensor& x_in, const at::Tensor& gate_in, const at::Tensor& y_in) {
  check_cpu(x_in, "gated_residual_fwd", "x");
  const BlockArgs g = gated_fwd_args(x_in, gate_in, y_in, "gated_residual_fwd");
  const at::Tensor &x = g.x, &y = g.other, &gate = g.v1;
  const int64_t B = g.B, N = g.N, D = g.D;
  const int dt = g.dt;
  at::Tensor out = at::empty(x.sizes(), x.options());
  if (x.numel() == 0) return out;
  const void* xp = x.const_data_ptr();
  const void* yp = y.const_data_ptr();
  const float* gp = gate.const_data_ptr<float>();
  void* outp = out.mutable_data_ptr();
  at::parallel_for(0, B * N, std::max<int64_t>(1, kElemGrain / D), [&](int64_t begin, int64_t end) {
    K().gated_fwd(dt, xp, gp, yp, outp, N, D, begin, end - begin);
  });
  return out;
}

// grad_x of gated_residual is grad_out itself: the caller passes it through, so no copy is made here.
std::tuple<at::Tensor, at::Tensor> gated_residual_bwd_cpu(const at::Tensor& go_in, const at::Tensor& gate_in,
                                                          const at::Tensor& y_in) {
  check_cpu(y_in, "gated_residual_bwd", "y");
  const BlockArgs g = gated_bwd_args(go_in, gate_in, y_in, "gated_residual_bwd");
  const at::Tensor &y = g.x, &go = g.other, &gate = g.v1;
  const int64_t B = g.B, N = g.N, D = g.D;
  const int dt = g.dt;
  at::Tensor gy = at::empty(y.sizes(), y.options());
  const void* gop = go.const_data_ptr();
  const void* yp = y.const_data_ptr();
  const float* gp = gate.const_data_ptr<float>();
  void* gyp = gy.mutable_data_ptr();
  // grad_gate = sum_n grad_out * y, grad_y = gate * grad_out
  const std::vector<at::Tensor> ggate =
      chunked_row_reduce(B, N, D, 1, [&](int64_t b, int64_t n0, int64_t nrows, float* acc) {
        K().gated_bwd(dt, gop, gp, yp, gyp, acc, N, D, b, n0, nrows);
      });
  return {ggate[0].to(gate_in.scalar_type()), gy};
}

// tanh-GELU and its input gradient, elementwise over contiguous buffers (kernels.h).
at::Tensor gelu_tanh_fwd_cpu(const at::Tensor& x_in) {
  check_cpu(x_in, "gelu_tanh_fwd", "x");
  const at::Tensor x = x_in.contiguous();
  const int dt = dtype_code(x, "gelu_tanh_fwd", "x");
  at::Tensor y = at::empty(x.sizes(), x.options());
  const void* xp = x.const_data_ptr();
  void* yp = y.mutable_data_ptr();
  at::parallel_for(0, x.numel(), kElemGrain, [&](int64_t begin, int64_t end) {
    K().gelu_tanh_fwd(dt, xp, yp, begin, end - begin);
  });
  return y;
}

at::Tensor gelu_tanh_bwd_cpu(const at::Tensor& gy_in, const at::Tensor& x_in) {
  check_cpu(x_in, "gelu_tanh_bwd", "x");
  check_cpu(gy_in, "gelu_tanh_bwd", "grad_y");
  TORCH_CHECK(gy_in.sizes() == x_in.sizes() && gy_in.scalar_type() == x_in.scalar_type(),
              "diffcurr_fast_C::gelu_tanh_bwd: grad_y must match x in shape and dtype, got ", gy_in.sizes(), " ",
              gy_in.scalar_type(), " and ", x_in.sizes(), " ", x_in.scalar_type());
  const at::Tensor x = x_in.contiguous(), gy = gy_in.contiguous();
  const int dt = dtype_code(x, "gelu_tanh_bwd", "x");
  at::Tensor gx = at::empty(x.sizes(), x.options());
  const void* xp = x.const_data_ptr();
  const void* gp = gy.const_data_ptr();
  void* gxp = gx.mutable_data_ptr();
  at::parallel_for(0, x.numel(), kElemGrain, [&](int64_t begin, int64_t end) {
    K().gelu_tanh_bwd(dt, gp, xp, gxp, begin, end - begin);
  });
  return gx;
}

// ---- token routing (row copies; docs/ops.md) ---------------------------------------------------------------
// Checks every index of idx (B, K) against [0, T) (an out-of-range index would read or write outside the tensors).
void check_route_range(const int64_t* idx, int64_t B, int64_t T, int64_t K, const char* op) {
  for (int64_t i = 0; i < B * K; ++i) {
    TORCH_CHECK(idx[i] >= 0 && idx[i] < T, "diffcurr_fast_C::", op, ": idx[", i / K, ", ", i % K, "] = ", idx[i],
                " is outside [0, ", T, ")");
  }
}

// The inverse map of idx: (B, T) int32 with pos[b, idx[b, k]] = k and -1 at the tokens not kept. Checks that the
// indices lie in [0, T) and that those of one sample are distinct (each row of the scatter has one source).
std::vector<int32_t> route_positions(const int64_t* idx, int64_t B, int64_t T, int64_t K, const char* op) {
  check_route_range(idx, B, T, K, op);
  std::vector<int32_t> pos(static_cast<size_t>(B * T), -1);
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t k = 0; k < K; ++k) {
      int32_t& p = pos[static_cast<size_t>(b * T + idx[b * K + k])];
      TORCH_CHECK(p < 0, "diffcurr_fast_C::", op, ": the indices of sample ", b, " must be distinct; token ",
                  idx[b * K + k], " is kept twice");
      p = static_cast<int32_t>(k);
    }
  }
  return pos;
}

int64_t row_grain(int64_t D) { return std::max<int64_t>(1, kElemGrain / std::max<int64_t>(1, D)); }

// ---- the modern block: RMSNorm-modulate, QK-norm + 2-D RoPE, SwiGLU (docs/ops.md) -------------------------
std::tuple<at::Tensor, at::Tensor> rmsnorm_modulate_fwd_cpu(const at::Tensor& x_in, const at::Tensor& shift_in,
                                                            const at::Tensor& scale_in,
                                                            const c10::optional<at::Tensor>& weight_in, double eps) {
  const char* op = "rmsnorm_modulate_fwd";
  check_cpu(x_in, op, "x");
  const RmsArgs g = rms_fwd_args(x_in, shift_in, scale_in, weight_in, eps, op);
  const int64_t B = g.B, N = g.N, D = g.D;
  at::Tensor y = at::empty(g.x.sizes(), g.x.options());
  at::Tensor rstd = at::empty({B, N}, g.x.options().dtype(at::kFloat));
  if (g.x.numel() == 0) {
    if (rstd.numel() > 0) rstd.fill_(1.0 / std::sqrt(eps));
    return {y, rstd};
  }
  const void* xp = g.x.const_data_ptr();
  const float* shp = g.shift.const_data_ptr<float>();
  const float* scp = g.scale.const_data_ptr<float>();
  const float* wp = g.weight_ptr();
  void* yp = y.mutable_data_ptr();
  float* rp = rstd.mutable_data_ptr<float>();
  const auto feps = static_cast<float>(eps);
  at::parallel_for(0, B * N, row_grain(D), [&](int64_t begin, int64_t end) {
    K().rmsnorm_fwd(g.dt, xp, shp, scp, wp, yp, rp, N, D, feps, begin, end - begin);
  });
  return {y, rstd};
}

// affine_grads == false: grad_x only (the others empty, shape (0,)). grad_weight is empty without a weight.
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> rmsnorm_modulate_bwd_cpu(
    const at::Tensor& gy_in, const at::Tensor& x_in, const at::Tensor& scale_in,
    const c10::optional<at::Tensor>& weight_in, const at::Tensor& rstd_in, bool affine_grads) {
  const char* op = "rmsnorm_modulate_bwd";
  check_cpu(x_in, op, "x");
  const RmsArgs g = rms_bwd_args(gy_in, x_in, scale_in, weight_in, rstd_in, op);
  const int64_t B = g.B, N = g.N, D = g.D;
  at::Tensor gx = at::empty(g.x.sizes(), g.x.options());
  const void* gyp = g.gy.const_data_ptr();
  const void* xp = g.x.const_data_ptr();
  const float* scp = g.scale.const_data_ptr<float>();
  const float* wp = g.weight_ptr();
  const float* rp = g.rstd.const_data_ptr<float>();
  void* gxp = gx.mutable_data_ptr();
  auto none = [&] { return at::empty({0}, scale_in.options()); };  // a fresh one each (outputs never alias)
  if (!affine_grads) {
    const int64_t nchunk = (N + kRowChunk - 1) / kRowChunk;
    at::parallel_for(0, B * nchunk, 1, [&](int64_t begin, int64_t end) {
      for (int64_t task = begin; task < end; ++task) {
        const int64_t n0 = (task % nchunk) * kRowChunk;
        K().rmsnorm_bwd(g.dt, gyp, xp, scp, wp, rp, gxp, nullptr, nullptr, N, D, task / nchunk, n0,
                        std::min(kRowChunk, N - n0));
      }
    });
    return {gx, none(), none(), none()};
  }
  // grad_shift = sum_n grad_y; S = sum_n grad_y * xhat; grad_scale = S * w; grad_w = sum_b (1 + scale) * S
  std::vector<at::Tensor> sums = chunked_row_reduce(B, N, D, 2, [&](int64_t b, int64_t n0, int64_t nrows, float* acc) {
    K().rmsnorm_bwd(g.dt, gyp, xp, scp, wp, rp, gxp, acc, acc + D, N, D, b, n0, nrows);
  });
  at::Tensor gw = none();
  if (wp != nullptr) {
    at::Tensor gwf = at::empty({D}, at::TensorOptions().dtype(at::kFloat));
    float* o = gwf.mutable_data_ptr<float>();
    const float* s = sums[1].const_data_ptr<float>();
    for (int64_t d = 0; d < D; ++d) o[d] = 0.0f;
    for (int64_t b = 0; b < B; ++b) {
      for (int64_t d = 0; d < D; ++d) o[d] += (1.0f + scp[b * D + d]) * s[b * D + d];
    }
    float* sp = sums[1].mutable_data_ptr<float>();
    for (int64_t b = 0; b < B; ++b) {
      for (int64_t d = 0; d < D; ++d) sp[b * D + d] *= wp[d];
    }
    gw = gwf.to(weight_in->scalar_type());
  }
  return {gx, sums[0].to(scale_in.scalar_type()), sums[1].to(scale_in.scalar_type()), gw};
}

constexpr int64_t kQkRowChunk = 128;  // rows (one head of one token) per partial sum of the weight gradients

// The rows of part p (0 q, 1 k, 2 v) of a packed (B, N, 3 H Dh) projection, and of a (B, H, N, Dh) tensor.
cpu::RowLayout packed_layout(const at::Tensor& qkv, int64_t H, int64_t Dh) {
  return {H, qkv.size(1), Dh, qkv.stride(0), Dh, qkv.stride(1)};
}
cpu::RowLayout heads_layout(const at::Tensor& t) {
  return {t.size(1), t.size(2), t.size(3), t.stride(0), t.stride(1), t.stride(2)};
}

// The rotary tables expanded to one entry per channel, as the CPU kernels read them (csrc/cpu/kernels.h):
// ce[.., 2m] = ce[.., 2m + 1] = cos[.., m], se[.., 2m] = -sin[.., m], se[.., 2m + 1] = sin[.., m]; rows of Dh
// (their sample stride: N Dh for per-sample tables, 0 for one table). Undefined without tables.
struct ExpandedTables {
  at::Tensor ce, se;
  int64_t tab_b = 0;
};

ExpandedTables expand_tables(const QkArgs& g) {
  ExpandedTables t;
  if (!g.cos.defined()) return t;
  const int64_t rows = g.cos.numel() / (g.Dh / 2);
  t.ce = at::empty({rows, g.Dh}, g.cos.options());
  t.se = at::empty({rows, g.Dh}, g.cos.options());
  const float *c = g.cos.const_data_ptr<float>(), *s = g.sin.const_data_ptr<float>();
  float *ce = t.ce.mutable_data_ptr<float>(), *se = t.se.mutable_data_ptr<float>();
  for (int64_t i = 0; i < rows * (g.Dh / 2); ++i) {
    ce[2 * i] = ce[2 * i + 1] = c[i];
    se[2 * i] = -s[i];
    se[2 * i + 1] = s[i];
  }
  t.tab_b = g.tab_b != 0 ? g.N * g.Dh : 0;
  return t;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> qk_norm_rope_fwd_cpu(
    const at::Tensor& qkv_in, int64_t heads, const c10::optional<at::Tensor>& wq_in,
    const c10::optional<at::Tensor>& wk_in, const c10::optional<at::Tensor>& cos_in,
    const c10::optional<at::Tensor>& sin_in, double eps) {
  const char* op = "qk_norm_rope_fwd";
  check_cpu(qkv_in, op, "qkv");
  const QkArgs g = qk_args(qkv_in, heads, wq_in, wk_in, cos_in, sin_in, eps, op);
  at::Tensor outs[3];
  for (at::Tensor& o : outs) o = at::empty({g.B, g.H, g.N, g.Dh}, g.qkv.options());
  const int64_t R = g.B * g.H * g.N;
  if (R == 0 || g.Dh == 0) return {outs[0], outs[1], outs[2]};
  const cpu::RowLayout il = packed_layout(g.qkv, g.H, g.Dh), ol = heads_layout(outs[0]);
  const auto* base = static_cast<const char*>(g.qkv.const_data_ptr());
  const int64_t part_bytes = g.H * g.Dh * g.qkv.element_size();
  const float* w[3] = {g.ptr(g.wq), g.ptr(g.wk), nullptr};
  const ExpandedTables t = expand_tables(g);
  const float *cp = g.ptr(t.ce), *sp = g.ptr(t.se);
  const auto feps = static_cast<float>(eps);
  // each thread's rows in all three parts (q and k normed and rotated, v copied into its heads layout), so that the
  // threads share the cheap v rows and the costly q, k rows alike
  at::parallel_for(0, R, row_grain(3 * g.Dh), [&](int64_t begin, int64_t end) {
    for (int p = 0; p < 3; ++p) {
      K().qk_rope_fwd(g.dt, base + p * part_bytes, il, w[p], p < 2 ? cp : nullptr, p < 2 ? sp : nullptr, t.tab_b,
                      outs[p].mutable_data_ptr(), ol, feps, begin, end - begin);
    }
  });
  return {outs[0], outs[1], outs[2]};
}

// grad_qkv (B, N, 3 H Dh) in one pass; weight_grads == false (or no weights): the weight gradients come back empty.
std::tuple<at::Tensor, at::Tensor, at::Tensor> qk_norm_rope_bwd_cpu(
    const at::Tensor& gq_in, const at::Tensor& gk_in, const at::Tensor& gv_in, const at::Tensor& qkv_in,
    int64_t heads, const c10::optional<at::Tensor>& wq_in, const c10::optional<at::Tensor>& wk_in,
    const c10::optional<at::Tensor>& cos_in, const c10::optional<at::Tensor>& sin_in, double eps, bool weight_grads) {
  const char* op = "qk_norm_rope_bwd";
  check_cpu(qkv_in, op, "qkv");
  const QkArgs g = qk_args(qkv_in, heads, wq_in, wk_in, cos_in, sin_in, eps, op);
  const at::Tensor like = at::empty({g.B, g.H, g.N, g.Dh}, g.qkv.options());
  at::Tensor grads[3];
  const char* names[3] = {"grad_q", "grad_k", "grad_v"};
  const at::Tensor* given[3] = {&gq_in, &gk_in, &gv_in};
  for (int p = 0; p < 3; ++p) {
    check_like(*given[p], like, op, names[p], "(B, heads, N, head_dim) of qkv");
    grads[p] = unit_last(*given[p]);
  }
  at::Tensor gqkv = at::empty({g.B, g.N, 3 * g.H * g.Dh}, g.qkv.options());
  auto none = [&] { return at::empty({0}, qkv_in.options()); };  // a fresh one each (outputs never alias)
  const bool wgrad = weight_grads && g.wq.defined();
  const int64_t R = g.B * g.H * g.N, Dh = g.Dh;
  if (R == 0 || Dh == 0) {
    if (!wgrad) return {gqkv, none(), none()};
    const at::Tensor z = at::zeros({Dh}, wq_in->options());
    return {gqkv, z, z.clone()};
  }
  const cpu::RowLayout il = packed_layout(g.qkv, g.H, Dh), ol = packed_layout(gqkv, g.H, Dh);
  const cpu::RowLayout gl[3] = {heads_layout(grads[0]), heads_layout(grads[1]), heads_layout(grads[2])};
  const auto* base = static_cast<const char*>(g.qkv.const_data_ptr());
  auto* obase = static_cast<char*>(gqkv.mutable_data_ptr());
  const int64_t part_bytes = g.H * Dh * g.qkv.element_size();
  const float* w[3] = {g.ptr(g.wq), g.ptr(g.wk), nullptr};
  const ExpandedTables t = expand_tables(g);
  const float *cp = g.ptr(t.ce), *sp = g.ptr(t.se);
  const auto feps = static_cast<float>(eps);
  // tasks: chunks of kQkRowChunk rows, each in q, k and v (so that the threads share the cheap v rows and the costly
  // q, k rows alike); a q or k chunk adds its rows' weight gradient into its own slot
  const int64_t nchunk = (R + kQkRowChunk - 1) / kQkRowChunk;
  std::vector<float> part(wgrad ? static_cast<size_t>(2 * nchunk * Dh) : 0, 0.0f);
  at::parallel_for(0, nchunk, 1, [&](int64_t begin, int64_t end) {
    for (int64_t c = begin; c < end; ++c) {
      const int64_t r0 = c * kQkRowChunk;
      for (int p = 0; p < 3; ++p) {
        float* acc = wgrad && p < 2 ? part.data() + (p * nchunk + c) * Dh : nullptr;
        K().qk_rope_bwd(g.dt, grads[p].const_data_ptr(), gl[p], base + p * part_bytes, il, w[p],
                        p < 2 ? cp : nullptr, p < 2 ? sp : nullptr, t.tab_b, obase + p * part_bytes, ol, acc, feps, r0,
                        std::min(kQkRowChunk, R - r0));
      }
    }
  });
  if (!wgrad) return {gqkv, none(), none()};
  at::Tensor gw[2];
  for (int64_t t = 0; t < 2; ++t) {  // the chunk sums in chunk order: independent of the thread count
    at::Tensor out = at::zeros({Dh}, at::TensorOptions().dtype(at::kFloat));
    float* o = out.mutable_data_ptr<float>();
    for (int64_t c = 0; c < nchunk; ++c) {
      const float* pc = part.data() + (t * nchunk + c) * Dh;
      for (int64_t d = 0; d < Dh; ++d) o[d] += pc[d];
    }
    gw[t] = out.to((t == 0 ? wq_in : wk_in)->scalar_type());
  }
  return {gqkv, gw[0], gw[1]};
}

at::Tensor swiglu_fwd_cpu(const at::Tensor& x_in) {
  const char* op = "swiglu_fwd";
  check_cpu(x_in, op, "x");
  const int64_t H = swiglu_half(x_in, op);
  const int dt = dtype_code(x_in, op, "x");
  const at::Tensor x = x_in.contiguous();
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = H;
  at::Tensor y = at::empty(shape, x.options());
  const int64_t R = H > 0 ? y.numel() / H : 0;
  if (R == 0) return y;
  const void* xp = x.const_data_ptr();
  void* yp = y.mutable_data_ptr();
  at::parallel_for(0, R, row_grain(3 * H), [&](int64_t begin, int64_t end) {
    K().swiglu_fwd(dt, xp, yp, H, begin, end - begin);
  });
  return y;
}

at::Tensor swiglu_bwd_cpu(const at::Tensor& gy_in, const at::Tensor& x_in) {
  const char* op = "swiglu_bwd";
  check_cpu(x_in, op, "x");
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
  if (R == 0) return gx;
  const void* xp = x.const_data_ptr();
  const void* gp = gy.const_data_ptr();
  void* gxp = gx.mutable_data_ptr();
  at::parallel_for(0, R, row_grain(5 * H), [&](int64_t begin, int64_t end) {
    K().swiglu_bwd(dt, gp, xp, gxp, H, begin, end - begin);
  });
  return gx;
}

at::Tensor token_gather_cpu(const at::Tensor& x_in, const at::Tensor& idx_in) {
  const char* op = "token_gather";
  check_cpu(x_in, op, "x");
  const RouteArgs g = token_gather_args(x_in, idx_in, op);
  at::Tensor out = at::empty({g.B, g.K, g.D}, g.rows.options());
  const int64_t* ip = g.idx.const_data_ptr<int64_t>();
  check_route_range(ip, g.B, g.T, g.K, op);
  if (out.numel() == 0) return out;
  const void* xp = g.rows.const_data_ptr();
  void* op_ = out.mutable_data_ptr();
  at::parallel_for(0, g.B * g.K, row_grain(g.D), [&](int64_t begin, int64_t end) {
    K().token_gather(g.dt, xp, ip, op_, g.T, g.K, g.D, begin, end - begin);
  });
  return out;
}

// base None: zeros where no row of src lands (the backward of token_gather, with tokens = T of its x).
at::Tensor token_scatter_cpu(const c10::optional<at::Tensor>& base_in, const at::Tensor& idx_in,
                             const at::Tensor& src_in, int64_t tokens) {
  const char* op = "token_scatter";
  check_cpu(src_in, op, "src");
  const RouteArgs g = token_scatter_args(base_in, idx_in, src_in, tokens, op);
  const at::Tensor base = optional_contig(base_in);
  at::Tensor out = at::empty({g.B, g.T, g.D}, g.rows.options());
  const std::vector<int32_t> pos = route_positions(g.idx.const_data_ptr<int64_t>(), g.B, g.T, g.K, op);
  if (out.numel() == 0) return out;
  const void* bp = base.defined() ? base.const_data_ptr() : nullptr;
  const void* sp = g.rows.const_data_ptr();
  void* op_ = out.mutable_data_ptr();
  at::parallel_for(0, g.B * g.T, row_grain(g.D), [&](int64_t begin, int64_t end) {
    K().token_scatter(g.dt, bp, pos.data(), sp, op_, g.T, g.K, g.D, begin, end - begin);
  });
  return out;
}

// grad_base = grad_out with the kept rows zeroed, grad_src = grad_out gathered at idx: one pass over grad_out.
std::tuple<at::Tensor, at::Tensor> token_scatter_bwd_cpu(const at::Tensor& go_in, const at::Tensor& idx_in) {
  const char* op = "token_scatter_bwd";
  check_cpu(go_in, op, "grad_out");
  const RouteArgs g = token_scatter_bwd_args(go_in, idx_in, op);
  at::Tensor gbase = at::empty({g.B, g.T, g.D}, g.rows.options());
  at::Tensor gsrc = at::empty({g.B, g.K, g.D}, g.rows.options());
  const std::vector<int32_t> pos = route_positions(g.idx.const_data_ptr<int64_t>(), g.B, g.T, g.K, op);
  if (gbase.numel() == 0) return {gbase, gsrc};
  const void* gp = g.rows.const_data_ptr();
  void* gbp = gbase.mutable_data_ptr();
  void* gsp = gsrc.mutable_data_ptr();
  at::parallel_for(0, g.B * g.T, row_grain(g.D), [&](int64_t begin, int64_t end) {
    K().token_scatter_bwd(g.dt, gp, pos.data(), gbp, gsp, g.T, g.K, g.D, begin, end - begin);
  });
  return {gbase, gsrc};
}

std::string cpu_isa() { return K().isa; }

std::string set_cpu_isa(const std::string& isa) {
  const cpu::KernelTable* previous = cpu::set_kernels(isa.c_str());
  TORCH_CHECK(previous != nullptr, "diffcurr_fast_C::set_cpu_isa: instruction set '", isa,
              "' is not supported here; this build and CPU run ", c10::Join(", ", cpu::supported_isas()));
  return previous->isa;
}

std::vector<std::string> cpu_isas() { return cpu::supported_isas(); }

}  // namespace
}  // namespace dcf

TORCH_LIBRARY(diffcurr_fast_C, m) {
  m.def("randn(int seed, int[] shape) -> Tensor", &dcf::randn_cpu);
  m.def("cpu_isa() -> str", &dcf::cpu_isa);
  m.def("cpu_isas() -> str[]", &dcf::cpu_isas);
  m.def("set_cpu_isa(str isa) -> str", &dcf::set_cpu_isa);
  m.def("randn_like(Tensor like, int seed) -> Tensor");
  m.def("q_sample(Tensor x0, Tensor a, Tensor c, Tensor? noise, int seed) -> Tensor");
  m.def(
      "diffusion_loss_fwd(Tensor pred, Tensor x0, Tensor? noise, int seed, Tensor p, Tensor q, Tensor w, "
      "bool with_grad, float grad_scale=1.0) -> (Tensor loss, Tensor grad)");
  m.def("sample_timesteps(Tensor weights, int batch_size, int seed) -> (Tensor t, Tensor importance)");
  m.def("adaln_modulate_fwd(Tensor x, Tensor shift, Tensor scale, float eps) -> (Tensor y, Tensor mean, Tensor rstd)");
  m.def(
      "adaln_modulate_bwd(Tensor grad_y, Tensor x, Tensor scale, Tensor mean, Tensor rstd, bool affine_grads=True) "
      "-> (Tensor gx, Tensor gshift, Tensor gscale)");
  m.def("gated_residual_fwd(Tensor x, Tensor gate, Tensor y) -> Tensor");
  m.def("gated_residual_bwd(Tensor grad_out, Tensor gate, Tensor y) -> (Tensor ggate, Tensor gy)");
  m.def("gelu_tanh_fwd(Tensor x) -> Tensor");
  m.def("gelu_tanh_bwd(Tensor grad_y, Tensor x) -> Tensor");
  m.def(
      "rmsnorm_modulate_fwd(Tensor x, Tensor shift, Tensor scale, Tensor? weight, float eps) -> (Tensor y, Tensor rstd)");
  m.def(
      "rmsnorm_modulate_bwd(Tensor grad_y, Tensor x, Tensor scale, Tensor? weight, Tensor rstd, bool affine_grads=True) "
      "-> (Tensor gx, Tensor gshift, Tensor gscale, Tensor gweight)");
  m.def(
      "qk_norm_rope_fwd(Tensor qkv, int heads, Tensor? q_weight, Tensor? k_weight, Tensor? cos, Tensor? sin, "
      "float eps) -> (Tensor q, Tensor k, Tensor v)");
  m.def(
      "qk_norm_rope_bwd(Tensor grad_q, Tensor grad_k, Tensor grad_v, Tensor qkv, int heads, Tensor? q_weight, "
      "Tensor? k_weight, Tensor? cos, Tensor? sin, float eps, bool weight_grads=True) -> (Tensor grad_qkv, "
      "Tensor grad_q_weight, Tensor grad_k_weight)");
  m.def("swiglu_fwd(Tensor x) -> Tensor");
  m.def("swiglu_bwd(Tensor grad_y, Tensor x) -> Tensor");
  m.def("token_gather(Tensor x, Tensor idx) -> Tensor");
  m.def("token_scatter(Tensor? base, Tensor idx, Tensor src, int tokens) -> Tensor");
  m.def("token_scatter_bwd(Tensor grad_out, Tensor idx) -> (Tensor grad_base, Tensor grad_src)");
}

TORCH_LIBRARY_IMPL(diffcurr_fast_C, CPU, m) {
  m.impl("randn_like", &dcf::randn_like_cpu);
  m.impl("q_sample", &dcf::q_sample_cpu);
  m.impl("diffusion_loss_fwd", &dcf::diffusion_loss_fwd_cpu);
  m.impl("sample_timesteps", &dcf::sample_timesteps_cpu);
  m.impl("adaln_modulate_fwd", &dcf::adaln_modulate_fwd_cpu);
  m.impl("adaln_modulate_bwd", &dcf::adaln_modulate_bwd_cpu);
  m.impl("gated_residual_fwd", &dcf::gated_residual_fwd_cpu);
  m.impl("gated_residual_bwd", &dcf::gated_residual_bwd_cpu);
  m.impl("gelu_tanh_fwd", &dcf::gelu_tanh_fwd_cpu);
  m.impl("gelu_tanh_bwd", &dcf::gelu_tanh_bwd_cpu);
  m.impl("rmsnorm_modulate_fwd", &dcf::rmsnorm_modulate_fwd_cpu);
  m.impl("rmsnorm_modulate_bwd", &dcf::rmsnorm_modulate_bwd_cpu);
  m.impl("qk_norm_rope_fwd", &dcf::qk_norm_rope_fwd_cpu);
  m.impl("qk_norm_rope_bwd", &dcf::qk_norm_rope_bwd_cpu);
  m.impl("swiglu_fwd", &dcf::swiglu_fwd_cpu);
  m.impl("swiglu_bwd", &dcf::swiglu_bwd_cpu);
  m.impl("token_gather", &dcf::token_gather_cpu);
  m.impl("token_scatter", &dcf::token_scatter_cpu);
  m.impl("token_scatter_bwd", &dcf::token_scatter_bwd_cpu);
}
