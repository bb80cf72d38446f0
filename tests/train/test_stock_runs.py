"""The stock nnx LM runs of aqtr-train at the tiny size (rules, serving)."""

import collections
import json

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

import aqtr.flax
from aqtr import fiddle as aqtr_fiddle
from aqtr.core.lowering import is_dot, sub_jaxprs
from aqtr.rules import Rule
from aqtr.train import cli, experiment, job, stock_lm

DIRECTIVES = [
  'config:tiny',
  "set:runs=('stock_float', 'stock_int8')",
  'set:steps=20',
  'set:eval_every=10',
  'set:sample_tokens=0',
  "fiddler:stock_rule('int4_weight_only', path='.*(gate|up|down)')",
  "fiddler:stock_rule('int8', weight=True)",
]


@pytest.fixture(scope='module')
def rows_and_out(tmp_path_factory):
  out = tmp_path_factory.mktemp('stock')
  cfg = cli.config_from_directives(DIRECTIVES)
  rows = job.run(cfg, out, show_progress=False, echo=False)
  return {r['run']: r for r in rows}, out


def test_stock_runs_serve_equal_train(rows_and_out):
  rows, out = rows_and_out
  assert list(rows) == ['stock_float', 'stock_int8', 'stock_custom']
  assert rows['stock_float']['serve==train'] == '-'
  for name in ('stock_int8', 'stock_custom'):
    assert rows[name]['serve==train'] is True
    info = json.loads((out / name / 'serving.json').read_text())
    assert info['max_abs_diff'] == 0.0
    assert info['serving_bytes'] < info['float_bytes']
  # int4 MLP kernels: smaller than all-int8.
  assert rows['stock_custom']['serving KB'] < rows['stock_int8']['serving KB']
  assert rows['stock_int8']['x params'] < 0.6
  # 20 steps learn something, and int8 stays near float.
  assert rows['stock_float']['val loss'] < 5.0
  assert (
    abs(rows['stock_int8']['val loss'] - rows['stock_float']['val loss']) < 0.1
  )
  text = (out / 'stock_custom' / 'injection.txt').read_text()
  assert 'blocks/0/gate/dot_general0  int4_weight_only  [rule 0]' in text


def test_config_json_keeps_the_rules(rows_and_out):
  _, out = rows_and_out
  cfg = aqtr_fiddle.loads((out / 'config.json').read_text())
  exp = experiment.split(cfg)[0]
  want = (
    Rule('int4_weight_only', path='.*(gate|up|down)'),
    Rule('int8', weight=True),
  )
  assert [r.label() for r in exp.stock_rules] == [r.label() for r in want]
  assert exp.run_names[-1] == 'stock_custom'


def _int8_dots(jaxpr) -> int:
  n = 0
  for eqn in jaxpr.eqns:
    if is_dot(eqn):
      n += str(eqn.invars[0].aval.dtype) == 'int8'
    for sub in sub_jaxprs(eqn):
      n += _int8_dots(sub)
  return n


def test_int8_dots_in_forward_and_backward():
  ids = jnp.zeros((2, 8), int)
  model = stock_lm.StockLm(32, 16, 1, 4, rngs=nnx.Rngs(0))
  counts = collections.Counter()
  for name in ('stock_float', 'stock_int8'):
    rules = stock_lm.RULES[name]
    m = model if rules is None else aqtr.flax.quantize(model, rules)
    graphdef, state = nnx.split(m)

    def loss(s, graphdef=graphdef):
      return nnx.merge(graphdef, s)(ids).sum()

    counts[name, 'fwd'] = _int8_dots(
      jax.make_jaxpr(lambda s, g=graphdef: nnx.merge(g, s)(ids))(state).jaxpr
    )
    counts[name, 'grad'] = _int8_dots(
      jax.make_jaxpr(jax.grad(loss))(state).jaxpr
    )
  assert counts['stock_float', 'fwd'] == counts['stock_float', 'grad'] == 0
  # 7 projections + the tied logits; the backward adds int8 gradients.
  assert counts['stock_int8', 'fwd'] == 8
  assert counts['stock_int8', 'grad'] >= 2 * 8


def test_stock_runs_need_the_lm_task():
  cfg = experiment.digits()
  cfg.runs = ('stock_int8',)
  with pytest.raises(ValueError, match="stock_int8 need task 'lm'"):
    experiment.split(cfg)


def test_stock_rules_must_be_rules():
  cfg = experiment.tiny()
  cfg.stock_rules = ('int8',)
  with pytest.raises(ValueError, match='stock_rules must be a tuple of'):
    experiment.split(cfg)


def test_unknown_fiddler_lists_stock_rule():
  with pytest.raises(cli.CommandLineError, match='stock_rule'):
    cli.config_from_directives(['config:tiny', 'fiddler:stock_rulez()'])


def test_attention_einsums_of_the_job_model_are_intercepted():
  # The stock model lives in aqtr/train: its raw einsums are user code.
  model = stock_lm.StockLm(32, 16, 1, 4, rngs=nnx.Rngs(0))
  q = aqtr.flax.quantize(model, [Rule('int8_fwd', weight=False)])
  rep = aqtr.flax.report(q, jnp.zeros((2, 8), int))
  assert rep.quantized_paths() == ['blocks/0/einsum0', 'blocks/0/einsum1']
