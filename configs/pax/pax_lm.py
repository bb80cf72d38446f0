"""An existing Pax-style LM experiment: a float decoder-only transformer.

This file stands for a user's experiment config. It knows nothing about
quantization; `pax_lm_int8.py` quantizes it with a handful of rules, without
editing this file or any layer code.

  python configs/pax/pax_lm.py     # trains the float model, prints losses

The data is byte-level text: the Python standard library's own `json`
package sources (always on disk, no download).
"""

from __future__ import annotations

import dataclasses
import json
import pathlib

import fiddle as fdl
import flax.linen as nn
import jax
import numpy as np
import optax

import aqtr.pax
from aqtr.pax import templates


@dataclasses.dataclass(frozen=True, kw_only=True)
class Experiment:
  """A model and its training settings (what a Pax task would hold)."""

  model: nn.Module
  learning_rate: float = 3e-3
  batch_size: int = 8
  seq_len: int = 16
  steps: int = 40
  seed: int = 0


def experiment() -> fdl.Config[Experiment]:
  """The float experiment: a 2-layer gated LM over bytes."""
  model = templates.transformer_lm(
    vocab_size=256,
    d_model=32,
    num_layers=2,
    num_heads=2,
    hidden_dim=64,
    max_len=16,
    gated=True,
  )
  return fdl.Config(Experiment, model=model)


def corpus(max_bytes: int = 200_000) -> np.ndarray:
  """Bytes of the stdlib `json` package sources, as int32 tokens."""
  root = pathlib.Path(json.__file__).parent
  data = b''.join(p.read_bytes() for p in sorted(root.glob('*.py')))
  return np.frombuffer(data[:max_bytes], np.uint8).astype(np.int32)


def train(exp_cfg: fdl.Config[Experiment]) -> list[float]:
  """Trains the experiment's model with Adam; returns the loss per step."""
  exp = fdl.build(exp_cfg)
  model, tokens = exp.model, corpus()
  rng = np.random.default_rng(exp.seed)
  key = jax.random.key(exp.seed)
  opt = optax.adam(exp.learning_rate)

  def batch():
    starts = rng.integers(0, len(tokens) - exp.seq_len, exp.batch_size)
    return np.stack([tokens[s : s + exp.seq_len] for s in starts])

  init_keys = {'params': key, 'quant': jax.random.fold_in(key, 1)}
  params = jax.jit(model.init)(init_keys, batch())['params']
  opt_state = opt.init(params)

  @jax.jit
  def step(params, opt_state, ids, key):
    def loss_fn(p):
      logits = model.apply({'params': p}, ids, rngs={'quant': key})
      return aqtr.pax.next_token_loss(logits, ids)

    loss, grads = jax.value_and_grad(loss_fn)(params)
    updates, opt_state = opt.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  losses = []
  for i in range(exp.steps):
    k = jax.random.fold_in(key, 2 + i)
    params, opt_state, loss = step(params, opt_state, batch(), k)
    losses.append(float(loss))
  return losses


if __name__ == '__main__':
  for i, loss in enumerate(train(experiment())):
    print(f'step {i:3d}  loss {loss:.3f}')
