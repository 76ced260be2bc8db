"""One optimizer step of a small Llama through the Hugging Face Trainer with zerocore stage 2
(``ZeroTrainer``), against ``zerocore.initialize`` driving the same model directly, and against the
same Trainer with DeepSpeed stage 2 (``TrainingArguments(deepspeed=...)``, DS_ACCELERATOR=cpu).

    python benchmarks/trainer_step.py --rounds 3 --steps 12 --out benchmarks/results/trainer_step_gloo_w2.json

Each variant runs in its own ``torchrun`` job of ``--ranks`` gloo ranks (1 thread each); the
variants run in a fresh random order each round. A step is timed from the Trainer's
``on_step_begin`` to ``on_step_end`` (forward, backward, reduction, clipping, optimizer step,
scheduler step; the batch is already fetched), and the direct loop times the same work. The first
``--warmup`` steps are dropped. Targets: Trainer/direct <= 1.03, Trainer(zerocore)/Trainer(DeepSpeed) <= 1.
Note: Transformers+DeepSpeed on CPU counts each rank as a world of one (it feeds both ranks the same
batches); its step still does the same compute and reduction.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
VARIANTS = ("direct", "trainer_zerocore", "trainer_deepspeed")
MICRO, SEQ, VOCAB = 4, 128, 2048


def model_and_data(n):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=256, intermediate_size=688,
                                         num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=4,
                                         max_position_embeddings=SEQ))
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (n, SEQ), generator=g)
    return model, ids


ZCFG = {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": 1, "gradient_clipping": 1.0,
        "zero_optimization": {"stage": 2}}


def worker(variant: str, steps: int, warmup: int, out: str) -> None:
    import torch
    from transformers import TrainerCallback, TrainingArguments

    torch.set_num_threads(1)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    total = steps + warmup
    model, ids = model_and_data(total * MICRO * world)
    times = []
    if variant == "direct":
        import zerocore

        engine = zerocore.initialize(model, dict(ZCFG, optimizer={"type": "AdamW", "params": {
            "lr": 1e-4, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.0}}))
        rank = engine.rank
        sched = torch.optim.lr_scheduler.LambdaLR(torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1e-4),
                                                  lambda s: min(1.0, (s + 1) / 3))
        for s in range(total):
            batch = ids[(s * world + rank) * MICRO:(s * world + rank + 1) * MICRO]
            t0 = time.perf_counter()
            engine.lr = sched.get_last_lr()[0]
            loss = engine(input_ids=batch, labels=batch).loss
            engine.backward(loss)
            engine.step()
            sched.step()
            times.append(time.perf_counter() - t0)
    else:
        import transformers

        class Tokens(torch.utils.data.Dataset):
            def __len__(self):
                return len(ids)

            def __getitem__(self, i):
                return {"input_ids": ids[i], "labels": ids[i]}

        class Timer(TrainerCallback):
            def on_step_begin(self, *a, **k):
                self.t0 = time.perf_counter()

            def on_step_end(self, *a, **k):
                times.append(time.perf_counter() - self.t0)

        tmp = tempfile.mkdtemp(prefix="trainer_step_")
        kw = {}
        if variant == "trainer_deepspeed":
            kw["deepspeed"] = {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
                               "gradient_clipping": "auto", "zero_optimization": {"stage": 2}}
        args = TrainingArguments(output_dir=tmp, per_device_train_batch_size=MICRO, max_steps=total,
                                 learning_rate=1e-4, warmup_steps=3, lr_scheduler_type="constant_with_warmup",
                                 max_grad_norm=1.0, logging_steps=10_000, save_strategy="no", use_cpu=True,
                                 ddp_backend="gloo", report_to=[], disable_tqdm=True, dataloader_num_workers=0,
                                 **kw)
        common = dict(model=model, args=args, train_dataset=Tokens(), callbacks=[Timer()])
        if variant == "trainer_zerocore":
            from zerocore.integrations.transformers import ZeroTrainer

            trainer = ZeroTrainer(**common, zerocore_config=ZCFG)
        else:
            trainer = transformers.Trainer(**common)
        trainer.train()
        rank = trainer.args.process_index
    if rank == 0:
        with open(out, "w") as f:
            json.dump({"times": times[warmup:]}, f)


def launch(variant, args, tmp) -> list[float]:
    out = os.path.join(tmp, f"{variant}.json")
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), OMP_NUM_THREADS="1",
               DS_ACCELERATOR="cpu", TRANSFORMERS_NO_ADVISORY_WARNINGS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={args.ranks}", __file__,
           "--worker", variant, "--steps", str(args.steps), "--warmup", str(args.warmup), "--json", out]
    r = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if r.returncode != 0:
        print(f"{variant} failed:\n{r.stderr[-3000:]}", file=sys.stderr)
        return []
    with open(out) as f:
        return json.load(f)["times"]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--worker")
    p.add_argument("--json")
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--out")
    a = p.parse_args()
    if a.worker:
        return worker(a.worker, a.steps, a.warmup, a.json)
    sys.path.insert(0, HERE)
    from _common import machine_info

    variants = a.variants.split(",")
    per_round = {v: [] for v in variants}
    loads = [os.getloadavg()[0]]
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(a.rounds):
            order = random.sample(variants, len(variants))
            for v in order:
                t = launch(v, a, tmp)
                per_round[v].append(statistics.median(t) if t else None)
                loads.append(os.getloadavg()[0])
                print(f"round {r} {v}: {per_round[v][-1]}", flush=True)
    med = {v: statistics.median([x for x in xs if x is not None]) if any(x is not None for x in xs) else None
           for v, xs in per_round.items()}

    def ratio(x, y):
        if med.get(x) is None or med.get(y) is None:
            return None
        rounds = [p / q for p, q in zip(per_round[x], per_round[y]) if p and q]
        return {"overall": med[x] / med[y], "per_round": rounds}

    result = {"machine": machine_info(), "ranks": a.ranks, "rounds": a.rounds, "steps": a.steps,
              "model": "Llama 4 layers, hidden 256, vocab 2048, seq 128, micro batch 4, fp32",
              "median_step_s": med, "per_round_median_s": per_round, "load_average_1min": loads,
              "trainer_vs_direct": ratio("trainer_zerocore", "direct"),
              "trainer_zerocore_vs_trainer_deepspeed": ratio("trainer_zerocore", "trainer_deepspeed"),
              "targets": {"trainer_vs_direct": "<= 1.03", "trainer_zerocore_vs_trainer_deepspeed": "<= 1.0"}}
    lines = ["| variant | median step (ms) | per-round medians (ms) |", "|---|---|---|"]
    for v in variants:
        lines.append(f"| {v} | {med[v] * 1e3:.1f} | " + ", ".join(f"{x * 1e3:.1f}" if x else "failed"
                                                                  for x in per_round[v]) + " |"
                     if med[v] else f"| {v} | failed | |")
    for k in ("trainer_vs_direct", "trainer_zerocore_vs_trainer_deepspeed"):
        if result[k]:
            lines.append(f"\n{k}: {result[k]['overall']:.3f}x (per round "
                         + ", ".join(f"{x:.3f}" for x in result[k]["per_round"]) + f"; target {result['targets'][k]})")
    lines.append(f"\nload average (1 min) during the run: {min(loads):.1f}-{max(loads):.1f}")
    text = "\n".join(lines)
    print(text)
    if a.out:
        with open(a.out, "w") as f:
            json.dump(result, f, indent=1)
        with open(os.path.splitext(a.out)[0] + ".txt", "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
