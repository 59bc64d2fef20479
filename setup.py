"""Build of the optional C++ extensions with torch's own extension tooling: the host checks
(bnbf/csrc/host_checks.cpp) and the CPU step's 8-bit codec (bnbf/csrc/cpu_codec.cpp).

Everything else is in pyproject.toml. The extensions are built when torch is importable at build time (``pip
install --no-build-isolation``) and a C++ compiler works; otherwise the install goes on without them and bnbf
uses their pure-Python twins (same answers and bits, more time per step).
"""

import sys

from setuptools import setup


def _extension() -> dict:
    try:
        import torch
        from torch.utils.cpp_extension import BuildExtension, CppExtension
    except ImportError:  # pip's isolated build environment has no torch: the Python checks serve
        return {}
    # the torch it was built against: bnbf loads it only under that very torch (its C++ ABI is not stable)
    version = [("BNBF_TORCH_VERSION", f'"{torch.__version__}"')]
    ext = CppExtension(
        "bnbf._host_checks_native",
        ["bnbf/csrc/host_checks.cpp"],
        extra_compile_args=["-O2"],
        define_macros=version,
        optional=True,
    )  # a failed compile leaves the install without it
    # the codec's bits must be torch's float32 ops': no fused multiply-add, no -ffast-math (errno and traps are
    # not part of a result; without them the loops vectorize); OpenMP, the runtime torch itself uses, for
    # at::parallel_for
    omp = ["-fopenmp"] if sys.platform.startswith("linux") and torch.backends.openmp.is_available() else []
    codec = CppExtension(
        "bnbf._cpu_codec_native",
        ["bnbf/csrc/cpu_codec.cpp"],
        extra_compile_args=["-O3", "-ffp-contract=off", "-fno-math-errno", "-fno-trapping-math", *omp],
        extra_link_args=omp,
        define_macros=version,
        optional=True,
    )
    return {"ext_modules": [ext, codec], "cmdclass": {"build_ext": BuildExtension}}


setup(**_extension())
