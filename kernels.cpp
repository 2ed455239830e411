// graft's CPU kernels: a linear and an attention whose result for a row is a function of that row's
// inputs alone, bit for bit, whatever the rows beside it (kernels.py says why and how they are built).
//
// Both are written so that every output element is reduced by one fixed sequence of float32 operations:
//   linear     y[m, n] = sum_k x[m, k] * W[n, k] (+ b[n]): 16-lane FMAs over k in order (bfloat16: the
//              CPU's bfloat16 dot product where it has one), a masked tail, one fixed horizontal sum.
//              Rows of x and of W are tiled for speed (4 x 4 outputs share their loads), but a tile
//              changes which outputs are computed together, never how.
//   attention  a query reads the keys its mask lets it see, in row order (committed rows, then its tree
//              ancestors: position order), scores them 16 at a time by one reduction tree per key, and
//              sums exp(score - max) * v one key after another (the weights' total in 16 lanes, in the
//              same order). Plain decoding at the same position sees the same keys in the same order.
// The one-token case reads each weight once as it streams, prefetching the next rows, which is what
// makes the step fast; nothing is chosen by the number of rows.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#if defined(__x86_64__)
#include <immintrin.h>
#endif
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>
#include <vector>

namespace {

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
using vec = __m512;
constexpr int64_t LANES = 16;
inline vec vzero() { return _mm512_setzero_ps(); }
inline vec vfma(vec a, vec b, vec c) { return _mm512_fmadd_ps(a, b, c); }
inline vec vset1(float f) { return _mm512_set1_ps(f); }
inline float vsum(vec a) { return _mm512_reduce_add_ps(a); }
inline __mmask16 tail_mask(int64_t n) { return (__mmask16)((1u << n) - 1u); }

template <typename T> inline vec vload(const T* p);
template <typename T> inline vec vload_tail(const T* p, int64_t n);
template <> inline vec vload<float>(const float* p) { return _mm512_loadu_ps(p); }
template <> inline vec vload_tail<float>(const float* p, int64_t n) { return _mm512_maskz_loadu_ps(tail_mask(n), p); }
template <> inline vec vload<at::BFloat16>(const at::BFloat16* p) {     // bf16 -> f32: the 16 bits on top
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p)), 16));
}
template <> inline vec vload_tail<at::BFloat16>(const at::BFloat16* p, int64_t n) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(tail_mask(n), p)), 16));
}
template <> inline vec vload<at::Half>(const at::Half* p) { return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)p)); }
template <> inline vec vload_tail<at::Half>(const at::Half* p, int64_t n) {
  return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(tail_mask(n), p));
}
inline void store(float* p, vec a) { _mm512_storeu_ps(p, a); }
inline vec vadd(vec a, vec b) { return _mm512_add_ps(a, b); }
inline vec vsub(vec a, vec b) { return _mm512_sub_ps(a, b); }
inline vec vmax2(vec a, vec b) { return _mm512_max_ps(a, b); }
inline vec vfirst(vec a, int64_t n) { return _mm512_maskz_mov_ps(tail_mask(n), a); }   // lanes >= n: 0
#else
// Portable: the same arithmetic on a 16-float array (the compiler may vectorize it; each lane's sum
// is still one fixed sequence).
struct vec { float v[16]; };
constexpr int64_t LANES = 16;
inline vec vzero() { vec r; for (int i = 0; i < 16; i++) r.v[i] = 0.f; return r; }
inline vec vfma(vec a, vec b, vec c) { for (int i = 0; i < 16; i++) c.v[i] = std::fma(a.v[i], b.v[i], c.v[i]); return c; }
inline vec vset1(float f) { vec r; for (int i = 0; i < 16; i++) r.v[i] = f; return r; }
inline float vsum(vec a) {                                   // a fixed pairwise tree
  for (int w = 8; w >= 1; w /= 2) for (int i = 0; i < w; i++) a.v[i] += a.v[i + w];
  return a.v[0];
}
template <typename T> inline vec vload(const T* p) { vec r; for (int i = 0; i < 16; i++) r.v[i] = float(p[i]); return r; }
template <typename T> inline vec vload_tail(const T* p, int64_t n) {
  vec r = vzero(); for (int64_t i = 0; i < n; i++) r.v[i] = float(p[i]); return r;
}
inline void store(float* p, vec a) { for (int i = 0; i < 16; i++) p[i] = a.v[i]; }
inline vec vadd(vec a, vec b) { for (int i = 0; i < 16; i++) a.v[i] += b.v[i]; return a; }
inline vec vsub(vec a, vec b) { for (int i = 0; i < 16; i++) a.v[i] -= b.v[i]; return a; }
inline vec vmax2(vec a, vec b) { for (int i = 0; i < 16; i++) a.v[i] = std::max(a.v[i], b.v[i]); return a; }
inline vec vfirst(vec a, int64_t n) { for (int64_t i = n; i < 16; i++) a.v[i] = 0.f; return a; }
#endif

// ------------------------------------------------------------------------------------------ linear

constexpr int64_t MR = 4, NR = 4;      // a tile: MR rows of x against NR rows of W

// How a tile reads and multiplies, by dtype. Widen: x float32 (widened once per call) against W of
// type T (float32, bfloat16 or float16, widened as it streams), 16 weights a step, one FMA per lane.
template <typename T>
struct Widen {
  using X = float;
  using V = vec;
  static constexpr int64_t STEP = LANES;
  static V x(const float* p) { return vload(p); }
  static V x_tail(const float* p, int64_t n) { return vload_tail(p, n); }
  static V w(const T* p) { return vload(p); }
  static V w_tail(const T* p, int64_t n) { return vload_tail(p, n); }
  static vec dot(V a, V b, vec acc) { return vfma(a, b, acc); }
};

#if defined(__AVX512BF16__)
// bfloat16 x and W with the CPU's bfloat16 dot product (VDPBF16PS): each of 16 lanes adds two exact
// products per instruction, 32 weights a step, no widening.
struct BF16Dot {
  using X = at::BFloat16;
  using V = __m512i;
  static constexpr int64_t STEP = 32;
  static V x(const X* p) { return _mm512_loadu_si512((const void*)p); }
  static V x_tail(const X* p, int64_t n) { return _mm512_maskz_loadu_epi16((__mmask32)((1ull << n) - 1u), p); }
  static V w(const X* p) { return x(p); }
  static V w_tail(const X* p, int64_t n) { return x_tail(p, n); }
  static vec dot(V a, V b, vec acc) { return _mm512_dpbf16_ps(acc, (__m512bh)a, (__m512bh)b); }
};
#endif

// y[m, n] for m in [m0, m0 + mr), n in [n0, n0 + nr). Every (m, n) runs the same sequence: the lanes'
// products over k in steps, in order, the masked tail, one vsum; mr and nr only decide how many
// outputs run side by side. pf: the next rows of W, prefetched while these compute (or null).
template <typename Op, typename T, int64_t mr, int64_t nr>
inline void tile(const typename Op::X* x, const T* w, const float* b, T* y, int64_t K, int64_t N, int64_t m0,
                 int64_t n0, const T* pf) {
  vec acc[mr][nr];
  #pragma GCC unroll 16
  for (int64_t i = 0; i < mr; i++) for (int64_t j = 0; j < nr; j++) acc[i][j] = vzero();
  auto step = [&](int64_t k, int64_t n) {            // n < STEP: the masked tail
    typename Op::V wv[nr];
    #pragma GCC unroll 16
    for (int64_t j = 0; j < nr; j++) wv[j] = n == Op::STEP ? Op::w(w + (n0 + j) * K + k) : Op::w_tail(w + (n0 + j) * K + k, n);
    if (pf)
#pragma GCC unroll 16
      for (int64_t j = 0; j < nr; j++) __builtin_prefetch(pf + j * K + k);
    #pragma GCC unroll 16
    for (int64_t i = 0; i < mr; i++) {
      const typename Op::V xv = n == Op::STEP ? Op::x(x + (m0 + i) * K + k) : Op::x_tail(x + (m0 + i) * K + k, n);
      #pragma GCC unroll 16
      for (int64_t j = 0; j < nr; j++) acc[i][j] = Op::dot(xv, wv[j], acc[i][j]);
    }
  };
  int64_t k = 0;
  for (; k + Op::STEP <= K; k += Op::STEP) step(k, Op::STEP);
  if (k < K) step(k, K - k);
  #pragma GCC unroll 16
  for (int64_t i = 0; i < mr; i++)
    #pragma GCC unroll 16
    for (int64_t j = 0; j < nr; j++) {
      float s = vsum(acc[i][j]);
      if (b) s += b[n0 + j];
      y[(m0 + i) * N + n0 + j] = T(s);
    }
}

template <typename X, typename T, int64_t nr>
inline void rows(const X* x, const T* w, const float* b, T* y, int64_t M, int64_t K, int64_t N, int64_t n0) {
  // the first pass over these nr rows of W also prefetches the next nr (memory streams while it computes)
  const T* pf = n0 + 2 * nr <= N ? w + (n0 + nr) * K : nullptr;
  int64_t m = 0;
#if defined(__AVX512BF16__)
  using Op = std::conditional_t<std::is_same_v<X, at::BFloat16>, BF16Dot, Widen<T>>;
#else
  using Op = Widen<T>;
#endif
  for (; m + MR <= M; m += MR) tile<Op, T, MR, nr>(x, w, b, y, K, N, m, n0, m ? nullptr : pf);
  for (; m < M; m++) tile<Op, T, 1, nr>(x, w, b, y, K, N, m, n0, m ? nullptr : pf);
}

template <typename X, typename T>
void linear_impl(const X* x, const T* w, const float* b, T* y, int64_t M, int64_t K, int64_t N) {
  const int64_t tiles = (N + NR - 1) / NR;
  // split over output columns only: a thread never shares an output's sum with another
  at::parallel_for(0, tiles, 16, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; t++) {
      int64_t n0 = t * NR;
      if (n0 + NR <= N) rows<X, T, NR>(x, w, b, y, M, K, N, n0);
      else for (int64_t n = n0; n < N; n++) rows<X, T, 1>(x, w, b, y, M, K, N, n);
    }
  });
}

at::Tensor linear(const at::Tensor& x, const at::Tensor& w, const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.device().is_cpu() && w.device().is_cpu(), "graft::linear: CPU tensors only");
  TORCH_CHECK(w.dim() == 2 && x.size(-1) == w.size(1), "graft::linear: x (..., K) and W (N, K)");
  TORCH_CHECK(x.scalar_type() == w.scalar_type(), "graft::linear: x and W of one dtype");
  const int64_t K = w.size(1), N = w.size(0);
  auto xs = x.reshape({-1, K}).contiguous();
  auto wc = w.contiguous();
  const int64_t M = xs.size(0);
  auto sizes = x.sizes().vec();
  sizes.back() = N;
  auto y = at::empty({M, N}, x.options());
  at::Tensor bf;
  if (bias.has_value() && bias->defined()) bf = bias->to(at::kFloat).contiguous();
  const float* bp = bf.defined() ? bf.data_ptr<float>() : nullptr;
  switch (x.scalar_type()) {
    case at::kFloat: linear_impl(xs.data_ptr<float>(), wc.data_ptr<float>(), bp, y.data_ptr<float>(), M, K, N); break;
    case at::kBFloat16:
#if defined(__AVX512BF16__)
      linear_impl(xs.data_ptr<at::BFloat16>(), wc.data_ptr<at::BFloat16>(), bp, y.data_ptr<at::BFloat16>(), M, K, N);
      break;
#endif
    case at::kHalf: {
      auto xf = xs.to(at::kFloat);                    // x widened once; W widened as it streams
      if (x.scalar_type() == at::kHalf)
        linear_impl(xf.data_ptr<float>(), wc.data_ptr<at::Half>(), bp, y.data_ptr<at::Half>(), M, K, N);
      else
        linear_impl(xf.data_ptr<float>(), wc.data_ptr<at::BFloat16>(), bp, y.data_ptr<at::BFloat16>(), M, K, N);
      break;
    }
    default: TORCH_CHECK(false, "graft::linear: float32, bfloat16 or float16");
  }
  return y.view(sizes);
}

// ------------------------------------------------------------------------------------------ attention

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
// exp(x) for x <= 0 (scores minus their max), 16 lanes: x = i ln2 + r, a degree-6 polynomial in r, times 2^i.
// Each lane's arithmetic is the same whatever lanes run beside it.
inline vec vexp_neg(vec x) {
  const vec t = _mm512_roundscale_ps(_mm512_mul_ps(x, vset1(1.44269504088896341f)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  vec r = _mm512_fmadd_ps(t, vset1(-0.693359375f), x);
  r = _mm512_fmadd_ps(t, vset1(2.12194440e-4f), r);
  vec p = vset1(1.3888889e-3f);
  p = _mm512_fmadd_ps(p, r, vset1(8.3333333e-3f));
  p = _mm512_fmadd_ps(p, r, vset1(4.1666667e-2f));
  p = _mm512_fmadd_ps(p, r, vset1(1.6666667e-1f));
  p = _mm512_fmadd_ps(p, r, vset1(0.5f));
  p = _mm512_fmadd_ps(p, r, vset1(1.0f));
  p = _mm512_fmadd_ps(p, r, vset1(1.0f));
  return _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(x, vset1(-87.f), _CMP_GE_OQ), _mm512_scalef_ps(p, t));
}

// The 16 horizontal sums of x[0..15] in one vector (lane i holds the sum of x[PERM[i]]): every sum by
// the same tree, lanes l + 8, then + 4, + 2, + 1, so a key's score does not depend on its neighbours.
inline vec vsum16(vec* x) {
  vec y[8], z[4], w[2];
  for (int i = 0; i < 8; i++)
    y[i] = _mm512_add_ps(_mm512_shuffle_f32x4(x[2 * i], x[2 * i + 1], 0x44), _mm512_shuffle_f32x4(x[2 * i], x[2 * i + 1], 0xEE));
  for (int i = 0; i < 4; i++)
    z[i] = _mm512_add_ps(_mm512_shuffle_f32x4(y[2 * i], y[2 * i + 1], 0x88), _mm512_shuffle_f32x4(y[2 * i], y[2 * i + 1], 0xDD));
  for (int i = 0; i < 2; i++)
    w[i] = _mm512_add_ps(_mm512_shuffle_ps(z[2 * i], z[2 * i + 1], 0x44), _mm512_shuffle_ps(z[2 * i], z[2 * i + 1], 0xEE));
  return _mm512_add_ps(_mm512_shuffle_ps(w[0], w[1], 0x88), _mm512_shuffle_ps(w[0], w[1], 0xDD));
}
inline float vmax(vec a) { return _mm512_reduce_max_ps(a); }
#else
inline vec vexp_neg(vec x) {
  vec o;
  for (int l = 0; l < 16; l++) {
    float v = x.v[l], t = std::nearbyint(v * 1.44269504088896341f);
    float r = std::fma(t, -0.693359375f, v);
    r = std::fma(t, 2.12194440e-4f, r);
    float p = 1.3888889e-3f;
    p = std::fma(p, r, 8.3333333e-3f); p = std::fma(p, r, 4.1666667e-2f); p = std::fma(p, r, 1.6666667e-1f);
    p = std::fma(p, r, 0.5f); p = std::fma(p, r, 1.0f); p = std::fma(p, r, 1.0f);
    o.v[l] = v >= -87.f ? std::ldexp(p, (int)t) : 0.f;
  }
  return o;
}
inline vec vsum16(vec* x) { vec o; for (int l = 0; l < 16; l++) o.v[l] = vsum(x[l]); return o; }
inline float vmax(vec a) { float m = a.v[0]; for (int l = 1; l < 16; l++) m = std::max(m, a.v[l]); return m; }
#endif

// which x[] each lane of vsum16 sums (found once by summing x[u] = u in lane 0)
struct Perm {
  int32_t lane_of[16];
  Perm() {
    vec x[16];
    float buf[16];
    for (int u = 0; u < 16; u++) {
      for (int l = 0; l < 16; l++) buf[l] = l ? 0.f : float(u);
      x[u] = vload(buf);
    }
    store(buf, vsum16(x));
    for (int l = 0; l < 16; l++) lane_of[(int)buf[l]] = l;
  }
};
const Perm PERM;

// GN query heads that share a KV head, against the keys their query sees (rows seen[0..n-1], in row
// order): out[g][0..D-1] = softmax(q_g.K) V. Each key row is loaded once for the GN heads; each head's
// arithmetic is its own and the same whatever heads run beside it. NV: vectors per head row
// (D <= 16 NV), so the outputs stay in registers. qf: GN rows of 16 NV floats (scaled, zero-padded).
template <typename T, int NV, int GN>
inline void heads(const float* qf, const T* kb, int64_t kstride, const T* vb, int64_t vstride, const int64_t* seen,
                  int64_t n, int64_t D, float* s, int64_t sstride, T* const* out) {
  const int64_t nv = (D + LANES - 1) / LANES;        // vectors in use (NV rounds up)
  auto row = [&](const T* r, vec* x) {
    for (int e = 0; e < NV; e++) {
      const int64_t d = e * LANES;
      x[e] = e >= nv ? vzero() : d + LANES <= D ? vload(r + d) : vload_tail(r + d, D - d);
    }
  };
  // 1. scores, 16 keys at a time (vsum16), and their max
  vec top[GN];
  for (int g = 0; g < GN; g++) top[g] = vset1(-std::numeric_limits<float>::infinity());
  for (int64_t c = 0; c < n; c += 16) {
    const int64_t m = std::min<int64_t>(16, n - c);
    vec part[GN][16];
    for (int64_t u = 0; u < 16; u++) {
      vec kr[NV];
      if (u < m) row(kb + seen[c + u] * kstride, kr);
      for (int g = 0; g < GN; g++) {
        vec a = vzero();
        if (u < m)
          for (int e = 0; e < NV; e++) if (e < nv) a = vfma(vload(qf + (g * NV + e) * LANES), kr[e], a);
        part[g][u] = a;
      }
    }
    for (int g = 0; g < GN; g++) {
      float buf[16];
      store(buf, vsum16(part[g]));
      float* sg = s + g * sstride + c;
      for (int64_t u = 0; u < 16; u++) sg[u] = u < m ? buf[PERM.lane_of[u]] : -std::numeric_limits<float>::infinity();
      top[g] = vmax2(top[g], vload(sg));
    }
  }
  // 2. p = exp(score - max), summed in 16 lanes; sum p * v key after key, in registers
  vec mx[GN], o[GN][NV], l[GN];
  for (int g = 0; g < GN; g++) {
    mx[g] = vset1(vmax(top[g]));
    l[g] = vzero();
    for (int e = 0; e < NV; e++) o[g][e] = vzero();
  }
  for (int64_t c = 0; c < n; c += 16) {
    const int64_t m = std::min<int64_t>(16, n - c);
    float pb[GN][16];
    for (int g = 0; g < GN; g++) {
      const vec p = vfirst(vexp_neg(vsub(vload(s + g * sstride + c), mx[g])), m);
      l[g] = vadd(l[g], p);
      store(pb[g], p);
    }
    for (int64_t u = 0; u < m; u++) {
      vec vr[NV];
      row(vb + seen[c + u] * vstride, vr);
      for (int g = 0; g < GN; g++) {
        const vec pv = vset1(pb[g][u]);
        for (int e = 0; e < NV; e++) if (e < nv) o[g][e] = vfma(pv, vr[e], o[g][e]);
      }
    }
  }
  for (int g = 0; g < GN; g++) {
    const float sum = vsum(l[g]);
    float buf[16 * NV];
    for (int e = 0; e < NV; e++) store(buf + e * LANES, o[g][e]);
    for (int64_t d = 0; d < D; d++) out[g][d] = T(n ? buf[d] / sum : 0.f);     // sees nothing (padding): zeros
  }
}

// every head of one KV head, GN at a time (GN from NV: the outputs must fit in registers)
template <typename T, int NV, int GMAX>
inline void kv_head(const float* qf, const T* kb, int64_t kstride, const T* vb, int64_t vstride, const int64_t* seen,
                    int64_t n, int64_t D, float* s, int64_t sstride, T* const* out, int64_t G) {
  for (int64_t g = 0; g < G; g += GMAX) {
    const float* q = qf + g * NV * LANES;
    switch (std::min<int64_t>(GMAX, G - g)) {
      case 1: heads<T, NV, 1>(q, kb, kstride, vb, vstride, seen, n, D, s, sstride, out + g); break;
      case 2: heads<T, NV, (GMAX >= 2 ? 2 : 1)>(q, kb, kstride, vb, vstride, seen, n, D, s, sstride, out + g); break;
      case 3: heads<T, NV, (GMAX >= 3 ? 3 : 1)>(q, kb, kstride, vb, vstride, seen, n, D, s, sstride, out + g); break;
      default: heads<T, NV, GMAX>(q, kb, kstride, vb, vstride, seen, n, D, s, sstride, out + g);
    }
  }
}

template <typename T>
void attention_impl(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& mask,
                    at::Tensor& out, float scale) {
  const int64_t B = q.size(0), H = q.size(1), Tq = q.size(2), D = q.size(3);
  const int64_t Hkv = k.size(1), S = k.size(2), G = H / Hkv;
  const T* qp = q.data_ptr<T>(); const T* kp = k.data_ptr<T>(); const T* vp = v.data_ptr<T>();
  const bool* mp = mask.data_ptr<bool>();
  T* op = out.data_ptr<T>();
  const auto qs = q.strides(), ks = k.strides(), vs = v.strides(), ms = mask.strides();
  TORCH_CHECK(qs[3] == 1 && ks[3] == 1 && vs[3] == 1, "graft::attention: rows must be contiguous");
  TORCH_CHECK(D <= 256, "graft::attention: head_dim <= 256");
  const int64_t NV = (D + LANES - 1) / LANES;
  const int64_t NVT = NV <= 1 ? 1 : NV <= 2 ? 2 : NV <= 4 ? 4 : NV <= 8 ? 8 : 16;     // the template's
  // one task per (request, query): its keys found once, then every KV head with the heads that share it
  at::parallel_for(0, B * Tq, 1, [&](int64_t i0, int64_t i1) {
    std::vector<int64_t> seen(S);
    std::vector<float> s(G * (S + 16)), qf(G * NVT * LANES, 0.f);
    std::vector<T*> outs(G);
    for (int64_t i = i0; i < i1; i++) {
      const int64_t b = i / Tq, t = i % Tq;
      const bool* mrow = mp + b * ms[0] + t * ms[2];
      int64_t n = 0;                                    // the keys this query sees, in row order
      for (int64_t j = 0; j < S; j++) if (mrow[j * ms[3]]) seen[n++] = j;
      for (int64_t h = 0; h < Hkv; h++) {
        for (int64_t g = 0; g < G; g++) {
          const T* qr = qp + b * qs[0] + (h * G + g) * qs[1] + t * qs[2];
          for (int64_t d = 0; d < D; d++) qf[g * NVT * LANES + d] = float(qr[d]) * scale;
          outs[g] = op + ((b * H + h * G + g) * Tq + t) * D;
        }
        const T* kb = kp + b * ks[0] + h * ks[1];
        const T* vb = vp + b * vs[0] + h * vs[1];
        const float* q = qf.data();
        switch (NVT) {
          case 1: kv_head<T, 1, 4>(q, kb, ks[2], vb, vs[2], seen.data(), n, D, s.data(), S + 16, outs.data(), G); break;
          case 2: kv_head<T, 2, 4>(q, kb, ks[2], vb, vs[2], seen.data(), n, D, s.data(), S + 16, outs.data(), G); break;
          case 4: kv_head<T, 4, 4>(q, kb, ks[2], vb, vs[2], seen.data(), n, D, s.data(), S + 16, outs.data(), G); break;
          case 8: kv_head<T, 8, 2>(q, kb, ks[2], vb, vs[2], seen.data(), n, D, s.data(), S + 16, outs.data(), G); break;
          default: kv_head<T, 16, 1>(q, kb, ks[2], vb, vs[2], seen.data(), n, D, s.data(), S + 16, outs.data(), G);
        }
      }
    }
  });
}

at::Tensor attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& mask,
                     double scale) {
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4 && mask.dim() == 4, "graft::attention: 4-d tensors");
  TORCH_CHECK(q.scalar_type() == k.scalar_type() && k.scalar_type() == v.scalar_type(), "graft::attention: one dtype");
  TORCH_CHECK(mask.scalar_type() == at::kBool, "graft::attention: a bool mask");
  TORCH_CHECK(q.size(1) % k.size(1) == 0 && k.sizes() == v.sizes() && q.size(3) == k.size(3), "graft::attention: shapes");
  TORCH_CHECK(mask.size(2) == q.size(2) && mask.size(3) == k.size(2), "graft::attention: mask (B, 1, T, S)");
  auto m = mask.expand({q.size(0), 1, q.size(2), k.size(2)});
  auto out = at::empty(q.sizes(), q.options());
  switch (q.scalar_type()) {
    case at::kFloat: attention_impl<float>(q, k, v, m, out, (float)scale); break;
    case at::kBFloat16: attention_impl<at::BFloat16>(q, k, v, m, out, (float)scale); break;
    case at::kHalf: attention_impl<at::Half>(q, k, v, m, out, (float)scale); break;
    default: TORCH_CHECK(false, "graft::attention: float32, bfloat16 or float16");
  }
  return out;
}

}  // namespace

TORCH_LIBRARY(graft, lib) {
  lib.def("linear(Tensor x, Tensor w, Tensor? bias) -> Tensor");
  lib.def("attention(Tensor q, Tensor k, Tensor v, Tensor mask, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(graft, CPU, lib) {
  lib.impl("linear", &linear);
  lib.impl("attention", &attention);
}
