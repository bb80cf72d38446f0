"""The two tasks of the main job: data, loss and the reported metric.

* 'lm': next-byte prediction on the stdlib corpus (`aqtr.data.stdlib`);
  the metric is bits per character (byte): validation loss / ln 2.
* 'digits': 10-way classification of scikit-learn's digits; the metric is
  validation accuracy.

Every run of an experiment calls `Task.batches()` for a fresh iterator from
the same seed, so all runs see the same batches in the same order.

Example:
  >>> from aqtr.train import experiment, tasks
  >>> exp, _, _ = experiment.split(experiment.tiny())
  >>> task = tasks.make(exp)
  >>> task.metric, next(task.batches())[0].shape
  ('bpc', (8, 32))
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from aqtr.data import digits, loader, stdlib

__all__ = ['Task', 'cross_entropy', 'evaluate_logits', 'make']

Batch = tuple[np.ndarray, np.ndarray]


@dataclasses.dataclass(frozen=True)
class Task:
  """Data and metric of one task.

  Attributes:
    name: 'lm' or 'digits'.
    batches: returns a fresh, seeded iterator of training batches.
    eval_set: fixed validation batches.
    metric: 'bpc' (lower is better) or 'accuracy' (higher is better).
    unit: what a throughput counts: 'tok' or 'img'.
    items_per_batch: tokens or images in one training batch.
    info: one line describing the data.
  """

  name: str
  batches: Callable[[], Iterator[Batch]]
  eval_set: list[Batch]
  metric: str
  unit: str
  items_per_batch: int
  info: str


def make(exp: Any) -> Task:
  """The Task of `exp.task`, with its data loaded."""
  if exp.task == 'lm':
    return _lm(exp)
  return _digits(exp)


def _lm(exp: Any) -> Task:
  exclude = stdlib.EXCLUDE
  if exp.holds_out_family:
    exclude += (exp.finetune_family,)  # Held out for the LoRA fine-tunes.
  corpus = stdlib.load(exp.val_percent, exp.max_corpus_bytes, exclude=exclude)
  b, t = exp.batch_size, exp.seq_len
  info = (
    f'stdlib bytes: train {len(corpus.train_files)} files '
    f'{len(corpus.train) / 1e6:.2f} MB, validation {len(corpus.val_files)} '
    f'files {len(corpus.val) / 1e6:.2f} MB (split by file)'
  )
  return Task(
    name='lm',
    batches=lambda: loader.windows(corpus.train, b, t, exp.seed),
    eval_set=loader.eval_windows(corpus.val, b, t, exp.eval_batches),
    metric='bpc',
    unit='tok',
    items_per_batch=b * t,
    info=info,
  )


def _digits(exp: Any) -> Task:
  d = digits.load(seed=exp.seed)
  n = len(d.x_val)
  info = f'sklearn digits 8x8: train {len(d.x_train)}, validation {n} images'
  return Task(
    name='digits',
    batches=lambda: loader.examples(
      d.x_train, d.y_train, exp.batch_size, exp.seed
    ),
    eval_set=[(d.x_val, d.y_val)],
    metric='accuracy',
    unit='img',
    items_per_batch=exp.batch_size,
    info=info,
  )


def cross_entropy(logits: jax.Array, labels: jax.Array) -> jax.Array:
  """Mean softmax cross entropy (nats) of integer labels."""
  logp = jax.nn.log_softmax(logits.astype(jnp.float32))
  picked = jnp.take_along_axis(logp, labels[..., None], axis=-1)
  return -picked.mean()


def evaluate_logits(
  logits_fn: Callable[[np.ndarray], jax.Array],
  eval_set: list[Batch],
  metric: str,
) -> dict[str, float]:
  """Validation loss and metric of `logits_fn` over `eval_set`.

  Args:
    logits_fn: inputs -> logits (jitted by the caller).
    eval_set: (inputs, labels) batches.
    metric: 'bpc' or 'accuracy'.

  Returns:
    {'val_loss': nats, metric: value}.
  """
  losses, correct, count = [], 0, 0
  for x, y in eval_set:
    logits = logits_fn(x)
    losses.append(float(cross_entropy(logits, jnp.asarray(y))))
    correct += int((np.asarray(logits.argmax(-1)) == y).sum())
    count += y.size
  loss = float(np.mean(losses))
  value = loss / math.log(2) if metric == 'bpc' else correct / count
  return {'val_loss': loss, metric: value}
