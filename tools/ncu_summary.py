"""Sum kernel durations from an Nsight Compute CSV, by kernel: where a token's GPU time goes.

On the GPU machine (ncu, no nsys), e.g. the kernels of one decode token, after warm-up:
  ncu --metrics gpu__time_duration.sum --csv --launch-skip 2000 --launch-count 700 \\
      python -m nbmoe.bench -m MODEL -ngl 99 -p 0 -n 8 -r 1 --no-bandwidth > k.csv
  python tools/ncu_summary.py k.csv [--per N]   (N: tokens the launches cover, for per-token)
The bench's timed repetitions alone (NBMOE_PROFILE_TIMED, nbmoe/config.py):
  NBMOE_PROFILE_TIMED=1 ncu --profile-from-start off --metrics gpu__time_duration.sum --csv \\
      python -m nbmoe.bench -m MODEL -ngl 99 -p 512 -n 0 -r 1 --no-bandwidth > k.csv
The sum is device-busy time; a token's wall time minus it is launch gaps and host waits.
"""
import argparse
import csv
import io
import re
from collections import defaultdict


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("csv")
    p.add_argument("--per", type=float, default=1.0, help="divide the times by this (tokens)")
    a = p.parse_args(argv)
    text = open(a.csv, errors="replace").read()
    start = text.find('"ID"')
    rows = list(csv.DictReader(io.StringIO(text[start:])))
    tot, cnt = defaultdict(float), defaultdict(int)
    for r in rows:
        if r.get("Metric Name") != "gpu__time_duration.sum":
            continue
        name = re.sub(r"\(.*", "", r["Kernel Name"]).split("::")[-1][:60]
        unit = r.get("Metric Unit", "nsecond")
        v = float(r["Metric Value"].replace(",", ""))
        v *= {"nsecond": 1e-3, "usecond": 1.0, "msecond": 1e3}.get(unit, 1e-3)
        tot[name] += v
        cnt[name] += 1
    all_us = sum(tot.values())
    print(f"{sum(cnt.values())} kernels, {all_us / a.per:.1f} us per token (device busy)")
    for name, us in sorted(tot.items(), key=lambda kv: -kv[1]):
        print(f"{us / a.per:10.1f} us {cnt[name] / a.per:7.1f} launches {us / cnt[name]:7.2f} us each  {name}")


if __name__ == "__main__":
    main()
