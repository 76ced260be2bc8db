"""Host memory the process really holds (RSS) with the optimizer state offloaded to host memory
vs to NVMe: stage 2, one rank, fp32, an MLP of about 24.2M parameters on the CPU device.

Each variant runs in a fresh process (peaks never mix), which reads /proc/self/status (VmRSS,
VmHWM) after building the model, after ``zerocore.initialize``, after the first step and after
the last one. The NVMe saving is reported per parameter: the swap files hold the fp32 master, m
and v; on a CPU device the master is the parameter itself (also resident with CPU offload), so
what NVMe can take out of RAM is m and v, 8 bytes a parameter, less its pinned tile buffers
(``buffer_count`` records of ``sub_group_size`` elements). Beside them CPU offload keeping the
device's reduced gradient between steps (``cpu_keep_grad``, as before ``ShardedGroup.release_grad``):
what giving it back saves, 4 bytes a parameter (the fp32 gradient on a CPU device).

    PYTHONPATH=. python benchmarks/offload_rss.py --repeats 3 --out benchmarks/results/offload_rss.json
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

# cpu_keep_grad: CPU offload keeping the device's reduced gradient between steps (as before
# ShardedGroup.release_grad): what giving it back saves, 4 bytes a parameter at fp32 on a CPU device
VARIANTS = ["cpu", "nvme", "cpu_keep_grad"]


def status() -> dict[str, int]:
    """VmRSS and VmHWM of this process, in bytes."""
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, rest = line.partition(":")
            if key in ("VmRSS", "VmHWM", "RssAnon"):
                out[key] = int(rest.split()[0]) * 1024
    return out


def model(width: int, layers: int):
    import torch

    torch.manual_seed(0)
    mods = []
    for _ in range(layers):
        mods += [torch.nn.Linear(width, width), torch.nn.Tanh()]
    return torch.nn.Sequential(*mods)


def child(args) -> dict:
    import torch

    import zerocore

    torch.set_num_threads(1)
    points = {"start": status()}
    m = model(args.width, args.layers)
    params = sum(p.numel() for p in m.parameters())
    points["model"] = status()
    off = {"device": args.variant.split("_")[0]}
    if args.variant == "cpu_keep_grad":
        from zerocore.offload.host_stepped import HostSteppedShard

        HostSteppedShard.releases_grad = property(lambda self: False)
    if args.variant == "nvme":
        off.update(nvme_path=args.swap, buffer_count=args.buffer_count)
    cfg = {"train_micro_batch_size_per_gpu": args.batch, "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
           "zero_optimization": {"stage": 2, "offload_optimizer": off, "sub_group_size": args.sub_group}}
    engine = zerocore.initialize(m, cfg)
    points["initialized"] = status()
    g = torch.Generator().manual_seed(1)
    for s in range(args.steps):
        x = torch.randn(args.batch, args.width, generator=g)
        loss = engine(x).pow(2).mean()
        engine.backward(loss)
        engine.step()
        del x, loss
        points[f"step{s + 1}"] = status()
    engine.destroy()
    return {"variant": args.variant, "params": params, "points": points}


def child_cmd(variant: str, args, swap: str) -> list[str]:
    return [sys.executable, os.path.abspath(__file__), "--child", variant, "--swap", swap,
            "--width", str(args.width), "--layers", str(args.layers), "--steps", str(args.steps),
            "--batch", str(args.batch), "--sub-group", str(args.sub_group), "--buffer-count", str(args.buffer_count)]


def child_env(args) -> dict:
    """With ``--malloc fixed`` glibc's mmap threshold is pinned at its 128 KiB default: a freed large
    tensor (autograd's per-parameter gradients, 24 MB each here) always goes back to the system.
    Left dynamic (``default``), glibc raises the threshold after the first such free and keeps later
    ones in its heap, which adds up to a gradient's worth (4 bytes a parameter) to either variant's
    RSS, more or less from run to run."""
    env = dict(os.environ)
    if args.malloc == "fixed":
        env["MALLOC_MMAP_THRESHOLD_"] = str(128 * 1024)
    return env


def run_variant(variant: str, args, swap: str) -> dict:
    r = subprocess.run(child_cmd(variant, args, swap), capture_output=True, text=True, check=False,
                       env=child_env(args))
    if r.returncode:
        raise SystemExit(f"{variant} failed ({r.returncode}):\n{r.stdout[-2000:]}{r.stderr[-2000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def memory_cgroup(limit_bytes: int) -> str:
    """A child memory cgroup (v2 ``memory.max``, else v1 ``memory.limit_in_bytes``) of this
    process's own, limited to ``limit_bytes``; its directory (writing a pid to its
    ``cgroup.procs`` moves that process in). Needs write access to the cgroup tree (root)."""
    with open("/proc/self/cgroup") as f:
        lines = [ln.strip().split(":", 2) for ln in f]
    v1 = [p for _, ctl, p in lines if "memory" in ctl.split(",")]
    if v1:
        base, knob = os.path.join("/sys/fs/cgroup/memory", v1[0].lstrip("/")), "memory.limit_in_bytes"
    else:
        base, knob = os.path.join("/sys/fs/cgroup", lines[0][2].lstrip("/")), "memory.max"
    path = os.path.join(base, f"zc_offload_rss_{os.getpid()}")
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, knob), "w") as f:
        f.write(str(limit_bytes))
    swap_knob = os.path.join(path, "memory.memsw.limit_in_bytes" if v1 else "memory.swap.max")
    if os.path.exists(swap_knob):  # no swapping out instead of failing
        with open(swap_knob, "w") as f:
            f.write(str(limit_bytes) if v1 else "0")
    return path


def run_limited(variant: str, args, swap: str, cgroup: str) -> dict:
    """One variant run inside the cgroup: its exit code (-9: killed by the OOM killer) and peak."""
    procs = os.path.join(cgroup, "cgroup.procs")

    def enter():
        with open(procs, "w") as f:
            f.write(str(os.getpid()))

    r = subprocess.run(child_cmd(variant, args, swap), capture_output=True, text=True, check=False,
                       preexec_fn=enter, env=child_env(args))
    out = {"variant": variant, "returncode": r.returncode}
    if r.returncode == 0:
        out["peak_mib"] = json.loads(r.stdout.strip().splitlines()[-1])["points"][f"step{args.steps}"]["VmHWM"] / (1 << 20)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--child", choices=VARIANTS)
    ap.add_argument("--swap", default="")
    ap.add_argument("--width", type=int, default=2460)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--sub-group", type=int, default=1 << 20, help="NVMe tile, elements (sub_group_size)")
    ap.add_argument("--buffer-count", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--malloc", choices=["fixed", "default"], default="fixed",
                    help="glibc's mmap threshold in the children: pinned (fixed) or dynamic (default)")
    ap.add_argument("--cgroup-limit-mib", type=int, default=0,
                    help="also run each variant once in a memory cgroup of this limit (root)")
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    if args.child:
        args.variant = args.child
        print(json.dumps(child(args)))
        return

    runs = {v: [] for v in VARIANTS}
    with tempfile.TemporaryDirectory(prefix="offload_rss_") as swap:
        for _ in range(args.repeats):
            for v in VARIANTS:  # interleaved: a drift in the machine's load hits both alike
                runs[v].append(run_variant(v, args, swap))
    params = runs["cpu"][0]["params"]
    last = f"step{args.steps}"
    mib = 1 << 20

    def med(v, point, key):
        return statistics.median(r["points"][point][key] for r in runs[v])

    def spread(v, point, key):
        vals = [r["points"][point][key] for r in runs[v]]
        return (max(vals) - min(vals)) / mib

    rows = []
    for point, key, label in [("initialized", "VmRSS", "RSS after initialize"), ("step1", "VmRSS", "RSS after step 1"),
                              (last, "VmRSS", f"RSS after step {args.steps} (steady)"),
                              (last, "VmHWM", "peak RSS (VmHWM)")]:
        c, n = med("cpu", point, key), med("nvme", point, key)
        rows.append({"what": label, "cpu_mib": c / mib, "nvme_mib": n / mib, "saved_mib": (c - n) / mib,
                     "saved_bytes_per_param": (c - n) / params,
                     "spread_mib": max(spread("cpu", point, key), spread("nvme", point, key))})
    state_mib = 12 * params / mib
    pool_mib = args.buffer_count * (4096 + 12 * args.sub_group) / mib
    lines = [f"stage 2, world 1, fp32, CPU device; {params / 1e6:.1f}M parameters (fp32 master + m + v "
             f"{state_mib:.0f} MiB); NVMe: sub_group_size {args.sub_group}, buffer_count {args.buffer_count} "
             f"({pool_mib:.0f} MiB of tile buffers); glibc mmap threshold {args.malloc}; median of {args.repeats}, "
             f"load {os.getloadavg()[0]:.1f}",
             f"{'':34s} {'cpu MiB':>9s} {'nvme MiB':>9s} {'saved MiB':>10s} {'B/param':>8s} {'spread':>7s}"]
    for r in rows:
        lines.append(f"{r['what']:34s} {r['cpu_mib']:9.0f} {r['nvme_mib']:9.0f} {r['saved_mib']:10.0f} "
                     f"{r['saved_bytes_per_param']:8.2f} {r['spread_mib']:7.0f}")
    for point, key, label in [(last, "VmRSS", f"RSS after step {args.steps}"), (last, "VmHWM", "peak RSS (VmHWM)")]:
        k, c = med("cpu_keep_grad", point, key), med("cpu", point, key)
        rows.append({"what": f"cpu keeping the device gradient: {label}", "keep_grad_mib": k / mib, "cpu_mib": c / mib,
                     "saved_mib": (k - c) / mib, "saved_bytes_per_param": (k - c) / params})
        lines.append(f"cpu keeping the device gradient, {label}: {k / mib:.0f} MiB; giving it back saves "
                     f"{(k - c) / mib:.0f} MiB ({(k - c) / params:.2f} B/param)")
    limited = []
    if args.cgroup_limit_mib:
        cgroup = memory_cgroup(args.cgroup_limit_mib << 20)
        try:
            with tempfile.TemporaryDirectory(prefix="offload_rss_") as swap:
                limited = [run_limited(v, args, swap, cgroup) for v in VARIANTS]
        finally:
            os.rmdir(cgroup)
        for r in limited:
            said = (f"completed, peak {r['peak_mib']:.0f} MiB" if r["returncode"] == 0 else
                    f"failed, exit code {r['returncode']}" + (" (killed: out of memory)" if r["returncode"] == -9 else ""))
            lines.append(f"under a {args.cgroup_limit_mib} MiB memory cgroup: {r['variant']} {said}")
    text = "\n".join(lines)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"params": params, "args": {k: v for k, v in vars(args).items() if k not in ("out",)},
                       "rows": rows, "cgroup": limited, "runs": runs, "loadavg": os.getloadavg()}, f, indent=1)
        with open(os.path.splitext(args.out)[0] + ".txt", "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
