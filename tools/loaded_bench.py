"""nbmoe's bench (and llama.cpp's llama-bench) on an idle and on a loaded machine, alternated.

    python tools/loaded_bench.py -r 4 -b 7 --llama-bench /path/to/llama-bench \\
        -c before:GOMP_SPINCOUNT=300000 -c after: -l llama.cpp: -l llama.cpp-passive:OMP_WAIT_POLICY=PASSIVE
    python tools/loaded_bench.py --phases idle --nice -20 ...     # as root: close to an idle machine

Each round runs every configuration (-c NAME:VAR=VALUE,...: nbmoe's bench in a fresh process
with those environment variables; -l: llama-bench likewise) once alone and once beside -b
CPU-burning processes, in a rotated order, so the machine's other load falls on all alike.
"before" sets libgomp's own default spin count, which keeps nbmoe from choosing the wait
policy (a user's setting wins): nbmoe as it ran before it chose one. The burners are plain
Python `while` loops, each bounded by --burn-limit seconds and stopped at the end of every
loaded phase. Prints, per test and thread count, the median t/s over the rounds, and the
load: runnable tasks sampled during the runs and the 1-minute load average at their ends
(medians); --json keeps every run.
"""
import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import threading
import time

BURNER = "import time\nend = time.time() + {limit}\nwhile time.time() < end:\n    pass\n"


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("-m", "--model", default=None, help="GGUF (default: nbmoe's default model)")
    p.add_argument("-c", "--config", action="append", default=None,
                   help="NAME:VAR=VALUE,... environment of one nbmoe configuration (repeatable; "
                        "default: before:GOMP_SPINCOUNT=300000 and after:)")
    p.add_argument("--llama-bench", default=None, help="llama-bench binary for the -l configurations")
    p.add_argument("-l", "--llama-config", action="append", default=None,
                   help="NAME:VAR=VALUE,... environment of one llama-bench configuration "
                        "(repeatable; default with --llama-bench: llama.cpp:)")
    p.add_argument("-t", "--threads", default="1,2", help="thread counts (comma list)")
    p.add_argument("-p", "--n-prompt", default="64", help="prompt length")
    p.add_argument("-n", "--n-gen", default="32", help="tokens to generate")
    p.add_argument("--reps", type=int, default=2, help="repetitions inside each bench run")
    p.add_argument("-r", "--rounds", type=int, default=3, help="rounds (each: every configuration idle and loaded)")
    p.add_argument("-b", "--burners", type=int, default=7, help="CPU-burning processes in the loaded phase")
    p.add_argument("--phases", default="idle,loaded", help="which phases to run (comma list)")
    p.add_argument("--nice", type=int, default=0,
                   help="niceness of the bench runs (-20 as root: the machine's other load "
                        "barely reaches them, close to an idle machine)")
    p.add_argument("--burn-limit", type=float, default=1800, help="seconds after which a burner stops itself")
    p.add_argument("--run-timeout", type=float, default=900, help="seconds one bench run may take")
    p.add_argument("--json", default=None, help="write every run's results here")
    p.add_argument("--table", default=None, metavar="JSON", help="only print the table of a --json file")
    args = p.parse_args(argv)
    args.configs = [parse_config(c) + (False,)
                    for c in (args.config or ["before:GOMP_SPINCOUNT=300000", "after:"])]
    if args.llama_bench:
        args.configs += [parse_config(c) + (True,) for c in (args.llama_config or ["llama.cpp:"])]
    return args


def parse_config(text):
    name, _, assigns = text.partition(":")
    env = dict(a.split("=", 1) for a in assigns.split(",") if a.strip())
    return name, env


def bench_command(args, llama, model):
    common = ["-m", model, "-t", args.threads, "-p", args.n_prompt, "-n", args.n_gen,
              "-r", str(args.reps), "-o", "json"]
    if llama:
        return [args.llama_bench] + common
    return [sys.executable, "-m", "nbmoe.bench", "--no-bandwidth"] + common


def run_once(args, name, config_env, llama, model):
    """One bench run: [(test, threads, t/s)], and the machine's load while it ran: the median
    count of runnable tasks (the bench's own threads and the burners included)."""
    env = dict(os.environ)
    # the compared variables start unset, so each configuration is exactly what it names
    for var in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "NUMBA_THREADING_LAYER"):
        env.pop(var, None)
    env.update(config_env)
    cmd = bench_command(args, llama, model)
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=(lambda: os.nice(args.nice)) if args.nice else None)
    samples, done = [], threading.Event()

    def sample():
        while not done.wait(0.25):
            samples.append(runnable_tasks())

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        text, err = proc.communicate(timeout=args.run_timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        print(f"  {name}: timed out after {args.run_timeout:.0f} s", file=sys.stderr)
        text, err = "", ""
    finally:
        done.set()
        sampler.join()
    load = statistics.median(samples) if samples else float("nan")
    try:
        rows = json.loads(text[text.index("["):])
    except ValueError:
        if text or err:
            print(f"  {name}: no JSON (rc {proc.returncode}): {err[-500:]}", file=sys.stderr)
        return [], load
    results = []
    for r in rows:
        test = f"pp{r['n_prompt']}" if r["n_prompt"] else f"tg{r['n_gen']}"
        results.append((test, int(r["n_threads"]), float(r["avg_ts"])))
    return results, load


def runnable_tasks():
    with open("/proc/stat") as f:
        for line in f:
            if line.startswith("procs_running"):
                return int(line.split()[1]) - 1     # not counting the thread that reads
    return 0


def start_burners(n, limit):
    code = BURNER.format(limit=limit)
    return [subprocess.Popen([sys.executable, "-c", code]) for _ in range(n)]


def stop_burners(procs):
    for p in procs:
        p.kill()
    for p in procs:
        p.wait()


def main(argv=None):
    args = parse_args(argv)
    # a kill ends the script through its finally blocks, which stop the burners
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    if args.table:
        with open(args.table) as f:
            runs = [tuple(r.values()) for r in json.load(f)]
        print_table(runs, list(dict.fromkeys(r[2] for r in runs)))
        return
    model = args.model
    if model is None:
        from nbmoe.loader.default_model import default_model_path
        model = str(default_model_path())
    runs = []   # (round, phase, config, test, threads, t/s, runnable tasks, 1-minute load average)
    for rnd in range(args.rounds):
        k = rnd % len(args.configs)
        order = args.configs[k:] + args.configs[:k]
        phases = args.phases.split(",")[::1 if rnd % 2 == 0 else -1]
        for phase in phases:
            burners = start_burners(args.burners, args.burn_limit) if phase == "loaded" else []
            try:
                if burners:
                    time.sleep(2)   # let the burners reach the run queue
                for name, env, llama in order:
                    results, load = run_once(args, name, env, llama, model)
                    for test, threads, ts in results:
                        runs.append((rnd, phase, name, test, threads, ts, load, load_average()))
                    save(args.json, runs)
                    shown = ", ".join(f"{t} t{n} {v:.1f}" for t, n, v in results)
                    print(f"round {rnd} {phase:6s} {name:10s} runnable {load:4.1f}: {shown}", file=sys.stderr)
            finally:
                stop_burners(burners)
    print_table(runs, [name for name, _, _ in args.configs])


def save(path, runs):
    """Every run so far, rewritten after each (a stopped script keeps what it measured)."""
    if path:
        with open(path, "w") as f:
            json.dump([dict(zip(("round", "phase", "config", "test", "threads", "ts", "runnable",
                                 "loadavg"), r)) for r in runs], f, indent=1)


def print_table(runs, names):
    """Median t/s per (test, threads) row and (phase, configuration) column."""
    phases = [ph for ph in ("idle", "loaded") if any(r[1] == ph for r in runs)]
    cols = [(ph, n) for ph in phases for n in names]
    keys = sorted({(r[3], r[4]) for r in runs}, key=lambda k: (k[0][:2] != "pp", k[0], k[1]))
    print("| test | threads | " + " | ".join(f"{n} {ph}" for ph, n in cols) + " |")
    print("|---|---:|" + "---:|" * len(cols))
    for test, threads in keys:
        cells = []
        for ph, n in cols:
            v = [r[5] for r in runs if (r[1], r[2], r[3], r[4]) == (ph, n, test, threads)]
            cells.append(f"{statistics.median(v):.2f}" if v else "-")
        print(f"| {test} | {threads} | " + " | ".join(cells) + " |")
    for ph in ("idle", "loaded"):
        runnable = [r[6] for r in runs if r[1] == ph]
        la = [r[7] for r in runs if r[1] == ph]
        if la:
            print(f"\n{ph}: runnable tasks during the runs, median {statistics.median(runnable):.1f} "
                  f"(on {os.cpu_count()} cores); 1-minute load average at their ends, median "
                  f"{statistics.median(la):.1f} (min {min(la):.1f}, max {max(la):.1f})")


def load_average():
    with open("/proc/loadavg") as f:
        return float(f.read().split()[0])


if __name__ == "__main__":
    main()
