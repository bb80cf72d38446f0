"""`aqtr-generate --checkpoint=FOLDER`: a stock LM's quantized checkpoint.

FOLDER is what `aqtr.checkpoints.export` writes for a Hugging Face Flax
causal LM converted by `aqtr.flax.convert` (or any compressed-tensors /
GPTQ / AWQ folder of such a model): `config.json` (the model's Hugging
Face config + `quantization_config`) and `*.safetensors`. The model is
rebuilt from the config with no float weights (`FlaxAutoModelForCausalLM`,
`aqtr.checkpoints.load` into its abstract variables) and decoded by
`aqtr.flax.decode.Decoder` through its own cache, stored as `--kv` says.
Prompts: `--ids=5,9,2` token ids (repeat for a batch), or `--prompt` text
when FOLDER holds a tokenizer.

  aqtr-generate --checkpoint=llama_int4 --ids=1,306,4658 --max_new=32 \\
    --kv=int8 --kv_scales=block --kv_block=32 --temperature=0.8 --top_k=40
"""

from __future__ import annotations

import dataclasses
import inspect
import math
import pathlib
from typing import Any

import jax
import jax.numpy as jnp

from aqtr.flax import decode, kv_cache

__all__ = ['Stock', 'load', 'run']


@dataclasses.dataclass(frozen=True)
class Stock:
  """A restored stock checkpoint.

  Attributes:
    model: the serving module (reads the stored codes).
    variables: its variables.
    tokenizer: the folder's tokenizer, or None.
    weight_bytes: bytes of the variables.
  """

  model: Any
  variables: Any
  tokenizer: Any
  weight_bytes: int


def load(folder: str) -> Stock:
  """The serving module and variables of a Hugging Face LM checkpoint.

  Raises:
    ValueError: one line: no such folder, no config.json, not a Flax
      causal LM's config, or tensors that do not fit the model.
  """
  from aqtr import checkpoints  # noqa: PLC0415 (flax extra)

  path = pathlib.Path(folder).absolute()
  if not (path / 'config.json').is_file():
    raise ValueError(
      f'--checkpoint: {path} has no config.json; give a folder written by '
      'aqtr.checkpoints.export of a Hugging Face Flax LM.'
    )
  try:
    import transformers  # noqa: PLC0415 (models extra)
  except ImportError:
    raise ValueError(
      '--checkpoint needs transformers (pip install aqtr[models]).'
    ) from None
  try:
    config = transformers.AutoConfig.from_pretrained(path)
    hf = transformers.FlaxAutoModelForCausalLM.from_config(
      config, _do_init=False
    )
  except (ValueError, KeyError, OSError) as e:
    msg = ' '.join(str(e).split())[:200]
    raise ValueError(
      f'--checkpoint: {path}/config.json is not a Flax causal LM config '
      f'({type(e).__name__}: {msg}).'
    ) from None
  module = hf.module
  ids = jnp.ones((1, 8), jnp.int32)
  kw = {'attention_mask': ids}
  if 'position_ids' in inspect.signature(type(module).__call__).parameters:
    kw['position_ids'] = jnp.arange(8)[None]
  abstract = jax.eval_shape(
    lambda: module.init(jax.random.key(0), ids, **kw, return_dict=False)
  )
  try:
    served, variables = checkpoints.load(
      module, str(path), ids, variables=abstract, **kw
    )
  except checkpoints.CheckpointError as e:
    raise ValueError(f'--checkpoint: {e}') from None
  tokenizer = None
  if any(path.glob('tokenizer*')):
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
  return Stock(served, variables, tokenizer, kv_cache.cache_bytes(variables))


def _rule(f: dict) -> kv_cache.CacheRule:
  block = f['kv_block'].value if f['kv_scales'].value == 'block' else 0
  if f['kv_scales'].value not in ('token', 'block'):
    raise ValueError(
      f"--kv_scales must be 'token' or 'block', got {f['kv_scales'].value!r}"
    )
  if f['kv_read'].value not in ('auto', 'dequantize'):
    raise ValueError(
      '--kv_read: a stock model reads its cache dequantized (its own '
      'attention code); use --kv_read=auto (or dequantize)'
    )
  b = f['kv_bound'].value
  if b != 0 and not (math.isfinite(b) and b > 0):
    raise ValueError(f'--kv_bound must be a finite bound > 0, got {b}')
  return kv_cache.CacheRule(
    numerics=f['kv'].value,
    calibration='static' if b else 'absmax',
    bound=b or None,
    block=block,
  )


def _prompts(f: dict, tokenizer) -> tuple[list[list[int]], list[str]]:
  ids = f['ids'].value or []
  if ids:
    out = []
    for i, s in enumerate(ids):
      try:
        out.append([int(t) for t in s.split(',') if t.strip()])
      except ValueError:
        raise ValueError(
          f'--ids #{i}: {s!r} is not comma-separated integer token ids'
        ) from None
    return out, [s for s in ids]
  if tokenizer is None:
    raise ValueError(
      '--checkpoint: the folder has no tokenizer; give prompts as token '
      'ids: --ids=5,9,2 (repeat for a batch)'
    )
  texts = f['prompt'].value
  return [tokenizer.encode(t) for t in texts], texts


def run(f: dict) -> None:
  """Generates from `--checkpoint` and prints; ValueError on a mistake."""
  if f['serving'].value:
    raise ValueError('give --serving or --checkpoint, not both')
  rule = _rule(f)
  stock = load(f['checkpoint'].value)
  limit = getattr(stock.model.config, 'max_position_embeddings', None)
  limit = limit or getattr(stock.model.config, 'n_positions', None) or 2048
  length = f['cache_len'].value or limit
  dec = decode.Decoder(stock.model, length=length, kv=rule)
  sampling = decode.Sampling(
    temperature=f['temperature'].value,
    top_k=f['top_k'].value,
    seed=f['seed'].value,
  )
  prompts, labels = _prompts(f, stock.tokenizer)
  out = dec.generate(stock.variables, prompts, f['max_new'].value, sampling)
  for label, tokens in zip(labels, out.tokens, strict=True):
    print(f'--- {label!r}')
    text = stock.tokenizer.decode(tokens) if stock.tokenizer else ''
    print(text or ' '.join(map(str, tokens)))
  if out.stopped:
    print(f'note: {out.stopped}')
  b, n = len(prompts), len(out.tokens[0])
  print(
    f'speed: {out.tokens_per_s:.1f} tokens/s decoding (batch {b}, {n} new '
    f'tokens each; prefill + first token {out.prefill_s:.3f} s; compile '
    f'{out.compile_s:.1f} s)'
  )
  per_token = out.kv_bytes / (b * length)
  print(
    f'memory: weights {stock.weight_bytes / 1024:.1f} KB (serving '
    f'variables), KV cache {out.kv_bytes / 1024:.1f} KB ({rule.numerics}, '
    f'{length} slots x {b} sequences, {per_token:.0f} B per token)'
  )
