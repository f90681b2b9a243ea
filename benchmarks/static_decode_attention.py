"""The decode attention kernels compiled for sm_90 without a GPU (Triton's compiler and ptxas only), at
Llama-3.1-8B's shapes over an fp8 pool: registers a thread, spills, shared memory, the programs a
multiprocessor that leaves (an estimate: 64K registers, 227 KB of shared memory, 64 warps), and the
SASS instructions of the main loop, in warp instructions per (token, KV head). A static count, not a timing: it
says which launch shapes fit, what maxnreg costs inside the loop, and whether the code compiles.

    TRITON_INTERPRET= python benchmarks/static_decode_attention.py [--launches 64:4:2:0:80,32:4:2:4:96] [--kv bf16]

Launches as `bench_decode_attention.py --launches`: BLOCK_N:warps:stages:kv_heads:maxnreg (kv_heads 0:
the one-head kernel, maxnreg 0: unbounded). Integer arguments and pointers are specialized as the JIT
does for these shapes (divisible by 16)."""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import tempfile
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from minisgl.kernels.triton.attention import _decode_kernel
from minisgl.kernels.triton.decode.packed import _decode_packed_kernel

DIV16 = {
    "stride_qb",
    "stride_qh",
    "stride_kn",
    "stride_vn",
    "stride_cs",
    "stride_ch",
    "stride_pt",
    "stride_rope",
}
DIV16 |= {"stride_vp"}
BIN = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"


def _signature(kernel, consts: dict, kv: str, qd: str) -> dict[str, str]:
    types = {"Q": qd, "KCache": kv, "VCache": kv, "KNew": qd, "VNew": qd, "Cos": qd, "Sin": qd, "Out": qd}
    types |= {"QW": qd, "KW": qd}
    types |= {"PageTable": "i32", "SeqLens": "i32", "NewSlots": "i32", "Done": "i32"}
    types |= {"KScale": "fp32", "VScale": "fp32", "Partial": "fp32", "Lse": "fp32"}
    sig = {}
    for name in kernel.arg_names:
        if name in consts:
            sig[name] = "constexpr"
        elif name in types:
            sig[name] = "*" + types[name]
        else:
            sig[name] = "fp32" if name in ("sm_scale", "eps") else "i32"
    return sig


def compile_one(launch: tuple[int, ...], kv: str) -> str:
    block_n, warps, stages, heads, maxnreg = (*launch, 0, 0)[:5]
    quant = kv == "fp8e4nv"
    common = dict(D=128, BLOCK_D=128, PS=16, BLOCK_N=block_n, NUM_SPLITS=1, HAS_NEW=True, ROPE=True, QUANT=quant,
                  KV_F16=quant, V_T=quant, IEEE=False, PDL=True, BLOCK_S=1, HEADS_FIRST=True, GROUP=4)  # fmt: skip
    if heads:
        kernel = _decode_packed_kernel
        consts = dict(common, HKV=8, HEADS=heads, BLOCK_M=max(16, triton.next_power_of_2(4 * heads)))
    else:
        kernel = _decode_kernel
        consts = dict(common, BLOCK_H=16, BLOCK_HALF=64, PEEL=False, BLOCK_G=4, LAZY=0.0, QK_NORM=False)
    sig = _signature(kernel, consts, kv, "bf16")
    attrs = {
        (i,): [["tt.divisibility", 16]]
        for i, n in enumerate(kernel.arg_names)
        if n not in consts and (sig[n].startswith("*") or n in DIV16)
    }
    opts = dict(num_warps=warps, num_stages=stages, **({"maxnreg": maxnreg} if maxnreg else {}))
    k = triton.compile(ASTSource(kernel, sig, consts, attrs), target=GPUTarget("cuda", 90, 32), options=opts)
    with tempfile.TemporaryDirectory() as tmp:
        cubin = Path(tmp) / "k.cubin"
        cubin.write_bytes(k.asm["cubin"])
        res = subprocess.run([BIN / "cuobjdump", "-res-usage", cubin], capture_output=True, text=True).stdout
        sass = subprocess.run([BIN / "cuobjdump", "-sass", cubin], capture_output=True, text=True).stdout
    regs = int(re.search(r"REG:(\d+)", res).group(1))
    stack = int(re.search(r"STACK:(\d+)", res).group(1))
    per_warp = -(-(-(-regs // 8) * 8) * 32 // 256) * 256
    programs = min(65536 // (per_warp * warps), 232448 // (k.metadata.shared + 1024), 64 // warps)
    body = _loop(sass)
    ops: dict[str, int] = {}
    for text in body:
        op = re.sub(r"^@!?U?P\w+\s+", "", text).split()[0].split(".")[0]
        ops[op] = ops.get(op, 0) + 1
    per = len(body) * warps / (block_n * max(1, heads))
    top = ", ".join(f"{o} {n}" for o, n in sorted(ops.items(), key=lambda x: -x[1])[:8])
    return (
        f"{':'.join(map(str, launch)):>14}: {regs} registers, stack {stack} B, shared {k.metadata.shared} B, "
        f"{programs} programs ({programs * warps} warps) a multiprocessor; loop {len(body)} instructions "
        f"({ops.get('LDL', 0)} LDL), {per:.1f} warp instructions a (token, KV head); {top}"
    )


def _loop(sass: str) -> list[str]:
    """The instructions of the longest backward branch's body (the loop over the positions)."""
    ins = [
        (int(m.group(1), 16), m.group(2).strip())
        for m in re.finditer(r"/\*([0-9a-f]{4,})\*/\s+(.*?);", sass)
    ]  # fmt: skip
    best = (0, -1)
    for addr, text in ins:
        m = re.search(r"BRA.*?0x([0-9a-f]+)", text)
        if m and int(m.group(1), 16) < addr and addr - int(m.group(1), 16) > best[1] - best[0]:
            best = (int(m.group(1), 16), addr)
    return [t for a, t in ins if best[0] <= a <= best[1]]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--launches", default="64:4:2:0:0,64:4:2:0:80,64:8:2:0:64,32:4:2:4:0,32:4:2:4:96,64:4:2:2:128"
    )
    ap.add_argument("--kv", choices=["fp8", "bf16"], default="fp8")
    ns = ap.parse_args()
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        raise SystemExit("run without TRITON_INTERPRET: this compiles the kernels")
    for spec in ns.launches.split(","):
        print(
            compile_one(tuple(int(v) for v in spec.split(":")), "fp8e4nv" if ns.kv == "fp8" else "bf16"),
            flush=True,
        )


if __name__ == "__main__":
    main()
