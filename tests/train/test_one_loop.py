"""aqtr/train has one training loop (`aqtr.train.loop.fit`).

Every run of the job (QAT, stock LMs, MoE, LoRA fine-tuning, Pax) trains
through `loop.fit`: no other module of aqtr/train takes a gradient or
applies an optimizer's update.
"""

from __future__ import annotations

import pathlib
import re

TRAIN = pathlib.Path(__file__).resolve().parents[2] / 'aqtr' / 'train'
STEP = re.compile(
  r'jax\.(value_and_grad|grad)\(|\btx\.update\(|apply_updates\('
)


def test_only_the_loop_takes_gradients_and_updates():
  found = sorted(
    p.name
    for p in TRAIN.glob('*.py')
    if STEP.search(
      '\n'.join(
        ln
        for ln in p.read_text().splitlines()
        if not ln.lstrip().startswith(('#', '>>>', '...'))
      )
    )
  )
  assert found == ['loop.py']
