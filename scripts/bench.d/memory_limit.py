#!/usr/bin/env python3
"""Load speed of kllm-mount under a memory limit (Python 3 standard library only).

    scripts/bench.d/memory_limit.py [--mib 512] [--rounds 2] [--out FILE.md] [--skip-build]

One sealed model with one locked shard of --mib MiB (examples/bench-shard). The daemon runs
in a memory cgroup of its own (a child of this process's: cgroup v2, or v1's memory
hierarchy) with two limits: one smaller than the shard (default: half of it; the shard is
served through FUSE with a cache that fits) and one that fits it (default: the shard plus
512 MiB; passthrough). Per limit and round, on a fresh mount with the page cache dropped
and the sealed file read back into it: the open and a sequential read of the whole shard in
1 MiB reads (an engine's load), its SHA-256 checked against the plain shard, then four
concurrent readers. The report gives the load speed, how the shard was served (bytes
through the daemon, from --status), the cgroup's peak charge and its OOM kills, and fails
(exit 1) on a wrong byte, a dead daemon or an OOM kill.

Needs root (cgroups, mounts, dropping the page cache) and /dev/fuse. Builds kllm-mount and
bench-shard in release mode unless --skip-build. Timing on a shared machine is noise:
compare the two limits within one run.
"""

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time

MiB = 1 << 20
READ = 1 << 20
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# Where cargo builds (CARGO_TARGET_DIR, a cargo config's target-dir, else target/).
TARGET = subprocess.run([os.path.join(ROOT, "scripts", "target-dir")], check=True,
                        capture_output=True, text=True).stdout.strip()
KLLM = os.path.join(TARGET, "release", "kllm-mount")
GEN = os.path.join(TARGET, "release", "examples", "bench-shard")


def log(*a):
    print(*a, file=sys.stderr, flush=True)


def unescape(field):
    """mountinfo writes space, tab, newline and backslash as octal escapes."""
    out, i = [], 0
    while i < len(field):
        if field[i] == "\\" and field[i + 1:i + 4].isdigit():
            out.append(chr(int(field[i + 1:i + 4], 8)))
            i += 4
        else:
            out.append(field[i])
            i += 1
    return "".join(out)


class Cgroup:
    """A memory cgroup made for the daemon below this process's own (src/limits.rs finds
    a process's cgroup the same way)."""

    def __init__(self, name):
        v1 = v2 = None
        for line in open("/proc/self/cgroup"):
            hid, controllers, path = line.rstrip("\n").split(":", 2)
            if "memory" in controllers.split(","):
                v1 = path
            elif hid == "0" and controllers == "":
                v2 = path
        self.v1 = v1 is not None
        path = v1 if self.v1 else v2
        if path is None:
            sys.exit("memory_limit: no memory cgroup found in /proc/self/cgroup")
        best = None
        for line in open("/proc/self/mountinfo"):
            before, after = line.split(" - ", 1)
            f = before.split(" ")
            root, point = unescape(f[3]), unescape(f[4])
            a = after.split(" ")
            ours = (a[0] == "cgroup" and "memory" in a[2].strip().split(",")) if self.v1 else a[0] == "cgroup2"
            rel = os.path.relpath(path, root)
            if ours and not rel.startswith("..") and (best is None or len(root) > len(best[0])):
                best = (root, point, "" if rel == "." else rel)
        if best is None:
            sys.exit("memory_limit: the memory cgroup hierarchy is not mounted here")
        parent = os.path.join(best[1], best[2])
        if not self.v1:
            # cgroup v2 hands the memory controller to children only from a cgroup with no
            # process of its own (run this in a delegated, empty one: systemd-run --scope
            # -p Delegate=yes).
            try:
                with open(os.path.join(parent, "cgroup.subtree_control"), "w") as f:
                    f.write("+memory")
            except OSError as e:
                sys.exit(f"memory_limit: cannot enable the memory controller below {parent} ({e})")
        self.dir = os.path.join(parent, name)
        os.makedirs(self.dir, exist_ok=True)

    def file(self, v1, v2):
        return os.path.join(self.dir, v1 if self.v1 else v2)

    def set_limit(self, nbytes):
        with open(self.file("memory.limit_in_bytes", "memory.max"), "w") as f:
            f.write(str(nbytes))

    def usage(self):
        return int(open(self.file("memory.usage_in_bytes", "memory.current")).read())

    def oom_kills(self):
        text = open(self.file("memory.oom_control", "memory.events")).read()
        for line in text.splitlines():
            k, v = line.split()
            if k == "oom_kill":
                return int(v)
        return 0

    def procs(self):
        return self.file("cgroup.procs", "cgroup.procs")

    def remove(self):
        for _ in range(50):
            try:
                os.rmdir(self.dir)
                return
            except OSError:
                time.sleep(0.1)


def drop_caches():
    os.sync()
    with open("/proc/sys/vm/drop_caches", "w") as f:
        f.write("3")


def read_into_cache(path):
    with open(path, "rb") as f:
        while f.read(16 * MiB):
            pass


def load(path):
    """Open and read the whole file in READ-byte preads; (seconds, sha256)."""
    h = hashlib.sha256()
    t0 = time.perf_counter()
    fd = os.open(path, os.O_RDONLY)
    try:
        off = 0
        while True:
            b = os.pread(fd, READ, off)
            if not b:
                break
            h.update(b)
            off += len(b)
    finally:
        os.close(fd)
    return time.perf_counter() - t0, h.hexdigest()


def concurrent(path, readers=4):
    """`readers` threads each reading a quarter; seconds."""
    size = os.path.getsize(path)
    part = (size + readers - 1) // readers
    errors = []

    def work(k):
        try:
            fd = os.open(path, os.O_RDONLY)
            try:
                off, end = k * part, min(size, (k + 1) * part)
                while off < end:
                    b = os.pread(fd, min(READ, end - off), off)
                    if not b:
                        raise IOError(f"short read at {off}")
                    off += len(b)
            finally:
                os.close(fd)
        except Exception as e:  # reported below
            errors.append(e)

    t0 = time.perf_counter()
    ts = [threading.Thread(target=work, args=(k,)) for k in range(readers)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    if errors:
        raise errors[0]
    return time.perf_counter() - t0


def status(mnt):
    out = subprocess.run([KLLM, "--status", mnt], capture_output=True, text=True)
    return json.loads(out.stdout) if out.returncode == 0 else None


def mounted(mnt):
    with open("/proc/self/mountinfo") as f:
        return any(unescape(l.split(" ")[4]) == mnt for l in f)


def one_run(data, mnt, limit, cg, want):
    """Mount in the cgroup under `limit`, load, check; a row of the report."""
    cg.set_limit(limit)
    drop_caches()
    read_into_cache(os.path.join(data, "sealed", "model.safetensors"))
    peak = [0]
    stop = threading.Event()

    def sample():
        while not stop.is_set():
            try:
                peak[0] = max(peak[0], cg.usage())
            except OSError:
                pass
            time.sleep(0.02)

    ooms0 = cg.oom_kills()
    logf = open(os.path.join(data, "daemon.log"), "a")
    daemon = subprocess.Popen(
        ["sh", "-c", 'echo $$ > "$0" && exec "$@"', cg.procs(), KLLM, "-f",
         "--key", os.path.join(data, "kllm.key"), os.path.join(data, "sealed"), mnt],
        stderr=logf, stdout=logf)
    row = {"limit_mib": limit // MiB}
    try:
        for _ in range(300):
            if mounted(mnt) and os.path.exists(os.path.join(mnt, "config.json")):
                break
            if daemon.poll() is not None:
                raise RuntimeError(f"the daemon exited ({daemon.returncode}); see {logf.name}")
            time.sleep(0.05)
        sampler = threading.Thread(target=sample)
        sampler.start()
        path = os.path.join(mnt, "model.safetensors")
        size = os.path.getsize(path)
        secs, digest = load(path)
        row["load_s"] = secs
        row["load_mib_s"] = size / MiB / secs
        row["bytes_exact"] = digest == want
        row["conc4_s"] = concurrent(path)
        st = status(mnt) or {}
        row["served"] = "passthrough" if st.get("bytes_served", size) < size // 2 else "fuse"
        row["bytes_through_daemon"] = st.get("bytes_served")
        mem = st.get("memory") or {}
        row["limit_from"] = mem.get("limit_from")
        row["passthrough_budget_mib"] = (mem.get("passthrough_budget") or 0) // MiB
        row["cache_budget_mib"] = (mem.get("cache_budget") or 0) // MiB
        stop.set()
        sampler.join()
        row["peak_charge_mib"] = peak[0] // MiB
        row["daemon_alive"] = daemon.poll() is None and mounted(mnt)
        row["oom_kills"] = cg.oom_kills() - ooms0
    finally:
        stop.set()
        if mounted(mnt):
            subprocess.run(["umount", "-l", mnt])
        try:
            daemon.wait(timeout=10)
        except subprocess.TimeoutExpired:
            daemon.kill()
            daemon.wait()
        logf.close()
    return row


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mib", type=int, default=512, help="size of the locked shard (MiB)")
    ap.add_argument("--small", type=int, help="the limit below the shard (MiB; default: half of it)")
    ap.add_argument("--fits", type=int, help="the limit that fits it (MiB; default: the shard + 512)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out", help="also write the report (markdown) here, and a .json beside it")
    ap.add_argument("--skip-build", action="store_true", help="use what cargo's release output (target/release, or CARGO_TARGET_DIR/release) holds")
    ap.add_argument("--keep", action="store_true", help="keep the data directory")
    a = ap.parse_args()
    if os.geteuid() != 0:
        sys.exit("memory_limit: run as root (cgroups, mounts, dropping the page cache)")
    small = (a.small or a.mib // 2) * MiB
    fits = (a.fits or a.mib + 512) * MiB
    if not a.skip_build:
        subprocess.run(["cargo", "build", "--release", "--locked", "--quiet", "--bin",
                        "kllm-mount", "--example", "bench-shard"], cwd=ROOT, check=True)
    data = tempfile.mkdtemp(prefix="kllm-memlimit.", dir=os.environ.get("TMPDIR", "/var/tmp"))
    mnt = os.path.join(data, "mnt")
    os.mkdir(mnt)
    cg = Cgroup(f"kllm-bench-memory-{os.getpid()}")
    rows, failed = [], False
    try:
        log(f"== a sealed model with one {a.mib} MiB locked shard")
        subprocess.run([GEN, "shard", data, "--mib", str(a.mib)], check=True,
                       stdout=subprocess.DEVNULL)
        h = hashlib.sha256()
        with open(os.path.join(data, "plain", "model.safetensors"), "rb") as f:
            while True:
                b = f.read(16 * MiB)
                if not b:
                    break
                h.update(b)
        want = h.hexdigest()
        for r in range(a.rounds):
            for name, limit in (("below the shard", small), ("fits the shard", fits)):
                log(f"== round {r + 1}: limit {limit // MiB} MiB ({name})")
                row = one_run(data, mnt, limit, cg, want)
                row["round"], row["case"] = r + 1, name
                rows.append(row)
                ok = row["bytes_exact"] and row["daemon_alive"] and row["oom_kills"] == 0
                failed |= not ok
                log(json.dumps(row))
    finally:
        cg.remove()
        if not a.keep:
            shutil.rmtree(data, ignore_errors=True)
    lines = [
        f"# kllm-mount under a memory limit ({a.mib} MiB locked shard, {a.rounds} rounds)",
        "",
        "| limit | case | served by | load (open + 1 MiB reads) | 4 readers | peak charge | bytes exact | alive, OOM kills |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for row in rows:
        lines.append(
            f"| {row['limit_mib']} MiB | {row['case']} | {row['served']} | "
            f"{row['load_s']:.2f} s ({row['load_mib_s']:.0f} MiB/s) | {row['conc4_s']:.2f} s | "
            f"{row['peak_charge_mib']} MiB | {'yes' if row['bytes_exact'] else 'NO'} | "
            f"{'yes' if row['daemon_alive'] else 'NO'}, {row['oom_kills']} |")
    if rows:
        lines += ["", f"Limit read by the daemon: {rows[0]['limit_from']}. Budgets under the "
                  f"small limit: passthrough {rows[0]['passthrough_budget_mib']} MiB, cache "
                  f"{rows[0]['cache_budget_mib']} MiB."]
    text = "\n".join(lines) + "\n"
    print(text)
    if a.out:
        with open(a.out, "w") as f:
            f.write(text)
        with open(os.path.splitext(a.out)[0] + ".json", "w") as f:
            json.dump(rows, f, indent=1)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
