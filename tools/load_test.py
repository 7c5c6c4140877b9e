"""Load test of a running nbmoe server (loopback only): N streaming clients for M seconds.

    python -m nbmoe.server -np 4 &  python tools/load_test.py -n 4 -d 20 --server-pid $!
    python tools/load_test.py -n 4 -d 20 --start -- -np 4 -c 4096    # starts the server itself

Each client asks /v1/completions (streamed) again and again until the time is up. Reported:
requests/s, generated tokens/s, time to first token and time per token after it (p50 / p99),
errors (any: exit status 1), and the server's resident memory before and after the run.
"""
import argparse
import os
import socket
import subprocess
import sys
import threading
import time
from urllib.parse import urlparse

import httpx

MAX_CLIENTS, MAX_SECONDS = 64, 600
LOOPBACK = {"127.0.0.1", "localhost", "::1"}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", default="http://127.0.0.1:8080", help="the server (loopback only)")
    p.add_argument("-n", "--clients", type=int, default=4, help=f"concurrent clients (1..{MAX_CLIENTS})")
    p.add_argument("-d", "--duration", type=float, default=20, help=f"seconds (at most {MAX_SECONDS})")
    p.add_argument("--max-tokens", type=int, default=32, help="tokens per request")
    p.add_argument("--api-key", default=None)
    p.add_argument("--server-pid", type=int, default=None, help="the server's pid, for its memory")
    p.add_argument("--start", action="store_true",
                   help="start `python -m nbmoe.server` on a free port with the arguments after --")
    args, rest = p.parse_known_args(argv)
    if rest and (not args.start or rest[0] != "--"):
        p.error(f"unknown arguments {rest} (server arguments go after --start --)")
    args.server_args = rest[1:]
    if not 1 <= args.clients <= MAX_CLIENTS or not 0 < args.duration <= MAX_SECONDS:
        p.error(f"clients must be 1..{MAX_CLIENTS} and duration 0..{MAX_SECONDS} s")
    if urlparse(args.url).hostname not in LOOPBACK:
        p.error(f"{args.url}: the load test runs against the loopback only")
    return args


def rss_mib(pid):
    """VmRSS of a process in MiB (None without a pid)."""
    if pid is None:
        return None
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024


def start_server(server_args):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "nbmoe.server", "--port", str(port), *server_args])
    url = f"http://127.0.0.1:{port}"
    t0 = time.time()
    while time.time() - t0 < MAX_SECONDS:          # loading and compiling
        if proc.poll() is not None:
            sys.exit(f"the server exited with status {proc.returncode}")
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    proc.kill()
    sys.exit("the server did not start")


class Stats:
    def __init__(self):
        self.lock = threading.Lock()
        self.requests = self.tokens = self.errors = 0
        self.ttft, self.per_token, self.messages = [], [], []

    def add(self, ttft, gaps, tokens):
        with self.lock:
            self.requests += 1
            self.tokens += tokens
            self.ttft.append(ttft)
            self.per_token.extend(gaps)

    def error(self, message):
        with self.lock:
            self.errors += 1
            self.messages.append(message)


def one_request(http, url, body, headers, stats):
    """One streamed completion: time to its first text, the gaps between texts after it."""
    import json
    t0 = time.perf_counter()
    times, tokens = [], 0
    with http.stream("POST", url + "/v1/completions", json=body, headers=headers) as r:
        if r.status_code != 200:
            r.read()
            return stats.error(f"status {r.status_code}: {r.text[:200]}")
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                return stats.error(chunk["error"]["message"])
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            elif chunk["choices"] and chunk["choices"][0]["text"]:
                times.append(time.perf_counter())
    if not times:
        return stats.error("no text in the reply")
    stats.add(times[0] - t0, [b - a for a, b in zip(times, times[1:])], tokens)


def client(i, args, url, deadline, stats, warm=False):
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    body = {"prompt": f"Story number {i}. Once upon a time", "max_tokens": args.max_tokens,
            "temperature": 0.8, "seed": i, "stream": True, "stream_options": {"include_usage": True},
            "ignore_eos": True}     # every request generates max_tokens
    with httpx.Client(timeout=120) as http:
        while True:
            try:
                one_request(http, url, body, headers, stats)
            except httpx.HTTPError as e:
                stats.error(f"{type(e).__name__}: {e}")
            if warm or time.perf_counter() >= deadline:
                return


def pct(values, q):
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, int(q / 100 * len(values)))]


def main(argv=None):
    args = parse_args(argv)
    proc, url = (start_server(args.server_args) if args.start else (None, args.url))
    pid = proc.pid if proc else args.server_pid
    try:
        warm = Stats()      # one request per client first: kernels and slots ready
        run_clients(args, url, 0, warm, warm=True)
        if warm.errors:
            sys.exit(f"warm-up failed: {warm.messages[0]}")
        before = rss_mib(pid)
        stats = Stats()
        t0 = time.perf_counter()
        run_clients(args, url, t0 + args.duration, stats)
        wall = time.perf_counter() - t0
        after = rss_mib(pid)
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(30)
    ms = lambda v: f"{1000 * v:.0f} ms"
    print(f"clients {args.clients}, {wall:.1f} s, {args.max_tokens} tokens per request")
    print(f"requests     {stats.requests} ({stats.requests / wall:.2f}/s)")
    print(f"tokens       {stats.tokens} ({stats.tokens / wall:.1f} t/s generated, all clients)")
    print(f"first token  p50 {ms(pct(stats.ttft, 50))}  p99 {ms(pct(stats.ttft, 99))}")
    print(f"per token    p50 {ms(pct(stats.per_token, 50))}  p99 {ms(pct(stats.per_token, 99))}")
    print(f"errors       {stats.errors}" + (f" (first: {stats.messages[0]})" if stats.errors else ""))
    if before is not None:
        print(f"server RSS   {before:.0f} MiB before, {after:.0f} MiB after ({after - before:+.1f} MiB)")
    sys.exit(1 if stats.errors else 0)


def run_clients(args, url, deadline, stats, warm=False):
    threads = [threading.Thread(target=client, args=(i, args, url, deadline, stats, warm))
               for i in range(args.clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


if __name__ == "__main__":
    main()
