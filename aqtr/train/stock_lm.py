"""The stock-model runs: a Llama-style nnx decoder quantized by rules.

`StockLm` is written with stock Flax nnx only (nothing aqtr in it):
RMSNorm, rotary position embeddings (arXiv 2104.09864), grouped-query
attention (arXiv 2305.13245) with raw `jnp.einsum`, a SwiGLU MLP (arXiv
2002.05202) of `nnx.Linear`s and a tied embedding (the logits are
`nnx.Embed.attend`). A run quantizes it without editing its
code, by rules (`aqtr.flax.quantize`, `aqtr.rules.Rule`), trains it on the
job's data with the job's optimizer, then converts it (`aqtr.flax.convert`:
frozen int8 kernels) and checks that serving gives the training logits bit
for bit on the validation set.

Runs (`aqtr.train.runs.StockRun`; their rules: `RULES`,
`Experiment.stock_rules` adds 'stock_custom'):

  stock_float   the float model (no rules)
  stock_int8    int8 forward and gradients on every weight op; attention's
                activation x activation einsums stay float
  stock_custom  the experiment's `stock_rules` (fiddler `stock_rule`)

The tied table is read by the lookup too, so `convert` keeps it float
(`keep`): its logits op quantizes it on the fly in SERVE.

Example:
  >>> import jax.numpy as jnp
  >>> from flax import nnx
  >>> m = StockLm(vocab_size=16, d_model=8, num_layers=1, num_heads=2,
  ...             rngs=nnx.Rngs(0))
  >>> m(jnp.zeros((1, 4), int)).shape
  (1, 4, 16)
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import fiddle as fdl
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import aqtr
import aqtr.flax
from aqtr.ptq import fold
from aqtr.rules import Rule
from aqtr.train import loop
from aqtr.train.tasks import Task

__all__ = [
  'KEEP',
  'RULES',
  'StockLm',
  'attention',
  'float_bytes',
  'fold_map',
  'init_attention',
  'rope',
  'serve',
  'sizes',
  'stock_rule',
  'train',
]

# Parameters `convert` keeps float: the tied table (also looked up).
KEEP = 'embed/embedding'

# The fixed stock runs: name -> rules (None: the float model).
RULES: dict[str, tuple[Rule, ...] | None] = {
  'stock_float': None,
  'stock_int8': (Rule('int8', weight=True),),
}


def rope(x: jax.Array, base: float = 10000.0) -> jax.Array:
  """Rotary position embedding of `x` [batch, time, ..., head_dim].

  Pairs (x_i, x_{i+d/2}) rotate by angle t * base^(-2i/d) (arXiv
  2104.09864).
  """
  t, d = x.shape[1], x.shape[-1]
  freq = base ** (-jnp.arange(0, d // 2, dtype=jnp.float32) * 2 / d)
  angle = jnp.arange(t, dtype=jnp.float32)[:, None] * freq[None, :]
  shape = (1, t) + (1,) * (x.ndim - 3) + (d // 2,)
  cos, sin = jnp.cos(angle).reshape(shape), jnp.sin(angle).reshape(shape)
  a, b = jnp.split(x, 2, axis=-1)
  return jnp.concatenate([a * cos - b * sin, a * sin + b * cos], -1)


def init_attention(block, d_model, num_heads, kv_heads, rngs) -> None:
  """Gives a pre-norm block its attention: `attn_norm`, grouped-query
  projections `q`, `k`, `v`, `o` (no bias), and the MLP's `mlp_norm`."""
  block.heads, block.kv_heads = num_heads, kv_heads
  block.head_dim = d_model // num_heads
  kv = kv_heads * block.head_dim
  lin = dict(use_bias=False, rngs=rngs)
  block.attn_norm = nnx.RMSNorm(d_model, rngs=rngs)
  block.q = nnx.Linear(d_model, d_model, **lin)
  block.k = nnx.Linear(d_model, kv, **lin)
  block.v = nnx.Linear(d_model, kv, **lin)
  block.o = nnx.Linear(d_model, d_model, **lin)
  block.mlp_norm = nnx.RMSNorm(d_model, rngs=rngs)


def attention(block, x: jax.Array) -> jax.Array:
  """`x` plus the block's causal grouped-query attention (rope on q, k)."""
  b, t, _ = x.shape
  g, hd = block.heads // block.kv_heads, block.head_dim
  h = block.attn_norm(x)
  q = rope(block.q(h).reshape(b, t, block.kv_heads, g, hd))
  k = rope(block.k(h).reshape(b, t, block.kv_heads, hd))
  v = block.v(h).reshape(b, t, block.kv_heads, hd)
  s = jnp.einsum('bqkgd,bskd->bkgqs', q, k) / hd**0.5
  s = jnp.where(jnp.tril(jnp.ones((t, t), bool)), s, -1e9)
  a = jnp.einsum('bkgqs,bskd->bqkgd', jax.nn.softmax(s), v)
  return x + block.o(a.reshape(b, t, -1))


class Block(nnx.Module):
  """Pre-norm decoder block: grouped-query attention and SwiGLU."""

  def __init__(self, d_model, num_heads, kv_heads, hidden, *, rngs):
    init_attention(self, d_model, num_heads, kv_heads, rngs)
    lin = dict(use_bias=False, rngs=rngs)
    self.gate = nnx.Linear(d_model, hidden, **lin)
    self.up = nnx.Linear(d_model, hidden, **lin)
    self.down = nnx.Linear(hidden, d_model, **lin)

  def __call__(self, x: jax.Array) -> jax.Array:
    x = attention(self, x)
    h = self.mlp_norm(x)
    return x + self.down(jax.nn.silu(self.gate(h)) * self.up(h))


class StockLm(nnx.Module):
  """Llama-style decoder LM of stock nnx layers; tied embedding.

  Args:
    vocab_size: tokens.
    d_model: width (a multiple of `num_heads`, head size even).
    num_layers: blocks.
    num_heads: query heads.
    kv_heads: key/value heads (grouped-query attention); None: half of
      `num_heads` (at least 1).
    mlp_ratio: SwiGLU hidden size / d_model.
    rngs: parameter initialisation.
  """

  def __init__(
    self,
    vocab_size: int,
    d_model: int,
    num_layers: int,
    num_heads: int,
    kv_heads: int | None = None,
    mlp_ratio: int = 4,
    *,
    rngs: nnx.Rngs,
  ):
    kv_heads = kv_heads or max(num_heads // 2, 1)
    if d_model % num_heads or num_heads % kv_heads:
      raise ValueError(
        f'StockLm: d_model ({d_model}) must divide by num_heads '
        f'({num_heads}), which must divide by kv_heads ({kv_heads}).'
      )
    self.embed = nnx.Embed(vocab_size, d_model, rngs=rngs)
    self.blocks = nnx.List(
      Block(d_model, num_heads, kv_heads, mlp_ratio * d_model, rngs=rngs)
      for _ in range(num_layers)
    )
    self.norm = nnx.RMSNorm(d_model, rngs=rngs)

  def __call__(self, ids: jax.Array) -> jax.Array:
    x = self.embed(ids)
    for block in self.blocks:
      x = block(x)
    return self.embed.attend(self.norm(x))


def sizes(template: Any) -> dict[str, int]:
  """`StockLm`'s size arguments taken from the job's LM template."""
  return _sizes(template)


def _sizes(template: Any) -> dict[str, int]:
  """The Pax LM template's sizes, for a stock model of the same shape."""
  try:
    emb, layers = template.embedding, template.layers
    return dict(
      vocab_size=emb.num_embeddings,
      d_model=emb.features,
      num_layers=len(layers),
      num_heads=layers[0].attention.num_heads,
    )
  except (AttributeError, IndexError, TypeError) as e:
    raise ValueError(
      'runs: the stock runs take their sizes from the LM template '
      f'(aqtr.train.models.lm); got {type(template).__name__}: {e}.'
    ) from e


def train(
  name: str,
  exp: Any,
  task: Task,
  template: Any,
  *,
  rules: tuple[Rule, ...] | None = None,
  on_record=None,
  show_progress: bool = False,
) -> loop.RunResult:
  """Trains the stock model quantized by `rules` on the job's data.

  Args:
    name: the run's name ('stock_float', 'stock_int8', 'stock_custom').
    exp: the experiment (steps, optimizer, evaluation, `stock_rules`).
    task: the 'lm' task.
    template: the job's LM template (sizes: vocab, width, layers, heads).
    rules: the `aqtr.rules.Rule`s quantizing it; None: float.
    on_record: called with each metrics record.
    show_progress: draw the progress bar.

  Returns:
    A `loop.RunResult`; `injected` is the trained nnx model (quantized,
    Mode.TRAIN), `report` its `aqtr.rules.Report` (or 'float').
  """
  if task.name != 'lm':
    raise ValueError(f"runs: {name!r} needs task 'lm', got {task.name!r}.")
  model = StockLm(**_sizes(template), rngs=nnx.Rngs(exp.seed))
  x0 = jnp.asarray(next(task.batches())[0])
  report: Any = 'float (no rules)'
  if rules is not None:
    model = aqtr.flax.quantize(model, rules)
    report = aqtr.flax.report(model, x0)
  graphdef, params = nnx.split(model)

  def apply(p, state, frozen, x, step):
    del frozen, step
    return nnx.merge(graphdef, p)(x), state

  f = loop.fit_task(
    name,
    loop.Trainee(params=params, apply=apply),
    loop.optimizer(exp),
    task.batches(),
    exp,
    task,
    on_record=on_record,
    show_progress=show_progress,
  )
  return loop.RunResult.of(
    f,
    name=name,
    config=aqtr.presets.float(),
    injected=nnx.merge(graphdef, f.params),
    report=report,
    param_opt_bytes=_nbytes(f.params) + _nbytes(f.opt_state),
  )


def _nbytes(tree: Any) -> int:
  return sum(x.nbytes for x in jax.tree.leaves(tree) if hasattr(x, 'nbytes'))


def float_bytes(r: loop.RunResult) -> int:
  """Bytes of the run's float parameters."""
  return _nbytes(r.params)


def serve(r: loop.RunResult, task: Task) -> dict[str, Any]:
  """Converts the trained run and compares serving with training logits.

  Returns:
    {'serving_bytes', 'float_bytes', 'kernel_ratio', 'serve_equal' (bit for
    bit on every validation batch), 'max_abs_diff', 'checkpoint' ('in
    memory': not saved)}.
  """
  model = r.injected
  served = aqtr.flax.convert(model, jnp.asarray(task.eval_set[0][0]), keep=KEEP)
  sizes = aqtr.flax.sizes(served)
  graphdef, state = nnx.split(served)
  serve_c = jax.jit(lambda s, x: nnx.merge(graphdef, s)(x))
  diff, equal = 0.0, True
  for x, _ in task.eval_set:
    a = np.asarray(r.logits_fn(r.params, x))
    b = np.asarray(serve_c(state, x))
    equal &= bool(np.array_equal(a, b))
    diff = max(diff, float(np.max(np.abs(a - b))))
  return {
    'serving_bytes': sizes.serving_bytes,
    'float_bytes': float_bytes(r),
    'kernel_ratio': sizes.kernel_ratio,
    'serve_equal': equal,
    'max_abs_diff': diff,
    'checkpoint': 'in memory',
  }


def stock_rule(cfg: fdl.Config, config: Any = 'int8', **criteria: Any) -> None:
  """Fiddler: appends `Rule(config, **criteria)` to `stock_rules`.

  The rules (first match wins) quantize the stock nnx LM of the run
  'stock_custom' (`aqtr.train.stock_lm`); criteria are `aqtr.rules.Rule`'s
  (path, layer, op, weight).

  Example:
    >>> from aqtr.train import experiment
    >>> cfg = experiment.tiny()
    >>> stock_rule(cfg, 'int4_weight_only', path='.*(gate|up|down)')
    >>> stock_rule(cfg, 'int8', weight=True)
    >>> [r.config for r in cfg.stock_rules]
    ['int4_weight_only', 'int8']
  """
  cfg.stock_rules = (*cfg.stock_rules, fdl.Config(Rule, config, **criteria))


def fold_map(params: Mapping, *, num_heads: int | None = None) -> fold.FoldMap:
  """The fold map of `StockLm` parameters (AWQ, SmoothQuant: `aqtr.ptq.fold`).

  Per block: attn_norm -> q, k, v; v -> o (grouped-query attention needs
  `num_heads`: o reads each v channel `num_heads / kv_heads` times;
  without it o is left unfolded); mlp_norm -> gate, up; up -> down
  (SwiGLU: silu(gate) * up is linear in up). The final norm feeds the
  tied embedding table (also the lookup): kept as is (`keep`).

  Args:
    params: the model's `nnx.to_pure_dict(nnx.state(model, nnx.Param))`.
    num_heads: the query heads (needed when kv_heads < num_heads).
  """
  blocks = params.get('blocks')
  if not isinstance(blocks, Mapping) or not blocks:
    raise ValueError(
      'stock_lm.fold_map: params have no "blocks" (expected the pure dict of a '
      'StockLm: blocks/<i>/{attn_norm,q,k,v,o,mlp_norm,gate,up,down}).'
    )
  groups, unfolded = [], []
  for i in sorted(blocks, key=int):
    b = f'blocks/{i}'
    k = lambda n, b=b: fold.Axis(path=f'{b}/{n}/kernel')  # noqa: E731
    groups.append(
      fold.FoldGroup(
        name=f'{b}/attn_norm',
        sources=(fold.Axis(path=f'{b}/attn_norm/scale'),),
        consumers=(k('q'), k('k'), k('v')),
      )
    )
    d_q = fold.get(params, f'{b}/q/kernel').shape[1]
    d_kv = fold.get(params, f'{b}/v/kernel').shape[1]
    if d_q == d_kv:
      o = fold.Axis(path=f'{b}/o/kernel')
    elif num_heads and d_q % num_heads == 0 and d_q % d_kv == 0:
      o = fold.Axis(
        path=f'{b}/o/kernel', repeat=d_q // d_kv, inner=d_q // num_heads
      )
    else:
      o = None
      unfolded.append(f'{b}/o/kernel')
    if o is not None:
      groups.append(
        fold.FoldGroup(
          name=f'{b}/v',
          sources=(fold.Axis(path=f'{b}/v/kernel', axis=1),),
          consumers=(o,),
          kind='linear',
        )
      )
    groups.append(
      fold.FoldGroup(
        name=f'{b}/mlp_norm',
        sources=(fold.Axis(path=f'{b}/mlp_norm/scale'),),
        consumers=(k('gate'), k('up')),
      )
    )
    groups.append(
      fold.FoldGroup(
        name=f'{b}/up',
        sources=(fold.Axis(path=f'{b}/up/kernel', axis=1),),
        consumers=(k('down'),),
        kind='linear',
      )
    )
  return fold.FoldMap(
    groups=tuple(groups), unfolded=tuple(unfolded), keep=('embed/embedding',)
  )


fold.register(
  'stock_lm',
  lambda params, root, model: fold_map(
    fold.get(params, root) if root else params,
    num_heads=model.blocks[0].heads if model is not None else None,
  ),
  model=StockLm,
  predicate=lambda params: 'blocks' in params and 'embed' in params,
)
