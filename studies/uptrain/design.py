"""What the uptraining study trains, in both designs: its constants (the
alphas read, the paper's, the margin), the conversions (`Arm`: K/V heads
by a method, an optimizer start), the source's and an uptraining run's
configs, and the layouts compared by cache bytes (`mla_plan`,
`mla_below_plan`, `gta_plan`, `gla_plan`, `tpa_plan`; a plan holds its
conversion's arguments, `train.convert.to_mla.arguments`)."""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from infra.errors import UserError
from lm import config_lib
from lm import model as model_lib
from train.convert import to_gta, to_mla, to_tpa

ALPHAS = (0.0125, 0.025, 0.05, 0.1, 0.2)  # Each twice the one before.
PAPER_ALPHA = 0.05  # The paper's test point.
NEAR = 0.02  # "Near MHA": at most this many nats above the control.
PILOT_RATES = (1.0, 1 / 3, 1 / 10)  # x the source's peak rate.
METHODS = ('identity', 'mean', 'first', 'random')
RECALL_TARGET = 0.95  # Held-out recall accuracy counted as regained.

# The arms of other layouts, by their runs' method: MHA -> MLA at GQA-K's
# cache bytes (single source); the replicated design's MLA below GQA's
# width, GTA and TPA at (or nearest) its bytes, GLA at its latent width.
MLA = 'mla'  # Its runs: runs/fresh/mla_K{K}, K: GQA's match.
MLA_BELOW = 'mla_half'  # Latent: half GQA-max(K)'s.
GTA = 'gta'  # Grouped-tied attention (`gta_plan`).
GLA = 'gla_half'  # MLA_BELOW's latent in GLA_GROUPS groups.
GLA_GROUPS = 2  # Zadouri et al.'s GLA-2.
TPA = 'tpa'  # Tensor product attention (`tpa_plan`).

# The source-replicated design (issue #49).
FIXED_STEPS = 80  # The fixed read: alpha = 0.05 of the 1,600-step source.
# x the source's peak rate: the rate the single-source study's pilot chose
# (docs/results/uptrain/single_source/), fixed here in advance for every
# source rather than piloted again on each.
RATE_RATIO = 1 / 3
QUICK_SOURCE_STEPS = [200, 400]  # --quick's source lengths.


@dataclasses.dataclass(frozen=True)
class Arm:
  """One conversion: K/V heads by `method`, the optimizer's `start`."""
  method: str
  K: int
  start: str = 'fresh'

  @property
  def name(self) -> str:
    return f'{self.start}/{self.method}_K{self.K}'


def unit_steps(steps: int) -> int:
  """Steps of the smallest alpha; alpha i is this x 2^i steps."""
  return max(1, round(ALPHAS[0] * steps))


def source_config(name: str, steps: int | None):
  config = config_lib.load(name)
  config.model.num_kv_heads = config.model.num_heads
  tc = config.train
  warmup = tc.warmup_steps * (steps or tc.steps) / tc.steps  # Its fraction.
  steps = steps or tc.steps
  config.train.update(steps=steps,
                      warmup_steps=min(max(1, round(warmup)), steps - 1),
                      eval_every=2 * unit_steps(steps),
                      log_every=2 * unit_steps(steps),
                      checkpoint_every=steps, keep_checkpoints=1)
  return config


def uptrain_config(converted, source, steps: int, rate: float, seed: int,
                   eval_every: int, end_ratio: float = 1.0):
  """The converted workdir's config set to uptrain `steps` at `rate`: warmup
  over the first alpha point's steps, then constant (end_ratio 1) or a
  cosine anneal to end_ratio x rate at `steps` (the recipe study's)."""
  config = config_lib.load(str(converted))
  warmup = min(unit_steps(source.train.steps), steps - 1) if steps > 1 else 0
  config.train.update(steps=steps, learning_rate=rate, warmup_steps=warmup,
                      min_learning_rate_ratio=end_ratio,
                      checkpoint_every=steps,
                      keep_checkpoints=1, log_every=eval_every,
                      eval_every=eval_every)
  config.seed = seed
  return config


def plan_arms(N: int, kv_heads: list[int]) -> list[Arm]:
  """The single-source design's conversions: the identity control, mean,
  first and random to each K (fresh Adam), and the control and mean with
  the source's Adam moments carried over (pooled)."""
  return ([Arm('identity', N)] +
          [Arm(m, K) for m in METHODS[1:] for K in kv_heads] +
          [Arm('identity', N, 'pooled')] +
          [Arm('mean', K, 'pooled') for K in kv_heads])


def replicated_arms(N: int, kv_heads: list[int]) -> list[Arm]:
  """The identity control, then mean-pooled, first-head and random (fresh
  K/V heads, drawn once per uptraining seed) to each K."""
  return [Arm('identity', N)] + [Arm(m, K) for m in METHODS[1:]
                                 for K in kv_heads]


def reads(steps: int, fixed: int) -> dict:
  """The uptraining steps read for a source of `steps`: alpha = 0.05 of
  them ('paper') and `fixed`; the run's length and evaluation period."""
  paper = max(1, round(PAPER_ALPHA * steps))
  return {'paper': paper, 'fixed': fixed, 'top': max(paper, fixed),
          'every': math.gcd(paper, fixed)}


# --- layouts of other caches, planned by bytes --------------------------------

def mla_plan(mc, K: int, numbers: int | None = None) -> dict:
  """The MLA conversion of the MHA source `mc` [N heads of H] caching what
  GQA-K caches per token: qk_rope_head_dim Y = 2·N (one RoPE frequency pair
  per head, the fewest `train.convert.to_mla` keeps, so the rest goes to the
  shared latent; 0 without RoPE) and kv_lora_rank R = 2·K·H - Y, so that
  R + Y = 2·K·H numbers per token and layer, as K heads' keys and values.
  Where that R is out of `to_mla`'s range [1, min(D, 2·N·H - Y)], the nearest
  in it (the bytes then differ, and both are recorded). The bytes are
  `lm.model.kv_bytes_per_token`'s, as final.json reports them.
  numbers: R + Y other than 2·K·H (a latent below GQA-K's width, compared
  with GQA-K's bytes all the same)."""
  N, H = mc.num_heads, mc.head_dim
  Y = 2 * N if mc.use_rope else 0
  numbers = 2 * K * H if numbers is None else numbers
  R = min(max(1, numbers - Y), mc.d_model, 2 * N * H - Y)
  pairs = (to_mla.select_pairs(np.zeros((N, H // 2)), Y) if mc.use_rope
           else None)  # Which pairs does not change the cache's size.
  mla_mc, _ = to_mla.target_config(mc, R, Y, pairs)
  return {'K': K, 'kv_lora_rank': R, 'qk_rope_head_dim': Y,
          'd_model': mc.d_model,
          'kv_bytes_per_token': model_lib.kv_bytes_per_token(mla_mc),
          'gqa_kv_bytes_per_token': model_lib.kv_bytes_per_token(
              dataclasses.replace(mc, num_kv_heads=K))}


def mla_below_plan(mc, kv_heads: list[int]) -> dict:
  """MLA whose cache is half of GQA-K's for the largest K (R + Y = K·H
  numbers), so its latent R sits below d_model as in MHA2MLA and TransMLA
  rather than at the width where 2·K·H = d_model makes it near-lossless;
  K = the largest target, method MLA_BELOW."""
  K = max(kv_heads)
  return {**mla_plan(mc, K, numbers=K * mc.head_dim), 'method': MLA_BELOW}


def gta_plan(mc, target_bytes: float, kv_heads: list[int]) -> dict:
  """GTA (`train.convert --to_gta`, K/V heads mean-pooled) of the MHA
  source `mc` [N heads of H] whose cache is nearest `target_bytes` (the
  study passes MLA_BELOW's): over K dividing N and the shared RoPE key's
  width Y (even, 2 .. H - 2; 0 without RoPE) it caches K·H + Y numbers per
  token and layer, against GQA-K's 2·K·H, so equal bytes need not exist; a
  tie goes to the smaller cache (GTA is never given more bytes than a
  layout as near below). partner_K: the mean-pooled GQA arm of kv_heads
  whose bytes are nearest GTA's (ties to the smaller), its comparison.
  Bytes are `lm.model.kv_bytes_per_token`'s."""
  N, H = mc.num_heads, mc.head_dim

  def size(K, Y):
    pairs = np.arange(Y // 2) if mc.use_rope else None  # Any Y / 2 pairs.
    return model_lib.kv_bytes_per_token(to_gta.target_config(
        dataclasses.replace(mc, num_kv_heads=K), Y, pairs)[0])
  widths = range(2, H - 1, 2) if mc.use_rope else (0,)
  layouts = {(K, Y): size(K, Y) for K in range(1, N + 1) if N % K == 0
             for Y in widths}
  (K, Y), got = _nearest(layouts, target_bytes)
  return {'K': K, 'qk_rope_head_dim': Y, 'method': GTA, 'pooling': 'mean',
          'kv_bytes_per_token': got, 'target_kv_bytes_per_token': target_bytes,
          **_partner(mc, got, kv_heads)}


def tpa_plan(mc, target_bytes: float, kv_heads: list[int]) -> dict:
  """TPA (`train.convert --to_tpa`: K/V heads mean-pooled to K, then key
  and value factors of rank K whose head factors start one-hot) of the MHA
  source `mc` [N heads of H] whose cache is nearest `target_bytes` (the
  study passes MLA_BELOW's): over K dividing N it caches 2·K·(N + H)
  numbers per token and layer, (N + H) / H times GQA-K's 2·K·H, so equal
  bytes need not exist; a tie goes to the smaller cache, as `gta_plan`'s.
  partner_K: the mean-pooled GQA arm of kv_heads whose bytes are nearest
  TPA's (ties to the smaller), its comparison. Where partner_K is K, the
  conversion computes the partner's conversion exactly (`to_tpa`), so the
  two differ at step 0 by rounding alone: the comparison's control.
  Bytes are `lm.model.kv_bytes_per_token`'s."""
  N = mc.num_heads
  layouts = {K: model_lib.kv_bytes_per_token(to_tpa.target_config(
      dataclasses.replace(mc, num_kv_heads=K))[0])
             for K in range(1, N + 1) if N % K == 0}
  K, got = _nearest(layouts, target_bytes)
  return {'K': K, 'method': TPA, 'pooling': 'mean',
          'kv_bytes_per_token': got, 'target_kv_bytes_per_token': target_bytes,
          **_partner(mc, got, kv_heads)}


def _nearest(sizes: dict, target: float) -> tuple:
  """(the key, its bytes) of SIZES {layout: bytes per token} nearest
  `target`; a tie goes to the smaller cache."""
  return min(sizes.items(), key=lambda kv: (abs(kv[1] - target), kv[1]))


def _partner(mc, got: float, kv_heads: list[int]) -> dict:
  """The mean-pooled GQA arm of kv_heads whose cache is nearest `got`
  bytes per token (a tie to the smaller cache) and its bytes."""
  partner, size = _nearest({k: model_lib.kv_bytes_per_token(
      dataclasses.replace(mc, num_kv_heads=k)) for k in kv_heads}, got)
  return {'partner_K': partner, 'partner_kv_bytes_per_token': size}


def gla_plan(mc, kv_heads: list[int], groups: int = GLA_GROUPS
             ) -> dict | None:
  """GLA (`train.convert --to_mla --latent_groups=groups`) of the MHA
  source `mc` at `mla_below_plan`'s latent width and RoPE dims, so its
  cache bytes are MLA_BELOW's; None where the groups do not divide the
  source's K (= N) and the latent (`to_mla.check_source`'s rule)."""
  below = mla_below_plan(mc, kv_heads)
  latent = to_mla.latent(below)
  try:
    to_mla.check_source(mc, latent.width, latent.rope, groups)
  except UserError:
    return None
  pairs = (to_mla.select_pairs(np.zeros((mc.num_heads, mc.head_dim // 2)),
                               latent.rope) if mc.use_rope else None)
  gla_mc, _ = to_mla.target_config(mc, latent.width, latent.rope, pairs,
                                   groups)
  return {**below, 'method': GLA, 'latent_groups': groups,
          'kv_bytes_per_token': model_lib.kv_bytes_per_token(gla_mc),
          'mla_kv_bytes_per_token': below['kv_bytes_per_token']}
