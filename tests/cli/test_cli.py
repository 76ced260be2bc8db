"""`zerocore env` reports versions, how each op was obtained, and the ISA."""
import json
import os
import re
import subprocess
import sys


def test_env_json():
    r = subprocess.run([sys.executable, "-m", "zerocore", "env", "--json"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    info = json.loads(r.stdout)
    assert info["torch"].startswith("2.")
    assert info["extension"] == "prebuilt"
    for op in ("adam", "flatten", "cast", "norm"):
        assert info["ops"][op] == "prebuilt"
    assert info["cpu_isa_active"] in info["cpu_isas_supported"]
    assert "aio" in info["ops"] and "cuda" in info["ops"]


def test_env_names_the_compiler_that_built_the_extension():
    """Compiled in (the extension's own macros) and recorded by the build (path and --version):
    the two name the same compiler."""
    r = subprocess.run([sys.executable, "-m", "zerocore", "env", "--json"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    info = json.loads(r.stdout)
    m = re.fullmatch(r"(gcc|clang) (\d+\.\d+\.\d+)\S*.*, libstdc\+\+ (\d+) \((\d{8})\), C\+\+ 201703",
                     info["extension_compiler"])
    assert m, info["extension_compiler"]
    built_by = info["extension_built_by"]
    path = built_by.rsplit(" (", 1)[1].rstrip(")")
    assert os.path.isabs(path) and os.path.exists(path), built_by
    assert m.group(2) in built_by  # e.g. 12.2.0 in "c++ (Debian 12.2.0-14+deb12u1) 12.2.0 (/usr/bin/c++)"


def test_env_says_when_the_extension_does_not_report_its_compiler():
    from zerocore.env_report import compiled_with

    class OldExtension:  # built before compiler_info existed
        pass

    assert compiled_with(OldExtension()).startswith("unknown (this extension predates compiler_info")


def test_env_text():
    r = subprocess.run([sys.executable, "-m", "zerocore", "env"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "cpu_isa_active" in r.stdout and "ops:" in r.stdout


# -- bad arguments are named, before anything starts (issue 15) ------------------------------------------
import pytest  # noqa: E402

from zerocore.cli import main  # noqa: E402


@pytest.mark.parametrize("argv,wording", [
    (["demo", "--steps", "0"], "argument --steps: must be >= 1, got 0"),
    (["demo", "--ranks", "0"], "argument --ranks: must be >= 1, got 0"),
    (["demo", "--ctx", "0"], "argument --ctx: must be >= 1, got 0"),
    (["demo", "--lr", "nan"], "argument --lr: must be a finite number > 0, got nan"),
])
def test_demo_rejects_bad_arguments(argv, wording, capsys):
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2 and wording in capsys.readouterr().err


@pytest.mark.parametrize("argv,wording", [
    (["demo", "--ctx", "100000"], "--ctx 100000 with --batch 8 needs about"),
    (["demo", "--dim", "10"], "--dim must be a multiple of 4"),
    (["demo", "--ctx", "300000"], "--ctx 300000 is longer than the demo can sample from"),
])
def test_demo_checks_what_the_run_needs_before_starting_ranks(argv, wording, capsys):
    assert main(argv) == 2
    out = capsys.readouterr()
    assert f"zerocore demo: error: {wording}" in out.err and "starting" not in out.out


def test_demo_memory_estimate_is_against_available_memory(capsys):
    assert main(["demo", "--ctx", "100000"]) == 2
    err = capsys.readouterr().err
    need = float(err.split("needs about ")[1].split(" GiB")[0])
    have = float(err.split("has ")[1].split(" GiB")[0])
    assert need > have > 0


def test_config_docs_write_errors_are_named(tmp_path, capsys):
    assert main(["config-docs", "--write", "/nonexistent/x"]) == 2
    assert "zerocore config-docs: error: cannot write /nonexistent/x: No such file or directory" in \
        capsys.readouterr().err
    target = tmp_path / "config.md"
    assert main(["config-docs", "--write", str(target)]) == 0
    from zerocore.config.docs import render

    assert target.read_text(encoding="utf-8") == render()
    assert [p.name for p in tmp_path.iterdir()] == ["config.md"]  # no temporary file left
