"""Peak memory of one RL update and one distill update at the real vocabulary size (151,936), with the
memory-lean log-prob path (``posttrain.logprobs``) against the full-logits path it replaced, and with/without
LoRA.

A Qwen2-architecture model with Qwen2.5's vocabulary (hidden size and depth small enough for this machine:
the [B, T, V] logits are what matters, and they do not depend on depth) takes one ``update.policy_update`` on
B sequences of T tokens, and a half-width student one ``distillation.divergence_update`` against it. Each
case runs in a fresh child process; the peak is the process's peak RSS during the update (``VmHWM``, reset just
before it) minus the RSS after the models and data were built (CPU; before, ``ru_maxrss`` could hold the build's
own peak), or ``torch.cuda.max_memory_allocated`` minus the memory allocated before the update (GPU). The
"full" cases run the old code (kept here as the reference: the whole [B, T, V] logits, log-softmax over it)
through the same update functions; the log-probs of both paths are compared on the same batch.

    python benchmarks/logprob_memory.py [--device cpu|cuda] [--hidden 64] [--layers 2] [--seqs 8] [--len 256]
    python benchmarks/logprob_memory.py --device cuda --qwen05b --hidden 896 --layers 24 --seqs 16 --len 1024
    python benchmarks/logprob_memory.py --model <run>/models/sft --student <run>/models/student_sft --tag smollm2

``--model``: a real model folder as the policy and the distill teacher (its own vocabulary, e.g. SmolLM2's 49,152),
``--student`` the distill student (by default a second copy of ``--model``); random token ids either way.

prints a table and writes benchmarks/results/logprob_memory_<device>.json.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from posttrain import distillation, logprobs, modeling  # noqa: E402
from posttrain.config import LoraCfg, Rl  # noqa: E402
from posttrain.rl import update  # noqa: E402
from tests.realmodel import QWEN25_05B, full_logp_entropy, qwen2  # noqa: E402

VOCAB = 151_936


def full_token_logp_entropy(model, t, temperature=1.0, entropy="grad", chunk=0):
    """The replaced path (``tests.realmodel.full_logp_entropy``) with token_logp_entropy's signature, to patch in."""
    return full_logp_entropy(model, t, temperature)


def full_divergence_update(student, teacher, opt, seqs, divergence, beta, pad_id, micro, max_grad_norm=1.0,
                           temperature=1.0):
    """The replaced distill update: both models' [B, T, V] logits."""
    from posttrain import divergences

    device = next(student.parameters()).device
    n_tok = sum(len(s.completion_ids) for s in seqs)
    opt.zero_grad(set_to_none=True)
    for start in range(0, len(seqs), micro):
        t = logprobs.batch_tensors(seqs[start : start + micro], pad_id, device)
        with torch.no_grad():
            t_logp = torch.log_softmax(teacher(input_ids=t["ids"], attention_mask=t["attn"]).logits[:, :-1].float()
                                       / temperature, -1)
        s_logp = torch.log_softmax(student(input_ids=t["ids"], attention_mask=t["attn"]).logits[:, :-1].float()
                                   / temperature, -1)
        div = divergences.DIVERGENCES[divergence](s_logp, t_logp, beta)
        (div * t["mask"]).sum().div(n_tok).backward()
    torch.nn.utils.clip_grad_norm_(student.parameters(), max_grad_norm)
    opt.step()
    return {}


def _seqs(n: int, length: int, vocab: int, seed: int = 0) -> list[logprobs.Seq]:
    g = torch.Generator().manual_seed(seed)
    p = length // 4
    return [logprobs.Seq(torch.randint(0, vocab, (p,), generator=g).tolist(),
                     torch.randint(0, vocab, (length - p,), generator=g).tolist(), [0.0] * (length - p),
                     1.0 if i % 2 else -1.0) for i in range(n)]


def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize() / 2**20


def _reset_peak() -> None:
    """Resets the process's peak RSS (``VmHWM``) to its RSS now (Linux >= 4.0): the peak read after the update is
    then the update's, not the model build's (``ru_maxrss`` cannot be reset)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def _peak_mb() -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmHWM:")) / 1024


def child(case: str, path: str, lora: bool, a: argparse.Namespace) -> dict:
    device = torch.device(a.device)
    torch.set_num_threads(2)
    dtype = "bfloat16" if device.type == "cuda" else "float32"
    lcfg = LoraCfg(r=16, alpha=32, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]) if lora else None
    shape = ({k: QWEN25_05B[k] for k in ("heads", "kv_heads", "intermediate", "tie")} if a.qwen05b else {})
    model = (modeling.load_model(a.model, dtype, device, trainable=True) if a.model
            else qwen2(None, hidden=a.hidden, layers=a.layers, vocab_size=VOCAB, seed=0, **shape))
    policy = modeling.make_trainable(model, lcfg, gradient_checkpointing=a.grad_ckpt).to(device)
    vocab = policy.config.vocab_size
    seqs = _seqs(a.seqs, a.len, vocab)
    cfg = Rl(micro_batch_size=a.seqs, lr=1e-5)
    trainable = [p for p in policy.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(trainable, lr=1e-5)
    if case == "distill":
        teacher = policy.eval()
        student = (modeling.load_model(a.student or a.model, dtype, device) if a.model
                   else qwen2(None, hidden=a.hidden // 2, layers=a.layers, vocab_size=VOCAB, seed=1).to(device))
        opt = torch.optim.AdamW(student.parameters(), lr=1e-5)
    if path == "full":
        update.token_logp_entropy = full_token_logp_entropy  # the name policy_update calls
    if device.type == "cuda":
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
    rss0 = _rss_mb()
    _reset_peak()
    t0 = time.time()
    with modeling.autocast(dtype, device):
        if case == "rl":
            update.policy_update(policy.train(), opt, seqs, cfg, pad_id=0)
        else:
            fn = full_divergence_update if path == "full" else distillation.divergence_update
            fn(student.train(), teacher, opt, seqs, "reverse_kl", 0.5, 0, a.seqs)
    if device.type == "cuda":
        torch.cuda.synchronize()
    secs = time.time() - t0
    peak = ((torch.cuda.max_memory_allocated() - base) / 2**20 if device.type == "cuda"
            else _peak_mb() - rss0)
    out = {"case": case, "path": path, "lora": lora, "vocab": vocab, "peak_mb": round(peak, 1),
           "seconds": round(secs, 2), "trainable_params": sum(p.numel() for p in trainable),
           "total_params": modeling.num_params(policy)}
    if case == "rl":  # the two paths' log-probs on the same batch
        t = logprobs.batch_tensors(seqs[:2], 0, device)
        with torch.no_grad(), modeling.autocast(dtype, device):
            lean = logprobs.token_logp_entropy(policy, t, entropy="off")[0]
            full = full_token_logp_entropy(policy, t)[0] * t["mask"]
        out["max_logp_diff"] = float((lean - full).abs().max())
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--seqs", type=int, default=8)
    ap.add_argument("--len", type=int, default=256)
    ap.add_argument("--qwen05b", action="store_true", help="Qwen2.5-0.5B's shape (hidden 896, 24 layers, ...)")
    ap.add_argument("--grad-ckpt", action="store_true", help="gradient checkpointing on (layer activations "
                    "recomputed): what is left is mostly the logits")
    ap.add_argument("--model", help="a model folder (a real model) instead of the random-init Qwen2 shape")
    ap.add_argument("--student", help="with --model: the distill student's folder (default: --model)")
    ap.add_argument("--tag", default="", help="appended to the result file's name")
    ap.add_argument("--child", nargs=3)
    a = ap.parse_args()
    if a.child:
        print(json.dumps(child(a.child[0], a.child[1], a.child[2] == "lora", a)))
        return
    rows = []
    for case, path, lora in [("rl", "full", "nolora"), ("rl", "lean", "nolora"), ("rl", "lean", "lora"),
                             ("distill", "full", "nolora"), ("distill", "lean", "nolora")]:
        cmd = [sys.executable, __file__, "--device", a.device, "--hidden", str(a.hidden), "--layers", str(a.layers),
               "--seqs", str(a.seqs), "--len", str(a.len), "--child", case, path, lora]
        cmd += ["--qwen05b"] * a.qwen05b + ["--grad-ckpt"] * a.grad_ckpt
        cmd += [x for k in ("model", "student") if getattr(a, k) for x in (f"--{k}", getattr(a, k))]
        res = subprocess.run(cmd, capture_output=True, text=True)
        if res.returncode:
            sys.exit(res.stderr[-2000:])
        rows.append(json.loads(res.stdout.strip().splitlines()[-1]))
        print(rows[-1], flush=True)
    shape = f"{a.model} (student {a.student or a.model})" if a.model else f"hidden {a.hidden}, layers {a.layers}"
    print(f"\nvocab {rows[0]['vocab']}, {'Qwen2.5-0.5B shape, ' * a.qwen05b}{shape}, "
          f"{a.seqs} sequences x {a.len} tokens, {a.device}{', gradient checkpointing' * a.grad_ckpt}")
    print(f"{'update':8} {'path':5} {'lora':5} {'peak MB':>9} {'s':>7} {'trainable':>11} {'logp diff':>10}")
    for r in rows:
        print(f"{r['case']:8} {r['path']:5} {str(r['lora']):5} {r['peak_mb']:9.0f} {r['seconds']:7.2f} "
              f"{r['trainable_params']:11,d} {r.get('max_logp_diff', float('nan')):10.2e}")
    for case in ("rl", "distill"):
        full, lean = (next(r for r in rows if r["case"] == case and r["path"] == p and not r["lora"])
                      for p in ("full", "lean"))
        print(f"{case}: peak {full['peak_mb']:.0f} MB -> {lean['peak_mb']:.0f} MB "
              f"({full['peak_mb'] / max(lean['peak_mb'], 1):.1f}x less)")
    name = f"logprob_memory_{a.device}{'_qwen05b' * a.qwen05b}{'_ckpt' * a.grad_ckpt}{'_' * bool(a.tag)}{a.tag}.json"
    out = ROOT / "benchmarks" / "results" / name
    out.write_text(json.dumps({"vocab": rows[0]["vocab"], "args": {k: v for k, v in vars(a).items() if k != "child"},
                               "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
