"""``deepspeed.checkpoint.ds_to_universal`` for zerocore checkpoints: DeepSpeed's step between saving at one
world size and loading at another (``"checkpoint": {"load_universal": true}``).

A zerocore checkpoint is universal as saved (it loads at any world size and stage), so the "conversion" makes
``--output_folder`` a checked copy of the tag folder ``--input_folder``: every file the manifest lists present
at its recorded size (the checksums are verified when it is loaded), hard-linked where the file system allows
(no bytes copied), else copied; built beside the destination and renamed into place, so an interrupted run
leaves no half folder. Then, as with DeepSpeed, load it by its tag (``engine.load_checkpoint(dir,
tag="global_step10_universal")``) or name it in ``latest_universal``, which a load with ``load_universal`` and
no tag reads. DeepSpeed's own checkpoint files are not zerocore's: such a folder is refused, naming it.

    python -m zerocore.deepspeed.checkpoint.ds_to_universal --input_folder ckpt/global_step10 \\
        --output_folder ckpt/global_step10_universal
"""
from __future__ import annotations

import argparse
import os
import shutil

from ...checkpoint.blockio import BlockFile
from ...checkpoint.layout import MANIFEST, CheckpointError, fsync_dir, read_manifest


def _link_or_copy(src: str, dst: str) -> None:
    try:
        os.link(src, dst)
    except OSError:  # another file system, or one without hard links
        shutil.copy2(src, dst)


def convert(input_folder, output_folder) -> str:
    """Makes ``output_folder`` the universal form of the checkpoint tag folder ``input_folder``; returns it."""
    src, dst = os.fspath(input_folder), os.fspath(output_folder)
    if not os.path.isfile(os.path.join(src, MANIFEST)):
        raise CheckpointError(f"ds_to_universal: {src} is not a zerocore checkpoint tag folder (no {MANIFEST}); "
                              "zerocore converts the checkpoints zerocore saved (give the tag folder, e.g. "
                              "ckpt/global_step10, not the save directory)")
    for name, record in read_manifest(src)["files"].items():
        BlockFile(os.path.join(src, name), record)  # present, at the recorded size (ChecksumError naming it)
    if os.path.exists(dst):
        raise CheckpointError(f"ds_to_universal: {dst} exists already; remove it or choose another --output_folder")
    parent = os.path.dirname(os.path.abspath(dst))
    os.makedirs(parent, exist_ok=True)
    tmp = os.path.join(parent, f".tmp-{os.path.basename(os.path.abspath(dst))}-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    try:
        for entry in sorted(os.listdir(src)):  # the manifest last: a folder with it is a complete one
            if entry != MANIFEST and os.path.isfile(os.path.join(src, entry)):
                _link_or_copy(os.path.join(src, entry), os.path.join(tmp, entry))
        _link_or_copy(os.path.join(src, MANIFEST), os.path.join(tmp, MANIFEST))
        fsync_dir(tmp)
        os.replace(tmp, dst)
        fsync_dir(parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return dst


def main(args) -> None:
    """DeepSpeed's entry point: ``args`` has ``input_folder`` and ``output_folder`` (its other options, the
    worker counts, ``keep_temp_folder``, ``strict``, ``inject_missing_state``, change nothing here)."""
    print(f"Converting checkpoint in {args.input_folder} to universal checkpoint in {args.output_folder}")
    convert(args.input_folder, args.output_folder)
    print("*** Done!")


def parse_arguments(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--input_folder", type=str, required=True, help="the checkpoint's tag folder")
    parser.add_argument("--output_folder", type=str, required=True, help="the universal checkpoint's folder")
    parser.add_argument("--num_extract_workers", type=int, default=4, help="accepted (DeepSpeed's); no effect")
    parser.add_argument("--num_merge_workers", type=int, default=2, help="accepted (DeepSpeed's); no effect")
    parser.add_argument("--keep_temp_folder", action="store_true", help="accepted (DeepSpeed's); no effect")
    parser.add_argument("--no_strict", dest="strict", action="store_false", help="accepted (DeepSpeed's); no effect")
    parser.add_argument("--inject_missing_state", action="store_true", help="accepted (DeepSpeed's); no effect")
    return parser.parse_args(argv)


if __name__ == "__main__":
    main(parse_arguments())
