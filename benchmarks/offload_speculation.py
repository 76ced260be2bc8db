"""Stage 2 with CPU offload, the host Adam started during the backward (``offload_optimizer.speculative_step``,
zerocore/offload/speculation.py) against the step as before (``after_backward``), beside the same step without
offload (``no_offload``: T_device) and the host Adam alone on the same shards (T_host, timed on the offloaded
engine's own state): the offloaded step against max(T_device, T_host), the issue's measure.

``speculative`` uses a clip threshold that does not bite (the speculation is kept); ``speculative_dropped`` one
that always bites: the first step's speculations are dropped and the step taken again after the backward, after
which the engine stops speculating (its predictor, speculation._Guess.worth_it) and steps as ``after_backward``
does: what a user whose clip bites every step pays. bf16 training (fp32 on a CPU device would make the master the parameter itself, which
the speculation may not write). All engines from the same seed, their steps interleaved in a fresh order each
round; the host step on the worker thread (``ZEROCORE_HOST_STEP_THREADS``, as on a GPU).

    python benchmarks/offload_speculation.py --out benchmarks/results/cpu_2026-11-26_issue35_stop42/offload_speculation_cpu.json
    python benchmarks/offload_speculation.py --device cuda --dim 1024 --layers 24 --bucket 2.5e7 --threads 15 --batch 8 --ctx 512
"""
from __future__ import annotations

import argparse
import os
import sys
import threading
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import host_step_args, interleaved, machine_info, summary, write_json  # noqa: E402

VARIANTS = {  # name: (offload, speculative_step, gradient_clipping)
    "no_offload": (False, False, 1e6),
    "after_backward": (True, False, 1e6),
    "speculative": (True, True, 1e6),
    "speculative_dropped": (True, True, 1e-6),
}


def build(args, name: str):
    import zerocore
    from zerocore.demo import TinyGPT

    offload, spec, clip = VARIANTS[name]
    torch.manual_seed(0)
    model = TinyGPT(args.vocab, dim=args.dim, layers=args.layers, heads=args.heads, ctx=args.ctx).to(args.device)
    z = {"stage": args.stage, "reduce_bucket_size": int(args.bucket)}
    if args.stage == 3:  # each TinyGPT block a unit, every parameter sharded
        z.update({"stage3_param_persistence_threshold": 0, "stage3_unit_min_params": 1})
    if offload:
        z["offload_optimizer"] = {"device": "cpu", "pin_memory": True, "speculative_step": spec}
    cfg = {"train_micro_batch_size_per_gpu": args.batch, "gradient_clipping": clip, "zero_optimization": z,
           "bf16": {"enabled": True, "check_grad_overflow": True},
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}}}
    return zerocore.initialize(model, cfg)


def host_adam_ms(engine, reps: int) -> list[float]:
    """T_host: the host Adam alone over the offloaded engine's shards (its batches' one call each; stage 3:
    each unit's shard), on the worker's thread count, from this thread (nothing else running)."""
    from zerocore.offload.host_batch import HostStepBatch

    batches = [m for m, _ in engine._batches if isinstance(m, HostStepBatch)]
    units = [s for s in engine.shards if getattr(s, "enqueue", None) is not None]
    if units:  # stage 3's units step one by one: the same kernel through a batch of one
        batches += [HostStepBatch([s]) for s in units]
    hyp = engine.optimizer.hypers()
    threads = torch.get_num_threads()
    torch.set_num_threads(int(os.environ["ZEROCORE_HOST_STEP_THREADS"]))
    out = []
    try:
        for _ in range(reps):
            t0 = time.perf_counter()
            for b in batches:
                b._multi.step([s.grad_h for s in b.shards], hyp, step=engine._optimizer_steps + 1, grad_scale=0.0)
            out.append(time.perf_counter() - t0)
    finally:
        torch.set_num_threads(threads)
    return out


class Timeline:
    """Per step: the forward+backward's time (to the device's end), step()'s, and each host Adam call
    (MultiShardStep.step of the engine's batches and speculations, on whichever thread; at stage 3 also each
    unit's queued step, which runs while the next forward waits for it) against them.
    Also where the backward's host time goes on the offloaded path: each shard's ``land`` (the gradient's
    copy to the host, its norm kernel, events: host time on the thread that runs the backward's hooks) and,
    inside it, the waits for the worker (``ready.wait``: the host step still reading the last landed
    gradient; ``before_land``: a speculation still reading it); and when the forward and the backward calls
    returned on the host (``fwd_host``, ``bwd_host``: the host's issue time, against the device's end)."""

    def __init__(self, engine):
        from zerocore.offload.host_batch import HostStepBatch

        self.calls: list[tuple[float, float]] = []
        self.lands: list[tuple[float, float]] = []
        self.waits: list[tuple[float, float]] = []  # the waits for the worker inside land
        self.steps: list[dict] = []
        multis = [m._multi for m, _ in engine._batches if isinstance(m, HostStepBatch)]
        multis += [m for s in getattr(engine, "_speculations", []) for m in s._multi.values()]
        for m in multis:
            self._wrap(m)
        plan = getattr(engine, "offload", None)
        for shard in (plan.shards.values() if plan is not None else ()):
            self._wrap_land(shard)
            if getattr(shard, "enqueue", None) is not None:  # stage 3: each unit's host step queued for the worker
                self._wrap_enqueue(shard)

    @staticmethod
    def _timed(fn, into: list):
        def timed(*a, **k):
            t = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                into.append((t, time.perf_counter()))
        return timed

    def _wrap_land(self, shard) -> None:
        inner_land, ready = shard.land, shard.ready
        inner_wait, waits, lands = ready.wait, self.waits, self.lands
        in_land = threading.local()

        def wait():
            if not getattr(in_land, "on", False):
                return inner_wait()
            return self._timed(inner_wait, waits)()

        def land(grad):
            in_land.on = True
            spec = shard.speculation
            before = spec.before_land if spec is not None else None
            if before is not None:
                spec.before_land = self._timed(before, waits)
            try:
                return self._timed(inner_land, lands)(grad)
            finally:
                in_land.on = False
                if before is not None:
                    del spec.before_land  # the class's method again
        ready.wait = wait
        shard.land = land

    def _wrap_enqueue(self, shard) -> None:
        """Stage 3's unit steps do not go through a HostStepBatch: the step each unit queues at step() (its
        host Adam, or the commit of a kept speculation) is timed as it runs on the worker, with the calls."""
        inner = shard.enqueue

        def enqueue(index, job, ready):
            return inner(index, self._timed(job, self.calls), ready)
        shard.enqueue = enqueue

    def _wrap(self, multi) -> None:
        multi.step = self._timed(multi.step, self.calls)

    def close_step(self, t0: float, t_bwd: float, t1: float, t_fwd_host: float | None = None,
                   t_bwd_host: float | None = None) -> None:
        # the calls that ended by this step's end, those begun in the last step included (first_adam_start < 0);
        # the ones still running go to the next step
        mine = [c for c in self.calls if c[1] <= t1 + 1e-3]
        self.calls[:] = [c for c in self.calls if c[1] > t1 + 1e-3]
        ms = 1e3
        d = {"fwd_bwd": (t_bwd - t0) * ms, "step": (t1 - t_bwd) * ms, "adam_calls": len(mine),
             "adam_sum": sum(b - a for a, b in mine) * ms,
             "adam_before_bwd_end": sum(max(0.0, min(b, t_bwd) - a) for a, b in mine) * ms}
        for name, spans in (("land", self.lands), ("land_wait", self.waits)):
            own = [c for c in spans if c[0] >= t0 - 1e-3 and c[1] <= t1 + 1e-3]
            spans[:] = [c for c in spans if c[1] > t1 + 1e-3]
            if own:
                d[f"{name}_calls"] = len(own)
                d[f"{name}_ms"] = sum(b - a for a, b in own) * ms
        if t_fwd_host is not None:
            d["fwd_host"] = (t_fwd_host - t0) * ms
        if t_bwd_host is not None:
            d["bwd_host"] = (t_bwd_host - t0) * ms
        if mine:
            d["first_adam_start"] = (min(a for a, _ in mine) - t0) * ms
            d["last_adam_end_after_bwd"] = (max(b for _, b in mine) - t_bwd) * ms
        self.steps.append(d)

    def summary(self) -> dict:
        import statistics

        keys = {k for d in self.steps for k in d}
        return {k: statistics.median(d[k] for d in self.steps if k in d) for k in sorted(keys)}


def profile_variants(engines: dict, one, args, params: int) -> dict:
    """``args.profile_steps`` steps of each engine under torch.profiler (step_profile.py): per step, the wall
    and device-busy time and each copy direction's device time, with the rate it moved the 16-bit gradients
    (to the host) and parameters (back) at: whether the host Adam beside them slows the copies."""
    from step_profile import profile_steps

    sync = torch.cuda.synchronize if args.device == "cuda" else None
    out = {}
    print(f"profiled ({args.profile_steps} steps, per step)  wall ms  busy ms  DtoH ms (GB/s)  HtoD ms (GB/s)")
    for k, e in engines.items():
        p = profile_steps(lambda inputs, targets, e=e: one(e), [torch.zeros(1, 2)], args.profile_steps, args.profile,
                          k, sync=sync)
        rate = {}
        for direction, prefix in (("dtoh", "Memcpy DtoH"), ("htod", "Memcpy HtoD")):
            ms = sum(v for name, v in p.get("memcpy_ms", {}).items() if name.startswith(prefix))
            rate[direction] = (ms, 2 * params / (ms * 1e-3) / 1e9 if ms else None)  # 2 bytes a parameter
        p["copy_rate_gbps"] = {d: r for d, (_, r) in rate.items()}
        out[k] = p
        cells = "".join(f"{ms:>9.2f} ({'-' if r is None else f'{r:.1f}'})" for ms, r in rate.values())
        print(f"{k:<34}{p['wall_ms']:>8.1f}{p['device_busy_ms']:>9.1f}{cells}")
    return out


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    host_step_args(ap, ctx=64, batch=4, bucket=1e6, rounds=10)
    ap.add_argument("--stage", type=int, choices=(1, 2, 3), default=2)
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    ap.add_argument("--trace", action="store_true",
                    help="a timeline of each step (the device synchronised after the backward, which the step then "
                         "does not overlap): when each host Adam call ran against the backward's end")
    ap.add_argument("--profile", metavar="DIR", help="after the timed rounds, --profile-steps steps of each variant "
                    "under torch.profiler (tables and traces in DIR): the host-device copies' device time and rate")
    ap.add_argument("--profile-steps", type=int, default=2)
    ap.add_argument("--sample", type=int, default=0, metavar="STEPS",
                    help="last, STEPS untraced steps of each variant with every thread's Python stack sampled "
                         "(host_sampler.py): which lines the training thread, autograd's and the worker spend on")
    ap.add_argument("--out")
    args = ap.parse_args(argv)
    os.environ["ZEROCORE_HOST_STEP_THREADS"] = str(args.threads)
    if args.device == "cpu":
        torch.set_num_threads(1)  # the training thread's one core; the worker has its own
    engines = {k: build(args, k) for k in args.variants}
    x = torch.randint(0, args.vocab, (args.batch, args.ctx + 1), device=args.device)
    sync = torch.cuda.synchronize if args.device == "cuda" else (lambda: None)

    traces = {k: Timeline(e) for k, e in engines.items()} if args.trace else {}
    names = {id(e): k for k, e in engines.items()}

    def one(e) -> float:
        t0 = time.perf_counter()
        loss = torch.nn.functional.cross_entropy(e(x[:, :-1]).flatten(0, 1).float(), x[:, 1:].flatten())
        t_fwd_host = time.perf_counter()
        e.backward(loss)
        tl = traces.get(names[id(e)])
        if tl is not None:
            t_bwd_host = time.perf_counter()
            sync()
            t_bwd = time.perf_counter()
        e.step()
        sync()
        t1 = time.perf_counter()
        if tl is not None:
            tl.close_step(t0, t_bwd, t1, t_fwd_host, t_bwd_host)
        return t1 - t0

    times = interleaved(engines, one, args.rounds, args.steps)
    res = {"machine": machine_info(), "args": vars(args), "step": {k: summary(v) for k, v in times.items()},
           # (the owned ranges: at stage 3 the module's own parameters are empty outside a gather)
           "params": sum(g.hi - g.lo for g in next(iter(engines.values())).groups)}
    offloaded = next((engines[k] for k in ("after_backward", "speculative") if k in engines), None)
    if offloaded is not None:
        res["t_host"] = summary(host_adam_ms(offloaded, args.rounds))
        res["groups"] = len(offloaded.groups)
    kept = {k: [(s.kept, s.dropped) for s in getattr(e, "_speculations", [])] for k, e in engines.items()}
    res["speculations_kept_dropped"] = {k: [sum(a for a, _ in v), sum(b for _, b in v)] for k, v in kept.items() if v}
    # stage 3: a unit's speculation not started by step() is withdrawn and the unit steps in the forward's order
    res["speculations_withdrawn"] = {k: sum(s.withdrawn for s in getattr(e, "_speculations", []))
                                     for k, e in engines.items() if getattr(e, "_speculations", None)}
    t_dev = res["step"].get("no_offload", {}).get("median_ms")
    t_host = res.get("t_host", {}).get("median_ms")
    ref = res["step"].get("after_backward", {}).get("median_ms")
    print(f"{res['params'] / 1e6:.1f}M parameters, stage {args.stage} bf16, {args.device}, host Adam on the worker with "
          f"{args.threads} thread(s); {args.rounds} interleaved rounds x {args.steps}")
    if t_host is not None:
        print(f"T_host (the host Adam alone) {t_host:.2f} ms over {res['groups']} groups")
    print(f"{'variant':<22}{'median ms':>11}{'min-max':>17}{'vs after_backward':>19}{'vs max(Tdev,Thost)':>20}")
    res["ratios"] = {}
    for k, s in res["step"].items():
        vs_ref = s["median_ms"] / ref if ref else None
        vs_max = s["median_ms"] / max(t_dev, t_host) if t_dev and t_host and k != "no_offload" else None
        res["ratios"][k] = {"vs_after_backward": vs_ref, "vs_max_device_host": vs_max}
        print(f"{k:<22}{s['median_ms']:>11.2f}{s['min_ms']:>8.2f}-{s['max_ms']:<8.2f}"
              f"{'' if vs_ref is None else f'{vs_ref:.3f}x':>19}{'' if vs_max is None else f'{vs_max:.3f}x':>20}")
    if res["speculations_kept_dropped"]:
        print("speculations kept / dropped:", res["speculations_kept_dropped"], "withdrawn:",
              res["speculations_withdrawn"])
    if args.profile:
        res["profile"] = profile_variants(engines, one, args, res["params"])
    if traces:
        res["trace"] = {k: tl.summary() for k, tl in traces.items()}
        print("timeline (medians over the timed steps, ms; the device synchronised after the backward)")
        for cols in (("fwd_bwd", "step", "adam_calls", "adam_sum", "adam_before_bwd_end", "first_adam_start",
                      "last_adam_end_after_bwd"),
                     ("fwd_host", "bwd_host", "land_calls", "land_ms", "land_wait_calls", "land_wait_ms")):
            print(f"{'variant':<22}" + "".join(f"{c:>24}" for c in cols))
            for k, d in res["trace"].items():
                print(f"{k:<22}" + "".join(f"{d.get(c, float('nan')):>24.2f}" for c in cols))
    if args.sample:
        from host_sampler import StackSampler, print_report

        traces.clear()  # untraced steps: no synchronisation after the backward
        res["sample"] = {}
        for k, e in engines.items():
            with StackSampler() as sampler:
                for _ in range(args.sample):
                    one(e)
            res["sample"][k] = sampler.report()
            print(f"{k}: {args.sample} steps sampled, {sampler.wall * 1e3 / args.sample:.1f} ms a step")
            print_report(res["sample"][k])
    for e in engines.values():
        e.destroy()
    write_json(args.out, res)
    return res


if __name__ == "__main__":
    main()
