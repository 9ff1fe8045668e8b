// ctest for the C++ kernels of diffcurr_fast: the Philox known-answer vectors, and the diffcurr_fast_C ops
// (called through the torch dispatcher, as C++ users do) against straightforward double-precision loops.
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <optional>
#include <tuple>
#include <vector>

#include "cpu/kernels.h"
#include "dc_math.h"

namespace {

int g_failures = 0;

void expect(bool ok, const char* what) {
  if (!ok) {
    ++g_failures;
    std::printf("FAIL: %s\n", what);
  } else {
    std::printf("ok:   %s\n", what);
  }
}

bool close(double got, double ref, double rtol, double atol) { return std::fabs(got - ref) <= atol + rtol * std::fabs(ref); }

// noise[i] of docs/ops.md with the transcendental functions in double precision.
double noise_ref(uint64_t seed, uint64_t i) {
  uint32_t r[4];
  const uint64_t c = i / 4;
  dcf::philox4x32_10(static_cast<uint32_t>(c), static_cast<uint32_t>(c >> 32), 0, 0, static_cast<uint32_t>(seed),
                     static_cast<uint32_t>(seed >> 32), r);
  const auto u = [](uint32_t v) { return static_cast<double>(dcf::uniform01(v)); };
  const int k = static_cast<int>(i % 4);
  const double ua = u(r[k < 2 ? 0 : 2]);
  const double rad = std::sqrt(-2.0 * std::log(ua > 1e-7 ? ua : static_cast<double>(1e-7f)));
  const double th = static_cast<double>(dcf::kTwoPi * dcf::uniform01(r[k < 2 ? 1 : 3]));
  return rad * ((k % 2 == 0) ? std::cos(th) : std::sin(th));
}

template <class Sig>
c10::TypedOperatorHandle<Sig> op(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Sig>();
}

void test_philox_kat() {
  const uint32_t cases[3][10] = {
      {0, 0, 0, 0, 0, 0, 0x6627e8d5, 0xe169c58d, 0xbc57ac4c, 0x9b00dbd8},
      {0xffffffff, 0xffffffff, 0xffffffff, 0xffffffff, 0xffffffff, 0xffffffff, 0x408f276d, 0x41c83b0e, 0xa20bc7c6,
       0x6d5451fd},
      {0x243f6a88, 0x85a308d3, 0x13198a2e, 0x03707344, 0xa4093822, 0x299f31d0, 0xd16cfe09, 0x94fdcceb, 0x5001e420,
       0x24126ea1},
  };
  bool ok = true;
  for (const auto& c : cases) {
    uint32_t r[4];
    dcf::philox4x32_10(c[0], c[1], c[2], c[3], c[4], c[5], r);
    for (int k = 0; k < 4; ++k) ok = ok && r[k] == c[6 + k];
  }
  expect(ok, "Philox4x32-10 known-answer vectors (Random123)");
}

void test_randn_counters() {
  // Across the 2^32 boundary of the 64-bit counter, for every compiled instruction set.
  const uint64_t seed = 0x123456789abcdefULL;
  const int64_t i0 = 4 * static_cast<int64_t>(0xfffffffeULL) + 1;
  for (const char* isa : {"generic", "avx2", "avx512"}) {
    const dcf::cpu::KernelTable* k = dcf::cpu::kernels_for(isa);
    if (k == nullptr) continue;
    std::vector<float> out(23);
    k->randn(seed, i0, 23, out.data());
    bool ok = true;
    for (int64_t j = 0; j < 23; ++j) ok = ok && close(out[j], noise_ref(seed, static_cast<uint64_t>(i0 + j)), 1e-5, 1e-5);
    std::printf("      isa %s\n", isa);
    expect(ok, "randn across the 32-bit counter boundary");
  }
}

void test_q_sample_and_loss() {
  const int64_t B = 3, M = 37;
  const int64_t seed = 2024;
  at::Tensor x0 = at::randn({B, M}), pred = at::randn({B, M});
  at::Tensor a = at::rand({B}), c = at::rand({B}), p = at::randn({B}), q = at::randn({B}), w = at::rand({B});
  auto q_sample = op<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                const std::optional<at::Tensor>&, int64_t)>("diffcurr_fast_C::q_sample");
  at::Tensor xt = q_sample.call(x0, a, c, std::nullopt, seed);
  auto loss_fwd = op<std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&,
                                                        const std::optional<at::Tensor>&, int64_t, const at::Tensor&,
                                                        const at::Tensor&, const at::Tensor&, bool, double)>(
      "diffcurr_fast_C::diffusion_loss_fwd");
  const double gscale = 0.25;  // the gradient of loss.mean() over 4 samples, folded into the forward
  auto [loss, grad] = loss_fwd.call(pred, x0, std::nullopt, seed, p, q, w, true, gscale);
  const float* X = x0.data_ptr<float>();
  const float* P = pred.data_ptr<float>();
  bool ok_q = true, ok_l = true, ok_g = true;
  for (int64_t b = 0; b < B; ++b) {
    double sum = 0.0;
    for (int64_t j = 0; j < M; ++j) {
      const int64_t i = b * M + j;
      const double n = noise_ref(static_cast<uint64_t>(seed), static_cast<uint64_t>(i));
      const double ref = a[b].item<double>() * X[i] + c[b].item<double>() * n;
      ok_q = ok_q && close(xt.data_ptr<float>()[i], ref, 1e-5, 1e-5);
      const double d = P[i] - (p[b].item<double>() * X[i] + q[b].item<double>() * n);
      sum += d * d;
      ok_g = ok_g && close(grad.data_ptr<float>()[i], gscale * w[b].item<double>() * 2.0 / M * d, 1e-5, 1e-6);
    }
    ok_l = ok_l && close(loss.data_ptr<float>()[b], w[b].item<double>() * sum / M, 1e-5, 1e-6);
  }
  expect(ok_q, "q_sample (seeded) against a loop");
  expect(ok_l, "diffusion_loss_fwd loss against a loop");
  expect(ok_g, "diffusion_loss_fwd grad against a loop");
  bool threw = false;
  try {
    q_sample.call(x0, at::ones({B + 1}), c, std::nullopt, seed);
  } catch (const c10::Error&) {
    threw = true;
  }
  expect(threw, "q_sample rejects a wrong-shaped coefficient");
}

void test_sample_timesteps() {
  const int64_t T = 11, batch = 101;
  at::Tensor wt = at::rand({T}, at::kDouble);
  wt.index_put_({at::indexing::Slice(0, 4)}, 0.0);
  auto st = op<std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, int64_t, int64_t)>(
      "diffcurr_fast_C::sample_timesteps");
  auto [t, imp] = st.call(wt, batch, 7);
  const double* W = wt.data_ptr<double>();
  std::vector<double> cdf(T);
  double acc = 0.0;
  for (int64_t k = 0; k < T; ++k) cdf[k] = (acc += W[k]);
  bool ok = true;
  for (int64_t b = 0; b < batch; ++b) {
    uint32_t r[4];
    dcf::philox4x32_10(static_cast<uint32_t>(b), 0, 0, 0, 7, 0, r);
    const double target = static_cast<double>(dcf::uniform01(r[0])) * acc;
    int64_t k = 0;
    while (k < T - 1 && !(cdf[k] > target)) ++k;
    ok = ok && t.data_ptr<int64_t>()[b] == k && W[k] > 0.0;
    ok = ok && close(imp.data_ptr<float>()[b], (acc / T) / W[k], 1e-6, 0.0);
  }
  expect(ok, "sample_timesteps against a linear search");
}

void test_adaln_and_gate() {
  const int64_t B = 3, N = 5, D = 19;
  at::Tensor x = at::randn({B, N, D}), shift = at::randn({B, D}), scale = at::randn({B, D}), gate = at::randn({B, D});
  auto fwd = op<std::tuple<at::Tensor, at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&,
                                                               const at::Tensor&, double)>(
      "diffcurr_fast_C::adaln_modulate_fwd");
  auto [y, mean, rstd] = fwd.call(x, shift, scale, 1e-6);
  auto gfwd = op<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&)>(
      "diffcurr_fast_C::gated_residual_fwd");
  at::Tensor out = gfwd.call(x, gate, y);
  const float* X = x.data_ptr<float>();
  bool ok = true, ok_g = true;
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t n = 0; n < N; ++n) {
      const float* xr = X + (b * N + n) * D;
      double mu = 0.0, var = 0.0;
      for (int64_t d = 0; d < D; ++d) mu += xr[d];
      mu /= D;
      for (int64_t d = 0; d < D; ++d) var += (xr[d] - mu) * (xr[d] - mu);
      const double rs = 1.0 / std::sqrt(var / D + 1e-6);
      ok = ok && close(mean.data_ptr<float>()[b * N + n], mu, 1e-5, 1e-6);
      ok = ok && close(rstd.data_ptr<float>()[b * N + n], rs, 1e-5, 1e-6);
      for (int64_t d = 0; d < D; ++d) {
        const int64_t i = (b * N + n) * D + d;
        const double ref = (xr[d] - mu) * rs * (1.0 + scale[b][d].item<double>()) + shift[b][d].item<double>();
        ok = ok && close(y.data_ptr<float>()[i], ref, 1e-5, 1e-5);
        const double gref = xr[d] + gate[b][d].item<double>() * y.data_ptr<float>()[i];
        ok_g = ok_g && close(out.data_ptr<float>()[i], gref, 1e-6, 1e-6);
      }
    }
  }
  expect(ok, "adaln_modulate_fwd against a loop");
  expect(ok_g, "gated_residual_fwd against a loop");
}

// Backward ops against double loops; N spans several row chunks and D has a tail after the 16-lane blocks.
void test_adaln_and_gate_backward() {
  for (const int64_t B : {int64_t{1}, int64_t{3}}) {
    const int64_t N = 131, D = 37;
    at::Tensor x = at::randn({B, N, D}), shift = at::randn({B, D}), scale = at::randn({B, D});
    at::Tensor gate = at::randn({B, D}), go = at::randn({B, N, D});
    auto fwd = op<std::tuple<at::Tensor, at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&,
                                                                 const at::Tensor&, double)>(
        "diffcurr_fast_C::adaln_modulate_fwd");
    auto [y, mean, rstd] = fwd.call(x, shift, scale, 1e-6);
    auto bwd = op<std::tuple<at::Tensor, at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&,
                                                                 const at::Tensor&, const at::Tensor&,
                                                                 const at::Tensor&, bool)>(
        "diffcurr_fast_C::adaln_modulate_bwd");
    auto [gx, gshift, gscale] = bwd.call(go, x, scale, mean, rstd, true);
    // without the affine gradients: the same grad_x, empty gshift / gscale
    auto [gx_only, no_shift, no_scale] = bwd.call(go, x, scale, mean, rstd, false);
    auto gbwd = op<std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&, const at::Tensor&)>(
        "diffcurr_fast_C::gated_residual_bwd");
    auto [ggate, gy] = gbwd.call(go, gate, x);
    const float* X = x.data_ptr<float>();
    const float* G = go.data_ptr<float>();
    bool ok = true, ok_g = true;
    for (int64_t b = 0; b < B; ++b) {
      std::vector<double> sh(D, 0.0), sc(D, 0.0), sg(D, 0.0);
      for (int64_t n = 0; n < N; ++n) {
        const int64_t r = b * N + n;
        const double mu = mean.data_ptr<float>()[r], rs = rstd.data_ptr<float>()[r];
        double m1 = 0.0, m2 = 0.0;
        for (int64_t d = 0; d < D; ++d) {
          const double gh = G[r * D + d] * (1.0 + scale[b][d].item<double>());
          m1 += gh / D;
          m2 += gh * (X[r * D + d] - mu) * rs / D;
        }
        for (int64_t d = 0; d < D; ++d) {
          const int64_t i = r * D + d;
          const double xh = (X[i] - mu) * rs;
          const double gh = G[i] * (1.0 + scale[b][d].item<double>());
          ok = ok && close(gx.data_ptr<float>()[i], rs * (gh - m1 - xh * m2), 1e-4, 1e-4);
          sh[d] += G[i];
          sc[d] += G[i] * xh;
          sg[d] += G[i] * X[i];
          ok_g = ok_g && close(gy.data_ptr<float>()[i], gate[b][d].item<double>() * G[i], 1e-6, 1e-7);
        }
      }
      for (int64_t d = 0; d < D; ++d) {
        ok = ok && close(gshift[b][d].item<double>(), sh[d], 1e-5, 1e-4);
        ok = ok && close(gscale[b][d].item<double>(), sc[d], 1e-5, 1e-4);
        ok_g = ok_g && close(ggate[b][d].item<double>(), sg[d], 1e-5, 1e-4);
      }
    }
    // the two per-column gradients are separate buffers, also for B = 1
    ok = ok && gshift.storage().data() != gscale.storage().data();
    ok = ok && at::equal(gx_only, gx) && no_shift.numel() == 0 && no_scale.numel() == 0;
    expect(ok, B == 1 ? "adaln_modulate_bwd against a loop (B = 1)" : "adaln_modulate_bwd against a loop");
    expect(ok_g, B == 1 ? "gated_residual_bwd against a loop (B = 1)" : "gated_residual_bwd against a loop");
  }
}

// Token routing: the gather, the scatter (with a base and without: zeros) and its backward, exact row copies
// against loops; unsorted indices, D with a tail after the 64-byte blocks.
void test_token_route() {
  const int64_t B = 3, T = 11, K = 4, D = 21;
  at::Tensor x = at::randn({B, T, D}), src = at::randn({B, K, D}), go = at::randn({B, T, D});
  at::Tensor idx = at::empty({B, K}, at::kLong);
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t k = 0; k < K; ++k) idx[b][k] = (7 * k + 3 * b + 2) % T;  // distinct per sample, unsorted
  }
  auto gather = op<at::Tensor(const at::Tensor&, const at::Tensor&)>("diffcurr_fast_C::token_gather");
  auto scatter = op<at::Tensor(const std::optional<at::Tensor>&, const at::Tensor&, const at::Tensor&, int64_t)>(
      "diffcurr_fast_C::token_scatter");
  auto bwd = op<std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&)>(
      "diffcurr_fast_C::token_scatter_bwd");
  at::Tensor g = gather.call(x, idx);
  at::Tensor s = scatter.call(x, idx, src, T);
  at::Tensor z = scatter.call(std::nullopt, idx, src, T);
  auto [gbase, gsrc] = bwd.call(go, idx);
  bool ok_g = true, ok_s = true, ok_b = true;
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t t = 0; t < T; ++t) {
      int64_t kept = -1;
      for (int64_t k = 0; k < K; ++k) kept = idx[b][k].item<int64_t>() == t ? k : kept;
      for (int64_t d = 0; d < D; ++d) {
        const float xv = x[b][t][d].item<float>(), gv = go[b][t][d].item<float>();
        const float sv = kept >= 0 ? src[b][kept][d].item<float>() : 0.0f;
        ok_s = ok_s && s[b][t][d].item<float>() == (kept >= 0 ? sv : xv) && z[b][t][d].item<float>() == sv;
        ok_b = ok_b && gbase[b][t][d].item<float>() == (kept >= 0 ? 0.0f : gv);
        if (kept >= 0) {
          ok_g = ok_g && g[b][kept][d].item<float>() == xv;
          ok_b = ok_b && gsrc[b][kept][d].item<float>() == gv;
        }
      }
    }
  }
  expect(ok_g, "token_gather against a loop");
  expect(ok_s, "token_scatter against a loop (with a base and without)");
  expect(ok_b, "token_scatter_bwd against a loop");
}

}  // namespace

int main() {
  std::printf("cpu kernels: %s\n", dcf::cpu::kernels().isa);
  test_philox_kat();
  test_randn_counters();
  test_q_sample_and_loss();
  test_sample_timesteps();
  test_adaln_and_gate();
  test_adaln_and_gate_backward();
  test_token_route();
  std::printf("%d failure(s)\n", g_failures);
  return g_failures == 0 ? 0 : 1;
}
