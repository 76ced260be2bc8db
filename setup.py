"""Builds zerocore and its native extension ``zerocore._C`` against the installed torch.

    pip install torch==2.13.0          # or the CUDA build you use
    pip install --no-build-isolation .

--no-build-isolation matters: the extension must be compiled against the torch you run with,
and an isolated build would download a different (multi-GB CUDA) torch to build against.
"""
import os
import runpy

from setuptools import find_packages, setup

try:
    import torch
    from torch.utils.cpp_extension import BuildExtension, CppExtension
except ImportError as exc:  # pragma: no cover - exercised only on a machine without torch
    raise SystemExit(
        "zerocore builds against the torch you already have, and none is importable "
        f"({exc}). Install it first (e.g. `pip install torch==2.13.0`), then run "
        "`pip install --no-build-isolation .`"
    )

ROOT = os.path.dirname(os.path.abspath(__file__))
spec = runpy.run_path(os.path.join(ROOT, "zerocore", "ops", "build_spec.py"))


def torch_tag() -> str:
    """Local version tag of the torch we build against: 'cpu' or 'cu<major><minor>'."""
    cuda = torch.version.cuda
    return "cu" + cuda.replace(".", "")[:3] if cuda else "cpu"


torch_base = torch.__version__.split("+")[0]
rel = lambda p: os.path.relpath(p, ROOT)  # noqa: E731 - setuptools wants relative paths

ext = CppExtension(
    "zerocore._C",
    [rel(p) for p in spec["sources"](ROOT)],
    include_dirs=spec["include_dirs"](ROOT),
    extra_compile_args={"cxx": spec["CXX_FLAGS"]},
    extra_link_args=spec["LINK_FLAGS"],
)

setup(
    name="zerocore",
    version=f"0.1.0+{torch_tag()}",
    description="ZeRO sharded data parallelism for PyTorch with native CPU/GPU kernels",
    packages=find_packages(include=["zerocore", "zerocore.*"]),
    package_data={"zerocore": ["data/*.txt"]},
    ext_modules=[ext],
    cmdclass={"build_ext": BuildExtension.with_options(use_ninja=True)},
    python_requires=">=3.9",
    # The extension is compiled against this exact torch; another version may not load it.
    install_requires=[f"torch=={torch_base}", "tqdm"],
    extras_require={"test": ["pytest>=7", "numpy"], "bench": ["deepspeed", "matplotlib"]},
    entry_points={"console_scripts": ["zerocore=zerocore.cli:main"]},
)
