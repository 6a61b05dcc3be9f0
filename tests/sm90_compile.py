"""Compile attngraph's Triton kernels for Hopper (sm_90) on a machine without a GPU.

Triton lowers a kernel to PTX with its own LLVM and assembles it with the ptxas it ships, as its
launcher would on an H100 / H200; no driver is needed. The tests use it to check what only the
GPU would otherwise show: that inline PTX assembles, where instructions sit relative to
``griddepcontrol.wait``, and that a kernel spills nothing to local memory.

Run in a process without ``TRITON_INTERPRET`` (the interpreter replaces ``@triton.jit``
functions, which then cannot compile): ``python tests/sm90_compile.py SPEC_JSON`` prints one
JSON object per spec. A spec: ``{"kernel": "module:name", "types": {arg: "*bf16" | "fp32" |
...}, "constexprs": {arg: value}, "options": {"num_warps": 4, ...}, "divisible": [arg, ...]}``;
arguments in neither map are ``i32``; pointers and the ``divisible`` integers are taken as
multiples of 16.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import json
import os
import re
import subprocess
import sys
import tempfile


def compile_sm90(kernel, types: dict, constexprs: dict, options: dict, divisible: list | None = None) -> dict:
    """``kernel`` compiled for sm_90: ``{"ptx": str, "regs": int, "local_bytes": int}``
    (registers per thread and local memory per thread, from the cubin's resource usage).
    Pointers and the integer arguments named in ``divisible`` are specialized as multiples of
    16 (bytes; elements for integers), as Triton's launcher specializes them when they are."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    params = list(inspect.signature(kernel.fn).parameters)
    signature = {p: "constexpr" if p in constexprs else types.get(p, "i32") for p in params}
    divisible = (set(divisible or ()) & set(params)) | {p for p, t in signature.items() if t.startswith("*")}
    attrs = {(params.index(p),): [["tt.divisibility", 16]] for p in divisible}
    src = ASTSource(fn=kernel, signature=signature, constexprs={(params.index(k),): v for k, v in constexprs.items()},
                    attrs=attrs)  # fmt: skip
    compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)
    tools = os.path.join(os.path.dirname(importlib.import_module("triton.backends.nvidia").__file__), "bin")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        usage = subprocess.run([os.path.join(tools, "cuobjdump"), "-res-usage", f.name], capture_output=True, text=True,
                               check=True).stdout  # fmt: skip
    regs = re.search(r"REG:(\d+)", usage)
    local = re.search(r"LOCAL:(\d+)", usage)
    return {"ptx": compiled.asm["ptx"], "regs": int(regs.group(1)), "local_bytes": int(local.group(1))}


def ptxas_missing() -> str | None:
    """Why kernels cannot be compiled for sm_90 here (None: they can)."""
    spec = importlib.util.find_spec("triton.backends.nvidia")
    if spec is None or spec.origin is None:
        return "Triton without its NVIDIA backend"
    tools = os.path.join(os.path.dirname(spec.origin), "bin")
    missing = [t for t in ("ptxas", "cuobjdump") if not os.path.exists(os.path.join(tools, t))]
    return f"Triton ships no {', '.join(missing)}" if missing else None


def compile_in_child(specs: list[dict]) -> list[dict]:
    """`compile_sm90` of each spec in a child process without Triton's interpreter (the
    caller may run under it); raises with the child's error output when one fails."""
    here = os.path.dirname(os.path.abspath(__file__))
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (os.path.dirname(here), env.get("PYTHONPATH")) if p)
    run = subprocess.run([sys.executable, os.path.join(here, "sm90_compile.py"), json.dumps(specs)], capture_output=True,
                         text=True, env=env, timeout=600)  # fmt: skip
    if run.returncode != 0:
        raise RuntimeError(f"compiling for sm_90 failed:\n{run.stderr[-3000:]}")
    lines = [json.loads(line) for line in run.stdout.splitlines() if line.startswith("{")]
    if len(lines) != len(specs):
        raise RuntimeError(f"compiled {len(lines)} of {len(specs)} kernels:\n{run.stdout[-2000:]}")
    return lines


def main(specs: list[dict]) -> None:
    for spec in specs:
        module, name = spec["kernel"].split(":")
        kernel = getattr(importlib.import_module(module), name)
        print(json.dumps(compile_sm90(kernel, spec.get("types", {}), spec.get("constexprs", {}), spec.get("options", {}),
                                      spec.get("divisible"))))  # fmt: skip


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
