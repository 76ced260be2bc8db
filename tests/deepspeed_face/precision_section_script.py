"""DeepSpeed's ``fp16`` section object (``deepspeed.runtime.precision_config.DeepSpeedFP16Config``) over a list of
sections, under the library ``ZC_FACE`` picks: for each section the values read back, or that it was refused and
whether as pydantic's ``ValidationError`` (DeepSpeed's pydantic model raises it). One gloo rank (face_script.py)."""
import importlib

import pydantic
import torch

from face_script import library, start

deepspeed = library()
DeepSpeedFP16Config = importlib.import_module(deepspeed.__name__ + ".runtime.precision_config").DeepSpeedFP16Config
FIELDS = ("enabled", "loss_scale", "initial_scale_power", "loss_scale_window", "hysteresis", "min_loss_scale")

DYNAMIC = {"enabled": True, "loss_scale": 0}
CASES = [
    {}, {"enabled": True}, {"loss_scale": 1}, {"loss_scale": 2.0}, {"loss_scale": 0},
    {"loss_scale": -1}, {"loss_scale": float("inf")}, {"loss_scale": float("nan")}, {"loss_scale": True},
    {"loss_scale": []}, {"loss_scale": {}},
    # DeepSpeed's validator calls float() on the value: a string holding a number is that number
    {"loss_scale": "3"}, {"loss_scale": "1e3"}, {"loss_scale": "abc"}, {"loss_scale": "inf"},
    # the dynamic scale's window and floor: refused where it uses them, unused (and kept) otherwise
    *({**DYNAMIC, key: v} for key in ("loss_scale_window", "min_loss_scale") for v in (0, -1, 1, 1000)),
    *({"enabled": True, "loss_scale": 128, key: v} for key in ("loss_scale_window", "min_loss_scale") for v in (0, -1)),
    *({"enabled": False, "loss_scale": 0, key: v} for key in ("loss_scale_window", "min_loss_scale") for v in (0, -1)),
    *({**DYNAMIC, key: v} for key in ("loss_scale_window", "min_loss_scale")
      for v in (True, False, float("inf"), float("nan"), "abc", None)),
    {**DYNAMIC, "loss_scale_window": 2.0}, {**DYNAMIC, "loss_scale_window": 2.5},
]


def case(section: dict) -> dict:
    try:
        c = DeepSpeedFP16Config(**section)
    except pydantic.ValidationError:
        return {"refused": "ValidationError"}
    except Exception as e:  # noqa: BLE001 - the kind is what is compared
        return {"refused": type(e).__name__}
    return {f: getattr(c, f) for f in FIELDS}


def main():
    out = start(deepspeed)
    torch.save([case(s) for s in CASES], out)


if __name__ == "__main__":
    main()
