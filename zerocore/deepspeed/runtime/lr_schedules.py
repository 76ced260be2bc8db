"""``deepspeed.runtime.lr_schedules``: DeepSpeed's schedule classes (torch ``LRScheduler``s, the
ones the engine builds from the config's ``scheduler`` section) and its public constant names."""
from __future__ import annotations

from ...schedules.deepspeed_types import (  # noqa: F401
    COS_MIN_RATIO, CYCLE_FIRST_STAIR_COUNT, CYCLE_FIRST_STEP_SIZE, CYCLE_MAX_LR, CYCLE_MAX_MOM, CYCLE_MIN_LR,
    CYCLE_MIN_MOM, CYCLE_SECOND_STAIR_COUNT, CYCLE_SECOND_STEP_SIZE, DECAY_LR_RATE, DECAY_MOM_RATE, DECAY_STEP_SIZE,
    LR_RANGE_TEST, LR_RANGE_TEST_MIN_LR, LR_RANGE_TEST_STAIRCASE, LR_RANGE_TEST_STEP_RATE, LR_RANGE_TEST_STEP_SIZE,
    ONE_CYCLE, TOTAL_NUM_STEPS, VALID_LR_SCHEDULES, WARMUP_COSINE_LR, WARMUP_DECAY_LR, WARMUP_LINEAR_RATE, WARMUP_LOG_RATE,
    WARMUP_LR, WARMUP_MAX_LR, WARMUP_MIN_LR, WARMUP_MIN_RATIO, WARMUP_NUM_STEPS, WARMUP_TYPE, LRRangeTest, OneCycle,
    WarmupCosineLR, WarmupDecayLR, WarmupLR)

LR_SCHEDULE = "lr_schedule"  # the key of the schedule's name in DeepSpeed's argparse helpers
EDGE_VALUE = "edge_value"
MID_VALUE = "mid_value"
