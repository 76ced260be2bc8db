"""`zerocore env` reports versions, how each op was obtained, and the ISA."""
import json
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


def test_env_text():
    r = subprocess.run([sys.executable, "-m", "zerocore", "env"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "cpu_isa_active" in r.stdout and "ops:" in r.stdout
