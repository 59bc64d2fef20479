"""Compile the step kernel for sm_90 on any machine (no GPU needed: Triton's bundled ptxas), for every
rule, state format and mode; prints the cubin size per variant.

    python scripts/compile_check.py [rule ...]
"""

from __future__ import annotations

import os
import sys

import torch
import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import bnbf  # noqa: E402
import bnbf.kernels.launcher as mt  # noqa: E402
from bnbf.kernels.step_kernel import FORMATS, HP_MAX, _step_kernel  # noqa: E402
from bnbf.state import present_mask  # noqa: E402

_TORCH = {tl.float32: torch.float32, tl.bfloat16: torch.bfloat16}


def compile_variant(rule_name, fmt, dtype, mode, from_ptr, skip_zeros=False):
    rule = bnbf.RULES[rule_name]
    present = present_mask(rule, rule.make_hparams({}))  # the default hyperparameters' slots
    n_hp = len(rule.scalars(rule.make_hparams({}), 1)) + 4  # the rule's scalars, then the four the step adds
    sig = {
        "table_ptr": "*i64",
        "task_ptr": "*i32",
        "grad_ptr": "*i64",
        "hp_ptr": "*fp32",
        "code_ptr": "*fp32",
        "norm_ptr": "*fp32",
        "n_tiles": "i32",
        **{f"h{i}": "fp32" for i in range(HP_MAX)},
        "clip_ptr": "*i64",  # gradient clipping off (CLIP 0): unused
        "clip_max": "fp32",
    }
    norm_terms = rule.norms[0] if rule.norms is not None else None
    const = dict(
        HP_FROM_PTR=from_ptr,
        HP_PER_TENSOR=False,
        FIRST_BLOCK=False,
        MATH=rule.math,
        SLOTS=len(rule.states),
        PRESENT=present,
        SIGNED=rule.signed_mask,
        QUANT=fmt != "fp32",
        P_DTYPE=dtype,
        HP_STRIDE=n_hp,
        BLOCK=256,
        ROWS=mt.ROWS,
        SOFT_BF16=False,
        FORMAT=FORMATS[fmt],
        ALIGNED=True,
        VEC=mt.VEC[fmt],
        ITERS=mt.ITERS[fmt][_TORCH[dtype]],
        PREFETCH=mt._prefetch(fmt, _TORCH[dtype], present, mode),
        SKIP_ZEROS=skip_zeros,
        NORM_MODE=mode,
        NORM_TERMS=norm_terms,
        SUM_SPLIT=mt.SUM_SPLIT,
        CLIP=0,
    )
    sig.update({k: "constexpr" for k in const})
    src = ASTSource(fn=_step_kernel, signature=sig, constexprs=const)
    options = {"num_warps": mt.NUM_WARPS, **mt._maxnreg(fmt, _TORCH[dtype])}
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)


def main(rules):
    for rule_name in rules:
        modes = (1, 2) if bnbf.RULES[rule_name].norms is not None else (0,)
        for fmt in ("power", "dynamic", "fp32"):
            for dtype in (tl.float32, tl.bfloat16):
                for mode in modes:
                    for from_ptr in (False, True):
                        k = compile_variant(rule_name, fmt, dtype, mode, from_ptr)
                        print(
                            f"{rule_name:9s} {fmt:7s} {str(dtype):9s} mode {mode} from_ptr {int(from_ptr)}: "
                            f"{len(k.asm['cubin'])} B cubin, {k.metadata.shared} B shared",
                            flush=True,
                        )


if __name__ == "__main__":
    main(sys.argv[1:] or list(bnbf.RULES))
