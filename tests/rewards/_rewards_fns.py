"""Module-level reward functions for the runner tests (importable by path in process workers)."""

import math
import time

import numpy as np

from jaxrl.rewards import RewardResult


def length_reward(prompt, completion, **_):
  return float(len(completion))


def echo_index(prompt, completion, *, idx, delay=0.0, **_):
  time.sleep(delay)
  return RewardResult(value=float(idx), info={"idx": idx})


def misbehaving(prompt, completion, *, kind, **_):
  if kind == "raise":
    raise ZeroDivisionError("boom")
  if kind == "nan":
    return math.nan
  if kind == "inf":
    return RewardResult(value=math.inf)
  if kind == "str":
    return "1.0"
  if kind == "none":
    return None
  if kind == "vector":
    return np.ones(3)
  if kind == "bool":
    return True
  return 1.0


def scaled(prompt, completion, *, scale=1.0, **_):
  return scale * len(completion)


def sleepy(prompt, completion, *, seconds, **_):
  time.sleep(seconds)
  return 1.0
