"""Op sites: paths, unset op fields, unsharing of shared nodes."""

import fiddle as fdl

import aqtr
import aqtr.pax
from aqtr.pax import paths, tags, templates

from .helpers import tiny_lm


def test_paths_of_the_lm():
  sites = paths.find_ops(tiny_lm())
  got = [s.path for s in sites]
  assert got[0] == 'embedding.einsum'
  assert got[1:9] == [
    f'layers[0].attention.{n}'
    for n in (
      'q_proj.einsum',
      'k_proj.einsum',
      'v_proj.einsum',
      'o_proj.einsum',
      'qk_einsum',
      'pv_einsum',
    )
  ] + ['layers[0].ffn.wi.einsum', 'layers[0].ffn.wo.einsum']
  assert len(got) == 17
  q = sites[1]
  assert q.prefixes == (
    'layers',
    'layers[0]',
    'layers[0].attention',
    'layers[0].attention.q_proj',
  )
  assert aqtr.pax.Attention in q.layers and aqtr.pax.Linear in q.layers
  assert q.op_cls is aqtr.pax.EinsumOp
  assert q.tags == {tags.WeightOp}
  assert sites[5].tags == {tags.ActivationOp}


def test_unset_op_fields_are_sites_and_can_be_set():
  cfg = fdl.Config(aqtr.pax.Linear, features=3)
  (site,) = paths.find_ops(cfg)
  assert site.path == 'einsum' and site.op is None
  site.set_config(None)
  assert 'einsum' not in cfg.__arguments__
  site.set_config(aqtr.presets.int8())
  assert fdl.get_callable(cfg.einsum) is aqtr.pax.EinsumOp
  assert cfg.einsum.config == aqtr.presets.int8()


def test_ops_in_lists_and_dicts():
  cfg = {'a': [fdl.Config(aqtr.pax.EinsumOp)], 'b': fdl.Config(aqtr.pax.ConvOp)}
  sites = paths.find_ops(cfg)
  assert [s.path for s in sites] == ["['a'][0]", "['b']"]
  sites[0].set_config(aqtr.presets.int8())
  assert cfg['a'][0].config == aqtr.presets.int8()


def test_unshare_template_repeated_by_reference():
  tpl = templates.block(8, 2, 16)
  cfg = templates.transformer_lm(16, 8, 3, 2, 16)
  cfg.layers = [tpl] * 3
  copied = paths.unshare(cfg)
  assert copied == ['layers[1]', 'layers[2]']
  assert len({id(layer) for layer in cfg.layers}) == 3
  ops = [s.op for s in paths.find_ops(cfg)]
  assert len({id(op) for op in ops}) == len(ops)


def test_unshare_inside_tuples():
  lin = templates.linear(4)
  cfg = fdl.Config(aqtr.pax.Mlp, layers=(lin, lin))
  assert paths.unshare(cfg) == ['layers[1]']
  assert isinstance(cfg.layers, tuple)
  assert cfg.layers[0] is not cfg.layers[1]


def test_index_dotted():
  assert paths.index_dotted('layers[3].ffn[10]') == 'layers.3.ffn.10'


def test_paths_agree_with_aqtr_selectors():
  cfg = tiny_lm()
  sites = [s.path for s in paths.find_ops(cfg)]
  assert set(sites) <= set(aqtr.selectors.paths(cfg))
  sel = aqtr.selectors.select_path(cfg, r'layers\[0\]\..*', aqtr.pax.EinsumOp)
  assert list(sel.paths) == [p for p in sites if p.startswith('layers[0].')]
