"""Runs DeepSpeed's own unit tests (a copy of its repository's ``tests/``, kept outside this repo)
against ``zerocore.deepspeed`` (or, with ``--face deepspeed``, against the installed DeepSpeed, to
learn which tests apply on CPU at all), and writes a pass/fail table with each failure's first
error line.

    git --git-dir=/work/.mirror/deepspeedai+DeepSpeed/repo archive v0.19.5 tests | tar -x -C /tmp/ds_v0195
    PYTHONPATH=$PWD python scripts/ds_unit/run.py --tests /tmp/ds_v0195/tests --out /tmp/ds_zc
    PYTHONPATH=$PWD python scripts/ds_unit/run.py --tests /tmp/ds_v0195/tests --face deepspeed --out /tmp/ds_ref

How: ``site/sitecustomize.py`` (both faces) keeps a rank's pytest failure from hanging DeepSpeed's
launcher (see there); ``site/ds_dist_fixture.py`` (a pytest plugin, both faces) makes DeepSpeed's
``DistributedFixture`` classes fixtures under this pytest. ``alias/deepspeed`` goes first on
PYTHONPATH, so ``import deepspeed`` in pytest and in every
rank DeepSpeed's ``DistributedTest`` spawns (forkserver children inherit the environment) is
``zerocore.deepspeed``. Their launcher is kept as is: with ``DS_ACCELERATOR=cpu`` the accelerator
is the CPU, the backend gloo, and ``LOCAL_SIZE`` tells the CPU accelerator how many "devices" there
are (DeepSpeed's CPU accelerator reads it too; without it a world of 2 is skipped on a one-socket
machine). Each test file runs in its own pytest process (a hung test ends only its file).
"""
from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
import xml.etree.ElementTree as ET

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))

# The files issue 34 names (paths under tests/unit).
ISSUE_FILES = [
    "runtime/test_lr_schedulers.py", "runtime/test_ds_initialize.py", "runtime/test_no_sync_ctxt.py",
    "runtime/zero/test_zero_context.py", "runtime/zero/test_zero_context_return.py",
    "runtime/zero/test_ignore_unused_parameters.py", "v1/zero/test_zero.py", "checkpoint/test_zero_optimizer.py",
    "checkpoint/test_lr_scheduler.py", "checkpoint/test_latest_checkpoint.py", "checkpoint/test_tag_validation.py",
]
# More of DeepSpeed's ZeRO, precision and config tests (``--set more``): the APIs users call
# beside initialize (leaf modules, tensor fragments, the config objects) and DeepSpeed's own engine internals.
MORE_FILES = [
    "runtime/zero/test_zero_grad_clip.py", "runtime/zero/test_zero_leaf_module.py",
    "runtime/zero/test_zero_tensor_fragment.py", "runtime/zero/test_zero_nesting_init.py",
    "runtime/zero/test_zero_config.py", "runtime/zero/test_zero_dynamic_class.py",
    "runtime/zero/test_zero_late_module_attach.py", "runtime/zero/test_zero_hook_attribute_delegation.py",
    "runtime/zero/test_zero_context_ancestry.py", "runtime/zero/test_unwrap_model.py",
    "runtime/zero/test_zero_autocast_mixed_dtype.py", "runtime/zero/test_zero_allreduce_fetch_params.py",
    "runtime/zero/test_zero_linear_direct_init.py", "runtime/half_precision/test_dynamic_loss_scale.py",
    "runtime/half_precision/test_zero_optim_overflow.py", "runtime/test_ds_config_dict.py",
    "runtime/test_multiple_models.py", "runtime/test_runtime_utils.py", "runtime/test_ds_config_model.py",
    "runtime/half_precision/test_fp16.py",
]
# loss.backward() through the engine, compared with DDP (``--set backward``; about 30 minutes on 2 cores)
BACKWARD_FILES = ["v1/zero/test_zero_user_backward.py", "runtime/test_multiple_models.py"]
# The rest of DeepSpeed's ZeRO, checkpoint, precision and autocast files (``--set wider``): universal checkpoints,
# zero_to_fp32 with tied weights, torch.func through the engine, torch_autocast, offload_states, the fp16
# section's validation (docs/deepspeed_unit_tests.md)
WIDER_FILES = [
    "checkpoint/test_other_optimizer.py", "checkpoint/test_shared_weights.py",
    "checkpoint/test_universal_checkpoint.py", "checkpoint/test_convert_checkpoint.py",
    "runtime/zero/test_nvme_checkpointing.py", "runtime/zero/test_zero_offloadpp.py", "runtime/zero/test_zero_tiled.py",
    "runtime/test_autocast.py", "runtime/test_multi_output_model.py", "runtime/test_precision_config_dynamic_scale.py",
    "runtime/test_precision_config_loss_scale.py", "v1/zero/test_offload_states.py",
    "v1/zero/test_zero2_offload_multi_backward.py", "v1/zero/test_zero_cpu_offload_grad_accum.py",
    "v1/zero/test_zero_functorch_linear.py", "v1/zero/test_zero_torch_func.py", "v1/zero/test_zero_autocast.py",
    "v1/zero/test_zero_activation_checkpoint_lifecycle.py", "v1/zero/test_zero_hook_count_regression.py",
    "v1/zero/test_zero_init_pg_contradiction.py", "v1/zero/test_overlap_comm_record_stream.py",
    "v1/zero/test_stage2_flatten_on_gpu.py", "runtime/comm/test_coalesced_collectives.py",
]
FILE_SETS = {"issue34": ISSUE_FILES, "more": MORE_FILES, "backward": BACKWARD_FILES, "wider": WIDER_FILES,
             "all": ISSUE_FILES + MORE_FILES + BACKWARD_FILES[:1] + WIDER_FILES}


def _env(face: str, local_size: int, timeout: int) -> dict:
    env = dict(os.environ)
    path = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    if face == "zerocore":
        path = [os.path.join(HERE, "alias"), ROOT] + path
    else:  # the installed DeepSpeed: keep this repo off the path so nothing of ours is imported
        path = [p for p in path if os.path.abspath(p) != ROOT]
    path.insert(0, os.path.join(HERE, "site"))  # sitecustomize.py: the launcher fix, for both faces
    env.update(PYTHONPATH=os.pathsep.join(path), DS_ACCELERATOR="cpu", LOCAL_SIZE=str(local_size),
               OMP_NUM_THREADS="1", DS_UNITTEST_TIMEOUT=str(timeout), DS_DISABLE_REUSE_DIST_ENV="1",
               TORCHINDUCTOR_COMPILE_THREADS="1")
    return env


def _first_line(text: str) -> str:
    """The error's own line: the last ``E   `` line of pytest's report naming an exception, else
    the message's first non-empty line."""
    lines = (text or "").splitlines()
    errors = [ln[1:].strip() for ln in lines if ln.startswith("E ")]
    named = [ln for ln in errors if "Error" in ln or "Exception" in ln or "assert" in ln.lower()]
    pick = (named or errors or [ln.strip() for ln in lines if ln.strip()] or [""])
    return pick[-1][:300] if named or errors else pick[0][:300]


def _read_junit(path: str) -> list[tuple[str, str, str]]:
    """(test id, passed|failed|error|skipped, first line) of each test case in a junit file."""
    rows = []
    for case in ET.parse(path).getroot().iter("testcase"):
        name = f"{case.get('classname', '')}::{case.get('name', '')}"
        outcome, line = "passed", ""
        for child in case:
            if child.tag in ("failure", "error", "skipped"):
                outcome = {"failure": "failed"}.get(child.tag, child.tag)
                line = _first_line(child.get("message", "") + "\n" + (child.text or ""))
                if child.tag == "skipped":
                    line = (child.get("message") or "")[:300]
                break
        rows.append((name, outcome, line))
    return rows


def run_file(tests: str, rel: str, face: str, out: str, args) -> list[tuple[str, str, str]]:
    junit = os.path.join(out, rel.replace("/", "__") + ".xml")
    if args.keep and os.path.exists(junit):  # a result of an earlier run into this folder
        return _read_junit(junit)
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "ds_dist_fixture",
           "--junitxml", junit, "-o", "junit_family=xunit1", "-W", "ignore::DeprecationWarning", f"unit/{rel}"]
    if args.k:
        cmd[-1:-1] = ["-k", args.k]
    log = os.path.join(out, rel.replace("/", "__") + ".log")
    t0 = time.time()
    with open(log, "w") as f:
        # a session of its own: on a timeout its whole process group goes (pytest, the forkserver, the ranks)
        proc = subprocess.Popen(cmd, cwd=tests, env=_env(face, args.local_size, args.timeout), stdout=f,
                                stderr=subprocess.STDOUT, start_new_session=True)
        try:
            proc.wait(timeout=args.file_timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            f.write(f"\nharness: the file ran past {args.file_timeout}s\n")
    print(f"{rel}: {time.time() - t0:.0f}s", file=sys.stderr, flush=True)
    if not os.path.exists(junit):
        return [(rel, "error", f"no junit report (see {log})")]
    return _read_junit(junit)


def write_table(rows_by_file: dict, out: str, face: str) -> str:
    lines = [f"# DeepSpeed unit tests against {face}", "", "| file | passed | failed | skipped |", "|---|---|---|---|"]
    total = [0, 0, 0]
    for rel, rows in rows_by_file.items():
        n = [sum(o == "passed" for _, o, _ in rows), sum(o in ("failed", "error") for _, o, _ in rows),
             sum(o == "skipped" for _, o, _ in rows)]
        total = [a + b for a, b in zip(total, n)]
        lines.append(f"| {rel} | {n[0]} | {n[1]} | {n[2]} |")
    lines.append(f"| **all** | {total[0]} | {total[1]} | {total[2]} |")
    lines += ["", "## Every test", "", "| test | outcome | first error line |", "|---|---|---|"]
    for rows in rows_by_file.values():
        for name, outcome, line in rows:
            lines.append(f"| {name} | {outcome} | {line.replace('|', '/')} |")
    text = "\n".join(lines) + "\n"
    with open(os.path.join(out, "table.md"), "w") as f:
        f.write(text)
    return text


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tests", required=True, help="DeepSpeed's tests/ folder (a copy outside this repo)")
    ap.add_argument("--face", choices=("zerocore", "deepspeed"), default="zerocore")
    ap.add_argument("--out", required=True, help="folder for the junit files, logs and table.md")
    ap.add_argument("--set", choices=sorted(FILE_SETS), default="issue34",
                    help="which files: issue 34's eleven, twenty more, the torch-style backward's two, "
                         "twenty-three wider (docs/deepspeed_unit_tests.md), or all of them")
    ap.add_argument("--files", nargs="*", default=None, help="paths under tests/unit (instead of --set)")
    ap.add_argument("-k", default=None, help="pytest -k expression")
    ap.add_argument("--local-size", type=int, default=4, help="CPU 'devices' (the largest world a test asks)")
    ap.add_argument("--timeout", type=int, default=300, help="seconds one distributed test may take")
    ap.add_argument("--file-timeout", type=int, default=3600, help="seconds one file may take")
    ap.add_argument("--keep", action="store_true", help="reuse a file's junit report already in --out")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    files = args.files if args.files else FILE_SETS[args.set]
    rows = {rel: run_file(os.path.abspath(args.tests), rel, args.face, args.out, args) for rel in files}
    text = write_table(rows, args.out, args.face)
    print(text.split("\n## ")[0])


if __name__ == "__main__":
    main()
