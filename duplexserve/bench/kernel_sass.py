"""The live-prefix ring kernels compiled for the H200 (sm_90) on any machine, their loop read
from the machine code: what a tile of the ring costs in instructions, before any GPU time.

Triton compiles for a target it is not running on; ``cuobjdump`` (shipped with Triton's NVIDIA
backend) prints the SASS. The kernel's main loop is the longest backward branch; a block inside
it that a forward branch can skip (the int8 kernel's rescale, taken only when the running
maximum moves) is counted apart, so ``common`` is what a tile usually executes. The arguments
carry the divisibility the runtime would find at run time (pointers and the ring's strides by
16 bytes), as Triton's JIT specializes them.
"""

from __future__ import annotations

import collections
import re
import subprocess
import tempfile
from collections.abc import Collection
from pathlib import Path
from typing import Any

# the arguments that are multiples of 16 (bytes, or elements) as the H200 runs had them (D 128, C 3000)
_BY_16 = {
    "Q", "K", "V", "K_SCALE", "V_SCALE", "LENGTHS", "PART_OUT", "PART_MAX", "PART_SUM", "TABLE",
    "stride_kb", "stride_kh", "stride_kc", "stride_vb", "stride_vh", "stride_vc", "stride_ksb", "stride_vsb",
}  # fmt: skip
_INSTRUCTION = re.compile(r"\s+/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;")
_TARGET = re.compile(r"BRA\s+(?:`\(\.L_x_\d+\)\s*)?(0x[0-9a-f]+)")


def compile_sm90(
    kernel: Any,
    types: list[str],
    constexprs: dict[str, Any],
    options: dict[str, Any],
    by_16: Collection[str] = (),
) -> Any:
    """``kernel`` compiled by Triton for sm_90 (H100, H200) on this machine, with a GPU or not:
    ``types`` the Triton types of its arguments but the ``constexprs``, in the kernel's order;
    the arguments named in ``by_16`` marked multiples of 16, as the JIT specializes them."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    names = [name for name in kernel.arg_names if name not in constexprs]  # the kernel's own order
    signature: dict[str, str] = dict(zip(names, types, strict=True))
    signature.update(dict.fromkeys(constexprs, "constexpr"))
    attrs = {(i,): [["tt.divisibility", 16]] for i, name in enumerate(names) if name in by_16}
    source = ASTSource(fn=kernel, signature=signature, constexprs=constexprs, attrs=attrs)
    return triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options)


def loop_counts(
    kv_dtype: str, config: Any, head_dim: int = 128, group: int = 16, paged: bool = False
) -> dict[str, Any]:
    """Registers, stack, shared memory and the main loop's instructions (all, the common path,
    the most frequent opcodes of it) of the tensor-core partials kernel for ``kv_dtype``, reading
    a ring or (``paged``) a page pool through a block table (paged_kv.py)."""
    import triton

    from duplexserve.engine_bridge.moshi import live_attention

    kernel = live_attention._partials_int8_mma if kv_dtype == "int8" else live_attention._partials_mma
    ring = "*i8" if kv_dtype == "int8" else "*bf16"
    constexprs = {"CHUNK": config.chunk, "BLOCK_N": config.block_n, "D": head_dim, "GROUP": group}
    constexprs["PAGED"] = paged
    # Q, K, V, the scales, LENGTHS, the partials, TABLE; its stride, 10 strides and 3 counts; the scale
    types = ["*bf16", ring, ring, "*bf16", "*bf16", "*i32", "*fp32", "*fp32", "*fp32", "*i32"]
    types += [*["i32"] * 14, "fp32"]
    options = {"num_warps": config.warps, "num_stages": config.stages}
    compiled = compile_sm90(kernel, types, constexprs, options, _BY_16)
    cuobjdump = str(Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as cubin:
        cubin.write(compiled.asm["cubin"])
        cubin.flush()
        usage, sass = (
            subprocess.run([cuobjdump, flag, cubin.name], capture_output=True, text=True, check=True).stdout
            for flag in ("-res-usage", "-sass")
        )
    code = [(int(m.group(1), 16), m.group(2)) for m in map(_INSTRUCTION.match, sass.splitlines()) if m]
    jumps = [(at, int(m.group(1), 16), text) for at, text in code if (m := _TARGET.search(text))]
    start, end = max(((to, at) for at, to, _ in jumps if to < at), key=lambda span: span[1] - span[0])
    body = [(at, text) for at, text in code if start <= at <= end]
    skipped = {
        at
        for branch, to, text in jumps
        if text.startswith("@") and start <= branch < to <= end
        for at, _ in body
        if branch < at < to
    }
    common = [text for at, text in body if at not in skipped]
    opcodes = collections.Counter(text.split()[text.startswith("@")].split(".")[0] for text in common)
    registers = re.search(r"REG:(\d+)", usage)
    stack = re.search(r"STACK:(\d+)", usage)
    return {
        "kv_dtype": kv_dtype,
        "kernel": str(config),
        "paged": paged,
        "registers": int(registers.group(1)) if registers else None,
        "stack_bytes": int(stack.group(1)) if stack else None,
        "shared_bytes": compiled.metadata.shared,
        "loop_instructions": len(body),
        "loop_common_path": len(common),
        "loop_skippable": len(skipped),
        "top_opcodes": opcodes.most_common(12),
    }
