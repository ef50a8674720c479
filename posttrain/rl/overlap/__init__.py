"""Asynchronous RL (``rl.overlap``): generator processes sample and score whole steps ahead of the trainer, with
weights at most ``max_staleness`` versions old, connected to it by a bounded queue.

- ``schedule``: the scheduling itself, pure of processes (which steps a generator takes, the oldest version a
  step may use, the trainer's ``Feed`` that hands out steps in order, once each, never too stale); the property
  test drives it with threads and random sleeps.
- ``weights``: versions of the policy's weights as files, published by the trainer after every update and
  loaded by the generators between steps, never inside one (a vLLM generator copies each into its engine).
- ``worker``: the generator process (spawned) and the trainer's handle on them (``Generators``); step
  metrics (the staleness histogram).
"""

from posttrain.rl.overlap.schedule import Feed, Item, assigned_steps, generator_loop, min_version
from posttrain.rl.overlap.weights import WeightStore
from posttrain.rl.overlap.worker import Generators, Spec, histogram, log_fields, sample_step, step_metrics

__all__ = ["Feed", "Generators", "Item", "Spec", "WeightStore", "assigned_steps", "generator_loop", "histogram",
           "log_fields", "min_version", "sample_step", "step_metrics"]
