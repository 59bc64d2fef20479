"""Compile the step kernel for sm_90 on any machine (no GPU needed: Triton's bundled ptxas), for every
rule, state format and mode; prints the cubin size per variant. Rules whose norm pass can take gradient
clipping's total norm (``norm_grad_powers``) also compile that pass (CLIP 3); gradient clipping's grads-only
pass (``_grad_squares_kernel``) is compiled for each grad dtype and tile.

    python scripts/compile_check.py [--clip N] [--dump DIR] [rule ...]

``--clip N`` compiles every variant with CLIP N (0, the default: no gradient clipping; 1 or 2). ``--dump DIR``
writes each variant's TTIR and PTX without source locations, so that two trees' files can be compared with
``diff -r`` (a change to a kernel's other modes must leave CLIP 0's code as it was). ``--loads`` prints, for each
step variant, where ptxas put the loads that come before the first store in the whole-tile path (instruction
indices, from the bundled cuobjdump): the first tile's, then the next tile's prefetch. A prefetch spread over
hundreds of instructions went with a slower kernel on the H200 (benchmarks/results/2026-12-03_h200_session23.md).
Under the Triton the GPU has (3.6.0 there: ``pip install --target DIR triton==3.6.0``, DIR first on PYTHONPATH)
the SASS is the GPU's.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile

import torch
import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import bnbf  # noqa: E402
import bnbf.kernels.launcher as mt  # noqa: E402
from bnbf.kernels.step_kernel import FORMATS, HP_MAX, _grad_squares_kernel, _step_kernel  # noqa: E402
from bnbf.state import present_mask  # noqa: E402

_TORCH = {tl.float32: torch.float32, tl.bfloat16: torch.bfloat16, tl.float16: torch.float16}


def compile_variant(rule_name, fmt, dtype, mode, from_ptr, skip_zeros=False, clip=0):
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
        "clip_ptr": "*fp32" if clip in (1, 2) else "*i64",  # unused by CLIP 0 and 3
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
        CLIP=clip,
    )
    sig.update({k: "constexpr" for k in const})
    src = ASTSource(fn=_step_kernel, signature=sig, constexprs=const)
    options = {"num_warps": mt.NUM_WARPS, **mt._maxnreg(fmt, _TORCH[dtype])}
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)


def compile_squares(dtype, block, iters):
    """Gradient clipping's grads-only pass for grads of ``dtype``, tiles of ``block`` elements, ``iters`` a
    program (a 32-bit state group's address table: 4 head fields and 4 per slot of a 2-slot rule)."""
    sig = {"table_ptr": "*i64", "task_ptr": "*i32", "grad_ptr": "*i64", "part_ptr": "*fp32", "n_tiles": "i32"}
    const = dict(ROW=12, G_DTYPE=dtype, BLOCK=block, ITERS=iters)
    sig.update({k: "constexpr" for k in const})
    src = ASTSource(fn=_grad_squares_kernel, signature=sig, constexprs=const)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": mt.NUM_WARPS})


def _dump(dump, name, k):
    if dump:
        os.makedirs(dump, exist_ok=True)
        for kind in ("ttir", "ptx"):
            with open(os.path.join(dump, f"{name}.{kind}"), "w") as f:
                f.write(_without_locations(k.asm[kind], kind))


def _without_locations(text: str, kind: str) -> str:
    """TTIR or PTX without source locations (line numbers move with any edit of the file)."""
    if kind == "ttir":
        text = "\n".join(line for line in text.splitlines() if not line.startswith("#loc"))
        return re.sub(r" ?loc\([^)]*\)", "", text)
    text = text.split(".section\t.debug")[0]
    skip = (".loc", ".file", "$L__tmp", "$L__func")
    return re.sub(r"\$L__tmp\d+", "", "\n".join(x for x in text.splitlines() if not x.strip().startswith(skip)))


def early_loads(k) -> list[int]:
    """Instruction indices of the loads before the first store in the whole-tile path of the compiled kernel ``k``
    (the code after the branch to the partial tiles; the whole kernel where it has none)."""
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(k.asm["cubin"])
        f.flush()
        sass = subprocess.run([tool, "-sass", f.name], capture_output=True, text=True, check=True).stdout
    code = [m.groups() for m in re.finditer(r"/\*([0-9a-f]{4})\*/\s+([^;]*);", sass)]
    start = next((i for i, (_, ins) in enumerate(code) if re.search(r"@!?P\d BRA", ins)), 0)
    loads = []
    for at, ins in code[start:]:
        if "STG" in ins or "EXIT" in ins:
            break
        if "LDG" in ins:
            loads.append(int(at, 16) // 16)
    return loads


def main(rules, clip=0, dump=None, loads=False):
    for rule_name in rules:
        rule = bnbf.RULES[rule_name]
        modes = [(1, clip), (2, clip)] if rule.norms is not None else [(0, clip)]
        if rule.norm_grad_powers is not None and clip == 0:
            modes.append((1, 3))  # the norm pass of gradient clipping folded into it
        for fmt in ("power", "dynamic", "fp32"):
            for dtype in (tl.float32, tl.bfloat16):
                for mode, clip_mode in modes:
                    for from_ptr in (False, True):
                        k = compile_variant(rule_name, fmt, dtype, mode, from_ptr, clip=clip_mode)
                        name = f"{rule_name}_{fmt}_{dtype}_mode{mode}_ptr{int(from_ptr)}_clip{clip_mode}"
                        _dump(dump, name, k)
                        print(
                            f"{rule_name:9s} {fmt:7s} {str(dtype):9s} mode {mode} from_ptr {int(from_ptr)} "
                            f"CLIP {clip_mode}: {len(k.asm['cubin'])} B cubin, {k.metadata.shared} B shared"
                            + (f"; early loads at {early_loads(k)}" if loads else ""),
                            flush=True,
                        )
    for dtype in (tl.float32, tl.bfloat16, tl.float16):
        for block in (256, 64):
            iters = mt.ITERS["power"][_TORCH[dtype]]
            k = compile_squares(dtype, block, iters)
            _dump(dump, f"squares_{dtype}_block{block}_iters{iters}", k)
            print(f"squares   {str(dtype):9s} block {block} iters {iters}: {len(k.asm['cubin'])} B cubin", flush=True)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("rules", nargs="*", help="rule names (default: every registered rule)")
    parser.add_argument("--clip", type=int, default=0, choices=(0, 1, 2), help="the CLIP mode of every variant")
    parser.add_argument("--dump", help="write each variant's TTIR and PTX (no source locations) here")
    parser.add_argument("--loads", action="store_true", help="where the whole-tile path's first loads stand")
    args = parser.parse_args()
    main(args.rules or list(bnbf.RULES), args.clip, args.dump, args.loads)
