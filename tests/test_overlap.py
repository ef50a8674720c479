"""Asynchronous RL (rl.overlap): the scheduler under random timings, the refusals at load, and the stage with
generator processes (k = 0 against the synchronous loop, bit for bit; k = 1 with two generators)."""

import csv
import random
import threading
import time
from pathlib import Path
from queue import Queue

import pytest
import torch
from conftest import tiny_raw
from safetensors.torch import load_file

from posttrain.config import ConfigError, parse_params
from posttrain.rl.overlap import Feed, Item, assigned_steps, generator_loop, min_version
from posttrain.schema import read_parquet
from stages import curate, model, reward, rl, rollout, sft


# ------------------------------------------------------------------------------------ the scheduler, pure
def test_assigned_steps_and_min_version_by_hand():
    assert list(assigned_steps(0, 2, 3, 8)) == [3, 5, 7] and list(assigned_steps(1, 2, 3, 8)) == [4, 6]
    assert [min_version(s, 2) for s in range(5)] == [0, 0, 0, 1, 2]  # max(0, s - 2)
    assert [min_version(s, 0) for s in range(3)] == [0, 1, 2]


def _simulate(seed: int, k: int, n: int, steps: int, start: int, rogue: bool = False):
    """Generators (threads) and a trainer with random sleeps around every action: the real generator_loop and
    Feed, an in-memory weight store. ``rogue``: generator 0 ignores the bound (takes whatever version exists)."""
    rng = random.Random(seed)
    lock, published = threading.Condition(), [start]  # versions published so far (newest last)
    q: Queue = Queue(maxsize=k + n + 1)
    mixed: list[int] = []

    def nap():
        with lock:
            t = rng.random() * 0.004
        time.sleep(t)

    def acquire_for(i):
        def acquire(need):
            nap()
            with lock:
                if not (rogue and i == 0):
                    lock.wait_for(lambda: published[-1] >= need)
                return published[-1]
        return acquire

    def collect(i):
        def fn(s, v):
            held = v  # the generator's own copy of the weights: only acquire changes it
            nap()
            if held != v:
                mixed.append(s)
            return ("samples", s, v)
        return fn

    threads = [threading.Thread(target=generator_loop, args=(assigned_steps(i, n, start, steps), k, acquire_for(i),
                                                             collect(i), q.put, i)) for i in range(n)]
    for t in threads:
        t.start()
    feed = Feed(k, q.get, lambda s: ("regenerated", s, s))
    consumed = []
    for step in range(start, steps):
        item = feed.take(step)
        consumed.append(item)
        nap()  # the update
        with lock:
            published.append(step + 1)
            lock.notify_all()
    for t in threads:
        t.join(timeout=10)
    return consumed, feed, mixed


@pytest.mark.parametrize("seed", range(40))
def test_no_consumed_sample_is_older_than_k_none_twice_none_skipped(seed):
    """Over random timings, 1-3 generators, k in 0..3, from a fresh start or a resume: the trainer takes
    every step once, in order, each sampled with a version in [step - k, step], and no generator mixes versions
    inside one step's samples; nothing is dropped (the wait makes staleness > k impossible)."""
    rng = random.Random(1000 + seed)
    k, n, start = rng.randint(0, 3), rng.randint(1, 3), rng.choice([0, 0, 5])
    consumed, feed, mixed = _simulate(seed, k, n, start + 12, start)
    assert [it.step for it in consumed] == list(range(start, start + 12))
    assert [it.payload[1] for it in consumed] == list(range(start, start + 12))  # each step's own samples, once
    assert all(0 <= it.step - it.version <= k for it in consumed)
    assert feed.dropped == 0 and not mixed and not feed.buffer


@pytest.mark.parametrize("seed", range(10))
def test_a_too_stale_item_is_dropped_counted_and_regenerated(seed):
    """A generator that does not wait (rogue) produces items older than k: the trainer never consumes them;
    each is counted and regenerated with the trainer's own weights (staleness 0)."""
    consumed, feed, _ = _simulate(seed, 0, 2, 10, 0, rogue=True)
    assert [it.step for it in consumed] == list(range(10))
    assert all(0 <= it.step - it.version <= 0 for it in consumed)
    regenerated = [it for it in consumed if it.payload[0] == "regenerated"]
    assert len(regenerated) == feed.dropped


def test_a_step_arriving_twice_is_a_bug():
    items = iter([Item(0, 0, "a"), Item(0, 0, "b")])
    feed = Feed(1, lambda: next(items), lambda s: None)
    feed.take(0)
    with pytest.raises(RuntimeError, match="arrived twice"):
        feed.take(1)


def test_weight_store_publishes_versions_whole_and_loads_the_newest_allowed(tmp_path):
    """Versions 0..3 published (each weight = its version); only the two newest are kept; acquire(need) loads
    the newest when it is >= need, returns at once when the model already holds it, and waits (here: stops)
    when none is new enough."""
    from posttrain.rl.overlap import WeightStore

    store, src, dst = WeightStore(tmp_path), torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)
    for v in range(4):
        torch.nn.init.constant_(src.weight, float(v))
        store.publish(src, v)
    store.flush()  # written by the store's thread, off the caller's
    assert store.versions() == [2, 3] and not list(tmp_path.glob(".*"))
    assert store.acquire(1, dst, None, lambda: False) == 3 and torch.all(dst.weight == 3.0)
    torch.nn.init.constant_(dst.weight, -1.0)
    assert store.acquire(3, dst, 3, lambda: False) == 3 and torch.all(dst.weight == -1.0)  # held: not reloaded
    assert store.acquire(4, dst, 3, lambda: True) is None


def test_a_failed_weight_write_fails_the_next_publish_once(tmp_path, monkeypatch):
    """A write that raises in the store's thread is raised by the next ``publish`` (the stage fails), and only
    once: a ``flush`` while the stage unwinds does not raise it again over the first error (it did: the
    pending future was never cleared)."""
    from posttrain.rl.overlap import WeightStore, weights

    store, model = WeightStore(tmp_path), torch.nn.Linear(2, 2)

    def full(*a, **k):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(weights.torch, "save", full)
    store.publish(model, 0)
    with pytest.raises(OSError, match="No space left"):
        store.publish(model, 1)
    store.flush()  # nothing pending: the error was reported
    assert store.versions() == []


def test_a_lora_policy_publishes_its_adapters_only_and_a_generator_loads_them_over_its_base(tmp_path):
    """Issue 50, finding 6: every version was the whole state dict, the frozen base included (14.2 GiB at 7B for the
    tens of MB that changed), written in the trainer's critical path. Now a version holds the trainable tensors
    only: a LoRA policy's adapters (here q_proj's and v_proj's A and B: 4 tensors of the state dict's 16), and a
    generator that built the same policy loads them over its base to the trainer's weights."""
    from posttrain import modeling
    from posttrain.config import LoraCfg, ModelCfg, TinyModel
    from posttrain.rl.overlap import WeightStore

    tok = modeling.build_char_tokenizer()
    base = modeling.build_tiny_model(TinyModel(hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64),
                                     tok, 0)
    folder = tmp_path / "policy"
    modeling.save_checkpoint(base, tok, folder, "float32")
    cfg = ModelCfg(lora=LoraCfg(r=4, alpha=8, dropout=0.0, target_modules=["q_proj", "v_proj"]))
    trainer = modeling.load_policy(str(folder), cfg, torch.device("cpu"))
    with torch.no_grad():
        for p in trainer.parameters():
            if p.requires_grad:
                p.add_(0.5)  # "an update": every adapter moves
    store = WeightStore(tmp_path / "w")
    store.publish(trainer, 1)
    store.flush()
    saved = torch.load(store.path(1), weights_only=True)
    trainable = {n for n, p in trainer.named_parameters() if p.requires_grad}
    assert set(saved) == trainable and (len(saved), len(trainer.state_dict())) == (4, 16)
    assert all("lora" in n for n in saved)
    gen = modeling.load_policy(str(folder), cfg, torch.device("cpu"))
    assert store.acquire(1, gen, None, lambda: False) == 1
    want = trainer.state_dict()
    assert all(torch.equal(v, want[k]) for k, v in gen.state_dict().items())


# ----------------------------------------------------------------------------------------- the refusals
@pytest.mark.parametrize("edit,key", [
    ({"rl": {"dynamic_sampling": "refill"}}, "rl.dynamic_sampling"),
    ({"rl": {"advantage": "prior_fused", "prior_budget": 8, "dynamic_sampling": "off"}}, "rl.prior_budget"),
    ({"runtime": {"distributed": {"nproc_per_node": 2}}}, "runtime.distributed.nproc_per_node"),
    ({"tools": {"enabled": True}, "distill": {"warmup": {"steps": 0}, "on_policy": {"steps": 0}, "grpo_steps": 0}},
     "tools.enabled"),
])
def test_what_cannot_run_ahead_is_refused_at_load_naming_the_key(tiny, edit, key):
    for section, values in edit.items():
        for k2, v in values.items():
            if isinstance(v, dict):
                tiny[section].setdefault(k2, {}).update(v)
            else:
                tiny[section][k2] = v
    parse_params({**tiny, "rl": {**tiny["rl"], "overlap": None}})  # fine without rl.overlap
    tiny["rl"].update({"overlap": {"max_staleness": 1}, "correction": {"name": "icepop"}})
    with pytest.raises(ConfigError) as e:
        parse_params(tiny)
    assert f" {key}: " in str(e.value) and "rl.overlap" in str(e.value) and "\n" not in str(e.value)


def test_the_techniques_that_work_under_overlap_load(tiny):
    tiny["rl"].update({"overlap": {"max_staleness": 2, "generators": 2}, "advantage": "prior_fused",
                       "correction": {"name": "icepop"},
                       "dynamic_sampling": "off", "token_select": "top_entropy", "kl_coef": 0.1,
                       "ref_reset": {"every": 2}})
    tiny["distill"]["grpo_steps"] = 0
    assert parse_params(tiny).rl.overlap.generators == 2
    with pytest.raises(ConfigError, match="max_staleness"):
        parse_params({**tiny, "rl": {**tiny["rl"], "overlap": {"max_staleness": -1}}})


# ------------------------------------------------------------------------------------------ the stage
def _upstream(p) -> None:
    for mod in (model, curate, sft, rollout):
        mod.run(p, *mod.paths(p))
    reward.run(p, {"rollouts": rollout.paths(p)[1]["rollouts"]}, reward.paths(p)[1])


def _run_rl(raw, root: Path):
    """rl.run on ``raw`` (the upstream fixture's inputs) with its outputs under ``root``."""
    p = parse_params(raw)
    out = {k: root / k for k in ("model", "rl_dir", "checkpoints", "report_dir")} | {"metrics": root / "rl.json"}
    torch.manual_seed(p.seed)  # as stage_main does: LoRA's adapters are initialised from torch's global RNG
    return rl.run(p, rl.paths(p)[0], out), out


@pytest.fixture(scope="module")
def upstream(tmp_path_factory):
    root = tmp_path_factory.mktemp("up")
    raw = tiny_raw(root)
    raw["runtime"].update({"generate_threads": 1, "train_threads": 1})
    _upstream(parse_params(raw))
    return raw


def _weights(out) -> dict[str, torch.Tensor]:
    return load_file(str(out["model"] / "model.safetensors"))


TIMING = {"samples_per_s", "gen_s", "reward_s", "update_s", "elapsed_s"}


@pytest.mark.slow  # 9 s: two rl runs, one with a generator process
@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_max_staleness_0_is_the_synchronous_loop_bit_for_bit(upstream, tmp_path, lora):
    """k = 0 with a generator process: every step waits for its own weights, so the final weights, the shards
    (less the version column) and every logged metric but the timings equal the synchronous loop's (also with
    LoRA: the generator builds the same adapter-wrapped model and loads the trainer's state into it)."""
    base = {**upstream, "model": {**upstream["model"], "lora": {} if lora else None}}
    sync, out_s = _run_rl(base, tmp_path / "sync")
    raw = {**base, "rl": {**base["rl"], "overlap": {"max_staleness": 0}}}
    asy, out_a = _run_rl(raw, tmp_path / "async")
    ws, wa = _weights(out_s), _weights(out_a)
    assert ws.keys() == wa.keys() and all(torch.equal(ws[n], wa[n]) for n in ws)
    for f in sorted((out_s["rl_dir"] / "shards").glob("*.parquet")):
        a = read_parquet(out_a["rl_dir"] / "shards" / f.name)
        assert [r.pop("version") for r in a] == [int(f.stem[5:]) - 1] * len(a)
        assert read_parquet(f) == a
    assert asy["staleness"] == {"0": asy["samples"]} and asy["dropped"] == 0
    for key in ("final_reward", "first_reward", "samples", "shards"):
        assert sync[key] == asy[key]


@pytest.mark.slow
def test_two_generators_one_version_ahead_with_the_techniques_that_work_under_overlap(upstream, tmp_path, caplog):
    """k = 1, two generator processes, with the prior-fused baseline, entropy token selection, reference resets
    (KL loss) and a TIS correction (AReaL's decoupled objective: the weight pi_trainer / pi_behaviour): every step
    trained once, each sample's version in the shards within [step - 1, step], the staleness histogram
    counting every sample, the same prompts per step as the synchronous loop, and no generator left running."""
    import multiprocessing

    raw = {**upstream, "rl": {**upstream["rl"], "steps": 6, "overlap": {"max_staleness": 1, "generators": 2},
                              "advantage": "prior_fused", "dynamic_sampling": "off", "token_select": "top_entropy",
                              "kl_coef": 0.1, "ref_reset": {"every": 2, "optimizer": True},
                              "correction": {"name": "tis_token", "kwargs": {"cap": 2.0}}},
           "distill": {**upstream["distill"], "grpo_steps": 0}}
    with caplog.at_level("INFO", logger="rl"):
        m, out = _run_rl(raw, tmp_path / "a")
    assert m["steps"] == 6 and m["shards"] == 6 and m["dropped"] == 0
    assert sum(m["staleness"].values()) == m["samples"] and set(m["staleness"]) == {"0", "1"}
    for step in range(1, 7):
        rows = read_parquet(out["rl_dir"] / "shards" / f"step_{step:05d}.parquet")
        versions = {r["version"] for r in rows}
        assert len(versions) == 1 and step - 1 - 1 <= versions.pop() <= step - 1  # step s+1 trains at version s
        assert all(r["policy"].endswith(f"@step{r['version']}") for r in rows)
    log = (out["report_dir"] / "train_log.csv").read_text().splitlines()
    head = log[0].split(",")
    rows = [dict(zip(head, r.split(","), strict=True)) for r in log[1:]]
    assert {"staleness", "stale_0", "stale_1", "dropped", "wait_s", "logprob_gap", "is_masked"} <= set(head)
    assert all(int(r["stale_0"]) + int(r["stale_1"]) == int(r["samples"]) for r in rows)
    clock = [float(r["elapsed_s"]) for r in rows]  # the loop's wall clock at each step's end
    assert clock == sorted(clock) and clock[0] > 0
    assert all(0.2 <= float(r["pg_tokens"]) < 0.3 for r in rows if r["updated"] == "1")
    assert sum("reference reset" in r.message for r in caplog.records) == 3
    assert not multiprocessing.active_children()


@pytest.mark.slow
def test_a_crashed_async_run_resumes_with_no_prompt_skipped_or_repeated(upstream, tmp_path, monkeypatch):
    """Killed (here: an error) in the update of step 4 with a checkpoint after step 2: the re-run resumes at
    step 2, the steps after it are sampled again (step s's prompts and seeds are a function of s), and every
    step's shard holds the same (prompt, sample, seed) rows, once each, as an uninterrupted run's. What may
    differ under k > 0 is the version each resampled step used (timing), hence the tokens and the weights."""
    from posttrain.rl import update

    raw = {**upstream, "rl": {**upstream["rl"], "steps": 5, "checkpoint_every": 2,
                              "overlap": {"max_staleness": 1, "generators": 2}, "correction": {"name": "icepop"}}}
    straight, out_s = _run_rl(raw, tmp_path / "straight")
    real, calls = update.update_from_groups, []

    def dies_in_step_4(*a, **kw):
        calls.append(1)
        if len(calls) == 4:
            raise RuntimeError("killed in step 4")
        return real(*a, **kw)

    monkeypatch.setattr(update, "update_from_groups", dies_in_step_4)
    with pytest.raises(RuntimeError, match="killed in step 4"):
        _run_rl(raw, tmp_path / "resumed")
    monkeypatch.setattr(update, "update_from_groups", real)
    resumed, out_r = _run_rl(raw, tmp_path / "resumed")
    assert resumed["resumed_from_step"] == 2 and resumed["shards"] == 5 and resumed["samples"] == straight["samples"]

    def keys(out, step):
        return [(r["prompt_id"], r["sample"], r["seed"], r["step"])
                for r in read_parquet(out["rl_dir"] / "shards" / f"step_{step:05d}.parquet")]

    for step in range(1, 6):
        assert keys(out_r, step) == keys(out_s, step)
        assert len(set(keys(out_r, step))) == len(keys(out_r, step))
    clock = [float(r["elapsed_s"]) for r in csv.DictReader((out_r["report_dir"] / "train_log.csv").open())]
    assert clock == sorted(clock) and clock[0] > 0  # the resumed run's wall clock goes on from the checkpoint's


@pytest.mark.slow  # 7 s
def test_stale_steps_replay_from_their_shards_to_the_trainers_weights(upstream, tmp_path, monkeypatch):
    """Under rl.overlap a step's shard holds what its update needs (the behaviour policy's log-probs and version);
    the trainer's own weights at the step's start are the proximal policy. Steps 2 and 3 of a k = 1 run (sampled
    by a generator one version behind, or not), replayed from their persisted shards on the trainer's state at
    the step's start (weights and optimizer, captured in the run), give the trainer's weights after the step,
    bit for bit (with a TIS correction, so the shard's behaviour log-probs enter the update)."""
    import copy

    from posttrain import modeling, training
    from posttrain.rl import collect, update
    from posttrain.rollout import chat_prompt_ids

    raw = {**upstream, "rl": {**upstream["rl"], "steps": 3, "dynamic_sampling": "off",
                              "overlap": {"max_staleness": 1, "generators": 1},
                              # a TIS correction weighs by pi_trainer / pi_behaviour: the shard's log-probs count
                              "correction": {"name": "tis_token", "kwargs": {"cap": 2.0}}},
           "distill": {**upstream["distill"], "grpo_steps": 0}}
    real, seen = update.update_from_groups, []

    def capture(model, opt, sb, *a, **kw):  # the trainer's state around each update, as the run had it
        before = (copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict()))
        got = real(model, opt, sb, *a, **kw)
        seen.append((before, copy.deepcopy(model.state_dict()), kw["seed"]))
        return got

    monkeypatch.setattr(update, "update_from_groups", capture)
    _, out = _run_rl(raw, tmp_path / "a")
    monkeypatch.undo()
    p = parse_params(raw)
    policy = raw["paths"]["sft_model"]
    tok = modeling.load_tokenizer(policy)
    torch.set_num_threads(p.rl.overlap.trainer_threads)  # as the trainer ran
    versions = []
    for step in (2, 3):
        rows = read_parquet(out["rl_dir"] / "shards" / f"step_{step:05d}.parquet")
        versions.append({r["version"] for r in rows})
        (w0, o0), w1, seed = seen[step - 1]
        model = modeling.load_policy(policy, p.model, torch.device("cpu"))
        model.load_state_dict(w0)
        opt = training.adamw(model, p.rl.lr, p.rl.weight_decay, training.ONLINE_BETAS)
        opt.load_state_dict(o0)
        prompts = {r["prompt_id"]: r["prompt"] for r in rows}
        prompt_ids = dict(zip(prompts, chat_prompt_ids(tok, list(prompts.values())), strict=True))
        model.train()
        real(model, opt, collect.StepBatch.from_rows(rows, p.rl.samples_per_prompt), p.rl, prompt_ids,
             tok.pad_token_id, None, seed=seed)
        got = model.state_dict()
        assert all(torch.equal(got[k], w1[k]) for k in w1), f"step {step}: the replay moved other weights"
        assert any(not torch.equal(w0[k], w1[k]) for k in w1)  # the step did update
    assert all(len(v) == 1 for v in versions) and versions[0] | versions[1] <= {0, 1, 2}


def test_the_loops_correction_call_site_is_decoupled_ppo_under_overlap():
    """Under rl.overlap the update's old log-probs are the trainer's weights at the step's start (the proximal
    policy) and the sampler's are the behaviour policy's, k versions older: ppo_clip against the first times a
    correction's weight exp(prox - behav) is AReaL's decoupled objective. With icepop's band [1e-6, cap] it equals
    ``corrections.decoupled_ppo_loss`` with ``cap`` (a weight over the cap drops the token). By hand, with
    logp = prox (ratio 1, nothing clipped), A = 1: prox - behav = 0.5, -2, 2 -> w = e^0.5 = 1.6487,
    e^-2 = 0.1353, e^2 = 7.389 > 5 -> 0; loss = -A * w = -1.6487, -0.1353, 0."""
    from posttrain import algos, corrections

    prox = torch.tensor([[-1.0, -2.0, -0.5]])
    behav = prox - torch.tensor([[0.5, -2.0, 2.0]])
    mask, adv, cfg = torch.ones(1, 3), torch.tensor([1.0]), algos.LossCfg(0.2, 0.28, None)
    loss, _ = algos.ppo_clip(prox.clone(), prox, adv, cfg)
    loop = loss * corrections.CORRECTIONS["icepop"](prox, behav, mask, low=1e-6, high=5.0).weights
    areal, _ = corrections.decoupled_ppo_loss(prox.clone(), prox, behav, adv, mask, cfg, cap=5.0)
    assert torch.allclose(loop, areal) and torch.allclose(loop, torch.tensor([[-1.6487, -0.1353, 0.0]]), atol=1e-4)


def test_stale_samples_without_a_correction_are_refused_at_load(tiny):
    """Issue 50, finding 5: rl.overlap.max_staleness > 0 loaded with no off-policy correction, so samples up to k
    versions old were trained as on-policy (one optimizer step per batch: ratio 1, the clip never acts). Now
    refused in one line naming the key; k = 0 and any correction load."""
    tiny["distill"]["grpo_steps"] = 0
    tiny["rl"].update({"dynamic_sampling": "off", "overlap": {"max_staleness": 1}})
    with pytest.raises(ConfigError) as e:
        parse_params(tiny)
    msg = str(e.value)
    assert msg.startswith("params: rl.overlap.max_staleness: ") and "1 with no rl.correction" in msg
    assert "\n" not in msg
    parse_params({**tiny, "rl": {**tiny["rl"], "overlap": {"max_staleness": 0}}})
    parse_params({**tiny, "rl": {**tiny["rl"], "correction": {"name": "icepop"}}})
