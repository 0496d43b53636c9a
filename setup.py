"""Build of kvoffload's optional native pieces (everything else is in pyproject.toml).

``kvoffload.worker._copy`` is a plain C library (a pool of copy threads, and the planner
that checks a job's pages and turns them into copies) that the CPU transfer backend loads
with ctypes. It is optional: without a C compiler the install still succeeds and the
backend copies page by page with ``ctypes.memmove`` from Python threads (slower once more
than one thread copies).

``kvoffload.blockfile._checksum`` is a C extension computing the lower tiers' block checksum
(XXH3-64) without the GIL, fused with the disk tier's reads and writes. It is optional
too: without it the same checksum comes from the ``xxhash`` package, with the same results
(``kvoffload.blockfile.checksum``).
"""

from setuptools import Extension, setup

setup(ext_modules=[Extension("kvoffload.worker._copy",
                             ["src/kvoffload/worker/_copy.c",
                              "src/kvoffload/worker/_copy_plan.c"],
                             depends=["src/kvoffload/worker/_copy.h"],
                             extra_compile_args=["-O2", "-pthread"],
                             extra_link_args=["-pthread"], optional=True),
                   Extension("kvoffload.blockfile._checksum", ["src/kvoffload/blockfile/_checksum.c"],
                             extra_compile_args=["-O3"], optional=True)])
