"""MLP and CNN classifier templates, float and quantized."""

import fiddle as fdl
import jax
import jax.numpy as jnp
import numpy as np

import aqtr
import aqtr.pax
from aqtr.pax import templates

from .helpers import apply, init, int8_dots

X = jax.random.normal(jax.random.key(0), (4, 8, 8, 1))


def test_mlp_flattens_and_classifies():
  mlp = fdl.build(templates.mlp_classifier(10, (16,)))
  params = init(mlp, X)
  assert params['params']['layers_0']['kernel'].shape == (64, 16)
  # flatten -> Linear -> relu -> Linear, computed by hand.
  p0, p1 = params['params']['layers_0'], params['params']['layers_1']
  h = jax.nn.relu(X.reshape(4, 64) @ p0['kernel'] + p0['bias'][None])
  want = h @ p1['kernel'] + p1['bias'][None]
  got = apply(mlp, params, X)
  assert got.shape == (4, 10)
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
  # The hidden activation is applied (a linear model would differ).
  linear = (X.reshape(4, 64) @ p0['kernel'] + p0['bias'][None]) @ p1['kernel']
  assert not np.allclose(got, linear + p1['bias'][None], atol=1e-3)


def test_cnn_float_and_int8_share_params():
  cfg = templates.cnn_classifier(10, (4, 8))
  shapes = jax.eval_shape(fdl.build(cfg).init, jax.random.key(0), X)
  assert shapes['params']['convs_0']['kernel'].shape == (3, 3, 1, 4)
  assert shapes['params']['convs_1']['kernel'].shape == (3, 3, 4, 8)
  cfg = templates.cnn_classifier(10, (4,))
  cnn = fdl.build(cfg)
  params = init(cnn, X)
  qcfg, report = aqtr.pax.inject(cfg, [aqtr.pax.Rule('int8')])
  assert len(report.quantized_paths()) == 2
  qcnn = fdl.build(qcfg)
  f, q = apply(cnn, params, X), apply(qcnn, params, X)
  assert f.shape == q.shape == (4, 10)
  np.testing.assert_allclose(q, f, atol=0.1 * float(jnp.abs(f).max()))

  def loss(p):
    return jnp.sum(apply(qcnn, p, X) ** 2)

  # The conv and the head layer, each fwd + dlhs + drhs.
  assert int8_dots(jax.make_jaxpr(jax.grad(loss))(params).jaxpr) == 6


def test_conv_stride_and_no_pool():
  cfg = templates.cnn_classifier(3, (4,), pool=1)
  cfg.convs[0].strides = (2, 2)
  cnn = fdl.build(cfg)
  params = init(cnn, X)
  assert params['params']['head']['layers_0']['kernel'].shape == (4 * 4 * 4, 3)
