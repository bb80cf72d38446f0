"""inject: rules by class / path / tag, jaxpr dot counts, reports."""

import copy

import fiddle as fdl
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from fiddle import selectors

import aqtr
import aqtr.pax
from aqtr.pax import Rule, inject, tags, templates

from .helpers import (
  apply,
  dot_dtypes,
  float_lm,
  grad_jaxpr,
  int8_dots,
  tiny_lm,
  tokens,
)

# Per layer: q, k, v, o projections and the ffn's wi, wo.
LINEARS_PER_LAYER = 6


def _params(cfg):
  model = fdl.build(cfg)
  return jax.eval_shape(model.init, jax.random.key(0), tokens())


def test_int8_on_all_linear_projections():
  cfg = tiny_lm()
  new, report = inject(cfg, [Rule('int8', layer=aqtr.pax.Linear)])
  assert len(report.quantized_paths()) == 2 * LINEARS_PER_LAYER
  assert all('_einsum' not in p for p in report.quantized_paths())
  dots = dot_dtypes(grad_jaxpr(new))
  # presets.int8: fwd, dlhs and drhs are each one int8 x int8 dot.
  assert dots[('int8', 'int8')] == 3 * 2 * LINEARS_PER_LAYER
  # QK^T and PV (fwd + 2 grads each, per layer) and the tied logits stay
  # float.
  assert dots[('float32', 'float32')] == 2 * 2 * 3 + 3
  assert set(dots) == {('int8', 'int8'), ('float32', 'float32')}


def test_parameter_tree_is_the_float_one():
  cfg = tiny_lm(gated=True, tied=False)
  new, _ = inject(cfg, [Rule('int8')])
  a, b = _params(cfg), _params(new)
  assert jax.tree.structure(a) == jax.tree.structure(b)
  assert jax.tree.map(jnp.shape, a) == jax.tree.map(jnp.shape, b)


def test_attention_einsums_only_when_asked():
  new, report = inject(tiny_lm(), [Rule('int8', tag=tags.ActivationOp)])
  assert report.quantized_paths() == [
    f'layers[{i}].attention.{n}'
    for i in (0, 1)
    for n in ('qk_einsum', 'pv_einsum')
  ]
  assert int8_dots(grad_jaxpr(new)) == 3 * 4


def test_layer_zero_and_softmax_only():
  rules = [
    Rule('int8', path=r'layers\.0\..*'),
    Rule('int8_weight_only', path='softmax'),
  ]
  new, report = inject(tiny_lm(tied=False), rules)
  q = report.quantized_paths()
  assert len(q) == 8 + 1
  assert all(p.startswith('layers[0].') for p in q[:-1])
  assert q[-1] == 'softmax.einsum'
  built = fdl.build(new)
  assert built.softmax.einsum.config == aqtr.presets.int8_weight_only()
  assert built.layers[1].ffn.wi.einsum.config is None
  # 8 int8 ops in layer 0 (3 dots each); the softmax is weight-only (float
  # activations, so its dots run in float).
  assert int8_dots(grad_jaxpr(new)) == 3 * 8


def test_path_syntax_variants_and_prefixes():
  cfg = tiny_lm()
  for path in (r'layers\.1', r'layers\[1\]', r'layers\[1\]\..*'):
    _, report = inject(cfg, [Rule('int8', path=path)])
    q = report.quantized_paths()
    assert len(q) == 8 and all(p.startswith('layers[1].') for p in q), path
  _, report = inject(cfg, {'.*attention.*': 'int8'})
  assert len(report.quantized_paths()) == 12


def test_first_matching_rule_wins_and_none_excludes():
  rules = [
    Rule(None, path=r'.*\.wo'),
    Rule('fp8', path=r'layers\.0\..*'),
    Rule('int8', layer=aqtr.pax.FeedForward),
  ]
  new, report = inject(tiny_lm(), rules)
  configs = report.configs()
  assert configs['layers[0].ffn.wo.einsum'] is None
  assert configs['layers[1].ffn.wo.einsum'] is None
  assert configs['layers[0].ffn.wi.einsum'] == aqtr.presets.fp8()
  assert configs['layers[1].ffn.wi.einsum'] == aqtr.presets.int8()
  assert report.wins == (2, 8 - 1, 1)
  assert report.hits == (2, 8, 4)


def test_report_of_unused_rules_and_strict():
  rules = [
    Rule('int8', layer=aqtr.pax.Linear),
    Rule('fp8', path=r'.*q_proj.*'),
    Rule('int8', path='decoder/.*'),
  ]
  _, report = inject(tiny_lm(), rules)
  assert report.unused_rules == rules[1:]
  text = report.unused_text()
  assert "rule 1 Rule('fp8', path='.*q_proj.*'): its 2 matching op(s)" in text
  assert "rule 2 Rule('int8', path='decoder/.*'): matched no op" in text
  assert 'unused rules:' in str(report)
  with pytest.raises(ValueError, match='decoder/'):
    inject(tiny_lm(), rules, strict=True)
  inject(tiny_lm(), rules[:1], strict=True)


def test_input_unchanged_and_fresh_nodes_per_op():
  cfg = tiny_lm()
  before = copy.deepcopy(cfg)
  fq = aqtr.fiddle.config('int8')
  new, _ = inject(cfg, [Rule(fq, layer=aqtr.pax.Linear)])
  assert cfg == before
  op_nodes = list(selectors.select(new, aqtr.pax.EinsumOp))
  cfgs = [op.config for op in op_nodes if op.config is not None]
  assert len(cfgs) == 12 and len({id(c) for c in cfgs}) == 12
  assert all(c is not fq for c in cfgs)
  # Editing one op's config leaves the others alone.
  new.layers[0].ffn.wi.einsum.config.fwd.lhs.numerics.bits = 4
  assert new.layers[1].ffn.wi.einsum.config.fwd.lhs.numerics.bits == 8


def test_preset_names_give_tagged_fiddle_trees():
  new, _ = inject(tiny_lm(), [Rule('int8', path=r'.*ffn.*')])
  fdl.set_tagged(new, tag=aqtr.tags.BwdBits, value=4)
  built = fdl.build(new)
  cfg = built.layers[1].ffn.wo.einsum.config
  assert (cfg.fwd.lhs.numerics.bits, cfg.dlhs.lhs.numerics.bits) == (8, 4)


def test_rules_by_index_after_expansion_of_a_shared_template():
  tpl = templates.block(32, 2, 64)
  cfg = tiny_lm()
  cfg.layers = [tpl, tpl]  # one node twice: the unexpanded template
  new, report = inject(cfg, [Rule('int8', path=r'layers\.0\..*')])
  assert report.unshared == ('layers[1]',)
  assert len(report.quantized_paths()) == 8
  assert new.layers[1].ffn.wi.einsum.config is None
  assert tpl.ffn.wi.einsum.config is None


def test_unset_op_fields_are_injected():
  cfg = fdl.Config(
    aqtr.pax.FeedForward,
    wi=fdl.Config(aqtr.pax.Linear, features=8),
    wo=fdl.Config(aqtr.pax.Linear, features=4),
  )
  new, report = inject(cfg, [Rule('int8', path='wi')])
  assert report.quantized_paths() == ['wi.einsum']
  assert 'einsum' not in new.wo.__arguments__
  ffn = fdl.build(new)
  x = jnp.ones((2, 4))
  params = jax.eval_shape(ffn.init, jax.random.key(0), x)
  assert jax.eval_shape(ffn.apply, params, x).shape == (2, 4)


def test_stochastic_rounding_needs_the_quant_stream():
  sr = aqtr.presets.fully_quantized(8, 8, stochastic_rounding=True)
  new, _ = inject(tiny_lm(), [Rule(sr, path=r'.*ffn\.wi')])
  model = fdl.build(new)
  ids = tokens()
  with pytest.raises(ValueError, match="rngs=.*'quant'"):
    jax.eval_shape(model.init, jax.random.key(0), ids)
  keys = {'params': jax.random.key(0), 'quant': jax.random.key(1)}
  params = jax.eval_shape(model.init, keys, ids)
  with pytest.raises(ValueError, match=r"layers_0/ffn/wi/einsum.*'quant'"):
    jax.eval_shape(model.apply, params, ids)
  out = jax.eval_shape(
    lambda p: model.apply(p, ids, rngs={'quant': jax.random.key(0)}), params
  )
  assert out.shape == (2, 16, 32)


def test_bad_rules():
  with pytest.raises(ValueError, match='unknown preset'):
    Rule('int7')
  with pytest.raises(TypeError, match='Rule.config'):
    Rule(8)
  with pytest.raises(ValueError, match='not a regex'):
    Rule('int8', path='(')
  with pytest.raises(TypeError, match='Rule.layer'):
    Rule('int8', layer='Linear')
  with pytest.raises(TypeError, match='Rule.tag'):
    Rule('int8', tag='WeightOp')
  with pytest.raises(TypeError, match='Rule objects'):
    inject(tiny_lm(), [('.*', 'int8')])


def test_bad_config_names_the_op_path():
  bad = aqtr.fiddle.config('int8')
  bad.fwd.use_fwd_quant = True
  with pytest.raises(ValueError, match=r'embedding\.einsum'):
    inject(tiny_lm(), [Rule(bad)])


def test_injected_model_runs_close_to_float():
  new, _ = inject(tiny_lm(), [Rule('int8', layer=aqtr.pax.Linear)])
  ids = tokens()
  f, params = float_lm()
  a, b = apply(f, params, ids), apply(fdl.build(new), params, ids)
  assert not np.array_equal(a, b)
  np.testing.assert_allclose(a, b, atol=0.05 * float(jnp.abs(a).max()))
