"""Templates: every op spelled out, clones are independent nodes."""

import fiddle as fdl
from fiddle import selectors

import aqtr.pax
from aqtr.pax import templates


def _ops(cfg, cls=aqtr.pax.EinsumOp):
  return list(selectors.select(cfg, cls))


def test_every_op_is_an_explicit_node():
  assert len(_ops(templates.linear(4))) == 1
  assert len(_ops(templates.feed_forward(4, 8))) == 2
  assert len(_ops(templates.feed_forward(4, 8, gated=True))) == 3
  assert len(_ops(templates.attention(8, 2))) == 6
  assert len(_ops(templates.transformer_lm(16, 8, 3, 2, 16))) == 3 * 8 + 1
  assert len(_ops(templates.transformer_lm(16, 8, 1, 2, 16, tied=False))) == 9
  assert len(_ops(templates.cnn_classifier(3, (4, 8)), aqtr.pax.ConvOp)) == 2


def test_layers_are_distinct_clones():
  tpl = templates.block(8, 2, 16)
  cfg = templates.transformer_lm(16, 8, 3, 2, 16, block_template=tpl)
  ids = {id(n) for layer in cfg.layers for n in _ops(layer)}
  assert len(ids) == 3 * 8
  cfg.layers[0].attention.num_heads = 4
  assert cfg.layers[1].attention.num_heads == 2
  assert tpl.attention.num_heads == 2


def test_repeat_and_build():
  a, b = templates.repeat(templates.linear(3), 2)
  a.features = 5
  assert (fdl.build(a).features, fdl.build(b).features) == (5, 3)


def test_bad_sizes():
  import pytest

  with pytest.raises(ValueError, match='head_dim'):
    templates.attention(10, 3)
  with pytest.raises(ValueError, match='norm kind'):
    templates.norm('batch')
