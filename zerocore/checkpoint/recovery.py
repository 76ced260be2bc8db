"""The recovery script a save leaves in ``save_dir``: ``zero_to_fp32.py``, as DeepSpeed leaves its own
there, with DeepSpeed's command line, consolidating with zerocore's offline reader
(``zerocore.deepspeed.utils.zero_to_fp32``, over ``checkpoint/offline.py``)::

    python save_dir/zero_to_fp32.py save_dir out_dir [-t TAG] [--safe_serialization] [--max_shard_size 5GB]
                                   [--exclude_frozen_parameters]

writes ``out_dir/pytorch_model.bin`` (or ``model.safetensors``, sharded by ``--max_shard_size`` with
an index) holding the model's fp32 weights under the model's own names.

Rank 0 writes it after publishing the tag, atomically (a temporary file renamed over it) and made
executable (the user's execute bit added, as DeepSpeed's ``_change_recovery_script_permissions``);
a folder where the mode cannot change (some network shares) keeps it readable only, and a failure
to write it warns: the checkpoint itself is complete by then.
"""
from __future__ import annotations

import os
import warnings

from .layout import write_atomic

NAME = "zero_to_fp32.py"

SCRIPT = '''#!/usr/bin/env python
"""Written by zerocore beside its checkpoints (as DeepSpeed writes its zero_to_fp32.py): consolidates a
zerocore checkpoint of any world size and ZeRO stage into one fp32 state dict, with DeepSpeed's command line.

    python zero_to_fp32.py CHECKPOINT_DIR OUTPUT_DIR [-t TAG] [--safe_serialization] [--max_shard_size 5GB]

CHECKPOINT_DIR is the folder given to save_checkpoint (holding 'latest' and the tag folders); the tag
'latest' names is read unless -t gives one. OUTPUT_DIR receives pytorch_model.bin, or model.safetensors
(sharded by --max_shard_size, with an index) with --safe_serialization. Needs zerocore installed.
"""
import argparse

from zerocore.deepspeed.utils.zero_to_fp32 import convert_zero_checkpoint_to_fp32_state_dict

if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="zerocore checkpoint -> fp32 state dict")
    parser.add_argument("checkpoint_dir", type=str, help="the folder given to save_checkpoint, e.g. path/checkpoint-12")
    parser.add_argument("output_dir", type=str,
                        help="folder for the fp32 state dict files, e.g. path/checkpoint-12-output/")
    parser.add_argument("--max_shard_size", type=str, default="5GB",
                        help="the largest safetensors shard (with --safe_serialization), e.g. 5GB or 500MB")
    parser.add_argument("--safe_serialization", default=False, action="store_true",
                        help="write safetensors (streaming, sharded) instead of torch.save's pickle")
    parser.add_argument("-t", "--tag", type=str, default=None, help="the checkpoint tag, e.g. global_step1")
    parser.add_argument("--exclude_frozen_parameters", action="store_true", help="exclude frozen parameters")
    parser.add_argument("-d", "--debug", action="store_true", help="accepted for DeepSpeed's command line")
    args = parser.parse_args()
    for path in convert_zero_checkpoint_to_fp32_state_dict(args.checkpoint_dir, args.output_dir,
                                                           max_shard_size=args.max_shard_size,
                                                           safe_serialization=args.safe_serialization, tag=args.tag,
                                                           exclude_frozen_parameters=args.exclude_frozen_parameters):
        print(path)
'''


def write_recovery_script(save_dir: str) -> str | None:
    """Rank 0, after a tag is published: ``save_dir/zero_to_fp32.py`` (replaced atomically when there).
    Returns its path, None (with a warning) when it could not be written."""
    dst = os.path.join(save_dir, NAME)
    try:  # a share without modes keeps it readable: run it with `python zero_to_fp32.py`
        write_atomic(dst, SCRIPT.encode("utf-8"), executable=True)
    except OSError as e:
        warnings.warn(f"zerocore checkpoint: the checkpoint is saved, but its recovery script {dst} could not be "
                      f"written ({e}); `zerocore consolidate` reads the checkpoint too", RuntimeWarning, stacklevel=4)
        return None
    return dst
