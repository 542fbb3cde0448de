// One decode step's attention for slm_bench's lean decoder: each row's new query over its prompt's cache (shared by
// the prompt's n samples) and its own generated cache, in one softmax. The generated cache is time-major,
// [B, KVH, T, n, D]: one (prompt, KV head)'s n samples at a position lie side by side, so a step reads each task's
// generated keys and values as one stream. Built and documented by nbs/infer/06_decode_kernel.ipynb
// (slm_bench.infer.decode_kernel), whose plain-torch specification it matches.

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
constexpr int64_t POSITION_MAJOR_QUERIES = 8;  // a task with this many queries reads its generated cache position by position

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

template <int64_t DC>  // the head size when it is a multiple of 16 compiled in (32, 64, 128), 0 otherwise
void attend(const float* Q, const float* KPT, const float* VP, const bool* KEEP, const float* KG, const float* VG, float* O,
            int64_t H, int64_t d_rt, int64_t B, int64_t KVH, int64_t L, int64_t T, int64_t written, int64_t n, float scale) {
  const int64_t D = DC ? DC : d_rt, G = H / KVH, S = L + written, QN = n * G;  // QN queries share a task's caches
  constexpr int QB = DC == 0 ? 1 : (DC <= 64 ? 4 : 2);  // queries per register block (at most 16 accumulators)
  at::parallel_for(0, B * KVH, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> score_buf(QN * S), penalty_buf(L), inv(QN);
    float* __restrict__ pen = penalty_buf.data();
    for (int64_t task = begin; task < end; ++task) {  // task: one prompt b and KV head kh
      const int64_t b = task / KVH, kh = task % KVH;
      const float* __restrict__ kpt = KPT + task * D * L;
      const float* __restrict__ vp = VP + task * L * D;
      const float* __restrict__ kg = KG + task * T * n * D;  // [T, n, D]: position u of sample i at (u * n + i) * D
      const float* __restrict__ vg = VG + task * T * n * D;
      for (int64_t l = 0; l < L; ++l) pen[l] = KEEP[b * L + l] ? 0.f : -1e30f;  // a pad key: its exponential underflows to 0
      // query j is sample j / G's head kh * G + j % G; its scores are row j of score_buf (prompt keys, then generated)
      auto query = [&](int64_t j) { return Q + ((b * n + j / G) * H + kh * G + j % G) * D; };
      auto output = [&](int64_t j) { return O + ((b * n + j / G) * H + kh * G + j % G) * D; };
      auto scores = [&](int64_t j) { return score_buf.data() + j * S; };
      int64_t j0 = 0;
      if constexpr (DC > 0)
        for (; j0 + QB <= QN; j0 += QB) {
          const float* qs[QB]; float* ps[QB];
          for (int qb = 0; qb < QB; ++qb) { qs[qb] = query(j0 + qb); ps[qb] = scores(j0 + qb); }
          scores_transposed_multi<DC, QB>(qs, kpt, L, ps);
        }
      for (int64_t j = j0; j < QN; ++j) scores_transposed<DC>(query(j), kpt, D, L, scores(j));
      // generated keys: position by position over the task's queries (one stream), or with few queries (too few
      // independent sums to hide a sum's latency) query by query, each over its own positions n·D floats apart
      const bool by_position = QN >= POSITION_MAJOR_QUERIES;
      if (by_position)
        for (int64_t u = 0; u < written; ++u)
          for (int64_t j = 0; j < QN; ++j) scores_rows<DC>(query(j), kg + (u * n + j / G) * D, 1, D, D, scores(j) + L + u);
      else
        for (int64_t j = 0; j < QN; ++j) scores_rows<DC>(query(j), kg + (j / G) * D, written, D, n * D, scores(j) + L);
      for (int64_t j = 0; j < QN; ++j) {
        float* __restrict__ p = scores(j);
        float m = -FLT_MAX;
        for (int64_t l = 0; l < L; ++l) { p[l] = p[l] * scale + pen[l]; m = std::max(m, p[l]); }
        for (int64_t u = 0; u < written; ++u) { p[L + u] *= scale; m = std::max(m, p[L + u]); }
        float total = 0.f;
#pragma omp simd reduction(+:total)
        for (int64_t s = 0; s < S; ++s) { p[s] = expf(p[s] - m); total += p[s]; }
        inv[j] = 1.f / total;
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
      if (by_position)
        for (int64_t u = 0; u < written; ++u)
          for (int64_t j = 0; j < QN; ++j) weighted_rows<DC>(scores(j) + L + u, vg + (u * n + j / G) * D, 1, D, D, output(j));
      else
        for (int64_t j = 0; j < QN; ++j) weighted_rows<DC>(scores(j) + L, vg + (j / G) * D, written, D, n * D, output(j));
      for (int64_t j = 0; j < QN; ++j) {
        float* o = output(j);
        for (int64_t k = 0; k < D; ++k) o[k] *= inv[j];
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
              "decode_attention: q [B*n, H, D], kpt [B, KVH, D, L], vp [B, KVH, L, D], kg and vg [B, KVH, T, n, D]");
  const int64_t N = q.size(0), H = q.size(1), D = q.size(2);
  const int64_t B = kpt.size(0), KVH = kpt.size(1), L = kpt.size(3), T = kg.size(2);
  TORCH_CHECK(N == B * n && kg.size(0) == B && kg.size(1) == KVH && kg.size(3) == n && kg.size(4) == D && kpt.size(2) == D &&
              vp.size(2) == L && H % KVH == 0,
              "decode_attention: q [B*n, H, D], kpt [B, KVH, D, L], vp [B, KVH, L, D], kg and vg [B, KVH, T, n, D]");
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
