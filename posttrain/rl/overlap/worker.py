"""Generator processes and the trainer's handle on them.

``generator_main`` (spawned, one per ``rl.overlap.generators``) loads the policy folder once and builds its
``rollout.backend`` on it (hf: samples with that model; vLLM: its own engine, into which each acquired version is
copied through ``WeightSync``, so the version a step records is the one the engine served), then per assigned
step acquires the newest allowed weights (``WeightStore``), samples and scores the whole step with
``sample_step`` (the rl loop's own ``collect.collect_step``: the same seeds, prompts and dynamic sampling as the
synchronous loop; every row carries its ``version``) and queues it pickled. Scoring happens in the generator:
the queue then carries scored groups, dynamic sampling's skip decision (which needs the rewards) is taken where
the samples are, and the reward time overlaps the update instead of adding to the trainer's step.

``Generators`` (the trainer's context manager) spawns them, turns the queue into a ``schedule.Feed``, fails with
the generator's traceback when one raises, and stops and joins them on exit. A generator whose trainer is gone
(SIGKILL) notices (its parent changes) and exits instead of waiting forever.
"""

from __future__ import annotations

import multiprocessing
import os
import pickle
import queue
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from posttrain import allocator, modeling, seeds
from posttrain.config import Params
from posttrain.rewards import RewardPool
from posttrain.rl import collect
from posttrain.rl.overlap.schedule import Feed, Item, assigned_steps, generator_loop
from posttrain.rl.overlap.weights import WeightStore
from posttrain.rl.prompts import PromptPool
from posttrain.rl.select import PromptCursor
from posttrain.rollout import BACKENDS, RolloutBackend

PUT_TIMEOUT_S = 0.5
JOIN_S = 10.0  # seconds a stopping generator may take to finish its step


@dataclass(frozen=True)
class Spec:
    """What a generator process needs: the params, the selected prompts, the policy folder it starts from (and
    its digest, for the rows' ``policy``), the weight store's folder, the RL seed and the first step."""

    params: Params
    prompts: PromptPool
    policy: str
    policy0: str
    weights: str
    rl_seed: int
    start: int


def sample_step(backend: RolloutBackend, tokenizer: Any, spec: Spec, step: int, version: int,
                pool: RewardPool | None) -> collect.StepBatch:
    """Step ``step``'s samples, scored, from the weights of ``version`` the backend holds: its prompts are the
    cursor's ``prompts_per_step`` at ``step * prompts_per_step`` (no refill under rl.overlap, so no step moves
    the cursor further), its seed ``seeds.rl_step``; each row records ``version``."""
    p, cfg = spec.params, spec.params.rl
    cursor = PromptCursor(len(spec.prompts), spec.rl_seed, pos=step * cfg.prompts_per_step)
    device = modeling.resolve_device(p.runtime.device)
    with modeling.autocast(p.model.dtype, device):
        sb = collect.collect_step(backend, tokenizer, spec.prompts, cursor, cfg, p.reward.rewards,
                                  seeds.rl_step(spec.rl_seed, step), policy=collect.policy_name(spec.policy0, version),
                                  pool=pool)
    for rows in sb.rows.values():
        for row in rows:
            row["version"] = version
    return sb


def generator_main(index: int, spec: Spec, out: Any, stop: Any, parent: int) -> None:
    """A generator process: see the module docstring. Errors go to the trainer as ("error", index, traceback)."""
    try:
        p, o = spec.params, spec.params.rl.overlap
        torch.set_num_threads(o.generator_threads)
        if p.runtime.keep_freed_memory:  # a spawned process: the stage's setup did not run here
            allocator.keep_freed_memory()
        # hf samples with this model; vLLM's engine loads its own copy, and this one (on the CPU) only stages
        # each version's weights for the engine (a LoRA policy's merged as they stream in)
        where = p.runtime.device if p.rollout.backend == "hf" else "cpu"
        model = modeling.load_policy(spec.policy, p.model, modeling.resolve_device(where)).eval()
        tok = modeling.load_tokenizer(spec.policy)
        # a generator's engine never gives its memory back (it samples while the trainer updates): no sleep mode
        options = p.vllm_options().model_copy(update={"sleep_level": 0})
        backend = BACKENDS[p.rollout.backend](model, tok, p.rl.generate_batch_size, options)
        store, loaded = WeightStore(spec.weights), None

        def stopped() -> bool:
            return stop.is_set() or os.getppid() != parent

        def acquire(need: int) -> int | None:
            nonlocal loaded
            loaded = store.acquire(need, model, loaded, stopped)
            if loaded is not None:  # vLLM: the engine serves the version just loaded (hf: nothing to do)
                backend.load_weights(model, collect.policy_name(spec.policy0, loaded))
            return loaded

        def put(item: Item) -> None:
            msg = (item.step, item.version, pickle.dumps(item.payload), index)
            while not stopped():
                try:
                    out.put(msg, timeout=PUT_TIMEOUT_S)
                    return
                except queue.Full:
                    continue
            out.cancel_join_thread()  # stopping: what is still queued is not waited for at exit

        with RewardPool.of(p.reward) as pool:
            generator_loop(assigned_steps(index, o.generators, spec.start, p.rl.steps), o.max_staleness, acquire,
                           lambda s, v: sample_step(backend, tok, spec, s, v, pool), put, index)
    except (SystemExit, KeyboardInterrupt):  # terminated (the trainer stopping): nothing to tell anyone
        out.cancel_join_thread()
    except BaseException:  # noqa: BLE001 (the trainer re-raises it with this traceback)
        try:  # never block on a queue no one reads any more (a trainer gone or stopping): exit regardless
            out.put(("error", index, traceback.format_exc(), index), timeout=PUT_TIMEOUT_S)
        except queue.Full:
            pass
        out.cancel_join_thread()


class Generators:
    """``with Generators(spec, regenerate) as feed: feed.take(step)``: the spawned generators behind a Feed."""

    def __init__(self, spec: Spec, regenerate: Callable[[int], Any]) -> None:
        self.spec, self.regenerate = spec, regenerate
        self.procs: list[Any] = []

    def __enter__(self) -> Feed:
        o = self.spec.params.rl.overlap
        ctx = multiprocessing.get_context("spawn")
        self.queue, self.stop = ctx.Queue(maxsize=o.max_staleness + o.generators + 1), ctx.Event()
        self.procs = [ctx.Process(target=generator_main, name=f"rl-generator-{i}",
                                  args=(i, self.spec, self.queue, self.stop, os.getpid()))
                      for i in range(o.generators)]
        for proc in self.procs:
            proc.start()
        return Feed(o.max_staleness, self._get, self.regenerate)

    def _get(self) -> Item:
        while True:
            try:
                msg = self.queue.get(timeout=1.0)
            except queue.Empty:
                dead = [f"{p.name} (exit code {p.exitcode})" for p in self.procs if p.exitcode not in (None, 0)]
                if dead or all(p.exitcode == 0 for p in self.procs):
                    raise RuntimeError(f"generators ended before their steps were taken: {dead}") from None
                continue
            if msg[0] == "error":
                raise RuntimeError(f"rl-generator-{msg[1]} failed:\n{msg[2]}")
            return Item(msg[0], msg[1], pickle.loads(msg[2]), msg[3])

    def __exit__(self, *exc: object) -> None:
        """Stop the generators; drain what they queued meanwhile (a process exits only once its queued data is
        in the pipe), then terminate any still busy after ``JOIN_S`` (inside a long step)."""
        self.stop.set()
        deadline = time.time() + JOIN_S
        while any(p.is_alive() for p in self.procs) and time.time() < deadline:
            try:
                self.queue.get(timeout=0.05)
            except queue.Empty:
                pass
        for proc in self.procs:
            if proc.is_alive():
                proc.terminate()
            proc.join(JOIN_S)
            if proc.is_alive():  # stuck (e.g. flushing into a pipe no one reads): no trainer waits forever
                proc.kill()
                proc.join()
        self.queue.cancel_join_thread()
        self.queue.close()


def log_fields(k: int) -> list[str]:
    """The train log's columns under rl.overlap: the version trained on, its staleness, the staleness
    histogram (samples at staleness 0..k), steps dropped so far and seconds the trainer waited."""
    return ["version", "staleness", *(f"stale_{j}" for j in range(k + 1)), "dropped", "wait_s"]


def step_metrics(item: Item, feed: Feed, samples: int) -> dict[str, Any]:
    """One step's row of ``log_fields``: every sample of a step has the step's version."""
    st = item.step - item.version
    return {"version": item.version, "staleness": st, **{f"stale_{j}": samples * (j == st) for j in range(feed.k + 1)},
            "dropped": feed.dropped, "wait_s": round(feed.wait_s, 3)}


def histogram(rows: Sequence[dict[str, Any]], k: int) -> dict[str, int]:
    """Samples per staleness over a run's log rows."""
    return {str(j): int(sum(r.get(f"stale_{j}", 0) for r in rows)) for j in range(k + 1)}
