"""llvm-mca on the hottest loop of a compiled kernel: cycles per iteration on the VM's core.

    NBMOE_CACHE=$(mktemp -d) python tools/mca_loop.py nbmoe.cpu.quants_k_i8:dot_rows_q4_k_i8 [-n 0] [--mcpu cascadelake]

Calls `inspect_asm` on every signature the kernel was compiled for (so run it in a fresh
kernel cache: functions loaded from the on-disk cache have no assembly), picks the loop
(a label and the last jump back to it) with the most `vpdpbusd` (else the most vector
instructions) and feeds its body to `llvm-mca`, printing the summary: Block RThroughput is
the bound from the ports, "Total Cycles / Iterations" the simulated cycles an iteration.
The kernel must have run once before (the caller does: --setup 'python code').
"""
import argparse
import importlib
import re
import subprocess


def loops(asm):
    """(label, body lines) of every backward jump's loop in the AT&T listing."""
    lines = asm.splitlines()
    where = {}
    out = []
    for i, ln in enumerate(lines):
        m = re.match(r"^(\.?L\w+):", ln.strip())
        if m:
            where[m.group(1)] = i
        m = re.match(r"^\s*j\w+\s+(\.?L\w+)", ln)
        if m and m.group(1) in where and where[m.group(1)] < i:
            body = [x for x in lines[where[m.group(1)] + 1:i + 1]
                    if x.strip() and not x.strip().startswith((".", "#"))]
            out.append((m.group(1), body))
    return out


def score(body):
    dp = sum("vpdpbusd" in x for x in body)
    return (dp, sum("zmm" in x for x in body))


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("kernel", help="module:function")
    p.add_argument("--setup", default="", help="python code run first (compiles the kernel)")
    p.add_argument("--mcpu", default="cascadelake")
    p.add_argument("--show", action="store_true", help="print the loop body")
    a = p.parse_args()
    mod, fn = a.kernel.split(":")
    exec(a.setup, {})
    disp = getattr(importlib.import_module(mod), fn)
    best = None
    for sig in disp.signatures:
        asm = disp.inspect_asm(sig)
        for label, body in loops(asm):
            if best is None or score(body) > score(best[1]):
                best = label, body
    label, body = best
    if a.show:
        print("\n".join(body))
    r = subprocess.run(["llvm-mca", f"-mcpu={a.mcpu}", "-iterations=200"], input="\n".join(body[:-1]) + "\n",
                       capture_output=True, text=True)
    head = r.stdout.split("\n\n")[0] + "\n" + "\n".join(
        ln for ln in r.stdout.splitlines() if "RThroughput" in ln or "uOps Per Cycle" in ln)
    print(f"{a.kernel} loop {label}: {len(body)} instructions, {score(body)[0]} vpdpbusd")
    print(head)
    print(r.stdout.split("Resource pressure per iteration:")[1].split("\n\n")[0] if "Resource pressure per iteration:" in r.stdout else "")


if __name__ == "__main__":
    main()
