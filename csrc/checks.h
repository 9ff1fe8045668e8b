// Argument checks shared by the CPU (ops.cpp) and CUDA (ops_cuda.cpp) torch wrappers of diffcurr_fast_C.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>
#include <c10/util/Optional.h>

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

}  // namespace dcf
