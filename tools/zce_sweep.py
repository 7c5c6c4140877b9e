"""Which -zce suits this machine: decode speed for several GPU shares, alternated in one run.

    python tools/zce_sweep.py -m model.gguf -ngl 99 -ot exps=CPU -t 16 --zce 0,1,2,3,4,auto

Loads the model once per value (all loads share the page cache and the locked mapping),
then decodes --tokens tokens with each in turn, --rounds times, so that the RAM bandwidth's
swings (minutes long on some machines) hit every value alike. Prints per value the median
tokens/s, the RAM GB/s it implies (expert bytes read per token from RAM, by the CPU and over
PCIe together) and its share of the streaming read measured in the same run.
"""
import argparse
import sys

import numpy as np


def main(argv=None):
    import nbmoe
    from nbmoe.cli.bench import model_facts, run_tg
    from nbmoe.cli.common import add_placement_args, placement_kwargs
    from nbmoe.cpu.membw import read_bandwidth
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-m", "--model", required=True)
    ap.add_argument("-t", "--threads", type=int, default=None)
    ap.add_argument("--zce", default="0,1,2,3,4,auto", help="GPU shares to compare (comma list)")
    ap.add_argument("--tokens", type=int, default=32, help="decode tokens a round")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--read-mb", type=int, default=0,
                    help="buffer of the streaming-read measurement (0: membw.default_read_bytes)")
    add_placement_args(ap)
    a = ap.parse_args(argv)
    values = [v if v == "auto" else int(v) for v in a.zce.split(",")]
    kw = placement_kwargs(a)
    llms, rng = {}, np.random.default_rng(0)
    for v in values:
        kw["zero_copy_experts"] = v
        llms[v] = nbmoe.load(a.model, n_ctx=a.tokens + 32, threads=a.threads, **kw)
        run_tg(llms[v], 2, rng)             # compile, then record the graphs
    rates = {v: [] for v in values}
    bws = []
    for _ in range(a.rounds):
        bws.append(read_bandwidth(a.read_mb << 20))
        for v in values:
            rates[v].append(a.tokens / run_tg(llms[v], a.tokens, rng))   # the bench's tg test
    ram = model_facts(llms[values[0]])["ram_bytes_per_token"]
    bw = float(np.median(bws))
    print(f"streaming read (median of {a.rounds}): {bw:.1f} GB/s; "
          f"{ram / 2**20:.0f} MiB of RAM weights a token")
    print(f"{'zce':>6s} {'t/s median':>11s} {'min':>7s} {'max':>7s} {'RAM GB/s':>9s} {'of read':>8s}")
    for v in values:
        r = np.array(rates[v])
        med = float(np.median(r))
        name = f"auto:{llms[v].zce_share}" if v == "auto" else str(v)   # auto: its share at the end
        print(f"{name:>6s} {med:11.2f} {r.min():7.2f} {r.max():7.2f} {med * ram / 1e9:9.1f} "
              f"{med * ram / 1e9 / bw:8.0%}")
    if "auto" in values and llms["auto"].balancer is not None:
        hist = llms["auto"].balancer.history
        print("auto, per measured token (share: GPU / CPU share us a layer): " + ", ".join(
            f"{s}: {g * 1e6:.0f}/{c * 1e6:.0f}" for s, g, c in hist))


if __name__ == "__main__":
    sys.exit(main())
