"""Predicted vs measured memory of a training step, for every case: the project's GPT, a Hugging
Face GPT-2 and a small Llama (from configs), stages 0-3, with and without CPU / NVMe offload, on
gloo ranks of this machine; ``gpt-frozen`` is the GPT with everything but the blocks' attention
frozen (LoRA's proportions: stage 3 partitions the frozen parameters too).

Measured (zerocore/planner/measure.py), on a step after a warm-up step:
- "measured": the peak of a memory-tracking dispatch mode (torch's MemTracker) over the real step:
  every storage the step's ops create, until it dies, plus the engine's held tensors and their
  in-place resizes;
- "alloc evts": the engine's held bytes plus the peak of the CPU allocator's own events (the
  profiler's memory records). It also sees gloo's all-gather scratch buffers (up to "+scratch",
  for as long as a collective runs, which depends on scheduling: the prediction leaves them out,
  and the profiler misses a free made on gloo's thread, so this column can only read high);
- the growth of the process's peak RSS over the step (glibc told to map every block of a page or
  more on its own and to return freed memory at once, so RSS follows live bytes).
Predicted: ``zerocore.planner`` for the same model built on the meta device, the same config,
world size, micro-batch and sequence length.

    PYTHONPATH=. python benchmarks/estimate_accuracy.py --json benchmarks/results/estimate_accuracy.json
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import machine_info, spawn_ranks  # noqa: E402

MODELS = ("gpt", "hf-gpt2", "hf-llama", "gpt-frozen")
OFFLOADS = ("none", "cpu", "nvme")


def model_and_meta(kind: str, args):
    """(the real model, the planner's input for it: a meta module or a Hugging Face config)."""
    torch.manual_seed(0)
    if kind in ("gpt", "gpt-frozen"):
        from zerocore.demo import TinyGPT

        def make():
            m = TinyGPT(args.vocab, args.dim, args.layers, heads=4, ctx=args.seq)
            if kind == "gpt-frozen":
                for name, p in m.named_parameters():
                    p.requires_grad_(".attn." in name)
            return m
        with torch.device("meta"):
            meta = make()
        return make(), meta
    from transformers import AutoModelForCausalLM, GPT2Config, LlamaConfig

    if kind == "hf-gpt2":
        cfg = GPT2Config(vocab_size=args.vocab, n_positions=args.seq, n_embd=args.dim, n_layer=args.layers, n_head=4)
    else:
        cfg = LlamaConfig(vocab_size=args.vocab, hidden_size=args.dim, intermediate_size=int(2.75 * args.dim) // 8 * 8,
                          num_hidden_layers=args.layers, num_attention_heads=4, num_key_value_heads=2,
                          max_position_embeddings=args.seq)
    cfg._attn_implementation = "eager"
    return AutoModelForCausalLM.from_config(cfg), cfg


def zero_config(stage: int, offload: str, nvme_dir: str, args) -> dict:
    z = {"stage": stage, "stage3_param_persistence_threshold": 1000, "reduce_bucket_size": args.bucket}
    if offload != "none":
        z["offload_optimizer"] = {"device": offload, "nvme_path": nvme_dir} if offload == "nvme" else {"device": "cpu"}
        if offload == "nvme":
            z["sub_group_size"] = 1 << 16
    cfg = {"train_micro_batch_size_per_gpu": args.batch, "gradient_clipping": 1.0,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}, "zero_optimization": z}
    if args.autocast:
        cfg["torch_autocast"] = {"enabled": True, "dtype": "bfloat16"}
    return cfg


def cases(args) -> list[tuple]:
    out = []
    for kind in args.models:
        for stage in args.stages:
            for off in args.offloads:
                if off != "none" and stage == 0:
                    continue
                out.append((kind, stage, off))
    return out


def worker(rank: int, world: int, init: str, args, out: str) -> None:
    import zerocore
    from zerocore.planner import batches
    from zerocore.planner.api import estimate
    from zerocore.planner.measure import dispatch_peak, measure_step

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world)
    rows = []
    nvme_dir = tempfile.mkdtemp(prefix=f"zc_est_{rank}_", dir=args.nvme_root)
    for kind, stage, off in cases(args):
        model, meta = model_and_meta(kind, args)
        if args.checkpointing:
            batches.enable_checkpointing(model)
        cfg = zero_config(stage, off, nvme_dir, args)
        engine = zerocore.initialize(model, cfg)
        gen = torch.Generator().manual_seed(rank)

        def fwd():  # (the module's call under the engine's torch_autocast, as Engine.forward runs it)
            return batches.lm_loss(engine.module, args.batch, args.seq, torch.device("cpu"), args.vocab, gen,
                                   autocast=("cpu", torch.bfloat16) if args.autocast else None)
        for _ in range(args.warmup):
            loss = fwd()
            engine.backward(loss)
            engine.step()
            del loss
        got = measure_step(engine, fwd)
        got["dispatch_peak"] = dispatch_peak(engine, fwd)
        engine.destroy()
        del engine, model
        if rank == 0:
            t0 = time.perf_counter()
            plan = estimate(meta, cfg, world=world, micro_batch=args.batch, seq_len=args.seq, device="cpu",
                            checkpointing=args.checkpointing)[0]
            rows.append({"model": kind, "stage": stage, "offload": off, "world": world, "checkpointing": args.checkpointing,
                         "autocast": args.autocast,
                         "predicted_peak": plan["peak"]["total"], "measured_peak": got["dispatch_peak"], "measured_peak_alloc": got["peak"],
                         "gloo_scratch": plan["gloo_allgather_scratch"],
                         "predicted_between": plan["between_steps"]["total"], "measured_between": got["between"],
                         "predicted_rss_growth": plan["peak"]["total"] - plan["between_steps"]["total"],
                         "measured_rss_growth": got["rss_growth"], "plan_s": time.perf_counter() - t0,
                         "at_peak": plan["peak"]})
    if rank == 0:
        with open(out, "w") as f:
            json.dump(rows, f)
    dist.destroy_process_group()


def render(rows: list[dict]) -> str:
    head = (f"{'model':9} {'st':>2} {'offload':7} {'w':>1} {'predicted':>11} {'measured':>11} {'ratio':>6} "
            f"{'alloc evts':>11} {'ratio':>6} {'+scratch':>9} {'pred betw':>11} {'meas betw':>11} "
            f"{'pred rss+':>10} {'meas rss+':>10} {'ratio':>6}")
    lines = [head]
    for r in rows:
        rr = r["measured_rss_growth"]
        rss_ratio = f"{r['predicted_rss_growth'] / rr:6.3f}" if rr else "   n/a"
        lines.append(f"{r['model']:9} {r['stage']:>2} {r['offload']:7} {r['world']:>1} {r['predicted_peak']:>11,} "
                     f"{r['measured_peak']:>11,} {r['predicted_peak'] / r['measured_peak']:6.3f} "
                     f"{r['measured_peak_alloc']:>11,} {r['predicted_peak'] / r['measured_peak_alloc']:6.3f} "
                     f"{r['gloo_scratch']:>9,} {r['predicted_between']:>11,} {r['measured_between']:>11,} "
                     f"{r['predicted_rss_growth']:>10,} {rr or 0:>10,} {rss_ratio}")
    return "\n".join(lines)


def main(argv=None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", nargs="+", default=list(MODELS), choices=MODELS)
    p.add_argument("--stages", nargs="+", type=int, default=[0, 1, 2, 3])
    p.add_argument("--offloads", nargs="+", default=list(OFFLOADS), choices=OFFLOADS)
    p.add_argument("--worlds", nargs="+", type=int, default=[1, 2])
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--vocab", type=int, default=1024)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--bucket", type=int, default=50_000, help="reduce_bucket_size (elements)")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--checkpointing", action="store_true", help="activation checkpointing of every block")
    p.add_argument("--autocast", action="store_true", help="torch_autocast (bfloat16) in the config: the forward "
                   "under torch.autocast")
    p.add_argument("--nvme-root", default=None, help="directory for the NVMe swap files (default: the temp dir)")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    # Blocks of a page or more always mmapped (and unmapped when freed), freed heap returned at once:
    # the peak RSS of a step then follows its live tensor bytes, not glibc's adaptive reuse of freed
    # memory (which hides them). The ranks inherit it.
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", "4096")
    os.environ.setdefault("MALLOC_TRIM_THRESHOLD_", "0")
    rows = []
    for world in args.worlds:
        rows += spawn_ranks(worker, world, args)
    print(render(rows))
    worst = max(abs(r["predicted_peak"] / r["measured_peak"] - 1) for r in rows)
    print(f"worst peak error: {100 * worst:.2f}%  (target 5%)   load: {os.getloadavg()}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine": machine_info(), "args": vars(args), "rows": rows,
                       "worst_peak_error_pct": 100 * worst, "loadavg": os.getloadavg()}, f, indent=1)
    return rows


if __name__ == "__main__":
    main()
