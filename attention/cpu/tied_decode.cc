// Decode attention against a cached state that serves as both key and
// value, for XLA's CPU, as two FFI custom calls (attention/cpu_kernel.py
// registers and calls them): grouped-tied attention's tied states (GTA,
// attention/tied.py) and, absorbed, multi-head latent attention's latents
// (MLA and its grouped form GLA, attention/latent.py).
//
// Letters as in decode_common.h, and Y the shared RoPE key's features (0:
// none), I = H - Y the query features that meet a state's first I.
//
// The cache holds per position one state t [W] per head (K of them) and one
// RoPE key rk [Y] shared by the heads. A work unit (batch row b, head k)
// streams that head's states block by block (a page, or DenseStateBlock
// positions of a dense cache) and reads each block ONCE for both products:
// row r's logit at position s is
//   (q[r, :I]·t[s, :I] · t_scale[s] + q[r, I:]·rk[s] · rope_scale[s])
//     · scale, soft-capped,
// the online softmax turns the block's logits into weights, and
//   acc[r] += weight[r, s] · t_scale[s] · t[s]   ([W])
// reads the same block again from L1, where the logits left it. The scales
// are the int8 cache's (1 for a float cache). A row's RoPE keys are the same
// for its K units, which are claimed one after another (Run), so all but the
// first unit read them from the CPU's caches.
//
//   GTA: t is a KV head's tied state, W = H: its value, and t[:I] the
//     positionless part of its key (I = H - Y); the output is the heads'.
//   MLA, GLA (absorbed): t is a latent group's latent c, W = F = A / G; the
//     query q = [q_nope·key_upᵀ, q_rope] (H = F + Y) meets all of c (I = F)
//     and the RoPE key; the output is the heads' weighted sums of latents
//     [.., F], which value_up turns into values (latent.py).
//
//   gqa_lab_paged_tied_decode: states [K, P, p, W] and RoPE keys
//     [1, P, p, Y] through page_table [B, M], in place (S = M·p); int8
//     scales [K, P, p] and [1, P, p].
//   gqa_lab_dense_tied_decode: states [B·K, S, W] and RoPE keys [B, S, Y]
//     (attention.Attention's GTA and MLA caches); int8 scales [B·K, S] and
//     [B, S].
//
// Both take query [B, T, N, H] float32 (its last Y features turned by RoPE),
// a visibility mask [B or 1, T, S] (true = attend), the scales (empty [0]
// for a float cache, and the RoPE key's when Y = 0) and return [B, T, N, W]
// float32; a query that sees no position gets zeros. Multi-versioned as
// grouped_decode.cc (x86-64-v4, v3, baseline).

#include "decode_common.h"

namespace gqa_lab {
namespace {

struct TiedProblem : Step {
  int64_t P, M;  // Paged only.
  const void* tied;
  const void* rope_key;  // Nothing read when Y = 0.
  const float* tied_scale;  // Null for a float cache.
  const float* rope_scale;  // Null for a float cache, or Y = 0.
  const int32_t* page_table;  // Paged only.
};

// Where block j starts, in positions of the tied states' [.., positions]
// order (their features start at this times W, their scales here) and of
// the RoPE keys'. Paged: page page_table[b, j] (checked to be in the pool,
// CheckPages), of KV head k for the tied states; dense: row b·K + k, and
// row b, from position s0.
struct BlockStart {
  int64_t tied, rope;
};

template <Layout layout>
GQA_LAB_INLINE BlockStart StartOfBlock(const TiedProblem& pr, int64_t b,
                                       int64_t k, int64_t j, int64_t s0) {
  if constexpr (layout == Layout::kPaged) {
    const int64_t page = pr.page_table[b * pr.M + j];
    return {(k * pr.P + page) * pr.L, page * pr.L};
  } else {
    return {(b * pr.K + k) * pr.S + s0, b * pr.S + s0};
  }
}

// Unit (b, k): out[b, :, k·G:(k+1)·G, :] for its R = G·T query rows.
template <typename E, Layout layout>
GQA_LAB_INLINE void TiedUnit(const TiedProblem& pr, int64_t unit,
                             Scratch& s) {
  const int64_t K = pr.K, W = pr.W, Y = pr.rope.width, S = pr.S, L = pr.L;
  const int64_t b = unit / K, k = unit % K;
  BeginUnit(pr, b, k, s);
  const bool* visible_TS = VisibleOfRow(pr, b);
  const E* tied = static_cast<const E*>(pr.tied);
  const E* rope_key = static_cast<const E*>(pr.rope_key);

  for (int64_t s0 = 0, j = 0; s0 < S; s0 += L, ++j) {
    const int64_t n = std::min(L, S - s0);
    if (!SeenInBlock(pr, visible_TS, s0, n, s)) continue;  // Not read.

    // The block's tied states [n, W], RoPE keys [n, Y] and scales [n].
    const BlockStart at = StartOfBlock<layout>(pr, b, k, j, s0);
    const E* t = tied + at.tied * W;
    const E* rk = rope_key + at.rope * Y;
    const float* ts = pr.tied_scale ? pr.tied_scale + at.tied : nullptr;
    const float* rs = pr.rope_scale ? pr.rope_scale + at.rope : nullptr;
    if (layout == Layout::kPaged && s0 + L < S) {
      // The next page lies elsewhere in the pool, where the CPU's prefetcher
      // does not look: its lines are fetched while this page is computed.
      // (A dense cache's next block follows this one in memory.)
      const BlockStart next = StartOfBlock<layout>(pr, b, k, j + 1, s0 + L);
      Prefetch(tied + next.tied * W, L * W);
      Prefetch(rope_key + next.rope * Y, L * Y);
      if (ts != nullptr) Prefetch(pr.tied_scale + next.tied, L);
      if (rs != nullptr) Prefetch(pr.rope_scale + next.rope, L);
    }

    // Logits [R, n]: q[:I]·t[:I] · ts + q[I:]·rk · rs, 16 positions at a
    // time; an unseen position's logit is computed or not (it is masked).
    PositionMajorLogits(pr, KeyBlock<E>{t, W, ts, rk, rs}, n, s);

    SoftmaxBlock(pr, visible_TS, s0, n, s);

    // The values are the same tied states, now in L1; an int8 state's
    // scale joins its weight.
    ScaleBlock(pr, n, ts, s);
    MixBlock(pr, n, t, W, s);
  }
  EndUnit(pr, b, k, s);
}

using UnitFn = void (*)(const TiedProblem&, int64_t, Scratch&);

#define GQA_LAB_UNIT(name, E, layout)                                       \
  GQA_LAB_CLONES void name(const TiedProblem& pr, int64_t u, Scratch& s) { \
    TiedUnit<E, layout>(pr, u, s);                                          \
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

// Fills the problem's widths from the query's H, the tied states' W and
// the RoPE keys' Y, refusing a query that is not I + Y features with I <= W.
ffi::Error CheckWidths(const char* target, ffi::Span<const int64_t> qd,
                       int64_t W, int64_t Y, TiedProblem& pr) {
  const int64_t I = pr.H - Y;
  if (I < 0 || I > W) {
    return Fail(target, "query " + Dims(qd) + " has H = " +
                std::to_string(pr.H) + " features, not I + Y with Y = " +
                std::to_string(Y) + " (the RoPE keys') and 0 <= I <= W = " +
                std::to_string(W) + " (the tied states')");
  }
  pr.W = W;
  pr.key = Cover::Of(I);
  pr.rope = Cover::Of(Y);
  pr.value = Cover::Of(W);
  return ffi::Error::Success();
}

// Checks what both layouts share, fills the problem's cache fields and its
// Step's, and runs it; the caller has set B, T, N, K, H, W, the covers, S
// and L. The cache holds tied_positions positions of the K heads' tied
// states and rope_positions of RoPE keys (each a scale when int8).
ffi::Error CheckAndRun(ffi::ThreadPool& pool, TiedProblem& pr, Layout layout,
                       const char* target, ffi::Buffer<ffi::F32>& query,
                       ffi::AnyBuffer& tied, ffi::AnyBuffer& rope_key,
                       ffi::Buffer<ffi::F32>& tied_scale,
                       ffi::Buffer<ffi::F32>& rope_scale,
                       ffi::Buffer<ffi::PRED>& visible, float scale,
                       float soft_cap, ffi::Result<ffi::Buffer<ffi::F32>>& out,
                       int64_t tied_positions, int64_t rope_positions) {
  const ffi::DataType dtype = tied.element_type();
  const int64_t Y = pr.rope.width;
  if (Y > 0 && rope_key.element_type() != dtype) {
    return Fail(target, "tied states and RoPE keys differ in dtype");
  }
  const bool int8 = dtype == ffi::DataType::S8;
  const int64_t tied_count = tied_scale.element_count();
  const int64_t rope_count = rope_scale.element_count();
  const int64_t want_rope = int8 && Y > 0 ? rope_positions : 0;
  if (tied_count != (int8 ? tied_positions : 0) || rope_count != want_rope) {
    return Fail(target, "scales " + Dims(tied_scale.dimensions()) + " and " +
                Dims(rope_scale.dimensions()) + " are not " +
                (int8 ? "one per position of the tied states (" +
                            std::to_string(tied_positions) +
                            ") and of the RoPE keys (" +
                            std::to_string(want_rope) + ")"
                      : std::string("empty (a float cache)")));
  }
  if (auto e = CheckStep(target, query, visible, scale, soft_cap, out, pr);
      e.failure()) {
    return e;
  }
  pr.tied = tied.untyped_data();
  pr.rope_key = rope_key.untyped_data();
  pr.tied_scale = int8 ? tied_scale.typed_data() : nullptr;
  pr.rope_scale = int8 && Y > 0 ? rope_scale.typed_data() : nullptr;
  UnitFn fn = Select(layout, dtype);
  if (fn == nullptr) {
    return Fail(target, "cache dtype not float32, bfloat16 or int8");
  }
  // Per row and position: K tied states of W and one RoPE key of Y.
  const int64_t spanned = pr.B * pr.S * (pr.K * pr.W + Y) *
                          static_cast<int64_t>(ffi::ByteWidth(dtype));
  Run(pool, pr, fn, spanned);
  return ffi::Error::Success();
}

ffi::Error PagedTiedDecode(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> query,
                           ffi::AnyBuffer tied, ffi::AnyBuffer rope_key,
                           ffi::Buffer<ffi::F32> tied_scale,
                           ffi::Buffer<ffi::F32> rope_scale,
                           ffi::BufferR2<ffi::S32> page_table,
                           ffi::Buffer<ffi::PRED> visible, float scale,
                           float soft_cap,
                           ffi::Result<ffi::Buffer<ffi::F32>> out) {
  const char* target = "gqa_lab_paged_tied_decode";
  auto td = tied.dimensions(), rd = rope_key.dimensions();
  if (td.size() != 4 || rd.size() != 4 || rd[0] != 1 || rd[1] != td[1] ||
      rd[2] != td[2]) {
    return Fail(target, "tied states " + Dims(td) + " and RoPE keys " +
                Dims(rd) + " are not [K, P, p, W] and [1, P, p, Y]");
  }
  TiedProblem pr{};
  if (auto e = CheckQuery(target, query, td[0], pr); e.failure()) return e;
  if (auto e = CheckWidths(target, query.dimensions(), td[3], rd[3], pr);
      e.failure()) {
    return e;
  }
  if (auto e = CheckPages(target, td[1], td[2], page_table, pr);
      e.failure()) {
    return e;
  }
  pr.P = td[1];
  pr.M = page_table.dimensions()[1];
  pr.page_table = page_table.typed_data();
  return CheckAndRun(pool, pr, Layout::kPaged, target, query, tied, rope_key,
                     tied_scale, rope_scale, visible, scale, soft_cap, out,
                     td[0] * td[1] * td[2], td[1] * td[2]);
}

ffi::Error DenseTiedDecode(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> query,
                           ffi::AnyBuffer tied, ffi::AnyBuffer rope_key,
                           ffi::Buffer<ffi::F32> tied_scale,
                           ffi::Buffer<ffi::F32> rope_scale,
                           ffi::Buffer<ffi::PRED> visible, float scale,
                           float soft_cap,
                           ffi::Result<ffi::Buffer<ffi::F32>> out) {
  const char* target = "gqa_lab_dense_tied_decode";
  auto td = tied.dimensions(), rd = rope_key.dimensions();
  auto qd = query.dimensions();
  const int64_t B = qd.size() == 4 ? qd[0] : 0;
  if (td.size() != 3 || rd.size() != 3 || B < 1 || td[0] % B ||
      rd[0] != B || rd[1] != td[1]) {
    return Fail(target, "tied states " + Dims(td) + " and RoPE keys " +
                Dims(rd) + " are not [B·K, S, W] and [B, S, Y], with B = " +
                "the query " + Dims(qd) + "'s first");
  }
  TiedProblem pr{};
  if (auto e = CheckQuery(target, query, td[0] / B, pr); e.failure()) {
    return e;
  }
  if (auto e = CheckWidths(target, qd, td[2], rd[2], pr); e.failure()) {
    return e;
  }
  pr.S = td[1];
  const int64_t position_bytes =
      (td[2] + rd[2]) * static_cast<int64_t>(ffi::ByteWidth(
                            tied.element_type()));
  pr.L = std::min<int64_t>(DenseStateBlock(position_bytes),
                           std::max<int64_t>(pr.S, 1));
  return CheckAndRun(pool, pr, Layout::kDense, target, query, tied, rope_key,
                     tied_scale, rope_scale, visible, scale, soft_cap, out,
                     td[0] * td[1], B * td[1]);
}

}  // namespace
}  // namespace gqa_lab

// The two symbols Python loads for tied caches (built with
// -fvisibility=hidden, all else stays private to the library).
namespace ffi = xla::ffi;
#define GQA_LAB_EXPORT extern "C" __attribute__((visibility("default")))
GQA_LAB_EXPORT XLA_FFI_Error* GqaLabPagedTiedDecode(
    XLA_FFI_CallFrame* call_frame);
GQA_LAB_EXPORT XLA_FFI_Error* GqaLabDenseTiedDecode(
    XLA_FFI_CallFrame* call_frame);

XLA_FFI_DEFINE_HANDLER_SYMBOL(GqaLabPagedTiedDecode, gqa_lab::PagedTiedDecode,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // query
                                  .Arg<ffi::AnyBuffer>()  // tied [K, P, p, W]
                                  .Arg<ffi::AnyBuffer>()  // rope [1, P, p, Y]
                                  .Arg<ffi::Buffer<ffi::F32>>()  // tied_scale
                                  .Arg<ffi::Buffer<ffi::F32>>()  // rope_scale
                                  .Arg<ffi::BufferR2<ffi::S32>>()  // table
                                  .Arg<ffi::Buffer<ffi::PRED>>()  // visible
                                  .Attr<float>("scale")
                                  .Attr<float>("soft_cap")
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(GqaLabDenseTiedDecode, gqa_lab::DenseTiedDecode,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // query
                                  .Arg<ffi::AnyBuffer>()  // tied [B·K, S, W]
                                  .Arg<ffi::AnyBuffer>()  // rope [B, S, Y]
                                  .Arg<ffi::Buffer<ffi::F32>>()  // tied_scale
                                  .Arg<ffi::Buffer<ffi::F32>>()  // rope_scale
                                  .Arg<ffi::Buffer<ffi::PRED>>()  // visible
                                  .Attr<float>("scale")
                                  .Attr<float>("soft_cap")
                                  .Ret<ffi::Buffer<ffi::F32>>());
