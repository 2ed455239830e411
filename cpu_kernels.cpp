// graft's CPU kernels: a linear, an attention and a whole decoder layer whose result for a row is a
// function of that row's inputs alone, bit for bit, whatever the rows beside it (cpu_kernels.py says why and
// how they are built).
//
// Each is written so that every output element is reduced by one fixed sequence of float32 operations:
//   linear     y[m, n] = sum_k x[m, k] * W[n, k] (+ b[n]): 16-lane FMAs over k in order (bfloat16: the
//              CPU's bfloat16 dot product where it has one), a masked tail, one fixed horizontal sum.
//              W is read as four sequential streams (its rows in quarters), four rows of x sharing each
//              load, but that changes which outputs are computed together, never how.
//   attention  a query reads the keys its mask lets it see, in row order (committed rows, then its tree
//              ancestors: position order), scores them 16 at a time by one reduction tree per key, and
//              sums exp(score - max) * v one key after another (the weights' total in 16 lanes, in the
//              same order). Plain decoding at the same position sees the same keys in the same order.
//   block      a Llama/Qwen3 layer: the two above, and row-wise stages (norms, RoPE, SwiGLU, residuals)
//              16 lanes at a time with lane-wise arithmetic only.
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
#include <cstring>
#include <limits>
#include <memory>
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
inline vec vmul(vec a, vec b) { return _mm512_mul_ps(a, b); }
inline vec vdiv(vec a, vec b) { return _mm512_div_ps(a, b); }
inline vec vmin2(vec a, vec b) { return _mm512_min_ps(a, b); }
inline vec vif_nonneg(vec c, vec a, vec b) { return _mm512_mask_blend_ps(_mm512_cmp_ps_mask(c, vzero(), _CMP_GE_OQ), b, a); }
// float32 -> T, rounded to nearest even (as c10's conversions), n lanes stored; vround: the same rounding, kept as float32
inline __m256i bf16_bits(vec a) {
  const __m512i u = _mm512_castps_si512(a);
  const __m512i r = _mm512_add_epi32(u, _mm512_add_epi32(_mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1)), _mm512_set1_epi32(0x7FFF)));
  const __m512i b = _mm512_mask_mov_epi32(_mm512_srli_epi32(r, 16), _mm512_cmp_ps_mask(a, a, _CMP_UNORD_Q), _mm512_set1_epi32(0x7FC0));
  return _mm512_cvtepi32_epi16(b);                  // NaN: c10's quiet NaN
}
template <typename T> inline void vstore(T* p, vec a, int64_t n);
template <> inline void vstore<float>(float* p, vec a, int64_t n) { _mm512_mask_storeu_ps(p, tail_mask(n), a); }
template <> inline void vstore<at::BFloat16>(at::BFloat16* p, vec a, int64_t n) { _mm256_mask_storeu_epi16(p, tail_mask(n), bf16_bits(a)); }
template <> inline void vstore<at::Half>(at::Half* p, vec a, int64_t n) {
  _mm256_mask_storeu_epi16(p, tail_mask(n), _mm512_cvtps_ph(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}
template <typename T> inline vec vround(vec a);
template <> inline vec vround<float>(vec a) { return a; }
template <> inline vec vround<at::BFloat16>(vec a) { return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bf16_bits(a)), 16)); }
template <> inline vec vround<at::Half>(vec a) { return _mm512_cvtph_ps(_mm512_cvtps_ph(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)); }
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
inline vec vmul(vec a, vec b) { for (int i = 0; i < 16; i++) a.v[i] *= b.v[i]; return a; }
inline vec vdiv(vec a, vec b) { for (int i = 0; i < 16; i++) a.v[i] /= b.v[i]; return a; }
inline vec vmin2(vec a, vec b) { for (int i = 0; i < 16; i++) a.v[i] = std::min(a.v[i], b.v[i]); return a; }
inline vec vif_nonneg(vec c, vec a, vec b) { for (int i = 0; i < 16; i++) a.v[i] = c.v[i] >= 0.f ? a.v[i] : b.v[i]; return a; }
template <typename T> inline void vstore(T* p, vec a, int64_t n) { for (int64_t i = 0; i < n; i++) p[i] = T(a.v[i]); }
template <typename T> inline vec vround(vec a) { for (int i = 0; i < 16; i++) a.v[i] = float(T(a.v[i])); return a; }
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

// y[m, n] for m in [m0, m0 + mr), n = n0, n0 + rs, .., n0 + (nr - 1) rs. Every (m, n) runs the same
// sequence: the lanes' products over k in steps, in order, the masked tail, one vsum; mr, nr and rs only
// decide which outputs run side by side. pf: the rows of W after these (one row on in each of the nr
// streams), prefetched while these compute (or null).
template <typename Op, typename T, int64_t mr, int64_t nr>
inline void tile(const typename Op::X* x, const T* w, const float* b, T* y, int64_t K, int64_t N, int64_t m0,
                 int64_t n0, int64_t rs, const T* pf) {
  vec acc[mr][nr];
  #pragma GCC unroll 16
  for (int64_t i = 0; i < mr; i++) for (int64_t j = 0; j < nr; j++) acc[i][j] = vzero();
  auto step = [&](int64_t k, int64_t n) {            // n < STEP: the masked tail
    typename Op::V wv[nr];
    #pragma GCC unroll 16
    for (int64_t j = 0; j < nr; j++) wv[j] = n == Op::STEP ? Op::w(w + (n0 + j * rs) * K + k) : Op::w_tail(w + (n0 + j * rs) * K + k, n);
    if (pf)
#pragma GCC unroll 16
      for (int64_t j = 0; j < nr; j++) __builtin_prefetch(pf + j * rs * K + k);
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
      if (b) s += b[n0 + j * rs];
      y[(m0 + i) * N + n0 + j * rs] = T(s);
    }
}

// every row of x against W's rows n0 + j rs (j < nr), the last (n0 + rs - 1: the stream's end) prefetching nothing
template <typename X, typename T, int64_t nr>
inline void rows(const X* x, const T* w, const float* b, T* y, int64_t M, int64_t K, int64_t N, int64_t n0, int64_t rs,
                 bool last) {
  const T* pf = last ? nullptr : w + (n0 + 1) * K;
  int64_t m = 0;
#if defined(__AVX512BF16__)
  using Op = std::conditional_t<std::is_same_v<X, at::BFloat16>, BF16Dot, Widen<T>>;
#else
  using Op = Widen<T>;
#endif
  for (; m + MR <= M; m += MR) tile<Op, T, MR, nr>(x, w, b, y, K, N, m, n0, rs, m ? nullptr : pf);
  for (; m < M; m++) tile<Op, T, 1, nr>(x, w, b, y, K, N, m, n0, rs, m ? nullptr : pf);
}

// W read as NR sequential streams (its rows in NR contiguous quarters, each walked row after row, which
// the memory's prefetchers follow), the rows past the quarters one at a time. Threads split the
// streams' rows: a thread never shares an output's sum with another.
template <typename X, typename T>
void linear_impl(const X* x, const T* w, const float* b, T* y, int64_t M, int64_t K, int64_t N) {
  const int64_t Q = N / NR;
  at::parallel_for(0, Q, 16, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; t++) rows<X, T, NR>(x, w, b, y, M, K, N, t, Q, t + 1 == t1);
  });
  for (int64_t n = NR * Q; n < N; n++) rows<X, T, 1>(x, w, b, y, M, K, N, n, 1, n + 1 == N);
}

// y (M, N) = x (M, K) W^T (+ b), x and y of W's dtype T. bfloat16 runs the CPU's bfloat16 dot product
// where it has one; otherwise x is widened into `wide` once and W as it streams.
template <typename T>
void lin(const T* x, int64_t M, const at::Tensor& w, const float* b, T* y, std::vector<float>& wide) {
  const int64_t K = w.size(1), N = w.size(0);
  const T* wp = w.data_ptr<T>();
#if defined(__AVX512BF16__)
  constexpr bool narrow = std::is_same_v<T, float> || std::is_same_v<T, at::BFloat16>;
#else
  constexpr bool narrow = std::is_same_v<T, float>;
#endif
  if constexpr (narrow) {
    linear_impl(x, wp, b, y, M, K, N);
  } else {
    wide.resize(M * K);
    for (int64_t i = 0; i < M * K; i++) wide[i] = float(x[i]);
    linear_impl(wide.data(), wp, b, y, M, K, N);
  }
}

// bias (N,) as float32 (null: none); `keep` holds the converted copy alive
inline const float* bias_ptr(const c10::optional<at::Tensor>& bias, at::Tensor& keep) {
  if (!bias.has_value() || !bias->defined()) return nullptr;
  keep = bias->to(at::kFloat).contiguous();
  return keep.data_ptr<float>();
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
  const float* bp = bias_ptr(bias, bf);
  std::vector<float> wide;
  switch (x.scalar_type()) {
    case at::kFloat: lin(xs.data_ptr<float>(), M, wc, bp, y.data_ptr<float>(), wide); break;
    case at::kBFloat16: lin(xs.data_ptr<at::BFloat16>(), M, wc, bp, y.data_ptr<at::BFloat16>(), wide); break;
    case at::kHalf: lin(xs.data_ptr<at::Half>(), M, wc, bp, y.data_ptr<at::Half>(), wide); break;
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

// Attention of GN query heads that share a KV head, against the keys their query sees (rows seen[0..n-1],
// in row order): out[g][0..D-1] = softmax(q_g.K) V, in three steps a caller may interleave with other
// queries' (so that the queries of one request read each block of keys while it is in cache): scores
// (chunks of 16 keys, their max), then sum (exp(score - max), summed in 16 lanes; sum p v key after key),
// then finish. Each key row is loaded once for the GN heads; each head's arithmetic is its own and the
// same whatever heads or queries run beside it and however the key range is split. NV: vectors per head
// row (D <= 16 NV). qf: GN rows of 16 NV floats (scaled, zero-padded); s: GN rows of scores.
template <int NV, int GN>
struct Heads {
  vec top[GN], mx[GN], l[GN], o[GN][NV];
  Heads() {
    for (int g = 0; g < GN; g++) {
      top[g] = vset1(-std::numeric_limits<float>::infinity());
      l[g] = vzero();
      for (int e = 0; e < NV; e++) o[g][e] = vzero();
    }
  }
};

template <typename T, int NV>
inline void key_row(const T* r, int64_t D, vec* x) {
  const int64_t nv = (D + LANES - 1) / LANES;        // vectors in use (NV rounds up)
  for (int e = 0; e < NV; e++) {
    const int64_t d = e * LANES;
    x[e] = e >= nv ? vzero() : d + LANES <= D ? vload(r + d) : vload_tail(r + d, D - d);
  }
}

// scores of keys [c0, c1) (multiples of 16) and their running max
template <typename T, int NV, int GN>
inline void scores(Heads<NV, GN>& a, const float* qf, const T* kb, int64_t kstride, const int64_t* seen, int64_t n,
                   int64_t c0, int64_t c1, int64_t D, float* s, int64_t sstride) {
  const int64_t nv = (D + LANES - 1) / LANES;
  for (int64_t c = c0; c < std::min(c1, n); c += 16) {
    const int64_t m = std::min<int64_t>(16, n - c);
    vec part[GN][16];
    for (int64_t u = 0; u < 16; u++) {
      vec kr[NV];
      if (u < m) key_row<T, NV>(kb + seen[c + u] * kstride, D, kr);
      for (int g = 0; g < GN; g++) {
        vec acc = vzero();
        if (u < m)
          for (int e = 0; e < NV; e++) if (e < nv) acc = vfma(vload(qf + (g * NV + e) * LANES), kr[e], acc);
        part[g][u] = acc;
      }
    }
    for (int g = 0; g < GN; g++) {
      float buf[16];
      store(buf, vsum16(part[g]));
      float* sg = s + g * sstride + c;
      for (int64_t u = 0; u < 16; u++) sg[u] = u < m ? buf[PERM.lane_of[u]] : -std::numeric_limits<float>::infinity();
      a.top[g] = vmax2(a.top[g], vload(sg));
    }
  }
}

// p = exp(score - max) of keys [c0, c1), summed in 16 lanes; p v summed key after key (scores: all done)
template <typename T, int NV, int GN>
inline void sum(Heads<NV, GN>& a, const T* vb, int64_t vstride, const int64_t* seen, int64_t n, int64_t c0, int64_t c1,
                int64_t D, const float* s, int64_t sstride) {
  const int64_t nv = (D + LANES - 1) / LANES;
  vec o[GN][NV];                                       // in registers for the range
  for (int g = 0; g < GN; g++) for (int e = 0; e < NV; e++) o[g][e] = a.o[g][e];
  for (int64_t c = c0; c < std::min(c1, n); c += 16) {
    const int64_t m = std::min<int64_t>(16, n - c);
    float pb[GN][16];
    for (int g = 0; g < GN; g++) {
      const vec p = vfirst(vexp_neg(vsub(vload(s + g * sstride + c), a.mx[g])), m);
      a.l[g] = vadd(a.l[g], p);
      store(pb[g], p);
    }
    for (int64_t u = 0; u < m; u++) {
      vec vr[NV];
      key_row<T, NV>(vb + seen[c + u] * vstride, D, vr);
      for (int g = 0; g < GN; g++) {
        const vec pv = vset1(pb[g][u]);
        for (int e = 0; e < NV; e++) if (e < nv) o[g][e] = vfma(pv, vr[e], o[g][e]);
      }
    }
  }
  for (int g = 0; g < GN; g++) for (int e = 0; e < NV; e++) a.o[g][e] = o[g][e];
}

template <typename T, int NV, int GN>
inline void finish(Heads<NV, GN>& a, int64_t n, int64_t D, T* const* out) {
  for (int g = 0; g < GN; g++) {
    const float total = vsum(a.l[g]);
    float buf[16 * NV];
    for (int e = 0; e < NV; e++) store(buf + e * LANES, a.o[g][e]);
    for (int64_t d = 0; d < D; d++) out[g][d] = T(n ? buf[d] / total : 0.f);     // sees nothing (padding): zeros
  }
}

// One KV head of one request: its Tq queries' GN heads g0.. against their keys (query t: seen[t], n[t]),
// the keys taken in blocks of KB, every query's work on a block before the next block: a tree's queries
// share the committed rows, which are then read from memory once for all of them, not once per query.
constexpr int64_t KB = 256;
template <typename T, int NV, int GN>
void kv_group(const float* qf, int64_t qstride, const T* kb, int64_t kstride, const T* vb, int64_t vstride,
              const int64_t* const* seen, const int64_t* n, int64_t Tq, int64_t D, float* s, int64_t sstride,
              T* const* out, int64_t ostride) {
  std::vector<Heads<NV, GN>> a(Tq);
  const int64_t most = *std::max_element(n, n + Tq);
  for (int64_t c = 0; c < most; c += KB)
    for (int64_t t = 0; t < Tq; t++) scores<T, NV, GN>(a[t], qf + t * qstride, kb, kstride, seen[t], n[t], c, c + KB, D, s + t * GN * sstride, sstride);
  for (int64_t t = 0; t < Tq; t++)
    for (int g = 0; g < GN; g++) a[t].mx[g] = vset1(vmax(a[t].top[g]));
  for (int64_t c = 0; c < most; c += KB)
    for (int64_t t = 0; t < Tq; t++) sum<T, NV, GN>(a[t], vb, vstride, seen[t], n[t], c, c + KB, D, s + t * GN * sstride, sstride);
  for (int64_t t = 0; t < Tq; t++) finish<T, NV, GN>(a[t], n[t], D, out + t * ostride);
}

// every head of one KV head, GN at a time (GN from NV: the outputs must fit in registers)
template <typename T, int NV, int GMAX>
inline void kv_head(const float* qf, int64_t qstride, const T* kb, int64_t kstride, const T* vb, int64_t vstride,
                    const int64_t* const* seen, const int64_t* n, int64_t Tq, int64_t D, float* s, int64_t sstride,
                    T* const* out, int64_t G) {
  for (int64_t g = 0; g < G; g += GMAX) {
    const float* q = qf + g * NV * LANES;
    T* const* o = out + g;
#define GRAFT_GROUP(GN) kv_group<T, NV, GN>(q, qstride, kb, kstride, vb, vstride, seen, n, Tq, D, s, sstride, o, G)
    switch (std::min<int64_t>(GMAX, G - g)) {
      case 1: GRAFT_GROUP(1); break;
      case 2: GRAFT_GROUP((GMAX >= 2 ? 2 : 1)); break;
      case 3: GRAFT_GROUP((GMAX >= 3 ? 3 : 1)); break;
      default: GRAFT_GROUP(GMAX);
    }
#undef GRAFT_GROUP
  }
}

// Strided (b, h, t) rows of D elements: element d of row (b, h, t) is p[b * sb + h * sh + t * st + d].
template <typename P>
struct Rows {
  P* p;
  int64_t sb, sh, st;
  P* at(int64_t b, int64_t h, int64_t t) const { return p + b * sb + h * sh + t * st; }
};

// q (B, H, Tq, D) against the keys and values of cache batch kbat[b] (b itself when kbat is null),
// rows 0..S-1, under mask rows mask(b, t) (S bools, stride ms_s). Writes out (B, H, Tq, D).
template <typename T>
void attend(Rows<const T> q, Rows<const T> k, Rows<const T> v, const int64_t* kbat, Rows<const bool> mask, int64_t ms_s,
            Rows<T> out, int64_t B, int64_t H, int64_t Tq, int64_t D, int64_t Hkv, int64_t S, float scale) {
  const int64_t G = H / Hkv;
  TORCH_CHECK(D <= 256, "graft::attention: head_dim <= 256");
  const int64_t NV = (D + LANES - 1) / LANES;
  const int64_t NVT = NV <= 1 ? 1 : NV <= 2 ? 2 : NV <= 4 ? 4 : NV <= 8 ? 8 : 16;     // the template's
  // 1. the keys each query sees, in row order, found once
  std::vector<int64_t> seen(B * Tq * S), n(B * Tq);
  at::parallel_for(0, B * Tq, 1, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; i++) {
      const bool* mrow = mask.at(i / Tq, 0, i % Tq);
      int64_t c = 0;
      for (int64_t j = 0; j < S; j++) if (mrow[j * ms_s]) seen[i * S + c++] = j;
      n[i] = c;
    }
  });
  // 2. one task per (request, KV head): the heads that share it, all of the request's queries together
  at::parallel_for(0, B * Hkv, 1, [&](int64_t i0, int64_t i1) {
    const int64_t qstride = G * NVT * LANES;
    std::vector<float> s(Tq * G * (S + 16)), qf(Tq * qstride, 0.f);
    std::vector<T*> outs(Tq * G);
    std::vector<const int64_t*> sn(Tq);
    for (int64_t i = i0; i < i1; i++) {
      const int64_t b = i / Hkv, h = i % Hkv, kb_ = kbat ? kbat[b] : b;
      for (int64_t t = 0; t < Tq; t++) {
        sn[t] = seen.data() + (b * Tq + t) * S;
        for (int64_t g = 0; g < G; g++) {
          const T* qr = q.at(b, h * G + g, t);
          for (int64_t d = 0; d < D; d++) qf[t * qstride + g * NVT * LANES + d] = float(qr[d]) * scale;
          outs[t * G + g] = out.at(b, h * G + g, t);
        }
      }
      const T* kb = k.at(kb_, h, 0);
      const T* vb = v.at(kb_, h, 0);
      const int64_t* nn = n.data() + b * Tq;
#define GRAFT_KV(NV_, GMAX) kv_head<T, NV_, GMAX>(qf.data(), qstride, kb, k.st, vb, v.st, sn.data(), nn, Tq, D, s.data(), S + 16, outs.data(), G)
      switch (NVT) {
        case 1: GRAFT_KV(1, 4); break;
        case 2: GRAFT_KV(2, 4); break;
        case 4: GRAFT_KV(4, 4); break;
        case 8: GRAFT_KV(8, 2); break;
        default: GRAFT_KV(16, 1);
      }
#undef GRAFT_KV
    }
  });
}

template <typename T>
void attention_impl(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& mask,
                    at::Tensor& out, float scale) {
  const auto qs = q.strides(), ks = k.strides(), vs = v.strides(), ms = mask.strides();
  TORCH_CHECK(qs[3] == 1 && ks[3] == 1 && vs[3] == 1, "graft::attention: rows must be contiguous");
  const int64_t H = q.size(1), Tq = q.size(2), D = q.size(3);
  attend<T>({q.data_ptr<T>(), qs[0], qs[1], qs[2]}, {k.data_ptr<T>(), ks[0], ks[1], ks[2]},
            {v.data_ptr<T>(), vs[0], vs[1], vs[2]}, nullptr, {mask.data_ptr<bool>(), ms[0], 0, ms[2]}, ms[3],
            {out.data_ptr<T>(), H * Tq * D, Tq * D, D}, q.size(0), H, Tq, D, k.size(1), k.size(2), scale);
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

// ------------------------------------------------------------------------------------------ layer

// A whole decoder layer (Llama, Qwen3: a dense MLP) in one call, for eager exact-mode steps: the ~60
// small torch ops of model.Block cost more than its weights take to read at one token. Every stage is
// per row (norms, RoPE, SwiGLU: a fixed loop over a row's elements) or one of the kernels above, so a
// row's result is still a function of that row (and the keys its mask shows) alone. Roundings follow
// model.py's torch ops: each op's float32 result rounded to the activations' dtype T.
template <typename T>
std::unique_ptr<T[]> scratch(int64_t n) { return std::unique_ptr<T[]>(new T[n]); }

// Every stage below runs 16 elements of a row at a time, the last ones masked, with lane-wise arithmetic
// only, so each element is computed alike wherever it sits; a row's one reduction (the norm's sum of
// squares) is 16 lanes in order, then one vsum.
template <typename F>
inline void each16(int64_t n, F f) {
  int64_t i = 0;
  for (; i + LANES <= n; i += LANES) f(i, LANES);
  if (i < n) f(i, n - i);
}
template <typename T> inline vec vin(const T* p, int64_t n) { return n == LANES ? vload(p) : vload_tail(p, n); }

// y = T(T(x * rsqrt(mean(x^2) + eps)) * w) for n rows of K (model.RMSNorm: normalize in float32, round, scale)
template <typename T>
void rms_norm(const T* x, const T* w, T* y, int64_t n, int64_t K, float eps) {
  for (int64_t r = 0; r < n; r++) {
    const T* xr = x + r * K;
    T* yr = y + r * K;
    vec acc = vzero();
    each16(K, [&](int64_t k, int64_t m) { const vec v = vin(xr + k, m); acc = vfma(v, v, acc); });
    const vec inv = vset1(1.f / std::sqrt(vsum(acc) / float(K) + eps));
    each16(K, [&](int64_t k, int64_t m) { vstore(yr + k, vmul(vround<T>(vmul(vin(xr + k, m), inv)), vin(w + k, m)), m); });
  }
}

// rotate-half RoPE in place on n_heads heads of D per row: x*cos + cat(-x2, x1)*sin (model.apply_rope);
// row m = b*Tq + t reads cos/sin row (b, t)
template <typename T>
void rope(T* x, int64_t B, int64_t Tq, int64_t n_heads, int64_t D, Rows<const T> cs, Rows<const T> sn) {
  const int64_t half = D / 2;
  float xf[256], r[256];
  for (int64_t b = 0; b < B; b++)
    for (int64_t t = 0; t < Tq; t++) {
      const T* c = cs.at(b, 0, t);
      const T* s = sn.at(b, 0, t);
      for (int64_t h = 0; h < n_heads; h++) {
        T* xr = x + ((b * Tq + t) * n_heads + h) * D;
        for (int64_t d = 0; d < D; d++) xf[d] = float(xr[d]);
        for (int64_t d = 0; d < D; d++) r[d] = d < half ? -xf[d + half] : xf[d - half];
        each16(D, [&](int64_t d, int64_t m) {
          vstore(xr + d, vadd(vround<T>(vmul(vin(xf + d, m), vin(c + d, m))), vround<T>(vmul(vin(r + d, m), vin(s + d, m)))), m);
        });
      }
    }
}

// y = T(a + b), n elements (a residual)
template <typename T>
void add(const T* a, const T* b, T* y, int64_t n) {
  each16(n, [&](int64_t i, int64_t m) { vstore(y + i, vadd(vin(a + i, m), vin(b + i, m)), m); });
}

// g = T(T(silu(g)) * u), n elements; silu(g) = g / (1 + exp(-g)), as g exp(g) / (1 + exp(g)) below 0 (the
// exponential's argument is never positive: vexp_neg)
template <typename T>
void swiglu(T* g, const T* u, int64_t n) {
  each16(n, [&](int64_t i, int64_t m) {
    const vec x = vin(g + i, m), e = vexp_neg(vmin2(x, vsub(vzero(), x)));
    const vec s = vdiv(vif_nonneg(x, x, vmul(x, e)), vadd(vset1(1.f), e));
    vstore(g + i, vmul(vround<T>(s), vin(u + i, m)), m);
  });
}

template <typename T>
at::Tensor block_impl(const at::Tensor& x, const at::Tensor& n1, const at::Tensor& wq, const float* bq,
                      const at::Tensor& wk, const float* bk, const at::Tensor& wv, const float* bv, const at::Tensor& wo,
                      const c10::optional<at::Tensor>& qn, const c10::optional<at::Tensor>& kn, const at::Tensor& n2,
                      const at::Tensor& wg, const at::Tensor& wu, const at::Tensor& wd, const at::Tensor& cos,
                      const at::Tensor& sin, at::Tensor& kc, at::Tensor& vc, const int64_t* rows, const int64_t* slots,
                      const at::Tensor& mask, const bool* keep, int64_t H, float eps) {
  const int64_t B = x.size(0), Tq = x.size(1), Dm = x.size(2), M = B * Tq;
  const int64_t Hkv = kc.size(1), D = kc.size(3), S = mask.size(3), I = wg.size(0);
  const int64_t NQ = H * D, NK = Hkv * D;
  std::vector<float> wide;
  const T* xp = x.data_ptr<T>();
  auto h = scratch<T>(M * Dm), q = scratch<T>(M * NQ), k = scratch<T>(M * NK), v = scratch<T>(M * NK);
  auto att = scratch<T>(M * NQ), x1 = scratch<T>(M * Dm), g = scratch<T>(M * I), u = scratch<T>(M * I);
  // 1. attention's input: norm, q/k/v, the q/k norms (Qwen3), RoPE at each row's position
  rms_norm(xp, n1.data_ptr<T>(), h.get(), M, Dm, eps);
  lin(h.get(), M, wq, bq, q.get(), wide);
  lin(h.get(), M, wk, bk, k.get(), wide);
  lin(h.get(), M, wv, bv, v.get(), wide);
  if (qn.has_value() && qn->defined()) {
    rms_norm(q.get(), qn->data_ptr<T>(), q.get(), M * H, D, eps);
    rms_norm(k.get(), kn->data_ptr<T>(), k.get(), M * Hkv, D, eps);
  }
  const Rows<const T> cr{cos.data_ptr<T>(), cos.stride(0), 0, cos.stride(1)}, sr{sin.data_ptr<T>(), sin.stride(0), 0, sin.stride(1)};
  rope(q.get(), B, Tq, H, D, cr, sr);
  rope(k.get(), B, Tq, Hkv, D, cr, sr);
  // 2. the new keys and values into the cache at their rows (a padding row, keep false, writes zeros)
  const auto ks = kc.strides(), vs = vc.strides();
  T* kp = kc.data_ptr<T>();
  T* vp = vc.data_ptr<T>();
  for (int64_t m = 0; m < M; m++) {
    const int64_t b = m / Tq, sb = slots ? slots[b] : b, r = rows[m];
    const bool real = keep ? keep[m] : true;
    for (int64_t hh = 0; hh < Hkv; hh++) {
      T* kd = kp + sb * ks[0] + hh * ks[1] + r * ks[2];
      T* vd = vp + sb * vs[0] + hh * vs[1] + r * vs[2];
      const T* kr = k.get() + m * NK + hh * D;
      const T* vr = v.get() + m * NK + hh * D;
      if (real) { std::memcpy(kd, kr, D * sizeof(T)); std::memcpy(vd, vr, D * sizeof(T)); }
      else { std::memset((void*)kd, 0, D * sizeof(T)); std::memset((void*)vd, 0, D * sizeof(T)); }
    }
  }
  // 3. attention over cache rows 0..S-1 (the kernel above), then o_proj and the residual
  const auto ms = mask.strides();
  attend<T>({q.get(), Tq * NQ, D, NQ}, {kp, ks[0], ks[1], ks[2]}, {vp, vs[0], vs[1], vs[2]}, slots,
            {mask.data_ptr<bool>(), ms[0], 0, ms[2]}, ms[3], {att.get(), Tq * NQ, D, NQ}, B, H, Tq, D, Hkv, S,
            1.f / std::sqrt(float(D)));
  lin(att.get(), M, wo, nullptr, h.get(), wide);                     // h: o_proj's output
  add(xp, h.get(), x1.get(), M * Dm);
  // 4. the MLP: norm, SwiGLU, down, the residual
  rms_norm(x1.get(), n2.data_ptr<T>(), h.get(), M, Dm, eps);
  lin(h.get(), M, wg, nullptr, g.get(), wide);
  lin(h.get(), M, wu, nullptr, u.get(), wide);
  swiglu(g.get(), u.get(), M * I);
  lin(g.get(), M, wd, nullptr, h.get(), wide);
  auto out = at::empty_like(x, at::MemoryFormat::Contiguous);
  T* op = out.data_ptr<T>();
  add(x1.get(), h.get(), op, M * Dm);
  return out;
}

at::Tensor block(const at::Tensor& x, const at::Tensor& n1, const at::Tensor& wq, const c10::optional<at::Tensor>& bq,
                 const at::Tensor& wk, const c10::optional<at::Tensor>& bk, const at::Tensor& wv,
                 const c10::optional<at::Tensor>& bv, const at::Tensor& wo, const c10::optional<at::Tensor>& qn,
                 const c10::optional<at::Tensor>& kn, const at::Tensor& n2, const at::Tensor& wg, const at::Tensor& wu,
                 const at::Tensor& wd, const at::Tensor& cos, const at::Tensor& sin, at::Tensor& kc, at::Tensor& vc,
                 const at::Tensor& rows, const c10::optional<at::Tensor>& slots, const at::Tensor& mask,
                 const c10::optional<at::Tensor>& keep, int64_t n_heads, double eps) {
  // shapes, dtypes and every index are checked before anything is read or written
  TORCH_CHECK(x.dim() == 3 && x.is_contiguous(), "graft::block: x (B, T, dim), contiguous");
  const int64_t B = x.size(0), Tq = x.size(1), Dm = x.size(2);
  TORCH_CHECK(kc.dim() == 4 && kc.sizes() == vc.sizes() && kc.stride(3) == 1 && vc.stride(3) == 1,
              "graft::block: caches (B, H_kv, rows, D)");
  const int64_t Hkv = kc.size(1), R = kc.size(2), D = kc.size(3), I = wg.size(0);
  TORCH_CHECK(D <= 256 && D % 2 == 0 && n_heads > 0 && n_heads % Hkv == 0, "graft::block: heads");
  for (const at::Tensor* t : std::initializer_list<const at::Tensor*>{&n1, &wq, &wk, &wv, &wo, &n2, &wg, &wu, &wd, &cos, &sin, &kc, &vc})
    TORCH_CHECK(t->scalar_type() == x.scalar_type() && t->device().is_cpu(), "graft::block: one dtype, CPU");
  for (const at::Tensor* t : std::initializer_list<const at::Tensor*>{&n1, &wq, &wk, &wv, &wo, &n2, &wg, &wu, &wd})
    TORCH_CHECK(t->is_contiguous(), "graft::block: contiguous weights");
  TORCH_CHECK(n1.numel() == Dm && n2.numel() == Dm && wq.sizes() == at::IntArrayRef({n_heads * D, Dm}) &&
              wk.sizes() == at::IntArrayRef({Hkv * D, Dm}) && wv.sizes() == wk.sizes() &&
              wo.sizes() == at::IntArrayRef({Dm, n_heads * D}) && wu.sizes() == wg.sizes() && wg.size(1) == Dm &&
              wd.sizes() == at::IntArrayRef({Dm, I}), "graft::block: weight shapes");
  const bool qk = qn.has_value() && qn->defined();
  TORCH_CHECK(qk == (kn.has_value() && kn->defined()) && (!qk || (qn->numel() == D && kn->numel() == D &&
              qn->scalar_type() == x.scalar_type() && kn->scalar_type() == x.scalar_type() && qn->is_contiguous() && kn->is_contiguous())),
              "graft::block: q and k norms (D,) both or neither");
  auto cs = cos.expand({B, Tq, D}), sn = sin.expand({B, Tq, D});
  TORCH_CHECK(cs.stride(2) == 1 && sn.stride(2) == 1, "graft::block: cos, sin (B|1, T, D), rows contiguous");
  TORCH_CHECK(mask.dim() == 4 && mask.scalar_type() == at::kBool && mask.size(2) == Tq && mask.size(3) <= R,
              "graft::block: mask (B|1, 1, T, n_keys <= cache rows) bool");
  auto m = mask.expand({B, 1, Tq, mask.size(3)});
  auto rw = rows.expand({B, Tq}).to(at::kLong).contiguous();
  const int64_t* rp = rw.data_ptr<int64_t>();
  for (int64_t i = 0; i < B * Tq; i++) TORCH_CHECK(rp[i] >= 0 && rp[i] < R, "graft::block: a row outside the cache");
  at::Tensor sl, kp;
  const int64_t* sp = nullptr;
  if (slots.has_value() && slots->defined()) {
    sl = slots->to(at::kLong).contiguous();
    TORCH_CHECK(sl.numel() == B, "graft::block: slots (B,)");
    sp = sl.data_ptr<int64_t>();
    for (int64_t b = 0; b < B; b++) TORCH_CHECK(sp[b] >= 0 && sp[b] < kc.size(0), "graft::block: a slot outside the cache");
  } else {
    TORCH_CHECK(kc.size(0) == B, "graft::block: without slots the cache holds B requests");
  }
  const bool* keepp = nullptr;
  if (keep.has_value() && keep->defined()) {
    kp = keep->expand({B, Tq}).to(at::kBool).contiguous();
    keepp = kp.data_ptr<bool>();
  }
  at::Tensor fb[3];
  const float *bq_ = bias_ptr(bq, fb[0]), *bk_ = bias_ptr(bk, fb[1]), *bv_ = bias_ptr(bv, fb[2]);
  TORCH_CHECK((!bq_ || fb[0].numel() == n_heads * D) && (!bk_ || fb[1].numel() == Hkv * D) && (!bv_ || fb[2].numel() == Hkv * D),
              "graft::block: bias shapes");
  switch (x.scalar_type()) {
#define GRAFT_BLOCK(T) block_impl<T>(x, n1, wq, bq_, wk, bk_, wv, bv_, wo, qn, kn, n2, wg, wu, wd, cs, sn, kc, vc, rp, sp, m, keepp, n_heads, (float)eps)
    case at::kFloat: return GRAFT_BLOCK(float);
    case at::kBFloat16: return GRAFT_BLOCK(at::BFloat16);
    case at::kHalf: return GRAFT_BLOCK(at::Half);
#undef GRAFT_BLOCK
    default: TORCH_CHECK(false, "graft::block: float32, bfloat16 or float16");
  }
}

}  // namespace

TORCH_LIBRARY(graft, lib) {
  lib.def("linear(Tensor x, Tensor w, Tensor? bias) -> Tensor");
  lib.def("attention(Tensor q, Tensor k, Tensor v, Tensor mask, float scale) -> Tensor");
  lib.def("block(Tensor x, Tensor n1, Tensor wq, Tensor? bq, Tensor wk, Tensor? bk, Tensor wv, Tensor? bv, Tensor wo, "
          "Tensor? qn, Tensor? kn, Tensor n2, Tensor wg, Tensor wu, Tensor wd, Tensor cos, Tensor sin, Tensor(a!) kc, "
          "Tensor(b!) vc, Tensor rows, Tensor? slots, Tensor mask, Tensor? keep, int n_heads, float eps) -> Tensor");
}

TORCH_LIBRARY_IMPL(graft, CPU, lib) {
  lib.impl("linear", &linear);
  lib.impl("attention", &attention);
  lib.impl("block", &block);
}
