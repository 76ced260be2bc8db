"""Where the host time of CPU offload's gradient landing goes (``HostSteppedShard.land``, zerocore/offload/
host_stepped.py): on an H100, stage 2 + optimizer offload spent 161 us of host time per land call, 147 calls a
step (`offload_speculation.py --trace`), in the backward's gradient hooks: the backward took 107 ms against 56
without offload. Two measurements:

1. ``calls``: each operation land makes, alone, on a device kept busy (a queued sleep kernel): the side-stream
   wait, the device-to-host copy of a gradient-sized tensor into zerocore's pinned buffer, torch's pinned buffer
   and pageable memory, the event, the norm kernel's launch. A call that waits for the device shows the sleep.
2. ``lines``: one engine (stage 2 + optimizer offload, bf16, the speculation benchmark's TinyGPT) trained a few
   steps with each line of ``land`` timed as it runs (``sys.monitoring``'s line events on that function only,
   Python >= 3.12; on older ones ``sys.settrace`` on the calling thread, which on a CPU device is the one
   running the hooks): host microseconds per call of each line.

    python benchmarks/land_host_time.py --device cuda --out land_host_time.json
    python benchmarks/land_host_time.py --dim 64 --layers 2 --ctx 32 --vocab 256     # a CPU run of part 2
"""
from __future__ import annotations

import argparse
import collections
import os
import statistics
import sys
import threading
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import machine_info, write_json  # noqa: E402


def busy(ms: float) -> None:
    """Keeps the current stream busy for about ``ms`` milliseconds (a sleep kernel)."""
    torch.cuda._sleep(int(ms * 1.4e6))  # cycles at ~1.4-2 GHz: a few ms either way is fine


def time_calls(numel: int, reps: int) -> dict:
    """Part 1: host microseconds of each operation land makes, issued behind 5 ms of queued device work."""
    from zerocore.offload.host_memory import _exact_pinned
    from zerocore import ops

    grad = torch.randn(numel, device="cuda").to(torch.bfloat16)
    side = torch.cuda.Stream()
    targets = {"zerocore_pinned": _exact_pinned(numel, torch.bfloat16),
               "torch_pinned": torch.empty(numel, dtype=torch.bfloat16, pin_memory=True),
               "pageable": torch.empty(numel, dtype=torch.bfloat16)}
    ops_ = {"wait_stream": lambda: side.wait_stream(torch.cuda.current_stream()),
            "event_record": lambda: torch.cuda.Event().record(side),
            "sum_squares_launch": lambda: ops.sum_squares(grad, sync=False),
            "record_stream": lambda: grad.record_stream(side)}
    for name, buf in targets.items():
        if buf is None:
            continue

        def copy(buf=buf):
            with torch.cuda.stream(side):
                buf.copy_(grad, non_blocking=True)
        ops_[f"copy_to_{name}"] = copy
    out = {}
    for name, fn in ops_.items():
        fn()
        torch.cuda.synchronize()
        times = []
        for _ in range(reps):
            busy(5.0)
            side.wait_stream(torch.cuda.current_stream())  # the copies queue behind the busy device, as in land
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e6)
            torch.cuda.synchronize()
        out[name] = {"median_us": statistics.median(times), "max_us": max(times)}
    out["_bytes"] = numel * 2
    return out


class LineTimer:
    """Host time per line of one function, on every thread that runs it. A line's time runs from its line
    event to the next line event (or the return) in the same frame: the calls it makes included."""

    def __init__(self, fn):
        self.code = fn.__code__
        self.spent = collections.defaultdict(float)  # line -> seconds
        self.hits = collections.Counter()
        self.calls = 0
        self._last = threading.local()
        self._lock = threading.Lock()

    def _line(self, line: int) -> None:
        now = time.perf_counter()
        prev = getattr(self._last, "v", None)
        with self._lock:
            if prev is not None:
                self.spent[prev[0]] += now - prev[1]
                self.hits[prev[0]] += 1
        self._last.v = (line, now)

    def _start(self) -> None:
        self._last.v = None

    def _end(self) -> None:
        now = time.perf_counter()
        prev = getattr(self._last, "v", None)
        with self._lock:
            self.calls += 1
            if prev is not None:
                self.spent[prev[0]] += now - prev[1]
                self.hits[prev[0]] += 1
        self._last.v = None

    def __enter__(self):
        mon = getattr(sys, "monitoring", None)
        if mon is not None:  # every thread, autograd's device thread included
            self._tool = mon.PROFILER_ID
            mon.use_tool_id(self._tool, "zerocore-land-timer")
            ev = mon.events
            # the events are enabled on this one function only (set_local_events), so every callback is its
            # (an unwinding call is not a local event: the next call's start drops its last line instead)
            mon.register_callback(self._tool, ev.LINE, lambda code, line: self._line(line))
            mon.register_callback(self._tool, ev.PY_RETURN, lambda code, off, val: self._end())
            mon.register_callback(self._tool, ev.PY_START, lambda code, off: self._start())
            mon.set_local_events(self._tool, self.code, ev.LINE | ev.PY_START | ev.PY_RETURN)
        else:  # this thread only (a CPU device runs the backward's hooks on it)
            def local(frame, event, arg):
                if event == "line":
                    self._line(frame.f_lineno)
                elif event == "return":
                    self._end()
                return local

            sys.settrace(lambda frame, event, arg: local if frame.f_code is self.code else None)
        return self

    def __exit__(self, *exc):
        mon = getattr(sys, "monitoring", None)
        if mon is not None:
            mon.set_local_events(self._tool, self.code, 0)
            mon.free_tool_id(self._tool)
        else:
            sys.settrace(None)

    def table(self) -> list[dict]:
        import linecache

        path = self.code.co_filename
        calls = max(self.calls, 1)
        return [{"line": ln, "us_per_call": 1e6 * s / calls, "source": linecache.getline(path, ln).strip()}
                for ln, s in sorted(self.spent.items())]


def time_lines(args) -> dict:
    """Part 2: land's lines in a stage-2 + optimizer offload engine's backward."""
    import zerocore
    from zerocore.demo import TinyGPT
    from zerocore.offload.host_stepped import HostSteppedShard

    dev = args.device
    torch.manual_seed(0)
    model = TinyGPT(args.vocab, dim=args.dim, layers=args.layers, heads=args.heads, ctx=args.ctx).to(dev)
    cfg = {"train_micro_batch_size_per_gpu": args.batch, "gradient_clipping": 1.0,
           "zero_optimization": {"stage": 2, "reduce_bucket_size": int(args.bucket),
                                 "offload_optimizer": {"device": "cpu", "pin_memory": True}},
           "bf16": {"enabled": True}, "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}}}
    engine = zerocore.initialize(model, cfg)
    x = torch.randint(0, args.vocab, (args.batch, args.ctx + 1), device=dev)

    def step():
        loss = torch.nn.functional.cross_entropy(engine(x[:, :-1]).flatten(0, 1).float(), x[:, 1:].flatten())
        engine.backward(loss)
        engine.step()

    for _ in range(2):
        step()
    if dev == "cuda":
        torch.cuda.synchronize()
    timer = LineTimer(HostSteppedShard.land)
    t0 = time.perf_counter()
    with timer:
        for _ in range(args.steps):
            step()
        if dev == "cuda":
            torch.cuda.synchronize()
    wall = (time.perf_counter() - t0) / args.steps
    rows = timer.table()
    per_step = timer.calls / args.steps
    engine.destroy()
    return {"calls_per_step": per_step, "step_ms": 1e3 * wall, "per_line": rows,
            "land_us_per_call": sum(r["us_per_call"] for r in rows),
            "tracer": "sys.monitoring" if hasattr(sys, "monitoring") else "sys.settrace (this thread)"}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--dim", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--ctx", type=int, default=128)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--bucket", type=float, default=2.5e6)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--numel", type=int, default=2_100_000, help="part 1's gradient size (a 337M GPT's group)")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("land_host_time.py: --device cuda but no CUDA device")
    res = {"machine": machine_info(), "args": vars(args)}
    if args.device == "cuda":
        res["calls"] = time_calls(args.numel, args.reps)
        print(f"part 1: host us per call behind 5 ms of queued device work ({res['calls']['_bytes'] / 1e6:.1f} MB)")
        for k, v in res["calls"].items():
            if not k.startswith("_"):
                print(f"  {k:28s} {v['median_us']:9.1f} us  (max {v['max_us']:.1f})")
    res["lines"] = time_lines(args)
    ln = res["lines"]
    print(f"part 2: land, {ln['calls_per_step']:.0f} calls a step, {ln['land_us_per_call']:.1f} us each "
          f"(step {ln['step_ms']:.1f} ms; {ln['tracer']})")
    for r in ln["per_line"]:
        print(f"  line {r['line']:4d} {r['us_per_call']:9.1f} us  {r['source']}")
    write_json(args.out, res)
    return res


if __name__ == "__main__":
    main()
