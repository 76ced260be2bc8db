"""``generate`` of a ZeRO-3 model: each unit gathered at every new token, or the whole model once per call.

Model: a Hugging Face Llama from its config (``--hidden``, ``--layers``; no download), greedy generation of
``--new-tokens`` tokens for ``--batch`` prompts of ``--prompt`` tokens, on ``--ranks`` ranks (gloo on the CPU,
NCCL with ``--device cuda``). Variants (every one starts from the same weights and must generate the unsharded
model's tokens, checked on every rank):

- ``unsharded``: the plain model, whole on each rank (no engine): the floor;
- ``zerocore_stage3``: a stage-3 engine, each decoder layer a unit: ``model.generate`` gathers each unit at every
  forward, i.e. every new token (Transformers passes ``synced_gpus``);
- ``zerocore_stage3_whole``: the same with ``zero_optimization.stage3_gather_for_generation``: the whole model
  gathered once for the call (what TRL's trainers ask for by default, ``ds3_gather_for_generation``);
- ``deepspeed_stage3``: DeepSpeed's engine, plain ``model.generate(synced_gpus=True)``;
- ``deepspeed_stage3_unwrap``: the same inside DeepSpeed's ``unwrap_model_for_generation`` (what TRL does with
  DeepSpeed: its module hooks removed, every parameter gathered once).

Protocol: every variant is built, then generates once (warm-up); then ``--rounds`` rounds, each running every
variant once in an order shuffled per round (the same on every rank), the ranks meeting before each call. A call's
time is the slowest rank's. Reported per variant: the median, min and max over rounds, and the median against
``unsharded``'s.

    python benchmarks/generate_stage3.py --out benchmarks/results/generate_stage3_cpu_w2.json
"""
from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import init_rank, machine_info, spawn_ranks, write_json  # noqa: E402

VARIANTS = ("unsharded", "zerocore_stage3", "zerocore_stage3_whole", "deepspeed_stage3", "deepspeed_stage3_unwrap")


def make_model(a):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=a.vocab, hidden_size=a.hidden, intermediate_size=int(a.hidden * 2.6875),
                      num_hidden_layers=a.layers, num_attention_heads=a.hidden // 64,
                      num_key_value_heads=a.hidden // 64,
                      max_position_embeddings=a.prompt + a.new_tokens, tie_word_embeddings=False)
    model = LlamaForCausalLM(cfg)
    model.generation_config.pad_token_id = 0
    return model.eval()


def zero_config(a, **zero) -> dict:
    return {"train_micro_batch_size_per_gpu": a.batch, "gradient_accumulation_steps": 1,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
            "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0, **zero},
            **({"bf16": {"enabled": True}} if a.device == "cuda" else {})}


def build(name: str, a, device):
    """(a function generating from ``ids``, the engine or None)."""
    model = make_model(a).to(device)
    if name == "unsharded":
        if a.device == "cuda":
            model = model.to(torch.bfloat16)
        return lambda ids: model.generate(ids, **gen_kwargs(a, ids, synced=False)), None
    if name.startswith("zerocore"):
        import zerocore

        engine = zerocore.initialize(model, zero_config(a, stage3_unit_classes=["LlamaDecoderLayer"],
                                                        stage3_gather_for_generation=name.endswith("_whole")))
        return lambda ids: model.generate(ids, **gen_kwargs(a, ids, synced=True)), engine
    os.environ.setdefault("DS_ACCELERATOR", "cpu" if a.device == "cpu" else "cuda")
    for key, value in (("LOCAL_RANK", device.index if device.index is not None else dist.get_rank()),
                       ("RANK", dist.get_rank()), ("WORLD_SIZE", dist.get_world_size())):
        os.environ.setdefault(key, str(value))
    import deepspeed
    from deepspeed.runtime.zero import unwrap_model_for_generation

    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                      config={**zero_config(a), "steps_per_print": 10 ** 9}, dist_init_required=False)
    if name.endswith("_unwrap"):
        def generate(ids):
            with unwrap_model_for_generation(engine):
                return engine.module.generate(ids, **gen_kwargs(a, ids, synced=True))
        return generate, engine
    return lambda ids: engine.module.generate(ids, **gen_kwargs(a, ids, synced=True)), engine


def gen_kwargs(a, ids, synced: bool) -> dict:
    return dict(attention_mask=torch.ones_like(ids), max_new_tokens=a.new_tokens, min_new_tokens=a.new_tokens,
                do_sample=False, synced_gpus=synced)


def worker(rank: int, world: int, init_file: str, a, out: str) -> None:
    device, sync = init_rank(rank, world, init_file, a.device)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(1, a.vocab, (a.batch, a.prompt), generator=g).to(device)
    gens, engines, tokens = {}, {}, {}
    with torch.no_grad():
        for name in a.variants:
            gens[name], engines[name] = build(name, a, device)
            tokens[name] = gens[name](ids).cpu()  # warm-up, and the tokens checked
    want = tokens.get("unsharded")
    same = {n: bool(want is None or torch.equal(t, want)) for n, t in tokens.items()}
    times = {n: [] for n in a.variants}
    with torch.no_grad():
        for r in range(a.rounds):
            order = list(a.variants)
            random.Random(r).shuffle(order)
            for name in order:
                sync()
                dist.barrier()
                t0 = time.perf_counter()
                gens[name](ids)
                sync()
                t = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
                dist.all_reduce(t, op=dist.ReduceOp.MAX)  # the call's time: the slowest rank's
                times[name].append(t.item())
    result = {"times_s": times, "same_tokens": same}
    if rank == 0:
        import json

        with open(out, "w") as f:
            json.dump(result, f)
    for e in engines.values():
        if e is not None and hasattr(e, "destroy"):
            e.destroy()
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=2048)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--prompt", type=int, default=16)
    ap.add_argument("--new-tokens", type=int, default=24)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    ap.add_argument("--out")
    a = ap.parse_args()
    if any(v.startswith("deepspeed") for v in a.variants):
        try:
            import deepspeed  # noqa: F401
        except ImportError:
            a.variants = [v for v in a.variants if not v.startswith("deepspeed")]
            print("deepspeed is not installed: its variants left out")
    raw = spawn_ranks(worker, a.ranks, a)
    base = statistics.median(raw["times_s"]["unsharded"]) if "unsharded" in raw["times_s"] else None
    rows = []
    print(f"{'variant':<26}{'median ms':>11}{'min':>9}{'max':>9}{'x unsharded':>13}  same tokens")
    for name, ts in raw["times_s"].items():
        ms = [t * 1e3 for t in ts]
        med = statistics.median(ms)
        row = {"variant": name, "median_ms": med, "min_ms": min(ms), "max_ms": max(ms),
               "vs_unsharded": med / (base * 1e3) if base else None, "same_tokens": raw["same_tokens"][name],
               "rounds_ms": ms}
        rows.append(row)
        ratio = f"{row['vs_unsharded']:.2f}x" if base else "-"
        print(f"{name:<26}{med:>11.1f}{min(ms):>9.1f}{max(ms):>9.1f}{ratio:>13}  {row['same_tokens']}")
    write_json(a.out, {"machine": machine_info(), "args": vars(a), "rows": rows,
                       "command": "python benchmarks/generate_stage3.py " + " ".join(sys.argv[1:])})
    if not all(r["same_tokens"] for r in rows):
        sys.exit("a variant generated other tokens than the unsharded model")


if __name__ == "__main__":
    main()
