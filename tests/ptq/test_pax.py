"""aqtr.ptq.quantize on the main job's Pax-style LM (`aqtr.train.models`)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

import aqtr
import aqtr.ptq as ptq
from aqtr.train import models

from .helpers import ptq_entry, solution


def test_pax_lm_serves_the_solution():
  t = models.lm(
    vocab_size=64, seq_len=16, d_model=32, num_layers=1, num_heads=2
  )
  ids = [
    jax.random.randint(jax.random.key(i), (4, 16), 0, 64) for i in range(3)
  ]
  v = models.build(t).init(jax.random.key(1), ids[0])
  cfg = aqtr.presets.int4_weight_only()
  rules = [aqtr.pax.Rule(cfg, tag=aqtr.pax.tags.WeightOp)]
  (tmpl, sv), rep = ptq.quantize(t, rules, ids, variables=v)
  assert len(rep.layers) == 7
  assert np.mean([r.error / r.rtn_error for r in rep.layers]) < 0.9
  sol = solution(t, cfg, ids, v)
  for path, (site, g, (_, wq)) in sol.items():
    node = sv['aqtr']
    for k in path.split('/'):
      node = node[k]
    parts = node[ptq_entry(site)]['rhs']
    np.testing.assert_array_equal(g.dequant(parts), wq)
  served = models.build(tmpl)
  logits = jax.jit(served.apply)(sv, ids[0])
  assert logits.shape == (4, 16, 64) and bool(jnp.isfinite(logits).all())
