"""DeepSeek's FP8 recipes on the stock MoE decoder (aqtr-train's moe_ runs).

The experts (`lax.ragged_dot`) and the attention projections run fp8 x fp8
dots, forward and backward (counted in the jaxpr of a train step); the
router and the tied embedding stay float; the runs train from
`aqtr-train` by name and serve as they trained.
"""

import jax
import jax.extend
import jax.numpy as jnp
import pytest
from flax import nnx

import aqtr.flax
from aqtr.core.lowering import sub_jaxprs
from aqtr.train import cli, job, runs, stock_moe

LAYERS, D, VOCAB = 1, 32, 64
IDS = jnp.arange(64).reshape(2, 32) % VOCAB


def fp8_eqns(jaxpr) -> dict[str, int]:
  """{primitive: count} of dot_general / ragged_dot eqns, all-fp8 operands."""
  n = {'dot_general': 0, 'ragged_dot_general': 0}
  for e in jaxpr.eqns:
    name = e.primitive.name
    if name in n and all('float8' in str(v.aval.dtype) for v in e.invars[:2]):
      n[name] += 1
    for sub in sub_jaxprs(e):
      for k, v in fp8_eqns(sub).items():
        n[k] += v
  return n


def step_jaxpr(name):
  model = stock_moe.StockMoe(VOCAB, D, LAYERS, 2, rngs=nnx.Rngs(0))
  model = aqtr.flax.quantize(model, stock_moe.rules(name, tile=16))
  model(IDS)  # state (delayed scaling), if any
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)

  def loss(p):
    return jnp.mean(nnx.merge(graphdef, p, rest)(IDS) ** 2)

  fwd = jax.make_jaxpr(lambda p: nnx.merge(graphdef, p, rest)(IDS))(params)
  return fwd.jaxpr, jax.make_jaxpr(jax.grad(loss))(params).jaxpr


@pytest.mark.parametrize(
  'name, tiles',
  [
    ('moe_maxtext_fp8', (1, 1, 1)),
    ('moe_deepseek_v3_fp8', (D // 16, D // 16, 1)),
  ],
)
def test_experts_and_projections_run_fp8_dots(name, tiles):
  """`tiles`: the ragged dots per expert matmul in fwd, dlhs, drhs (the
  blockwise recipe's grouped GEMM runs one per 1 x 16 tile of K, as the
  paper's kernels accumulate each 128-wide tile's product in fp32)."""
  fwd, train = step_jaxpr(name)
  # Forward: q, k, v, o and the three expert matmuls of each block; the
  # router and the logits (tied embedding) stay float.
  got = fp8_eqns(fwd)
  assert got == {
    'dot_general': 4 * LAYERS,
    'ragged_dot_general': 3 * LAYERS * tiles[0],
  }
  # A train step: the forward and both gradients of each, in fp8.
  got = fp8_eqns(train)
  assert got == {
    'dot_general': 3 * 4 * LAYERS,
    'ragged_dot_general': 3 * LAYERS * sum(tiles),
  }


def test_float_run_has_no_fp8_and_runs_are_registered():
  assert stock_moe.rules('moe_float') is None
  for name in stock_moe.NAMES:
    assert type(runs.get(name)).__qualname__ == f'MoeRun[{name}]'
  with pytest.raises(ValueError, match=r"unknown run 'moe_x'; runs: \("):
    stock_moe.rules('moe_x')
  assert stock_moe.tile_for(128, 1024) == 128
  assert stock_moe.tile_for(32, 16, 256) == 16


@pytest.mark.slow
def test_recipes_train_from_aqtr_train_by_name(tmp_path):
  cfg = cli.config_from_directives(
    [
      'config:tiny',
      "set:runs=('moe_float', 'moe_maxtext_fp8', 'moe_deepseek_v3_fp8')",
      'set:steps=10',
      'set:eval_every=10',
      'set:sample_tokens=0',
    ]
  )
  rows = job.run(cfg, tmp_path, show_progress=False, echo=False)
  rows = {r['run']: r for r in rows}
  assert rows['moe_float']['serve==train'] == '-'
  for name in ('moe_maxtext_fp8', 'moe_deepseek_v3_fp8'):
    assert rows[name]['serve==train'] is True
    assert rows[name]['x params'] < 0.6
    gap = rows[name]['val loss'] / rows['moe_float']['val loss'] - 1
    assert abs(gap) < 0.02
  text = (tmp_path / 'moe_maxtext_fp8' / 'injection.txt').read_text()
  assert 'blocks/0/ragged_dot0          fwd e4m3xe4m3' in text
  assert 'blocks/0/router/dot_general0  float  [rule 0]' in text
