"""Shared layers and data for the tests of aqtr.flax (linen and nnx).

(A plain module, not a conftest: tests/flax has no __init__.py so that the
directory name cannot shadow the real `flax` package.)
"""

from __future__ import annotations

import functools
import math
import zlib

import flax.linen as nn
import jax.numpy as jnp
import numpy as np
from flax import nnx

import aqtr
import aqtr.flax.linen as ql
import aqtr.flax.nnx as qn
from aqtr.freezers import Mode

KINDS = ('dense', 'dense_general', 'einsum', 'conv')

# Input shapes per layer kind.
SHAPES = {
  'dense': (3, 8),
  'dense_general': (3, 4, 5),
  'einsum': (2, 3, 5),
  'conv': (2, 6, 6, 3),
}


def np_init(key, shape, dtype=jnp.float32):
  """A lecun-normal-like initializer from numpy, seeded by the shape.

  (jax.random compiles slowly on XLA:CPU; the test models avoid it.)
  """
  del key
  rng = np.random.default_rng(zlib.crc32(repr(tuple(shape)).encode()))
  fan_in = math.prod(shape[:-1]) if len(shape) > 1 else 1
  x = rng.standard_normal(shape) / math.sqrt(fan_in)
  return jnp.asarray(x if len(shape) > 1 else 0.1 * x, dtype)


INIT = dict(kernel_init=np_init, bias_init=np_init)


def weights_config(preset=aqtr.presets.int8):
  """`preset()` with frozen int weights (the layers' rhs)."""
  return aqtr.freezers.configure(preset(), rhs='weights')


def data(kind: str, seed: int = 0, scale: float = 1.0):
  rng = np.random.default_rng(seed)
  return jnp.asarray(scale * rng.standard_normal(SHAPES[kind]), jnp.float32)


def linen_layer(kind: str, cfg, mode: Mode) -> nn.Module:
  """A stock linen layer of `kind` with the aqtr op injected."""
  dg = functools.partial(ql.DotGeneral, config=cfg, mode=mode)
  if kind == 'dense':
    return nn.Dense(6, dot_general_cls=dg, **INIT)
  if kind == 'dense_general':
    return nn.DenseGeneral((2, 3), axis=(-2, -1), dot_general_cls=dg, **INIT)
  if kind == 'einsum':
    op = functools.partial(ql.Einsum, config=cfg, mode=mode)
    return ql.EinsumDense((5, 2, 3), 'btd,dhf->bthf', einsum_cls=op, **INIT)
  if kind == 'conv':
    cv = functools.partial(ql.ConvGeneralDilated, config=cfg, mode=mode)
    return nn.Conv(4, (3, 3), conv_general_dilated_cls=cv, **INIT)
  raise ValueError(kind)


def nnx_layer(kind: str, cfg, seed: int = 0) -> nnx.Module:
  """A stock nnx layer of `kind` with its own aqtr op."""
  kw = dict(rngs=nnx.Rngs(seed), **INIT)
  if kind == 'dense':
    return nnx.Linear(8, 6, dot_general=qn.DotGeneral(cfg), **kw)
  if kind == 'dense_general':
    op = qn.DotGeneral(cfg)
    return nnx.LinearGeneral(
      (4, 5), (2, 3), axis=(-2, -1), dot_general=op, **kw
    )
  if kind == 'einsum':
    op = qn.Einsum(cfg)
    return nnx.Einsum('btd,dhf->bthf', (5, 2, 3), (2, 3), einsum_op=op, **kw)
  if kind == 'conv':
    op = qn.ConvGeneralDilated(cfg)
    return nnx.Conv(3, 4, (3, 3), conv_general_dilated=op, **kw)
  raise ValueError(kind)


def bitwise(a, b) -> None:
  np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


class LinenMLP(nn.Module):
  """64 -> hidden -> 10, every Dense quantized by `cfg` in `mode`."""

  cfg: object = None
  mode: Mode = Mode.TRAIN
  hidden: int = 128

  @nn.compact
  def __call__(self, x):
    dg = functools.partial(ql.DotGeneral, config=self.cfg, mode=self.mode)
    x = nn.relu(nn.Dense(self.hidden, dot_general_cls=dg, **INIT)(x))
    return nn.Dense(10, dot_general_cls=dg, **INIT)(x)


class LinenCNN(nn.Module):
  """8x8x1 images -> conv 3x3 -> conv 3x3 stride 2 -> Dense(10)."""

  cfg: object = None
  mode: Mode = Mode.TRAIN

  @nn.compact
  def __call__(self, x):
    cv = functools.partial(
      ql.ConvGeneralDilated, config=self.cfg, mode=self.mode
    )
    dg = functools.partial(ql.DotGeneral, config=self.cfg, mode=self.mode)
    x = x.reshape(x.shape[0], 8, 8, 1)
    x = nn.relu(nn.Conv(8, (3, 3), conv_general_dilated_cls=cv, **INIT)(x))
    x = nn.Conv(16, (3, 3), strides=2, conv_general_dilated_cls=cv, **INIT)(x)
    x = nn.relu(x).reshape(x.shape[0], -1)
    return nn.Dense(10, dot_general_cls=dg, **INIT)(x)


class NnxMLP(nnx.Module):
  """The nnx twin of LinenMLP."""

  def __init__(self, cfg, rngs: nnx.Rngs, hidden: int = 128):
    kw = dict(rngs=rngs, **INIT)
    self.l1 = nnx.Linear(64, hidden, dot_general=qn.DotGeneral(cfg), **kw)
    self.l2 = nnx.Linear(hidden, 10, dot_general=qn.DotGeneral(cfg), **kw)

  def __call__(self, x):
    return self.l2(nnx.relu(self.l1(x)))


def digits(n: int | None = None):
  """(x [N, 64] in [0, 1], labels [N]): sklearn's digits, or a stand-in.

  Without scikit-learn: 10 random prototype images plus noise (learnable).
  """
  try:
    from sklearn.datasets import load_digits

    d = load_digits()
    x, y = (d.data / 16.0).astype(np.float32), d.target.astype(np.int32)
  except ImportError:
    rng = np.random.default_rng(0)
    protos = rng.uniform(0, 1, (10, 64))
    y = rng.integers(0, 10, 1797).astype(np.int32)
    x = np.clip(protos[y] + 0.3 * rng.standard_normal((1797, 64)), 0, 1)
    x = x.astype(np.float32)
  idx = np.random.default_rng(0).permutation(len(x))[:n]
  return jnp.asarray(x[idx]), jnp.asarray(y[idx])
