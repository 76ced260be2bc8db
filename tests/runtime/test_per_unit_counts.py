"""Stage 3's host work per step is per unit, not per parameter: a differential count.

Two models with the same number of units (``BLOCKS`` blocks of benchmarks/backward_overhead.py,
each one stage-3 unit) and 4 or 12 parameters per unit (one or three LayerNorm + Linear pairs),
2 gloo ranks, one training step (forward + backward + optimizer step) after two warm-up steps,
counted on each rank by ``count_helpers.ZerocoreCounter``: zerocore's Python calls, the native
calls made from zerocore's code, the lines of zerocore's code executed (which see a per-parameter
loop of attribute writes such as ``p.data = v``, invisible to call counts) and the collectives.
With the work per unit and none per parameter, every count is the same for both models.

Stage 2 has one gradient hook per parameter by design (as DeepSpeed's stage 2): its Python calls
may grow by one per parameter, no more.

``python tests/test_per_unit_counts.py`` prints the counts and the sites that grow.
"""
from __future__ import annotations

import pytest

from count_helpers import count_step, grown_sites
from dist_helpers import spawn_cases

WORLD, BLOCKS = 2, 10
SMALL, LARGE = 4, 12  # parameters per unit
CASES = [{"stage": s, "blocks": BLOCKS, "params_per_block": k} for s in (2, 3) for k in (SMALL, LARGE)]


def _run(tmp_dir) -> list[list[dict]]:
    results = spawn_cases(CASES, WORLD, tmp_dir, timeout=300, run=count_step)
    for rank, rs in enumerate(results):
        for case, r in zip(CASES, rs):
            assert "error" not in r, f"rank {rank}, {case}:\n{r['error']}"
        assert len(rs) == len(CASES), f"rank {rank} stopped early"
    return results


@pytest.fixture(scope="module")
def counts(tmp_path_factory):
    return _run(tmp_path_factory.mktemp("per_unit_counts"))


def pair(counts, rank: int, stage: int) -> tuple[dict, dict]:
    i = CASES.index({"stage": stage, "blocks": BLOCKS, "params_per_block": SMALL})
    small, large = counts[rank][i], counts[rank][i + 1]
    assert (small["params"], large["params"]) == (SMALL * BLOCKS, LARGE * BLOCKS)
    return small, large


def assert_same(counts, stage: int, kind: str) -> None:
    for rank in range(WORLD):
        small, large = pair(counts, rank, stage)
        a, b = small["totals"][kind], large["totals"][kind]
        extra = (LARGE - SMALL) * BLOCKS
        assert a == b, (f"stage {stage}, rank {rank}: {kind} per step {a} with {SMALL} parameters per unit, {b} "
                        f"with {LARGE} ({(b - a) / extra:+.2f} per extra parameter); grown: "
                        f"{grown_sites(small, large, kind)}")


def test_stage3_python_calls_are_per_unit(counts):
    assert_same(counts, 3, "python")


def test_stage3_native_calls_are_per_unit(counts):
    assert_same(counts, 3, "native")


def test_stage3_lines_executed_are_per_unit(counts):
    assert_same(counts, 3, "lines")


def test_stage3_collectives_are_per_unit(counts):
    assert_same(counts, 3, "collectives")
    small, _ = pair(counts, 0, 3)
    assert small["groups"] == BLOCKS and small["totals"]["collectives"] > 0, small["totals"]


def test_stage2_python_calls_grow_by_at_most_the_gradient_hook(counts):
    for rank in range(WORLD):
        small, large = pair(counts, rank, 2)
        extra = (LARGE - SMALL) * BLOCKS
        grown = large["totals"]["python"] - small["totals"]["python"]
        assert grown <= extra, (rank, small["totals"], large["totals"], grown_sites(small, large, "python"))
    assert_same(counts, 2, "collectives")


if __name__ == "__main__":
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        res = _run(d)
    for stage in (2, 3):
        small, large = pair(res, 0, stage)
        extra = (LARGE - SMALL) * BLOCKS
        print(f"stage {stage}, world {WORLD}, {BLOCKS} units, {small['groups']} groups, rank 0, per step:")
        for kind in small["totals"]:
            a, b = small["totals"][kind], large["totals"][kind]
            print(f"  {kind:<12}{a:>7} with {SMALL} params/unit {b:>7} with {LARGE}  "
                  f"({(b - a) / extra:+.2f} per extra parameter)")
            for site in grown_sites(small, large, kind, top=30):
                print(f"      {site}")
