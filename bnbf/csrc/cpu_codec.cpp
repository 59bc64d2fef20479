// The CPU step's 8-bit codec: block-wise quantization of optimizer states with the step's stochastic rounding,
// and dequantization, one fused pass each. bnbf/quant.py's quantize_state_reference, dequantize_state_reference
// and state_dither are the specification and the test oracle; this file computes the same bits.
//
// Built at install time by torch's own tooling (setup.py), never at run time. Compiled with -ffp-contract=off and
// without -ffast-math: every float32 operation below is the one torch performs, in the same order (a fused
// multiply-add or a reassociated sum would change the last bit of a code position). The hot loops are compiled
// for several x86-64 levels (target_clones), the CPU's picked at load time.

#include <torch/extension.h>

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <utility>
#include <vector>

namespace {

// bnbf/quant.py's constants (the step's dither, the zero point, the power format's margin)
constexpr uint32_t kLane = 0x9E3779B1u;
constexpr uint32_t kBlock = 0x85EBCA77u;
constexpr uint32_t kStep = 0xC2B2AE3Du;
constexpr uint32_t kMix = 0x7FEB352Du;
constexpr int32_t kPowerFloor = 4;
constexpr float kDynamicCeilBelow = 1e-5f;      // torch compares a float32 tensor with the float32 of 1e-5
constexpr float kCeil = 0.5f - 0x1p-17f;         // _CEIL
constexpr double kPowerMargin = 1.0 - 0x1p-16;  // POWER_MARGIN; 127 and 255 times it are exact in float32
// POWER_COMP_SIGNED / _UNSIGNED: the stored absmax's factor that undoes the margin's scaling of decoded values
constexpr float kPowerCompSigned = static_cast<float>(1.0 / (kPowerMargin * kPowerMargin));
constexpr float kPowerCompUnsigned = static_cast<float>(1.0 / (kPowerMargin * kPowerMargin * kPowerMargin * kPowerMargin));

// clones for AVX-512 (x86-64-v4) and AVX2 (v3): the baseline (SSE2) cannot vectorize the dynamic format's
// select chain, several times slower
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && __GNUC__ >= 12
#define BNBF_CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#elif defined(__x86_64__) && defined(__GNUC__)
#define BNBF_CLONES __attribute__((target_clones("avx2", "default")))
#else
#define BNBF_CLONES
#endif
// The per-block helpers go into each clone: an out-of-line copy would be the baseline's, not vectorized.
#if defined(__GNUC__)
#define BNBF_INLINE inline __attribute__((always_inline))
#else
#define BNBF_INLINE inline
#endif

uint32_t block_hash(int64_t block, int64_t seed) {
  uint32_t h = static_cast<uint32_t>(block) * kBlock + static_cast<uint32_t>(static_cast<uint64_t>(seed)) * kStep;
  h ^= h >> 16;
  h *= kMix;
  return h ^ (h >> 15);
}

// The dither of a lane: (2k + 1) / 2**23 - 1/2, k the top 22 bits of lane * LANE + block_hash (exact in float32).
BNBF_INLINE float dither(uint32_t lane, uint32_t hash) {
  const uint32_t k = (lane * kLane + hash) >> 10;
  return static_cast<float>(static_cast<int32_t>(2 * k + 1)) * 0x1p-23f - 0.5f;
}

BNBF_INLINE uint32_t float_bits(float x) {
  uint32_t u;
  std::memcpy(&u, &x, sizeof u);
  return u;
}

// The dynamic maps' per-decade constants, computed in double and rounded to float32 as _dynamic_constants does:
// decade i (0..6) starts at edge[i], has n = 2**(i + k_off) bins and bin position u = a * s[i] - b[i].
struct Dynamic {
  float edge[7], s[7], b[7];
  float below_first, below_rest;  // the factor of a position below the bins: decade 0's, the others'
  float above_top, above_rest;    // ... and above them: the top decade's, the others'
  int32_t k_off;

  explicit Dynamic(bool is_signed) {
    k_off = is_signed ? 0 : 1;
    for (int i = 0; i < 7; ++i) {
      const int n = 1 << (i + k_off);
      edge[i] = i == 0 ? 0.0f : static_cast<float>(std::pow(10.0, static_cast<double>(i - 7)));
      double p10 = 1.0;
      for (int j = 0; j < 6 - i; ++j) p10 *= 10.0;
      s[i] = static_cast<float>(p10 * n / 0.9);
      b[i] = static_cast<float>(0.1 * n / 0.9 + 0.5);
    }
    below_first = static_cast<float>(1.0 / (0.1 * (k_off + 1) / 0.9 + 0.5));
    below_rest = static_cast<float>(1.0 / 0.6);
    above_top = 2.0f;
    above_rest = static_cast<float>(1.0 / 3.0);
  }
};

const Dynamic kDynamicSigned(true), kDynamicUnsigned(false);

// The loops below are written for the vectorizer: every load unconditional, selects instead of branches, the
// keep mask as bytes (a bool operand stops GCC 12), integers for signs. KEEP: the step's mask of finite gradient
// elements (the state of a non-finite one is stored as 0), or none.

// The largest magnitude of a block, as the largest bit pattern of |v| (the same order for non-negative floats;
// an integer max vectorizes without -ffast-math).
template <bool KEEP>
BNBF_INLINE float block_absmax(const float* __restrict x, const uint8_t* __restrict keep, int64_t len) {
  uint32_t top = 0;
  for (int64_t i = 0; i < len; ++i) {
    const uint32_t bits = float_bits(x[i]) & 0x7FFFFFFFu;
    top = std::max(top, KEEP && !keep[i] ? 0u : bits);
  }
  float absmax;
  std::memcpy(&absmax, &top, sizeof absmax);
  return absmax;
}

BNBF_INLINE float value(const float* __restrict x, const uint8_t* __restrict keep, int64_t i, bool use_keep) {
  const float v = x[i];
  return use_keep && !keep[i] ? 0.0f : v;
}

BNBF_INLINE float normed_of(float v, float scale) { return std::min(std::max(v * scale, -1.0f), 1.0f); }

// The power format's code of a value from the root of its |normed| (sqrt signed, sqrt(sqrt) unsigned).
template <bool SIGNED>
BNBF_INLINE int32_t power_code(float root, float v, float normed, float d) {
  if constexpr (SIGNED) {
    float t = root * static_cast<float>(127.0 * kPowerMargin);
    t = t < 1.0f ? t * t : t;  // below code 1: unbiased in the value (t**2)
    const float mag = std::nearbyint(std::min(t + d, 127.0f));
    return static_cast<int32_t>(128.0f + (normed > 0.0f ? mag : (normed < 0.0f ? -mag : 0.0f)));
  } else {
    const float t = root * static_cast<float>(255.0 * kPowerMargin);
    const int32_t c = static_cast<int32_t>(std::nearbyint(std::min(t + d, 255.0f)));
    // the floor: a nonzero value's float32 bits (as an int) capped at POWER_FLOOR
    const int32_t bits = static_cast<int32_t>(float_bits(v));
    return std::max(c, v != 0.0f ? std::min(std::max(bits, 0), kPowerFloor) : 0);
  }
}

// A non-negative float moved by k ulps (down stops at 0).
BNBF_INLINE float ulps_down(float r, uint32_t k) {
  const uint32_t bits = float_bits(r);
  const uint32_t moved = bits > k ? bits - k : 0u;
  float out;
  std::memcpy(&out, &moved, sizeof out);
  return out;
}

BNBF_INLINE float ulps_up(float r, uint32_t k) {
  const uint32_t moved = float_bits(r) + k;
  float out;
  std::memcpy(&out, &moved, sizeof out);
  return out;
}

// The oracle takes its roots with torch.sqrt, which is not correctly rounded with MKL (17% of float32 inputs are
// 1 ulp off), and a call per block would cost more than the rest of the codec. The code is a monotone function of
// the root, so a block brackets each root by the correctly rounded one (the hardware's) +- kRootSlack ulps: where
// both ends give one code, it is torch's code too; elsewhere (~1e-4 of the values) unsure marks the element,
// whose code quantize_power takes again from torch's own sqrt.
constexpr uint32_t kRootSlack = 2;

template <bool KEEP, bool SIGNED>
BNBF_INLINE uint8_t block_power_codes(const float* __restrict x, const uint8_t* __restrict keep,
                                      uint8_t* __restrict codes, uint8_t* __restrict unsure, int64_t len, float scale,
                                      uint32_t hash) {
  uint8_t any = 0;
  for (int64_t i = 0; i < len; ++i) {
    const float v = value(x, keep, i, KEEP);
    const float normed = normed_of(v, scale);
    const float d = dither(static_cast<uint32_t>(i), hash);
    const float r = std::sqrt(std::abs(normed));
    float lo, hi;
    if constexpr (SIGNED) {
      lo = ulps_down(r, kRootSlack);
      hi = ulps_up(r, kRootSlack);
    } else {  // the second root of either end of the first's bracket
      lo = ulps_down(std::sqrt(ulps_down(r, kRootSlack)), kRootSlack);
      hi = ulps_up(std::sqrt(ulps_up(r, kRootSlack)), kRootSlack);
    }
    const int32_t c_lo = power_code<SIGNED>(lo, v, normed, d);
    const int32_t c_hi = power_code<SIGNED>(hi, v, normed, d);
    codes[i] = static_cast<uint8_t>(c_lo);
    const uint8_t u = c_lo != c_hi ? 1 : 0;
    unsure[i] = u;
    any |= u;
  }
  return any;
}

// The dynamic format's codes of a block as block_dynamic_codes below, with a select per decade: what a CPU without
// AVX2 runs (its permutes of 8-lane vectors are scalar, 1.4x slower than this), and a non-x86 one.
template <bool KEEP, bool SIGNED>
BNBF_INLINE void block_dynamic_codes_chain(const float* __restrict x, const uint8_t* __restrict keep,
                                     uint8_t* __restrict codes, int64_t len, float scale, uint32_t hash) {
  const Dynamic& c = SIGNED ? kDynamicSigned : kDynamicUnsigned;
  for (int64_t i = 0; i < len; ++i) {
    const float v = value(x, keep, i, KEEP);
    const float normed = normed_of(v, scale);
    // non-negative states round up below DYNAMIC_CEIL_BELOW (the offset at _CEIL)
    const float dith = dither(static_cast<uint32_t>(i), hash);
    const float d = !SIGNED && normed < kDynamicCeilBelow ? kCeil : dith;
    const float a = SIGNED ? std::min(std::abs(normed), 1.0f) : std::min(std::max(normed, 0.0f), 1.0f);
    // the decade by a chain of selects (a gather per constant costs 2.5x the whole loop)
    float s = c.s[0], b = c.b[0];
    int32_t dec = 0;
    for (int j = 1; j < 7; ++j) {
      const int32_t up = a >= c.edge[j] ? 1 : 0;
      s = up ? c.s[j] : s;
      b = up ? c.b[j] : b;
      dec += up;
    }
    const int32_t n = 1 << (dec + c.k_off);
    const float top = static_cast<float>(n - 1);
    const float below = dec == 0 ? c.below_first : c.below_rest, above = dec == 6 ? c.above_top : c.above_rest;
    float u = a * s - b;
    u = u < 0.0f ? u * below : u;
    u = u > top ? top + (u - top) * above : u;
    const int32_t negative = SIGNED ? static_cast<int32_t>(normed < 0.0f) : 0;
    int32_t k = std::max(static_cast<int32_t>(std::nearbyint(u + d)), -1);
    k = std::min(k, n - (dec == 6 ? negative : 0));  // a negative value's top decade has n - 1 bins
    k = a == 0.0f ? -1 : k;
    const int32_t rank = n - 1 - c.k_off + k;
    // signed: 126 - rank below zero, 128 + rank above; unsigned: a nonzero value never takes code 0
    const int32_t code = SIGNED ? 128 + rank - negative * (2 + 2 * rank) : std::max(1 + rank, v != 0.0f ? 1 : 0);
    codes[i] = static_cast<uint8_t>(code);
  }
}

// The dynamic format's codes of a block: the bin position u in the value's decade, rounded with the dither. Written
// in GCC's vector extensions, 8 lanes: the decade's constants come from 8-entry tables by one in-register permute
// each (vpermps; the auto-vectorizer gathers from memory instead, or needs a select per decade and constant), and
// the decade itself from the float's exponent and one compare. Every float32 operation is the scalar oracle's.
// (-Wpsabi: these helpers are always inlined into the clones, so no 32-byte vector crosses a call boundary)
#pragma GCC diagnostic ignored "-Wpsabi"
typedef float V8f __attribute__((vector_size(32)));
typedef int32_t V8i __attribute__((vector_size(32)));
typedef uint32_t V8u __attribute__((vector_size(32)));
typedef uint8_t V8b __attribute__((vector_size(8)));

// Decade i's constants as 8-lane tables (entry 7 unused, except edge: +inf, so a value never passes decade 6).
struct DynamicTables {
  V8f edge, s, b, top, below, above;
  V8i n;
};

DynamicTables dynamic_tables(const Dynamic& c) {
  DynamicTables t{};
  for (int i = 0; i < 8; ++i) {
    const int d = i < 7 ? i : 6;
    t.edge[i] = i < 7 ? c.edge[i] : INFINITY;
    t.s[i] = c.s[d];
    t.b[i] = c.b[d];
    t.n[i] = 1 << (d + c.k_off);
    t.top[i] = static_cast<float>(t.n[i] - 1);
    t.below[i] = d == 0 ? c.below_first : c.below_rest;
    t.above[i] = d == 6 ? c.above_top : c.above_rest;
  }
  return t;
}

const DynamicTables kTablesSigned = dynamic_tables(kDynamicSigned), kTablesUnsigned = dynamic_tables(kDynamicUnsigned);

BNBF_INLINE V8f permute(V8f table, V8i idx) { return __builtin_shuffle(table, idx); }
BNBF_INLINE V8i permute(V8i table, V8i idx) { return __builtin_shuffle(table, idx); }
BNBF_INLINE V8f vmin(V8f a, V8f b) { return b < a ? b : a; }  // std::min's operand order
BNBF_INLINE V8f vmax(V8f a, V8f b) { return a < b ? b : a; }  // std::max's
BNBF_INLINE V8i vmin(V8i a, V8i b) { return b < a ? b : a; }
BNBF_INLINE V8i vmax(V8i a, V8i b) { return a < b ? b : a; }

// Round to nearest even, as nearbyint in the default rounding mode, for |x| < 2**22: x + 1.5 * 2**23 lands where
// the ulp is 1 (the sum is rounded to an integer, ties to even as 1.5 * 2**23 is even), the difference is exact.
BNBF_INLINE V8f round_even(V8f x) {
  return (x + 0x1.8p23f) - 0x1.8p23f;  // not folded: no -ffast-math
}

// The codes of 8 values v of a block, lane: their lanes in the block (the dither's index).
template <bool SIGNED>
BNBF_INLINE V8i dynamic_codes8(V8f v, V8i lane, float scale, uint32_t hash, const DynamicTables& t, int32_t k_off) {
  const V8f zero = {}, one = zero + 1.0f;
  V8f normed = vmin(vmax(v * scale, zero - 1.0f), one);
  const V8u k = ((V8u)lane * kLane + hash) >> 10;
  const V8f dith = __builtin_convertvector((V8i)k * 2 + 1, V8f) * 0x1p-23f - 0.5f;
  V8f d = dith;
  if constexpr (!SIGNED) d = normed < kDynamicCeilBelow ? zero + kCeil : dith;
  V8f a;
  if constexpr (SIGNED) {
    a = vmin((V8f)((V8i)normed & 0x7FFFFFFF), one);
  } else {
    a = vmin(vmax(normed, zero), one);
  }
  // the decade: the edges below a's binade (5e/16, e the biased exponent, fits them all; one edge at most lies in
  // a binade, the decades being 10x apart), plus one if a reaches the next edge
  const V8i e = (V8i)a >> 23;
  const V8i base = vmin(vmax((e * 5 - 522) >> 4, V8i{} + 0), V8i{} + 6);
  const V8i dec = base + (a >= permute(t.edge, base + 1) ? V8i{} + 1 : V8i{});
  const V8i n = permute(t.n, dec);
  const V8f top = permute(t.top, dec);
  V8f u = a * permute(t.s, dec) - permute(t.b, dec);
  u = u < 0.0f ? u * permute(t.below, dec) : u;
  u = u > top ? top + (u - top) * permute(t.above, dec) : u;
  const V8i negative = SIGNED ? (normed < 0.0f ? V8i{} + 1 : V8i{}) : V8i{};
  V8i kk = vmax(__builtin_convertvector(round_even(u + d), V8i), V8i{} - 1);
  kk = vmin(kk, n - (dec == 6 ? negative : V8i{}));  // a negative value's top decade has n - 1 bins
  kk = a == 0.0f ? V8i{} - 1 : kk;
  const V8i rank = n - 1 - k_off + kk;
  if constexpr (SIGNED) return 128 + rank - negative * (2 + 2 * rank);
  return vmax(1 + rank, v != 0.0f ? V8i{} + 1 : V8i{});  // a nonzero value never takes code 0
}

template <bool KEEP, bool SIGNED>
BNBF_INLINE void block_dynamic_codes(const float* __restrict x, const uint8_t* __restrict keep,
                                     uint8_t* __restrict codes, int64_t len, float scale, uint32_t hash) {
  const DynamicTables& t = SIGNED ? kTablesSigned : kTablesUnsigned;
  const int32_t k_off = SIGNED ? 0 : 1;
  const V8i lanes = {0, 1, 2, 3, 4, 5, 6, 7};
  auto group = [&](const float* xs, const uint8_t* ks, uint8_t* out, int64_t i) {
    V8f v;
    std::memcpy(&v, xs, sizeof v);
    if constexpr (KEEP) {
      V8b kb;
      std::memcpy(&kb, ks, sizeof kb);
      v = __builtin_convertvector(kb, V8i) != 0 ? v : V8f{};
    }
    const V8i c = dynamic_codes8<SIGNED>(v, lanes + static_cast<int32_t>(i), scale, hash, t, k_off);
    const V8b cb = __builtin_convertvector(c, V8b);
    std::memcpy(out, &cb, sizeof cb);
  };
  const int64_t full = len & ~int64_t{7};
  for (int64_t i = 0; i < full; i += 8) group(x + i, KEEP ? keep + i : nullptr, codes + i, i);
  if (full < len) {  // the last partial group from copies padded with zeros (not kept), only its lanes stored
    const int64_t m = len - full;
    float xs[8] = {};
    uint8_t ks[8] = {}, out[8];
    std::memcpy(xs, x + full, m * sizeof(float));
    if (KEEP) std::memcpy(ks, keep + full, m);
    group(xs, ks, out, full);
    std::memcpy(codes + full, out, m);
  }
}

// The block's keep mask where it has an element to zero, else null: the step's gradients are almost always all
// finite, and a block without the mask runs 1.3x faster.
BNBF_INLINE const uint8_t* block_mask(const uint8_t* __restrict keep, int64_t start, int64_t len) {
  if (keep == nullptr) return nullptr;
  uint8_t all = 1;
  for (int64_t i = 0; i < len; ++i) all &= keep[start + i];
  return all ? nullptr : keep + start;
}

// What both formats do first for block r: its extent, its keep mask (null when all kept), its absmax (written),
// the scale that normalizes it and its dither hash.
struct BlockHead {
  int64_t start, len;
  const uint8_t* keep;
  float scale;
  uint32_t hash;
};

BNBF_INLINE BlockHead block_head(const float* x, const uint8_t* keep, float* absmax, int64_t n, int64_t block_size,
                                 int64_t seed, int64_t first, int64_t r) {
  const int64_t start = r * block_size;
  const int64_t len = std::min(block_size, n - start);
  const uint8_t* k = block_mask(keep, start, len);
  const float a = k ? block_absmax<true>(x + start, k, len) : block_absmax<false>(x + start, k, len);
  absmax[r] = a;
  return {start, len, k, a > 0.0f ? 1.0f / a : 0.0f, block_hash(first + r, seed)};
}

// The 8-lane permutes where they are one instruction (x86-64 with AVX2), else the select chain.
#if defined(__x86_64__) && defined(__GNUC__)
const bool kVectorDecades = [] {
  __builtin_cpu_init();  // (a static initializer may run before libgcc's own)
  return __builtin_cpu_supports("avx2") != 0;
}();
#else
const bool kVectorDecades = false;
#endif

// Blocks [b0, b1) of the dynamic format.
template <bool SIGNED>
BNBF_CLONES void quantize_dynamic(const float* x, const uint8_t* keep, uint8_t* codes, float* absmax, int64_t n,
                                  int64_t block_size, int64_t seed, int64_t first, int64_t b0, int64_t b1) {
  for (int64_t r = b0; r < b1; ++r) {
    const BlockHead h = block_head(x, keep, absmax, n, block_size, seed, first, r);
    if (kVectorDecades) {
      h.keep ? block_dynamic_codes<true, SIGNED>(x + h.start, h.keep, codes + h.start, h.len, h.scale, h.hash)
             : block_dynamic_codes<false, SIGNED>(x + h.start, h.keep, codes + h.start, h.len, h.scale, h.hash);
    } else {
      h.keep ? block_dynamic_codes_chain<true, SIGNED>(x + h.start, h.keep, codes + h.start, h.len, h.scale, h.hash)
             : block_dynamic_codes_chain<false, SIGNED>(x + h.start, h.keep, codes + h.start, h.len, h.scale, h.hash);
    }
  }
}

template <bool SIGNED>
BNBF_CLONES void power_blocks(const float* x, const uint8_t* keep, uint8_t* codes, uint8_t* unsure, float* absmax,
                              int64_t n, int64_t block_size, int64_t seed, int64_t first, int64_t r,
                              std::vector<int64_t>& redo) {
  const BlockHead h = block_head(x, keep, absmax, n, block_size, seed, first, r);
  const uint8_t any =
      h.keep ? block_power_codes<true, SIGNED>(x + h.start, h.keep, codes + h.start, unsure, h.len, h.scale, h.hash)
             : block_power_codes<false, SIGNED>(x + h.start, h.keep, codes + h.start, unsure, h.len, h.scale, h.hash);
  if (any) {
    for (int64_t i = 0; i < h.len; ++i) {
      if (unsure[i]) redo.push_back(h.start + i);
    }
  }
}

// The unsure codes (see block_power_codes) again from torch's roots.
template <bool SIGNED>
void power_redo(const float* x, const uint8_t* keep, uint8_t* codes, const float* absmax, int64_t block_size,
                int64_t seed, int64_t first, const std::vector<int64_t>& redo) {
  const int64_t m = static_cast<int64_t>(redo.size());
  at::Tensor roots = at::empty({m}, at::kFloat);
  float* rp = roots.data_ptr<float>();
  auto normed_at = [&](int64_t i) {
    const int64_t r = i / block_size;
    const float v = keep != nullptr && !keep[i] ? 0.0f : x[i];
    return std::make_pair(v, normed_of(v, absmax[r] > 0.0f ? 1.0f / absmax[r] : 0.0f));
  };
  for (int64_t j = 0; j < m; ++j) rp[j] = std::abs(normed_at(redo[j]).second);
  roots.sqrt_();  // the oracle's normed.abs().sqrt()
  if (!SIGNED) roots.sqrt_();
  for (int64_t j = 0; j < m; ++j) {
    const int64_t i = redo[j], r = i / block_size;
    const auto [v, normed] = normed_at(i);
    const float d = dither(static_cast<uint32_t>(i - r * block_size), block_hash(first + r, seed));
    codes[i] = static_cast<uint8_t>(power_code<SIGNED>(rp[j], v, normed, d));
  }
}

// Blocks [b0, b1) of the power format; the unsure codes (see block_power_codes) again from torch's roots, then
// the stored absmax's margin factor (POWER_COMP_*).
template <bool SIGNED>
void quantize_power(const float* x, const uint8_t* keep, uint8_t* codes, float* absmax, int64_t n, int64_t block_size,
                    int64_t seed, int64_t first, int64_t b0, int64_t b1) {
  std::vector<uint8_t> unsure(block_size);
  std::vector<int64_t> redo;
  for (int64_t r = b0; r < b1; ++r) {
    power_blocks<SIGNED>(x, keep, codes, unsure.data(), absmax, n, block_size, seed, first, r, redo);
  }
  if (!redo.empty()) power_redo<SIGNED>(x, keep, codes, absmax, block_size, seed, first, redo);
  // after the codes, which are taken from the block's true absmax
  const float comp = SIGNED ? kPowerCompSigned : kPowerCompUnsigned;
  for (int64_t r = b0; r < b1; ++r) absmax[r] = std::min(absmax[r] * comp, std::numeric_limits<float>::max());
}

BNBF_CLONES void dequantize_blocks(const uint8_t* __restrict codes, const float* __restrict absmax,
                                   const float* __restrict table, float* __restrict out, int64_t n,
                                   int64_t block_size, int64_t b0, int64_t b1) {
  for (int64_t r = b0; r < b1; ++r) {
    const int64_t start = r * block_size;
    const int64_t len = std::min(block_size, n - start);
    const float a = absmax[r];
    for (int64_t i = 0; i < len; ++i) {
      const int32_t c = codes[start + i];  // an int index: GCC gathers with it, not with a byte
      out[start + i] = table[c] * a;
    }
  }
}

void check_cpu_contiguous(const at::Tensor& t, const char* name, at::ScalarType dtype, int64_t numel) {
  TORCH_CHECK(t.device().is_cpu(), name, " must be a CPU tensor, got one on ", t.device());
  TORCH_CHECK(t.scalar_type() == dtype, name, " must be ", dtype, ", got ", t.scalar_type());
  TORCH_CHECK(t.is_contiguous(), name, " must be contiguous");
  // no integers in the messages: formatting one crashed the process on a torch 2.11 host (the Python wrapper
  // checks first and says the sizes)
  TORCH_CHECK(t.numel() == numel, name, " has the wrong number of elements");
}

int64_t blocks_of(int64_t n, int64_t block_size) {
  TORCH_CHECK(block_size > 0 && (block_size & (block_size - 1)) == 0, "block_size must be a positive power of two");
  return (n + block_size - 1) / block_size;
}

// Blocks per task of at::parallel_for: about 64K elements, so a small tensor runs on the calling thread.
int64_t chunk_blocks(int64_t block_size) { return std::max<int64_t>(1, 65536 / block_size); }

template <bool SIGNED>
void quantize_range(bool power, const float* x, const uint8_t* keep, uint8_t* codes, float* absmax, int64_t n,
                    int64_t block_size, int64_t seed, int64_t first, int64_t b0, int64_t b1) {
  if (power) {
    quantize_power<SIGNED>(x, keep, codes, absmax, n, block_size, seed, first, b0, b1);
  } else {
    quantize_dynamic<SIGNED>(x, keep, codes, absmax, n, block_size, seed, first, b0, b1);
  }
}

// quantize_(x, keep, codes, absmax, power, signed, block_size, seed, first_block): writes the codes and absmax
// of keep ? x : 0 (keep: a bool mask of x's numel, or None) in the format (power or dynamic, signed or not),
// rounded as the step rounds: quantize_state_reference(x, fmt, signed, block_size, state_dither(numel, seed,
// block_size, first_block=first_block)) bit for bit. x: float32 finite values, contiguous.
void quantize_(const at::Tensor& x, const c10::optional<at::Tensor>& keep, at::Tensor& codes, at::Tensor& absmax,
               bool power, bool is_signed, int64_t block_size, int64_t seed, int64_t first) {
  const int64_t n = x.numel();
  const int64_t nblocks = blocks_of(n, block_size);
  check_cpu_contiguous(x, "x", at::kFloat, n);
  if (keep.has_value()) check_cpu_contiguous(*keep, "keep", at::kBool, n);
  check_cpu_contiguous(codes, "codes", at::kByte, n);
  check_cpu_contiguous(absmax, "absmax", at::kFloat, nblocks);
  const float* xp = x.data_ptr<float>();
  const uint8_t* kp = keep.has_value() ? reinterpret_cast<const uint8_t*>(keep->data_ptr<bool>()) : nullptr;
  uint8_t* cp = codes.data_ptr<uint8_t>();
  float* ap = absmax.data_ptr<float>();
  const int64_t grain = chunk_blocks(block_size);
  at::parallel_for(0, nblocks, grain, [&](int64_t b0, int64_t b1) {
    is_signed ? quantize_range<true>(power, xp, kp, cp, ap, n, block_size, seed, first, b0, b1)
              : quantize_range<false>(power, xp, kp, cp, ap, n, block_size, seed, first, b0, b1);
  });
}

// dequantize(codes, absmax, table, block_size, out) -> float32 table[codes] * absmax[block], in codes' shape
// (dequantize_state_reference with the format's map as table); written into out (float32, codes' numel,
// contiguous) where given: the caller's scratch, saving a fresh buffer's page faults per state (~0.4 ms per 4M).
at::Tensor dequantize(const at::Tensor& codes, const at::Tensor& absmax, const at::Tensor& table, int64_t block_size,
                      const c10::optional<at::Tensor>& out) {
  const int64_t n = codes.numel();
  const int64_t nblocks = blocks_of(n, block_size);
  check_cpu_contiguous(codes, "codes", at::kByte, n);
  check_cpu_contiguous(absmax, "absmax", at::kFloat, nblocks);
  check_cpu_contiguous(table, "table", at::kFloat, 256);
  if (out.has_value()) check_cpu_contiguous(*out, "out", at::kFloat, n);
  at::Tensor values =
      out.has_value() ? out->view(codes.sizes()) : at::empty(codes.sizes(), codes.options().dtype(at::kFloat));
  const uint8_t* cp = codes.data_ptr<uint8_t>();
  const float* ap = absmax.data_ptr<float>();
  const float* tp = table.data_ptr<float>();
  float* op = values.data_ptr<float>();
  at::parallel_for(0, nblocks, chunk_blocks(block_size),
                   [&](int64_t b0, int64_t b1) { dequantize_blocks(cp, ap, tp, op, n, block_size, b0, b1); });
  return values;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("quantize_", &quantize_, "codes and absmax of a float32 state, rounded as the step rounds");
  m.def("dequantize", &dequantize, "float32 values of codes: table[codes] * absmax", py::arg("codes"),
        py::arg("absmax"), py::arg("table"), py::arg("block_size"), py::arg("out") = py::none());
  m.attr("torch_version") = BNBF_TORCH_VERSION;
}
