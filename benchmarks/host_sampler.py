"""Where each thread of this process spends its host time, by sampling every thread's Python stack at a
fixed interval (``sys._current_frames``): a py-spy without installing one, for the GPU machine (no network).

Why: torch.profiler attributes the Python of a backward hook to the op that ran it (``AccumulateGrad``'s self
time: 131-228 us a parameter at stage 2 with offload on an H100, against ~6 on this project's CPU), so it
cannot say which line of the hook the time goes to; and cProfile sees one thread, while on a GPU the
backward's hooks run on autograd's device thread and the host Adam on zerocore's worker. A thread blocked in
native code (a CUDA call, a lock, a wait for the GIL) shows as the Python line that made the call, which is
what is wanted: the line to change.

    with StackSampler() as s:
        ...  # the steps
    report = s.report()   # per thread: samples, the functions on the stack most often, the leaf lines

The sampler needs the GIL for each sample; the interpreter's switch interval is lowered to ``interval``
while it runs (restored after), so a thread running Python is interrupted that often.
"""
from __future__ import annotations

import collections
import os
import sys
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _where(code) -> str:
    """The file of ``code`` as the report names it: under site-packages from there ("torch/_ops.py", even
    in a virtual environment inside the repository), else relative to the repository, else as it is."""
    path = code.co_filename
    if "site-packages/" in path:
        return path.rsplit("site-packages/", 1)[-1]
    return os.path.relpath(path, ROOT) if path.startswith(ROOT) else path


class StackSampler:
    """Samples every other thread's Python stack each ``interval`` seconds between ``__enter__`` and
    ``__exit__``. ``focus``: path prefixes (relative to the repository, or under site-packages) of the
    functions reported as inclusive time; the leaf lines are reported whatever their file."""

    def __init__(self, interval: float = 0.002, focus: tuple[str, ...] = ("zerocore/", "benchmarks/")):
        self.interval, self.focus = interval, focus
        self.samples: collections.Counter = collections.Counter()  # thread -> samples
        self.sweeps = 0  # looks at every thread
        self.inclusive: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
        self.leaves: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._switch = None
        self.wall = 0.0

    def __enter__(self) -> "StackSampler":
        self._switch = sys.getswitchinterval()
        sys.setswitchinterval(self.interval)
        self._t0 = time.perf_counter()
        self._thread = threading.Thread(target=self._run, name="host-sampler", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        sys.setswitchinterval(self._switch)
        self.wall += time.perf_counter() - self._t0

    def _names(self) -> dict[int, str]:
        # name@ident: two engines' workers share a name
        return {t.ident: f"{t.name}@{t.ident}" for t in threading.enumerate()}

    def _run(self) -> None:
        me = threading.get_ident()
        names = self._names()
        while not self._stop.is_set():
            frames = sys._current_frames()
            self.sweeps += 1
            for tid, frame in frames.items():
                if tid == me:
                    continue
                name = names.get(tid)
                if name is None:  # a thread started since the last look, or a native one (autograd's device thread)
                    names = self._names()
                    name = names.setdefault(tid, f"native@{tid}")  # (kept: no second look for it)
                self._take(name, frame)
            del frames
            time.sleep(self.interval)

    def _take(self, thread: str, frame) -> None:
        self.samples[thread] += 1
        self.leaves[thread][f"{_where(frame.f_code)}:{frame.f_lineno} {frame.f_code.co_name}"] += 1
        seen = set()
        while frame is not None:
            where = _where(frame.f_code)
            if where.startswith(self.focus):
                key = f"{where} {frame.f_code.co_name}"
                if key not in seen:
                    seen.add(key)
                    self.inclusive[thread][key] += 1
            frame = frame.f_back

    def report(self, top: int = 15) -> dict:
        """Per thread (the busiest first): its samples, and the ``top`` focused functions (share of the thread's
        samples with the function on the stack) and leaf lines (share with that line running or blocked)."""
        out = {"wall_s": self.wall, "interval_s": self.interval, "sweeps": self.sweeps, "threads": {}}
        for thread, n in self.samples.most_common():
            out["threads"][thread] = {
                "samples": n,
                "inclusive": {k: c / n for k, c in self.inclusive[thread].most_common(top)},
                "leaves": {k: c / n for k, c in self.leaves[thread].most_common(top)},
            }
        return out


def print_report(report: dict, top: int = 8, min_samples: int = 5) -> None:
    for thread, r in report["threads"].items():
        if r["samples"] < min_samples:
            continue
        print(f"  thread {thread}: {r['samples']} samples")
        for k, share in list(r["inclusive"].items())[:top]:
            print(f"    {100 * share:5.1f}%  {k}")
        for k, share in list(r["leaves"].items())[:3]:
            print(f"    leaf {100 * share:5.1f}%  {k}")
