// Grouped decode attention for XLA's CPU, as two FFI custom calls
// (attention/cpu_kernel.py registers and calls them).
//
// Letters as in attention/core.py: B batch rows, T queries per row, S cached
// positions per row, N query heads, K KV heads, G = N / K, H head dim; R = G·T
// query rows of one KV head; P pages of p positions in a paged pool, M pages
// per row's table.
//
// One work unit is one (batch row, KV head): its G·T query rows stream that
// head's keys and values once, block by block (a page, or kDenseBlock
// positions of a dense cache), with an online softmax, so each K/V byte read
// serves G query heads. A block no query sees is not read at all (the
// positions past a row's length). Units are shared among XLA's intra-op
// threads and the calling thread.
//
//   gqa_lab_paged_decode: keys and values [K, P, p, H] read in place through
//     page_table [B, M] (position s of row b: page page_table[b, s / p],
//     offset s % p; S = M·p).
//   gqa_lab_dense_decode: keys [B·K, H, S], values [B·K, S, H] (the layout of
//     attention.Attention's cache).
//
// Both take query [B, T, N, H] float32, a visibility mask [B or 1, T, S]
// (true = attend), int8 scales per position and KV head (paged [K, P, p],
// dense [B·K, S]; empty [0] for a float cache) and return [B, T, N, H]
// float32. Logits are q·k · scale (· the key's scale), soft-capped where
// soft_cap > 0; a query that sees no position gets zeros.
//
// One build serves AVX2 and AVX-512 machines: the hot loops are compiled
// three times (x86-64-v4, v3 and baseline) and chosen at load time by the
// CPU's features (GCC/Clang function multi-versioning), not -march=native.

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

namespace ffi = xla::ffi;

namespace {

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
GQA_LAB_INLINE float Sum16(F16 v) {
  float sum = 0.0f;
  for (int j = 0; j < kLanes; ++j) sum += v[j];
  return sum;
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

// Logits of rows r0..r0+RC-1 against one key [H] (H a multiple of 16).
template <int RC, typename E>
GQA_LAB_INLINE void DotRows(const float* q_RH, int64_t r0, int64_t H,
                            const E* key, float* logits_RL, int64_t L,
                            int64_t i) {
  F16 sum[RC] = {};
  for (int64_t h = 0; h < H; h += kLanes) {
    const F16 k = Load16(key + h);
    for (int j = 0; j < RC; ++j) sum[j] += Load16(q_RH + (r0 + j) * H + h) * k;
  }
  for (int j = 0; j < RC; ++j) logits_RL[(r0 + j) * L + i] = Sum16(sum[j]);
}

// Logits of rows r0..r0+RC-1 at 16·PV positions from keys [H, stride].
// RC·PV independent sums: one row (MHA) takes PV = 4, so that its additions
// do not wait on each other.
template <int RC, int PV, typename E>
GQA_LAB_INLINE void DotColumns(const float* q_RH, int64_t r0, int64_t H,
                               const E* keys, int64_t stride,
                               float* logits_RL, int64_t L) {
  F16 sum[RC][PV] = {};
  for (int64_t h = 0; h < H; ++h) {
    F16 k[PV];
    for (int u = 0; u < PV; ++u) k[u] = Load16(keys + h * stride + u * kLanes);
    for (int j = 0; j < RC; ++j) {
      const float q = q_RH[(r0 + j) * H + h];
      for (int u = 0; u < PV; ++u) sum[j][u] += q * k[u];
    }
  }
  for (int j = 0; j < RC; ++j) {
    for (int u = 0; u < PV; ++u) {
      Store16(logits_RL + (r0 + j) * L + u * kLanes, sum[j][u]);
    }
  }
}

// acc[r0..r0+RC-1, h:h+16·HV] += weights[rows, i] · values[i, h:h+16·HV]
// over the block's seen positions; one row takes HV = 4 (as PV above).
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

struct Problem {
  int64_t B, T, N, K, H, S;
  int64_t L;         // Positions per block: p, or kDenseBlock.
  int64_t P, M;      // Paged only.
  const float* query;
  const void* key;
  const void* value;
  const float* key_scale;    // Null for a float cache.
  const float* value_scale;
  const int32_t* page_table;  // Paged only.
  const bool* visible;
  bool visible_per_row;  // [B, T, S], else [1, T, S].
  float scale, soft_cap;
  float* out;
};

// One worker's buffers, sized for any unit of the problem.
struct Scratch {
  std::vector<float> q_RH, acc_RH, logits_RL, max_R, total_R;
  std::vector<char> seen_L;
  explicit Scratch(const Problem& pr) {
    const int64_t R = pr.N / pr.K * pr.T;
    q_RH.resize(R * pr.H);
    acc_RH.resize(R * pr.H);
    logits_RL.resize(R * pr.L);
    max_R.resize(R);
    total_R.resize(R);
    seen_L.resize(pr.L);
  }
};

// The index of block j's first position in the cache's [.., positions]
// order: its values start at this times H, its scales here. Paged: page
// page_table[b, j] of KV head k (clamped into the pool: a bad table entry
// reads a wrong page, never outside the pool); dense: row b·K + k, position
// s0.
template <Layout layout>
GQA_LAB_INLINE int64_t FirstOfBlock(const Problem& pr, int64_t b, int64_t k,
                                    int64_t j, int64_t s0) {
  if constexpr (layout == Layout::kPaged) {
    const int64_t page =
        std::clamp<int64_t>(pr.page_table[b * pr.M + j], 0, pr.P - 1);
    return (k * pr.P + page) * pr.L;
  } else {
    return (b * pr.K + k) * pr.S + s0;
  }
}

template <typename E>
GQA_LAB_INLINE void Prefetch(const E* data, int64_t count) {
  const char* bytes = reinterpret_cast<const char*>(data);
  for (int64_t i = 0; i < count * int64_t{sizeof(E)}; i += 64) {
    __builtin_prefetch(bytes + i);
  }
}

// Unit (b, k): out[b, :, k·G:(k+1)·G, :] for its R = G·T query rows,
// row r = g·T + t.
template <typename E, Layout layout>
GQA_LAB_INLINE void AttendUnit(const Problem& pr, int64_t unit, Scratch& s) {
  const int64_t K = pr.K, G = pr.N / pr.K, T = pr.T, H = pr.H, S = pr.S;
  const int64_t L = pr.L, R = G * T;
  const int64_t b = unit / K, k = unit % K;
  float* q_RH = s.q_RH.data();
  float* acc_RH = s.acc_RH.data();
  float* logits_RL = s.logits_RL.data();
  char* seen_L = s.seen_L.data();
  for (int64_t g = 0; g < G; ++g) {
    for (int64_t t = 0; t < T; ++t) {
      const float* q = pr.query + ((b * T + t) * pr.N + k * G + g) * H;
      float* row = q_RH + (g * T + t) * H;
      for (int64_t h = 0; h < H; ++h) row[h] = q[h] * pr.scale;
    }
  }
  std::fill(acc_RH, acc_RH + R * H, 0.0f);
  std::fill(s.max_R.begin(), s.max_R.end(), kMinusInf);
  std::fill(s.total_R.begin(), s.total_R.end(), 0.0f);
  const bool* visible_TS = pr.visible + (pr.visible_per_row ? b * T * S : 0);
  const E* keys = static_cast<const E*>(pr.key);
  const E* values = static_cast<const E*>(pr.value);

  for (int64_t s0 = 0, j = 0; s0 < S; s0 += L, ++j) {
    const int64_t n = std::min(L, S - s0);
    bool any = false;
    for (int64_t i = 0; i < n; ++i) {
      bool seen = false;
      for (int64_t t = 0; t < T; ++t) seen |= visible_TS[t * S + s0 + i];
      seen_L[i] = seen;
      any |= seen;
    }
    if (!any) continue;  // Not one byte of this block is read.

    // The block's keys (paged [p, H]; dense [H, S] from column s0), values
    // [n, H] and scales [n].
    const int64_t first = FirstOfBlock<layout>(pr, b, k, j, s0);
    const E* key_block =
        keys + (layout == Layout::kPaged ? first * H : (b * K + k) * H * S + s0);
    const E* value_block = values + first * H;
    const float* key_scale = pr.key_scale ? pr.key_scale + first : nullptr;
    const float* value_scale = pr.value_scale ? pr.value_scale + first : nullptr;
    if (layout == Layout::kPaged && s0 + L < S) {
      // The next page lies elsewhere in the pool, where the CPU's prefetcher
      // does not look: its lines are fetched while this page is computed.
      const int64_t next = FirstOfBlock<layout>(pr, b, k, j + 1, s0 + L);
      Prefetch(keys + next * H, L * H);
      Prefetch(values + next * H, L * H);
      if (key_scale != nullptr) {
        Prefetch(pr.key_scale + next, L);
        Prefetch(pr.value_scale + next, L);
      }
    } else if (layout == Layout::kDense && s0 + L < S) {
      // The next block's keys: H runs of L positions, S apart, more streams
      // than the prefetcher follows.
      const int64_t ahead = std::min(L, S - s0 - L);
      for (int64_t h = 0; h < H; ++h) Prefetch(key_block + h * S + L, ahead);
    }

    // Logits [R, n]: each key read once for the R rows, kRows rows at a time
    // (their sums in registers), the remaining rows one by one.
    const int64_t R4 = R - R % kRows;
    const int64_t n16 = n - n % kLanes;  // Positions in whole vectors.
    if constexpr (layout == Layout::kPaged) {
      for (int64_t i = 0; i < n; ++i) {
        if (!seen_L[i]) continue;
        const E* key = key_block + i * H;
        if (H % kLanes == 0) {
          for (int64_t r = 0; r < R4; r += kRows) {
            DotRows<kRows>(q_RH, r, H, key, logits_RL, L, i);
          }
          for (int64_t r = R4; r < R; ++r) {
            DotRows<1>(q_RH, r, H, key, logits_RL, L, i);
          }
        } else {
          for (int64_t r = 0; r < R; ++r) {
            float dot = 0.0f;
            for (int64_t h = 0; h < H; ++h) {
              dot += q_RH[r * H + h] * ToFloat(key[h]);
            }
            logits_RL[r * L + i] = dot;
          }
        }
      }
    } else {
      for (int64_t i = 0; i < n16; i += kLanes) {
        for (int64_t r = 0; r < R4; r += kRows) {
          DotColumns<kRows, 1>(q_RH, r, H, key_block + i, S, logits_RL + i, L);
        }
      }
      for (int64_t r = R4; r < R; ++r) {
        int64_t i = 0;
        for (; i + 4 * kLanes <= n16; i += 4 * kLanes) {
          DotColumns<1, 4>(q_RH, r, H, key_block + i, S, logits_RL + i, L);
        }
        for (; i < n16; i += kLanes) {
          DotColumns<1, 1>(q_RH, r, H, key_block + i, S, logits_RL + i, L);
        }
      }
      for (int64_t i = n16; i < n; ++i) {  // A last block's odd positions.
        for (int64_t r = 0; r < R; ++r) {
          float dot = 0.0f;
          for (int64_t h = 0; h < H; ++h) {
            dot += q_RH[r * H + h] * ToFloat(key_block[h * S + i]);
          }
          logits_RL[r * L + i] = dot;
        }
      }
    }

    // Online softmax: the logits become this block's weights against the
    // row's running max; earlier blocks' sums are rescaled to it.
    for (int64_t r = 0; r < R; ++r) {
      const bool* visible_S = visible_TS + (r % T) * S + s0;
      float* logits = logits_RL + r * L;
      if (key_scale != nullptr) {
        for (int64_t i = 0; i < n; ++i) logits[i] *= key_scale[i];
      }
      if (pr.soft_cap > 0.0f) {
        for (int64_t i = 0; i < n; ++i) {
          logits[i] = pr.soft_cap * std::tanh(logits[i] / pr.soft_cap);
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
        float* acc = acc_RH + r * H;
        for (int64_t h = 0; h < H; ++h) acc[h] *= rescale;
      }
    }

    // acc [R, H] += weights [R, n] x values [n, H]: each value read once
    // per kRows rows (from L1). An int8 value's scale joins its weight.
    if (value_scale != nullptr) {
      for (int64_t r = 0; r < R; ++r) {
        for (int64_t i = 0; i < n; ++i) logits_RL[r * L + i] *= value_scale[i];
      }
    }
    if (H % kLanes == 0) {
      for (int64_t h = 0; h < H; h += kLanes) {
        for (int64_t r = 0; r < R4; r += kRows) {
          Accumulate<kRows, 1>(logits_RL, L, r, h, H, n, seen_L, value_block,
                               acc_RH);
        }
      }
      for (int64_t r = R4; r < R; ++r) {
        int64_t h = 0;
        for (; h + 4 * kLanes <= H; h += 4 * kLanes) {
          Accumulate<1, 4>(logits_RL, L, r, h, H, n, seen_L, value_block,
                           acc_RH);
        }
        for (; h < H; h += kLanes) {
          Accumulate<1, 1>(logits_RL, L, r, h, H, n, seen_L, value_block,
                           acc_RH);
        }
      }
    } else {
      for (int64_t i = 0; i < n; ++i) {
        if (!seen_L[i]) continue;
        for (int64_t r = 0; r < R; ++r) {
          const float w = logits_RL[r * L + i];
          for (int64_t h = 0; h < H; ++h) {
            acc_RH[r * H + h] += w * ToFloat(value_block[i * H + h]);
          }
        }
      }
    }
  }

  for (int64_t g = 0; g < G; ++g) {
    for (int64_t t = 0; t < T; ++t) {
      const int64_t r = g * T + t;
      const float total = s.total_R[r];
      const float inverse = total > 0.0f ? 1.0f / total : 0.0f;
      float* out = pr.out + ((b * T + t) * pr.N + k * G + g) * H;
      for (int64_t h = 0; h < H; ++h) out[h] = acc_RH[r * H + h] * inverse;
    }
  }
}

using UnitFn = void (*)(const Problem&, int64_t, Scratch&);

#define GQA_LAB_UNIT(name, E, layout)                                   \
  GQA_LAB_CLONES void name(const Problem& pr, int64_t u, Scratch& s) { \
    AttendUnit<E, layout>(pr, u, s);                                    \
  }
GQA_LAB_UNIT(PagedF32, float, Layout::kPaged)
GQA_LAB_UNIT(PagedBF16, bf16, Layout::kPaged)
GQA_LAB_UNIT(PagedS8, int8_t, Layout::kPaged)
GQA_LAB_UNIT(DenseF32, float, Layout::kDense)
GQA_LAB_UNIT(DenseBF16, bf16, Layout::kDense)
GQA_LAB_UNIT(DenseS8, int8_t, Layout::kDense)
#undef GQA_LAB_UNIT

// Runs every unit (b, k) of the problem on the calling thread and up to
// pool.num_threads() - 1 of XLA's intra-op threads (one per
// kMinBytesPerThread of the cache the call spans, bytes_per_position each
// for a key and a value of one KV head), each with its own
// Scratch. Units are claimed from a shared counter, and the call returns
// once every claimed unit is done, so a scheduled task that starts late (or
// never, on a busy pool) holds up nothing: it finds no unit left and touches
// nothing of this call's.
void Run(ffi::ThreadPool& pool, const Problem& pr, UnitFn unit_fn,
         int64_t bytes_per_position) {
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
  const int64_t spanned = count * pr.S * bytes_per_position;
  const int64_t helpers =
      std::min({pool.num_threads(), count,
                std::max<int64_t>(spanned / kMinBytesPerThread, 1)}) - 1;
  for (int64_t i = 0; i < helpers; ++i) pool.Schedule(decltype(work)(work));
  work();
  std::unique_lock<std::mutex> lock(progress->mutex);
  progress->all_done.wait(lock, [&] { return progress->done == count; });
}

std::string Dims(ffi::Span<const int64_t> dims) {
  std::string text = "[";
  for (size_t i = 0; i < dims.size(); ++i) {
    text += (i ? ", " : "") + std::to_string(dims[i]);
  }
  return text + "]";
}

// The unit function for a cache dtype, or null.
UnitFn Select(Layout layout, ffi::DataType dtype) {
  const bool paged = layout == Layout::kPaged;
  switch (dtype) {
    case ffi::DataType::F32: return paged ? PagedF32 : DenseF32;
    case ffi::DataType::BF16: return paged ? PagedBF16 : DenseBF16;
    case ffi::DataType::S8: return paged ? PagedS8 : DenseS8;
    default: return nullptr;
  }
}

// Checks what both layouts share and fills the problem's common fields;
// the caller has set B, T, N, K, H, S from the cache's shape.
ffi::Error CheckCommon(Problem& pr, const char* target,
                       ffi::Buffer<ffi::F32>& query, ffi::AnyBuffer& key,
                       ffi::AnyBuffer& value, ffi::Buffer<ffi::F32>& key_scale,
                       ffi::Buffer<ffi::F32>& value_scale,
                       ffi::Buffer<ffi::PRED>& visible, float scale,
                       float soft_cap, ffi::Result<ffi::Buffer<ffi::F32>>& out,
                       int64_t scale_count) {
  auto fail = [&](const std::string& what) {
    return ffi::Error::InvalidArgument(std::string(target) + ": " + what);
  };
  if (key.element_type() != value.element_type()) {
    return fail("keys and values differ in dtype");
  }
  const bool int8 = key.element_type() == ffi::DataType::S8;
  if (int8 != (key_scale.element_count() > 0) ||
      key_scale.element_count() != value_scale.element_count()) {
    return fail("an int8 cache takes key and value scales, a float one none");
  }
  if (int8 && static_cast<int64_t>(key_scale.element_count()) != scale_count) {
    return fail("scales " + Dims(key_scale.dimensions()) + " hold " +
                std::to_string(key_scale.element_count()) +
                " values, the cache " + std::to_string(scale_count) +
                " positions and KV heads");
  }
  auto vd = visible.dimensions();
  if (vd.size() != 3 || (vd[0] != 1 && vd[0] != pr.B) || vd[1] != pr.T ||
      vd[2] != pr.S) {
    return fail("visible " + Dims(vd) + " is not [B or 1, T, S] = [" +
                std::to_string(pr.B) + " or 1, " + std::to_string(pr.T) +
                ", " + std::to_string(pr.S) + "]");
  }
  auto od = out->dimensions();
  if (od.size() != 4 || od[0] != pr.B || od[1] != pr.T || od[2] != pr.N ||
      od[3] != pr.H) {
    return fail("output " + Dims(od) + " is not the query's shape");
  }
  pr.query = query.typed_data();
  pr.key = key.untyped_data();
  pr.value = value.untyped_data();
  pr.key_scale = int8 ? key_scale.typed_data() : nullptr;
  pr.value_scale = int8 ? value_scale.typed_data() : nullptr;
  pr.visible = visible.typed_data();
  pr.visible_per_row = vd[0] == pr.B && pr.B > 1;
  pr.scale = scale;
  pr.soft_cap = soft_cap;
  pr.out = out->typed_data();
  return ffi::Error::Success();
}

ffi::Error CheckQuery(const char* target, ffi::Buffer<ffi::F32>& query,
                      int64_t K, int64_t H, Problem& pr) {
  auto qd = query.dimensions();
  if (qd.size() != 4 || qd[3] != H || K < 1 || qd[2] % K) {
    return ffi::Error::InvalidArgument(
        std::string(target) + ": query " + Dims(qd) +
        " is not [B, T, N, H] with H = " + std::to_string(H) +
        " and N a multiple of K = " + std::to_string(K));
  }
  pr.B = qd[0];
  pr.T = qd[1];
  pr.N = qd[2];
  pr.K = K;
  pr.H = H;
  return ffi::Error::Success();
}

ffi::Error PagedDecode(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> query,
                       ffi::AnyBuffer key, ffi::AnyBuffer value,
                       ffi::Buffer<ffi::F32> key_scale,
                       ffi::Buffer<ffi::F32> value_scale,
                       ffi::BufferR2<ffi::S32> page_table,
                       ffi::Buffer<ffi::PRED> visible, float scale,
                       float soft_cap, ffi::Result<ffi::Buffer<ffi::F32>> out) {
  const char* target = "gqa_lab_paged_decode";
  auto kd = key.dimensions();
  if (kd.size() != 4 || Dims(kd) != Dims(value.dimensions())) {
    return ffi::Error::InvalidArgument(
        std::string(target) + ": keys " + Dims(kd) + " and values " +
        Dims(value.dimensions()) + " are not both [K, P, p, H]");
  }
  Problem pr{};
  if (auto e = CheckQuery(target, query, kd[0], kd[3], pr); e.failure()) {
    return e;
  }
  auto td = page_table.dimensions();
  if (td[0] != pr.B) {
    return ffi::Error::InvalidArgument(
        std::string(target) + ": page table " + Dims(td) + " has not B = " +
        std::to_string(pr.B) + " rows");
  }
  pr.P = kd[1];
  pr.L = kd[2];
  pr.M = td[1];
  pr.S = pr.M * pr.L;
  pr.page_table = page_table.typed_data();
  if (auto e = CheckCommon(pr, target, query, key, value, key_scale,
                           value_scale, visible, scale, soft_cap, out,
                           kd[0] * kd[1] * kd[2]);
      e.failure()) {
    return e;
  }
  UnitFn fn = Select(Layout::kPaged, key.element_type());
  if (fn == nullptr) {
    return ffi::Error::InvalidArgument(
        std::string(target) + ": cache dtype not float32, bfloat16 or int8");
  }
  Run(pool, pr, fn,
      2 * pr.H * static_cast<int64_t>(ffi::ByteWidth(key.element_type())));
  return ffi::Error::Success();
}

ffi::Error DenseDecode(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> query,
                       ffi::AnyBuffer key, ffi::AnyBuffer value,
                       ffi::Buffer<ffi::F32> key_scale,
                       ffi::Buffer<ffi::F32> value_scale,
                       ffi::Buffer<ffi::PRED> visible, float scale,
                       float soft_cap, ffi::Result<ffi::Buffer<ffi::F32>> out) {
  const char* target = "gqa_lab_dense_decode";
  auto kd = key.dimensions(), vd = value.dimensions();
  if (kd.size() != 3 || vd.size() != 3 || kd[0] != vd[0] || kd[1] != vd[2] ||
      kd[2] != vd[1]) {
    return ffi::Error::InvalidArgument(
        std::string(target) + ": keys " + Dims(kd) + " and values " +
        Dims(vd) + " are not [B·K, H, S] and [B·K, S, H]");
  }
  auto qd = query.dimensions();
  const int64_t B = qd.size() == 4 ? qd[0] : 0;
  if (B < 1 || kd[0] % B) {
    return ffi::Error::InvalidArgument(
        std::string(target) + ": query " + Dims(qd) + " is not [B, T, N, H]" +
        " with B dividing the cache's " + std::to_string(kd[0]) + " rows");
  }
  Problem pr{};
  if (auto e = CheckQuery(target, query, kd[0] / B, kd[1], pr); e.failure()) {
    return e;
  }
  pr.S = kd[2];
  pr.L = std::min<int64_t>(kDenseBlock, std::max<int64_t>(pr.S, 1));
  if (auto e = CheckCommon(pr, target, query, key, value, key_scale,
                           value_scale, visible, scale, soft_cap, out,
                           kd[0] * kd[2]);
      e.failure()) {
    return e;
  }
  UnitFn fn = Select(Layout::kDense, key.element_type());
  if (fn == nullptr) {
    return ffi::Error::InvalidArgument(
        std::string(target) + ": cache dtype not float32, bfloat16 or int8");
  }
  Run(pool, pr, fn,
      2 * pr.H * static_cast<int64_t>(ffi::ByteWidth(key.element_type())));
  return ffi::Error::Success();
}

}  // namespace

// The two symbols Python loads (built with -fvisibility=hidden, all else
// stays private to the library).
#define GQA_LAB_EXPORT extern "C" __attribute__((visibility("default")))
GQA_LAB_EXPORT XLA_FFI_Error* GqaLabPagedDecode(XLA_FFI_CallFrame* call_frame);
GQA_LAB_EXPORT XLA_FFI_Error* GqaLabDenseDecode(XLA_FFI_CallFrame* call_frame);

XLA_FFI_DEFINE_HANDLER_SYMBOL(GqaLabPagedDecode, PagedDecode,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // query
                                  .Arg<ffi::AnyBuffer>()  // key [K, P, p, H]
                                  .Arg<ffi::AnyBuffer>()  // value
                                  .Arg<ffi::Buffer<ffi::F32>>()  // key_scale
                                  .Arg<ffi::Buffer<ffi::F32>>()  // value_scale
                                  .Arg<ffi::BufferR2<ffi::S32>>()  // table
                                  .Arg<ffi::Buffer<ffi::PRED>>()  // visible
                                  .Attr<float>("scale")
                                  .Attr<float>("soft_cap")
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(GqaLabDenseDecode, DenseDecode,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // query
                                  .Arg<ffi::AnyBuffer>()  // key [B·K, H, S]
                                  .Arg<ffi::AnyBuffer>()  // value [B·K, S, H]
                                  .Arg<ffi::Buffer<ffi::F32>>()  // key_scale
                                  .Arg<ffi::Buffer<ffi::F32>>()  // value_scale
                                  .Arg<ffi::Buffer<ffi::PRED>>()  // visible
                                  .Attr<float>("scale")
                                  .Attr<float>("soft_cap")
                                  .Ret<ffi::Buffer<ffi::F32>>());
