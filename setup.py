"""Setuptools shim: all metadata lives in pyproject.toml.

The CPU kernels (zpp/quant/csrc) are compiled at first use, per machine, so that they
may use the running processor's vector units; the CUDA kernels (cuda/) are compiled at
run time by cupy. Nothing is compiled at install time: build_py only copies cuda/*.cu into
the built package (zpp/quant/cuda_src/), where an installed zpp looks for them.
"""
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

_CUDA_DIR = Path(__file__).resolve().parent / "cuda"


class build_py_with_cuda_sources(build_py):
    def run(self):
        super().run()
        dest = Path(self.build_lib) / "zpp" / "quant" / "cuda_src"
        self.mkpath(str(dest))
        for src in sorted(_CUDA_DIR.glob("*.cu")):
            self.copy_file(str(src), str(dest / src.name))


setup(cmdclass={"build_py": build_py_with_cuda_sources})
