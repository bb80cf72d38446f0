"""The stock MoE decoder runs: DeepSeek's FP8 recipes by rules.

`StockMoe` is written with stock Flax nnx and JAX only (nothing aqtr in
it): the attention of `aqtr.train.stock_lm` (RMSNorm, rotary embeddings,
grouped-query attention with raw `jnp.einsum`, `nnx.Linear` projections),
and in place of the dense MLP a mixture of experts: a router
(`nnx.Linear`, softmax over the top-k logits), the experts' SwiGLU as
three `jax.lax.ragged_dot`s over tokens sorted by expert, and a tied
embedding (`nnx.Embed.attend`). A run quantizes it by rules
(`aqtr.flax.quantize`) without editing it, trains it on the job's data
with the job's loop (`aqtr.train.loop.fit`: the calibration state rides
along), then converts it and checks serve == train.

Runs (`aqtr.train.runs.MoeRun`; rules `rules(name, tile)`): the router
and the tied embedding / logits stay float (as in DeepSeek-V3), every
other weight op (attention projections, experts) is quantized:

  moe_float           no rules
  moe_fp8             e4m3 forward, e5m2 gradients, current per-channel
                      scales (`aqtr.presets.fp8`)
  moe_fp8_delayed     per-tensor delayed scaling (amax history, state in
                      'aqtr_state'; `aqtr.presets.fp8_delayed`)
  moe_maxtext_fp8     MaxText's DeepSeek fine-tuning recipe
                      (`aqtr.presets.maxtext_deepseek_fp8`): static
                      activation ranges from a CALIBRATE pass over
                      `CALIBRATE_BATCHES` training batches first
  moe_deepseek_v3_fp8 the DeepSeek-V3 paper's blockwise recipe
                      (`aqtr.presets.deepseek_v3_fp8`: 1 x tile activation
                      tiles, tile x tile weight blocks, online scales)

Example:
  >>> import jax.numpy as jnp
  >>> m = StockMoe(vocab_size=16, d_model=8, num_layers=1, num_heads=2,
  ...              rngs=nnx.Rngs(0))
  >>> m(jnp.zeros((1, 4), int)).shape
  (1, 4, 16)
"""

from __future__ import annotations

import itertools
import math
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

import aqtr
import aqtr.flax
from aqtr.rules import Rule
from aqtr.train import loop
from aqtr.train.stock_lm import attention, init_attention, sizes
from aqtr.train.tasks import Task

__all__ = [
  'CALIBRATE_BATCHES',
  'NAMES',
  'MoeBlock',
  'StockMoe',
  'rules',
  'tile_for',
  'train',
]

CALIBRATE_BATCHES = 4  # Training batches the static-range recipe sees first.
NAMES = (
  'moe_float',
  'moe_fp8',
  'moe_fp8_delayed',
  'moe_maxtext_fp8',
  'moe_deepseek_v3_fp8',
)


class MoeBlock(nnx.Module):
  """Pre-norm block: grouped-query attention, then top-k routed experts."""

  def __init__(
    self, d_model, num_heads, kv_heads, hidden, experts, top_k, *, rngs
  ):
    init_attention(self, d_model, num_heads, kv_heads, rngs)
    self.experts, self.top_k = experts, top_k
    self.router = nnx.Linear(d_model, experts, use_bias=False, rngs=rngs)
    init = nnx.initializers.lecun_normal()
    self.gate = nnx.Param(init(rngs.params(), (experts, d_model, hidden)))
    self.up = nnx.Param(init(rngs.params(), (experts, d_model, hidden)))
    self.down = nnx.Param(init(rngs.params(), (experts, hidden, d_model)))

  def moe(self, x: jax.Array) -> jax.Array:
    """Top-k routing; each expert's SwiGLU as `lax.ragged_dot`s."""
    shape, d = x.shape, x.shape[-1]
    x = x.reshape(-1, d)
    weights, chosen = jax.lax.top_k(self.router(x), self.top_k)
    weights = jax.nn.softmax(weights, -1).reshape(-1)
    expert = chosen.reshape(-1)
    order = jnp.argsort(expert)
    token = order // self.top_k
    sizes = jnp.bincount(expert, length=self.experts).astype(jnp.int32)
    xs = x[token]
    h = jax.nn.silu(jax.lax.ragged_dot(xs, self.gate[...], sizes))
    h = h * jax.lax.ragged_dot(xs, self.up[...], sizes)
    y = jax.lax.ragged_dot(h, self.down[...], sizes) * weights[order, None]
    return jnp.zeros_like(x).at[token].add(y).reshape(shape)

  def __call__(self, x: jax.Array) -> jax.Array:
    x = attention(self, x)
    return x + self.moe(self.mlp_norm(x))


class StockMoe(nnx.Module):
  """MoE decoder LM of stock nnx layers and `lax.ragged_dot`; tied embedding.

  Args:
    vocab_size: tokens.
    d_model: width (a multiple of `num_heads`, head size even).
    num_layers: blocks.
    num_heads: query heads (key/value heads: half, at least 1).
    experts: routed experts per block.
    top_k: experts per token.
    hidden: each expert's SwiGLU width (None: d_model).
    rngs: parameter initialisation.
  """

  def __init__(
    self,
    vocab_size: int,
    d_model: int,
    num_layers: int,
    num_heads: int,
    experts: int = 4,
    top_k: int = 2,
    hidden: int | None = None,
    *,
    rngs: nnx.Rngs,
  ):
    kv_heads = max(num_heads // 2, 1)
    if d_model % num_heads or not 1 <= top_k <= experts:
      raise ValueError(
        f'StockMoe: d_model ({d_model}) must divide by num_heads '
        f'({num_heads}) and 1 <= top_k ({top_k}) <= experts ({experts}).'
      )
    self.embed = nnx.Embed(vocab_size, d_model, rngs=rngs)
    self.blocks = nnx.List(
      MoeBlock(
        d_model,
        num_heads,
        kv_heads,
        hidden or d_model,
        experts,
        top_k,
        rngs=rngs,
      )
      for _ in range(num_layers)
    )
    self.norm = nnx.RMSNorm(d_model, rngs=rngs)

  def __call__(self, ids: jax.Array) -> jax.Array:
    x = self.embed(ids)
    for block in self.blocks:
      x = block(x)
    return self.embed.attend(self.norm(x))


def tile_for(*sizes: int, tile: int = 128) -> int:
  """The blockwise recipe's tile: `tile`, or the largest power of two that
  divides every contraction of a smaller model (its `sizes`).

  Example:
    >>> tile_for(128, 1024), tile_for(32, 256)
    (128, 32)
  """
  g = math.gcd(tile, *sizes)
  return 1 << (g.bit_length() - 1)


def rules(name: str, tile: int = 128) -> tuple[Rule, ...] | None:
  """The rules of the MoE run `name` (None: float).

  The router and the tied embedding (lookup and logits) stay float; the
  experts' ragged dots get the recipe's expert config, every other weight
  op (attention projections) its dot config.

  Example:
    >>> [r.label() for r in rules('moe_fp8')]  # doctest: +NORMALIZE_WHITESPACE
    ['router float', 'embedding float', "Rule('fp8', op=ragged_dot)",
     "Rule('fp8', weight=True)"]
  """
  if name not in NAMES:
    raise ValueError(f'stock_moe: unknown run {name!r}; runs: {NAMES}.')
  if name == 'moe_float':
    return None
  dots = experts = name.removeprefix('moe_')
  if name == 'moe_deepseek_v3_fp8':
    dots = aqtr.presets.deepseek_v3_fp8(tile)
    experts = aqtr.presets.deepseek_v3_fp8(tile, experts=True)
  elif name == 'moe_maxtext_fp8':
    dots = experts = aqtr.presets.maxtext_deepseek_fp8()
  return (
    Rule(None, path='.*router', name='router float'),
    Rule(None, path='embed', name='embedding float'),
    Rule(experts, op='ragged_dot'),
    Rule(dots, weight=True),
  )


def build(name: str, exp: Any, template: Any, x0) -> Any:
  """The run's model: `StockMoe` of the template's sizes, quantized."""
  size = sizes(template)
  model = StockMoe(**size, rngs=nnx.Rngs(exp.seed))
  d, heads = size['d_model'], size['num_heads']
  kv = max(heads // 2, 1) * (d // heads)  # k and v's width
  cut = rules(name, tile_for(d, kv, x0.size))
  return model if cut is None else aqtr.flax.quantize(model, cut)


def train(
  name: str,
  exp: Any,
  task: Task,
  template: Any,
  *,
  on_record=None,
  show_progress: bool = False,
) -> loop.RunResult:
  """Trains MoE run `name` on the job's data (see the module docstring).

  Returns:
    A `loop.RunResult`; `injected` is the trained nnx model (with its
    calibration state), `report` its `aqtr.rules.Report` (or 'float').
  """
  if task.name != 'lm':
    raise ValueError(f"runs: {name!r} needs task 'lm', got {task.name!r}.")
  batches = task.batches()
  x0 = jnp.asarray(next(task.batches())[0])
  model = build(name, exp, template, x0)
  report: Any = 'float (no rules)'
  if name != 'moe_float':
    report = aqtr.flax.report(model, x0)
  if name == 'moe_maxtext_fp8':  # Static ranges from the first batches.
    calib = itertools.islice(task.batches(), CALIBRATE_BATCHES)
    aqtr.flax.calibrate(model, [jnp.asarray(x) for x, _ in calib])
  else:
    model(x0)  # Creates the calibration state, if any.
  graphdef, params, state, rest = nnx.split(
    model, nnx.Param, aqtr.flax.rule_state.QuantState, ...
  )

  def apply(p, s, frozen, x, step):
    del step
    m = nnx.merge(graphdef, p, s, frozen)
    out = m(x)
    return out, nnx.state(m, aqtr.flax.rule_state.QuantState)

  f = loop.fit_task(
    name,
    loop.Trainee(params=params, apply=apply, state=state, frozen=rest),
    loop.optimizer(exp),
    batches,
    exp,
    task,
    on_record=on_record,
    show_progress=show_progress,
  )
  return loop.RunResult.of(
    f,
    name=name,
    config=aqtr.presets.float(),
    injected=nnx.merge(graphdef, f.params, f.state, rest),
    report=report,
    param_opt_bytes=_nbytes(f.params) + _nbytes(f.opt_state),
  )


def _nbytes(tree: Any) -> int:
  return sum(x.nbytes for x in jax.tree.leaves(tree) if hasattr(x, 'nbytes'))
