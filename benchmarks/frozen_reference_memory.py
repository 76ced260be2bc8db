"""What a rank holds of TRL's DPO reference model at ZeRO stage 3: partitioned by zerocore (the trainer wraps it in an
engine that trains nothing, as TRL's DeepSpeed path wraps it in DeepSpeed's inference engine) or kept whole on every
rank (as TRL keeps a reference model without DeepSpeed).

Each variant runs in fresh processes (``torchrun --nproc_per_node WORLD``, gloo, CPU): a Llama built from its
config (the policy) and a copy of it (the reference), ``make_zero_trainer(DPOTrainer)`` at stage 3 in bf16, a few
DPO steps. Per rank: the bytes the reference's engine holds (its ``memory_report``), the resident set after the
trainer is built and after training, and the peak (VmHWM); variants interleaved over rounds, medians and
ranges over rounds and ranks. ``whole`` is the same run with the wrapping turned off.

    python benchmarks/frozen_reference_memory.py --out benchmarks/results/frozen_reference_memory_cpu_w2.json
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
VARIANTS = ("sharded", "whole")


def worker(args) -> None:
    import copy

    import datasets
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast
    from trl import DPOConfig, DPOTrainer

    import zerocore.integrations.transformers.trainer as trainer_module
    from zerocore.integrations.transformers import make_zero_trainer

    if args.variant == "whole":  # the reference model left as TRL leaves it without DeepSpeed
        trainer_module.shard_frozen_models = lambda trainer: []
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.hidden * 8 // 3,
                      num_hidden_layers=args.layers, num_attention_heads=args.hidden // 64,
                      num_key_value_heads=args.hidden // 64, max_position_embeddings=64, pad_token_id=0,
                      eos_token_id=1, bos_token_id=2, tie_word_embeddings=False)
    model = LlamaForCausalLM(cfg).to(torch.bfloat16)
    ref = copy.deepcopy(model)
    ref_bytes = sum(p.numel() * p.element_size() for p in ref.parameters())
    words = Tokenizer(models.WordLevel({f"t{i}": i for i in range(args.vocab)}, unk_token="t0"))
    words.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok = PreTrainedTokenizerFast(tokenizer_object=words, pad_token="t0", eos_token="t1", bos_token="t2")
    n = 64
    pairs = {"prompt": [" ".join(f"t{(i * 5 + j) % 200 + 3}" for j in range(6)) for i in range(n)],
             "chosen": [" ".join(f"t{(i * 3 + j) % 200 + 3}" for j in range(4)) for i in range(n)],
             "rejected": [" ".join(f"t{(i * 7 + j) % 200 + 3}" for j in range(5)) for i in range(n)]}
    out_dir = tempfile.mkdtemp()
    dargs = DPOConfig(output_dir=out_dir, per_device_train_batch_size=2, max_steps=args.steps, logging_steps=1,
                      learning_rate=1e-4, report_to=[], use_cpu=True, save_strategy="no", bf16=True, seed=0,
                      ddp_backend="gloo", disable_tqdm=True)
    zc = {"bf16": {"enabled": True}, "zero_optimization": {"stage": 3}}
    trainer = make_zero_trainer(DPOTrainer)(model=model, ref_model=ref, args=dargs, processing_class=tok,
                                            train_dataset=datasets.Dataset.from_dict(pairs), zerocore_config=zc)
    del ref
    from offload_rss import status  # (this folder's: VmRSS and VmHWM from /proc/self/status)

    built = status()["VmRSS"]
    engines = getattr(trainer, "zerocore_frozen_engines", [])
    held = sum(e.memory_report()["frozen"] for e in engines)
    t0 = time.perf_counter()
    trainer.train()
    seconds = time.perf_counter() - t0
    rec = {"variant": args.variant, "rank": int(os.environ.get("RANK", "0")), "ref_bytes_whole": ref_bytes,
           "ref_engine_bytes": held, "ref_param_elems_outside_forward": sum(
               p.numel() for p in trainer.ref_model.parameters()),
           "rss_after_build": built, "rss_after_train": status()["VmRSS"], "peak_rss": status()["VmHWM"],
           "train_s": seconds,
           "losses": [h["loss"] for h in trainer.state.log_history if "loss" in h]}
    trainer.zerocore_engine.destroy()
    with open(os.path.join(args.out_dir, f"{args.variant}_rank{rec['rank']}.json"), "w") as f:
        json.dump(rec, f)


def launch(variant: str, world: int, out_dir: str, opts: list[str], malloc: str = "default") -> list[dict]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), "OMP_NUM_THREADS": "1"}
    if malloc == "fixed":  # glibc's mmap threshold pinned at its 128 KiB default: large frees go back to the system
        env["MALLOC_MMAP_THRESHOLD_"] = str(128 * 1024)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(world), "--master_port", str(port),
           __file__, "--worker", "--variant", variant, "--out_dir", out_dir, *opts]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800)
    if proc.returncode != 0:
        raise RuntimeError(f"{variant} failed (rc {proc.returncode}):\n{proc.stderr[-4000:]}")
    return [json.load(open(os.path.join(out_dir, f"{variant}_rank{r}.json"))) for r in range(world)]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--worker", action="store_true")
    p.add_argument("--variant", choices=VARIANTS)
    p.add_argument("--out_dir")
    p.add_argument("--out", default=None, help="JSON to write (the table is printed either way)")
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--hidden", type=int, default=768)
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--malloc", choices=("default", "fixed"), default="default",
                   help="glibc's mmap threshold in the workers: dynamic (glibc's default) or pinned at 128 KiB")
    args = p.parse_args()
    if args.worker:
        return worker(args)
    opts = ["--steps", str(args.steps), "--hidden", str(args.hidden), "--layers", str(args.layers),
            "--vocab", str(args.vocab)]
    runs = {v: [] for v in VARIANTS}
    for r in range(args.rounds):
        for v in (VARIANTS if r % 2 == 0 else VARIANTS[::-1]):  # interleaved, the order alternating
            runs[v] += launch(v, args.world, tempfile.mkdtemp(), opts, args.malloc)
    mib = 1 << 20
    rows = {}
    for v, recs in runs.items():
        rows[v] = {key: {"median_mib": statistics.median(r[key] for r in recs) / mib,
                         "min_mib": min(r[key] for r in recs) / mib, "max_mib": max(r[key] for r in recs) / mib}
                   for key in ("ref_engine_bytes", "rss_after_build", "rss_after_train", "peak_rss")}
        rows[v]["ref_bytes_whole_mib"] = recs[0]["ref_bytes_whole"] / mib
        rows[v]["train_s_median"] = statistics.median(r["train_s"] for r in recs)
        rows[v]["losses_rank0"] = [r["losses"] for r in recs if r["rank"] == 0]
    saved = {key: rows["whole"][key]["median_mib"] - rows["sharded"][key]["median_mib"]
             for key in ("rss_after_build", "rss_after_train", "peak_rss")}
    expect = rows["whole"]["ref_bytes_whole_mib"] * (1 - 1 / args.world)
    print(f"DPO reference model {rows['whole']['ref_bytes_whole_mib']:.1f} MiB (bf16), world {args.world}, stage 3, "
          f"{args.rounds} rounds, glibc mmap threshold {args.malloc}; "
          "per rank, medians over rounds and ranks [min, max]")
    print(f"{'':22}{'sharded':>24}{'whole':>24}{'saved':>10}")
    for key in ("rss_after_build", "rss_after_train", "peak_rss"):
        cells = [f"{rows[v][key]['median_mib']:8.1f} [{rows[v][key]['min_mib']:.0f}, {rows[v][key]['max_mib']:.0f}]"
                 for v in VARIANTS]
        print(f"{key:22}{cells[0]:>24}{cells[1]:>24}{saved[key]:10.1f}")
    print(f"reference engine holds {rows['sharded']['ref_engine_bytes']['median_mib']:.1f} MiB per rank; "
          f"the partition saves {expect:.1f} MiB per rank by the formula")
    result = {"machine": __import__("_common").machine_info(), "world": args.world, "rounds": args.rounds,
              "model": {"hidden": args.hidden, "layers": args.layers, "vocab": args.vocab}, "steps": args.steps,
              "malloc": args.malloc,
              "variants": rows, "saved_mib": saved, "expected_saving_mib": expect,
              "command": "python benchmarks/frozen_reference_memory.py " + " ".join(sys.argv[1:])}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    sys.path.insert(0, HERE)
    main()
