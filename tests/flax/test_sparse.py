"""N:M sparse weights in Flax: TRAIN == SERVE from compressed weights."""

import jax
from flax_cases import LinenMLP, bitwise, digits

import aqtr
import aqtr.flax.linen as ql
from aqtr import sparsity
from aqtr.freezers import Mode


def test_flax_linen_train_equals_serve():
  cfg = aqtr.freezers.configure(
    sparsity.configure(aqtr.presets.int8(), rhs=sparsity.NM()),
    rhs='sparse_weights',
  )
  x, _ = digits(16)
  v = jax.jit(LinenMLP(cfg).init)(jax.random.key(0), x)
  serving = ql.convert(LinenMLP(cfg, Mode.CONVERT), v, x)
  leaves = jax.tree_util.tree_leaves_with_path(serving[ql.FROZEN])
  names = {jax.tree_util.keystr(p).split("'")[-2] for p, _ in leaves}
  assert names == {'values', 'indices', 'scale'}
  bitwise(
    jax.jit(LinenMLP(cfg, Mode.SERVE).apply)(serving, x),
    jax.jit(LinenMLP(cfg).apply)(v, x),
  )
