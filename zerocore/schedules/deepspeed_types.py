"""DeepSpeed's learning-rate schedules (``WarmupLR``, ``WarmupDecayLR``, ``WarmupCosineLR``,
``OneCycle``, ``LRRangeTest``) as ``torch.optim.lr_scheduler.LRScheduler`` subclasses, with the
formulas, defaults and per-group behaviour of DeepSpeed 0.19's ``deepspeed.runtime.lr_schedules``.

Counting follows DeepSpeed, not torch: ``last_batch_iteration`` (torch's ``last_epoch``) is the
index of the last batch trained, -1 before the first; building a schedule with -1 sets every
group's lr to the schedule's value *before* the first step (WarmupLR: ``warmup_min_lr``), and each
``step()`` advances one batch and sets the lr for the next one. A scalar hyper-parameter applies
to every param group; a list gives one value per group. ``state_dict()`` carries
``last_batch_iteration`` (DeepSpeed's own key) and ``load_state_dict`` accepts DeepSpeed's
one-key form as well as the full one.
"""
from __future__ import annotations

import warnings

import math

from torch import Tensor
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LRScheduler

WARMUP_LOG_RATE = "log"
WARMUP_LINEAR_RATE = "linear"
WARMUP_TYPES = (WARMUP_LOG_RATE, WARMUP_LINEAR_RATE)

# DeepSpeed's public names for the types and their parameters (scripts import them from
# deepspeed.runtime.lr_schedules; zerocore.deepspeed re-exports these)
LR_RANGE_TEST, ONE_CYCLE, WARMUP_LR, WARMUP_DECAY_LR, WARMUP_COSINE_LR = (
    "LRRangeTest", "OneCycle", "WarmupLR", "WarmupDecayLR", "WarmupCosineLR")
VALID_LR_SCHEDULES = [LR_RANGE_TEST, ONE_CYCLE, WARMUP_LR, WARMUP_DECAY_LR, WARMUP_COSINE_LR]
LR_RANGE_TEST_MIN_LR, LR_RANGE_TEST_STEP_RATE = "lr_range_test_min_lr", "lr_range_test_step_rate"
LR_RANGE_TEST_STEP_SIZE, LR_RANGE_TEST_STAIRCASE = "lr_range_test_step_size", "lr_range_test_staircase"
CYCLE_FIRST_STEP_SIZE, CYCLE_FIRST_STAIR_COUNT = "cycle_first_step_size", "cycle_first_stair_count"
CYCLE_SECOND_STEP_SIZE, CYCLE_SECOND_STAIR_COUNT = "cycle_second_step_size", "cycle_second_stair_count"
DECAY_STEP_SIZE, CYCLE_MIN_LR, CYCLE_MAX_LR, DECAY_LR_RATE = ("decay_step_size", "cycle_min_lr", "cycle_max_lr",
                                                              "decay_lr_rate")
CYCLE_MIN_MOM, CYCLE_MAX_MOM, DECAY_MOM_RATE = "cycle_min_mom", "cycle_max_mom", "decay_mom_rate"
WARMUP_MIN_LR, WARMUP_MAX_LR, WARMUP_NUM_STEPS, WARMUP_TYPE = ("warmup_min_lr", "warmup_max_lr", "warmup_num_steps",
                                                               "warmup_type")
WARMUP_MIN_RATIO, COS_MIN_RATIO, TOTAL_NUM_STEPS = "warmup_min_ratio", "cos_min_ratio", "total_num_steps"


def per_group(optimizer: Optimizer, value, name: str) -> list:
    """``value`` for every param group, or a list/tuple of one value per group."""
    n = len(optimizer.param_groups)
    if isinstance(value, (list, tuple)):
        if len(value) != n:
            raise ValueError(f"{name}: got {len(value)} values for {n} param groups; give one number or one per group")
        return list(value)
    return [value] * n


def set_group_values(optimizer: Optimizer, key: str, values: list) -> list:
    for group, v in zip(optimizer.param_groups, values):
        if isinstance(group.get(key), Tensor):
            group[key].fill_(v.squeeze() if isinstance(v, Tensor) else v)
        else:
            group[key] = v
    return [group[key] for group in optimizer.param_groups]


def _positive_int(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return value


def _warmup_type(value: str) -> str:
    """An unknown warmup curve falls back to 'log' with a warning, as DeepSpeed's classes do (a
    config's scheduler section is checked before: there it is an error naming the key)."""
    if value not in WARMUP_TYPES:
        warnings.warn(f"warmup_type: got {value!r}, not one of {', '.join(map(repr, WARMUP_TYPES))}; using "
                      f"{WARMUP_LOG_RATE!r} (DeepSpeed's fallback)", UserWarning, stacklevel=3)
        return WARMUP_LOG_RATE
    return value


class _BatchSchedule(LRScheduler):
    """The DeepSpeed counting on top of torch's LRScheduler (see the module docstring).
    Subclasses set their fields, then call ``_start(optimizer, last_batch_iteration)``, and
    implement ``get_lr()`` for the current ``last_epoch``; ``_initial_values()`` is what
    building at -1 applies (default: ``get_lr()`` at -1)."""

    def _start(self, optimizer: Optimizer, last_batch_iteration: int) -> None:
        self._resume_at = int(last_batch_iteration)
        # torch's constructor with -1 (it requires 'initial_lr' in every group otherwise); the
        # DeepSpeed position is set by _initial_step, which torch's constructor calls last
        super().__init__(optimizer, last_epoch=-1)

    def _initial_step(self) -> None:
        self._step_count = 0
        self.last_epoch = self._resume_at
        if self.last_epoch == -1:
            self._apply_initial()
        self._last_lr = [g["lr"] for g in self.optimizer.param_groups]

    def _apply_initial(self) -> None:
        set_group_values(self.optimizer, "lr", self.get_lr())

    @property
    def last_batch_iteration(self) -> int:
        return self.last_epoch

    @last_batch_iteration.setter
    def last_batch_iteration(self, value: int) -> None:
        self.last_epoch = value

    def step(self, batch_iteration: int | None = None) -> None:
        """Advances to ``batch_iteration`` (default: the next batch) and sets each group's lr."""
        self._step_count += 1
        self.last_epoch = self.last_epoch + 1 if batch_iteration is None else int(batch_iteration)
        self._last_lr = set_group_values(self.optimizer, "lr", self.get_lr())
        self._after_step()

    def _after_step(self) -> None:
        """Other group values a schedule cycles (OneCycle's momentum)."""

    def state_dict(self) -> dict:
        sd = super().state_dict()
        sd["last_batch_iteration"] = self.last_epoch
        return sd

    def load_state_dict(self, state_dict: dict) -> None:
        state_dict = dict(state_dict)
        it = state_dict.pop("last_batch_iteration", None)
        self.__dict__.update(state_dict)
        if it is not None:
            self.last_epoch = it


class LRRangeTest(_BatchSchedule):
    """lr = min_lr * (1 + step_rate * interval), interval = (iteration + 1) / step_size (floored
    with ``lr_range_test_staircase``)."""

    def __init__(self, optimizer: Optimizer, lr_range_test_min_lr=1e-3, lr_range_test_step_size: int = 2000,
                 lr_range_test_step_rate: float = 1.0, lr_range_test_staircase: bool = False,
                 last_batch_iteration: int = -1):
        self.min_lr = per_group(optimizer, lr_range_test_min_lr, "lr_range_test_min_lr")
        self.step_size = _positive_int("lr_range_test_step_size", lr_range_test_step_size)
        self.step_rate = lr_range_test_step_rate
        self.staircase = lr_range_test_staircase
        self._start(optimizer, last_batch_iteration)

    def _apply_initial(self) -> None:
        set_group_values(self.optimizer, "lr", self.min_lr)

    def get_lr(self) -> list[float]:
        interval = float(self.last_epoch + 1) / self.step_size
        if self.staircase:
            interval = math.floor(interval)
        increase = 1 + self.step_rate * interval
        return [lr * increase for lr in self.min_lr]


class OneCycle(_BatchSchedule):
    """One cycle of lr (``cycle_min_lr`` up to ``cycle_max_lr`` over ``cycle_first_step_size``
    batches and back over ``cycle_second_step_size``), then decay; with ``cycle_momentum`` (and an
    optimizer with ``betas``) beta1 cycles inversely between ``cycle_max_mom`` and
    ``cycle_min_mom``, beta2 set to 0.99, as DeepSpeed does."""

    def __init__(self, optimizer: Optimizer, cycle_min_lr, cycle_max_lr, decay_lr_rate: float = 0.0,
                 cycle_first_step_size: int = 2000, cycle_second_step_size: int | None = None,
                 cycle_first_stair_count: int = 0, cycle_second_stair_count: int | None = None,
                 decay_step_size: int = 0, cycle_momentum: bool = True, cycle_min_mom=0.8, cycle_max_mom=0.9,
                 decay_mom_rate: float = 0.0, last_batch_iteration: int = -1):
        first = float(cycle_first_step_size)
        second = float(cycle_second_step_size) if cycle_second_step_size is not None else first
        if first <= 0:
            raise ValueError(f"cycle_first_step_size must be positive, got {first}")
        if second < 0:
            raise ValueError(f"cycle_second_step_size must be non-negative, got {second}")
        self.total_size = first + second
        self.step_ratio = first / self.total_size
        self.first_step_size, self.second_step_size = first, second
        self.first_stair_count = cycle_first_stair_count
        self.second_stair_count = cycle_first_stair_count if cycle_second_stair_count is None \
            else cycle_second_stair_count
        self.decay_step_size = decay_step_size
        no_decay = math.isclose(decay_step_size, 0)
        self.min_lrs = per_group(optimizer, cycle_min_lr, "cycle_min_lr")
        self.max_lrs = per_group(optimizer, cycle_max_lr, "cycle_max_lr")
        self.decay_lr_rate = decay_lr_rate
        self.skip_lr_decay = no_decay or math.isclose(decay_lr_rate, 0)
        self.cycle_momentum = bool(cycle_momentum) and "betas" in optimizer.defaults
        self.decay_mom_rate = decay_mom_rate
        self.skip_mom_decay = no_decay or math.isclose(decay_mom_rate, 0)
        if self.cycle_momentum:
            self.min_moms = [(m, 0.99) for m in per_group(optimizer, cycle_min_mom, "cycle_min_mom")]
            self.max_moms = [(m, 0.99) for m in per_group(optimizer, cycle_max_mom, "cycle_max_mom")]
        self._start(optimizer, last_batch_iteration)

    def _apply_initial(self) -> None:
        set_group_values(self.optimizer, "lr", self.min_lrs)
        if self.cycle_momentum:
            for group, mom in zip(self.optimizer.param_groups, self.min_moms):
                group["betas"] = mom

    def _scale(self) -> float:
        it = self.last_epoch + 1
        cycle = math.floor(1 + it / self.total_size)
        x = 1.0 + it / self.total_size - cycle
        if x <= self.step_ratio:
            scale, stairs = x / self.step_ratio, self.first_stair_count
        else:
            scale, stairs = (x - 1) / (self.step_ratio - 1), self.second_stair_count
        if stairs > 0:  # flat across each stair, quantised from the integer batch offset
            pos = it % self.total_size
            if pos <= self.first_step_size:
                where = pos * stairs / self.first_step_size
            else:
                where = (self.total_size - pos) * stairs / self.second_step_size
            scale = math.floor(where) / stairs
        return scale

    def get_lr(self) -> list[float]:
        if self.last_epoch < self.total_size:
            s = self._scale()
            return [lo + (hi - lo) * s for lo, hi in zip(self.min_lrs, self.max_lrs)]
        if self.skip_lr_decay:
            return list(self.min_lrs)
        factor = 1 + self.decay_lr_rate * ((self.last_epoch - self.total_size + 1) / self.decay_step_size)
        return [lo / factor for lo in self.min_lrs]

    def get_mom(self) -> list[tuple[float, float]] | None:
        if not self.cycle_momentum:
            return None
        if self.last_epoch < self.total_size:
            s = self._scale()
            return [(hi[0] - (hi[0] - lo[0]) * s, lo[1]) for lo, hi in zip(self.min_moms, self.max_moms)]
        if self.skip_mom_decay:
            return list(self.max_moms)
        factor = 1 + self.decay_mom_rate * ((self.last_epoch - self.total_size + 1) / self.decay_step_size)
        return [(b0 * factor, b1) for b0, b1 in self.max_moms]

    def _after_step(self) -> None:
        moms = self.get_mom()
        if moms is not None:
            for group, mom in zip(self.optimizer.param_groups, moms):
                group["betas"] = mom


class WarmupLR(_BatchSchedule):
    """From ``warmup_min_lr`` to ``warmup_max_lr`` (default: each group's lr) over
    ``warmup_num_steps`` batches (at least 2), logarithmically or linearly, then constant."""

    def __init__(self, optimizer: Optimizer, warmup_min_lr=0.0, warmup_max_lr=None, warmup_num_steps: int = 1000,
                 warmup_type: str = WARMUP_LOG_RATE, last_batch_iteration: int = -1):
        _positive_int("warmup_num_steps", warmup_num_steps)
        if warmup_max_lr is None:
            warmup_max_lr = [g["lr"] for g in optimizer.param_groups]
        self.min_lrs = per_group(optimizer, warmup_min_lr, "warmup_min_lr")
        self.max_lrs = per_group(optimizer, warmup_max_lr, "warmup_max_lr")
        self.delta_lrs = [hi - lo for hi, lo in zip(self.max_lrs, self.min_lrs)]
        self.warmup_num_steps = max(2, warmup_num_steps)
        self.warmup_type = _warmup_type(warmup_type)
        self.inverse_log_warm_up = 1.0 / math.log(self.warmup_num_steps)
        self._start(optimizer, last_batch_iteration)

    def _warmup_gamma(self) -> float:
        if self.warmup_type == WARMUP_LOG_RATE:
            return self.inverse_log_warm_up * math.log(self.last_epoch + 1)
        return self.last_epoch / self.warmup_num_steps

    def _gamma(self) -> float:
        return self._warmup_gamma() if self.last_epoch < self.warmup_num_steps else 1.0

    def get_lr(self) -> list[float]:
        if self.last_epoch < 0:
            return list(self.min_lrs)
        g = self._gamma()
        return [lo + d * g for lo, d in zip(self.min_lrs, self.delta_lrs)]


class WarmupDecayLR(WarmupLR):
    """WarmupLR, then linear decay to 0 at ``total_num_steps``."""

    def __init__(self, optimizer: Optimizer, total_num_steps: int, warmup_min_lr=0.0, warmup_max_lr=0.001,
                 warmup_num_steps: int = 1000, warmup_type: str = WARMUP_LOG_RATE, last_batch_iteration: int = -1):
        self.total_num_steps = total_num_steps
        super().__init__(optimizer, warmup_min_lr, warmup_max_lr, warmup_num_steps, warmup_type,
                         last_batch_iteration)

    def _gamma(self) -> float:
        if self.last_epoch < self.warmup_num_steps:
            return self._warmup_gamma()
        return max(0.0, float(self.total_num_steps - self.last_epoch)
                   / float(max(1.0, self.total_num_steps - self.warmup_num_steps)))


class WarmupCosineLR(_BatchSchedule):
    """Each group's lr times a ratio: from ``warmup_min_ratio`` to 1 over ``warmup_num_steps``
    batches, then a cosine down to ``cos_min_ratio`` at ``total_num_steps`` (held there after)."""

    def __init__(self, optimizer: Optimizer, total_num_steps: int, warmup_min_ratio: float = 0.0,
                 warmup_num_steps: int = 1000, cos_min_ratio: float = 0.0001, warmup_type: str = WARMUP_LOG_RATE,
                 last_batch_iteration: int = -1):
        _positive_int("warmup_num_steps", warmup_num_steps)
        self.total_num_steps = total_num_steps
        self.cos_min_ratio = cos_min_ratio
        self.warmup_type = _warmup_type(warmup_type)
        self.warmup_min_ratio = warmup_min_ratio
        self.warmup_num_steps = max(2, warmup_num_steps)
        self.inverse_log_warm_up = 1.0 / math.log(self.warmup_num_steps)
        self.org_lrs = [g["lr"].clone() if isinstance(g["lr"], Tensor) else g["lr"] for g in optimizer.param_groups]
        self._start(optimizer, last_batch_iteration)

    def get_lr_ratio(self) -> float:
        it = self.last_epoch
        if it < 0:
            return 0.0
        if it < self.warmup_num_steps:
            if self.warmup_type == WARMUP_LOG_RATE:
                r = self.inverse_log_warm_up * math.log(it + 1)
            else:
                r = it / self.warmup_num_steps
            return self.warmup_min_ratio + r * (1.0 - self.warmup_min_ratio)
        progress = min(1.0, (it - self.warmup_num_steps + 1) / max(1, self.total_num_steps - self.warmup_num_steps))
        r = (1 + math.cos(math.pi * progress)) / 2
        return max(0.0, self.cos_min_ratio + (1.0 - self.cos_min_ratio) * r)

    def get_lr(self) -> list[float]:
        if self.last_epoch < 0:
            return [0.0 for _ in self.org_lrs]
        r = self.get_lr_ratio()
        return [lr * r for lr in self.org_lrs]


DEEPSPEED_SCHEDULES = {cls.__name__: cls for cls in (WarmupLR, WarmupDecayLR, WarmupCosineLR, OneCycle, LRRangeTest)}
