"""The memory plan (``posttrain plan``): per-rank peak memory of the sft, rl and distill updates under FSDP2 at a
target world size and GPU memory, **measured by running** one update step of this project's own code path
(``Dist.wrap``, ``training.accumulate``, ``logprobs.token_logp_entropy``, the frozen KL reference or teacher the
stage loads) under torch.distributed's fake process group and fake tensors, with torch's ``FSDPMemTracker``
(``torch.distributed._tools.fsdp2_mem_tracker``). No weights are read and no GPU is needed: a model is its
``config.json`` (a local folder's, or a file such as ``benchmarks/model_configs/qwen2.5-7b.json``).

What it counts, per rank: sharded parameters, gradients and optimizer state, the unsharded parameters and
all-gather buffers FSDP2 holds during a layer's forward/backward, activations and temporaries at the step's
peak (the tracker's categories), and, resident beside them, the full-weight copies our code keeps (the FSDP2
generation copy, the KL reference, the teacher): bytes of the tensors the code allocated, not a formula. The
vLLM engine's share (``rollout.vllm.gpu_memory_utilization`` of the card) is added to the generation phase, and
so are the casts autocast caches while the hf backend samples on fp32 masters in a bf16 region (counted by
torch's caching rule, ``autocast_cache_bytes``: the one count here that is not an allocation the plan ran).
What it does not model: the CUDA caching allocator's fragmentation and NCCL's buffers (budget ~5-10% more),
CUDA kernels' workspaces, and which SDPA kernel a GPU picks (the plan runs CPU's flash-attention kernel, which
like a GPU's never materialises the [T, T] scores). Fake tensors have no values, so the memory-lean log-prob
path scores every position (``logprobs.scored_positions``): the most its LM head can cost.

torch's ``FakeStore`` (``torch.testing._internal.distributed.fake_pg``) is the store the fake backend takes;
torchtitan's memory estimator uses the same pieces.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
import torch.distributed as tdist

from posttrain import distributed, logprobs, modeling, training
from posttrain.distributed import Dist, forward, placement
from posttrain.rollout import ModelFolder, policy_source

GiB = 2**30
STAGES = ("sft", "rl", "distill")


@dataclass(frozen=True)
class Shape:
    """One stage's update as the plan runs it: ``seqs`` sequences of ``seq_len`` tokens per micro-batch."""

    stage: str
    seqs: int
    seq_len: int
    frozen: str | None  # "reference" (rl's KL anchor: sharded under FSDP2) or "teacher" (distill: a full model)
    engine_frac: float  # of the card, held by a colocated vLLM engine while it generates (0: hf backend)
    entropy: str  # "grad" when the loss has an entropy term


def shapes(params: Any, seq_len: int) -> list[Shape]:
    """The three trainers' micro-batches under ``params`` (a token budget caps the sequences per micro-batch)."""
    def seqs(cfg: Any) -> int:
        budget = getattr(cfg, "max_tokens_per_micro_batch", None)
        return max(1, min(cfg.micro_batch_size, budget // seq_len)) if budget else cfg.micro_batch_size

    rl, engine = params.rl, params.rollout.vllm.gpu_memory_utilization if params.rollout.backend == "vllm" else 0.0
    kl = (rl.kl_coef > 0 or rl.kl_reward_coef > 0) and params.model.lora is None  # LoRA: the adapter off is the ref
    return [Shape("sft", seqs(params.sft), seq_len, None, 0.0, "off"),
            Shape("rl", seqs(rl), seq_len, "reference" if kl else None, engine,
                  "grad" if rl.entropy_coef > 0 else "off"),
            Shape("distill", seqs(params.distill), seq_len, "teacher", engine, "off")]


class _PlanDist(Dist):
    """``Dist`` on the fake process group: its reductions of Python numbers return this rank's value (what the
    fake backend's all-reduce returns) without the ``.item()`` a fake tensor cannot give."""

    def sum(self, *xs: float) -> list[float]:
        return [float(x) for x in xs]

    def max(self, x: float) -> float:
        return float(x)

    def clip_grad_norm(self, model: torch.nn.Module, max_norm: float) -> float:
        torch.nn.utils.clip_grad_norm_(modeling.trainable_params(model), max_norm)
        return 0.0


@contextlib.contextmanager
def fake_job(world: int) -> Iterator[Dist]:
    """A fake process group of ``world`` ranks (this process is rank 0), its device mesh, fake tensors, and
    ``distributed.current()`` set to it; all undone after."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    tdist.init_process_group("fake", rank=0, world_size=world, store=FakeStore())
    before, positions = distributed._CURRENT, logprobs.scored_positions
    try:
        d = _PlanDist(0, world, 0, "fsdp2", "cpu", init_device_mesh("cpu", (world,)))  # the mesh: outside fake mode
        distributed._CURRENT = d
        logprobs.scored_positions = lambda mask: torch.arange(mask.numel())  # no values: every position
        with FakeTensorMode(allow_non_fake_inputs=True):
            yield d
    finally:
        distributed._CURRENT, logprobs.scored_positions = before, positions
        tdist.destroy_process_group()


def resident_bytes(*modules: torch.nn.Module) -> int:
    """Bytes of the distinct allocated storages of ``modules``' parameters and buffers (tied ones once; a
    skeleton's meta tensors hold none)."""
    seen: dict[int, int] = {}
    for m in modules:
        for t in (*m.parameters(), *m.buffers()):
            t = t.to_local() if hasattr(t, "to_local") else t  # a shard's own bytes
            if not t.is_meta:
                seen[id(t.untyped_storage())] = t.untyped_storage().nbytes()
    return sum(seen.values())


def autocast_cache_bytes(module: torch.nn.Module, dtype: str) -> int:
    """Bytes autocast holds while ``module`` samples on the hf backend in a ``dtype`` region (under ``no_grad``,
    ``rollout.hf``): one ``dtype`` cast of each distinct fp32 leaf weight and bias that requires grad and a
    linear layer reads, kept until the region ends (torch caches only those; tests/test_rollout.py counts the
    casts). So the fp32 trainer sampling under bf16 autocast (full fine-tuning, no FSDP2 copy) holds 2 more
    bytes per linear parameter; a copy already in ``dtype`` (FSDP2's) or a frozen LoRA base holds none."""
    if dtype == "float32":
        return 0
    size = torch.empty(0, dtype=getattr(torch, dtype)).element_size()
    cast = {id(t): t.numel() for mod in module.modules() if isinstance(mod, torch.nn.Linear)
            for t in (mod.weight, mod.bias) if t is not None and t.requires_grad and t.dtype == torch.float32}
    return size * sum(cast.values())  # (tied weights: one tensor, one cast)


# the trackers' categories, in the table's columns (FSDPMemTracker's and MemTracker's names)
CATEGORIES = {"Params": ("Sharded Param", "Parameter", "Buffer"),
              "Gathered": ("Unsharded Param", "All Gather", "Reduce Scatter"),
              "Grads": ("Sharded Grad", "Unsharded Grad", "Gradient"),
              "OptState": ("OptState", "Optstate"), "Activation": ("Activation",), "Temp": ("Temp", "Other")}


def _peak_only(tracker: type) -> type:
    """``tracker`` (torch's MemTracker or FSDPMemTracker) keeping the global peak only: after every op they update
    the peak of each tracked module, a loop over all modules (a 7B LoRA step, ~1,000 modules, ran 25 minutes
    without ending); the plan reads the global peak alone."""
    from copy import deepcopy

    class PeakOnly(tracker):  # type: ignore[misc, valid-type]
        def _update_peak_stats(self, peak_state: Any) -> None:
            for dev, snap in self._curr_mem_snap.items():
                if self._peak_mem.get(dev, 0) < snap["Total"]:
                    self._peak_mem[dev] = snap["Total"]
                    self._peak_mem_snap[dev] = deepcopy(snap)

    return PeakOnly


class _NoHook:
    """A hook handle with nothing to remove: MemTracker's stand-in for a frozen parameter's gradient hooks."""

    def remove(self) -> None:
        pass


def measure(config: Any, params: Any, shape: Shape, d: Dist, student: Any = None) -> dict[str, float]:
    """Run two update steps of ``shape`` (the second one, tracked, holds the optimizer's state) on a model built from
    ``config`` inside ``fake_job``, as the stage runs it (rl and distill first make the generation copy, sft
    never; distill trains its student, ``distill.student``); the tracker's categories at the step's peak and the
    resident copies, GiB per rank. Under DDP (``runtime.distributed.strategy``; LoRA, which the config refuses
    under FSDP2) every rank runs the one-process step and holds the whole model, so ``d`` is a world of one."""
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
    from torch.distributed._tools.mem_tracker import MemTracker
    from transformers import AutoModelForCausalLM

    m = params.model
    with torch.device("meta"):  # built as FSDP2's ranks > 0 build it, then allocated (as fake tensors)
        trained = (student or student_config(config, params.distill.student)) if shape.stage == "distill" else config
        model = AutoModelForCausalLM.from_config(trained, dtype=getattr(torch, modeling.policy_dtype(m)),
                                                 attn_implementation=m.attn_implementation)
        model = modeling.make_trainable(model, m.lora, m.gradient_checkpointing)
        frozen = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, m.dtype),
                                                  attn_implementation=m.attn_implementation) if shape.frozen else None
    for module in (model, frozen):
        if module is not None:
            placement.to_empty_tied(module, "cpu")  # (fake tensors: fake_job's mode)
    if shape.frozen == "reference" and d.active:  # sharded as the rl stage's Dist.load_frozen shards it
        frozen, _ = placement.fsdp2(frozen.requires_grad_(False), d.main, torch.device("cpu"), False, d.mesh, m.dtype,
                                    with_copy=False)
    wrapped = d.wrap(model.train(), m.dtype)
    cache = 0  # bytes of autocast's casts while the hf backend samples (sft never samples)
    if shape.stage != "sft":  # the backend built and synced as the stage does: the hf backend's full copy
        # (resident from here on), or the vllm engine's folder and its stream (one gathered tensor at a time)
        name = "vllm" if shape.engine_frac and shape.stage == "rl" else "hf"  # distill's student: always hf
        # (stages/distill.py; its engine, when vllm, holds the teacher)
        policy_source(name, lambda: d.plain(wrapped), ModelFolder("(planned)"))
        weights = d.for_generation(wrapped, SimpleNamespace(samples_with_module=name == "hf"))
        for _ in () if isinstance(weights, torch.nn.Module) else weights:
            pass
        cache = autocast_cache_bytes(weights, m.dtype) if isinstance(weights, torch.nn.Module) else 0
    opt = training.adamw(wrapped, 1e-6, 0.0, training.ONLINE_BETAS)
    items = list(range(shape.seqs * d.world))  # one micro-batch per rank: the tracker follows one forward a step
    runs = wrapped if d.active else placement.Forward(wrapped)  # DDP's module: one root per step, as FSDP2's

    def loss_of(chunk: list[int], real: bool) -> torch.Tensor:
        ids = torch.randint(0, config.vocab_size, (len(chunk), shape.seq_len))
        batch = {"ids": ids, "attn": torch.ones_like(ids), "mask": torch.ones_like(ids[:, 1:], dtype=torch.bool)}
        with modeling.autocast(m.dtype, torch.device("cpu")):
            lp, ent = forward(runs, logprobs.token_logp_entropy, batch, entropy=shape.entropy)
        return -(lp.sum() + ent.sum()) / ids.numel()

    training.accumulate(wrapped, opt, items, shape.seqs, loss_of, 1.0)  # FSDP2's lazy init, Adam's state made
    if shape.frozen == "reference" and d.active:  # scored once, as each step scores it: what stays gathered after
        ids = torch.randint(0, config.vocab_size, (shape.seqs, shape.seq_len))
        batch = {"ids": ids, "attn": torch.ones_like(ids), "mask": torch.ones_like(ids[:, 1:], dtype=torch.bool)}
        with torch.no_grad(), modeling.autocast(m.dtype, torch.device("cpu")):
            forward(frozen, logprobs.token_logp_entropy, batch, entropy="off")
    if d.active:
        tracker = _peak_only(FSDPMemTracker)(wrapped, opt)
    else:
        tracker = _peak_only(MemTracker)()
        tracker.track_external(wrapped, opt)
        for p in wrapped.parameters():  # MemTracker hooks every parameter's grad, which a frozen one refuses
            if not p.requires_grad:
                tracker._param_to_grad_hook_handles[p] = (_NoHook(), _NoHook())
    with tracker:  # the step as every later one runs
        training.accumulate(wrapped, opt, items, shape.seqs, loss_of, 1.0)
    (peak,) = tracker.get_tracker_snapshot("peak").values()
    got = {str(getattr(k, "value", k)): v for k, v in peak.items()}
    out = {col: sum(got.get(k, 0) for k in keys) / GiB for col, keys in CATEGORIES.items()}
    out["Full copy"] = resident_bytes(*d._copies.values()) / GiB
    out["Frozen model"] = resident_bytes(frozen) / GiB if frozen is not None else 0.0
    out["Autocast cache"] = cache / GiB
    out["Update peak"] = got["Total"] / GiB + out["Full copy"] + out["Frozen model"]
    d._copies.clear()
    return out


def plan(config: Any, params: Any, world: int, gpu_gib: float, seq_len: int, stages: tuple[str, ...] = STAGES,
         student: Any = None) -> list[dict[str, Any]]:
    """One row per stage: the measured categories (GiB per rank), the update's peak, the generation phase's
    (what stays resident while the engine or the hf copy generates, plus the engine's share) and a verdict.
    ``student``: the distill student's config (default: from ``distill.student``)."""
    rows = []
    for shape in shapes(params, seq_len):
        if shape.stage not in stages:
            continue
        ddp = params.runtime.distributed.strategy == "ddp"  # (the config refuses FSDP2 with LoRA)
        with fake_job(1 if ddp else world) as d:
            got = measure(config, params, shape, d, student)
        engine = shape.engine_frac * gpu_gib
        gen = got["Params"] + got["OptState"] + got["Full copy"] + got["Frozen model"] + got["Autocast cache"] + engine
        peak = max(got["Update peak"], gen)
        rows.append({"stage": shape.stage, "world": world, "strategy": "ddp" if ddp else "fsdp2",
                     "seqs": shape.seqs, "seq_len": seq_len,
                     **{k: round(v, 6) for k, v in got.items()}, "Engine": round(engine, 6),
                     "Generation peak": round(gen, 6), "Peak": round(peak, 6),
                     "verdict": "fits" if peak <= gpu_gib else advice(got, peak, gpu_gib)})
    return rows


def advice(got: dict[str, float], peak: float, gpu_gib: float) -> str:
    """What to change, from the largest share of the peak."""
    over = f"needs {peak:.1f} GiB of {gpu_gib:g}"
    if got["Activation"] + got.get("Temp", 0.0) >= max(got["Full copy"], got["Frozen model"], got["OptState"]):
        return f"{over}: set model.gradient_checkpointing, or fewer tokens per micro-batch"
    if got["Full copy"] + got["Frozen model"] >= got["OptState"]:
        return f"{over}: the full copies per rank dominate (LoRA: model.lora)"
    return f"{over}: more ranks, or LoRA (model.lora)"


COLUMNS = (*CATEGORIES, "Full copy", "Frozen model", "Update peak", "Autocast cache", "Engine", "Generation peak")


def table(rows: list[dict[str, Any]], title: str) -> str:
    """A markdown table of ``plan`` rows (GiB per rank)."""
    head = ["stage", "strategy", "seqs x len", *COLUMNS, "verdict"]
    lines = [f"**{title}** (GiB per rank)", "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells = [r["stage"], r["strategy"], f"{r['seqs']} x {r['seq_len']}", *(f"{r.get(c, 0.0):.2f}" for c in COLUMNS),
                 r["verdict"]]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def student_config(teacher: Any, student: Any) -> Any:
    """The distill student's config: the teacher's cut to ``layers`` (``{layers: k}``), the teacher's with a
    ``tiny`` size's fields, or a student folder's own ``config.json``."""
    import copy

    if isinstance(student, str):
        return load_config(student)
    cfg = copy.deepcopy(teacher)
    if hasattr(student, "layers"):
        cfg.num_hidden_layers = student.layers
    else:
        cfg.hidden_size, cfg.num_hidden_layers = student.hidden_size, student.num_layers
        cfg.num_attention_heads = cfg.num_key_value_heads = student.num_heads
        cfg.intermediate_size, cfg.head_dim = student.intermediate_size, student.hidden_size // student.num_heads
    return cfg


def load_config(source: str | Path) -> Any:
    """A model's config: a ``config.json`` file or a model folder holding one."""
    from transformers import AutoConfig

    p = Path(source)
    if p.is_file():
        import json

        raw = json.loads(p.read_text())
        return AutoConfig.for_model(raw.pop("model_type"), **raw)
    return AutoConfig.from_pretrained(str(p))
