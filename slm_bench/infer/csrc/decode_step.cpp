// The elementwise parts of slm_bench's lean decode step, each fused into one pass: RoPE with the cache write, the
// residual add with RMSNorm, SiLU times the up projection, and the pick of a sampled token (Gumbel-max or inverse
// CDF). Built with decode_attention.cpp and documented by nbs/infer/06_decode_kernel.ipynb
// (slm_bench.infer.decode_kernel), whose plain-torch specifications these match.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <algorithm>
#include <cfloat>
#include <cmath>
#include <utility>
#include <vector>

namespace {

constexpr int64_t GRAIN = 32768;  // elements per thread below which a loop runs on one thread (torch's own grain size)

void check_float(const at::Tensor& t, const char* op, const char* name) {
  TORCH_CHECK(t.scalar_type() == at::kFloat && t.is_contiguous() && t.device().is_cpu(), op, ": ", name,
              " must be a contiguous float32 CPU tensor");
}

template <typename F>
void over_rows(int64_t rows, int64_t width, const F& body) {
  at::parallel_for(0, rows, std::max<int64_t>(1, GRAIN / std::max<int64_t>(width, 1)), body);
}

// q = RoPE(q part of qkv) as [N, H, D]; RoPE(k part) and the v part written at position t of the lane-major generated
// cache kg and vg [B, KVH, T, D, n] (row r = b * n + i is prompt b's sample i).
at::Tensor rope_qkv(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin, at::Tensor& kg, at::Tensor& vg,
                    int64_t t, int64_t heads) {
  for (auto [tensor, name] : {std::pair{&qkv, "qkv"}, {&cos, "cos"}, {&sin, "sin"}, {&kg, "kg"}, {&vg, "vg"}})
    check_float(*tensor, "rope_qkv", name);
  TORCH_CHECK(qkv.dim() == 2 && cos.dim() == 2 && kg.dim() == 5,
              "rope_qkv: qkv [N, (heads + 2 kv_heads) d], cos and sin [N, d], kg and vg [B, kv_heads, T, d, n]");
  const int64_t N = qkv.size(0), KVH = kg.size(1), T = kg.size(2), D = kg.size(3), n = kg.size(4);
  TORCH_CHECK(qkv.size(1) == (heads + 2 * KVH) * D && kg.size(0) * n == N && vg.sizes() == kg.sizes(),
              "rope_qkv: qkv [N, (heads + 2 kv_heads) d], kg and vg [B, kv_heads, T, d, n] with B * n = N");
  TORCH_CHECK(cos.sizes() == sin.sizes() && cos.size(0) == N && cos.size(1) == D && D % 2 == 0,
              "rope_qkv: cos and sin [N, d] (rotary over the whole head)");
  TORCH_CHECK(t >= 0 && t < T, "rope_qkv: t must be in 0..", T - 1);
  at::Tensor q = at::empty({N, heads, D}, qkv.options());
  const float *X = qkv.data_ptr<float>(), *C = cos.data_ptr<float>(), *S = sin.data_ptr<float>();
  float *Q = q.data_ptr<float>(), *KG = kg.data_ptr<float>(), *VG = vg.data_ptr<float>();
  const int64_t width = (heads + 2 * KVH) * D, half = D / 2;
  over_rows(N, width, [&](int64_t begin, int64_t end) {
    std::vector<float> rotated(D);
    float* __restrict__ k_rot = rotated.data();
    for (int64_t r = begin; r < end; ++r) {
      const float* __restrict__ c = C + r * D;
      const float* __restrict__ s = S + r * D;
      auto rotate = [&](const float* __restrict__ x, float* __restrict__ out) {  // x cos + rotate_half(x) sin
#pragma omp simd
        for (int64_t i = 0; i < half; ++i) out[i] = x[i] * c[i] - x[i + half] * s[i];
#pragma omp simd
        for (int64_t i = half; i < D; ++i) out[i] = x[i] * c[i] + x[i - half] * s[i];
      };
      const float* x = X + r * width;
      for (int64_t h = 0; h < heads; ++h) rotate(x + h * D, Q + (r * heads + h) * D);
      const int64_t b = r / n, i = r % n;
      for (int64_t h = 0; h < KVH; ++h) {  // element k of sample i at ((b, h, t) * D + k) * n + i: n floats apart
        const int64_t at = ((b * KVH + h) * T + t) * D * n + i;
        rotate(x + (heads + h) * D, k_rot);
        const float* v = x + (heads + KVH + h) * D;
        for (int64_t k = 0; k < D; ++k) { KG[at + k * n] = k_rot[k]; VG[at + k * n] = v[k]; }
      }
    }
  });
  return q;
}

inline void norm_row(const float* __restrict__ x, const float* __restrict__ w, float* __restrict__ out, int64_t H,
                     float eps) {
  float squares = 0.f;
#pragma omp simd reduction(+:squares)
  for (int64_t i = 0; i < H; ++i) squares += x[i] * x[i];
  const float inv = 1.f / std::sqrt(squares / H + eps);
#pragma omp simd
  for (int64_t i = 0; i < H; ++i) out[i] = w[i] * (x[i] * inv);
}

// w * x / sqrt(mean(x^2) + eps), row by row of x [R, H].
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& w, double eps) {
  check_float(x, "rms_norm", "x");
  check_float(w, "rms_norm", "w");
  const int64_t H = x.size(-1), R = x.numel() / H;
  TORCH_CHECK(w.numel() == H, "rms_norm: w has ", w.numel(), " entries for rows of ", H);
  at::Tensor out = at::empty_like(x);
  const float *X = x.data_ptr<float>(), *W = w.data_ptr<float>();
  float* O = out.data_ptr<float>();
  over_rows(R, H, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) norm_row(X + r * H, W, O + r * H, H, static_cast<float>(eps));
  });
  return out;
}

// x += y in place (the residual stream), then rms_norm(x, w, eps).
at::Tensor add_rms_norm(at::Tensor& x, const at::Tensor& y, const at::Tensor& w, double eps) {
  check_float(x, "add_rms_norm", "x");
  check_float(y, "add_rms_norm", "y");
  check_float(w, "add_rms_norm", "w");
  const int64_t H = x.size(-1), R = x.numel() / H;
  TORCH_CHECK(y.numel() == x.numel() && w.numel() == H, "add_rms_norm: x and y [R, H], w [H]");
  at::Tensor out = at::empty_like(x);
  float* X = x.data_ptr<float>();
  const float *Y = y.data_ptr<float>(), *W = w.data_ptr<float>();
  float* O = out.data_ptr<float>();
  over_rows(R, H, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      float* __restrict__ xr = X + r * H;
      const float* __restrict__ yr = Y + r * H;
#pragma omp simd
      for (int64_t i = 0; i < H; ++i) xr[i] += yr[i];
      norm_row(xr, W, O + r * H, H, static_cast<float>(eps));
    }
  });
  return out;
}

// silu(gate) * up for gate_up [R, 2F] holding gate then up: [R, F].
at::Tensor silu_mul(const at::Tensor& gate_up) {
  check_float(gate_up, "silu_mul", "gate_up");
  const int64_t F = gate_up.size(-1) / 2, R = gate_up.numel() / (2 * F);
  TORCH_CHECK(gate_up.size(-1) == 2 * F, "silu_mul: the last dimension holds gate and up, so it must be even");
  at::Tensor out = at::empty({R, F}, gate_up.options());
  const float* GU = gate_up.data_ptr<float>();
  float* O = out.data_ptr<float>();
  over_rows(R, 2 * F, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* __restrict__ g = GU + r * 2 * F;
      const float* __restrict__ u = g + F;
      float* __restrict__ o = O + r * F;
#pragma omp simd
      for (int64_t i = 0; i < F; ++i) o[i] = g[i] / (1.f + expf(-g[i])) * u[i];
    }
  });
  return out;
}

// argmax over each row of scores - log(-log(max(u, 1e-20))): a Gumbel-max draw from softmax(scores) with uniforms u.
at::Tensor gumbel_argmax(const at::Tensor& scores, const at::Tensor& u) {
  check_float(scores, "gumbel_argmax", "scores");
  check_float(u, "gumbel_argmax", "u");
  TORCH_CHECK(scores.dim() == 2 && u.sizes() == scores.sizes(), "gumbel_argmax: scores and u [R, V]");
  const int64_t R = scores.size(0), V = scores.size(1);
  at::Tensor out = at::empty({R}, scores.options().dtype(at::kLong));
  const float *SC = scores.data_ptr<float>(), *U = u.data_ptr<float>();
  int64_t* O = out.data_ptr<int64_t>();
  over_rows(R, V, [&](int64_t begin, int64_t end) {
    std::vector<float> buf(V);
    float* __restrict__ z = buf.data();
    for (int64_t r = begin; r < end; ++r) {
      const float* __restrict__ s = SC + r * V;
      const float* __restrict__ ur = U + r * V;
#pragma omp simd
      for (int64_t v = 0; v < V; ++v) {
        const float uv = ur[v] < 1e-20f ? 1e-20f : ur[v];
        z[v] = s[v] - logf(-logf(uv));
      }
      int64_t best = 0;
      float top = z[0];
      for (int64_t v = 1; v < V; ++v)
        if (z[v] > top) { top = z[v]; best = v; }  // the first of equal maxima, as torch.argmax
      O[r] = best;
    }
  });
  return out;
}

// The first index whose cumulative softmax(scores) (in double) reaches u, per row: an inverse-CDF draw with one
// uniform u per row (torch: softmax, cumsum, divide by the last entry, searchsorted). The sums run in another order
// than torch's, so a pick can differ only where u lies within rounding (~1e-16) of a boundary.
constexpr int64_t PICK_BLOCK = 64;  // tokens per block of the cumulative scan

at::Tensor inverse_cdf_pick(const at::Tensor& scores, const at::Tensor& u) {
  check_float(scores, "inverse_cdf_pick", "scores");
  TORCH_CHECK(u.scalar_type() == at::kDouble && u.is_contiguous() && u.device().is_cpu(),
              "inverse_cdf_pick: u must be a contiguous float64 CPU tensor");
  TORCH_CHECK(scores.dim() == 2 && u.dim() == 1 && u.size(0) == scores.size(0), "inverse_cdf_pick: scores [R, V] and u [R]");
  const int64_t R = scores.size(0), V = scores.size(1);
  at::Tensor out = at::empty({R}, scores.options().dtype(at::kLong));
  const float* SC = scores.data_ptr<float>();
  const double* U = u.data_ptr<double>();
  int64_t* O = out.data_ptr<int64_t>();
  over_rows(R, V, [&](int64_t begin, int64_t end) {
    std::vector<double> buf(V);
    double* __restrict__ p = buf.data();
    for (int64_t r = begin; r < end; ++r) {
      const float* __restrict__ s = SC + r * V;
      float top = -FLT_MAX;
      for (int64_t v = 0; v < V; ++v) top = s[v] > top ? s[v] : top;
      double total = 0.0;
#pragma omp simd reduction(+:total)
      for (int64_t v = 0; v < V; ++v) { p[v] = exp(static_cast<double>(s[v]) - top); total += p[v]; }
      // the first v whose cumulative weight reaches u * total: whole blocks skipped by their sums, then the crossing
      // block token by token (the specification's cdf / cdf[-1] >= u without normalising every entry)
      const double target = U[r] * total;
      double running = 0.0;
      int64_t v0 = 0;
      for (; v0 + PICK_BLOCK <= V; v0 += PICK_BLOCK) {
        double block = 0.0;
#pragma omp simd reduction(+:block)
        for (int64_t v = v0; v < v0 + PICK_BLOCK; ++v) block += p[v];
        if (running + block >= target) break;
        running += block;
      }
      int64_t pick = V - 1;
      for (int64_t v = v0; v < V; ++v) {
        running += p[v];
        if (running >= target) { pick = v; break; }
      }
      O[r] = pick;
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(slm_bench, m) {
  m.def("rope_qkv(Tensor qkv, Tensor cos, Tensor sin, Tensor(a!) kg, Tensor(b!) vg, int t, int heads) -> Tensor");
  m.def("rms_norm(Tensor x, Tensor w, float eps) -> Tensor");
  m.def("add_rms_norm(Tensor(a!) x, Tensor y, Tensor w, float eps) -> Tensor");
  m.def("silu_mul(Tensor gate_up) -> Tensor");
  m.def("gumbel_argmax(Tensor scores, Tensor u) -> Tensor");
  m.def("inverse_cdf_pick(Tensor scores, Tensor u) -> Tensor");
}

TORCH_LIBRARY_IMPL(slm_bench, CPU, m) {
  m.impl("rope_qkv", &rope_qkv);
  m.impl("rms_norm", &rms_norm);
  m.impl("add_rms_norm", &add_rms_norm);
  m.impl("silu_mul", &silu_mul);
  m.impl("gumbel_argmax", &gumbel_argmax);
  m.impl("inverse_cdf_pick", &inverse_cdf_pick);
}
