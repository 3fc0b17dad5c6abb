// What the two decode kernels share (grouped_decode.cc: separate keys and
// values; tied_decode.cc: grouped-tied attention's tied states): the
// 16-float vectors, a work unit's online softmax, the threads, the checks.
//
// Letters as in attention/core.py: B batch rows, T queries per row, S cached
// positions per row, N query heads, K KV heads, G = N / K, H head dim; R = G·T
// query rows of one KV head, row r = g·T + t; L positions per block (a page
// of p, or kDenseBlock of a dense cache).
//
// A work unit is one (batch row, KV head): its R query rows stream the
// head's cache once, block by block, with an online softmax. A kernel's unit
// function computes a block's logits [R, n] and hands them here
// (SoftmaxBlock), then adds the weighted values (AccumulateBlock).
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

constexpr int64_t kDenseBlock = 64;  // A dense cache's positions per block.
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

// acc[r0..r0+RC-1, h:h+16·HV] += weights[rows, i] · values[i, h:h+16·HV]
// over the block's seen positions; one row takes HV = 4, so that its
// additions do not wait on each other.
template <int RC, int HV, typename E>
GQA_LAB_INLINE void Accumulate(const float* weights_RL, int64_t L, int64_t r0,
                               int64_t h, int64_t H, int64_t n,
                               const char* seen_L, const E* values,
                               float* acc_RH) {
  F16 sum[RC][HV];
  for (int j = 0; j < RC; ++j) {
    for (int u = 0; u < HV; ++u) {
      sum[j][u] = Load16(acc_RH + (r0 + j) * H + h + u * kLanes);
    }
  }
  for (int64_t i = 0; i < n; ++i) {
    if (!seen_L[i]) continue;
    F16 v[HV];
    for (int u = 0; u < HV; ++u) v[u] = Load16(values + i * H + h + u * kLanes);
    for (int j = 0; j < RC; ++j) {
      const float w = weights_RL[(r0 + j) * L + i];
      for (int u = 0; u < HV; ++u) sum[j][u] += w * v[u];
    }
  }
  for (int j = 0; j < RC; ++j) {
    for (int u = 0; u < HV; ++u) {
      Store16(acc_RH + (r0 + j) * H + h + u * kLanes, sum[j][u]);
    }
  }
}

enum class Layout { kPaged, kDense };

// The queries' side of a decode call, which both kernels' problems extend
// with their cache.
struct Step {
  int64_t B, T, N, K, H, S;
  int64_t L;  // Positions per block: p, or kDenseBlock.
  const float* query;  // [B, T, N, H].
  const bool* visible;  // [B or 1, T, S].
  bool visible_per_row;  // [B, T, S], else [1, T, S].
  float scale, soft_cap;
  float* out;  // [B, T, N, H].
};

// One worker's buffers, sized for any unit of the call.
struct Scratch {
  std::vector<float> q_RH, acc_RH, logits_RL, max_R, total_R;
  std::vector<char> seen_L;
  explicit Scratch(const Step& st) {
    const int64_t R = st.N / st.K * st.T;
    q_RH.resize(R * st.H);
    acc_RH.resize(R * st.H);
    logits_RL.resize(R * st.L);
    max_R.resize(R);
    total_R.resize(R);
    seen_L.resize(st.L);
  }
};

// Unit (b, k)'s start: its query rows, times the scale, in s.q_RH; empty
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
  std::fill(s.acc_RH.begin(), s.acc_RH.end(), 0.0f);
  std::fill(s.max_R.begin(), s.max_R.end(), kMinusInf);
  std::fill(s.total_R.begin(), s.total_R.end(), 0.0f);
}

// Row b's mask [T, S].
GQA_LAB_INLINE const bool* VisibleOfRow(const Step& st, int64_t b) {
  return st.visible + (st.visible_per_row ? b * st.T * st.S : 0);
}

// s.seen_L[i]: whether any of the T queries sees position s0 + i of the
// block's n; false when none sees any (the block is then not read at all).
GQA_LAB_INLINE bool SeenInBlock(const Step& st, const bool* visible_TS,
                                int64_t s0, int64_t n, Scratch& s) {
  bool any = false;
  for (int64_t i = 0; i < n; ++i) {
    bool seen = false;
    for (int64_t t = 0; t < st.T; ++t) seen |= visible_TS[t * st.S + s0 + i];
    s.seen_L[i] = seen;
    any |= seen;
  }
  return any;
}

// Online softmax of the block's logits s.logits_RL [R, n] (scaled, int8
// scales applied): soft-capped and masked, they become this block's weights
// against each row's running max; earlier blocks' sums are rescaled to it.
GQA_LAB_INLINE void SoftmaxBlock(const Step& st, const bool* visible_TS,
                                 int64_t s0, int64_t n, Scratch& s) {
  const int64_t R = st.N / st.K * st.T, T = st.T, S = st.S, L = st.L;
  const int64_t H = st.H;
  const int64_t n16 = n - n % kLanes;  // Positions in whole vectors.
  for (int64_t r = 0; r < R; ++r) {
    const bool* visible_S = visible_TS + (r % T) * S + s0;
    float* logits = s.logits_RL.data() + r * L;
    if (st.soft_cap > 0.0f) {
      for (int64_t i = 0; i < n; ++i) {
        logits[i] = st.soft_cap * std::tanh(logits[i] / st.soft_cap);
      }
    }
    for (int64_t i = 0; i < n; ++i) {
      logits[i] = visible_S[i] ? logits[i] : kMinusInf;
    }
    F16 max16 = F16{} + kMinusInf;
    for (int64_t i = 0; i < n16; i += kLanes) {
      const F16 x = Load16(logits + i);
      max16 = x > max16 ? x : max16;
    }
    float block_max = kMinusInf;
    for (int j = 0; j < kLanes; ++j) block_max = std::max(block_max, max16[j]);
    for (int64_t i = n16; i < n; ++i) block_max = std::max(block_max, logits[i]);
    if (block_max == kMinusInf) {
      std::fill(logits, logits + n, 0.0f);
      continue;
    }
    const float new_max = std::max(s.max_R[r], block_max);
    const float rescale = std::exp(s.max_R[r] - new_max);  // 0 at first.
    s.max_R[r] = new_max;
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
      float* acc = s.acc_RH.data() + r * H;
      for (int64_t h = 0; h < H; ++h) acc[h] *= rescale;
    }
  }
}

// s.logits_RL [R, n] times an int8 cache's scale per position, scale [n]
// (a key's before the softmax, a value's after it, into its weight); nothing
// for a float cache (scale null).
GQA_LAB_INLINE void ScaleBlock(const Step& st, int64_t n, const float* scale,
                               Scratch& s) {
  if (scale == nullptr) return;
  const int64_t R = st.N / st.K * st.T, L = st.L;
  float* logits_RL = s.logits_RL.data();
  for (int64_t r = 0; r < R; ++r) {
    for (int64_t i = 0; i < n; ++i) logits_RL[r * L + i] *= scale[i];
  }
}

// acc [R, H] += weights s.logits_RL [R, n] x values [n, H] (an int8 value's
// scale already in its weight): each value read once per kRows rows (from
// L1), the unseen positions skipped.
template <typename E>
GQA_LAB_INLINE void AccumulateBlock(const Step& st, int64_t n,
                                    const E* values, Scratch& s) {
  const int64_t R = st.N / st.K * st.T, H = st.H, L = st.L;
  const int64_t R4 = R - R % kRows;
  const float* weights_RL = s.logits_RL.data();
  const char* seen_L = s.seen_L.data();
  float* acc_RH = s.acc_RH.data();
  if (H % kLanes == 0) {
    for (int64_t h = 0; h < H; h += kLanes) {
      for (int64_t r = 0; r < R4; r += kRows) {
        Accumulate<kRows, 1>(weights_RL, L, r, h, H, n, seen_L, values,
                             acc_RH);
      }
    }
    for (int64_t r = R4; r < R; ++r) {
      int64_t h = 0;
      for (; h + 4 * kLanes <= H; h += 4 * kLanes) {
        Accumulate<1, 4>(weights_RL, L, r, h, H, n, seen_L, values, acc_RH);
      }
      for (; h < H; h += kLanes) {
        Accumulate<1, 1>(weights_RL, L, r, h, H, n, seen_L, values, acc_RH);
      }
    }
  } else {
    for (int64_t i = 0; i < n; ++i) {
      if (!seen_L[i]) continue;
      for (int64_t r = 0; r < R; ++r) {
        const float w = weights_RL[r * L + i];
        for (int64_t h = 0; h < H; ++h) {
          acc_RH[r * H + h] += w * ToFloat(values[i * H + h]);
        }
      }
    }
  }
}

// Unit (b, k)'s end: out[b, :, k·G:(k+1)·G, :] = its sums / totals (zeros
// for a row that saw nothing).
GQA_LAB_INLINE void EndUnit(const Step& st, int64_t b, int64_t k,
                            const Scratch& s) {
  const int64_t G = st.N / st.K, T = st.T, H = st.H;
  for (int64_t g = 0; g < G; ++g) {
    for (int64_t t = 0; t < T; ++t) {
      const int64_t r = g * T + t;
      const float total = s.total_R[r];
      const float inverse = total > 0.0f ? 1.0f / total : 0.0f;
      float* out = st.out + ((b * T + t) * st.N + k * G + g) * H;
      for (int64_t h = 0; h < H; ++h) out[h] = s.acc_RH[r * H + h] * inverse;
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

// Checks the query [B, T, N, H] against the cache's K and H and fills st's
// B, T, N, K, H.
inline ffi::Error CheckQuery(const char* target, ffi::Buffer<ffi::F32>& query,
                             int64_t K, int64_t H, Step& st) {
  auto qd = query.dimensions();
  if (qd.size() != 4 || qd[3] != H || K < 1 || qd[2] % K) {
    return Fail(target, "query " + Dims(qd) +
                " is not [B, T, N, H] with H = " + std::to_string(H) +
                " and N a multiple of K = " + std::to_string(K));
  }
  st.B = qd[0];
  st.T = qd[1];
  st.N = qd[2];
  st.K = K;
  st.H = H;
  return ffi::Error::Success();
}

// Checks the mask and the output against st's B, T, S (set by the caller,
// with CheckQuery's fields) and fills the rest of st.
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
      od[3] != st.H) {
    return Fail(target, "output " + Dims(od) + " is not the query's shape");
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
