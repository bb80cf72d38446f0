"""Text generation from the main job's LM: serving checkpoints and samples.

`load(<run>/serving)` rebuilds the SERVE model of an `aqtr-train` run from
the files the job wrote next to the frozen weights (`model.json`: the float
template, `config.json`: the run's DotGeneralConfig) and restores the
int8/fp8 weights; `aqtr.pax.decode.Decoder` then generates from them with
a float or quantized KV cache. `samples` is the job's generation step
(a few continuations of `PROMPT` in `summary.md`).

Example (a run's serving folder; see tests/train/test_generate.py):
  >>> from aqtr.train import generate
  >>> served = generate.load('out/int8/serving')  # doctest: +SKIP
  >>> dec = generate.decoder(served.model)  # doctest: +SKIP
  >>> out = dec.generate(served.variables, [generate.encode('def ')], 20)
  ... # doctest: +SKIP
  >>> generate.text(out.tokens[0])  # doctest: +SKIP
  'main():\\n    ...'
"""

from __future__ import annotations

import dataclasses
import math
import pathlib
from typing import Any

import fiddle as fdl
import jax
import jax.numpy as jnp

import aqtr
import aqtr.flax.linen as aqtr_linen
import aqtr.pax
from aqtr import fiddle as aqtr_fiddle
from aqtr.data import stdlib
from aqtr.flax import common
from aqtr.freezers import Mode
from aqtr.pax import decode, kv_cache
from aqtr.train import models, serving, tasks

__all__ = [
  'PROMPT',
  'Served',
  'cache_bpc',
  'decoder',
  'encode',
  'load',
  'samples',
  'text',
]

# The fixed prompt of the job's samples (summary.md).
PROMPT = 'def __init__(self'


def encode(prompt: str) -> list[int]:
  """Byte ids of `prompt` (the stdlib LM's vocabulary: UTF-8 bytes).

  Example:
    >>> encode('hi')
    [104, 105]
  """
  return list(prompt.encode('utf-8'))


def text(tokens: Any) -> str:
  """The text of byte ids (`aqtr.data.stdlib.decode`)."""
  return stdlib.decode(tokens)


@dataclasses.dataclass(frozen=True)
class Served:
  """A restored serving checkpoint.

  Attributes:
    model: the SERVE model (linen), reading frozen weights.
    variables: its variables ('params' without frozen kernels, 'aqtr').
    template: the float model template.
    config: the run's DotGeneralConfig.
    weight_bytes: bytes of the serving variables.
  """

  model: Any
  variables: Any
  template: Any
  config: aqtr.DotGeneralConfig
  weight_bytes: int


def _read_json(path: pathlib.Path, what: str) -> Any:
  if not path.is_file():
    raise ValueError(
      f'{path.parent}: no {path.name} ({what}); give the serving folder '
      'of an aqtr-train LM run (<out>/<run>/serving).'
    )
  try:
    return aqtr_fiddle.loads(path.read_text())
  except (ValueError, TypeError, KeyError, AttributeError) as e:
    msg = ' '.join(str(e).split())[:200]
    raise ValueError(
      f'{path}: cannot be read as {what} ({type(e).__name__}: {msg}); '
      'restore the file the aqtr-train run wrote.'
    ) from None


def load(
  path: str | pathlib.Path,
  template: fdl.Config | None = None,
  config: aqtr.DotGeneralConfig | None = None,
) -> Served:
  """Restores the serving checkpoint of an `aqtr-train` LM run.

  Args:
    path: the run's serving folder (`variables/`, `config.json`,
      `model.json`).
    template: if given, must equal the saved float model template.
    config: if given, must equal the saved DotGeneralConfig.

  Returns:
    A `Served`.

  Raises:
    ValueError: one line: not a serving folder, not an LM, another model
      or config than the given one, or variables that do not fit.
  """
  path = pathlib.Path(path).absolute()
  if not (path / 'variables').is_dir():
    raise ValueError(
      f'{path}: not a serving checkpoint (no variables/); give '
      '<out>/<run>/serving of an aqtr-train run of a quantized config.'
    )
  saved_model = _read_json(path / 'model.json', 'the model template')
  saved_config = aqtr_fiddle.build(
    _read_json(path / 'config.json', "the run's config")
  )
  if fdl.get_callable(saved_model) is not aqtr.pax.TransformerLm:
    raise ValueError(
      f'{path}: the checkpoint is of a {fdl.get_callable(saved_model).__name__}'
      ', not a TransformerLm; generation needs an LM run.'
    )
  if template is not None and template != saved_model:
    raise ValueError(
      f'{path}: the checkpoint holds another model than the one given '
      '(its model.json differs); serve it with its own model.json.'
    )
  if config is not None and config != saved_config:
    raise ValueError(
      f'{path}: the checkpoint was converted with another config than the '
      'one given; serve it with its config.json.'
    )
  keep = None
  if (path / 'high_precision.json').is_file():
    keep = aqtr_fiddle.build(
      _read_json(path / 'high_precision.json', 'the float blocks')
    )
  injected, _ = models.inject(saved_model, saved_config, keep)
  x = jnp.zeros((1, saved_model.max_len), jnp.int32)
  k = jax.random.key(0)  # 'quant': configs with stochastic rounding.
  shapes = jax.eval_shape(
    models.build(injected).init, {'params': k, 'quant': k}, x
  )
  conv = models.build(models.serving_template(injected, Mode.CONVERT))
  like = jax.eval_shape(lambda v: aqtr_linen.convert(conv, v, x), shapes)
  try:
    variables = serving.restore(path, like)
  except Exception as e:  # Reported in one line.
    msg = ' '.join(str(e).split())[:300]
    raise ValueError(
      f'{path}: the saved variables do not fit the model of its '
      f'model.json and config.json ({type(e).__name__}: {msg})'
    ) from e
  model = models.build(models.serving_template(injected, Mode.SERVE))
  return Served(
    model=model,
    variables=variables,
    template=saved_model,
    config=saved_config,
    weight_bytes=common.nbytes(variables),
  )


def decoder(
  model: Any,
  kv: kv_cache.KVCacheConfig | None = None,
  length: int | None = None,
) -> decode.Decoder:
  """A `Decoder` of a (serving or training) LM; the cache: `length` slots."""
  return decode.Decoder(model, kv=kv, length=length)


def samples(
  model: Any,
  variables: Any,
  *,
  prompt: str = PROMPT,
  max_new: int = 48,
  kv: kv_cache.KVCacheConfig | None = None,
  seed: int = 0,
) -> list[tuple[str, str]]:
  """The job's generation step: greedy and two sampled continuations.

  Args:
    model: the LM (SERVE model, or the training model).
    variables: its variables.
    prompt: the prompt text.
    max_new: new bytes per sample (fewer when the cache fills).
    kv: the cache config (default float).
    seed: the sampling seed.

  Returns:
    [(how, text, stopped)]: 'greedy', then 'T=0.8 top-k 20' with seeds
    seed and seed + 1; `stopped` says when the cache filled (else None).
  """
  dec = decoder(model, kv)
  ids = [encode(prompt)]
  out = [('greedy', dec.generate(variables, ids, max_new))]
  for s in (seed, seed + 1):
    how = decode.Sampling(temperature=0.8, top_k=20, seed=s)
    g = dec.generate(variables, ids, max_new, how)
    out.append((f'T=0.8 top-k 20, seed {s}', g))
  return [(how, text(g.tokens[0]), g.stopped) for how, g in out]


def cache_bpc(
  model: Any,
  variables: Any,
  eval_set: list[tuple[Any, Any]],
  kv: kv_cache.KVCacheConfig | None = None,
) -> float:
  """Teacher-forced bits per byte of `eval_set` read through the cache.

  Each validation window is one prefill: every query reads the keys and
  values as the cache stores them (quantized when `kv` says so).

  Args:
    model: the LM; its max_len must cover the windows.
    variables: its variables.
    eval_set: (inputs [b, T], next bytes [b, T]) batches.
    kv: the cache config (default float).

  Returns:
    Mean cross-entropy over the batches / ln 2.
  """
  dec = decoder(model, kv, eval_set[0][0].shape[1])
  losses = [
    float(tasks.cross_entropy(dec.logits(variables, x), jnp.asarray(y)))
    for x, y in eval_set
  ]
  return sum(losses) / len(losses) / math.log(2)
