#!/usr/bin/env python3
"""What each engine's loading pattern asks of the mount, measured at the FUSE level.

    trace_loaders.py KLLM_MOUNT SEALED [--key FILE]

For each pattern, mounts SEALED afresh (cold kernel page cache) in the foreground with
RUST_LOG=debug, runs the pattern over every shard, unmounts, and counts the READ requests
the kernel sent (fuser logs one line per request): how many, their sizes, how many bytes
in all, and how many bytes were asked for more than once. Used for docs/ENGINES.md; not
part of scripts/e2e's pass/fail. Run it with the e2e venv's Python.
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

READ = re.compile(r"ino (0x[0-9a-f]+) READ fh \S+, offset Ok\((\d+)\), size (\d+)")

PATTERNS = {
    "safe_open + get_tensor (mmap; vLLM lazy, SGLang, transformers)": """
from safetensors import safe_open
for p in FILES:
    with safe_open(p, framework="pt") as f:
        for n in f.keys():
            f.get_tensor(n).sum()
""",
    "safetensors.torch.load(f.read()) (vLLM eager)": """
from safetensors.torch import load
for p in FILES:
    with open(p, "rb") as f:
        load(f.read())
""",
    "8 threads, f.read(16 MiB) per file (vLLM prefetch)": """
from concurrent.futures import ThreadPoolExecutor
def whole(p):
    with open(p, "rb") as f:
        while f.read(16 << 20):
            pass
with ThreadPoolExecutor(8) as pool:
    list(pool.map(whole, FILES))
""",
    "mx.load (mlx-lm)": """
import mlx.core as mx
for p in FILES:
    w = mx.load(p)
    mx.eval(list(w.values()))
""",
    "AutoModelForCausalLM.from_pretrained (transformers)": """
import torch
from transformers import AutoModelForCausalLM
AutoModelForCausalLM.from_pretrained(MNT, dtype="auto")
""",
    "4 processes, safe_open + get_tensor at once (tensor parallel)": """
import multiprocessing as mp
def one(files):
    from safetensors import safe_open
    for p in files:
        with safe_open(p, framework="pt") as f:
            for n in f.keys():
                f.get_tensor(n).sum()
if __name__ == "__main__":
    ps = [mp.get_context("spawn").Process(target=one, args=(FILES,)) for _ in range(4)]
    [p.start() for p in ps]
    [p.join() for p in ps]
""",
}


def measure(binary: str, sealed: str, key: list[str], code: str) -> dict:
    mnt = tempfile.mkdtemp(prefix="kllm-trace-")
    log = Path(mnt + ".log")
    env = dict(os.environ, RUST_LOG="fuser=debug")
    with open(log, "w") as out:
        daemon = subprocess.Popen([binary, sealed, mnt, "-f", *key], stdout=out, stderr=out,
                                  env=env)
    try:
        for _ in range(100):
            if os.path.ismount(mnt):
                break
            time.sleep(0.1)
        else:
            raise SystemExit(f"mount did not come up: {log.read_text()[-2000:]}")
        files = sorted(str(p) for p in Path(mnt).glob("*.safetensors"))
        script = Path(mnt + ".py")
        script.write_text(f"MNT = {mnt!r}\nFILES = {files!r}\n" + code)
        t0 = time.time()
        try:
            subprocess.run([sys.executable, str(script)], check=True)
        finally:
            script.unlink()
        seconds = time.time() - t0
    finally:
        for attempt in range(20):
            r = subprocess.run(["fusermount3", "-u", mnt], capture_output=True, text=True)
            if r.returncode == 0:
                break
            print(f"  fusermount3 -u: {r.stderr.strip()} (retrying)", file=sys.stderr)
            time.sleep(0.5)
        daemon.wait(timeout=30)
        os.rmdir(mnt)
    reads = [(ino, int(o), int(s)) for ino, o, s in READ.findall(log.read_text())]
    log.unlink()
    sizes = [s for _, _, s in reads]
    seen = collections.Counter()
    for ino, o, s in reads:
        for page in range(o // 4096, (o + s + 4095) // 4096):
            seen[ino, page] += 1
    again = sum(c - 1 for c in seen.values()) * 4096
    return {
        "requests": len(reads), "bytes": sum(sizes), "seconds": seconds,
        "sizes": (min(sizes), int(statistics.median(sizes)), max(sizes)) if sizes else (0, 0, 0),
        "again": again,
    }


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("binary")
    ap.add_argument("sealed")
    ap.add_argument("--key", default=None)
    args = ap.parse_args()
    key = ["--key", args.key] if args.key else []
    total = sum(p.stat().st_size for p in Path(args.sealed).glob("*.safetensors"))
    print(f"{args.sealed}: {total} bytes of shards\n")
    print("| pattern | READ requests | size min / median / max | bytes read | "
          "bytes asked again |")
    print("|---|---|---|---|---|")
    for name, code in PATTERNS.items():
        r = measure(args.binary, args.sealed, key, code)
        print(f"| {name} | {r['requests']} | {r['sizes'][0] >> 10} / {r['sizes'][1] >> 10} / "
              f"{r['sizes'][2] >> 10} KiB | {r['bytes'] / total:.2f}x | "
              f"{r['again'] / total:.2f}x |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
