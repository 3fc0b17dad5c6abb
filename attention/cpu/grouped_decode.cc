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
// threads and the calling thread. What this shares with grouped-tied
// attention's kernel (tied_decode.cc) is in decode_common.h.
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

#include "decode_common.h"

namespace gqa_lab {
namespace {

// Logits of rows r0..r0+RC-1 at 16·PV positions from keys [H, stride]
// (a dense cache's transposed keys): RC·PV independent sums, each key
// vector read once for the RC rows.
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

// Rows r0..r0+RC-1's logits at the block's n positions from keys [H, S]
// from column s0 (already offset): 64 positions at a time, then 16, then
// the last block's odd positions one by one.
template <int RC, typename E>
GQA_LAB_INLINE void ColumnLogits(const float* q_RH, int64_t r0, int64_t H,
                                 const E* keys, int64_t S, int64_t n,
                                 float* logits_RL, int64_t L) {
  const int64_t n16 = n - n % kLanes;
  int64_t i = 0;
  for (; i + 4 * kLanes <= n16; i += 4 * kLanes) {
    DotColumns<RC, 4>(q_RH, r0, H, keys + i, S, logits_RL + i, L);
  }
  for (; i < n16; i += kLanes) {
    DotColumns<RC, 1>(q_RH, r0, H, keys + i, S, logits_RL + i, L);
  }
  for (; i < n; ++i) {
    for (int j = 0; j < RC; ++j) {
      float dot = 0.0f;
      for (int64_t h = 0; h < H; ++h) {
        dot += q_RH[(r0 + j) * H + h] * ToFloat(keys[h * S + i]);
      }
      logits_RL[(r0 + j) * L + i] = dot;
    }
  }
}

struct Problem : Step {
  int64_t P, M;  // Paged only.
  const void* keys;
  const void* values;
  const float* key_scale;  // Null for a float cache.
  const float* value_scale;
  const int32_t* page_table;  // Paged only.
};

// The index of block j's first position in the cache's [.., positions]
// order: its values start at this times H, its scales here. Paged: page
// page_table[b, j] of KV head k (checked to be in the pool, CheckPages);
// dense: row b·K + k, position s0.
template <Layout layout>
GQA_LAB_INLINE int64_t FirstOfBlock(const Problem& pr, int64_t b, int64_t k,
                                    int64_t j, int64_t s0) {
  if constexpr (layout == Layout::kPaged) {
    return (k * pr.P + pr.page_table[b * pr.M + j]) * pr.L;
  } else {
    return (b * pr.K + k) * pr.S + s0;
  }
}

// Unit (b, k): out[b, :, k·G:(k+1)·G, :] for its R = G·T query rows.
template <typename E, Layout layout>
GQA_LAB_INLINE void AttendUnit(const Problem& pr, int64_t unit, Scratch& s) {
  const int64_t K = pr.K, H = pr.H, S = pr.S, L = pr.L, R = pr.R();
  const int64_t b = unit / K, k = unit % K;
  BeginUnit(pr, b, k, s);
  const float* q_RH = s.q_RH.data();
  float* logits_RL = s.logits_RL.data();
  const bool* visible_TS = VisibleOfRow(pr, b);
  const E* keys = static_cast<const E*>(pr.keys);
  const E* values = static_cast<const E*>(pr.values);

  for (int64_t s0 = 0, j = 0; s0 < S; s0 += L, ++j) {
    const int64_t n = std::min(L, S - s0);
    if (!SeenInBlock(pr, visible_TS, s0, n, s)) continue;  // Not read.

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

    // Logits [R, n]. Paged keys [p, H], a position's key a row: 16
    // positions at a time (PositionMajorLogits, the key's scale in it).
    // Dense keys [H, S], positions in lanes: kRows rows at a time, each key
    // vector read once for them, then the key's scale.
    if constexpr (layout == Layout::kPaged) {
      PositionMajorLogits(pr, KeyBlock<E>{key_block, H, key_scale, nullptr,
                                          nullptr}, n, s);
    } else {
      int64_t r = 0;
      for (; r + kRows <= R; r += kRows) {
        ColumnLogits<kRows>(q_RH, r, H, key_block, S, n, logits_RL, L);
      }
      for (; r < R; ++r) {
        ColumnLogits<1>(q_RH, r, H, key_block, S, n, logits_RL, L);
      }
      ScaleBlock(pr, n, key_scale, s);
    }

    SoftmaxBlock(pr, visible_TS, s0, n, s);

    ScaleBlock(pr, n, value_scale, s);  // An int8 value's scale: its weight's.
    MixBlock(pr, n, value_block, H, s);
  }
  EndUnit(pr, b, k, s);
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

// Checks what both layouts share and fills the problem's cache fields and
// its Step's; the caller has set B, T, N, K, H, S and L.
ffi::Error CheckCommon(Problem& pr, const char* target,
                       ffi::Buffer<ffi::F32>& query, ffi::AnyBuffer& key,
                       ffi::AnyBuffer& value, ffi::Buffer<ffi::F32>& key_scale,
                       ffi::Buffer<ffi::F32>& value_scale,
                       ffi::Buffer<ffi::PRED>& visible, float scale,
                       float soft_cap, ffi::Result<ffi::Buffer<ffi::F32>>& out,
                       int64_t scale_count) {
  if (key.element_type() != value.element_type()) {
    return Fail(target, "keys and values differ in dtype");
  }
  const bool int8 = key.element_type() == ffi::DataType::S8;
  if (int8 != (key_scale.element_count() > 0) ||
      key_scale.element_count() != value_scale.element_count()) {
    return Fail(target,
                "an int8 cache takes key and value scales, a float one none");
  }
  if (int8 && static_cast<int64_t>(key_scale.element_count()) != scale_count) {
    return Fail(target, "scales " + Dims(key_scale.dimensions()) + " hold " +
                std::to_string(key_scale.element_count()) +
                " values, the cache " + std::to_string(scale_count) +
                " positions and KV heads");
  }
  pr.W = pr.H;
  pr.value = Cover::Of(pr.H);
  if (auto e = CheckStep(target, query, visible, scale, soft_cap, out, pr);
      e.failure()) {
    return e;
  }
  pr.keys = key.untyped_data();
  pr.values = value.untyped_data();
  pr.key_scale = int8 ? key_scale.typed_data() : nullptr;
  pr.value_scale = int8 ? value_scale.typed_data() : nullptr;
  return ffi::Error::Success();
}

// Runs the problem's units with the unit function of its layout and dtype.
ffi::Error Launch(ffi::ThreadPool& pool, const Problem& pr, Layout layout,
                  const char* target, ffi::DataType dtype) {
  UnitFn fn = Select(layout, dtype);
  if (fn == nullptr) {
    return Fail(target, "cache dtype not float32, bfloat16 or int8");
  }
  // A key and a value of H each per position, unit and KV head.
  const int64_t spanned = pr.B * pr.K * pr.S * 2 * pr.H *
                          static_cast<int64_t>(ffi::ByteWidth(dtype));
  Run(pool, pr, fn, spanned);
  return ffi::Error::Success();
}

// Checks the query's head dim against the cache's H.
ffi::Error CheckHeadDim(const char* target, ffi::Buffer<ffi::F32>& query,
                        int64_t H, const Problem& pr) {
  if (pr.H != H) {
    return Fail(target, "query " + Dims(query.dimensions()) +
                " is not [B, T, N, H] with H = " + std::to_string(H) +
                ", the cache's");
  }
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
    return Fail(target, "keys " + Dims(kd) + " and values " +
                Dims(value.dimensions()) + " are not both [K, P, p, H]");
  }
  Problem pr{};
  if (auto e = CheckQuery(target, query, kd[0], pr); e.failure()) return e;
  if (auto e = CheckHeadDim(target, query, kd[3], pr); e.failure()) return e;
  if (auto e = CheckPages(target, kd[1], kd[2], page_table, pr);
      e.failure()) {
    return e;
  }
  pr.P = kd[1];
  pr.M = page_table.dimensions()[1];
  pr.page_table = page_table.typed_data();
  pr.key = Cover::Of(pr.H);  // The keys are position-major: [p, H].
  if (auto e = CheckCommon(pr, target, query, key, value, key_scale,
                           value_scale, visible, scale, soft_cap, out,
                           kd[0] * kd[1] * kd[2]);
      e.failure()) {
    return e;
  }
  return Launch(pool, pr, Layout::kPaged, target, key.element_type());
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
    return Fail(target, "keys " + Dims(kd) + " and values " + Dims(vd) +
                " are not [B·K, H, S] and [B·K, S, H]");
  }
  auto qd = query.dimensions();
  const int64_t B = qd.size() == 4 ? qd[0] : 0;
  if (B < 1 || kd[0] % B) {
    return Fail(target, "query " + Dims(qd) + " is not [B, T, N, H]" +
                " with B dividing the cache's " + std::to_string(kd[0]) +
                " rows");
  }
  Problem pr{};
  if (auto e = CheckQuery(target, query, kd[0] / B, pr); e.failure()) {
    return e;
  }
  if (auto e = CheckHeadDim(target, query, kd[1], pr); e.failure()) return e;
  pr.S = kd[2];
  pr.L = std::min<int64_t>(kDenseBlock, std::max<int64_t>(pr.S, 1));
  if (auto e = CheckCommon(pr, target, query, key, value, key_scale,
                           value_scale, visible, scale, soft_cap, out,
                           kd[0] * kd[2]);
      e.failure()) {
    return e;
  }
  return Launch(pool, pr, Layout::kDense, target, key.element_type());
}

}  // namespace
}  // namespace gqa_lab

// The two symbols Python loads for grouped-query caches (built with
// -fvisibility=hidden, all else stays private to the library).
namespace ffi = xla::ffi;
#define GQA_LAB_EXPORT extern "C" __attribute__((visibility("default")))
GQA_LAB_EXPORT XLA_FFI_Error* GqaLabPagedDecode(XLA_FFI_CallFrame* call_frame);
GQA_LAB_EXPORT XLA_FFI_Error* GqaLabDenseDecode(XLA_FFI_CallFrame* call_frame);

XLA_FFI_DEFINE_HANDLER_SYMBOL(GqaLabPagedDecode, gqa_lab::PagedDecode,
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

XLA_FFI_DEFINE_HANDLER_SYMBOL(GqaLabDenseDecode, gqa_lab::DenseDecode,
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
