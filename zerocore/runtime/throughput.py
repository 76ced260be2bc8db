"""``engine.tput_timer``: DeepSpeed's ThroughputTimer, samples per second over the training steps.

The engine starts it at each forward and stops it at each ``step()`` (marking the accumulation
boundaries); the first ``start_step`` optimizer steps are not timed (start-up: allocation,
compilation, the first collectives), as DeepSpeed's. Wall-clock time on the host: the device is not
synchronized (DeepSpeed's ``synchronized`` timer would add a device sync to every step)."""
from __future__ import annotations

import time


class ThroughputTimer:
    def __init__(self, batch_size: int | None, start_step: int = 2, steps_per_output: int | None = None):
        """``batch_size``: samples per optimizer step over all ranks (train_batch_size)."""
        self.batch_size = batch_size or 1
        self.start_step = start_step
        self.steps_per_output = steps_per_output
        self.initialized = False
        self.started = False
        self.start_time = 0.0
        self.end_time = 0.0
        self.micro_step_count = 0
        self.global_step_count = 0
        self.total_elapsed_time = 0.0  # timed seconds, from start_step on
        self.step_elapsed_time = 0.0  # timed seconds of the accumulation window under way

    def start(self) -> None:
        self.initialized = True
        self.started = True
        if self.global_step_count >= self.start_step:
            self.start_time = time.time()

    def stop(self, global_step: bool = False, report_speed: bool = False) -> None:
        """Ends a micro-step begun by ``start()`` (nothing without one); ``global_step``: it ended an
        accumulation window."""
        if not self.started:
            return
        self.started = False
        self.micro_step_count += 1
        if global_step:
            self.global_step_count += 1
        if self.start_time > 0:
            self.end_time = time.time()
            duration = self.end_time - self.start_time
            self.total_elapsed_time += duration
            self.step_elapsed_time += duration
            if global_step:
                self.step_elapsed_time = 0.0

    def avg_samples_per_sec(self) -> float:
        """Samples per second over the timed optimizer steps (-inf before the first)."""
        steps = self.global_step_count - self.start_step
        if steps > 0 and self.total_elapsed_time > 0:
            return self.batch_size * steps / self.total_elapsed_time
        return float("-inf")
