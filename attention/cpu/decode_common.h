// What the two decode kernels share (grouped_decode.cc: separate keys and
// values; tied_decode.cc: a cached state that is both, GTA's tied states
// and MLA's latents): the 16-float vectors, a block's logits against
// position-major keys, a work unit's online softmax and weighted sum, the
// threads, the checks.
//
// Letters as in attention/core.py: B batch rows, T queries per row, S cached
// positions per row, N query heads, K KV heads (a tied kernel's state heads),
// G = N / K, H a query's features, W a value's (and the output's; H for
// grouped-query attention); R = G·T query rows of one KV head, row
// r = g·T + t; L positions per block (a page of p, or a dense cache's
// block: kDenseBlock, DenseStateBlock).
//
// A work unit is one (batch row, KV head): its R query rows stream the
// head's cache once, block by block, with an online softmax. A kernel's unit
// function computes a block's logits [R, n] (PositionMajorLogits where a
// position's key is a row of the cache), hands them to SoftmaxBlock, then
// adds the weighted values (MixBlock).
//
// The vector loops put what they read once in registers and what they use
// many times in lanes: a block's logits are 16 positions at a time, each
// row's 16 partial sums reduced together (Reduce16x16), never one
// horizontal sum per position; a weighted sum keeps up to 8 rows x 48
// features of sums in registers while each value vector is read once.
//
// Everything below is inline: the hot parts are compiled into each of a
// kernel's multi-versioned unit functions (GQA_LAB_CLONES), for its target.

#ifndef GQA_LAB_ATTENTION_CPU_DECODE_COMMON_H_
#define GQA_LAB_ATTENTION_CPU_DECODE_COMMON_H_

#include <algorithm>
#include <atomic>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <limits>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "xla/ffi/api/ffi.h"

// -DGQA_LAB_CLONES=... builds one target only (how the tests check each).
#ifndef GQA_LAB_CLONES
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define GQA_LAB_CLONES \
  __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define GQA_LAB_CLONES
#endif
#endif
#define GQA_LAB_INLINE inline __attribute__((always_inline))

namespace gqa_lab {

namespace ffi = xla::ffi;

// A dense cache's positions per block. Grouped-query attention's keys
// [H, S] are H runs of positions, each read kDenseBlock at a time: at 64
// (256 B of float32 a run) one core streamed a cache from memory at 9-16
// GB per second of its time, at 256 at 12-25 (B = 256 of 2,048 positions,
// N = 8 or 16, K = 1 to 16; 512 no better: 2-core Zen 5 EPYC,
// 2026-12-04). A state kernel (tied_decode.cc) reads each block twice,
// its logits then its weighted sum, so its block is what fits
// kBlockBytes (DenseStateBlock): MLA48's 64 float32 a position at 256
// positions (64 KiB) left L1 and was 15% slower than at 64.
constexpr int64_t kDenseBlock = 256;
constexpr int64_t kBlockBytes = 24 << 10;
// The cache bytes a call spans per thread it wakes: below it, waking an
// intra-op thread (tens of microseconds while the pool sleeps, as it does
// between one-request decode steps) costs more than the thread saves. At 1
// MiB per thread: train.sample's one-request step (gqa_small, 2 units of 256
// positions, 256 KiB) runs on the calling thread alone, 87-90 ms for 176
// tokens against 107-115 ms waking one helper per call (and 92 ms on the
// pure-JAX path); one layer's step at B=1, K=8, 1,024 positions (4 MiB) is
// 0.72 ms with a helper, 0.81 ms without (2-core AVX-512 Xeon,
// 2026-12-03; docs/speed.md).
constexpr int64_t kMinBytesPerThread = int64_t{1} << 20;
constexpr float kMinusInf = -std::numeric_limits<float>::infinity();

using bf16 = uint16_t;  // bfloat16's bits: a float32's upper half.

GQA_LAB_INLINE float ToFloat(float x) { return x; }
GQA_LAB_INLINE float ToFloat(int8_t x) { return static_cast<float>(x); }
GQA_LAB_INLINE float ToFloat(bf16 x) {
  return __builtin_bit_cast(float, static_cast<uint32_t>(x) << 16);
}

// 16 floats, the hot loops' unit: one AVX-512 register, two AVX2 ones, four
// SSE ones (GCC/Clang vector extensions, lowered for each clone's target).
typedef float F16 __attribute__((vector_size(64)));
constexpr int64_t kLanes = 16;
constexpr int64_t kRows = 4;  // Query rows whose sums are kept in registers.

// Positions per block of a dense state cache of `position_bytes` a
// position: kBlockBytes' worth, a multiple of 16 from 64 to kDenseBlock.
inline int64_t DenseStateBlock(int64_t position_bytes) {
  const int64_t fit = kBlockBytes / std::max<int64_t>(position_bytes, 1);
  return std::clamp<int64_t>(fit - fit % kLanes, 64, kDenseBlock);
}

GQA_LAB_INLINE F16 Load16(const float* x) {
  F16 v;
  __builtin_memcpy(&v, x, sizeof(v));
  return v;
}
GQA_LAB_INLINE F16 Load16(const bf16* x) {
  typedef uint16_t U16 __attribute__((vector_size(32)));
  typedef uint32_t U32 __attribute__((vector_size(64)));
  U16 bits;
  __builtin_memcpy(&bits, x, sizeof(bits));
  return reinterpret_cast<F16>(__builtin_convertvector(bits, U32) << 16);
}
GQA_LAB_INLINE F16 Load16(const int8_t* x) {
  typedef int8_t I8 __attribute__((vector_size(16)));
  I8 bytes;
  __builtin_memcpy(&bytes, x, sizeof(bytes));
  return __builtin_convertvector(bytes, F16);
}
GQA_LAB_INLINE void Store16(float* x, F16 v) {
  __builtin_memcpy(x, &v, sizeof(v));
}
// The sum of v's lanes as a tree of halves (a sum lane by lane would be 15
// additions each waiting on the last: compilers may not reorder them).
GQA_LAB_INLINE float Sum16(F16 v) {
  typedef float F8 __attribute__((vector_size(32)));
  typedef float F4 __attribute__((vector_size(16)));
  const F8 a = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) +
               __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
  const F4 b = __builtin_shufflevector(a, a, 0, 1, 2, 3) +
               __builtin_shufflevector(a, a, 4, 5, 6, 7);
  return (b[0] + b[2]) + (b[1] + b[3]);
}

// One step of Reduce16x16: x and y each hold 16/P sums as P partials (lane
// P·o + q: partial q of sum o); the result holds their 32/P sums, x's
// first, as P/2 partials (lane (P/2)·o + q: partials q and q + P/2 added).
#define GQA_LAB_HALVE(x, y, P)                                            \
  (__builtin_shufflevector(x, y, GQA_LAB_IDX16(P, 0)) +                   \
   __builtin_shufflevector(x, y, GQA_LAB_IDX16(P, P / 2)))
#define GQA_LAB_IDX(P, d, l) (P * ((l) / (P / 2)) + (l) % (P / 2) + d)
#define GQA_LAB_IDX16(P, d)                                                \
  GQA_LAB_IDX(P, d, 0), GQA_LAB_IDX(P, d, 1), GQA_LAB_IDX(P, d, 2),       \
      GQA_LAB_IDX(P, d, 3), GQA_LAB_IDX(P, d, 4), GQA_LAB_IDX(P, d, 5),   \
      GQA_LAB_IDX(P, d, 6), GQA_LAB_IDX(P, d, 7), GQA_LAB_IDX(P, d, 8),   \
      GQA_LAB_IDX(P, d, 9), GQA_LAB_IDX(P, d, 10), GQA_LAB_IDX(P, d, 11), \
      GQA_LAB_IDX(P, d, 12), GQA_LAB_IDX(P, d, 13), GQA_LAB_IDX(P, d, 14), \
      GQA_LAB_IDX(P, d, 15)

// Lane p: the sum of a[p]'s lanes. 15 steps of two shuffles and an add (8,
// 4, 2, 1 pairs), where 16 Sum16 would take 16 trees of 4.
GQA_LAB_INLINE F16 Reduce16x16(const F16 a[16]) {
  F16 b[8], c[4], d[2];
  for (int k = 0; k < 8; ++k) b[k] = GQA_LAB_HALVE(a[2 * k], a[2 * k + 1], 16);
  for (int k = 0; k < 4; ++k) c[k] = GQA_LAB_HALVE(b[2 * k], b[2 * k + 1], 8);
  for (int k = 0; k < 2; ++k) d[k] = GQA_LAB_HALVE(c[2 * k], c[2 * k + 1], 4);
  return GQA_LAB_HALVE(d[0], d[1], 2);
}
#undef GQA_LAB_HALVE
#undef GQA_LAB_IDX16
#undef GQA_LAB_IDX

// e^x, 16 at a time: Cephes' expf (relative error ~1e-7); 0 below -87
// (where e^x leaves float32's normal range), so a masked logit (-inf)
// weighs exactly 0.
GQA_LAB_INLINE F16 Exp16(F16 x) {
  typedef int32_t I32 __attribute__((vector_size(64)));
  const F16 low = x < -87.0f ? F16{} + 1.0f : F16{};  // 1 where e^x -> 0.
  x = x < -87.0f ? F16{} - 87.0f : x;
  x = x > 88.0f ? F16{} + 88.0f : x;
  // x = n·ln 2 + r, n rounded to nearest (the 1.5·2^23 trick), |r| <= ln2/2.
  const F16 n = (x * 1.44269504f + 12582912.0f) - 12582912.0f;
  x = x - n * 0.693359375f + n * 2.12194440e-4f;
  F16 p = 1.9875691500e-4f * x + 1.3981999507e-3f;
  p = p * x + 8.3334519073e-3f;
  p = p * x + 4.1665795894e-2f;
  p = p * x + 1.6666665459e-1f;
  p = p * x + 5.0000001201e-1f;
  p = p * x * x + x + 1.0f;
  const I32 two_n = (__builtin_convertvector(n, I32) + 127) << 23;
  return low != 0.0f ? F16{} : p * reinterpret_cast<F16>(two_n);
}

template <typename E>
GQA_LAB_INLINE void Prefetch(const E* data, int64_t count) {
  const char* bytes = reinterpret_cast<const char*>(data);
  for (int64_t i = 0; i < count * int64_t{sizeof(E)}; i += 64) {
    __builtin_prefetch(bytes + i);
  }
}

// How 16-float vectors cover the features [0, width) of a cached vector:
// at 0, 16, ..., and, for a remainder, one more ending at `width`, whose
// first `skip` lanes the vector before it covers already. Below 16 features
// (which a vector would overrun) none: the features are taken one by one.
struct Cover {
  int64_t width = 0, vectors = 0, skip = 0;
  static Cover Of(int64_t width) {
    Cover c;
    c.width = width;
    if (width >= kLanes) {
      c.vectors = (width + kLanes - 1) / kLanes;
      c.skip = c.vectors * kLanes - width;
    }
    return c;
  }
  GQA_LAB_INLINE int64_t Offset(int64_t v) const {
    return std::min(v * kLanes, width - kLanes);
  }
  GQA_LAB_INLINE int64_t Scalars() const { return vectors ? 0 : width; }
  // Features of vector v that it alone covers: lanes [First(v), 16).
  GQA_LAB_INLINE int64_t First(int64_t v) const {
    return v == vectors - 1 ? skip : 0;
  }
};

enum class Layout { kPaged, kDense };

// The queries' side of a decode call, which both kernels' problems extend
// with their cache.
struct Step {
  int64_t B, T, N, K, S;
  int64_t H;  // A query row's features.
  int64_t W;  // A value's features, the output's.
  int64_t L;  // Positions per block: p, or a dense cache's block.
  // Position-major keys (PositionMajorLogits): a query row's features
  // [0, I) meet a key's own [0, I) (key.width = I), and its features
  // [I, I + Y) a second key of Y shared by the K heads (rope.width = Y;
  // GTA's and MLA's RoPE key), I + Y = H. The values' cover: value.
  Cover key, rope, value;
  const float* query;  // [B, T, N, H].
  const bool* visible;  // [B or 1, T, S].
  bool visible_per_row;  // [B, T, S], else [1, T, S].
  float scale, soft_cap;
  float* out;  // [B, T, N, W].

  int64_t R() const { return N / K * T; }
  // A row's weighted sums: the value cover's vectors, or its scalars.
  int64_t AccWidth() const {
    return value.vectors ? value.vectors * kLanes : value.width;
  }
};

// One worker's buffers, sized for any unit of the call.
struct Scratch {
  std::vector<float> q_RH, logits_RL, max_R, total_R;
  // [R, key + rope vectors, 16]: the queries as PositionMajorLogits meets
  // the covers. (Floats, read and written as vectors with Load16 and
  // Store16: a vector's alignment in a std::vector is the base target's.)
  std::vector<float> q_vectors;
  std::vector<float> acc;  // [R, AccWidth()]: the weighted sums.
  std::vector<char> seen_L;
  bool all_seen;  // Every query of the unit sees every position of the block.
  explicit Scratch(const Step& st) {
    const int64_t R = st.R();
    q_RH.resize(R * st.H);
    q_vectors.resize(R * (st.key.vectors + st.rope.vectors) * kLanes);
    acc.resize(R * st.AccWidth());
    logits_RL.resize(R * st.L);
    max_R.resize(R);
    total_R.resize(R);
    seen_L.resize(st.L);
  }
  float* Acc(const Step& st, int64_t r) {
    return acc.data() + r * st.AccWidth();
  }
};

// Unit (b, k)'s start: its query rows, times the scale, in s.q_RH, and as
// the vectors that meet the key and rope covers in s.q_vectors (a
// remainder vector's lanes that the vector before it covers: zero); empty
// sums.
GQA_LAB_INLINE void BeginUnit(const Step& st, int64_t b, int64_t k,
                              Scratch& s) {
  const int64_t G = st.N / st.K, T = st.T, H = st.H;
  for (int64_t g = 0; g < G; ++g) {
    for (int64_t t = 0; t < T; ++t) {
      const float* q = st.query + ((b * T + t) * st.N + k * G + g) * H;
      float* row = s.q_RH.data() + (g * T + t) * H;
      for (int64_t h = 0; h < H; ++h) row[h] = q[h] * st.scale;
    }
  }
  const int64_t V = st.key.vectors + st.rope.vectors;
  for (int64_t r = 0; r < st.R(); ++r) {
    const float* q = s.q_RH.data() + r * H;
    for (int64_t v = 0; v < V; ++v) {
      const bool rope = v >= st.key.vectors;
      const Cover& c = rope ? st.rope : st.key;
      const int64_t u = rope ? v - st.key.vectors : v;
      const float* from = q + (rope ? st.key.width : 0) + c.Offset(u);
      F16 x = Load16(from);
      for (int64_t l = 0; l < c.First(u); ++l) x[l] = 0.0f;
      Store16(s.q_vectors.data() + (r * V + v) * kLanes, x);
    }
  }
  std::fill(s.acc.begin(), s.acc.end(), 0.0f);
  std::fill(s.max_R.begin(), s.max_R.end(), kMinusInf);
  std::fill(s.total_R.begin(), s.total_R.end(), 0.0f);
}

// Row b's mask [T, S].
GQA_LAB_INLINE const bool* VisibleOfRow(const Step& st, int64_t b) {
  return st.visible + (st.visible_per_row ? b * st.T * st.S : 0);
}

// 16 bools as 16 lanes of 0 or -1 (true), to select with.
typedef int32_t I16 __attribute__((vector_size(64)));
GQA_LAB_INLINE I16 Mask16(const bool* x) {
  typedef char C16 __attribute__((vector_size(16)));
  C16 bytes;
  __builtin_memcpy(&bytes, x, sizeof(bytes));
  return __builtin_convertvector(bytes, I16) != 0;
}

// s.seen_L[i]: whether any of the T queries sees position s0 + i of the
// block's n; false when none sees any (the block is then not read at all).
// s.all_seen: whether every query sees every position (no mask to apply).
GQA_LAB_INLINE bool SeenInBlock(const Step& st, const bool* visible_TS,
                                int64_t s0, int64_t n, Scratch& s) {
  bool any = false, all = true;
  for (int64_t i = 0; i < n; ++i) {
    bool seen = false;
    for (int64_t t = 0; t < st.T; ++t) {
      const bool v = visible_TS[t * st.S + s0 + i];
      seen |= v;
      all &= v;
    }
    s.seen_L[i] = seen;
    any |= seen;
  }
  s.all_seen = all;
  return any;
}

// A block's position-major keys as PositionMajorLogits reads them: the
// n positions of `key` (a position's features `stride` apart; its first
// st.key.width met by the queries) and of `rope` (st.rope.width each, or
// none), each with an int8 cache's scale per position (null: 1).
template <typename E>
struct KeyBlock {
  const E* key;
  int64_t stride;
  const float* key_scale;
  const E* rope;
  const float* rope_scale;
};

// Row r's logit at one position, its features one by one beyond the
// vectors (a remainder of fewer than 16).
template <typename E>
GQA_LAB_INLINE float ScalarLogit(const Step& st, const float* q,
                                 const KeyBlock<E>& kb, int64_t i) {
  float key = 0.0f, rope = 0.0f;
  for (int64_t h = 0; h < st.key.Scalars(); ++h) {
    key += q[h] * ToFloat(kb.key[i * kb.stride + h]);
  }
  for (int64_t h = 0; h < st.rope.Scalars(); ++h) {
    rope += q[st.key.width + h] * ToFloat(kb.rope[i * st.rope.width + h]);
  }
  return key * (kb.key_scale ? kb.key_scale[i] : 1.0f) +
         rope * (kb.rope_scale ? kb.rope_scale[i] : 1.0f);
}

// Row r's 16 partial sums of its logit at positions i0..i0+15 (key part
// times its scale, plus rope part times its), or at position i0 alone
// (kOne).
template <int kCount, typename E>
GQA_LAB_INLINE void PartialSums(const Step& st, const float* qv,
                                const KeyBlock<E>& kb, int64_t i0,
                                F16 sum[kCount]) {
  for (int p = 0; p < kCount; ++p) sum[p] = F16{};
  for (int64_t v = 0; v < st.key.vectors; ++v) {
    const E* x = kb.key + i0 * kb.stride + st.key.Offset(v);
    const F16 q = Load16(qv + v * kLanes);
    for (int p = 0; p < kCount; ++p) sum[p] += q * Load16(x + p * kb.stride);
  }
  if (kb.key_scale != nullptr) {
    for (int p = 0; p < kCount; ++p) sum[p] *= kb.key_scale[i0 + p];
  }
  for (int64_t v = 0; v < st.rope.vectors; ++v) {
    const int64_t Y = st.rope.width;
    const E* x = kb.rope + i0 * Y + st.rope.Offset(v);
    const F16 q = Load16(qv + (st.key.vectors + v) * kLanes);
    for (int p = 0; p < kCount; ++p) {
      sum[p] += (kb.rope_scale ? q * kb.rope_scale[i0 + p] : q) *
                Load16(x + p * Y);
    }
  }
}

// s.logits_RL [R, n]: each row against the block's position-major keys,
// 16 positions at a time (a row's 16 partial-sum vectors reduced
// together), a last block's odd positions one by one. Unseen positions
// get logits too (SoftmaxBlock masks them).
template <typename E>
GQA_LAB_INLINE void PositionMajorLogits(const Step& st, const KeyBlock<E>& kb,
                                        int64_t n, Scratch& s) {
  const int64_t R = st.R(), L = st.L;
  const int64_t V = st.key.vectors + st.rope.vectors;
  const bool scalars = st.key.Scalars() + st.rope.Scalars() > 0;
  const int64_t n16 = n - n % kLanes;
  for (int64_t r = 0; r < R; ++r) {
    const float* qv = s.q_vectors.data() + r * V * kLanes;
    const float* q = s.q_RH.data() + r * st.H;
    float* logits = s.logits_RL.data() + r * L;
    for (int64_t i = 0; i < n16; i += kLanes) {
      F16 sum[kLanes];
      PartialSums<kLanes>(st, qv, kb, i, sum);
      F16 x = Reduce16x16(sum);
      if (scalars) {
        for (int p = 0; p < kLanes; ++p) x[p] += ScalarLogit(st, q, kb, i + p);
      }
      Store16(logits + i, x);
    }
    for (int64_t i = n16; i < n; ++i) {
      F16 sum[1];
      PartialSums<1>(st, qv, kb, i, sum);
      logits[i] = Sum16(sum[0]) + (scalars ? ScalarLogit(st, q, kb, i) : 0.0f);
    }
  }
}

// Online softmax of the block's logits s.logits_RL [R, n] (scaled, int8
// scales applied): soft-capped and masked, they become this block's weights
// against each row's running max; earlier blocks' sums are rescaled to it.
GQA_LAB_INLINE void SoftmaxBlock(const Step& st, const bool* visible_TS,
                                 int64_t s0, int64_t n, Scratch& s) {
  const int64_t R = st.R(), T = st.T, S = st.S, L = st.L;
  const int64_t n16 = n - n % kLanes;  // Positions in whole vectors.
  for (int64_t r = 0; r < R; ++r) {
    const bool* visible_S = visible_TS + (T == 1 ? 0 : r % T * S) + s0;
    float* logits = s.logits_RL.data() + r * L;
    if (st.soft_cap > 0.0f) {
      for (int64_t i = 0; i < n; ++i) {
        logits[i] = st.soft_cap * std::tanh(logits[i] / st.soft_cap);
      }
    }
    // Masked (unless every position is seen) and the block's max, in one
    // pass.
    F16 max16 = F16{} + kMinusInf;
    for (int64_t i = 0; i < n16; i += kLanes) {
      F16 x = Load16(logits + i);
      if (!s.all_seen) {
        x = Mask16(visible_S + i) ? x : F16{} + kMinusInf;
        Store16(logits + i, x);
      }
      max16 = x > max16 ? x : max16;
    }
    float block_max = kMinusInf;
    for (int j = 0; j < kLanes; ++j) block_max = std::max(block_max, max16[j]);
    for (int64_t i = n16; i < n; ++i) {
      logits[i] = visible_S[i] ? logits[i] : kMinusInf;
      block_max = std::max(block_max, logits[i]);
    }
    if (block_max == kMinusInf) {
      std::fill(logits, logits + n, 0.0f);
      continue;
    }
    const float old_max = s.max_R[r];
    const float new_max = std::max(old_max, block_max);
    const float rescale = new_max == old_max ? 1.0f
                                             : std::exp(old_max - new_max);
    s.max_R[r] = new_max;  // (rescale 0 at first: e^-inf.)
    F16 total16 = {};
    for (int64_t i = 0; i < n16; i += kLanes) {
      const F16 w = Exp16(Load16(logits + i) - new_max);
      Store16(logits + i, w);
      total16 += w;
    }
    float total = Sum16(total16);
    for (int64_t i = n16; i < n; ++i) {
      logits[i] = std::exp(logits[i] - new_max);
      total += logits[i];
    }
    s.total_R[r] = s.total_R[r] * rescale + total;
    if (rescale != 1.0f) {
      float* acc = s.Acc(st, r);
      for (int64_t h = 0; h < st.AccWidth(); ++h) acc[h] *= rescale;
    }
  }
}

// s.logits_RL [R, n] times an int8 cache's scale per position, scale [n]
// (a key's before the softmax, a value's after it, into its weight); nothing
// for a float cache (scale null).
GQA_LAB_INLINE void ScaleBlock(const Step& st, int64_t n, const float* scale,
                               Scratch& s) {
  if (scale == nullptr) return;
  const int64_t R = st.R(), L = st.L;
  float* logits_RL = s.logits_RL.data();
  for (int64_t r = 0; r < R; ++r) {
    for (int64_t i = 0; i < n; ++i) logits_RL[r * L + i] *= scale[i];
  }
}

// Rows r0..r0+RC-1's sums of value vectors v0..v0+VC-1 += their weights
// times the block's seen values [n, stride]: RC·VC sums in registers, each
// value vector read once for the RC rows.
template <int RC, int VC, typename E>
GQA_LAB_INLINE void MixTile(const Step& st, int64_t r0, int64_t v0,
                            int64_t n, const E* values, int64_t stride,
                            Scratch& s) {
  const int64_t L = st.L, A = st.AccWidth() / kLanes;
  const float* weights_RL = s.logits_RL.data();
  const char* seen_L = s.seen_L.data();
  float* acc = s.acc.data();
  F16 sum[RC][VC];
  int64_t offset[VC];
  for (int u = 0; u < VC; ++u) offset[u] = st.value.Offset(v0 + u);
  for (int j = 0; j < RC; ++j) {
    for (int u = 0; u < VC; ++u) {
      sum[j][u] = Load16(acc + ((r0 + j) * A + v0 + u) * kLanes);
    }
  }
  for (int64_t i = 0; i < n; ++i) {
    if (!seen_L[i]) continue;
    F16 v[VC];
    for (int u = 0; u < VC; ++u) v[u] = Load16(values + i * stride + offset[u]);
    for (int j = 0; j < RC; ++j) {
      const float w = weights_RL[(r0 + j) * L + i];
      for (int u = 0; u < VC; ++u) sum[j][u] += w * v[u];
    }
  }
  for (int j = 0; j < RC; ++j) {
    for (int u = 0; u < VC; ++u) {
      Store16(acc + ((r0 + j) * A + v0 + u) * kLanes, sum[j][u]);
    }
  }
}

// Rows r0..r0+RC-1 over every value vector, three at a time.
template <int RC, typename E>
GQA_LAB_INLINE void MixRows(const Step& st, int64_t r0, int64_t n,
                            const E* values, int64_t stride, Scratch& s) {
  const int64_t V = st.value.vectors;
  int64_t v = 0;
  for (; v + 3 <= V; v += 3) MixTile<RC, 3>(st, r0, v, n, values, stride, s);
  if (V - v == 2) MixTile<RC, 2>(st, r0, v, n, values, stride, s);
  if (V - v == 1) MixTile<RC, 1>(st, r0, v, n, values, stride, s);
}

// acc [R, W] += weights s.logits_RL [R, n] x the block's values [n, W],
// a value's features `stride` apart (an int8 value's scale already in its
// weight); the unseen positions skipped.
template <typename E>
GQA_LAB_INLINE void MixBlock(const Step& st, int64_t n, const E* values,
                             int64_t stride, Scratch& s) {
  const int64_t R = st.R();
  if (st.value.vectors == 0) {  // Fewer than 16 features: one by one.
    const int64_t L = st.L, W = st.value.width;
    for (int64_t i = 0; i < n; ++i) {
      if (!s.seen_L[i]) continue;
      for (int64_t r = 0; r < R; ++r) {
        const float w = s.logits_RL[r * L + i];
        float* acc = s.Acc(st, r);
        for (int64_t h = 0; h < W; ++h) {
          acc[h] += w * ToFloat(values[i * stride + h]);
        }
      }
    }
    return;
  }
  int64_t r = 0;
  for (; r + 8 <= R; r += 8) MixRows<8>(st, r, n, values, stride, s);
  for (; r + 4 <= R; r += 4) MixRows<4>(st, r, n, values, stride, s);
  for (; r < R; ++r) MixRows<1>(st, r, n, values, stride, s);
}

// Unit (b, k)'s end: out[b, :, k·G:(k+1)·G, :] = its sums / totals (zeros
// for a row that saw nothing).
GQA_LAB_INLINE void EndUnit(const Step& st, int64_t b, int64_t k,
                            Scratch& s) {
  const int64_t G = st.N / st.K, T = st.T, W = st.W;
  for (int64_t g = 0; g < G; ++g) {
    for (int64_t t = 0; t < T; ++t) {
      const int64_t r = g * T + t;
      const float total = s.total_R[r];
      const float inverse = total > 0.0f ? 1.0f / total : 0.0f;
      const float* acc = s.Acc(st, r);
      float* out = st.out + ((b * T + t) * st.N + k * G + g) * W;
      if (st.value.vectors == 0) {
        for (int64_t h = 0; h < W; ++h) out[h] = acc[h] * inverse;
        continue;
      }
      for (int64_t v = 0; v < st.value.vectors; ++v) {
        const int64_t at = st.value.Offset(v);
        for (int64_t l = st.value.First(v); l < kLanes; ++l) {
          out[at + l] = acc[v * kLanes + l] * inverse;
        }
      }
    }
  }
}

// Runs unit_fn on every unit (b, k) of the problem, on the calling thread
// and up to pool.num_threads() - 1 of XLA's intra-op threads (one per
// kMinBytesPerThread of the `spanned` cache bytes the call reads), each
// with its own Scratch. Units are claimed from a shared counter, in order
// (a row's K units one after another), and the call returns once every
// claimed unit is done, so a scheduled task that starts late (or never, on
// a busy pool) holds up nothing: it finds no unit left and touches nothing
// of this call's.
template <typename Problem>
inline void Run(ffi::ThreadPool& pool, const Problem& pr,
                void (*unit_fn)(const Problem&, int64_t, Scratch&),
                int64_t spanned) {
  struct Progress {
    std::atomic<int64_t> next{0}, done{0};
    std::mutex mutex;
    std::condition_variable all_done;
  };
  const int64_t count = pr.B * pr.K;
  auto progress = std::make_shared<Progress>();
  auto work = [progress, count, &pr, unit_fn] {
    std::unique_ptr<Scratch> scratch;  // Made on the first unit claimed.
    int64_t finished = 0;
    for (int64_t u; (u = progress->next.fetch_add(1)) < count; ++finished) {
      if (scratch == nullptr) scratch = std::make_unique<Scratch>(pr);
      unit_fn(pr, u, *scratch);
    }
    if (finished && progress->done.fetch_add(finished) + finished == count) {
      std::lock_guard<std::mutex> lock(progress->mutex);
      progress->all_done.notify_all();
    }
  };
  const int64_t helpers =
      std::min({pool.num_threads(), count,
                std::max<int64_t>(spanned / kMinBytesPerThread, 1)}) - 1;
  for (int64_t i = 0; i < helpers; ++i) pool.Schedule(decltype(work)(work));
  work();
  std::unique_lock<std::mutex> lock(progress->mutex);
  progress->all_done.wait(lock, [&] { return progress->done == count; });
}

inline std::string Dims(ffi::Span<const int64_t> dims) {
  std::string text = "[";
  for (size_t i = 0; i < dims.size(); ++i) {
    text += (i ? ", " : "") + std::to_string(dims[i]);
  }
  return text + "]";
}

inline ffi::Error Fail(const char* target, const std::string& what) {
  return ffi::Error::InvalidArgument(std::string(target) + ": " + what);
}

// Checks the query [B, T, N, H] against the cache's K and fills st's B, T,
// N, K, H.
inline ffi::Error CheckQuery(const char* target, ffi::Buffer<ffi::F32>& query,
                             int64_t K, Step& st) {
  auto qd = query.dimensions();
  if (qd.size() != 4 || K < 1 || qd[2] % K) {
    return Fail(target, "query " + Dims(qd) +
                " is not [B, T, N, H] with N a multiple of K = " +
                std::to_string(K));
  }
  st.B = qd[0];
  st.T = qd[1];
  st.N = qd[2];
  st.K = K;
  st.H = qd[3];
  return ffi::Error::Success();
}

// Checks a paged pool of P pages of p positions and the page table [B, M]
// read through it: every entry a page of the pool (an empty pool has none,
// and a wrong id would read another sequence's page, or outside the pool).
// Fills st's S and L.
inline ffi::Error CheckPages(const char* target, int64_t P, int64_t p,
                             ffi::BufferR2<ffi::S32>& page_table, Step& st) {
  auto td = page_table.dimensions();
  if (td[0] != st.B) {
    return Fail(target, "page table " + Dims(td) + " has not B = " +
                std::to_string(st.B) + " rows");
  }
  if (P < 1 || p < 1) {
    return Fail(target, "an empty pool (" + std::to_string(P) + " pages of " +
                std::to_string(p) + " positions): allocate its pages first");
  }
  const int32_t* table = page_table.typed_data();
  for (int64_t e = 0; e < td[0] * td[1]; ++e) {
    if (table[e] < 0 || table[e] >= P) {
      return Fail(target, "page_table[" + std::to_string(e / td[1]) + ", " +
                  std::to_string(e % td[1]) + "] = " +
                  std::to_string(table[e]) + " is not a page of the pool's " +
                  std::to_string(P) + " (0 to " + std::to_string(P - 1) + ")");
    }
  }
  st.L = p;
  st.S = td[1] * p;
  return ffi::Error::Success();
}

// Checks the mask and the output against st's B, T, S, N, W (set by the
// caller) and fills the rest of st.
inline ffi::Error CheckStep(const char* target, ffi::Buffer<ffi::F32>& query,
                            ffi::Buffer<ffi::PRED>& visible, float scale,
                            float soft_cap,
                            ffi::Result<ffi::Buffer<ffi::F32>>& out,
                            Step& st) {
  auto vd = visible.dimensions();
  if (vd.size() != 3 || (vd[0] != 1 && vd[0] != st.B) || vd[1] != st.T ||
      vd[2] != st.S) {
    return Fail(target, "visible " + Dims(vd) +
                " is not [B or 1, T, S] = [" + std::to_string(st.B) +
                " or 1, " + std::to_string(st.T) + ", " +
                std::to_string(st.S) + "]");
  }
  auto od = out->dimensions();
  if (od.size() != 4 || od[0] != st.B || od[1] != st.T || od[2] != st.N ||
      od[3] != st.W) {
    return Fail(target, "output " + Dims(od) + " is not [B, T, N, W] = [" +
                std::to_string(st.B) + ", " + std::to_string(st.T) + ", " +
                std::to_string(st.N) + ", " + std::to_string(st.W) + "]");
  }
  st.query = query.typed_data();
  st.visible = visible.typed_data();
  st.visible_per_row = vd[0] == st.B && st.B > 1;
  st.scale = scale;
  st.soft_cap = soft_cap;
  st.out = out->typed_data();
  return ffi::Error::Success();
}

}  // namespace gqa_lab

#endif  // GQA_LAB_ATTENTION_CPU_DECODE_COMMON_H_
