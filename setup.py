"""The one compiled part: ckptfix.core._scan (ckptfix/core/_scan.c), the NaN/Inf check fused into the copy.

Optional: where no C compiler is, the install goes on without it and ckptfix checks with numpy
(ckptfix/core/tensorcopy.py). Everything else is declared in pyproject.toml.
"""

from setuptools import Extension, setup

setup(ext_modules=[Extension("ckptfix.core._scan", ["ckptfix/core/_scan.c"], optional=True)])
