"""Build of the optional C++ host checks (bnbf/csrc/host_checks.cpp) with torch's own extension tooling.

Everything else is in pyproject.toml. The extension is built when torch is importable at build time (``pip
install --no-build-isolation``) and a C++ compiler works; otherwise the install goes on without it and bnbf uses
the pure-Python twins of the checks (same answers, more host time per step).
"""

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
    return {"ext_modules": [ext], "cmdclass": {"build_ext": BuildExtension}}


setup(**_extension())
