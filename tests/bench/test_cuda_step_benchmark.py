"""benchmarks/step.py without a GPU: the command line (device, ranks, variants skipped when their
package or device is missing), the models from configs, and the JSON of a tiny CPU run."""
from __future__ import annotations

import json
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks")))
import step  # noqa: E402
import step_variants as sv  # noqa: E402

TINY = ["--dim", "32", "--layers", "2", "--heads", "2", "--ctx", "16", "--batch", "2"]


def test_cpu_defaults():
    a = step.parse_args([])
    assert a.device == "cpu" and a.ranks == 2 and a.vocab == 65 and a.variants == sv.CPU_DEFAULT and not a.skipped


def test_cuda_arguments(monkeypatch):
    with pytest.raises(SystemExit):
        step.parse_args(["--device", "cuda"])  # no GPU here: a clear error, not a crash
    with pytest.raises(SystemExit):
        step.parse_args(["--ranks", "all"])  # 'all' is for GPUs
    with pytest.raises(SystemExit):
        step.parse_args(["--variants", "torch_amp"])  # a GPU-only variant on the CPU
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    a = step.parse_args(["--device", "cuda"])
    assert a.ranks == 1 and a.vocab == 32768
    assert step.parse_args(["--device", "cuda", "--ranks", "all"]).ranks == 4
    monkeypatch.setattr(sv.importlib.util, "find_spec", lambda name: None if name == "deepspeed" else True)
    a = step.parse_args(["--device", "cuda"])
    assert set(a.skipped) == {"deepspeed_stage1", "deepspeed_stage2", "deepspeed_stage3"}
    assert "deepspeed" in a.skipped["deepspeed_stage2"] and "torch_amp" in a.variants and "zerocore_stage3" in a.variants
    with pytest.raises(SystemExit):
        step.parse_args(["--device", "cuda", "--variants", "deepspeed_stage3"])


@pytest.mark.parametrize("kind", sv.MODELS)
def test_models_from_configs(kind):
    if kind.startswith("hf") and sv.importlib.util.find_spec("transformers") is None:
        pytest.skip("transformers not installed")
    args = step.parse_args(["--model", kind] + TINY)
    model = sv.build_model(kind, args, 50)
    assert len(sv.blocks_of(model)) == 2
    assert type(sv.blocks_of(model)[0]).__name__ == sv.UNIT_CLASS[kind]
    x = torch.randint(0, 50, (2, 16))
    assert sv.logits(model, x).shape == (2, 16, 50)
    assert sv.loss_of(model, x, x).dim() == 0


@pytest.mark.slow  # spawns a rank and builds two variants: ~1-2 min on the loaded 2-core VM
def test_tiny_cpu_run_writes_the_table_json(tmp_path):
    out = tmp_path / "step.json"
    report = step.main(["--ranks", "1", "--warmup", "1", "--steps", "2", "--rounds", "1", "--variants",
                        "ddp_torch_adamw", "zerocore_stage2", "--out", str(out)] + TINY)
    saved = json.loads(out.read_text())
    assert saved["device"] == "cpu" and saved["world"] == 1 and saved["n_params"] > 0
    for v in ("ddp_torch_adamw", "zerocore_stage2"):
        r = saved["results"][v]
        assert r["median_ms"] > 0 and r["tokens_per_s"] > 0 and len(r["times_ms"]) == 1 and len(r["times_ms"][0]) == 2
        assert r["peak_GiB"] is None and r["between_steps_GiB"] is None  # measured on GPUs only
        assert r["final_loss"] == pytest.approx(r["final_loss"])  # finite
    assert "zerocore_stage2/ddp_torch_adamw" in saved["ratios"] and report["results"].keys() == saved["results"].keys()
