// One decode step's attention for slm_bench's lean decoder: each row's new query over its prompt's cache (shared by
// the prompt's n samples) and its own generated cache, in one softmax. The generated cache is time-major with the
// samples innermost, [B, KVH, T, D, n]: at a position, element k of one (prompt, KV head)'s n samples lie side by side,
// so a step reads each task's generated keys and values as one stream and the n samples are the vector lanes. Built
// and documented by nbs/infer/06_decode_kernel.ipynb (slm_bench.infer.decode_kernel), whose plain-torch specification
// it matches.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstring>
#include <vector>

namespace {

typedef float v16 __attribute__((vector_size(64)));  // 16 floats: one AVX-512 register, two AVX2 ones
constexpr int64_t KEY_BLOCK = 4;  // prompt keys' scores are computed 4 × 16 at a time, in registers

inline v16 load(const float* x) { v16 v; std::memcpy(&v, x, sizeof v); return v; }
inline void store(float* x, v16 v) { std::memcpy(x, &v, sizeof v); }
inline float sum(v16 v) { float s = 0.f; for (int i = 0; i < 16; ++i) s += v[i]; return s; }

// p[l] = q . key l, for L keys stored transposed (kt [D, L]).
template <int64_t DC>
void scores_transposed(const float* __restrict__ q, const float* __restrict__ kt, int64_t D, int64_t L, float* __restrict__ p) {
  int64_t l0 = 0;
  if constexpr (DC > 0) {
    for (; l0 + 16 * KEY_BLOCK <= L; l0 += 16 * KEY_BLOCK) {
      v16 acc[KEY_BLOCK] = {};
      for (int64_t k = 0; k < DC; ++k) {
        const float qk = q[k];
        for (int64_t j = 0; j < KEY_BLOCK; ++j) acc[j] += qk * load(kt + k * L + l0 + 16 * j);
      }
      for (int64_t j = 0; j < KEY_BLOCK; ++j) store(p + l0 + 16 * j, acc[j]);
    }
  }
  for (int64_t l = l0; l < L; ++l) p[l] = 0.f;
  for (int64_t k = 0; k < D; ++k) {
    const float qk = q[k];
    for (int64_t l = l0; l < L; ++l) p[l] += qk * kt[k * L + l];
  }
}

// out = sum_i w[i] * rows[i] over `count` rows of width D, `stride` floats apart, added to out.
template <int64_t DC>
void weighted_rows(const float* __restrict__ w, const float* __restrict__ rows, int64_t count, int64_t D, int64_t stride,
                   float* __restrict__ out) {
  if constexpr (DC > 0) {
    v16 acc[DC / 16];
    for (int64_t j = 0; j < DC / 16; ++j) acc[j] = load(out + 16 * j);
    for (int64_t i = 0; i < count; ++i)
      for (int64_t j = 0; j < DC / 16; ++j) acc[j] += w[i] * load(rows + i * stride + 16 * j);
    for (int64_t j = 0; j < DC / 16; ++j) store(out + 16 * j, acc[j]);
  } else {
    for (int64_t i = 0; i < count; ++i)
      for (int64_t k = 0; k < D; ++k) out[k] += w[i] * rows[i * stride + k];
  }
}

// p[u] = q . keys[u] for `count` keys of width D, `stride` floats apart.
template <int64_t DC>
void scores_rows(const float* __restrict__ q, const float* __restrict__ keys, int64_t count, int64_t D, int64_t stride,
                 float* __restrict__ p) {
  if constexpr (DC > 0) {
    v16 qv[DC / 16];
    for (int64_t j = 0; j < DC / 16; ++j) qv[j] = load(q + 16 * j);
    for (int64_t u = 0; u < count; ++u) {
      v16 acc = qv[0] * load(keys + u * stride);
      for (int64_t j = 1; j < DC / 16; ++j) acc += qv[j] * load(keys + u * stride + 16 * j);
      p[u] = sum(acc);
    }
  } else {
    for (int64_t u = 0; u < count; ++u) {
      float acc = 0.f;
      for (int64_t k = 0; k < D; ++k) acc += q[k] * keys[u * stride + k];
      p[u] = acc;
    }
  }
}

// scores_transposed for QB queries over the same keys: each key vector loaded once for all of them (every score is the
// same sum in the same order as scores_transposed's, so the results are bitwise the same).
template <int64_t DC, int QB>
void scores_transposed_multi(const float* const* q, const float* __restrict__ kt, int64_t L, float* const* p) {
  int64_t l0 = 0;
  for (; l0 + 16 * KEY_BLOCK <= L; l0 += 16 * KEY_BLOCK) {
    v16 acc[QB][KEY_BLOCK] = {};
    for (int64_t k = 0; k < DC; ++k) {
      v16 keys[KEY_BLOCK];
      for (int64_t j = 0; j < KEY_BLOCK; ++j) keys[j] = load(kt + k * L + l0 + 16 * j);
      for (int qb = 0; qb < QB; ++qb) {
        const float qk = q[qb][k];
        for (int64_t j = 0; j < KEY_BLOCK; ++j) acc[qb][j] += qk * keys[j];
      }
    }
    for (int qb = 0; qb < QB; ++qb)
      for (int64_t j = 0; j < KEY_BLOCK; ++j) store(p[qb] + l0 + 16 * j, acc[qb][j]);
  }
  for (int qb = 0; qb < QB; ++qb) {
    for (int64_t l = l0; l < L; ++l) p[qb][l] = 0.f;
    for (int64_t k = 0; k < DC; ++k) {
      const float qk = q[qb][k];
      for (int64_t l = l0; l < L; ++l) p[qb][l] += qk * kt[k * L + l];
    }
  }
}

// weighted_rows for QB queries over the same rows: out[qb] += sum_i w[qb][i] * rows[i], each row loaded once for all of
// them (each query's sum in weighted_rows's order). QB independent accumulator chains keep the FMA units busy.
template <int64_t DC, int QB>
void weighted_rows_multi(const float* const* w, const float* __restrict__ rows, int64_t count, float* const* out) {
  v16 acc[QB][DC / 16];
  for (int qb = 0; qb < QB; ++qb)
    for (int64_t j = 0; j < DC / 16; ++j) acc[qb][j] = load(out[qb] + 16 * j);
  for (int64_t i = 0; i < count; ++i) {
    v16 row[DC / 16];
    for (int64_t j = 0; j < DC / 16; ++j) row[j] = load(rows + i * DC + 16 * j);
    for (int qb = 0; qb < QB; ++qb) {
      const float wi = w[qb][i];
      for (int64_t j = 0; j < DC / 16; ++j) acc[qb][j] += wi * row[j];
    }
  }
  for (int qb = 0; qb < QB; ++qb)
    for (int64_t j = 0; j < DC / 16; ++j) store(out[qb] + 16 * j, acc[qb][j]);
}

// generated_scores for n a multiple of 16 and a compiled-in head size: 16 lanes at a time, four positions per pass (each
// query vector loaded once for the four), every sum in generated_scores's order.
template <int64_t DC>
void generated_scores_by16(const float* __restrict__ qt, const float* __restrict__ kg, int64_t written, int64_t n,
                           float* __restrict__ gs) {
  constexpr int64_t U = 4;
  for (int64_t i0 = 0; i0 < n; i0 += 16) {
    int64_t u = 0;
    for (; u + U <= written; u += U) {
      v16 acc[U] = {};
      for (int64_t k = 0; k < DC; ++k) {
        const v16 qk = load(qt + k * n + i0);
        for (int64_t m = 0; m < U; ++m) acc[m] += qk * load(kg + ((u + m) * DC + k) * n + i0);
      }
      for (int64_t m = 0; m < U; ++m) store(gs + (u + m) * n + i0, acc[m]);
    }
    for (; u < written; ++u) {
      v16 acc = {};
      for (int64_t k = 0; k < DC; ++k) acc += load(qt + k * n + i0) * load(kg + (u * DC + k) * n + i0);
      store(gs + u * n + i0, acc);
    }
  }
}

// generated_values for n a multiple of 16 and a compiled-in head size: 16 lanes × 16 elements of the head accumulated in
// registers over the positions, then added to the n outputs.
template <int64_t DC>
void generated_values_by16(const float* __restrict__ w, const float* __restrict__ vg, int64_t written, int64_t n,
                           float* const* out) {
  for (int64_t i0 = 0; i0 < n; i0 += 16)
    for (int64_t k0 = 0; k0 < DC; k0 += 16) {
      v16 acc[16] = {};
      for (int64_t u = 0; u < written; ++u) {
        const v16 wu = load(w + u * n + i0);
        const float* __restrict__ values = vg + (u * DC + k0) * n + i0;
        for (int64_t c = 0; c < 16; ++c) acc[c] += wu * load(values + c * n);
      }
      for (int64_t c = 0; c < 16; ++c)
        for (int64_t l = 0; l < 16; ++l) out[i0 + l][k0 + c] += acc[c][l];
    }
}

// The generated part of one task's scores for query head g of its group: gs[u * n + i] = q_(sample i) . key u of sample
// i, for the `written` positions u of the task's lane-major cache kg [T, D, n]. With n > 1 the n samples are the
// vector lanes (each query's sum runs over d in order, no horizontal sums); one sample reads its keys as rows.
template <int64_t DC>
void generated_scores(const float* const* q, const float* __restrict__ kg, int64_t written, int64_t D, int64_t n,
                      float* __restrict__ qt, float* __restrict__ gs) {
  if (n == 1) return scores_rows<DC>(q[0], kg, written, D, D, gs);
  for (int64_t i = 0; i < n; ++i)
    for (int64_t k = 0; k < D; ++k) qt[k * n + i] = q[i][k];  // the n queries transposed, [D, n]
  if constexpr (DC > 0)
    if (n % 16 == 0) return generated_scores_by16<DC>(qt, kg, written, n, gs);
  for (int64_t u = 0; u < written; ++u) {
    float* __restrict__ row = gs + u * n;
    const float* __restrict__ keys = kg + u * D * n;
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) row[i] = qt[i] * keys[i];
    for (int64_t k = 1; k < D; ++k) {
#pragma omp simd
      for (int64_t i = 0; i < n; ++i) row[i] += qt[k * n + i] * keys[k * n + i];
    }
  }
}

// In place over a task's generated scores gs [written, n] for one query head: scale them and raise each lane's maximum
// m[i] (its prompt scores' maximum on entry) to theirs.
void generated_max(float* __restrict__ gs, int64_t written, int64_t n, float scale, float* __restrict__ m) {
  if (n == 1) {
    float top = m[0];
#pragma omp simd reduction(max:top)
    for (int64_t u = 0; u < written; ++u) { gs[u] *= scale; top = std::max(top, gs[u]); }
    m[0] = top;
    return;
  }
  for (int64_t u = 0; u < written; ++u) {
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) { gs[u * n + i] *= scale; m[i] = std::max(m[i], gs[u * n + i]); }
  }
}

// Then, with m final: each generated score s becomes exp(s - m[i]), and total[i] is their sum per lane.
void generated_exp(float* __restrict__ gs, int64_t written, int64_t n, const float* __restrict__ m, float* __restrict__ total) {
  if (n == 1) {
    float sum = 0.f;
#pragma omp simd reduction(+:sum)
    for (int64_t u = 0; u < written; ++u) { gs[u] = expf(gs[u] - m[0]); sum += gs[u]; }
    total[0] = sum;
    return;
  }
  for (int64_t i = 0; i < n; ++i) total[i] = 0.f;
  for (int64_t u = 0; u < written; ++u) {
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) { gs[u * n + i] = expf(gs[u * n + i] - m[i]); total[i] += gs[u * n + i]; }
  }
}

// out[i] += sum_u w[u * n + i] * value u of sample i, over the task's lane-major values vg [T, D, n]; acc [D, n] is
// scratch. One sample reads its values as rows.
template <int64_t DC>
void generated_values(const float* __restrict__ w, const float* __restrict__ vg, int64_t written, int64_t D, int64_t n,
                      float* __restrict__ acc, float* const* out) {
  if (n == 1) return weighted_rows<DC>(w, vg, written, D, D, out[0]);
  if constexpr (DC > 0)
    if (n % 16 == 0) return generated_values_by16<DC>(w, vg, written, n, out);
  for (int64_t e = 0; e < D * n; ++e) acc[e] = 0.f;
  for (int64_t u = 0; u < written; ++u) {
    const float* __restrict__ wu = w + u * n;
    const float* __restrict__ values = vg + u * D * n;
    for (int64_t k = 0; k < D; ++k) {
#pragma omp simd
      for (int64_t i = 0; i < n; ++i) acc[k * n + i] += wu[i] * values[k * n + i];
    }
  }
  for (int64_t i = 0; i < n; ++i)
    for (int64_t k = 0; k < D; ++k) out[i][k] += acc[k * n + i];
}

template <int64_t DC>  // the head size when it is a multiple of 16 compiled in (32, 64, 128), 0 otherwise
void attend(const float* Q, const float* KPT, const float* VP, const bool* KEEP, const float* KG, const float* VG, float* O,
            int64_t H, int64_t d_rt, int64_t B, int64_t KVH, int64_t L, int64_t T, int64_t written, int64_t n, float scale) {
  const int64_t D = DC ? DC : d_rt, G = H / KVH, QN = n * G;  // QN queries share a task's prompt cache
  constexpr int QB = DC == 0 ? 1 : (DC <= 64 ? 4 : 2);  // queries per register block (at most 16 accumulators)
  at::parallel_for(0, B * KVH, 1, [&](int64_t begin, int64_t end) {
    // per thread: prompt scores [QN, L]; generated scores [G, written, n]; a [D, n] scratch (transposed queries, then the
    // value accumulator); per-query maxima and sums; one head's per-lane maxima and sums
    std::vector<float> score_buf(QN * L), gen_buf(G * written * n), lane_buf(D * n), penalty_buf(L), top(QN), total(QN), lane(n),
        lane_total(n);
    std::vector<const float*> lane_q(n);
    std::vector<float*> lane_out(n);
    float* __restrict__ pen = penalty_buf.data();
    for (int64_t task = begin; task < end; ++task) {  // task: one prompt b and KV head kh
      const int64_t b = task / KVH, kh = task % KVH;
      const float* __restrict__ kpt = KPT + task * D * L;
      const float* __restrict__ vp = VP + task * L * D;
      const float* __restrict__ kg = KG + task * T * D * n;  // [T, D, n]: element k of sample i at position u at (u * D + k) * n + i
      const float* __restrict__ vg = VG + task * T * D * n;
      for (int64_t l = 0; l < L; ++l) pen[l] = KEEP[b * L + l] ? 0.f : -1e30f;  // a pad key: its exponential underflows to 0
      // query j is sample j / G's head kh * G + j % G; its prompt scores are row j of score_buf, its generated ones lane
      // j / G of block j % G of gen_buf
      auto query = [&](int64_t j) { return Q + ((b * n + j / G) * H + kh * G + j % G) * D; };
      auto output = [&](int64_t j) { return O + ((b * n + j / G) * H + kh * G + j % G) * D; };
      auto scores = [&](int64_t j) { return score_buf.data() + j * L; };
      auto generated = [&](int64_t g) { return gen_buf.data() + g * written * n; };
      int64_t j0 = 0;
      if constexpr (DC > 0)
        for (; j0 + QB <= QN; j0 += QB) {
          const float* qs[QB]; float* ps[QB];
          for (int qb = 0; qb < QB; ++qb) { qs[qb] = query(j0 + qb); ps[qb] = scores(j0 + qb); }
          scores_transposed_multi<DC, QB>(qs, kpt, L, ps);
        }
      for (int64_t j = j0; j < QN; ++j) scores_transposed<DC>(query(j), kpt, D, L, scores(j));
      for (int64_t g = 0; g < G; ++g) {
        for (int64_t i = 0; i < n; ++i) lane_q[i] = query(i * G + g);
        generated_scores<DC>(lane_q.data(), kg, written, D, n, lane_buf.data(), generated(g));
      }
      // one softmax per query over its prompt and generated scores: maxima first, then the exponentials and their sums
      for (int64_t j = 0; j < QN; ++j) {
        float* __restrict__ p = scores(j);
        float m = -FLT_MAX;
        for (int64_t l = 0; l < L; ++l) { p[l] = p[l] * scale + pen[l]; m = std::max(m, p[l]); }
        top[j] = m;
      }
      for (int64_t g = 0; g < G; ++g) {
        for (int64_t i = 0; i < n; ++i) lane[i] = top[i * G + g];
        generated_max(generated(g), written, n, scale, lane.data());
        for (int64_t i = 0; i < n; ++i) top[i * G + g] = lane[i];
        generated_exp(generated(g), written, n, lane.data(), lane_total.data());
        for (int64_t i = 0; i < n; ++i) total[i * G + g] = lane_total[i];
      }
      for (int64_t j = 0; j < QN; ++j) {
        float* __restrict__ p = scores(j);
        const float m = top[j];
        float sum = 0.f;
#pragma omp simd reduction(+:sum)
        for (int64_t l = 0; l < L; ++l) { p[l] = expf(p[l] - m); sum += p[l]; }
        total[j] += sum;
        float* o = output(j);
        for (int64_t k = 0; k < D; ++k) o[k] = 0.f;
      }
      j0 = 0;
      if constexpr (DC > 0)
        for (; j0 + QB <= QN; j0 += QB) {
          const float* ws[QB]; float* os[QB];
          for (int qb = 0; qb < QB; ++qb) { ws[qb] = scores(j0 + qb); os[qb] = output(j0 + qb); }
          weighted_rows_multi<DC, QB>(ws, vp, L, os);
        }
      for (int64_t j = j0; j < QN; ++j) weighted_rows<DC>(scores(j), vp, L, D, D, output(j));
      for (int64_t g = 0; g < G; ++g) {
        for (int64_t i = 0; i < n; ++i) lane_out[i] = output(i * G + g);
        generated_values<DC>(generated(g), vg, written, D, n, lane_buf.data(), lane_out.data());
      }
      for (int64_t j = 0; j < QN; ++j) {
        float* o = output(j);
        const float inv = 1.f / total[j];
        for (int64_t k = 0; k < D; ++k) o[k] *= inv;
      }
    }
  });
}

at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& kpt, const at::Tensor& vp, const at::Tensor& keep,
                            const at::Tensor& kg, const at::Tensor& vg, int64_t written, int64_t n, double scale) {
  for (const at::Tensor* t : {&q, &kpt, &vp, &kg, &vg})
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->is_contiguous() && t->device().is_cpu(),
                "decode_attention takes contiguous float32 CPU tensors");
  TORCH_CHECK(keep.scalar_type() == at::kBool && keep.is_contiguous(), "decode_attention: keep is a contiguous bool mask [B, L]");
  TORCH_CHECK(q.dim() == 3 && kpt.dim() == 4 && vp.dim() == 4 && kg.dim() == 5 && vg.sizes() == kg.sizes(),
              "decode_attention: q [B*n, H, D], kpt [B, KVH, D, L], vp [B, KVH, L, D], kg and vg [B, KVH, T, D, n]");
  const int64_t N = q.size(0), H = q.size(1), D = q.size(2);
  const int64_t B = kpt.size(0), KVH = kpt.size(1), L = kpt.size(3), T = kg.size(2);
  TORCH_CHECK(N == B * n && kg.size(0) == B && kg.size(1) == KVH && kg.size(3) == D && kg.size(4) == n && kpt.size(2) == D &&
              vp.size(2) == L && H % KVH == 0,
              "decode_attention: q [B*n, H, D], kpt [B, KVH, D, L], vp [B, KVH, L, D], kg and vg [B, KVH, T, D, n]");
  TORCH_CHECK(written >= 1 && written <= T, "decode_attention: written must be in 1..", T);
  at::Tensor out = at::empty({N, H, D}, q.options());
  const float *Q = q.data_ptr<float>(), *KPT = kpt.data_ptr<float>(), *VP = vp.data_ptr<float>();
  const float *KG = kg.data_ptr<float>(), *VG = vg.data_ptr<float>();
  const bool* KEEP = keep.data_ptr<bool>();
  float* O = out.data_ptr<float>();
  const float sc = static_cast<float>(scale);
  switch (D) {
    case 32: attend<32>(Q, KPT, VP, KEEP, KG, VG, O, H, D, B, KVH, L, T, written, n, sc); break;
    case 64: attend<64>(Q, KPT, VP, KEEP, KG, VG, O, H, D, B, KVH, L, T, written, n, sc); break;
    case 128: attend<128>(Q, KPT, VP, KEEP, KG, VG, O, H, D, B, KVH, L, T, written, n, sc); break;
    default: attend<0>(Q, KPT, VP, KEEP, KG, VG, O, H, D, B, KVH, L, T, written, n, sc);
  }
  return out;
}

}  // namespace

TORCH_LIBRARY(slm_bench, m) {
  m.def("decode_attention(Tensor q, Tensor kpt, Tensor vp, Tensor keep, Tensor kg, Tensor vg, int written, int n, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(slm_bench, CPU, m) { m.impl("decode_attention", &decode_attention); }
