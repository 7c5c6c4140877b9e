"""llvm-mca on the hottest loop of a compiled kernel: cycles per iteration on the VM's core.

    NBMOE_CACHE=$(mktemp -d) python tools/mca_loop.py nbmoe.cpu.quants_k_i8:dot_rows_q4_k_i8 ... \
        --setup "import sys; sys.path.insert(0, 'tools'); import bench_rtr_l2; bench_rtr_l2.main([...])"

Calls `inspect_asm` on every signature the kernel was compiled for (so run it in a fresh
kernel cache: functions loaded from the on-disk cache have no assembly), picks the loop
(a label and a jump back to it) with the most `vpdpbusd` (else the most vector
instructions; the innermost of equals) and feeds its body to `llvm-mca`, printing the summary: Block RThroughput is
the bound from the ports, "Total Cycles / Iterations" the simulated cycles an iteration.
The kernel must have run once before (the caller does: --setup 'python code').
"""
import argparse
import importlib
import re
import subprocess


def loops(asm, fn):
    """(label, body lines) of every backward jump's loop in the AT&T listing, within the
    functions whose symbol holds fn (the kernel itself, not the kernels linked into it)."""
    lines = asm.splitlines()
    where, out, inside = {}, [], False
    for i, ln in enumerate(lines):
        m = re.match(r"^([\w.$]+):", ln)
        if m and not m.group(1).startswith(".L"):
            inside = fn in m.group(1)
        m = re.match(r"^(\.?L\w+):", ln.strip())
        if m:
            where[m.group(1)] = i
        m = re.match(r"^\s*j\w+\s+(\.?L\w+)", ln)
        if inside and m and m.group(1) in where and where[m.group(1)] < i:
            body = [x for x in lines[where[m.group(1)] + 1:i + 1]
                    if x.strip() and not x.strip().startswith((".", "#"))]
            if not any("call" in x for x in body):     # a hot loop calls nothing
                out.append((m.group(1), body))
    return out


def score(body):
    """Most vpdpbusd, else most 512-bit instructions; of loops with as many, the innermost."""
    dp = sum("vpdpbusd" in x for x in body)
    return (dp, sum("zmm" in x for x in body) if not dp else 0, -len(body))


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("kernels", nargs="+", help="module:function")
    p.add_argument("--setup", default="", help="python code run first (compiles the kernel)")
    p.add_argument("--mcpu", default="cascadelake")
    p.add_argument("--show", action="store_true", help="print the loop body")
    a = p.parse_args()
    exec(a.setup, {})
    for kernel in a.kernels:
        report(kernel, a)


def report(kernel, a):
    mod, fn = kernel.split(":")
    disp = getattr(importlib.import_module(mod), fn)
    best = None
    for sig in disp.signatures:
        asm = disp.inspect_asm(sig)
        for label, body in loops(asm, fn):
            if best is None or score(body) > score(best[1]):
                best = label, body
    if best is None:
        print(f"{kernel}: no assembly (loaded from the kernel cache?)")
        return
    label, body = best
    if a.show:
        print("\n".join(body))
    r = subprocess.run(["llvm-mca", f"-mcpu={a.mcpu}", "-iterations=200"], input="\n".join(body[:-1]) + "\n",
                       capture_output=True, text=True)
    stats = dict(re.findall(r"^(Total Cycles|Iterations|Block RThroughput|Total uOps):\s+([\d.]+)", r.stdout, re.M))
    cycles = float(stats["Total Cycles"]) / float(stats["Iterations"])
    print(f"{kernel} loop {label}: {len(body)} instructions, {score(body)[0]} vpdpbusd, "
          f"{cycles:.1f} cycles an iteration (ports bound {stats['Block RThroughput']}), "
          f"{float(stats['Total uOps']) / float(stats['Iterations']):.0f} uops")

if __name__ == "__main__":
    main()
