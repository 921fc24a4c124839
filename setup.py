"""Setuptools shim: all metadata lives in pyproject.toml.

The CPU kernels (zpp/quant/csrc) are compiled at first use, per machine, so that they
may use the running processor's vector units; the CUDA kernels (cuda/) are compiled at
run time by cupy. Nothing is compiled at install time.
"""
from setuptools import setup

setup()
