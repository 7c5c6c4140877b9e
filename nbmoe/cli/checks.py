"""Flag values checked before a model loads, for both command-line tools.

A value no run can use is one line (`error: argument -t/--threads: ...`) and exit status 2,
as argparse reports a malformed one. Where llama.cpp goes on (more threads than Numba can
run, -ngl without a GPU) the engine warns and the tools print that as one `warning:` line.
"""
import argparse
import sys
import warnings


class Parser(argparse.ArgumentParser):
    """argparse with its errors on one line (no usage block), exit status 2."""

    def error(self, message):
        from nbmoe.cli.common import err_console
        err_console.print(f"[bold red]error:[/] {message} (see {self.prog} --help)")
        sys.exit(2)


def at_least(n):
    return lambda v: v >= n


def in_unit(v):
    return 0.0 <= v <= 1.0


# dest -> (test, what a good value is). A flag that a tool lacks is skipped.
RULES = {
    "ubatch_size": (at_least(1), "at least 1"),
    "threads": (at_least(1), "at least 1"),
    "n_gpu_layers": (at_least(0), "0 or more (99 = all)"),
    "n_cpu_moe": (at_least(0), "0 or more"),
    "zero_copy_experts": (lambda v: v == "auto" or v >= 0, "'auto' or 0 or more"),
    "run_time_repack": (lambda v: v in (0, 1), "0 or 1"),
    "fused_moe": (lambda v: v in (0, 1), "0 or 1"),
    "upload_all_experts": (lambda v: v in (0, 1), "0 or 1"),
    "merge_up_gate_experts": (lambda v: v in (0, 1), "0 or 1"),
    # chat
    "ctx_size": (at_least(0), "0 or more (0 = the model's training context)"),
    "n_predict": (lambda v: v == -1 or v >= 1, "at least 1, or -1 (until the context is full)"),
    "temp": (at_least(0.0), "0 or more (0 = greedy)"),
    "top_k": (at_least(0), "0 or more (0 = off)"),
    "top_p": (in_unit, "between 0 and 1 (1 = off)"),
    "min_p": (in_unit, "between 0 and 1 (0 = off)"),
    "repeat_penalty": (lambda v: v > 0, "above 0 (1 = off)"),
    "seed": (at_least(-1), "0 or more, or -1 (random)"),
    # bench
    "n_prompt": (at_least(0), "0 or more (0 = no prompt test)"),
    "n_gen": (at_least(0), "0 or more (0 = no generation test)"),
    "n_depth": (at_least(0), "0 or more (0 = an empty cache)"),
    "repetitions": (at_least(1), "at least 1"),
    "batch_size": (at_least(1), "at least 1"),
}


def check_values(parser, values):
    """values: {dest: value or list of values}; the first bad one ends the program."""
    flags = {a.dest: "/".join(a.option_strings) for a in parser._actions}
    for dest, value in values.items():
        if dest not in RULES or value is None:
            continue
        ok, want = RULES[dest]
        for v in value if isinstance(value, list) else [value]:
            if not ok(v):
                parser.error(f"argument {flags.get(dest, dest)}: must be {want}, got {v}")


def int_list_arg(parser, dest, text):
    """A comma list of integers from a flag's text (bench), or a one-line error."""
    try:
        values = [int(v) for v in str(text).split(",") if v.strip() != ""]
    except ValueError:
        values = []
    if not values:
        flag = next("/".join(a.option_strings) for a in parser._actions if a.dest == dest)
        parser.error(f"argument {flag}: expected a comma list of integers, got {text!r}")
    return values


def one_line_warnings():
    """Show warnings (the engine's: threads, -ngl without a GPU) as one `warning:` line each."""
    from nbmoe.cli.common import err_console

    def show(message, category, filename, lineno, file=None, line=None):
        err_console.print(f"[bold yellow]warning:[/] {message}")

    warnings.showwarning = show


def check_threads(parser, threads):
    """Threads as the engine will run them: a count above Numba's pool warns and uses the
    pool (llama.cpp also accepts more threads than cores); below 1 is an error."""
    if threads is None:
        return None
    check_values(parser, {"threads": threads})
    from nbmoe.engine import usable_threads
    out = []
    for t in threads if isinstance(threads, list) else [threads]:
        t = usable_threads(t)
        if t not in out:
            out.append(t)
    return out if isinstance(threads, list) else out[0]
