"""Model tags on op fields: pre-tagged configs, usable with fdl.set_tagged."""

import fiddle as fdl

import aqtr
import aqtr.pax
from aqtr.pax import tags, templates


def test_fields_are_pre_tagged():
  att = fdl.Config(aqtr.pax.Attention)
  assert fdl.get_tags(att, 'qk_einsum') == {tags.ActivationOp}
  assert fdl.get_tags(att, 'pv_einsum') == {tags.ActivationOp}
  for cls, field in (
    (aqtr.pax.Linear, 'einsum'),
    (aqtr.pax.Softmax, 'einsum'),
    (aqtr.pax.SharedEmbeddingSoftmax, 'einsum'),
    (aqtr.pax.Conv, 'conv'),
  ):
    assert fdl.get_tags(fdl.Config(cls), field) == {tags.WeightOp}


def test_set_tagged_replaces_op_nodes():
  cfg = templates.attention(8, 2)
  fdl.set_tagged(
    cfg,
    tag=tags.ActivationOp,
    value=fdl.Config(aqtr.pax.EinsumOp, config=aqtr.presets.int8()),
  )
  built = fdl.build(cfg)
  assert built.qk_einsum.config == aqtr.presets.int8()
  assert built.q_proj.einsum.config is None
