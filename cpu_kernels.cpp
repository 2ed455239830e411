// graft's CPU kernels: a linear, an attention and a whole decoder layer whose result for a row is a
// function of that row's inputs alone, bit for bit, whatever the rows beside it (cpu_kernels.py says why and
// how they are built).
//
// Each is written so that every output element is reduced by one fixed sequence of float32 operations:
//   linear     y[m, n] = sum_k x[m, k] * W[n, k] (+ b[n]): 16-lane FMAs over k in order (bfloat16: the
//              CPU's bfloat16 dot product where it has one), a masked tail, one fixed horizontal sum.
//              W is read as four sequential streams (its rows in quarters), four rows of x sharing each
//              load, but that changes which outputs are computed together, never how. On AMX (bfloat16,
//              even K): one tile element per output, a tile multiply's 32 weights summed as the tiles
//              sum them (one row: the same arithmetic on FMAs), chunks in order.
//   attention  a query reads the keys its mask lets it see, in row order (committed rows, then its tree
//              ancestors: position order), scores them 16 at a time by one reduction tree per key (on
//              AMX: one tile element per score), and sums exp(score - max) * v one key after another (the
//              weights' total in 16 lanes, in the same order). Plain decoding at the same position sees
//              the same keys in the same order.
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
#if defined(__linux__)
#include <sys/syscall.h>
#include <unistd.h>
#endif
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <memory>
#include <mutex>
#include <string>
#include <tuple>
#include <type_traits>
#include <unordered_map>
#include <vector>

namespace {

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define GRAFT_AVX512 1
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
// int8 (a quantized weight, quant.py) -> f32: sign-extended, then converted (exact: |q| <= 127)
template <> inline vec vload<int8_t>(const int8_t* p) { return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)p))); }
template <> inline vec vload_tail<int8_t>(const int8_t* p, int64_t n) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_maskz_loadu_epi8(tail_mask(n), p)));
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
inline uint32_t vmask_ge(vec a, vec c) { return _mm512_cmp_ps_mask(a, c, _CMP_GE_OQ); }     // lanes a >= c (a NaN: no)
inline uint32_t vmask_nan(vec a) { return _mm512_cmp_ps_mask(a, a, _CMP_UNORD_Q); }
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
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
// AVX2 (Zen 2/3, Haswell to Skylake client): the same 16-lane vector as two 8-lane halves, every
// operation lane-wise on each half; vsum is the same tree as AVX-512's (lanes l + 8, then + 4, + 2, + 1).
#define GRAFT_AVX2 1
struct vec { __m256 lo, hi; };
constexpr int64_t LANES = 16;
inline __m256i lanes_below(int64_t n) {                       // the first n of 8 lanes set
  return _mm256_cmpgt_epi32(_mm256_set1_epi32((int)n), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}
inline vec vzero() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
inline vec vfma(vec a, vec b, vec c) { return {_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi)}; }
inline vec vset1(float f) { return {_mm256_set1_ps(f), _mm256_set1_ps(f)}; }
inline float hsum8(__m256 s) {                               // lanes l + 4, then + 2, + 1
  const __m128 t = _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
  const __m128 u = _mm_add_ps(t, _mm_shuffle_ps(t, t, 0x4E));
  return _mm_cvtss_f32(_mm_add_ss(u, _mm_shuffle_ps(u, u, 0xB1)));
}
inline float vsum(vec a) { return hsum8(_mm256_add_ps(a.lo, a.hi)); }
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const at::BFloat16* p) {                 // bf16 -> f32: the 16 bits on top
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)p)), 16));
}
inline __m256 load8(const at::Half* p) { return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)p)); }
inline __m256 load8(const int8_t* p) { return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)p))); }
template <typename T> inline __m256 load8_tail(const T* p, int64_t n) {         // n < 8; the rest 0
  T buf[8] = {};
  std::memcpy((void*)buf, (const void*)p, std::max<int64_t>(n, 0) * sizeof(T));
  return load8(buf);
}
template <> inline __m256 load8_tail<float>(const float* p, int64_t n) { return _mm256_maskload_ps(p, lanes_below(n)); }
template <typename T> inline vec vload(const T* p) { return {load8(p), load8(p + 8)}; }
template <typename T> inline vec vload_tail(const T* p, int64_t n) {
  return n >= 8 ? vec{load8(p), load8_tail(p + 8, n - 8)} : vec{load8_tail(p, n), _mm256_setzero_ps()};
}
inline void store(float* p, vec a) { _mm256_storeu_ps(p, a.lo); _mm256_storeu_ps(p + 8, a.hi); }
inline vec vadd(vec a, vec b) { return {_mm256_add_ps(a.lo, b.lo), _mm256_add_ps(a.hi, b.hi)}; }
inline vec vsub(vec a, vec b) { return {_mm256_sub_ps(a.lo, b.lo), _mm256_sub_ps(a.hi, b.hi)}; }
inline vec vmax2(vec a, vec b) { return {_mm256_max_ps(a.lo, b.lo), _mm256_max_ps(a.hi, b.hi)}; }
inline vec vmin2(vec a, vec b) { return {_mm256_min_ps(a.lo, b.lo), _mm256_min_ps(a.hi, b.hi)}; }
inline vec vmul(vec a, vec b) { return {_mm256_mul_ps(a.lo, b.lo), _mm256_mul_ps(a.hi, b.hi)}; }
inline vec vdiv(vec a, vec b) { return {_mm256_div_ps(a.lo, b.lo), _mm256_div_ps(a.hi, b.hi)}; }
inline vec vfirst(vec a, int64_t n) {                        // lanes >= n: 0
  return {_mm256_and_ps(a.lo, _mm256_castsi256_ps(lanes_below(n))), _mm256_and_ps(a.hi, _mm256_castsi256_ps(lanes_below(n - 8)))};
}
inline vec vif_nonneg(vec c, vec a, vec b) {
  const __m256 z = _mm256_setzero_ps();
  return {_mm256_blendv_ps(b.lo, a.lo, _mm256_cmp_ps(c.lo, z, _CMP_GE_OQ)), _mm256_blendv_ps(b.hi, a.hi, _mm256_cmp_ps(c.hi, z, _CMP_GE_OQ))};
}
inline uint32_t vmask_ge(vec a, vec c) {
  return (uint32_t)_mm256_movemask_ps(_mm256_cmp_ps(a.lo, c.lo, _CMP_GE_OQ)) |
         (uint32_t)_mm256_movemask_ps(_mm256_cmp_ps(a.hi, c.hi, _CMP_GE_OQ)) << 8;
}
inline uint32_t vmask_nan(vec a) {
  return (uint32_t)_mm256_movemask_ps(_mm256_cmp_ps(a.lo, a.lo, _CMP_UNORD_Q)) |
         (uint32_t)_mm256_movemask_ps(_mm256_cmp_ps(a.hi, a.hi, _CMP_UNORD_Q)) << 8;
}
// float32 -> bfloat16 rounded to nearest even (c10's rounding; NaN: c10's quiet NaN), kept in the top 16 bits
inline __m256i bf16_round8(__m256 a) {
  const __m256i u = _mm256_castps_si256(a);
  const __m256i r = _mm256_add_epi32(u, _mm256_add_epi32(_mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1)), _mm256_set1_epi32(0x7FFF)));
  const __m256i top = _mm256_and_si256(r, _mm256_set1_epi32((int)0xFFFF0000u));
  return _mm256_blendv_epi8(top, _mm256_set1_epi32(0x7FC00000), _mm256_castps_si256(_mm256_cmp_ps(a, a, _CMP_UNORD_Q)));
}
template <typename T> inline void vstore(T* p, vec a, int64_t n);
template <> inline void vstore<float>(float* p, vec a, int64_t n) {
  if (n >= 16) { store(p, a); return; }
  _mm256_maskstore_ps(p, lanes_below(n), a.lo);
  if (n > 8) _mm256_maskstore_ps(p + 8, lanes_below(n - 8), a.hi);
}
template <> inline void vstore<at::BFloat16>(at::BFloat16* p, vec a, int64_t n) {
  const __m256i lo = _mm256_srli_epi32(bf16_round8(a.lo), 16), hi = _mm256_srli_epi32(bf16_round8(a.hi), 16);
  const __m256i b = _mm256_permute4x64_epi64(_mm256_packus_epi32(lo, hi), 0xD8);      // 16 x u16, in order
  if (n >= 16) { _mm256_storeu_si256((__m256i*)p, b); return; }
  uint16_t buf[16];
  _mm256_storeu_si256((__m256i*)buf, b);
  std::memcpy((void*)p, buf, n * sizeof(uint16_t));
}
template <> inline void vstore<at::Half>(at::Half* p, vec a, int64_t n) {
  const __m128i lo = _mm256_cvtps_ph(a.lo, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m128i hi = _mm256_cvtps_ph(a.hi, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  if (n >= 16) { _mm_storeu_si128((__m128i*)p, lo); _mm_storeu_si128((__m128i*)(p + 8), hi); return; }
  uint16_t buf[16];
  _mm_storeu_si128((__m128i*)buf, lo);
  _mm_storeu_si128((__m128i*)(buf + 8), hi);
  std::memcpy((void*)p, buf, n * sizeof(uint16_t));
}
template <typename T> inline vec vround(vec a);
template <> inline vec vround<float>(vec a) { return a; }
template <> inline vec vround<at::BFloat16>(vec a) { return {_mm256_castsi256_ps(bf16_round8(a.lo)), _mm256_castsi256_ps(bf16_round8(a.hi))}; }
template <> inline vec vround<at::Half>(vec a) {
  return {_mm256_cvtph_ps(_mm256_cvtps_ph(a.lo, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)),
          _mm256_cvtph_ps(_mm256_cvtps_ph(a.hi, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC))};
}
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
inline uint32_t vmask_ge(vec a, vec c) { uint32_t m = 0; for (int i = 0; i < 16; i++) m |= (uint32_t)(a.v[i] >= c.v[i]) << i; return m; }
inline uint32_t vmask_nan(vec a) { uint32_t m = 0; for (int i = 0; i < 16; i++) m |= (uint32_t)std::isnan(a.v[i]) << i; return m; }
template <typename T> inline void vstore(T* p, vec a, int64_t n) { for (int64_t i = 0; i < n; i++) p[i] = T(a.v[i]); }
template <typename T> inline vec vround(vec a) { for (int i = 0; i < 16; i++) a.v[i] = float(T(a.v[i])); return a; }
#endif

// ------------------------------------------------------------------------------------------ linear
//
// y[m, n] = sum_k x[m, k] W[n, k]: each output is one accumulator of Op::A lanes, fed over k in steps of
// Op::STEP in order (a masked tail last), then summed across its lanes by one fixed tree (Op::sum). That
// sequence is the same whatever else is computed beside it, so a row's outputs do not depend on how many
// rows there are: a tile (mr rows of x against nr rows of W, mr x nr accumulators held in registers)
// only decides which outputs are computed together, and which loads they share.
//   one row (decoding): 1 x 4 tiles over four sequential streams of W (its rows in quarters, each walked
//     in order; the next row of each is prefetched into L1): W read once, at the memory's pace.
//   several rows (a tree, a prefill chunk): the rows in tiles of at most MR_MAX, as even as possible
//     (9 = 5 + 4, 17 = 6 + 6 + 5), against NR_MULTI streams: each W vector loaded feeds mr products, each
//     x vector nr, and the rows PF_AHEAD groups on are prefetched into L2 while these compute, so that
//     W streams in from memory while the core multiplies near its peak (kernel_peak measures it).

// How one output's sum is formed, by ISA. Widen: x float32 against W of type T widened as it loads, one
// FMA per lane (x of another type is widened once per call, in lin).
#if defined(GRAFT_AVX512)
template <typename T>
struct Widen {
  using X = float;
  using W = T;                                          // the weight's element (float, bfloat16, float16, int8)
  using V = __m512;
  using A = __m512;
  static constexpr int64_t STEP = 16, MACS = 16;        // weights a step; multiply-adds an instruction
  static A zero() { return _mm512_setzero_ps(); }
  static V x(const float* p) { return _mm512_loadu_ps(p); }
  static V x_tail(const float* p, int64_t n) { return _mm512_maskz_loadu_ps(tail_mask(n), p); }
  static V w(const T* p) { return vload(p); }
  static V w_tail(const T* p, int64_t n) { return vload_tail(p, n); }
  static A dot(V a, V b, A acc) { return _mm512_fmadd_ps(a, b, acc); }
  static float sum(A a) { return _mm512_reduce_add_ps(a); }          // lanes l + 8, + 4, + 2, + 1
};
constexpr int64_t MR_MAX = 6, NR_MULTI = 4;     // 24 accumulators, 4 W vectors and an x: 29 of 32 registers
#elif defined(GRAFT_AVX2)
template <typename T>
struct Widen {                                   // 8 lanes: AVX2 has 16 registers, not 32
  using X = float;
  using W = T;
  using V = __m256;
  using A = __m256;
  static constexpr int64_t STEP = 8, MACS = 8;
  static A zero() { return _mm256_setzero_ps(); }
  // Each load held in a register (the empty asm): left to itself GCC folds a load into every FMA that
  // reads it, 15-16 loads a step for 12 FMAs, where Zen 3 does two 256-bit loads a cycle (~60% of peak)
  static V x(const float* p) { return held(_mm256_loadu_ps(p)); }
  static V x_tail(const float* p, int64_t n) { return held(load8_tail(p, n)); }
  static V w(const T* p) { return held(load8(p)); }
  static V w_tail(const T* p, int64_t n) { return held(load8_tail(p, n)); }
  static V held(V v) { asm("" : "+x"(v)); return v; }
  static A dot(V a, V b, A acc) { return _mm256_fmadd_ps(a, b, acc); }
  static float sum(A a) { return hsum8(a); }                          // lanes l + 4, + 2, + 1
};
constexpr int64_t MR_MAX = 4, NR_MULTI = 3;     // 12 accumulators, 3 W vectors and an x: 16 of 16 registers
// bfloat16 W on AVX2 (lin_as): 16 weights a step from one 256-bit load, in two parts of 8, each widened by
// one unpack with zero (a bfloat16 is the top half of its float32): part 0 takes weights 0-3 and 8-11 (the
// low words of each 128-bit lane), part 1 4-7 and 12-15; x is laid out to match once a call (permute16).
// One shuffle a vector of 8 instead of Widen's zero-extend and shift: the multi-row tiles spend their time
// on the FP pipes the shuffles share (measured on a Zen 3, SmolLM2's shapes from memory, one thread: a pass
// of 3 rows 17% and of 4 rows 13% faster, one row the same; in cache every row count 7-30% faster).
struct WidenBF16 {
  using X = float;
  using W = at::BFloat16;
  using V = __m256;
  using A = __m256;
  static constexpr int64_t STEP = 16, MACS = 8;
  static constexpr int PARTS = 2;
  static A zero() { return _mm256_setzero_ps(); }
  static V held(V v) { asm("" : "+x"(v)); return v; }
  static V x(const float* p, int s) {
    __m256 r;
    asm volatile("vmovups %1, %0" : "=x"(r) : "m"(*(const __m256*)(p + 8 * s)));
    return r;
  }
  static V x_tail(const float* p, int64_t n, int s) { return held(load8_tail(p + 8 * s, std::min<int64_t>(n - 8 * s, 8))); }
  // (in asm: left to itself GCC loads the 16 weights once for both parts, holding three more registers than
  // the tile has; the zeroing idiom costs no execution)
  static V w(const W* p, int s) {
    __m256 r;
    if (s) asm volatile("vpxor %0, %0, %0\n\tvpunpckhwd %1, %0, %0" : "=x"(r) : "m"(*(const __m256i*)p));
    else asm volatile("vpxor %0, %0, %0\n\tvpunpcklwd %1, %0, %0" : "=x"(r) : "m"(*(const __m256i*)p));
    return r;
  }
  static V w_tail(const W* p, int64_t n, int s) {                  // the tail in order, 8 a part
    const int64_t m = std::min<int64_t>(n - 8 * s, 8);
    return held(m == 8 ? load8(p + 8 * s) : load8_tail(p + 8 * s, m));
  }
  static A dot(V a, V b, A acc) { return _mm256_fmadd_ps(a, b, acc); }
  static float sum(A a) { return hsum8(a); }
};
// A 4 x 3 tile's whole steps in asm: its 12 accumulators (ymm4-15), 3 weights (ymm0-2) and an x (ymm3) take
// all 16 registers, which GCC's allocator did not keep (it spilled accumulators every step: 16-40% slower
// than the zero-extending tile). The same products into the same accumulators in the same order as the
// C++ step (part 0, then part 1, step after step). Runs n[0] steps, then n[1] pairs of steps and n[2] (0 or
// 1) single steps that each prefetch a line of the three rows at pf into L2, then n[3] steps.
#define G43_W(U, O) "vpxor %%ymm0, %%ymm0, %%ymm0\n\t" U " " O "(%[w]), %%ymm0, %%ymm0\n\t" \
  "vpxor %%ymm1, %%ymm1, %%ymm1\n\t" U " " O "(%[w],%[ws],1), %%ymm1, %%ymm1\n\t" \
  "vpxor %%ymm2, %%ymm2, %%ymm2\n\t" U " " O "(%[w],%[ws],2), %%ymm2, %%ymm2\n\t"
#define G43_ROW(XA, A0, A1, A2) "vmovups " XA ", %%ymm3\n\t" "vfmadd231ps %%ymm0, %%ymm3, %%ymm" A0 "\n\t" \
  "vfmadd231ps %%ymm1, %%ymm3, %%ymm" A1 "\n\t" "vfmadd231ps %%ymm2, %%ymm3, %%ymm" A2 "\n\t"
#define G43_HALF(U, WO, XO) G43_W(U, WO) G43_ROW(XO "(%[x])", "4", "5", "6") \
  G43_ROW(XO "(%[x],%[xs],1)", "7", "8", "9") G43_ROW(XO "(%[x],%[xs],2)", "10", "11", "12") \
  G43_ROW(XO "(%[x],%[x3],1)", "13", "14", "15")
#define G43_STEP(WO, XO0, XO1) G43_HALF("vpunpcklwd", WO, XO0) G43_HALF("vpunpckhwd", WO, XO1)
#define G43_FETCH "prefetcht1 (%[pf])\n\t" "prefetcht1 (%[pf],%[ws],1)\n\t" "prefetcht1 (%[pf],%[ws],2)\n\t"
#define G43_LOOP(L, I, BODY, W, X, PF) "mov " #I "(%[n]), %[c]\n\t" "test %[c], %[c]\n\t" "jz " #L "f\n\t" \
  #L "0:\n\t" BODY "add $" #W ", %[w]\n\t" "add $" #X ", %[x]\n\t" PF "dec %[c]\n\t" "jnz " #L "0b\n\t" #L ":\n\t"
inline void steps43(__m256 (&a)[4][3], const float* x, int64_t K, const at::BFloat16* w, int64_t ws,
                    const at::BFloat16* pf, const int64_t (&n)[4]) {
  const int64_t xs = K * 4, x3 = 3 * K * 4, wsb = ws * 2;
  int64_t c;
  asm volatile(
      "vmovups 0(%[a]), %%ymm4\n\t" "vmovups 32(%[a]), %%ymm5\n\t" "vmovups 64(%[a]), %%ymm6\n\t"
      "vmovups 96(%[a]), %%ymm7\n\t" "vmovups 128(%[a]), %%ymm8\n\t" "vmovups 160(%[a]), %%ymm9\n\t"
      "vmovups 192(%[a]), %%ymm10\n\t" "vmovups 224(%[a]), %%ymm11\n\t" "vmovups 256(%[a]), %%ymm12\n\t"
      "vmovups 288(%[a]), %%ymm13\n\t" "vmovups 320(%[a]), %%ymm14\n\t" "vmovups 352(%[a]), %%ymm15\n\t"
      G43_LOOP(11, 0, G43_STEP("0", "0", "32"), 32, 64, "")
      G43_LOOP(12, 8, G43_STEP("0", "0", "32") G43_STEP("32", "64", "96") G43_FETCH, 64, 128, "add $64, %[pf]\n\t")
      G43_LOOP(13, 16, G43_STEP("0", "0", "32") G43_FETCH, 32, 64, "add $32, %[pf]\n\t")
      G43_LOOP(14, 24, G43_STEP("0", "0", "32"), 32, 64, "")
      "vmovups %%ymm4, 0(%[a])\n\t" "vmovups %%ymm5, 32(%[a])\n\t" "vmovups %%ymm6, 64(%[a])\n\t"
      "vmovups %%ymm7, 96(%[a])\n\t" "vmovups %%ymm8, 128(%[a])\n\t" "vmovups %%ymm9, 160(%[a])\n\t"
      "vmovups %%ymm10, 192(%[a])\n\t" "vmovups %%ymm11, 224(%[a])\n\t" "vmovups %%ymm12, 256(%[a])\n\t"
      "vmovups %%ymm13, 288(%[a])\n\t" "vmovups %%ymm14, 320(%[a])\n\t" "vmovups %%ymm15, 352(%[a])\n\t"
      : [x] "+r"(x), [w] "+r"(w), [pf] "+r"(pf), [c] "=&r"(c)
      : [a] "r"(&a[0][0]), [n] "r"(&n[0]), [xs] "r"(xs), [x3] "r"(x3), [ws] "r"(wsb)
      : "xmm0", "xmm1", "xmm2", "xmm3", "xmm4", "xmm5", "xmm6", "xmm7", "xmm8", "xmm9", "xmm10", "xmm11", "xmm12",
        "xmm13", "xmm14", "xmm15", "cc", "memory");
}
#undef G43_W
#undef G43_ROW
#undef G43_HALF
#undef G43_STEP
#undef G43_FETCH
#undef G43_LOOP
// x laid out as WidenBF16 reads it: each whole 16 as 0-3, 8-11, 4-7, 12-15; the tail in order.
template <typename T>
void permute16(const T* x, float* out, int64_t M, int64_t K) {
  static constexpr int order[16] = {0, 1, 2, 3, 8, 9, 10, 11, 4, 5, 6, 7, 12, 13, 14, 15};
  const int64_t KS = K - K % 16;
  for (int64_t m = 0; m < M; m++) {
    const T* r = x + m * K;
    float* o = out + m * K;
    for (int64_t c = 0; c < KS; c += 16)
      for (int i = 0; i < 16; i++) o[c + i] = float(r[c + order[i]]);
    for (int64_t k = KS; k < K; k++) o[k] = float(r[k]);
  }
}
#else
template <typename T>
struct Widen {                                   // portable: the 16-float vector, one row at a time
  using X = float;
  using W = T;
  using V = vec;
  using A = vec;
  static constexpr int64_t STEP = LANES, MACS = LANES;
  static A zero() { return vzero(); }
  static V x(const float* p) { return vload(p); }
  static V x_tail(const float* p, int64_t n) { return vload_tail(p, n); }
  static V w(const T* p) { return vload(p); }
  static V w_tail(const T* p, int64_t n) { return vload_tail(p, n); }
  static A dot(V a, V b, A acc) { return vfma(a, b, acc); }
  static float sum(A a) { return vsum(a); }
};
constexpr int64_t MR_MAX = 1, NR_MULTI = 4;
#endif
constexpr int64_t PF_AHEAD = 2;

#if defined(__AVX512BF16__)
// bfloat16 x and W with the CPU's bfloat16 dot product (VDPBF16PS): each of 16 lanes adds two exact
// products per instruction, 32 weights a step, no widening.
struct BF16Dot {
  using X = at::BFloat16;
  using W = X;
  using V = __m512i;
  using A = __m512;
  static constexpr int64_t STEP = 32, MACS = 32;
  static A zero() { return _mm512_setzero_ps(); }
  static V x(const X* p) { return _mm512_loadu_si512((const void*)p); }
  static V x_tail(const X* p, int64_t n) { return _mm512_maskz_loadu_epi16((__mmask32)((1ull << n) - 1u), p); }
  static V w(const X* p) { return x(p); }
  static V w_tail(const X* p, int64_t n) { return x_tail(p, n); }
  static A dot(V a, V b, A acc) { return _mm512_dpbf16_ps(acc, (__m512bh)a, (__m512bh)b); }
  static float sum(A a) { return _mm512_reduce_add_ps(a); }
};
// bfloat16 x against int8 W (quant.py), W read at one byte a weight. A weight q is split into two
// bfloat16s made from its bits by one logic op each, a = 128 + (q & 127) and b = -128 or -256 (q's sign
// bit), a + b = q, so 32 weights cost one widening and two VDPBF16PS (x . a, then x . b, into the same
// lane: its running sum stays the sum over the weights so far). Widening q to float32 and packing
// bfloat16 pairs instead, one VDPBF16PS a 32, ran a one-row pass about 20% slower (a pass of many rows
// about 20% faster); plain decoding is what int8 is for. Every product is exact; the sums carry the
// extra terms' rounding, far below the bfloat16 output's.
struct I8BF16Dot : BF16Dot {
  using W = int8_t;
  struct V { __m512i a, b; };
  static V split(__m512i q) {                                     // q: 32 int8 sign-extended to words
    return {_mm512_ternarylogic_epi32(q, _mm512_set1_epi32(0x007F007F), _mm512_set1_epi32(0x43004300), 0xEA),
            _mm512_ternarylogic_epi32(q, _mm512_set1_epi32(0x00800080), _mm512_set1_epi32((int)0xC300C300), 0xEA)};
  }
  static V w(const W* p) { return split(_mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i*)p))); }
  static V w_tail(const W* p, int64_t n) {                        // past n: q = 0 against x's zeros
    return split(_mm512_cvtepi8_epi16(_mm256_maskz_loadu_epi8((__mmask32)((1ull << n) - 1u), p)));
  }
  static A dot(__m512i x, V w, A acc) {
    return _mm512_dpbf16_ps(_mm512_dpbf16_ps(acc, (__m512bh)x, (__m512bh)w.a), (__m512bh)x, (__m512bh)w.b);
  }
};
#endif

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__) && defined(GRAFT_AVX512) && defined(__linux__)
#define GRAFT_AMX 1
// bfloat16 on AMX (Sapphire Rapids and later): one tile multiply (TDPBF16PS) takes up to 16 rows of x
// against 16 outputs of W, 32 weights deep, so a tree pass of up to 16 nodes costs about what a one-row
// pass costs: the weight's reads. Each output y[m, n] is one element of a C tile. What a tile multiply
// adds to it, measured bit for bit on the CPU (the SDM's pseudocode says the same): the products of the
// chunk's even weights summed by a float32 FMA chain from zero, in order, likewise the odd ones, then
// C + (even + odd), denormals flushed. The rows of x beside a row are other elements of the same tiles,
// never in its sum. One row (M = 1: plain decoding) runs that same arithmetic on AVX-512 FMAs (amx_row,
// MXCSR's DAZ and FTZ set), since vector loads with a software prefetch stream the packed weight faster
// than tile loads (plain decoding ~2% below VDPBF16PS's instead of ~5%); a one-token step and a tree pass
// still run the same sums, row for row. The path is chosen per process (the CPU, the OS's grant,
// GRAFT_AMX=0 to refuse it) and per shape (K even). W is read from a packed copy (amx_packed) whose 1 KB
// B tiles are contiguous, which streams at the memory's pace; the copy costs W's size again in memory.
struct alignas(64) TileConfig { uint8_t palette, start; uint8_t reserved[14]; uint16_t colsb[16]; uint8_t rows[16]; };

bool amx_on() {                         // the OS must grant the tile state (Linux >= 5.16) before first use
  static const bool on = [] {
    const char* e = std::getenv("GRAFT_AMX");
    if (e && std::string(e) == "0") return false;
    return syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XFEATURE_XTILEDATA */) == 0;
  }();
  return on;
}

// W (N, K) as B tiles: block nb (16 outputs, zeros past N), chunk c (32 weights; the last kt) at
// ((nb * KT) + c) * 512; in it, pair row p (the chunk's weights 2 p, 2 p + 1) at + p * 32, output i's pair
// at + 2 i. A copy per weight (by its data pointer), made on first use, made again once the weight is
// written (its version counter) and dropped at the next copy made once it is freed (its storage held
// weakly: a new weight at the same address is another storage).
struct Packed {
  c10::weak_intrusive_ptr<c10::StorageImpl> storage;
  int64_t N, K;
  uint32_t version;
  at::Tensor tiles;
};
std::mutex packed_lock;
std::unordered_map<const void*, Packed> packed_cache;

uint32_t version_of(const at::Tensor& w) {       // inference tensors have none: 0
  return w.is_inference() ? 0u : w.unsafeGetTensorImpl()->version_counter().current_version();
}

const at::BFloat16* amx_packed(const at::Tensor& w) {
  const int64_t N = w.size(0), K = w.size(1), KT = (K + 31) / 32, NB = (N + 15) / 16;
  const void* key = w.data_ptr();
  const uint32_t v = version_of(w);
  std::lock_guard<std::mutex> hold(packed_lock);
  auto it = packed_cache.find(key);
  if (it != packed_cache.end()) {
    const Packed& p = it->second;
    auto live = p.storage.lock();
    if (live && live.get() == w.storage().unsafeGetStorageImpl() && p.N == N && p.K == K && p.version == v)
      return p.tiles.data_ptr<at::BFloat16>();
  }
  for (auto i = packed_cache.begin(); i != packed_cache.end();)   // weights freed since: their copies go
    i = i->second.storage.expired() ? packed_cache.erase(i) : std::next(i);
  at::Tensor tiles = at::zeros({NB * KT * 512}, w.options().device(at::kCPU));
  const at::BFloat16* src = w.data_ptr<at::BFloat16>();
  at::BFloat16* dst = tiles.data_ptr<at::BFloat16>();
  at::parallel_for(0, NB, 16, [&](int64_t b0, int64_t b1) {
    for (int64_t nb = b0; nb < b1; nb++)
      for (int64_t i = 0; i < 16 && nb * 16 + i < N; i++)
        for (int64_t q = 0; q < K / 2; q++)                  // pair q: chunk q / 16, pair row q % 16
          std::memcpy(dst + nb * KT * 512 + (q / 16) * 512 + (q % 16) * 32 + 2 * i, src + (nb * 16 + i) * K + 2 * q,
                      2 * sizeof(at::BFloat16));
  });
  packed_cache.insert_or_assign(key, Packed{w.storage().getWeakStorageImpl(), N, K, v, tiles});
  return dst;
}

// Tiles 0-3: C, R rows of x by four blocks of 16 outputs; 4: A, x's 32-deep chunk; 6, 7: B, a block's
// chunk (in turn); where K has a tail of kt < 32, tile 5 is its A (kt wide) and 7 its B (kt / 2 pair rows;
// B is then 6 alone).
void amx_configure(int64_t kt, int64_t R) {
  TileConfig c{};
  c.palette = 1;
  for (int t = 0; t < 8; t++) c.colsb[t] = 64, c.rows[t] = uint8_t(t < 6 ? R : 16);
  if (kt) c.colsb[5] = uint16_t(2 * kt), c.rows[7] = uint8_t(kt / 2);
  // LDTILECFG with the whole 64 bytes as its operand: GCC 12's _tile_loadconfig names only the first 8,
  // so where this was inlined with constant arguments (amx_peak) the optimiser dropped the stores to the
  // rest, the tiles were configured with 0 rows and the first tile load raised SIGILL
  asm volatile("ldtilecfg %0" : : "m"(c));
}

// The G (1 or 4) C tiles of packed blocks wb[j] against R rows of x (x's rows K apart), stored to out[j]
// (R rows of 16 floats).
template <int G>
void amx_blocks(const at::BFloat16* const* wb, const at::BFloat16* x, int64_t K, int64_t KC, int64_t kt, float* out) {
#define GRAFT_EACH(F) F(0) if constexpr (G > 1) { F(1) F(2) F(3) }
#define GRAFT_ZERO(J) _tile_zero(J);
// (each B tile's 16 lines prefetched 4 chunks ahead: a pass of 4-9 rows ~3.5% faster than tile loads alone)
#define GRAFT_DP(J) for (int l = 0; l < 16; l++) \
                      _mm_prefetch(reinterpret_cast<const char*>(wb[J] + (kc + 4) * 512 + l * 32), _MM_HINT_T0); \
                    if (kt || J % 2 == 0) { _tile_loadd(6, wb[J] + kc * 512, 64); _tile_dpbf16ps(J, 4, 6); } \
                    else { _tile_loadd(7, wb[J] + kc * 512, 64); _tile_dpbf16ps(J, 4, 7); }
#define GRAFT_TAIL(J) _tile_loadd(7, wb[J] + KC * 512, 64); _tile_dpbf16ps(J, 5, 7);
#define GRAFT_STORE(J) _tile_stored(J, out + J * 256, 64);
  GRAFT_EACH(GRAFT_ZERO)
  for (int64_t kc = 0; kc < KC; kc++) {
    _tile_loadd(4, x + kc * 32, 2 * K);
    GRAFT_EACH(GRAFT_DP)
  }
  if (kt) {
    _tile_loadd(5, x + KC * 32, 2 * K);
    GRAFT_EACH(GRAFT_TAIL)
  }
  GRAFT_EACH(GRAFT_STORE)
#undef GRAFT_STORE
#undef GRAFT_TAIL
#undef GRAFT_DP
#undef GRAFT_ZERO
#undef GRAFT_EACH
}

// Two blocks of rows at once (M > ROWS_MAX, K a multiple of 32): C tiles 0, 1 the first block's 16 rows
// against packed blocks wb[0], wb[1] (G = 2; G = 1: wb[0] alone), 2, 3 the second's R2 rows against the
// same; A tiles 4, 5; B tiles 6, 7, each loaded once for both blocks of rows (a block at a time, a SmolLM2
// tree pass at B = 4 of 20 rows took 33 ms, of 16 rows 28). Every output's sum is the one a single block's
// tile multiply makes (amx_blocks): the same chunks in the same order. Stored to out[j] (first block) and
// out[512 + j] (second), 16 floats a row.
void amx_configure_pair(int64_t R2) {
  TileConfig c{};
  c.palette = 1;
  for (int t = 0; t < 8; t++) c.colsb[t] = 64, c.rows[t] = uint8_t(t == 2 || t == 3 || t == 5 ? R2 : 16);
  asm volatile("ldtilecfg %0" : : "m"(c));
}

template <int G>
void amx_pair(const at::BFloat16* const* wb, const at::BFloat16* x, int64_t K, int64_t KC, float* out) {
  _tile_zero(0); _tile_zero(2);
  if constexpr (G > 1) { _tile_zero(1); _tile_zero(3); }
  for (int64_t kc = 0; kc < KC; kc++) {
    for (int j = 0; j < G; j++)
      for (int l = 0; l < 16; l++) _mm_prefetch(reinterpret_cast<const char*>(wb[j] + (kc + 4) * 512 + l * 32), _MM_HINT_T0);
    _tile_loadd(4, x + kc * 32, 2 * K);
    _tile_loadd(5, x + 16 * K + kc * 32, 2 * K);
    _tile_loadd(6, wb[0] + kc * 512, 64);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(2, 5, 6);
    if constexpr (G > 1) {
      _tile_loadd(7, wb[1] + kc * 512, 64);
      _tile_dpbf16ps(1, 4, 7);
      _tile_dpbf16ps(3, 5, 7);
    }
  }
  _tile_stored(0, out, 64); _tile_stored(2, out + 512, 64);
  if constexpr (G > 1) { _tile_stored(1, out + 256, 64); _tile_stored(3, out + 768, 64); }
}

// Up to ROWS_MAX rows against one block of 16 outputs (16 < M <= ROWS_MAX, K a multiple of 32), the
// blocks in memory order (linear_amx): each B tile, a chunk of the block, is loaded once and multiplied
// into every block of rows, so the pass reads W once, in one stream, as a pass of 16 rows does. C tiles
// 0 .. F - 1: F full blocks of 16 rows; C tile 4: the last R2 rows (1-16; 0: none); A tiles 5 (16 rows)
// and 6 (R2 rows); B tile 7. Measured on SmolLM2's output projection (49152 x 576, one thread, the two
// interleaved in one process): 36 rows 3.8 ms against 4.4 for amx_pair (two blocks of rows against two
// output blocks at a time, also in memory order), 72 rows 5.9 against 7.4; 16 rows 2.6, one row 2.3. Every output's sum is the one a single block's tile
// multiply makes (amx_blocks): the same chunks in the same order. Stored to out + i * 256 for row block i.
constexpr int64_t ROWS_MAX = 80;

void amx_configure_rows(int64_t R2) {
  TileConfig c{};
  c.palette = 1;
  for (int t = 0; t < 8; t++) c.colsb[t] = 64, c.rows[t] = uint8_t((t == 4 || t == 6) && R2 ? R2 : 16);
  asm volatile("ldtilecfg %0" : : "m"(c));
}

template <int F, bool TAIL>
void amx_rows(const at::BFloat16* wb, const at::BFloat16* x, int64_t K, int64_t KC, float* out) {
#define GRAFT_EACH(G) G(0) G(1) G(2) G(3)
#define GRAFT_ZERO(I) if constexpr (F > I) _tile_zero(I);
#define GRAFT_DP(I) if constexpr (F > I) { _tile_loadd(5, x + I * 16 * K + kc * 32, 2 * K); _tile_dpbf16ps(I, 5, 7); }
#define GRAFT_STORE(I) if constexpr (F > I) _tile_stored(I, out + I * 256, 64);
  GRAFT_EACH(GRAFT_ZERO)
  if constexpr (TAIL) _tile_zero(4);
  for (int64_t kc = 0; kc < KC; kc++) {
    for (int l = 0; l < 16; l++) _mm_prefetch(reinterpret_cast<const char*>(wb + (kc + 4) * 512 + l * 32), _MM_HINT_T0);
    _tile_loadd(7, wb + kc * 512, 64);
    GRAFT_EACH(GRAFT_DP)
    if constexpr (TAIL) { _tile_loadd(6, x + F * 16 * K + kc * 32, 2 * K); _tile_dpbf16ps(4, 6, 7); }
  }
  GRAFT_EACH(GRAFT_STORE)
  if constexpr (TAIL) _tile_stored(4, out + F * 256, 64);
#undef GRAFT_STORE
#undef GRAFT_DP
#undef GRAFT_ZERO
#undef GRAFT_EACH
}

// amx_rows for F full blocks (0-4) and a last block or not
void amx_rows_of(int64_t F, bool tail, const at::BFloat16* wb, const at::BFloat16* x, int64_t K, int64_t KC, float* out) {
  switch (2 * F + tail) {
    case 3: return amx_rows<1, true>(wb, x, K, KC, out);
    case 4: return amx_rows<2, false>(wb, x, K, KC, out);
    case 5: return amx_rows<2, true>(wb, x, K, KC, out);
    case 6: return amx_rows<3, false>(wb, x, K, KC, out);
    case 7: return amx_rows<3, true>(wb, x, K, KC, out);
    case 8: return amx_rows<4, false>(wb, x, K, KC, out);
    default: return amx_rows<4, true>(wb, x, K, KC, out);
  }
}

// The same G blocks for one row of x (xf: x in float32) on AVX-512, the tile multiply's arithmetic chunk
// by chunk (above), stored to out[j] (16 floats).
template <int G>
void amx_row(const at::BFloat16* const* wb, const float* xf, int64_t KC, int64_t kt, float* out) {
  const unsigned csr = _mm_getcsr();
  _mm_setcsr(csr | 0x8040);                                    // DAZ, FTZ: as AMX treats denormals
  const __m512i odd = _mm512_set1_epi32(int(0xFFFF0000u));
  vec c[G];
  for (int j = 0; j < G; j++) c[j] = vzero();
  auto chunk = [&](int64_t kc, int64_t pairs) {
    vec e[G], o[G];
    for (int j = 0; j < G; j++) e[j] = o[j] = vzero();
    for (int64_t p = 0; p < pairs; p++) {
      const vec xe = vset1(xf[kc * 32 + 2 * p]), xo = vset1(xf[kc * 32 + 2 * p + 1]);
      #pragma GCC unroll 4
      for (int j = 0; j < G; j++) {
        const __m512i w = _mm512_loadu_si512(wb[j] + kc * 512 + p * 32);   // 16 outputs' pairs
        _mm_prefetch(reinterpret_cast<const char*>(wb[j] + (kc + 2) * 512 + p * 32), _MM_HINT_T0);   // 2 KB on (past the end: no fault)
        e[j] = vfma(xe, _mm512_castsi512_ps(_mm512_slli_epi32(w, 16)), e[j]);
        o[j] = vfma(xo, _mm512_castsi512_ps(_mm512_and_si512(w, odd)), o[j]);
      }
    }
    for (int j = 0; j < G; j++) c[j] = vadd(c[j], vadd(e[j], o[j]));
  };
  for (int64_t kc = 0; kc < KC; kc++) chunk(kc, 16);
  if (kt) chunk(KC, kt / 2);
  for (int j = 0; j < G; j++) _mm512_storeu_ps(out + j * 256, c[j]);
  _mm_setcsr(csr);
}

// y (M, N) = x (M, K) W^T (+ b), bfloat16, K even, W packed (amx_packed). Threads split the tasks of
// four 16-output blocks (below); a C tile's row r (row r of x: 16 outputs) gets the bias, is rounded as
// vstore rounds, and stored.
template <typename T>
void linear_amx(const at::BFloat16* x, const at::BFloat16* wp, const float* b, T* y, int64_t M, int64_t K, int64_t N) {
  if (M == 0) return;
  const int64_t KC = K / 32, kt = K % 32, KT = KC + (kt > 0), MB = (M + 15) / 16, NB = (N + 15) / 16;
  std::vector<float> xf;                                       // one row: x in float32, for amx_row
  if (M == 1) xf.assign(x, x + K);
  // tiles of R = min(M, 16) rows; past 16 where K is a multiple of 32, up to ROWS_MAX rows at once (amx_rows),
  // past that blocks of rows in pairs (amx_pair, each pair against two output blocks at a time, an odd last
  // block's rows read in place); else a last block of fewer rows read from a copy padded with zeros
  const bool pairs = M > ROWS_MAX && kt == 0;
  const int64_t R = std::min<int64_t>(M, 16), tail_rows = M > 16 && kt ? M % 16 : 0;
  std::vector<at::BFloat16> pad(tail_rows ? 16 * K : 0, at::BFloat16(0.f));
  if (tail_rows) std::memcpy(pad.data(), x + (M - tail_rows) * K, tail_rows * K * sizeof(at::BFloat16));
  // up to 16 rows, four streams a task, as one-row decoding reads W (blocks t, t + Q, t + 2 Q, t + 3 Q: the
  // memory's prefetchers follow four far-apart streams better than two neighbours); past 16, where each
  // block's weights feed many more products, blocks 4 t .. 4 t + 3, W in memory order (a prefill's 640 rows
  // against SmolLM2's 1536 x 576 gate: 1.4 ms against 3.0); the last NB - 4 Q blocks alone
  const int64_t Q = NB / 4;
  auto block = [&](int64_t t, bool four, int64_t j) { return four ? (M > 16 ? 4 * t + j : t + j * Q) : t; };
  auto emit = [&](const float* out, int64_t n0, int64_t m0, int64_t rows) {
    const int64_t nn = std::min<int64_t>(16, N - n0);
    const vec bias = b ? vload_tail(b + n0, nn) : vzero();
    for (int64_t r = 0; r < rows; r++) {
      vec s = _mm512_loadu_ps(out + r * 16);
      if (b) s = vadd(s, bias);
      vstore<T>(y + (m0 + r) * N + n0, s, nn);
    }
  };
  if (M > 16 && M <= ROWS_MAX && kt == 0) {                              // amx_rows, the blocks in order
    const int64_t F = std::min<int64_t>(M / 16, 4), R2 = M - 16 * F;        // (80 rows: four blocks and a fifth)
    at::parallel_for(0, NB, 16, [&](int64_t b0, int64_t b1) {
      alignas(64) float out[5 * 256];
      amx_configure_rows(R2);
      for (int64_t nb = b0; nb < b1; nb++) {
        amx_rows_of(F, R2 > 0, wp + nb * KT * 512, x, K, KC, out);
        for (int64_t i = 0; i < F + (R2 > 0); i++) emit(out + i * 256, nb * 16, 16 * i, i < F ? 16 : R2);
      }
    });
    return;
  }
  auto run_pairs = [&](int64_t t, bool four, float* out, int64_t& config) {
    const at::BFloat16* wb[4];
    const int64_t G = four ? 4 : 1;
    for (int64_t j = 0; j < G; j++) wb[j] = wp + block(t, four, j) * KT * 512;
    for (int64_t mb = 0; mb < MB; mb += 2) {
      const int64_t r1 = std::min<int64_t>(16, M - mb * 16), r2 = mb + 1 < MB ? std::min<int64_t>(16, M - mb * 16 - 16) : 0;
      const int64_t want = r2 ? 100 + r2 : r1;             // (a pair's config: 100 + R2; a lone block's: R)
      if (config != want) r2 ? amx_configure_pair(r2) : amx_configure(0, r1), config = want;
      if (!r2) {                                           // a lone last block: all G output blocks at once
        four ? amx_blocks<4>(wb, x + mb * 16 * K, K, KC, 0, out) : amx_blocks<1>(wb, x + mb * 16 * K, K, KC, 0, out);
        for (int64_t j = 0; j < G; j++) emit(out + j * 256, block(t, four, j) * 16, mb * 16, r1);
        continue;
      }
      for (int64_t g = 0; g < G; g += 2) {
        const at::BFloat16* wg[2] = {wb[g], wb[std::min<int64_t>(g + 1, G - 1)]};
        G > 1 ? amx_pair<2>(wg, x + mb * 16 * K, K, KC, out) : amx_pair<1>(wg, x + mb * 16 * K, K, KC, out);
        for (int64_t j = 0; j < std::min<int64_t>(2, G - g); j++) {
          const int64_t n0 = block(t, four, g + j) * 16;
          emit(out + j * 256, n0, mb * 16, r1);
          emit(out + 512 + j * 256, n0, mb * 16 + 16, r2);
        }
      }
    }
  };
  auto run = [&](int64_t t, bool four, float* out) {
    const at::BFloat16* wb[4];
    for (int64_t j = 0; j < 4; j++) wb[j] = wp + block(t, four, j) * KT * 512;
    for (int64_t mb = 0; mb < MB; mb++) {
      const int64_t rows = std::min<int64_t>(16, M - mb * 16);
      if (M == 1) four ? amx_row<4>(wb, xf.data(), KC, kt, out) : amx_row<1>(wb, xf.data(), KC, kt, out);
      else {
        const at::BFloat16* xb = rows < R ? pad.data() : x + mb * 16 * K;
        four ? amx_blocks<4>(wb, xb, K, KC, kt, out) : amx_blocks<1>(wb, xb, K, KC, kt, out);
      }
      for (int64_t j = 0; j < (four ? 4 : 1); j++) emit(out + j * 256, block(t, four, j) * 16, mb * 16, rows);
    }
  };
  at::parallel_for(0, Q + (NB - 4 * Q), 4, [&](int64_t t0, int64_t t1) {
    alignas(64) float out[4 * 256];
    if (pairs) {
      int64_t config = -1;
      for (int64_t t = t0; t < t1; t++) run_pairs(t < Q ? t : 3 * Q + t, t < Q, out, config);
      return;
    }
    if (M > 1) amx_configure(kt, R);
    for (int64_t t = t0; t < t1; t++) run(t < Q ? t : 3 * Q + t, t < Q, out);
  });
}
#endif

// A step in parts (Op::PARTS, where an Op has them: WidenBF16's two halves), each loaded as W (or x) part s of
// the step at p, n of its weights there (n < STEP: the masked tail). W's vector and x's may differ in type
// (I8BF16Dot: a W step is two bfloat16 vectors), so each load keeps its own.
template <typename Op> constexpr int parts = [] { if constexpr (requires { Op::PARTS; }) return Op::PARTS; else return 1; }();
template <typename Op, bool W, typename P>
inline auto part(const P* p, int64_t n, int s) {
  if constexpr (parts<Op> > 1) {
    if constexpr (W) return n == Op::STEP ? Op::w(p, s) : Op::w_tail(p, n, s);
    else return n == Op::STEP ? Op::x(p, s) : Op::x_tail(p, n, s);
  } else {
    if constexpr (W) return n == Op::STEP ? Op::w(p) : Op::w_tail(p, n);
    else return n == Op::STEP ? Op::x(p) : Op::x_tail(p, n);
  }
}

// y[m, n] for m in [m0, m0 + mr), n = n0, n0 + rs, .., n0 + (nr - 1) rs. Every (m, n) runs the same
// sequence: the lanes' products over k in steps, in order, the masked tail, one Op::sum; mr, nr and rs
// only decide which outputs run side by side. pf: rows of W to come (at the same offsets from each of
// the nr streams), their weights [p0, p1) prefetched while these compute (null: none), with locality
// hint HINT (3: into L1, 2: into L2). sc: an int8 W's scale per output (null: none), applied to the sum
// before the bias, the same one multiply for every row.
template <typename Op, typename T, int64_t mr, int64_t nr, int HINT>
inline void tile(const typename Op::X* x, const typename Op::W* w, const float* sc, const float* b, T* y, int64_t K,
                 int64_t N, int64_t m0, int64_t n0, int64_t rs, const typename Op::W* pf, int64_t p0 = 0,
                 int64_t p1 = INT64_MAX) {
  typename Op::A acc[mr][nr];
  #pragma GCC unroll 32
  for (int64_t i = 0; i < mr; i++)
    #pragma GCC unroll 32
    for (int64_t j = 0; j < nr; j++) acc[i][j] = Op::zero();
  auto step = [&](int64_t k, int64_t n, auto fetch) {      // n < STEP: the masked tail; fetch: prefetch here
    #pragma GCC unroll 1
    for (int s = 0; s < parts<Op>; s++) {                  // (a step's parts in order: WidenBF16's two halves)
      if (s * Op::STEP / parts<Op> >= n) break;
      typename Op::V wv[nr];
      #pragma GCC unroll 16
      for (int64_t j = 0; j < nr; j++) wv[j] = part<Op, true>(w + (n0 + j * rs) * K + k, n, s);
      if constexpr (decltype(fetch)::value)
        if (s == 0 && (sizeof(typename Op::W) * Op::STEP >= 64 || (k * sizeof(typename Op::W)) % 64 == 0))   // a line once
          #pragma GCC unroll 16
          for (int64_t j = 0; j < nr; j++) __builtin_prefetch(pf + j * rs * K + k, 0, HINT);
      #pragma GCC unroll 16
      for (int64_t i = 0; i < mr; i++) {
        const auto xv = part<Op, false>(x + (m0 + i) * K + k, n, s);
        #pragma GCC unroll 16
        for (int64_t j = 0; j < nr; j++) acc[i][j] = Op::dot(xv, wv[j], acc[i][j]);
      }
    }
  };
  // Whole steps in three runs, the middle one prefetching (p0, p1: multiples of a line, so of a step),
  // then the masked tail: the same steps in the same order as one loop, without a test per step.
  const int64_t KS = K - K % Op::STEP, a = pf ? std::min(p0, KS) : KS, e = pf ? std::max(a, std::min(p1, KS)) : KS;
  int64_t k = 0;
#if defined(GRAFT_AVX2)
  if constexpr (std::is_same_v<Op, WidenBF16> && mr == 4 && nr == 3) {               // (the same steps, in asm)
    const int64_t pairs = pf ? (e - a) / 32 : 0, n[4] = {a / 16, pairs, pf ? (e - a) / 16 - 2 * pairs : 0, (KS - e) / 16};
    steps43(acc, x + m0 * K, K, w + n0 * K, rs * K, pf ? pf + a : nullptr, n);
    k = KS;
  }
#endif
  for (; k < a; k += Op::STEP) step(k, Op::STEP, std::false_type{});
  for (; k < e; k += Op::STEP) step(k, Op::STEP, std::true_type{});
  for (; k < KS; k += Op::STEP) step(k, Op::STEP, std::false_type{});
  if (k < K) step(k, K - k, std::false_type{});
  #pragma GCC unroll 32
  for (int64_t i = 0; i < mr; i++)
    #pragma GCC unroll 32
    for (int64_t j = 0; j < nr; j++) {
      float s = Op::sum(acc[i][j]);
      if (sc) s *= sc[n0 + j * rs];
      if (b) s += b[n0 + j * rs];
      y[(m0 + i) * N + n0 + j * rs] = T(s);
    }
}

// All M rows against W's rows n0 + j rs (j < nr): tiles of rows as even as possible, each at most
// MR_MAX; each prefetches its share of pf's lines (the tiles after the first read what it brought): a
// burst of them all in one tile fills the core's outstanding misses and stalls it (measured: a float32
// pass of 17 rows from memory ran at 57% of the FMA peak against 79% with W in L2).
template <typename Op, typename T, int64_t nr>
inline void row_tiles(const typename Op::X* x, const typename Op::W* w, const float* sc, const float* b, T* y, int64_t M,
                      int64_t K, int64_t N, int64_t n0, int64_t rs, const typename Op::W* pf) {
  const int64_t tiles = (M + MR_MAX - 1) / MR_MAX, small = M / tiles, big = M % tiles;
  constexpr int64_t LINE = 64 / sizeof(typename Op::W);                   // weights a cache line
  const int64_t lines = (K + LINE - 1) / LINE;
  for (int64_t t = 0, m = 0; t < tiles; t++) {
    const int64_t r = small + (t < big), p0 = t * lines / tiles * LINE, p1 = (t + 1) * lines / tiles * LINE;
    switch (r) {
#define GRAFT_TILE(R) case R: if constexpr (R <= MR_MAX) tile<Op, T, R, nr, 2>(x, w, sc, b, y, K, N, m, n0, rs, pf, p0, p1); break;
      GRAFT_TILE(1) GRAFT_TILE(2) GRAFT_TILE(3) GRAFT_TILE(4) GRAFT_TILE(5) GRAFT_TILE(6)
#undef GRAFT_TILE
      default: TORCH_CHECK(false, "graft::linear: tile rows");
    }
    m += r;
  }
}

// W read as sequential streams (its rows in contiguous parts, each walked row after row, which the
// memory's prefetchers follow), the rows past the parts one at a time. Threads split the streams'
// rows: a thread never shares an output's sum with another.
template <typename Op, typename T>
void linear_impl(const typename Op::X* x, const typename Op::W* w, const float* sc, const float* b, T* y, int64_t M,
                 int64_t K, int64_t N) {
  if (M == 0) return;
  if (M == 1) {
    constexpr int64_t nr = 4;
    const int64_t Q = N / nr;
    at::parallel_for(0, Q, 16, [&](int64_t t0, int64_t t1) {
      for (int64_t t = t0; t < t1; t++)
        tile<Op, T, 1, nr, 3>(x, w, sc, b, y, K, N, 0, t, Q, t + 1 < t1 ? w + (t + 1) * K : nullptr);
    });
    for (int64_t n = nr * Q; n < N; n++) tile<Op, T, 1, 1, 3>(x, w, sc, b, y, K, N, 0, n, 1, n + 1 < N ? w + (n + 1) * K : nullptr);
    return;
  }
  const int64_t Q = N / NR_MULTI;
  at::parallel_for(0, Q, 8, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; t++)
      row_tiles<Op, T, NR_MULTI>(x, w, sc, b, y, M, K, N, t, Q, t + PF_AHEAD < t1 ? w + (t + PF_AHEAD) * K : nullptr);
  });
  for (int64_t n = NR_MULTI * Q; n < N; n++) row_tiles<Op, T, 1>(x, w, sc, b, y, M, K, N, n, 1, nullptr);
}

// y (M, N) = x (M, K) W^T (* scale) (+ b), x and y of dtype T, W of T or int8 (W_), an int8 W with its
// scale per output (sc). bfloat16 runs the CPU's bfloat16 dot product where it has one (an int8 W widened
// to bfloat16 in registers); otherwise x is widened into `wide` once and W as it streams.
template <typename T, typename W_>
void lin_as(const T* x, int64_t M, const W_* wp, int64_t K, int64_t N, const float* sc, const float* b, T* y,
            std::vector<float>& wide) {
#if defined(__AVX512BF16__)
  if constexpr (std::is_same_v<T, at::BFloat16>) {
    if constexpr (std::is_same_v<W_, int8_t>) linear_impl<I8BF16Dot, T>(x, wp, sc, b, y, M, K, N);
    else linear_impl<BF16Dot, T>(x, wp, sc, b, y, M, K, N);
    return;
  }
#endif
#if defined(GRAFT_AVX2)
  if constexpr (std::is_same_v<T, at::BFloat16> && std::is_same_v<W_, at::BFloat16>) {
    wide.resize(M * K);
    permute16(x, wide.data(), M, K);
    linear_impl<WidenBF16, T>(wide.data(), wp, sc, b, y, M, K, N);
    return;
  }
#endif
  if constexpr (std::is_same_v<T, float>) {
    linear_impl<Widen<W_>, T>(x, wp, sc, b, y, M, K, N);
  } else {
    wide.resize(M * K);
    for (int64_t i = 0; i < M * K; i++) wide[i] = float(x[i]);
    linear_impl<Widen<W_>, T>(wide.data(), wp, sc, b, y, M, K, N);
  }
}

template <typename T>
void lin(const T* x, int64_t M, const at::Tensor& w, const float* b, T* y, std::vector<float>& wide,
         const float* sc = nullptr) {
#if defined(GRAFT_AMX)
  if constexpr (std::is_same_v<T, at::BFloat16>)
    if (w.scalar_type() == at::kBFloat16 && w.size(1) % 2 == 0 && amx_on())
      return linear_amx<T>(x, amx_packed(w), b, y, M, w.size(1), w.size(0));
#endif
  if (w.scalar_type() == at::kChar)
    lin_as<T, int8_t>(x, M, w.data_ptr<int8_t>(), w.size(1), w.size(0), sc, b, y, wide);
  else
    lin_as<T, T>(x, M, w.data_ptr<T>(), w.size(1), w.size(0), nullptr, b, y, wide);
}

// The core's multiply-add peak for the linear's dtype: GMAC/s of the instruction lin's inner loop
// runs (VDPBF16PS for bfloat16 where the CPU has it, else FMA on widened floats), 12 independent
// accumulators in registers, for about `seconds`. What bench.py divides a pass's work by.
template <typename Op>
double op_peak(double seconds) {
  using V = typename Op::V;
  alignas(64) typename Op::X in[2 * Op::STEP];
  for (int64_t i = 0; i < 2 * Op::STEP; i++) in[i] = typename Op::X(1.0f + 1e-3f * float(i % 7));
  const V a = Op::x(in), c = Op::x(in + Op::STEP);
  typename Op::A acc[12];
  for (auto& r : acc) r = Op::zero();
  int64_t steps = 0;
  const auto t0 = std::chrono::steady_clock::now();
  double took = 0;
  do {
    for (int it = 0; it < 4096; it++) {
      #pragma GCC unroll 12
      for (int j = 0; j < 12; j++) acc[j] = Op::dot(a, c, acc[j]);
    }
    steps += 4096;
    took = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  } while (took < seconds);
  float sink = 0;
  for (auto& r : acc) sink += Op::sum(r);
  volatile float keep = sink;
  (void)keep;
  return double(steps) * 12 * Op::MACS / took / 1e9;
}

#if defined(GRAFT_AMX)
// AMX's bfloat16 peak: TDPBF16PS on four independent C tiles (16 x 16 outputs, 32 deep: 8192 multiply-adds
// each), operands in tiles, for about `seconds`.
double amx_peak(double seconds) {
  amx_configure(0, 16);
  alignas(64) uint16_t one[512];
  for (auto& v : one) v = 0x3F80;                              // bfloat16 1.0
  _tile_loadd(2, one, 64);
  _tile_loadd(3, one, 64);
  _tile_loadd(4, one, 64);
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(5);
  _tile_zero(6);
  int64_t ops = 0;
  const auto t0 = std::chrono::steady_clock::now();
  double took = 0;
  do {
    for (int it = 0; it < 1024; it++) {
      _tile_dpbf16ps(0, 2, 4);
      _tile_dpbf16ps(1, 3, 4);
      _tile_dpbf16ps(5, 2, 4);
      _tile_dpbf16ps(6, 3, 4);
    }
    ops += 4096;
    took = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  } while (took < seconds);
  return double(ops) * 8192 / took / 1e9;
}
#endif

std::string isa() {
#if defined(GRAFT_AMX)
  if (amx_on()) return "avx512_bf16+amx";
#endif
#if defined(__AVX512BF16__) && defined(GRAFT_AVX512)
  return "avx512_bf16";
#elif defined(GRAFT_AVX512)
  return "avx512";
#elif defined(GRAFT_AVX2)
  return "avx2";
#else
  return "portable";
#endif
}

double kernel_peak(c10::ScalarType dtype, double seconds) {
  switch (dtype) {
#if defined(GRAFT_AMX)
    case at::kBFloat16: return amx_on() ? amx_peak(seconds) : op_peak<BF16Dot>(seconds);
#elif defined(__AVX512BF16__)
    case at::kBFloat16: return op_peak<BF16Dot>(seconds);
#else
    case at::kBFloat16: return op_peak<Widen<at::BFloat16>>(seconds);
#endif
    case at::kHalf: return op_peak<Widen<at::Half>>(seconds);
    case at::kFloat: return op_peak<Widen<float>>(seconds);
    default: TORCH_CHECK(false, "graft::peak: float32, bfloat16 or float16");
  }
}

// bias (N,) as float32 (null: none); `keep` holds the converted copy alive
inline const float* bias_ptr(const c10::optional<at::Tensor>& bias, at::Tensor& keep) {
  if (!bias.has_value() || !bias->defined()) return nullptr;
  keep = bias->to(at::kFloat).contiguous();
  return keep.data_ptr<float>();
}

// An int8 W's scales (N,) as float32 (`keep` holds the converted copy alive); null for a float W, which
// takes none. Checked: an int8 W has its N scales, a float W is x's dtype.
inline const float* scale_ptr(const at::Tensor& w, const c10::optional<at::Tensor>& scale, c10::ScalarType xt,
                              at::Tensor& keep, const char* what) {
  const bool q = scale.has_value() && scale->defined();
  if (w.scalar_type() != at::kChar) {
    TORCH_CHECK(!q && w.scalar_type() == xt, what, ": x and W of one dtype (a scale only with an int8 W)");
    return nullptr;
  }
  TORCH_CHECK(q && scale->numel() == w.size(0) && scale->device().is_cpu(), what, ": an int8 W takes its scales (N,)");
  keep = scale->to(at::kFloat).contiguous();
  return keep.data_ptr<float>();
}

at::Tensor linear(const at::Tensor& x, const at::Tensor& w, const c10::optional<at::Tensor>& bias,
                  const c10::optional<at::Tensor>& scale) {
  TORCH_CHECK(x.device().is_cpu() && w.device().is_cpu(), "graft::linear: CPU tensors only");
  TORCH_CHECK(w.dim() == 2 && x.size(-1) == w.size(1), "graft::linear: x (..., K) and W (N, K)");
  at::Tensor sk;
  const float* sp = scale_ptr(w, scale, x.scalar_type(), sk, "graft::linear");
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
    case at::kFloat: lin(xs.data_ptr<float>(), M, wc, bp, y.data_ptr<float>(), wide, sp); break;
    case at::kBFloat16: lin(xs.data_ptr<at::BFloat16>(), M, wc, bp, y.data_ptr<at::BFloat16>(), wide, sp); break;
    case at::kHalf: lin(xs.data_ptr<at::Half>(), M, wc, bp, y.data_ptr<at::Half>(), wide, sp); break;
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

inline float vmax(vec a) { return _mm512_reduce_max_ps(a); }
#elif defined(GRAFT_AVX2)
inline __m256 exp8_neg(__m256 x) {                           // vexp_neg's arithmetic, 8 lanes
  const __m256 t = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fmadd_ps(t, _mm256_set1_ps(-0.693359375f), x);
  r = _mm256_fmadd_ps(t, _mm256_set1_ps(2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.3888889e-3f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3333333e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1666667e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666667e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
  // p * 2^t (t >= -126 wherever x >= -87: 2^t is a normal float, and the product rounds once, as scalef)
  const __m256 two_t = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(t), _mm256_set1_epi32(127)), 23));
  const __m256 keep = _mm256_cmp_ps(x, _mm256_set1_ps(-87.f), _CMP_GE_OQ);
  return _mm256_and_ps(_mm256_mul_ps(p, _mm256_blendv_ps(_mm256_set1_ps(1.f), two_t, keep)), keep);
}
inline vec vexp_neg(vec x) { return {exp8_neg(x.lo), exp8_neg(x.hi)}; }
inline float vmax(vec a) {
  const __m256 m = _mm256_max_ps(a.lo, a.hi);
  const __m128 t = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
  const __m128 u = _mm_max_ps(t, _mm_shuffle_ps(t, t, 0x4E));
  return _mm_cvtss_f32(_mm_max_ss(u, _mm_shuffle_ps(u, u, 0xB1)));
}
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
inline float vmax(vec a) { float m = a.v[0]; for (int l = 1; l < 16; l++) m = std::max(m, a.v[l]); return m; }
#endif

// Strided (b, h, t) rows of D elements: element d of row (b, h, t) is p[b * sb + h * sh + t * st + d].
template <typename P>
struct Rows {
  P* p;
  int64_t sb, sh, st;
  P* at(int64_t b, int64_t h, int64_t t) const { return p + b * sb + h * sh + t * st; }
};

// Attention, exact per query: a query's output is a function of its own q and of the keys and values
// its mask lets it see, in row order (committed rows, then its tree ancestors: position order), whatever
// queries run beside it. Plain decoding at the same position sees the same keys in the same order, so a
// tree node's output is plain decoding's, bit for bit. For one request and one KV head:
//   1. scores. Keys are taken 16 rows at a time and transposed into a block (keys in lanes), so that a
//      score is one accumulator lane fed element by element of the head dimension, in order, with no
//      horizontal sum; every query-head of the request reuses the block (SCORE_GROUP at a time, which
//      hides the FMA's latency). score = scale * sum_d q_d k_d.
//   2. softmax. A query-head's seen scores in row order, their max, p = exp(score - max) 16 at a time and
//      their total in 16 lanes, both in seen order.
//   3. p V. Each value row is read once for up to GR query-heads, each adding p v for the rows it sees,
//      in row order; then the total divides.
// Keys as float32 (element d of key u at [d * 16 + u]); for bfloat16 on a CPU with the bfloat16 dot
// product, as pairs (key u's elements 2p and 2p + 1 in dword [p * 16 + u]), two products a lane a step.
#if defined(GRAFT_AVX512)
// 16 rows of 16 dwords -> 16 columns (out[c] holds element c of every row), in registers
inline void transpose16(__m512i* r) {
  __m512i t[16], u[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {
    u[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
    u[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
    u[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
    u[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
  }
  for (int i = 0; i < 4; i++) {             // 128-bit lanes: rows 4i..4i+3 of each quarter
    t[i] = _mm512_shuffle_i32x4(u[i], u[i + 4], 0x88);
    t[i + 4] = _mm512_shuffle_i32x4(u[i], u[i + 4], 0xDD);
    t[i + 8] = _mm512_shuffle_i32x4(u[i + 8], u[i + 12], 0x88);
    t[i + 12] = _mm512_shuffle_i32x4(u[i + 8], u[i + 12], 0xDD);
  }
  for (int i = 0; i < 4; i++) {
    r[i] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0x88);
    r[i + 8] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0xDD);
    r[i + 4] = _mm512_shuffle_i32x4(t[i + 4], t[i + 12], 0x88);
    r[i + 12] = _mm512_shuffle_i32x4(t[i + 4], t[i + 12], 0xDD);
  }
}
#endif

template <typename T>
struct KeysF {
  using E = float;
  static constexpr int64_t PER = 1;                   // elements a block entry holds
  static void block(const T* k, int64_t st, int64_t n, int64_t D, float* out) {
#if defined(GRAFT_AVX512)
    for (int64_t d0 = 0; d0 < D; d0 += 16) {        // 16 keys x 16 elements at a time, widened, transposed
      const int64_t w = std::min<int64_t>(16, D - d0);
      __m512i r[16];
      for (int64_t u = 0; u < 16; u++)
        r[u] = u < n ? _mm512_castps_si512(w == 16 ? vload(k + u * st + d0) : vload_tail(k + u * st + d0, w)) : _mm512_setzero_si512();
      transpose16(r);
      for (int64_t c = 0; c < w; c++) _mm512_storeu_si512((void*)(out + (d0 + c) * 16), r[c]);
    }
#else
    for (int64_t u = 0; u < 16; u++)
      for (int64_t d = 0; d < D; d++) out[d * 16 + u] = u < n ? float(k[u * st + d]) : 0.f;
#endif
  }
  static void query(const T* q, int64_t D, float* out) { for (int64_t d = 0; d < D; d++) out[d] = float(q[d]); }
  template <int R>                                    // R query-heads' 16 scores (unscaled)
  static void dots(const float* const* q, const float* kt, int64_t D, vec* out) {
    vec acc[R];                                       // (locals: vector types may alias, out would not stay in registers)
    const float* qr[R];
    for (int r = 0; r < R; r++) acc[r] = vzero(), qr[r] = q[r];
    for (int64_t d = 0; d < D; d++) {
      const vec kv = vload(kt + d * 16);
      #pragma GCC unroll 8
      for (int r = 0; r < R; r++) acc[r] = vfma(vset1(qr[r][d]), kv, acc[r]);
    }
    for (int r = 0; r < R; r++) out[r] = acc[r];
  }
};
#if defined(__AVX512BF16__)
struct KeysBF16 {
  using E = uint32_t;
  static constexpr int64_t PER = 2;
  static void block(const at::BFloat16* k, int64_t st, int64_t n, int64_t D, uint32_t* out) {
    for (int64_t p0 = 0; p0 < D / 2; p0 += 16) {    // 16 keys x 16 pairs at a time
      const int64_t w = std::min<int64_t>(16, D / 2 - p0);
      const __mmask16 m = (__mmask16)((1u << w) - 1u);
      __m512i r[16];
      for (int64_t u = 0; u < 16; u++)
        r[u] = u < n ? _mm512_maskz_loadu_epi32(m, (const void*)(k + u * st + 2 * p0)) : _mm512_setzero_si512();
      transpose16(r);
      for (int64_t c = 0; c < w; c++) _mm512_storeu_si512((void*)(out + (p0 + c) * 16), r[c]);
    }
  }
  static void query(const at::BFloat16* q, int64_t D, uint32_t* out) { std::memcpy(out, q, D * sizeof(at::BFloat16)); }
  template <int R>
  static void dots(const uint32_t* const* q, const uint32_t* kt, int64_t D, vec* out) {
    vec acc[R];
    const float* qr[R];
    for (int r = 0; r < R; r++) acc[r] = vzero(), qr[r] = reinterpret_cast<const float*>(q[r]);
    for (int64_t p = 0; p < D / 2; p++) {
      const __m512i kv = _mm512_loadu_si512((const void*)(kt + p * 16));
      #pragma GCC unroll 8
      for (int r = 0; r < R; r++)           // q's pair broadcast straight from memory (a load, not a shuffle)
        acc[r] = _mm512_dpbf16_ps(acc[r], (__m512bh)_mm512_set1_ps(qr[r][p]), (__m512bh)kv);
    }
    for (int r = 0; r < R; r++) out[r] = acc[r];
  }
};
template <typename T> struct KeysOf { using type = KeysF<T>; };
template <> struct KeysOf<at::BFloat16> { using type = KeysBF16; };
#else
template <typename T> struct KeysOf { using type = KeysF<T>; };
#endif

#if defined(GRAFT_AVX512)
constexpr int SCORE_GROUP = 8;        // query-heads scored together (accumulators in registers)
#elif defined(GRAFT_AVX2)
constexpr int SCORE_GROUP = 4;        // (vec is two of AVX2's 16 registers)
#else
constexpr int SCORE_GROUP = 4;
#endif
constexpr int64_t KB = 256;                         // keys transposed at a time (a block set that stays in cache)

#if defined(GRAFT_AMX)
// 1. on AMX (bfloat16 keys, D a multiple of 32): one tile multiply scores 16 query-heads against 16 keys, 32
// elements deep. A key block (KeysBF16::block: pair p of key u at dword p * 16 + u) is its B tile as it stands,
// 1 KB a 32-element chunk; the query-heads' rows (DE dwords apart) its A tile; C accumulates the chunks in
// order. A score is one C element, summed as a tile multiply sums (linear_amx), whatever rows beside it: plain
// decoding's G query-heads (a tile whose other rows are zeros) get a tree's bits. The dot-product path took
// ~30% of a 9-node pass's attention (one VDPBF16PS a pair of elements, a query-head and 16 keys). Tiles 0
// (C), 1 (A), 2 (B) as amx_configure(0, 16) sets them.

// 16 query-heads (q: rows DE dwords apart) x 16 keys (blk) -> out (16 x 16 floats, unscaled)
void amx_scores(const uint32_t* q, int64_t DE, const uint32_t* blk, float* out) {
  _tile_zero(0);
  for (int64_t c = 0; c < DE / 16; c++) {
    _tile_loadd(1, q + c * 16, DE * 4);
    _tile_loadd(2, blk + c * 256, 64);
    _tile_dpbf16ps(0, 1, 2);
  }
  _tile_stored(0, out, 64);
}
#endif

// 3. p v, added in row order to NV accumulators per query-head (kept between calls in memory, o). vf: the
// value rows, DV elements apart, NV vectors each: the cache's own where a row is whole vectors (read in
// place, widened in registers: the same floats), else widened to float32 first and zero-padded. pv_shared: Q query-heads over rows
// j0..j1-1, which each of them sees, every value row loaded once for the Q (Q NV independent FMA chains:
// one chain's latency would bound a single query-head); pv_seen: one query-head over its seen-list
// entries c0..c1-1 (the first `gap` of them are rows 0..gap-1).
#if defined(GRAFT_AVX512)
template <int NV> constexpr int PV_Q = NV <= 4 ? 6 : NV <= 8 ? 2 : 1;     // Q NV + NV + 1 <= 32 registers
#elif defined(GRAFT_AVX2)
template <int NV> constexpr int PV_Q = NV <= 1 ? 4 : NV <= 2 ? 2 : 1;     // (vec: two of 16 registers)
#else
template <int NV> constexpr int PV_Q = 1;
#endif

template <int NV, int Q, typename V>
void pv_shared(const float* const* p, const V* vf, int64_t DV, int64_t j0, int64_t j1, float* const* o) {
  vec acc[Q][NV];
  const float* pr[Q];
  #pragma GCC unroll 8
  for (int q = 0; q < Q; q++) {
    pr[q] = p[q];
    #pragma GCC unroll 16
    for (int e = 0; e < NV; e++) acc[q][e] = vload(o[q] + e * LANES);
  }
  for (int64_t j = j0; j < j1; j++) {
    vec v[NV];
    #pragma GCC unroll 16
    for (int e = 0; e < NV; e++) v[e] = vload(vf + j * DV + e * LANES);
    #pragma GCC unroll 8
    for (int q = 0; q < Q; q++) {
      const vec pv = vset1(pr[q][j]);
      #pragma GCC unroll 16
      for (int e = 0; e < NV; e++) acc[q][e] = vfma(pv, v[e], acc[q][e]);
    }
  }
  #pragma GCC unroll 8
  for (int q = 0; q < Q; q++)
    #pragma GCC unroll 16
    for (int e = 0; e < NV; e++) store(o[q] + e * LANES, acc[q][e]);
}

template <int NV, typename V>
void pv_seen(const float* p, const V* vf, int64_t DV, const int64_t* sn, int64_t c0, int64_t c1, int64_t gap, float* o) {
  vec acc[NV];
  #pragma GCC unroll 16
  for (int e = 0; e < NV; e++) acc[e] = vload(o + e * LANES);
  for (int64_t c = c0; c < c1; c++) {
    const int64_t j = c < gap ? c : sn[c];
    const vec pv = vset1(p[j]);
    #pragma GCC unroll 16
    for (int e = 0; e < NV; e++) acc[e] = vfma(pv, vload(vf + j * DV + e * LANES), acc[e]);
  }
  #pragma GCC unroll 16
  for (int e = 0; e < NV; e++) store(o + e * LANES, acc[e]);
}

// every query-head r of a (request, KV head): out[r] = (sum of p v over its seen rows, in row order) / l[r]
template <int NV, typename V>
void pv(const float* sc, int64_t sstride, const V* vf, int64_t DV, const int64_t* const* sn, const int64_t* n,
        const int64_t* gap, int64_t R, float* acc) {
  constexpr int Q = PV_Q<NV>;
  const float* p[Q];
  float* o[Q];
  for (int64_t r0 = 0; r0 < R; r0 += Q) {
    const int64_t k = std::min<int64_t>(Q, R - r0);
    int64_t common = std::numeric_limits<int64_t>::max();
    for (int64_t q = 0; q < k; q++) {
      p[q] = sc + (r0 + q) * sstride;
      o[q] = acc + (r0 + q) * DV;
      common = std::min(common, std::min(gap[r0 + q], n[r0 + q]));
    }
    // the rows all k of them see (their committed prefix), shared; then each one's own rest
    switch (k) {
#define GRAFT_PVQ(K) case K: if constexpr (K <= Q) pv_shared<NV, K, V>(p, vf, DV, 0, common, o); break;
      GRAFT_PVQ(1) GRAFT_PVQ(2) GRAFT_PVQ(3) GRAFT_PVQ(4) GRAFT_PVQ(5) GRAFT_PVQ(6)
#undef GRAFT_PVQ
    }
    for (int64_t q = 0; q < k; q++) pv_seen<NV, V>(p[q], vf, DV, sn[r0 + q], common, n[r0 + q], gap[r0 + q], o[q]);
  }
}

// q (B, H, Tq, D) against the keys and values of cache batch kbat[b] (b itself when kbat is null),
// rows 0..S-1, under mask rows mask(b, t) (S bools, stride ms_s). Writes out (B, H, Tq, D). on (B Tq,):
// the rows whose output is read (null: all); the others, as a row that sees nothing, get zeros and cost
// nothing (a padding row of a request beside a longer one would otherwise score every key it may see).
template <typename T>
void attend(Rows<const T> q, Rows<const T> k, Rows<const T> v, const int64_t* kbat, Rows<const bool> mask, int64_t ms_s,
            Rows<T> out, int64_t B, int64_t H, int64_t Tq, int64_t D, int64_t Hkv, int64_t S, float scale,
            const bool* on = nullptr) {
  using Keys = typename KeysOf<T>::type;
  using E = typename Keys::E;
  const int64_t G = H / Hkv, R = Tq * G;              // query-heads of a (request, KV head): r = t G + g
  TORCH_CHECK(D <= 256 && D % Keys::PER == 0, "graft::attention: head_dim <= 256 (even for bfloat16)");
  const int64_t NV = (D + LANES - 1) / LANES, DE = D / Keys::PER, S16 = (S + 15) / 16 * 16;
  // the keys each query sees, in row order, found once
  // (gap[i]: the seen list begins with rows 0..gap - 1, every one of them: the committed rows, read in place)
  std::vector<int64_t> seen(B * Tq * S), n(B * Tq), last(B * Tq), gap(B * Tq);
  at::parallel_for(0, B * Tq, 1, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; i++) {
      if (on && !on[i]) { n[i] = gap[i] = 0, last[i] = -1; continue; }
      const bool* mrow = mask.at(i / Tq, 0, i % Tq);
      int64_t c = 0;
      for (int64_t j = 0; j < S; j++) if (mrow[j * ms_s]) seen[i * S + c++] = j;
      n[i] = c;
      last[i] = c ? seen[i * S + c - 1] : -1;
      int64_t g = 0;
      while (g < c && seen[i * S + g] == g) g++;
      gap[i] = g;
    }
  });
  // one task per (request, KV head): every query-head of the request that reads it
#if defined(GRAFT_AMX)
  const bool tiles = std::is_same_v<E, uint32_t> && DE % 16 == 0 && amx_on();
#else
  const bool tiles = false;
#endif
  const int64_t R16 = (R + 15) / 16 * 16;             // (tiles: query-heads in blocks of 16, the rest zeros)
  at::parallel_for(0, B * Hkv, 1, [&](int64_t i0, int64_t i1) {
    std::vector<E> qe(R16 * DE), kt(KB * DE);
#if defined(GRAFT_AMX)
    alignas(64) float tile[256];                      // (a C tile's scores, 16 query-heads x 16 keys)
    if (tiles) amx_configure(0, 16);
#endif
    std::vector<float> sc(R * S16), l(R), sbuf(S16), vf, acc;
    std::vector<const int64_t*> snr(R);
    std::vector<const E*> qp(R);
    std::vector<int64_t> rl(R), rn(R), rg(R), rt(R);
    std::vector<T*> outs(R);
    for (int64_t i = i0; i < i1; i++) {
      const int64_t b = i / Hkv, h = i % Hkv, kb_ = kbat ? kbat[b] : b;
      int64_t most = -1, R = 0;                       // R: the query-heads of rows that see a key, in row order
      for (int64_t t = 0; t < Tq; t++)
        for (int64_t g = 0; g < G; g++) {
          if (!n[b * Tq + t]) {                       // sees nothing (padding): zeros
            std::fill_n(out.at(b, h * G + g, t), D, T(0.f));
            continue;
          }
          const int64_t r = R++;
          Keys::query(q.at(b, h * G + g, t), D, qe.data() + r * DE);
          qp[r] = qe.data() + r * DE;
          rl[r] = last[b * Tq + t];
          rn[r] = n[b * Tq + t];
          rg[r] = gap[b * Tq + t];
          rt[r] = t;
          outs[r] = out.at(b, h * G + g, t);
          most = std::max(most, rl[r]);
        }
      const T* kb = k.at(kb_, h, 0);
      if (tiles) std::fill(qe.begin() + R * DE, qe.begin() + R16 * DE, E(0));
      // 1. scores of every query-head against the keys up to the last one it sees, KB keys at a time
      for (int64_t c0 = 0; c0 <= most; c0 += KB) {
        const int64_t c1 = std::min(most + 1, c0 + KB);
        for (int64_t j = c0; j < c1; j += 16) Keys::block(kb + j * k.st, k.st, std::min<int64_t>(16, c1 - j), D, kt.data() + (j - c0) * DE);
        for (int64_t j = c0; j < c1; j += 16) {
          const E* blk = kt.data() + (j - c0) * DE;
#if defined(GRAFT_AMX)
          if constexpr (std::is_same_v<E, uint32_t>) if (tiles) {
            for (int64_t r = 0; r < R; r += 16) {
              amx_scores(qe.data() + r * DE, DE, blk, tile);
              for (int64_t u = 0; u < std::min<int64_t>(16, R - r); u++)
                if (rl[r + u] >= j) store(sc.data() + (r + u) * S16 + j, vmul(vload(tile + u * 16), vset1(scale)));
            }
            continue;
          }
#endif
          for (int64_t r = 0; r < R; r += SCORE_GROUP) {
            vec acc[SCORE_GROUP];
            const int64_t m = std::min<int64_t>(SCORE_GROUP, R - r);
            switch (m) {
#define GRAFT_DOTS(M_) case M_: if constexpr (M_ <= SCORE_GROUP) Keys::template dots<M_>(qp.data() + r, blk, D, acc); break;
              GRAFT_DOTS(1) GRAFT_DOTS(2) GRAFT_DOTS(3) GRAFT_DOTS(4) GRAFT_DOTS(5) GRAFT_DOTS(6) GRAFT_DOTS(7) GRAFT_DOTS(8)
#undef GRAFT_DOTS
            }
            for (int64_t u = 0; u < m; u++) if (rl[r + u] >= j) store(sc.data() + (r + u) * S16 + j, vmul(acc[u], vset1(scale)));
          }
        }
      }
      // 2. softmax over each query-head's seen keys, in seen order; p replaces the score in place
      for (int64_t r = 0; r < R; r++) {
        const int64_t nr = rn[r], in_place = rg[r] / 16 * 16;        // whole chunks of the seen prefix
        const int64_t* sn = seen.data() + (b * Tq + rt[r]) * S;
        float* row = sc.data() + r * S16;
        for (int64_t c = in_place; c < nr; c++) sbuf[c] = row[sn[c]];
        for (int64_t c = nr; c < (nr + 15) / 16 * 16; c++) sbuf[c] = -std::numeric_limits<float>::infinity();
        auto chunk = [&](int64_t c) { return c < in_place ? row + c : sbuf.data() + c; };
        vec top = vset1(-std::numeric_limits<float>::infinity());     // the max: exact in any order
        for (int64_t c = 0; c < nr; c += 16) top = vmax2(top, vload(chunk(c)));
        const float mx = vmax(top);
        vec tot = vzero();
        for (int64_t c = 0; c < nr; c += 16) {
          const int64_t m = std::min<int64_t>(16, nr - c);
          const vec p = vfirst(vexp_neg(vsub(vload(chunk(c)), vset1(mx))), m);
          tot = vadd(tot, p);
          store(chunk(c), p);
        }
        l[r] = vsum(tot);
        for (int64_t c = in_place; c < nr; c++) row[sn[c]] = sbuf[c];
      }
      // 3. p V: each query-head's sum, the values read in place where a row is whole vectors (64, 128: a
      //    widening pass wrote and reread 4 bytes a value, ~2 MB a layer at 2,048 keys), else widened once
      const T* vb = v.at(kb_, h, 0);
      const int64_t NVT = NV <= 1 ? 1 : NV <= 2 ? 2 : NV <= 4 ? 4 : NV <= 8 ? 8 : 16, DV = NVT * LANES;
      const bool in_place = D == DV;
      if (!in_place) {
        vf.resize((most + 1) * DV);
        for (int64_t j = 0; j <= most; j++)
          for (int64_t d = 0; d < DV; d += LANES)
            store(vf.data() + j * DV + d, d + LANES <= D ? vload(vb + j * v.st + d) : d < D ? vload_tail(vb + j * v.st + d, D - d) : vzero());
      }
      acc.assign(R * DV, 0.f);
      for (int64_t r = 0; r < R; r++) snr[r] = seen.data() + (b * Tq + rt[r]) * S;
      switch (NVT) {
#define GRAFT_PVN(NV_) case NV_: \
        if (in_place) pv<NV_, T>(sc.data(), S16, vb, v.st, snr.data(), rn.data(), rg.data(), R, acc.data()); \
        else pv<NV_, float>(sc.data(), S16, vf.data(), DV, snr.data(), rn.data(), rg.data(), R, acc.data()); break;
        GRAFT_PVN(1) GRAFT_PVN(2) GRAFT_PVN(4) GRAFT_PVN(8) GRAFT_PVN(16)
#undef GRAFT_PVN
      }
      for (int64_t r = 0; r < R; r++)
        for (int64_t d = 0; d < D; d++) outs[r][d] = T(acc[r * DV + d] / l[r]);
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
                      const at::Tensor& mask, const bool* keep, int64_t H, float eps, const T* emb, const T* hn, bool nbr,
                      const float* const* sc, const bool* want) {
  const int64_t B = x.size(0), Tq = x.size(1), Dm = x.size(2), M = B * Tq;
  const int64_t Hkv = kc.size(1), D = kc.size(3), S = mask.size(3), I = wg.size(0);
  const int64_t NQ = H * D, NK = Hkv * D, Din = wq.size(1);         // Din: 2 Dm for an EAGLE-3 head's layer
  std::vector<float> wide;
  // Only the real rows (keep true; every row without keep) are computed: a padding row (a slot that
  // drafts nothing, a pruned tree's empty places, a prefill chunk's tail) costs no weight reads or
  // multiply-adds; it writes zeros to the cache and its output is zeros.
  // A real row whose output nobody reads (want false: a head's prefill and catch-up rows, an extend's rows
  // before the last) only writes its key and value: no q, attention, o_proj nor MLP (its output is zeros).
  std::vector<int64_t> real, used, at;               // at: each used row's place among the real ones
  for (int64_t m = 0; m < M; m++) if (!keep || keep[m]) {
    if (!want || want[m]) { used.push_back(m); at.push_back((int64_t)real.size()); }
    real.push_back(m);
  }
  const int64_t Mr = (int64_t)real.size(), Mu = (int64_t)used.size();
  const bool every = Mu == Mr;
  auto gather = [&](const T* src, int64_t w, const std::vector<int64_t>& rs, std::unique_ptr<T[]>& buf) -> const T* {
    if ((int64_t)rs.size() == M) return src;           // rows rs of src, compacted
    buf = scratch<T>(std::max<int64_t>((int64_t)rs.size(), 1) * w);
    for (size_t i = 0; i < rs.size(); i++) std::memcpy(buf.get() + i * w, src + rs[i] * w, w * sizeof(T));
    return buf.get();
  };
  auto pick = [&](const T* src, int64_t w, std::unique_ptr<T[]>& buf) -> const T* {   // a real-row array's used rows
    if (every) return src;
    buf = scratch<T>(std::max<int64_t>(Mu, 1) * w);
    for (int64_t i = 0; i < Mu; i++) std::memcpy(buf.get() + i * w, src + at[i] * w, w * sizeof(T));
    return buf.get();
  };
  std::unique_ptr<T[]> xg, eg, rg, ag, hq, rs_;
  const T* xp = gather(x.data_ptr<T>(), Dm, real, xg);
  auto h = scratch<T>(std::max<int64_t>(Mr, 1) * Din), qr = scratch<T>(Mu * NQ + 1), kr = scratch<T>(Mr * NK + 1),
       vr = scratch<T>(Mr * NK + 1), x1 = scratch<T>(Mu * Dm + 1), g = scratch<T>(Mu * I + 1), u = scratch<T>(Mu * I + 1);
  // 1. attention's input: norm, q/k/v, the q/k norms (Qwen3), RoPE at each row's position. An EAGLE-3
  //    head's layer (draft.DraftLayer) reads [input_layernorm(emb), hidden_norm(x)] per row, and adds its
  //    attention to x or, with nbr (norm_before_residual), to hidden_norm(x)
  std::unique_ptr<T[]> xn;
  const T* res = xp;                                                  // what the attention adds to
  if (emb) {
    xn = scratch<T>(Mr * Dm + 1);
    auto e = scratch<T>(Mr * Dm + 1);
    rms_norm(gather(emb, Dm, real, eg), n1.data_ptr<T>(), e.get(), Mr, Dm, eps);
    rms_norm(xp, hn, xn.get(), Mr, Dm, eps);
    for (int64_t m = 0; m < Mr; m++) {
      std::memcpy(h.get() + m * Din, e.get() + m * Dm, Dm * sizeof(T));
      std::memcpy(h.get() + m * Din + Dm, xn.get() + m * Dm, Dm * sizeof(T));
    }
    if (nbr) res = xn.get();
  } else {
    rms_norm(xp, n1.data_ptr<T>(), h.get(), Mr, Dm, eps);
  }
  if (Mu) lin(pick(h.get(), Din, hq), Mu, wq, bq, qr.get(), wide, sc[0]);
  lin(h.get(), Mr, wk, bk, kr.get(), wide, sc[1]);
  lin(h.get(), Mr, wv, bv, vr.get(), wide, sc[2]);
  // every row's q, k, v (B, Tq, ...), a padding row's zeros: attention and the cache read them by position
  auto spread = [&](std::unique_ptr<T[]>& src, int64_t w, const std::vector<int64_t>& rs) {
    if ((int64_t)rs.size() == M) return std::move(src);
    auto full = scratch<T>(M * w);
    std::memset((void*)full.get(), 0, M * w * sizeof(T));
    for (size_t i = 0; i < rs.size(); i++) std::memcpy(full.get() + rs[i] * w, src.get() + i * w, w * sizeof(T));
    return full;
  };
  auto q = spread(qr, NQ, used), k = spread(kr, NK, real), v = spread(vr, NK, real);
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
    const bool on = keep ? keep[m] : true;
    for (int64_t hh = 0; hh < Hkv; hh++) {
      T* kd = kp + sb * ks[0] + hh * ks[1] + r * ks[2];
      T* vd = vp + sb * vs[0] + hh * vs[1] + r * vs[2];
      const T* kr_ = k.get() + m * NK + hh * D;
      const T* vr_ = v.get() + m * NK + hh * D;
      if (on) { std::memcpy(kd, kr_, D * sizeof(T)); std::memcpy(vd, vr_, D * sizeof(T)); }
      else { std::memset((void*)kd, 0, D * sizeof(T)); std::memset((void*)vd, 0, D * sizeof(T)); }
    }
  }
  // 3. attention over cache rows 0..S-1 (the kernel above), then o_proj and the residual (used rows; a row
  //    not used, padding or not wanted, attends to nothing)
  auto out = (int64_t)used.size() == M ? at::empty_like(x, at::MemoryFormat::Contiguous)
                                       : at::zeros_like(x, at::MemoryFormat::Contiguous);
  if (!Mu) return out;
  std::unique_ptr<bool[]> on;                          // the used rows (null: all)
  if (Mu < M) {
    on.reset(new bool[M]());
    for (int64_t m : used) on[m] = true;
  }
  auto att = scratch<T>(M * NQ);
  const auto ms = mask.strides();
  attend<T>({q.get(), Tq * NQ, D, NQ}, {kp, ks[0], ks[1], ks[2]}, {vp, vs[0], vs[1], vs[2]}, slots,
            {mask.data_ptr<bool>(), ms[0], 0, ms[2]}, ms[3], {att.get(), Tq * NQ, D, NQ}, B, H, Tq, D, Hkv, S,
            1.f / std::sqrt(float(D)), on.get());
  lin(gather(att.get(), NQ, used, ag), Mu, wo, nullptr, h.get(), wide, sc[3]);    // h: o_proj's output
  add(pick(res, Dm, rs_), h.get(), x1.get(), Mu * Dm);
  // 4. the MLP: norm, SwiGLU, down, the residual
  rms_norm(x1.get(), n2.data_ptr<T>(), h.get(), Mu, Dm, eps);
  lin(h.get(), Mu, wg, nullptr, g.get(), wide, sc[4]);
  lin(h.get(), Mu, wu, nullptr, u.get(), wide, sc[5]);
  swiglu(g.get(), u.get(), Mu * I);
  lin(g.get(), Mu, wd, nullptr, h.get(), wide, sc[6]);
  T* op = out.data_ptr<T>();
  if (Mu == M) {
    add(x1.get(), h.get(), op, M * Dm);
  } else {
    for (int64_t i = 0; i < Mu; i++) add(x1.get() + i * Dm, h.get() + i * Dm, op + used[i] * Dm, Dm);
  }
  return out;
}

at::Tensor block(const at::Tensor& x, const at::Tensor& n1, const at::Tensor& wq, const c10::optional<at::Tensor>& bq,
                 const at::Tensor& wk, const c10::optional<at::Tensor>& bk, const at::Tensor& wv,
                 const c10::optional<at::Tensor>& bv, const at::Tensor& wo, const c10::optional<at::Tensor>& qn,
                 const c10::optional<at::Tensor>& kn, const at::Tensor& n2, const at::Tensor& wg, const at::Tensor& wu,
                 const at::Tensor& wd, const at::Tensor& cos, const at::Tensor& sin, at::Tensor& kc, at::Tensor& vc,
                 const at::Tensor& rows, const c10::optional<at::Tensor>& slots, const at::Tensor& mask,
                 const c10::optional<at::Tensor>& keep, int64_t n_heads, double eps, at::TensorList scales,
                 const c10::optional<at::Tensor>& emb, const c10::optional<at::Tensor>& hn, bool nbr,
                 const c10::optional<at::Tensor>& want) {
  // shapes, dtypes and every index are checked before anything is read or written
  TORCH_CHECK(x.dim() == 3 && x.is_contiguous(), "graft::block: x (B, T, dim), contiguous");
  const int64_t B = x.size(0), Tq = x.size(1), Dm = x.size(2);
  TORCH_CHECK(kc.dim() == 4 && kc.sizes() == vc.sizes() && kc.stride(3) == 1 && vc.stride(3) == 1,
              "graft::block: caches (B, H_kv, rows, D)");
  const int64_t Hkv = kc.size(1), R = kc.size(2), D = kc.size(3), I = wg.size(0);
  TORCH_CHECK(D <= 256 && D % 2 == 0 && n_heads > 0 && n_heads % Hkv == 0, "graft::block: heads");
  for (const at::Tensor* t : std::initializer_list<const at::Tensor*>{&n1, &wq, &wk, &wv, &wo, &n2, &wg, &wu, &wd, &cos, &sin, &kc, &vc})
    TORCH_CHECK(t->device().is_cpu(), "graft::block: CPU tensors");
  for (const at::Tensor* t : std::initializer_list<const at::Tensor*>{&n1, &n2, &cos, &sin, &kc, &vc})
    TORCH_CHECK(t->scalar_type() == x.scalar_type(), "graft::block: one dtype");
  // the seven linears' weights: x's dtype, or every one int8 with its scales (q, k, v, o, gate, up, down)
  TORCH_CHECK(scales.empty() || scales.size() == 7, "graft::block: no scales, or one (N,) for each of the 7 linears");
  at::Tensor sk[7];
  const float* sc[7] = {};
  const at::Tensor* lw[7] = {&wq, &wk, &wv, &wo, &wg, &wu, &wd};
  for (int i = 0; i < 7; i++) {
    TORCH_CHECK(lw[i]->scalar_type() == (scales.empty() ? x.scalar_type() : at::kChar), "graft::block: weights of x's dtype, or int8 with scales");
    if (!scales.empty()) sc[i] = scale_ptr(*lw[i], scales[i], x.scalar_type(), sk[i], "graft::block");
  }
  for (const at::Tensor* t : std::initializer_list<const at::Tensor*>{&n1, &wq, &wk, &wv, &wo, &n2, &wg, &wu, &wd})
    TORCH_CHECK(t->is_contiguous(), "graft::block: contiguous weights");
  const bool draft = emb.has_value() && emb->defined();
  TORCH_CHECK(draft == (hn.has_value() && hn->defined()), "graft::block: emb and hn (a head's layer) both or neither");
  if (draft)
    TORCH_CHECK(emb->sizes() == x.sizes() && emb->is_contiguous() && emb->scalar_type() == x.scalar_type() &&
                hn->numel() == Dm && hn->is_contiguous() && hn->scalar_type() == x.scalar_type(),
                "graft::block: emb (B, T, dim) and hn (dim,) of x's dtype, contiguous");
  const int64_t Din = draft ? 2 * Dm : Dm;
  TORCH_CHECK(n1.numel() == Dm && n2.numel() == Dm && wq.sizes() == at::IntArrayRef({n_heads * D, Din}) &&
              wk.sizes() == at::IntArrayRef({Hkv * D, Din}) && wv.sizes() == wk.sizes() &&
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
  at::Tensor wt;
  const bool* wantp = nullptr;
  if (want.has_value() && want->defined()) {
    wt = want->expand({B, Tq}).to(at::kBool).contiguous();
    wantp = wt.data_ptr<bool>();
  }
  at::Tensor fb[3];
  const float *bq_ = bias_ptr(bq, fb[0]), *bk_ = bias_ptr(bk, fb[1]), *bv_ = bias_ptr(bv, fb[2]);
  TORCH_CHECK((!bq_ || fb[0].numel() == n_heads * D) && (!bk_ || fb[1].numel() == Hkv * D) && (!bv_ || fb[2].numel() == Hkv * D),
              "graft::block: bias shapes");
  switch (x.scalar_type()) {
#define GRAFT_BLOCK(T) block_impl<T>(x, n1, wq, bq_, wk, bk_, wv, bv_, wo, qn, kn, n2, wg, wu, wd, cs, sn, kc, vc, rp, sp, m, keepp, n_heads, \
                                     (float)eps, draft ? emb->data_ptr<T>() : nullptr, draft ? hn->data_ptr<T>() : nullptr, nbr, sc, \
                                     wantp)
    case at::kFloat: return GRAFT_BLOCK(float);
    case at::kBFloat16: return GRAFT_BLOCK(at::BFloat16);
    case at::kHalf: return GRAFT_BLOCK(at::Half);
#undef GRAFT_BLOCK
    default: TORCH_CHECK(false, "graft::block: float32, bfloat16 or float16");
  }
}

// Every decoder layer of a target in one call (model.Transformer's fused route): block() layer after
// layer, weights as per-layer lists, each layer's KV cache written at `rows`. capture: layer indices
// (0..L) whose input, x before that layer (L: after the last), is returned too, in the list's order (the
// EAGLE-3 features). Returns (x after the last layer, the captured tensors).
std::tuple<at::Tensor, std::vector<at::Tensor>> layers(
    const at::Tensor& x, at::TensorList n1, at::TensorList wq, const c10::List<std::optional<at::Tensor>>& bq,
    at::TensorList wk, const c10::List<std::optional<at::Tensor>>& bk, at::TensorList wv,
    const c10::List<std::optional<at::Tensor>>& bv, at::TensorList wo, const c10::List<std::optional<at::Tensor>>& qn,
    const c10::List<std::optional<at::Tensor>>& kn, at::TensorList n2, at::TensorList wg, at::TensorList wu,
    at::TensorList wd, const at::Tensor& cos, const at::Tensor& sin, at::TensorList kc, at::TensorList vc,
    const at::Tensor& rows, const std::optional<at::Tensor>& slots, const at::Tensor& mask,
    const std::optional<at::Tensor>& keep, int64_t n_heads, double eps, at::IntArrayRef capture, at::TensorList scales) {
  const int64_t L = (int64_t)n1.size();
  TORCH_CHECK(scales.empty() || (int64_t)scales.size() == 7 * L, "graft::layers: no scales, or 7 a layer (int8 weights)");
  for (size_t i : {wq.size(), bq.size(), wk.size(), bk.size(), wv.size(), bv.size(), wo.size(), qn.size(), kn.size(),
                   n2.size(), wg.size(), wu.size(), wd.size(), kc.size(), vc.size()})
    TORCH_CHECK((int64_t)i == L, "graft::layers: one entry a layer in every list");
  for (int64_t c : capture) TORCH_CHECK(c >= 0 && c <= L, "graft::layers: capture points in [0, layers]");
  std::vector<at::Tensor> got(capture.size());
  at::Tensor h = x.contiguous();
  for (int64_t i = 0; i <= L; i++) {
    for (size_t c = 0; c < capture.size(); c++) if (capture[c] == i) got[c] = h;
    if (i == L) break;
    at::Tensor kci = kc[i], vci = vc[i];
    h = block(h, n1[i], wq[i], bq.get(i), wk[i], bk.get(i), wv[i], bv.get(i), wo[i], qn.get(i), kn.get(i), n2[i], wg[i],
              wu[i], wd[i], cos, sin, kci, vci, rows, slots, mask, keep, n_heads, eps,
              scales.empty() ? scales : scales.slice(7 * i, 7), std::nullopt, std::nullopt, false, std::nullopt);
  }
  return {h, got};
}

// ------------------------------------------------------------------------------------------ a head's top k

// The k most likely tokens of each row of logits (rows, V) and their log-probabilities: indices (rows, k)
// in descending order of the logit (ties: the lower index first), values float32 logit - logsumexp.
// What draft.Eagle3.top_logprobs computes as log_softmax then topk, in one pass over each row (V floats,
// a running top k) plus one for the sum, without writing the V log-probabilities out.
// The k largest of a row of V values, best first (ties: the lower index first, as argmax; NaN never
// enters): 16 at a time, a chunk looked into only when its largest value could enter. Returns how many
// (min(k, the values that are not NaN)).
template <typename T>
int64_t row_topk(const T* row, int64_t V, int64_t k, float* tv, int64_t* ti) {
  int64_t n = 0;
  float thr = -std::numeric_limits<float>::infinity();    // what a value must beat to enter (once k are in)
  float buf[16];
  for (int64_t j0 = 0; j0 < V; j0 += 16) {
    const int64_t m = std::min<int64_t>(16, V - j0);
    const vec v = m == 16 ? vload(row + j0) : vload_tail(row + j0, m);
    if (n == k && m == 16 && !(vmax(v) > thr)) continue;
    store(buf, v);
    for (int64_t u = 0; u < m; u++) {
      const float f = buf[u];
      if (!(f == f) || (n == k && !(f > thr))) continue;
      int64_t at = n < k ? n++ : k - 1;
      while (at > 0 && f > tv[at - 1]) { tv[at] = tv[at - 1]; ti[at] = ti[at - 1]; at--; }
      tv[at] = f;
      ti[at] = j0 + u;
      if (n == k) thr = tv[k - 1];
    }
  }
  return n;
}

template <typename T>
void top_rows(const T* x, int64_t rows, int64_t V, int64_t k, float* val, int64_t* idx, bool logprobs) {
  at::parallel_for(0, rows, 1, [&](int64_t r0, int64_t r1) {
    std::vector<float> tv(k);
    std::vector<int64_t> ti(k);
    for (int64_t r = r0; r < r1; r++) {
      const T* row = x + r * V;
      const int64_t n = row_topk(row, V, k, tv.data(), ti.data());
      float lse = 0.f;
      if (logprobs && n) {                                  // log-probabilities: minus logsumexp
        const float mx = tv[0];                             // (exp(x - max) <= 1)
        vec tot = vzero();
        for (int64_t j0 = 0; j0 < V; j0 += 16) {
          const int64_t m = std::min<int64_t>(16, V - j0);
          const vec v = m == 16 ? vload(row + j0) : vload_tail(row + j0, m);
          tot = vadd(tot, vfirst(vexp_neg(vsub(v, vset1(mx))), m));
        }
        lse = mx + std::log(vsum(tot));
      }
      for (int64_t i = 0; i < k; i++) {
        val[r * k + i] = i < n ? tv[i] - lse : -std::numeric_limits<float>::infinity();
        idx[r * k + i] = i < n ? ti[i] : 0;
      }
    }
  });
}

std::tuple<at::Tensor, at::Tensor> top_impl(const at::Tensor& logits, int64_t k, bool logprobs) {
  TORCH_CHECK(logits.device().is_cpu() && logits.dim() >= 1 && k >= 1 && k <= logits.size(-1),
              "graft::top: CPU values (..., V), 1 <= k <= V");
  auto x = logits.contiguous();
  const int64_t V = x.size(-1), rows = x.numel() / std::max<int64_t>(V, 1);
  auto sizes = x.sizes().vec();
  sizes.back() = k;
  auto val = at::empty(sizes, x.options().dtype(at::kFloat));
  auto idx = at::empty(sizes, x.options().dtype(at::kLong));
  switch (x.scalar_type()) {
    case at::kFloat: top_rows(x.data_ptr<float>(), rows, V, k, val.data_ptr<float>(), idx.data_ptr<int64_t>(), logprobs); break;
    case at::kBFloat16: top_rows(x.data_ptr<at::BFloat16>(), rows, V, k, val.data_ptr<float>(), idx.data_ptr<int64_t>(), logprobs); break;
    case at::kHalf: top_rows(x.data_ptr<at::Half>(), rows, V, k, val.data_ptr<float>(), idx.data_ptr<int64_t>(), logprobs); break;
    default: TORCH_CHECK(false, "graft::top: float32, bfloat16 or float16");
  }
  return {val, idx};
}

std::tuple<at::Tensor, at::Tensor> top_logprobs(const at::Tensor& logits, int64_t k) { return top_impl(logits, k, true); }

// The k largest of each row (..., V) and their indices, best first (ties: the lower index: k = 1 is argmax);
// values float32. What the continuation matrix learns (graft.update) and greedy decoding chooses.
std::tuple<at::Tensor, at::Tensor> topk_rows(const at::Tensor& x, int64_t k) { return top_impl(x, k, false); }

// Sampling's draw (verify.choose): per row of x = logits / temperature (rows, V), argmax over v of x[v] + g[v],
// g = -log(-log(u)), u = ((h >> 8) + 0.5) / 2^24, h = hash32(h_pos ^ th[v]), h_pos the row's position hash
// (verify.py's position_noise), ties to the lower v, as torch's argmax. x is the float32
// quotient warp computes; the hashes and u are integer and exact float64 steps in C++; the logs are torch's
// own (at::log_, whose value for an element does not depend on where it sits in the buffer:
// tests/test_kernels.py), so every g is the same float64 bits; the sum and the comparison are IEEE float64.
// Only tokens that can win get their noise: u's 2^24 values bound g to [G_MIN, G_MAX] = [-2.85, 17.33], so a
// token whose x is below s - G_MAX, s the x + g of any token, can never reach the best sum; s: the best sum
// of the row's 16 largest x, which is nearly always the best (on SmolLM2 at temperature 0.8, 0.01-20% of a
// row's vocabulary stays: a draw costs two passes over the logits and its candidates' logs).
inline uint64_t hash32(uint64_t x) {             // verify._hash32 (its int64 arithmetic never overflows)
  x &= 0xFFFFFFFFull;
  x = ((x ^ (x >> 16)) * 0x45D9F3Bull) & 0xFFFFFFFFull;
  x = ((x ^ (x >> 16)) * 0x45D9F3Bull) & 0xFFFFFFFFull;
  return x ^ (x >> 16);
}

inline uint64_t position_hash(int64_t seed, int64_t pos) {   // verify.position_noise's key (int64 products wrap alike)
  const uint64_t base = hash32((uint64_t)seed * 0x2545F491ull + 0x1234567ull);
  const uint64_t h = hash32(base ^ (((uint64_t)pos * 0x27D4EB2Dull) & 0xFFFFFFFFull));
  const int64_t hi = seed >> 32;
  return hi == 0 ? h : hash32(h ^ hash32((uint64_t)hi * 0x2F1E9B7ull + 0x5A5A5A5ull));
}

inline double gumbel_u(uint64_t h_pos, int64_t th) { return ((double)(hash32(h_pos ^ (uint64_t)th) >> 8) + 0.5) / 16777216.0; }

template <typename T>
void gumbel_rows(const T* xp, int64_t rows, int64_t V, int64_t N, const float* temp, const bool* real,
                 const uint64_t* hpos, const int64_t* tp, int64_t* op) {
  const double g_max = -std::log(-std::log(1.0 - 0.5 / 16777216.0)), g_min = -std::log(-std::log(0.5 / 16777216.0));
  const int64_t V16 = V / LANES * LANES;
  std::vector<std::vector<int32_t>> cand(rows);   // per row, the tokens that can win, ascending
  // 1. per row: its best x (a NaN decides at once: torch's argmax picks the first; so does an infinite best:
  // +inf, the first +inf, every other sum finite; -inf, token 0, every sum -inf), then its candidates
  at::parallel_for(0, rows, 1, [&](int64_t r0, int64_t r1) {
    float tv[16];
    int64_t ti[16];
    for (int64_t r = r0; r < r1; r++) {
      op[r] = 0;
      if (real && !real[r]) continue;             // (a padding row: no candidates, 0)
      const T* xr = xp + r * V;
      const float t = temp ? temp[r / N] : 1.f;
      const vec tq = vset1(t);
      vec mx = vset1(-std::numeric_limits<float>::infinity());
      uint32_t nan = 0;
      for (int64_t v = 0; v < V16; v += LANES) {
        const vec a = vdiv(vload(xr + v), tq);
        nan |= vmask_nan(a);
        mx = vmax2(a, mx);                        // (a NaN lane keeps mx: counted in nan)
      }
      float m16[LANES], best = -std::numeric_limits<float>::infinity();
      store(m16, mx);
      for (int64_t i = 0; i < LANES; i++) best = std::max(best, m16[i]);
      for (int64_t v = V16; v < V; v++) nan |= std::isnan(float(xr[v]) / t), best = std::max(best, float(xr[v]) / t);
      if (nan || std::isinf(best)) {
        for (int64_t v = 0; v < V; v++)
          if (std::isnan(float(xr[v]) / t) || (!nan && float(xr[v]) / t == best)) { op[r] = v; break; }
        continue;
      }
      // the bound s: the best sum of the 16 largest (their noise by std::log: a bound with a margin for
      // float64 rounding and std::log's ulps, never a result); the candidates: x >= s - G_MAX
      const int64_t n = row_topk(xr, V, std::min<int64_t>(16, V), tv, ti);     // (x's order: temperature > 0)
      double s = (double)best + g_min;
      for (int64_t i = 0; i < n; i++) s = std::max(s, (double)(tv[i] / t) - std::log(-std::log(gumbel_u(hpos[r], tp[ti[i]]))));
      const float cut = std::nextafter((float)(s - g_max - 1e-6 - 1e-12 * std::fabs(s)), -std::numeric_limits<float>::infinity());
      const vec cv = vset1(cut);                  // (in float32, rounded down: a few more, never fewer)
      auto& c = cand[r];
      for (int64_t v = 0; v < V16; v += LANES)
        for (uint32_t m = vmask_ge(vdiv(vload(xr + v), tq), cv); m; m &= m - 1) c.push_back((int32_t)(v + __builtin_ctz(m)));
      for (int64_t v = V16; v < V; v++) if (float(xr[v]) / t >= cut) c.push_back((int32_t)v);
    }
  });
  // 2. every candidate's u in one float64 buffer (rows one after another, padded to whole vectors), its logs
  std::vector<int64_t> off(rows + 1, 0);
  for (int64_t r = 0; r < rows; r++) off[r + 1] = off[r] + (int64_t)cand[r].size();
  auto g = at::full({std::max<int64_t>((off[rows] + 63) / 64 * 64, 64)}, 0.5, at::TensorOptions().dtype(at::kDouble));
  double* gp = g.data_ptr<double>();
  at::parallel_for(0, rows, 1, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; r++)
      for (size_t i = 0; i < cand[r].size(); i++) gp[off[r] + i] = gumbel_u(hpos[r], tp[cand[r][i]]);
  });
  at::log_(g);                                    // -log(-log(u)), as torch computes it
  g.neg_();
  at::log_(g);
  // 3. per row, the best x + g among its candidates (ascending: a tie keeps the lower token)
  at::parallel_for(0, rows, 1, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; r++) {
      const T* xr = xp + r * V;
      const float t = temp ? temp[r / N] : 1.f;
      const double* lr = gp + off[r];
      double best = 0.0;
      int64_t arg = -1;
      for (size_t i = 0; i < cand[r].size(); i++) {
        const double sum = (double)(float(xr[cand[r][i]]) / t) + -lr[i];    // x + g, g = -log(-log u)
        if (arg < 0 || sum > best) best = sum, arg = cand[r][i];
      }
      if (arg >= 0) op[r] = arg;
    }
  });
}

// logits (B, N, V) float32, bfloat16 or float16; seed (B,), positions (B, N) int64; th (V,) int64; temperature
// (B,) float32 > 0 or None (then logits are float32, already warped); real (B, N) bool or None: the rows
// drawn (another's result: 0). Returns (B, N) int64.
at::Tensor gumbel_argmax(const at::Tensor& logits, const at::Tensor& seed, const at::Tensor& positions, const at::Tensor& th,
                         const c10::optional<at::Tensor>& temperature, const c10::optional<at::Tensor>& real) {
  const bool warm = temperature.has_value() && temperature->defined();
  TORCH_CHECK(logits.device().is_cpu() && logits.dim() == 3 && (logits.scalar_type() == at::kFloat || (warm &&
              (logits.scalar_type() == at::kBFloat16 || logits.scalar_type() == at::kHalf))),
              "graft::gumbel_argmax: logits (B, N, V) float32 (bfloat16, float16 with a temperature)");
  const int64_t B = logits.size(0), N = logits.size(1), V = logits.size(2);
  TORCH_CHECK(th.scalar_type() == at::kLong && th.numel() == V && seed.scalar_type() == at::kLong && seed.numel() == B &&
              positions.scalar_type() == at::kLong && positions.numel() == B * N,
              "graft::gumbel_argmax: token hashes (V,), seeds (B,) and positions (B, N) int64");
  auto x = logits.contiguous();
  auto sc = seed.contiguous(), pc = positions.contiguous(), thc = th.contiguous();
  at::Tensor tc;
  if (warm) {
    tc = temperature->to(at::kFloat).contiguous();
    TORCH_CHECK(tc.numel() == B, "graft::gumbel_argmax: temperatures (B,)");
    for (int64_t b = 0; b < B; b++)
      TORCH_CHECK(tc.data_ptr<float>()[b] > 0 && std::isfinite(tc.data_ptr<float>()[b]), "graft::gumbel_argmax: temperatures > 0");
  }
  std::vector<uint64_t> hpos(B * N);
  for (int64_t i = 0; i < B * N; i++) hpos[i] = position_hash(sc.data_ptr<int64_t>()[i / N], pc.data_ptr<int64_t>()[i]);
  at::Tensor rc;
  if (real.has_value() && real->defined()) {
    TORCH_CHECK(real->scalar_type() == at::kBool && real->numel() == B * N, "graft::gumbel_argmax: real rows (B, N) bool");
    rc = real->contiguous();
  }
  auto out = at::empty({B, N}, logits.options().dtype(at::kLong));
  const float* tp_ = warm ? tc.data_ptr<float>() : nullptr;
  const bool* rp = rc.defined() ? rc.data_ptr<bool>() : nullptr;
  switch (x.scalar_type()) {
    case at::kFloat: gumbel_rows(x.data_ptr<float>(), B * N, V, N, tp_, rp, hpos.data(), thc.data_ptr<int64_t>(), out.data_ptr<int64_t>()); break;
    case at::kBFloat16: gumbel_rows(x.data_ptr<at::BFloat16>(), B * N, V, N, tp_, rp, hpos.data(), thc.data_ptr<int64_t>(), out.data_ptr<int64_t>()); break;
    default: gumbel_rows(x.data_ptr<at::Half>(), B * N, V, N, tp_, rp, hpos.data(), thc.data_ptr<int64_t>(), out.data_ptr<int64_t>()); break;
  }
  return out;
}

// A plain round's learn (graft.plain_learn, one node a request) in one call: ~12 small torch ops cost a
// plain step ~0.2 ms on a CPU (each one's dispatch runs cold after the weights have streamed through the
// caches), 1-2% of a step. For every request b: its matrix row at its root (an empty slot's: the spare row
// V) takes the top-k ids of logits[b] (topk_rows's) and is marked written; its context takes nxt[b] at
// column clen (an empty slot's: the spare last column) and clen grows by active; its pending rows take
// feats[b] and nxt[b] at row pend_n, which grows by active. Any group left out (undefined) is skipped.
void plain_learn(const at::Tensor& logits, const at::Tensor& tokens, const at::Tensor& valid, const at::Tensor& nxt,
                 const at::Tensor& active, const c10::optional<at::Tensor>& feats, const c10::optional<at::Tensor>& M,
                 const c10::optional<at::Tensor>& written, const c10::optional<at::Tensor>& ctx,
                 const c10::optional<at::Tensor>& clen, const c10::optional<at::Tensor>& pend_feats,
                 const c10::optional<at::Tensor>& pend_ids, const c10::optional<at::Tensor>& pend_n) {
  const int64_t B = tokens.size(0);
  auto on = [](const c10::optional<at::Tensor>& t) { return t.has_value() && t->defined(); };
  auto longs = [&](const at::Tensor& t, const char* what) {
    TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kLong && t.dim() == 1 && t.size(0) == B && t.is_contiguous(),
                "graft::plain_learn: ", what, " (B,) int64, contiguous");
    return t.data_ptr<int64_t>();
  };
  const int64_t *tok = longs(tokens, "tokens"), *nx = longs(nxt, "nxt"), *act = longs(active, "active");
  TORCH_CHECK(valid.scalar_type() == at::kBool && valid.numel() == B && valid.is_contiguous(), "graft::plain_learn: valid (B,) bool");
  const bool* ok = valid.data_ptr<bool>();
  if (on(M)) {
    TORCH_CHECK(on(written) && M->dim() == 3 && M->size(0) == B && M->scalar_type() == at::kInt && M->is_contiguous() &&
                written->scalar_type() == at::kBool && written->is_contiguous() &&
                written->sizes() == at::IntArrayRef({B, M->size(1)}) && logits.dim() == 2 && logits.size(0) == B,
                "graft::plain_learn: M (B, V + 1, k) int32 and written (B, V + 1) bool, logits (B, V)");
    const int64_t R = M->size(1), k = M->size(2);
    auto top = std::get<1>(top_impl(logits, k, false));                           // (B, k)
    const int64_t* ti = top.data_ptr<int64_t>();
    int32_t* mp = M->data_ptr<int32_t>();
    bool* wp = written->data_ptr<bool>();
    for (int64_t b = 0; b < B; b++) {
      const int64_t row = ok[b] ? tok[b] : R - 1;
      TORCH_CHECK(row >= 0 && row < R, "graft::plain_learn: a token outside the matrix");
      for (int64_t j = 0; j < k; j++) mp[(b * R + row) * k + j] = (int32_t)ti[b * k + j];
      wp[b * R + row] = true;
    }
  }
  if (on(ctx)) {
    TORCH_CHECK(on(clen) && ctx->dim() == 2 && ctx->size(0) == B && ctx->scalar_type() == at::kLong && ctx->is_contiguous(),
                "graft::plain_learn: ctx (B, S) int64 and clen");
    int64_t* cl = longs(*clen, "clen");
    int64_t* cp = ctx->data_ptr<int64_t>();
    const int64_t S = ctx->size(1);
    for (int64_t b = 0; b < B; b++) {
      cp[b * S + (act[b] > 0 ? std::min(cl[b], S - 1) : S - 1)] = nx[b];
      cl[b] += act[b];
    }
  }
  if (on(pend_feats)) {
    const at::Tensor& pf = *pend_feats;
    TORCH_CHECK(on(feats) && on(pend_n) && pf.dim() == 3 && pf.size(0) == B && pf.is_contiguous() && feats->is_contiguous() &&
                feats->scalar_type() == pf.scalar_type() && feats->numel() == B * pf.size(2),
                "graft::plain_learn: pend_feats (B, P, F) and feats (B, F) of one dtype, contiguous");
    int64_t* pn = longs(*pend_n, "pend_n");
    const int64_t P = pf.size(1), F = pf.size(2), w = pf.element_size();
    if (on(pend_ids))
      TORCH_CHECK(pend_ids->sizes() == at::IntArrayRef({B, P}) && pend_ids->scalar_type() == at::kLong && pend_ids->is_contiguous(),
                  "graft::plain_learn: pend_ids (B, P) int64, contiguous");
    int64_t* pi = on(pend_ids) ? pend_ids->data_ptr<int64_t>() : nullptr;
    char* dst = (char*)pf.data_ptr();
    const char* src = (const char*)feats->data_ptr();
    for (int64_t b = 0; b < B; b++) {
      TORCH_CHECK(pn[b] >= 0 && pn[b] < P, "graft::plain_learn: pending rows full");
      std::memcpy(dst + ((b * P + pn[b]) * F) * w, src + b * F * w, F * w);
      if (pi) pi[b * P + pn[b]] = nx[b];
      pn[b] += act[b];
    }
  }
}

// A head's k best tokens after each hidden state h (..., H), in one call: its final norm (weight nw,
// eps), its lm_head (W (V, H)) and top_logprobs, what draft.Eagle3.top_logprobs computes in torch ops.
std::tuple<at::Tensor, at::Tensor> norm_top_logprobs(const at::Tensor& h, const at::Tensor& nw, double eps,
                                                     const at::Tensor& w, int64_t k) {
  TORCH_CHECK(h.device().is_cpu() && h.scalar_type() == w.scalar_type() && nw.scalar_type() == h.scalar_type() &&
              w.dim() == 2 && h.size(-1) == w.size(1) && nw.numel() == w.size(1) && w.is_contiguous() && nw.is_contiguous(),
              "graft::norm_top_logprobs: h (..., H), norm weight (H,), W (V, H) of one dtype");
  const int64_t H = w.size(1), V = w.size(0);
  auto x = h.reshape({-1, H}).contiguous();
  const int64_t M = x.size(0);
  auto sizes = h.sizes().vec();
  sizes.back() = V;
  auto logits = at::empty({M, V}, h.options());
  std::vector<float> wide;
  switch (h.scalar_type()) {
#define GRAFT_HEAD(T) { auto n = scratch<T>(M * H + 1); rms_norm(x.data_ptr<T>(), nw.data_ptr<T>(), n.get(), M, H, (float)eps); \
                        lin(n.get(), M, w, nullptr, logits.data_ptr<T>(), wide); break; }
    case at::kFloat: GRAFT_HEAD(float)
    case at::kBFloat16: GRAFT_HEAD(at::BFloat16)
    case at::kHalf: GRAFT_HEAD(at::Half)
#undef GRAFT_HEAD
    default: TORCH_CHECK(false, "graft::norm_top_logprobs: float32, bfloat16 or float16");
  }
  return top_impl(logits.view(sizes), k, true);
}

// ------------------------------------------------------------------------------------------ hybrid trees

// graft.graft_trees with a retrieval tree, one request at a time, in plain loops (the Python version is
// ~20 small torch ops per template level, which on a CPU cost far more than the merge itself): the same
// result, element for element (tests/test_graft.py checks both). Inputs as graft_trees documents: d_tok,
// d_par, kept (B, n); r_tok, r_score (B, R); the template's parents and depths (R,) (nodes in best-first
// order, parents first; parent -1: the anchor, -2: the root) and ranks (< 0: a context node); anchor,
// free (B,). Returns tokens, parents, valid, retrieved (B, n).
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> graft_trees(
    const at::Tensor& d_tok_, const at::Tensor& d_par_, const at::Tensor& kept_, const at::Tensor& r_tok_,
    const at::Tensor& r_score_, const at::Tensor& t_par_, const at::Tensor& t_depth_, const at::Tensor& t_rank_,
    const at::Tensor& anchor_, const at::Tensor& free_) {
  const int64_t B = d_tok_.size(0), n = d_tok_.size(1), R = r_tok_.size(1);
  TORCH_CHECK(d_tok_.dim() == 2 && d_par_.sizes() == d_tok_.sizes() && kept_.sizes() == d_tok_.sizes() &&
              r_tok_.dim() == 2 && r_tok_.size(0) == B && r_score_.sizes() == r_tok_.sizes() && t_par_.numel() == R &&
              t_depth_.numel() == R && t_rank_.numel() == R && anchor_.numel() == B && free_.numel() == B,
              "graft::graft_trees: shapes");
  auto L = [](const at::Tensor& t) { return t.to(at::kLong).contiguous(); };
  const auto d_tok = L(d_tok_), d_par = L(d_par_), r_tok = L(r_tok_), t_par = L(t_par_), t_depth = L(t_depth_),
             t_rank = L(t_rank_), anchor = L(anchor_), freec = L(free_);
  const auto kept = kept_.to(at::kBool).contiguous();
  const auto r_score = r_score_.to(at::kFloat).contiguous();
  const int64_t* tp = t_par.data_ptr<int64_t>();
  const int64_t* td = t_depth.data_ptr<int64_t>();
  for (int64_t j = 0; j < R; j++) TORCH_CHECK(tp[j] < j && tp[j] >= -2 && td[j] >= 1, "graft::graft_trees: a template's parents come first");
  auto o_tok = at::zeros({B, n}, d_tok.options()), o_par = at::full({B, n}, -1, d_tok.options());
  auto o_val = at::zeros({B, n}, kept.options()), o_src = at::zeros({B, n}, d_tok.options());
  const float NEG = -std::numeric_limits<float>::infinity(), POS = std::numeric_limits<float>::infinity();
  int64_t depth_max = 0;
  for (int64_t j = 0; j < R; j++) depth_max = std::max(depth_max, td[j]);
  at::parallel_for(0, B, 1, [&](int64_t b0, int64_t b1) {
    std::vector<int64_t> kpos(n), hid(R), ph(R), into(R), order(R), slot(R);
    std::vector<float> eff(R), lifted(R);
    std::vector<char> merged(R), hit(R), take(R), isnew(R);
    for (int64_t b = b0; b < b1; b++) {
      const int64_t* dt = d_tok.data_ptr<int64_t>() + b * n;
      const int64_t* dp = d_par.data_ptr<int64_t>() + b * n;
      const bool* kp = kept.data_ptr<bool>() + b * n;
      const int64_t* rt = r_tok.data_ptr<int64_t>() + b * R;
      const float* sc = r_score.data_ptr<float>() + b * R;
      const int64_t an = anchor.data_ptr<int64_t>()[b], fr = freec.data_ptr<int64_t>()[b];
      int64_t nk = 0;
      for (int64_t i = 0; i < n; i++) kpos[i] = kp[i] ? nk++ : nk - 1;    // kept.cumsum(1) - 1
      std::fill(hid.begin(), hid.end(), 0);
      std::fill(merged.begin(), merged.end(), 0);
      std::fill(eff.begin(), eff.end(), NEG);
      auto up = [&](int64_t par) { return par == -1 ? an : par < -1 ? -1 : hid[par]; };
      for (int64_t d = 1; d <= depth_max; d++) {         // level by level: parents are resolved
        for (int64_t j = 0; j < R; j++) if (td[j] == d) ph[j] = up(tp[j]);
        for (int64_t j = 0; j < R; j++) {
          if (td[j] != d) continue;
          const bool off = sc[j] > NEG;
          int64_t first_draft = -1;                     // the first kept draft node with its parent and token
          for (int64_t i = 0; i < n && first_draft < 0; i++) if (kp[i] && dp[i] == ph[j] && dt[i] == rt[j]) first_draft = i;
          hit[j] = first_draft >= 0 && off;
          into[j] = j;
          hid[j] = hit[j] ? first_draft : 0;
        }
        for (int64_t j = 0; j < R; j++) {                // an earlier sibling of this level with its token
          if (td[j] != d) continue;
          const bool off = sc[j] > NEG;
          int64_t twin = -1;
          for (int64_t u = 0; u < j && twin < 0; u++)
            if (td[u] == d && ph[u] == ph[j] && rt[u] == rt[j] && sc[u] > NEG && !hit[u]) twin = u;
          const bool dup = twin >= 0 && off && !hit[j];
          merged[j] = hit[j] || dup;
          if (dup) into[j] = twin;
          if (!hit[j]) hid[j] = n + into[j];
          lifted[j] = sc[j];
        }
        for (int64_t j = 0; j < R; j++)                  // the node kept takes the better score
          if (td[j] == d && into[j] != j) lifted[into[j]] = std::max(lifted[into[j]], sc[j]);
        for (int64_t j = 0; j < R; j++) {                // capped by the parent's
          if (td[j] != d) continue;
          const float cap = ph[j] >= n ? eff[ph[j] - n] : POS;
          eff[j] = std::min(lifted[j], cap);
        }
      }
      // the free best unmerged nodes by score (ties: template order) take the slots after the kept ones
      for (int64_t j = 0; j < R; j++) { isnew[j] = !merged[j] && eff[j] > NEG; order[j] = j; }
      std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t c) {
        const float ka = isnew[a] ? eff[a] : NEG, kc = isnew[c] ? eff[c] : NEG;
        return ka > kc;
      });
      int64_t seen_new = 0;
      for (int64_t x = 0; x < R; x++) {
        const int64_t j = order[x];
        seen_new += isnew[j];
        take[j] = isnew[j] && seen_new <= fr;
        slot[j] = nk + seen_new - 1;
      }
      int64_t* ot = o_tok.data_ptr<int64_t>() + b * n;
      int64_t* op = o_par.data_ptr<int64_t>() + b * n;
      bool* ov = o_val.data_ptr<bool>() + b * n;
      int64_t* os = o_src.data_ptr<int64_t>() + b * n;
      for (int64_t i = 0; i < n; i++)                    // the kept draft nodes, compacted in order
        if (kp[i]) {
          ot[kpos[i]] = dt[i];
          op[kpos[i]] = dp[i] >= 0 ? kpos[dp[i]] : -1;
          ov[kpos[i]] = true;
          os[kpos[i]] = 0;
        }
      for (int64_t j = 0; j < R; j++) {                  // then the retrieved ones taken
        if (!take[j] || slot[j] >= n) continue;
        const int64_t p = up(tp[j]);
        ot[slot[j]] = rt[j];
        op[slot[j]] = p >= n ? slot[p - n] : p >= 0 ? kpos[std::min(p, n - 1)] : -1;
        ov[slot[j]] = true;
        os[slot[j]] = t_rank.data_ptr<int64_t>()[j] < 0 ? 2 : 1;
      }
    }
  });
  return {o_tok, o_par, o_val, o_src};
}

// ------------------------------------------------------------------------------------------ retrieval and learning
//
// A drafting round's small steps (graft.py), each ~10-20 small torch ops that cost a CPU more than their
// work (~0.3-0.6 ms a round each, 1-3% of a token), as plain loops over each request: the same results,
// element for element (tests/test_graft.py runs both versions).

// graft.retrieve: node j of the template takes M[b, token of its parent, ranks[j]] (parent -1: under[b]).
// M (B, R, k) int32; under (B,); parents, ranks (n,) (parents first). Returns (B, n) int64.
at::Tensor retrieve(const at::Tensor& M, const at::Tensor& under_, const at::Tensor& parents_, const at::Tensor& ranks_) {
  TORCH_CHECK(M.device().is_cpu() && M.dim() == 3 && M.scalar_type() == at::kInt && M.is_contiguous() && under_.dim() == 1 &&
              under_.size(0) == M.size(0) && parents_.dim() == 1 && ranks_.sizes() == parents_.sizes(),
              "graft::retrieve: M (B, R, k) int32, under (B,), parents and ranks (n,)");
  const int64_t B = M.size(0), R = M.size(1), k = M.size(2), n = parents_.size(0);
  auto under = under_.to(at::kLong).contiguous(), par = parents_.to(at::kLong).contiguous(), rank = ranks_.to(at::kLong).contiguous();
  const int64_t *u = under.data_ptr<int64_t>(), *tp = par.data_ptr<int64_t>(), *tr = rank.data_ptr<int64_t>();
  for (int64_t j = 0; j < n; j++)
    TORCH_CHECK(tp[j] >= -1 && tp[j] < j && tr[j] >= 0 && tr[j] < k, "graft::retrieve: a template's parents come first, ranks < k");
  auto out = at::empty({B, n}, under.options());
  int64_t* o = out.data_ptr<int64_t>();
  const int32_t* mp = M.data_ptr<int32_t>();
  for (int64_t b = 0; b < B; b++)
    for (int64_t j = 0; j < n; j++) {
      const int64_t t = tp[j] < 0 ? u[b] : o[b * n + tp[j]];
      TORCH_CHECK(t >= 0 && t < R, "graft::retrieve: a token outside the matrix");
      o[b * n + j] = mp[(b * R + t) * k + tr[j]];
    }
  return out;
}

// graft.context_match: each request's longest match of its last m <= G tokens earlier in its context
// (ctx (B, S), the first clen (B,) real; longest first, then newest), and the T tokens after it.
// Returns (tokens (B, T) int64, real (B, T) bool, m (B,) int64), what the torch version returns, the
// tokens after no match included (a match ending at S - 1).
std::tuple<at::Tensor, at::Tensor, at::Tensor> context_match(const at::Tensor& ctx_, const at::Tensor& clen_, int64_t G, int64_t T) {
  TORCH_CHECK(ctx_.device().is_cpu() && ctx_.dim() == 2 && ctx_.size(1) >= 1 && clen_.dim() == 1 && clen_.size(0) == ctx_.size(0) &&
              G >= 0 && T >= 0, "graft::context_match: ctx (B, S), clen (B,)");
  const auto ctx = ctx_.to(at::kLong).contiguous(), clen = clen_.to(at::kLong).contiguous();
  const int64_t B = ctx.size(0), S = ctx.size(1);
  auto tok = at::empty({B, T}, ctx.options()), m = at::empty({B}, ctx.options());
  auto real = at::empty({B, T}, ctx.options().dtype(at::kBool));
  const int64_t *c = ctx.data_ptr<int64_t>(), *cl = clen.data_ptr<int64_t>();
  int64_t *ot = tok.data_ptr<int64_t>(), *om = m.data_ptr<int64_t>();
  bool* orl = real.data_ptr<bool>();
  for (int64_t b = 0; b < B; b++) {
    const int64_t* row = c + b * S;
    const int64_t L = cl[b];
    std::vector<int64_t> tail(G);
    for (int64_t i = 0; i < G; i++) tail[i] = row[std::min(std::max<int64_t>(L - 1 - i, 0), S - 1)];
    int64_t best = S - 1, run_best = 0;               // no match: the torch version's argmax, at S - 1
    for (int64_t s = std::min(L - 1, S) - 1; s >= 0; s--) {    // earlier ends only, newest first
      int64_t r = 0;
      while (r < G && L - 1 - r >= 0 && s - r >= 0 && row[s - r] == tail[r]) r++;
      if (r > run_best) run_best = r, best = s;
    }
    om[b] = run_best;
    for (int64_t t = 0; t < T; t++) {
      const int64_t pos = best + 1 + t;
      ot[b * T + t] = row[std::min(pos, S - 1)];
      orl[b * T + t] = pos < L && run_best > 0;
    }
  }
  return {tok, real, m};
}

// graft.learn's writes for a drafting round, in one call. For every request b: its matrix (M (B, R, k)
// int32, written (B, R)) learns the top-k ids of every real node's logits (logits (B, N, V); tokens,
// valid (B, N)) at the node's token, one write per distinct token: the accepted path's nodes (path
// (B, P), its first A[b] + 1) win, then the later node; padding and the losers write the spare row R - 1,
// in update's order (by token, then priority). Its context (ctx (B, S), clen (B,)) takes the accepted
// tokens and the bonus (nxt: the token after each path node), (A + 1) * active of them, the rest on the
// spare last column; its pending rows take feats (B, P, F) and nxt at rows 0..P-1, pend_n = (A + 1) *
// active. A group left out (undefined) is skipped.
void tree_learn(const at::Tensor& logits, const at::Tensor& tokens_, const at::Tensor& valid_, const at::Tensor& path_,
                const at::Tensor& A_, const at::Tensor& bonus_, const at::Tensor& active_, const c10::optional<at::Tensor>& feats_,
                const c10::optional<at::Tensor>& M, const c10::optional<at::Tensor>& written, const c10::optional<at::Tensor>& ctx,
                const c10::optional<at::Tensor>& clen, const c10::optional<at::Tensor>& pend_feats,
                const c10::optional<at::Tensor>& pend_ids, const c10::optional<at::Tensor>& pend_n) {
  auto on = [](const c10::optional<at::Tensor>& t) { return t.has_value() && t->defined(); };
  TORCH_CHECK(tokens_.device().is_cpu() && tokens_.dim() == 2 && valid_.sizes() == tokens_.sizes(),
              "graft::tree_learn: tokens and valid (B, N)");
  const auto tokens = tokens_.to(at::kLong).contiguous(), valid = valid_.to(at::kBool).contiguous();
  const auto path = path_.to(at::kLong).contiguous(), A = A_.to(at::kLong).contiguous();
  const auto bonus = bonus_.to(at::kLong).contiguous(), active = active_.to(at::kLong).contiguous();
  const c10::optional<at::Tensor> feats = on(feats_) ? c10::optional<at::Tensor>(feats_->contiguous()) : c10::nullopt;
  const int64_t B = tokens.size(0), N = tokens.size(1);
  auto longs = [&](const at::Tensor& t, const char* what) {
    TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kLong && t.dim() == 1 && t.size(0) == B && t.is_contiguous(),
                "graft::tree_learn: ", what, " (B,) int64, contiguous");
    return t.data_ptr<int64_t>();
  };
  const int64_t *a = longs(A, "A"), *bo = longs(bonus, "bonus"), *act = longs(active, "active");
  TORCH_CHECK(path.dim() == 2 && path.size(0) == B, "graft::tree_learn: path (B, P)");
  const int64_t P = path.size(1);
  const int64_t *tok = tokens.data_ptr<int64_t>(), *pa = path.data_ptr<int64_t>();
  const bool* ok = valid.data_ptr<bool>();
  for (int64_t i = 0; i < B * P; i++) TORCH_CHECK(pa[i] >= 0 && pa[i] < N, "graft::tree_learn: a path node outside the tree");
  for (int64_t b = 0; b < B; b++) TORCH_CHECK(a[b] >= 0 && a[b] < std::max<int64_t>(P, 1), "graft::tree_learn: A outside the path");
  if (on(M))                                           // (every index checked before anything is written)
    for (int64_t i = 0; i < B * N; i++)
      TORCH_CHECK(!ok[i] || (tok[i] >= 0 && tok[i] < M->size(1)), "graft::tree_learn: a token outside the matrix");
  if (on(clen))
    for (int64_t b = 0; b < B; b++) TORCH_CHECK(longs(*clen, "clen")[b] >= 0, "graft::tree_learn: a negative context length");
  std::vector<int64_t> nxt(B * P);                     // the token after each path node; at A: the bonus
  for (int64_t b = 0; b < B; b++)
    for (int64_t j = 0; j < P; j++)
      nxt[b * P + j] = j == a[b] || j + 1 == P ? bo[b] : tok[b * N + pa[b * P + j + 1]];
  if (on(M)) {
    TORCH_CHECK(on(written) && M->dim() == 3 && M->size(0) == B && M->scalar_type() == at::kInt && M->is_contiguous() &&
                written->scalar_type() == at::kBool && written->is_contiguous() &&
                written->sizes() == at::IntArrayRef({B, M->size(1)}) && logits.dim() == 3 && logits.size(0) == B &&
                logits.size(1) == N, "graft::tree_learn: M (B, V + 1, k) int32 and written (B, V + 1) bool, logits (B, N, V)");
    const int64_t R = M->size(1), k = M->size(2), V = R - 1;
    auto top = std::get<1>(top_impl(logits, k, false));                           // (B, N, k)
    const int64_t* ti = top.data_ptr<int64_t>();
    int32_t* mp = M->data_ptr<int32_t>();
    bool* wp = written->data_ptr<bool>();
    std::vector<int64_t> prio(N), key(N), order(N);
    for (int64_t b = 0; b < B; b++) {
      for (int64_t i = 0; i < N; i++) prio[i] = i;
      for (int64_t j = 0; j < P; j++) prio[pa[b * P + j]] = pa[b * P + j] + (j <= a[b] ? N : 0);   // (scatter: the last wins)
      for (int64_t i = 0; i < N; i++) {
        key[i] = (ok[b * N + i] ? tok[b * N + i] : V) * (2 * N) + prio[i];
        order[i] = i;
      }
      std::sort(order.begin(), order.end(), [&](int64_t x, int64_t y) { return key[x] < key[y]; });   // keys distinct
      for (int64_t q = 0; q < N; q++) {
        const int64_t i = order[q], t = key[i] / (2 * N);
        const int64_t row = q + 1 == N || key[order[q + 1]] / (2 * N) != t ? t : V;   // the last of its token
        for (int64_t j = 0; j < k; j++) mp[(b * R + row) * k + j] = (int32_t)ti[(b * N + i) * k + j];
        wp[b * R + row] = true;
      }
    }
  }
  if (on(ctx)) {
    TORCH_CHECK(on(clen) && ctx->dim() == 2 && ctx->size(0) == B && ctx->scalar_type() == at::kLong && ctx->is_contiguous(),
                "graft::tree_learn: ctx (B, S) int64 and clen");
    int64_t* cl = longs(*clen, "clen");
    int64_t* cp = ctx->data_ptr<int64_t>();
    const int64_t S = ctx->size(1);
    for (int64_t b = 0; b < B; b++) {
      const int64_t n = (a[b] + 1) * act[b];
      for (int64_t j = 0; j < P; j++) cp[b * S + (j < n ? std::min(cl[b] + j, S - 1) : S - 1)] = nxt[b * P + j];
      cl[b] += n;
    }
  }
  if (on(pend_n)) {
    int64_t* pn = longs(*pend_n, "pend_n");
    TORCH_CHECK(on(pend_feats) && on(feats) && pend_feats->dim() == 3 && pend_feats->size(0) == B && pend_feats->size(1) >= P &&
                pend_feats->is_contiguous() && feats->is_contiguous() && feats->scalar_type() == pend_feats->scalar_type() &&
                feats->sizes() == at::IntArrayRef({B, P, pend_feats->size(2)}),
                "graft::tree_learn: pend_feats (B, >= P, F) and feats (B, P, F) of one dtype, contiguous");
    const int64_t Pr = pend_feats->size(1), row = pend_feats->size(2) * pend_feats->element_size();
    for (int64_t b = 0; b < B; b++)
      std::memcpy((char*)pend_feats->data_ptr() + b * Pr * row, (const char*)feats->data_ptr() + b * P * row, P * row);
    if (on(pend_ids)) {
      TORCH_CHECK(pend_ids->dim() == 2 && pend_ids->size(0) == B && pend_ids->size(1) >= P && pend_ids->scalar_type() == at::kLong &&
                  pend_ids->is_contiguous(), "graft::tree_learn: pend_ids (B, >= P) int64, contiguous");
      int64_t* pi = pend_ids->data_ptr<int64_t>();
      for (int64_t b = 0; b < B; b++)
        for (int64_t j = 0; j < P; j++) pi[b * pend_ids->size(1) + j] = nxt[b * P + j];
    }
    for (int64_t b = 0; b < B; b++) pn[b] = (a[b] + 1) * act[b];
  }
}

// verify.tree_mask: row i of a tree sees itself and its ancestors (parents (B, N), -1: the root; a
// padding node, valid False, is its own root), up to 2^s generations for s = bit_length(max(max_depth, 1))
// (the torch version squares the parent relation s times). Returns (mask (B, N, N) bool, depth (B, N)
// int64: ancestors seen).
std::tuple<at::Tensor, at::Tensor> tree_mask(const at::Tensor& parents_, const at::Tensor& valid_, int64_t max_depth) {
  TORCH_CHECK(parents_.device().is_cpu() && parents_.dim() == 2 && valid_.sizes() == parents_.sizes(),
              "graft::tree_mask: parents and valid (B, N)");
  const auto par = parents_.to(at::kLong).contiguous();
  const auto valid = valid_.to(at::kBool).contiguous();
  const int64_t B = par.size(0), N = par.size(1);
  int64_t s = 0;
  for (int64_t d = std::max<int64_t>(max_depth, 1); d; d >>= 1) s++;
  const int64_t reach = s >= 62 ? INT64_MAX : (int64_t(1) << s);
  auto mask = at::zeros({B, N, N}, valid.options());
  auto depth = at::empty({B, N}, par.options());
  const int64_t* pp = par.data_ptr<int64_t>();
  const bool* ok = valid.data_ptr<bool>();
  bool* mp = mask.data_ptr<bool>();
  int64_t* dp = depth.data_ptr<int64_t>();
  std::vector<int64_t> up(N);
  for (int64_t b = 0; b < B; b++) {
    for (int64_t i = 0; i < N; i++) {
      const int64_t p = pp[b * N + i];
      TORCH_CHECK(p < N, "graft::tree_mask: a parent outside the tree");
      up[i] = p < 0 || !ok[b * N + i] ? i : p;
    }
    for (int64_t i = 0; i < N; i++) {
      bool* row = mp + (b * N + i) * N;
      row[i] = true;
      int64_t seen = 1;
      for (int64_t j = i, g = 0; g < reach && up[j] != j; g++) {
        j = up[j];
        if (!row[j]) row[j] = true, seen++;
        else break;                                       // (a cycle: malformed parents, nothing new)
      }
      dp[b * N + i] = seen - 1;
    }
  }
  return {mask, depth};
}

// verify.accept: every request's longest accepted path (tokens, parents, valid, depth, target (B, N),
// mask (B, N, N) from tree_mask). A node is acceptable when it is the root, or real with its token the
// target's choice at its parent, and so is every node it sees; the deepest such node (the first on
// ties) ends the path. Returns (A (B,) its depth, bonus (B,) the target's choice there, path (B, min(P,
// N)): the nodes it sees by depth, then the others in index order).
std::tuple<at::Tensor, at::Tensor, at::Tensor> accept(const at::Tensor& tokens_, const at::Tensor& parents_, const at::Tensor& valid_,
                                                      const at::Tensor& mask_, const at::Tensor& depth_, const at::Tensor& target_,
                                                      int64_t P) {
  TORCH_CHECK(tokens_.device().is_cpu() && tokens_.dim() == 2 && parents_.sizes() == tokens_.sizes() &&
              valid_.sizes() == tokens_.sizes() && depth_.sizes() == tokens_.sizes() && target_.sizes() == tokens_.sizes() &&
              mask_.dim() == 3 && mask_.size(0) == tokens_.size(0) && mask_.size(1) == tokens_.size(1) &&
              mask_.size(2) == tokens_.size(1) && P >= 1, "graft::accept: tokens, parents, valid, depth, target (B, N), mask (B, N, N)");
  auto L = [](const at::Tensor& t) { return t.to(at::kLong).contiguous(); };
  const auto tok = L(tokens_), par = L(parents_), dep = L(depth_), tgt = L(target_);
  const auto valid = valid_.to(at::kBool).contiguous(), mask = mask_.to(at::kBool).contiguous();
  const int64_t B = tok.size(0), N = tok.size(1), Pn = std::min(P, N);
  auto A = at::empty({B}, tok.options()), bonus = at::empty({B}, tok.options()), path = at::empty({B, Pn}, tok.options());
  const int64_t *tp = tok.data_ptr<int64_t>(), *pp = par.data_ptr<int64_t>(), *dp = dep.data_ptr<int64_t>(), *gp = tgt.data_ptr<int64_t>();
  const bool *vp = valid.data_ptr<bool>(), *mp = mask.data_ptr<bool>();
  int64_t *ap = A.data_ptr<int64_t>(), *bp = bonus.data_ptr<int64_t>(), *op = path.data_ptr<int64_t>();
  std::vector<char> ok(N);
  std::vector<int64_t> key(N), order(N);
  for (int64_t b = 0; b < B; b++) {
    const int64_t o = b * N;
    for (int64_t j = 0; j < N; j++) {
      const int64_t p = std::max<int64_t>(pp[o + j], 0);
      TORCH_CHECK(p < N, "graft::accept: a parent outside the tree");
      ok[j] = j == 0 || (vp[o + j] && tp[o + j] == gp[o + p]);
    }
    int64_t best = 0, best_key = INT64_MIN;
    for (int64_t i = 0; i < N; i++) {
      bool good = true;
      for (int64_t j = 0; j < N && good; j++) good = !(mp[(o + i) * N + j] && !ok[j]);
      const int64_t k = good ? dp[o + i] : -1;
      if (k > best_key) best_key = k, best = i;            // deepest; the first on ties
    }
    for (int64_t j = 0; j < N; j++) key[j] = mp[(o + best) * N + j] ? dp[o + j] : N, order[j] = j;
    std::stable_sort(order.begin(), order.end(), [&](int64_t x, int64_t y) { return key[x] < key[y]; });
    ap[b] = dp[o + best];
    bp[b] = gp[o + best];
    for (int64_t j = 0; j < Pn; j++) op[b * Pn + j] = order[j];
  }
  return {A, bonus, path};
}

// ------------------------------------------------------------------------------------------ KV compaction

// Every cache t (B, H_kv, R, D): request b's rows src[b, i] become its rows dst[b, i] (src, dst (B, n)),
// all of a request's rows read before any is written (a source may be another's destination). One call
// for every layer's keys and values, where the torch version is two indexed ops a tensor.
void move_rows(at::TensorList caches, const at::Tensor& src, const at::Tensor& dst) {
  TORCH_CHECK(src.dim() == 2 && src.sizes() == dst.sizes(), "graft::move_rows: src and dst (B, n)");
  auto s = src.to(at::kLong).contiguous(), d = dst.to(at::kLong).contiguous();
  const int64_t B = s.size(0), n = s.size(1);
  const int64_t* sp = s.data_ptr<int64_t>();
  const int64_t* dp = d.data_ptr<int64_t>();
  for (const auto& t : caches) {
    TORCH_CHECK(t.device().is_cpu() && t.dim() == 4 && t.size(0) == B && t.stride(3) == 1, "graft::move_rows: caches (B, H_kv, R, D), CPU");
    const int64_t R = t.size(2);
    for (int64_t i = 0; i < B * n; i++)
      TORCH_CHECK(sp[i] >= 0 && sp[i] < R && dp[i] >= 0 && dp[i] < R, "graft::move_rows: a row outside the cache");
  }
  at::parallel_for(0, (int64_t)caches.size(), 1, [&](int64_t c0, int64_t c1) {
    std::vector<char> buf;
    for (int64_t c = c0; c < c1; c++) {
      const at::Tensor& t = caches[c];
      const int64_t H = t.size(1), row = t.size(3) * t.element_size();
      char* base = (char*)t.data_ptr();
      const int64_t sb = t.stride(0) * t.element_size(), sh = t.stride(1) * t.element_size(), sr = t.stride(2) * t.element_size();
      buf.resize(n * row);
      for (int64_t b = 0; b < B; b++)
        for (int64_t h = 0; h < H; h++) {
          char* p = base + b * sb + h * sh;
          for (int64_t i = 0; i < n; i++) std::memcpy(buf.data() + i * row, p + sp[b * n + i] * sr, row);
          for (int64_t i = 0; i < n; i++) std::memcpy(p + dp[b * n + i] * sr, buf.data() + i * row, row);
        }
    }
  });
}

}  // namespace

TORCH_LIBRARY(graft, lib) {
  lib.def("peak(ScalarType dtype, float seconds) -> float", &kernel_peak);
  lib.def("isa() -> str", &isa);
  lib.def("move_rows(Tensor(a!)[] caches, Tensor src, Tensor dst) -> ()");
  lib.def("top_logprobs(Tensor logits, int k) -> (Tensor, Tensor)");
  lib.def("topk_rows(Tensor x, int k) -> (Tensor, Tensor)");
  lib.def("gumbel_argmax(Tensor logits, Tensor seed, Tensor positions, Tensor th, Tensor? temperature, Tensor? real) -> Tensor");
  lib.def("plain_learn(Tensor logits, Tensor tokens, Tensor valid, Tensor nxt, Tensor active, Tensor? feats, "
          "Tensor(a!)? M, Tensor(b!)? written, Tensor(c!)? ctx, Tensor(d!)? clen, Tensor(e!)? pend_feats, "
          "Tensor(f!)? pend_ids, Tensor(g!)? pend_n) -> ()");
  lib.def("norm_top_logprobs(Tensor h, Tensor nw, float eps, Tensor w, int k) -> (Tensor, Tensor)");
  lib.def("layers(Tensor x, Tensor[] n1, Tensor[] wq, Tensor?[] bq, Tensor[] wk, Tensor?[] bk, Tensor[] wv, Tensor?[] bv, "
          "Tensor[] wo, Tensor?[] qn, Tensor?[] kn, Tensor[] n2, Tensor[] wg, Tensor[] wu, Tensor[] wd, Tensor cos, "
          "Tensor sin, Tensor(a!)[] kc, Tensor(b!)[] vc, Tensor rows, Tensor? slots, Tensor mask, Tensor? keep, "
          "int n_heads, float eps, int[] capture, Tensor[] scales) -> (Tensor, Tensor[])");
  lib.def("graft_trees(Tensor d_tok, Tensor d_par, Tensor kept, Tensor r_tok, Tensor r_score, Tensor t_par, "
          "Tensor t_depth, Tensor t_rank, Tensor anchor, Tensor free) -> (Tensor, Tensor, Tensor, Tensor)");
  lib.def("tree_mask(Tensor parents, Tensor valid, int max_depth) -> (Tensor, Tensor)");
  lib.def("accept(Tensor tokens, Tensor parents, Tensor valid, Tensor mask, Tensor depth, Tensor target, int P) -> (Tensor, Tensor, Tensor)");
  lib.def("retrieve(Tensor M, Tensor under, Tensor parents, Tensor ranks) -> Tensor");
  lib.def("context_match(Tensor ctx, Tensor clen, int G, int T) -> (Tensor, Tensor, Tensor)");
  lib.def("tree_learn(Tensor logits, Tensor tokens, Tensor valid, Tensor path, Tensor A, Tensor bonus, Tensor active, "
          "Tensor? feats, Tensor(a!)? M, Tensor(b!)? written, Tensor(c!)? ctx, Tensor(d!)? clen, Tensor(e!)? pend_feats, "
          "Tensor(f!)? pend_ids, Tensor(g!)? pend_n) -> ()");
  lib.def("linear(Tensor x, Tensor w, Tensor? bias, Tensor? scale=None) -> Tensor");
  lib.def("attention(Tensor q, Tensor k, Tensor v, Tensor mask, float scale) -> Tensor");
  lib.def("block(Tensor x, Tensor n1, Tensor wq, Tensor? bq, Tensor wk, Tensor? bk, Tensor wv, Tensor? bv, Tensor wo, "
          "Tensor? qn, Tensor? kn, Tensor n2, Tensor wg, Tensor wu, Tensor wd, Tensor cos, Tensor sin, Tensor(a!) kc, "
          "Tensor(b!) vc, Tensor rows, Tensor? slots, Tensor mask, Tensor? keep, int n_heads, float eps, Tensor[] scales, "
          "Tensor? emb=None, Tensor? hn=None, bool nbr=False, Tensor? want=None) -> Tensor");
}

TORCH_LIBRARY_IMPL(graft, CPU, lib) {
  lib.impl("linear", &linear);
  lib.impl("attention", &attention);
  lib.impl("block", &block);
  lib.impl("move_rows", &move_rows);
  lib.impl("top_logprobs", &top_logprobs);
  lib.impl("topk_rows", &topk_rows);
  lib.impl("gumbel_argmax", &gumbel_argmax);
  lib.impl("plain_learn", &plain_learn);
  lib.impl("norm_top_logprobs", &norm_top_logprobs);
  lib.impl("layers", &layers);
  lib.impl("graft_trees", &graft_trees);
  lib.impl("retrieve", &retrieve);
  lib.impl("tree_mask", &tree_mask);
  lib.impl("accept", &accept);
  lib.impl("context_match", &context_match);
  lib.impl("tree_learn", &tree_learn);
}
