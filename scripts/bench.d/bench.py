#!/usr/bin/env python3
"""The driver of scripts/bench (Python 3 standard library only). See scripts/bench --help
and docs/PERFORMANCE.md.

Systems: kllm-mount in passthrough mode ("kllm": the first open decodes the whole shard
into private memory and the kernel serves it from there) and in FUSE mode ("kllm-fuse":
every read through the daemon), bindfs, gocryptfs, and "raw": the plain file read directly
from the page cache.

Per round, for each data set (a lock-v2 BF16 shard, a lock-v1 F32/F8 shard), after dropping
every cache and re-reading the underlying files (sealed shard, plain shard, gocryptfs cipher
file) into the page cache:
  for each cold metric (sequential 1 MiB reads, mmap page-touch, 4 concurrent readers), for
  each system in an order rotated round by round: mount it fresh (its own caches and the
  FUSE page cache are then cold), measure (the open included), unmount. Right after the
  cold sequential read the same file is read again through the same mount: the warm
  re-read. Then, each on a fresh mount: open() and first-byte time for every system; a
  tensor-parallel load (4 processes, each a quarter of every tensor's rows, vs 1 process)
  with the daemon's CPU time, for both kllm modes; a cold sequential read with the
  manifest checked (--verify open) and not (--verify off), for both kllm modes.
Then the daemon's RSS in each mode while reading 10x its cache budget, and the time until
a fresh kllm-mount answers for 1, 10 and 100 shards of small and of large sizes.
Ratios are paired within a round (kllm / peer, measured seconds apart on the same machine
state) and reported as medians over rounds.
"""

import argparse
import datetime
import json
import mmap
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time

MiB = 1 << 20
READ = 1 << 20  # the readers' request size
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TARGET = os.environ.get("CARGO_TARGET_DIR", os.path.join(ROOT, "target"))
KLLM = os.path.join(TARGET, "release", "kllm-mount")
GEN = os.path.join(TARGET, "release", "examples", "bench-shard")
# kllm-mount in each serving mode, then the peers; "raw" is the plain file, no FUSE
KLLM_MODES = {"kllm": "passthrough", "kllm-fuse": "fuse"}
KLLMS = list(KLLM_MODES)
SYSTEMS = KLLMS + ["bindfs", "gocryptfs", "raw"]
PEERS = ["bindfs", "gocryptfs", "raw"]
METRICS = ["seq", "mmap", "conc"]
TP_WORLD = 4  # processes of the tensor-parallel load
PASS = "bench-passphrase-not-secret"
WARM_PASSES = 3
RETRIES = 2  # repeats of a measurement during which another process dropped the page cache
READY_REPS = 5  # timed mounts per set and round (the report pools them over rounds)


def log(*a):
    print(*a, file=sys.stderr, flush=True)


def run(cmd, **kw):
    kw.setdefault("check", True)
    return subprocess.run(cmd, **kw)


# ---------------------------------------------------------------- readers


def read_seq(path, start=0, length=None):
    """Sequential READ-byte preads into one buffer; returns (bytes, seconds). The time
    includes the open: in passthrough mode kllm-mount decodes the shard there."""
    t0 = time.perf_counter()
    fd = os.open(path, os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size
        end = size if length is None else min(size, start + length)
        buf = bytearray(READ)
        mv = memoryview(buf)
        off, total = start, 0
        while off < end:
            n = os.preadv(fd, [mv[: min(READ, end - off)]], off)
            if n <= 0:
                raise IOError(f"{path}: short read at {off}")
            off += n
            total += n
        return total, time.perf_counter() - t0
    finally:
        os.close(fd)


def busy_seconds():
    """CPU time spent by the whole machine, all cores (user, nice, system, irq, softirq)."""
    with open("/proc/stat") as f:
        t = [int(x) for x in f.readline().split()[1:8]]
    return (t[0] + t[1] + t[2] + t[5] + t[6]) / os.sysconf("SC_CLK_TCK")


def read_mmap(path):
    """Map the file and touch one byte of every 4 KiB page, in order (as a safetensors
    mmap load does); returns (bytes, seconds), the open included."""
    t0 = time.perf_counter()
    fd = os.open(path, os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size
        m = mmap.mmap(fd, size, prot=mmap.PROT_READ)
        mv = memoryview(m)
        touched = bytes(mv[::4096])  # one byte per page, copied in C
        mv.release()
        m.close()
        dt = time.perf_counter() - t0
        assert len(touched) == (size + 4095) // 4096
        return size, dt
    finally:
        os.close(fd)


def read_conc(path, readers=4, length=None):
    """`readers` threads, each with its own descriptor, each reading a contiguous share
    sequentially; returns (bytes, wall seconds)."""
    size = os.path.getsize(path)
    end = size if length is None else min(size, length)
    share = -(-end // readers)
    share = -(-share // 4096) * 4096
    results = [None] * readers
    errors = []

    def work(k):
        try:
            a = k * share
            results[k] = read_seq(path, a, max(0, min(end, a + share) - a))[0]
        except Exception as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=work, args=(k,)) for k in range(readers)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    dt = time.perf_counter() - t0
    if errors:
        raise errors[0]
    return sum(results), dt


def scatter(path, start, length, readers=4):
    """4 KiB reads, one per MiB of [start, start + length), in a shuffled order, by
    `readers` threads; returns the number of reads."""
    import random
    offs = [start + k * MiB + 64 * 1024 for k in range(length // MiB)]
    random.Random(1).shuffle(offs)
    errors = []

    def work(part):
        fd = os.open(path, os.O_RDONLY)
        try:
            for o in part:
                os.pread(fd, 4096, o)
        except Exception as e:  # noqa: BLE001
            errors.append(e)
        finally:
            os.close(fd)

    threads = [threading.Thread(target=work, args=(offs[k::readers],)) for k in range(readers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return len(offs)


def safetensors_tensors(fd):
    """(offset, bytes, rows) of every tensor of an open safetensors file, in file order;
    rows is the first dimension (1 for a scalar)."""
    n = int.from_bytes(os.pread(fd, 8, 0), "little")
    raw = b""
    while len(raw) < n:
        chunk = os.pread(fd, n - len(raw), 8 + len(raw))
        if not chunk:
            raise IOError("short safetensors header")
        raw += chunk
    out = []
    for name, t in json.loads(raw).items():
        if name == "__metadata__":
            continue
        b, e = t["data_offsets"]
        rows = t["shape"][0] if t["shape"] else 1
        out.append((8 + n + b, e - b, rows))
    return sorted(out)


def load_rows(path, rank, world):
    """What one rank of a tensor-parallel loader reads: open the file, parse its header,
    and pread rows [rank/world, (rank+1)/world) of every tensor into a buffer; returns
    (bytes, seconds)."""
    t0 = time.perf_counter()
    fd = os.open(path, os.O_RDONLY)
    try:
        buf = bytearray(READ)
        mv = memoryview(buf)
        total = 0
        for off, length, rows in safetensors_tensors(fd):
            if rows == 0 or length == 0:
                continue
            row_bytes = length // rows
            a = off + rows * rank // world * row_bytes
            end = off + rows * (rank + 1) // world * row_bytes
            while a < end:
                n = os.preadv(fd, [mv[: min(READ, end - a)]], a)
                if n <= 0:
                    raise IOError(f"{path}: short read at {a}")
                a += n
                total += n
        return total, time.perf_counter() - t0
    finally:
        os.close(fd)


def _tp_rank(path, rank, world, barrier, results):
    barrier.wait()
    try:
        results.put((rank, load_rows(path, rank, world), None))
    except Exception as e:  # noqa: BLE001
        results.put((rank, None, repr(e)))


def tensor_parallel_load(path, world):
    """`world` processes started together, each loading its share of the rows of every
    tensor; returns (bytes of all ranks, wall seconds from the common start)."""
    import multiprocessing
    ctx = multiprocessing.get_context("fork")
    barrier = ctx.Barrier(world + 1)
    results = ctx.Queue()
    procs = [ctx.Process(target=_tp_rank, args=(path, k, world, barrier, results))
             for k in range(world)]
    for p in procs:
        p.start()
    barrier.wait()
    t0 = time.perf_counter()
    got = [results.get(timeout=600) for _ in procs]
    dt = time.perf_counter() - t0
    for p in procs:
        p.join()
    errors = [e for _, _, e in got if e]
    if errors:
        raise IOError(f"tensor-parallel load of {path}: {errors[0]}")
    return sum(r[0] for _, r, _ in got), dt


def process_cpu_seconds(pid):
    """utime + stime of process `pid`, all its threads (/proc/PID/stat)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def kllm_status(mnt):
    """`kllm-mount --status MNT` as a dict."""
    p = run([KLLM, "--status", mnt], capture_output=True, text=True, timeout=30)
    return json.loads(p.stdout)


def sha256_file(path):
    import hashlib
    h = hashlib.sha256()
    with open(path, "rb", buffering=0) as f:
        while True:
            chunk = f.read(8 * MiB)
            if not chunk:
                return h.hexdigest()
            h.update(chunk)


def warm(paths):
    for p in paths:
        with open(p, "rb", buffering=0) as f:
            while f.read(8 * MiB):
                pass


def drop_count():
    """How often anyone dropped the page cache since boot (/proc/vmstat drop_pagecache)."""
    try:
        with open("/proc/vmstat") as f:
            for line in f:
                if line.startswith("drop_pagecache "):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


def drop_caches():
    os.sync()
    with open("/proc/sys/vm/drop_caches", "w") as f:
        f.write("3\n")


# ---------------------------------------------------------------- mounts


def pids_for(mnt):
    """Processes whose command line names `mnt` (the daemon of a mount)."""
    out = []
    for d in os.listdir("/proc"):
        if not d.isdigit() or int(d) == os.getpid():
            continue
        try:
            with open(f"/proc/{d}/cmdline", "rb") as f:
                args = f.read().split(b"\0")
        except OSError:
            continue
        if mnt.encode() in args:
            out.append(int(d))
    return out


def is_mounted(mnt):
    real = os.path.realpath(mnt)
    with open("/proc/self/mountinfo") as f:
        return any(line.split()[4] == real for line in f)


def become_subreaper():
    """Daemons that detach (kllm-mount, bindfs, gocryptfs) are re-parented to this process,
    which reaps them, instead of to an init that may leave them as zombies."""
    try:
        import ctypes
        ctypes.CDLL(None, use_errno=True).prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER
    except Exception:  # noqa: BLE001
        pass


def reap():
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def alive(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def unmount(mnt):
    if not is_mounted(mnt):
        return
    pids = pids_for(mnt)
    for _ in range(50):
        if subprocess.run(["fusermount3", "-u", mnt], stderr=subprocess.DEVNULL).returncode == 0:
            break
        time.sleep(0.1)
    else:
        subprocess.run(["fusermount3", "-uz", mnt], stderr=subprocess.DEVNULL)
    # the daemon exits once unmounted; wait so it takes no CPU from the next measurement
    deadline = time.time() + 10
    while time.time() < deadline:
        reap()
        if not any(alive(p) for p in pids):
            break
        time.sleep(0.005)


class Bench:
    def __init__(self, a):
        self.a = a
        self.work = a.work
        self.mounts = set()
        self.kllm_opts = a.kllm_opts.split() if a.kllm_opts else []
        self.bindfs_opts = a.bindfs_opts.split() if a.bindfs_opts else []
        self.gocryptfs_opts = a.gocryptfs_opts.split() if a.gocryptfs_opts else []
        self.data = {}  # name -> dict(dir, plain, sealed, cipher_dir, file)
        self.rounds = []
        self.ready_sets = []

    # --- mounting

    def mnt(self, system, ds):
        return os.path.join(self.work, "mnt", f"{system}-{ds}")

    def kllm_log(self, system, ds):
        return os.path.join(self.work, "logs", f"{system}-{ds}.log")

    def last_decode_ms(self, system, ds):
        """The daemon's own time for its last whole-shard decode (passthrough), from its
        debug log line "decoded N bytes in T"."""
        import re
        try:
            with open(self.kllm_log(system, ds), errors="replace") as f:
                hits = re.findall(r"decoded \d+ bytes in ([0-9.]+)(ns|µs|us|ms|s)\b", f.read())
        except OSError:
            return None
        if not hits:
            return None
        value, unit = hits[-1]
        return float(value) * {"ns": 1e-6, "µs": 1e-3, "us": 1e-3, "ms": 1.0, "s": 1e3}[unit]

    def daemon_pid(self, mnt):
        return kllm_status(mnt)["pid"]

    def mount(self, system, ds, extra=(), cache_size=None):
        d = self.data[ds]
        mnt = self.mnt(system, ds)
        os.makedirs(mnt, exist_ok=True)
        unmount(mnt)
        if system in KLLM_MODES:
            cmd = [KLLM, d["sealed"], mnt, "--key", d["key"], "--mode", KLLM_MODES[system],
                   "--log-file", self.kllm_log(system, ds), *self.kllm_opts, *extra]
            if cache_size is None and system == "kllm":
                # what keeps a decoded shard across opens (the warm re-read, later ranks)
                cache_size = self.a.kllm_cache_size
            if cache_size is not None:
                cmd += ["--cache-size", cache_size]
        elif system == "bindfs":
            cmd = ["bindfs", "-r", *self.bindfs_opts, d["plain"], mnt]
        elif system == "bindfs-kc":
            # the FUSE page cache's own speed: bindfs keeping it across opens, like kllm-mount
            cmd = ["bindfs", "-r", "-o", "kernel_cache", *self.bindfs_opts, d["plain"], mnt]
        elif system == "gocryptfs":
            cmd = ["gocryptfs", "-q", "-nosyslog", "-ro", "-passfile", d["passfile"],
                   *self.gocryptfs_opts,
                   d["cipher"], mnt]
        else:
            raise ValueError(system)
        env = dict(os.environ)
        if system in KLLM_MODES:
            env["RUST_LOG"] = "kllm_mount=debug"  # the decode time of each passthrough open
        run(cmd, timeout=120, env=env)
        self.mounts.add(mnt)
        return mnt

    def umount(self, system, ds):
        mnt = self.mnt(system, ds)
        unmount(mnt)
        self.mounts.discard(mnt)

    def unmount_all(self):
        for m in list(self.mounts):
            unmount(m)
        self.mounts.clear()

    def measure_warm_ceiling(self, ds, res):
        """Warm re-read through bindfs with `-o kernel_cache`: what the kernel's FUSE page
        cache gives any daemon, since warm reads never reach the daemon."""
        s = "bindfs-kc"
        warm(self.underlying("bindfs", ds))
        self.mount(s, ds)
        try:
            p = self.path(s, ds)
            read_seq(p)
            self.measure_warm(s, ds, p, res)
        finally:
            self.umount(s, ds)

    def measure_warm(self, s, ds, p, res):
        """Warm re-read of `p` (already read once through system `s`): passes through the
        mount interleaved with raw page-cache reads of the plain file, median of
        WARM_PASSES each."""
        raw = self.path("raw", ds)
        w, wr = [], []
        for _ in range(WARM_PASSES):
            n, dt = read_seq(p)
            w.append(n / dt / MiB)
            n, dt = read_seq(raw)
            wr.append(n / dt / MiB)
        res["warm"][s] = statistics.median(w)
        res["warm_raw"][s] = statistics.median(wr)

    def path(self, system, ds):
        f = self.data[ds]["file"]
        if system == "raw":
            return os.path.join(self.data[ds]["plain"], f)
        return os.path.join(self.mnt(system, ds), f)

    # --- data

    def make_data(self):
        a = self.a
        os.makedirs(os.path.join(self.work, "logs"), exist_ok=True)
        sets = [("v2-bf16", a.mib, "v2", "bf16")]
        if a.v1_mib > 0:
            sets.append(("v1-f32-f8", a.v1_mib, "v1", "f32,f8"))
        for name, mib, lock, dtype in sets:
            out = os.path.join(self.work, "data", name)
            t = time.time()
            run([GEN, "shard", out, "--mib", str(mib), "--lock", lock, "--dtype", dtype])
            d = dict(dir=out, plain=os.path.join(out, "plain"), sealed=os.path.join(out, "sealed"),
                     key=os.path.join(out, "kllm.key"), file="model.safetensors", mib=mib,
                     lock=lock, dtype=dtype)
            self.data[name] = d
            # gocryptfs holding the plain shard
            d["cipher"] = os.path.join(out, "gocryptfs-cipher")
            d["passfile"] = os.path.join(out, "gocryptfs.pass")
            with open(d["passfile"], "w") as f:
                f.write(PASS + "\n")
            os.makedirs(d["cipher"])
            # -scryptn 10: only the wrapping of the master key (mount time), not the data path
            run(["gocryptfs", "-q", "-init", "-passfile", d["passfile"], "-scryptn", "10",
                 d["cipher"]], stdout=subprocess.DEVNULL)
            mnt = self.mnt("gocryptfs", name)
            os.makedirs(mnt, exist_ok=True)
            run(["gocryptfs", "-q", "-nosyslog", "-passfile", d["passfile"], d["cipher"], mnt])
            self.mounts.add(mnt)
            shutil.copyfile(os.path.join(d["plain"], d["file"]), os.path.join(mnt, d["file"]))
            os.sync()
            unmount(mnt)
            d["cipher_files"] = [os.path.join(r, f) for r, _, fs in os.walk(d["cipher"]) for f in fs]
            # a kLLM catalog manifest of the sealed directory, placed there only while the
            # integrity measurement runs
            files = {}
            for r_, _, fs in os.walk(d["sealed"]):
                for f in fs:
                    full = os.path.join(r_, f)
                    files[os.path.relpath(full, d["sealed"])] = sha256_file(full)
            d["manifest_text"] = json.dumps(
                {"format": "kllm-catalog", "version": 1, "files": dict(sorted(files.items()))},
                indent=2)
            fd = os.open(os.path.join(d["plain"], d["file"]), os.O_RDONLY)
            try:
                d["tensor_bytes"] = sum(length for _, length, _ in safetensors_tensors(fd))
            finally:
                os.close(fd)
            log(f"data {name}: {mib} MiB, lock {lock} {dtype}, with gocryptfs copy, "
                f"{time.time() - t:.1f} s")
            self.check_same_bytes(name)
        # mount-ready sets: 1, 10, 100 shards; small (dense) and large (sparse) sizes
        lo, hi = (1, 4) if a.quick else (1, 16)
        for count in (1, 10, 100):
            for label, mn, mx, sparse in (("small", lo, hi, False), ("large", 512, 4096, True)):
                out = os.path.join(self.work, "data", f"ready-{count}-{label}")
                cmd = [GEN, "shards", out, "--count", str(count), "--min-mib", str(mn),
                       "--max-mib", str(mx), "--tensors", str(a.ready_tensors)]
                if sparse:
                    cmd.append("--sparse")
                run(cmd)
                apparent = sum(os.path.getsize(os.path.join(out, "sealed", f))
                               for f in os.listdir(os.path.join(out, "sealed")))
                self.ready_sets.append(dict(
                    name=f"{count} x {label}", count=count, label=label, dir=out,
                    sizes=f"{mn}..{mx} MiB" if count > 1 else f"{mx} MiB",
                    total_mib=apparent / MiB, sparse=sparse))

    def check_same_bytes(self, ds):
        """All four systems serve the same bytes (sampled: 8 spread 1 MiB ranges plus the
        header and the tail)."""
        import hashlib
        size = os.path.getsize(self.path("raw", ds))
        offs = sorted({0, max(0, size - MiB)} | {(size // 8) * k for k in range(1, 8)})
        digests = {}
        for s in SYSTEMS:
            if s != "raw":
                self.mount(s, ds)
            h = hashlib.sha256()
            fd = os.open(self.path(s, ds), os.O_RDONLY)
            try:
                assert os.fstat(fd).st_size == size, f"{s}: size differs"
                for o in offs:
                    h.update(os.pread(fd, MiB, o))
            finally:
                os.close(fd)
            digests[s] = h.hexdigest()
            if s != "raw":
                self.umount(s, ds)
        if len(set(digests.values())) != 1:
            raise SystemExit(f"bench: the systems do not serve the same bytes for {ds}: {digests}")
        log(f"data {ds}: kllm-mount, bindfs, gocryptfs and the plain file agree (sampled)")

    # --- one round

    def warm_underlying(self):
        files = []
        for d in self.data.values():
            files += [os.path.join(d["plain"], d["file"]), os.path.join(d["sealed"], d["file"])]
            files += d["cipher_files"]
        warm(files)

    def underlying(self, system, ds):
        d = self.data[ds]
        if system in KLLM_MODES:
            return [os.path.join(d["sealed"], d["file"])]
        if system == "gocryptfs":
            return d["cipher_files"]
        return [os.path.join(d["plain"], d["file"])]

    def measure(self, metric, path):
        if metric == "seq":
            return read_seq(path)
        if metric == "mmap":
            return read_mmap(path)
        return read_conc(path, 4)

    def measure_one(self, metric, s, ds, res):
        """One cold measurement of system `s` (and, after the sequential read, the warm
        re-read passes), from a fresh mount over warm underlying files."""
        # the underlying file of this system, warm again (cheap when it already is; restores
        # it if anything dropped caches since the round began)
        warm(self.underlying(s, ds))
        if s != "raw":
            self.mount(s, ds)
        try:
            p = self.path(s, ds)
            pid = self.daemon_pid(self.mnt(s, ds)) if s in KLLM_MODES else None
            dcpu0 = process_cpu_seconds(pid) if pid else 0.0
            cpu0 = busy_seconds()
            n, dt = self.measure(metric, p)
            res[metric][s] = n / dt / MiB
            if metric == "seq":
                res["seq_s"][s] = dt
                # what reading costs the machine: reader, kernel and daemon together
                res["cpu_s_per_gib"][s] = (busy_seconds() - cpu0) / (n / 2**30)
                if pid:
                    res["daemon_cpu_s_per_gib"][s] = (process_cpu_seconds(pid) - dcpu0) / (n / 2**30)
                    if s == "kllm":
                        res["decode_ms"][s] = self.last_decode_ms(s, ds)
                self.measure_warm(s, ds, p, res)
        finally:
            if s != "raw":
                self.umount(s, ds)

    def open_test(self, s, ds, res):
        """open() of the shard on a fresh mount (in passthrough the whole decode happens
        here), and the time until its first 4 KiB arrive."""
        warm(self.underlying(s, ds))
        if s != "raw":
            self.mount(s, ds)
        try:
            p = self.path(s, ds)
            t0 = time.perf_counter()
            fd = os.open(p, os.O_RDONLY)
            t1 = time.perf_counter()
            try:
                first = os.pread(fd, 4096, 0)
                t2 = time.perf_counter()
            finally:
                os.close(fd)
            assert len(first) == 4096
            res["open_ms"][s] = (t1 - t0) * 1000
            res["ttfb_ms"][s] = (t2 - t0) * 1000
            if s == "kllm":
                res["open_decode_ms"][s] = self.last_decode_ms(s, ds)
        finally:
            if s != "raw":
                self.umount(s, ds)

    def tp_test(self, s, ds, world, res):
        """Tensor-parallel load: `world` processes at once, each reading its share of every
        tensor's rows, on a fresh mount; the daemon's CPU time (utime + stime) over it."""
        warm(self.underlying(s, ds))
        self.mount(s, ds)
        try:
            mnt = self.mnt(s, ds)
            pid = self.daemon_pid(mnt)
            cpu0 = process_cpu_seconds(pid)
            n, dt = tensor_parallel_load(self.path(s, ds), world)
            # releases reach the daemon after the readers' close; they cost it little
            cpu1 = process_cpu_seconds(pid)
            assert n == self.data[ds]["tensor_bytes"], (n, self.data[ds]["tensor_bytes"])
            res["tp_cpu_s"][s][world] = cpu1 - cpu0
            res["tp_mibps"][s][world] = n / dt / MiB
        finally:
            self.umount(s, ds)

    def verify_test(self, s, ds, verify, res):
        """Cold sequential read with the manifest in the sealed directory, checked
        (`--verify open`, the default) or not (`--verify off`)."""
        d = self.data[ds]
        manifest = os.path.join(d["sealed"], "kllm-manifest.json")
        with open(manifest, "w") as f:
            f.write(d["manifest_text"])
        try:
            warm(self.underlying(s, ds))
            self.mount(s, ds, extra=["--verify", "open" if verify else "off"])
            try:
                n, dt = read_seq(self.path(s, ds))
                st = kllm_status(self.mnt(s, ds))
            finally:
                self.umount(s, ds)
        finally:
            os.unlink(manifest)
        key = "on" if verify else "off"
        res["verify"][s][key] = n / dt / MiB
        res["verify_bytes"][s][key] = st.get("verified_bytes", 0)
        if verify and not st.get("verified_files"):
            raise SystemExit(f"bench: {s} did not verify {ds} against its manifest: {st}")
        if not verify and st.get("verified_files"):
            raise SystemExit(f"bench: {s} verified {ds} under --verify off: {st}")

    def one_round(self, r):
        rec = {"round": r, "datasets": {}, "ready": {}, "rss": {},
               "loadavg": os.getloadavg()[0], "disturbed": 0}
        t0 = time.time()
        drop_caches()
        self.warm_underlying()
        rot = r % len(SYSTEMS)
        order = SYSTEMS[rot:] + SYSTEMS[:rot]
        kllms = KLLMS if r % 2 == 0 else KLLMS[::-1]
        for ds, d in self.data.items():
            res = {m: {} for m in METRICS + ["warm", "warm_raw", "cpu_s_per_gib", "seq_s",
                                             "daemon_cpu_s_per_gib", "decode_ms", "open_ms",
                                             "ttfb_ms", "open_decode_ms"]}
            for k in ("tp_cpu_s", "tp_mibps", "verify", "verify_bytes"):
                res[k] = {s: {} for s in KLLMS}

            def undisturbed(what, measure):
                for _ in range(1 + RETRIES):
                    drops = drop_count()
                    measure()
                    if drop_count() == drops:
                        break
                    # another process dropped the page cache during the measurement
                    rec["disturbed"] += 1
                    log(f"round {r + 1} {ds} {what}: the page cache was dropped "
                        "by another process during the measurement; measuring again")

            for metric in METRICS:
                for s in order:
                    undisturbed(f"{metric} {s}", lambda: self.measure_one(metric, s, ds, res))
            undisturbed("warm ceiling", lambda: self.measure_warm_ceiling(ds, res))
            for s in order:
                undisturbed(f"open {s}", lambda: self.open_test(s, ds, res))
            worlds = (1, TP_WORLD) if r % 2 == 0 else (TP_WORLD, 1)
            for s in kllms:
                for world in worlds:
                    undisturbed(f"tensor-parallel {s} x{world}",
                                lambda: self.tp_test(s, ds, world, res))
            for s in kllms:
                for verify in ((True, False) if r % 2 == 0 else (False, True)):
                    undisturbed(f"verify {s} {verify}",
                                lambda: self.verify_test(s, ds, verify, res))
            rec["datasets"][ds] = res
            log(f"round {r + 1} {ds}: " + "; ".join(
                f"{m} " + " ".join(f"{s}={res[m][s]:.0f}" for s in SYSTEMS) for m in METRICS + ["warm"])
                + " MiB/s; open " + " ".join(f"{s}={res['open_ms'][s]:.1f}" for s in SYSTEMS)
                + " ms; tensor-parallel daemon CPU " + " ".join(
                    f"{s}={res['tp_cpu_s'][s][1]:.2f}/{res['tp_cpu_s'][s][TP_WORLD]:.2f}s"
                    for s in KLLMS)
                + "; verify on/off " + " ".join(
                    f"{s}={res['verify'][s]['on']:.0f}/{res['verify'][s]['off']:.0f}" for s in KLLMS)
                + f" MiB/s ({time.time() - t0:.0f} s)")
        for s in kllms:
            rec["rss"][s] = self.rss_test(s)
        rec["ready"] = self.ready_test()
        log(f"round {r + 1}: RSS peak " + ", ".join(
            f"{s} {rec['rss'][s]['private_max_mib']:.1f} MiB (backing {rec['rss'][s]['backing_mib']:.0f} MiB)"
            for s in KLLMS)
            + f" (budget {rec['rss']['kllm']['budget_mib']} MiB); ready "
            + " ".join(f"[{k}] {statistics.median(v) * 1000:.0f} ms" for k, v in rec["ready"].items())
            + f"; load {rec['loadavg']:.1f}; repeated {rec['disturbed']}; {time.time() - t0:.0f} s")
        return rec

    def rss_test(self, system):
        """Daemon memory of kllm-mount in mode `system` with a small --cache-size while
        reading 10x that much. VmRSS counts the daemon's own memory; in passthrough the
        decoded shard lives in private tmpfs memory (RssShmem while the daemon maps it to
        fill it), which `--status` reports as backing_bytes and is counted apart."""
        ds = "v2-bf16"
        size = os.path.getsize(self.path("raw", ds))
        budget = self.a.rss_budget_mib or max(2, min(64, size // (10 * MiB)))
        mnt = self.mount(system, ds, cache_size=f"{budget}M")
        pid = self.daemon_pid(mnt)
        path = self.path(system, ds)

        def status():
            v = {}
            with open(f"/proc/{pid}/status") as f:
                for line in f:
                    k, _, rest = line.partition(":")
                    if k in ("VmRSS", "VmHWM", "RssAnon", "RssFile", "RssShmem"):
                        v[k] = int(rest.split()[0]) / 1024.0  # kB -> MiB
            return v

        base = status()["VmRSS"]
        samples = []
        stop = threading.Event()

        def sampler():
            while not stop.is_set():
                samples.append(status())
                time.sleep(0.005)

        th = threading.Thread(target=sampler)
        th.start()
        length = min(size, 10 * budget * MiB)
        held = os.open(path, os.O_RDONLY)  # keeps the decoded backing alive for --status
        try:
            # 1: whole-block reads, 4 concurrent readers over 10x the budget
            n, dt = read_conc(path, 4, length)
            # 2: the kernel's copy of those pages dropped (clean pages of the mount's file),
            # one 4 KiB read in every MiB of the same range, in random order: partial-block
            # reads, which in FUSE mode go through the daemon's cache and make it evict
            os.posix_fadvise(held, 0, 0, os.POSIX_FADV_DONTNEED)
            scatter(path, 0, length)
            st = kllm_status(mnt)
        finally:
            stop.set()
            th.join()
            os.close(held)
        end = status()
        self.umount(system, ds)
        private = [x.get("RssAnon", 0) + x.get("RssFile", 0) for x in samples + [end]]
        return dict(budget_mib=budget, read_mib=n / MiB, base_mib=base,
                    sampled_max_mib=max(x["VmRSS"] for x in samples + [end]),
                    private_max_mib=max(private),
                    shmem_max_mib=max(x.get("RssShmem", 0) for x in samples + [end]),
                    hwm_mib=end["VmHWM"], mibps=n / dt / MiB,
                    backing_mib=st.get("backing_bytes", 0) / MiB,
                    cache_mib=st.get("cache_bytes", 0) / MiB)

    def ready_test(self):
        out = {}
        mnt = os.path.join(self.work, "mnt", "ready")
        os.makedirs(mnt, exist_ok=True)
        for rs in self.ready_sets:
            sealed = os.path.join(rs["dir"], "sealed")
            key = os.path.join(rs["dir"], "kllm.key")
            first = sorted(f for f in os.listdir(sealed) if f.endswith(".safetensors"))[0]
            cmd = [KLLM, sealed, mnt, "--key", key, *self.kllm_opts]
            # untimed: warms exactly what a mount reads (headers, metadata, trusted.kllm)
            run(cmd, timeout=120)
            self.mounts.add(mnt)
            unmount(mnt)
            times = []
            for _ in range(READY_REPS):
                t0 = time.perf_counter()
                run(cmd, timeout=120)
                os.stat(os.path.join(mnt, first))  # the mount answers a lookup
                times.append(time.perf_counter() - t0)
                unmount(mnt)
            out[rs["name"]] = times
        self.mounts.discard(mnt)
        return out


# ---------------------------------------------------------------- report


def med(xs):
    return statistics.median(xs) if xs else float("nan")


def fmt_ratio(xs):
    if not xs:
        return "n/a"
    return f"**{med(xs):.2f}x** ({min(xs):.2f}-{max(xs):.2f})"


def machine_info():
    cpu = "?"
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / (1 << 30)

    def ver(cmd):
        try:
            p = subprocess.run(cmd, capture_output=True, text=True, timeout=10)
            return (p.stdout or p.stderr).strip().splitlines()[0]
        except Exception:  # noqa: BLE001
            return "?"

    try:
        with open("/proc/sys/fs/fuse/max_pages_limit") as f:
            max_pages = f.read().strip()
    except OSError:
        max_pages = "?"
    commit = os.environ.get("KLLM_BENCH_LABEL") or ver(
        ["git", "-C", ROOT, "describe", "--always", "--dirty", "--abbrev=12"])
    if commit.startswith("fatal"):
        commit = "unknown (not a git checkout; set KLLM_BENCH_LABEL)"
    return dict(cpu=cpu, cores=os.cpu_count(), mem_gib=round(mem, 1), kernel=platform.release(),
                bindfs=ver(["bindfs", "--version"]), gocryptfs=ver(["gocryptfs", "-version"]),
                fusermount3=ver(["fusermount3", "--version"]), python=platform.python_version(),
                fuse_max_pages_limit=max_pages, commit=commit)


def fmt_med(xs, unit="", digits=1):
    xs = [x for x in xs if x is not None]
    if not xs:
        return "n/a"
    return f"{med(xs):.{digits}f}{unit} ({min(xs):.{digits}f}-{max(xs):.{digits}f})"


LABEL = {"kllm": "kllm (passthrough)", "kllm-fuse": "kllm-fuse"}


def report(b, info, decode_table, cmdline, started, elapsed):
    a = b.a
    rounds = b.rounds
    L = []
    w = L.append
    w(f"# kllm-mount benchmark results ({started})")
    w("")
    w(f"Command: `{cmdline}`  ")
    w(f"Build: `{info['commit']}`; {len(rounds)} rounds; run took {elapsed / 60:.1f} min.  ")
    w(f"Machine: {info['cpu']}, {info['cores']} cores, {info['mem_gib']} GiB RAM, Linux "
      f"{info['kernel']}, fuse max_pages_limit {info['fuse_max_pages_limit']}; "
      f"{info['bindfs']}; {info['gocryptfs'].split(';')[0]}; {info['fusermount3']}.  ")
    w(f"kllm: `--mode passthrough --cache-size {a.kllm_cache_size}` (the cache size is what "
      "keeps a decoded shard after its last close, so the warm re-read and later opens find "
      "it decoded); kllm-fuse: `--mode fuse` (default cache); extra options for both: "
      f"`{a.kllm_opts or '(none)'}`. "
      f"bindfs: `-r {a.bindfs_opts}`; gocryptfs: `-ro {a.gocryptfs_opts}`.  ")
    w("1-minute load average at the start of each round: "
      + ", ".join(f"{r['loadavg']:.1f}" for r in rounds)
      + f" ({info['cores']} cores){'; the bench ran at nice ' + str(a.nice) if a.nice else ''}.  ")
    w("Measurements repeated because another process dropped the page cache during them: "
      + ", ".join(str(r["disturbed"]) for r in rounds) + " (per round).")
    w("")

    def ratios(ds, metric, peer, num):
        out = []
        for r in rounds:
            res = r["datasets"][ds][metric]
            if res.get(peer) and res.get(num):
                out.append(res[num] / res[peer])
        return out

    def warm_ratios(ds, s):
        return [r["datasets"][ds]["warm"][s] / r["datasets"][ds]["warm_raw"][s] for r in rounds]

    def tp_ratios(ds, s):
        out = []
        for r in rounds:
            c = r["datasets"][ds]["tp_cpu_s"][s]
            if c.get(1):
                out.append(c[TP_WORLD] / c[1])
        return out

    def verify_ratios(ds, s):
        return [r["datasets"][ds]["verify"][s]["on"] / r["datasets"][ds]["verify"][s]["off"]
                for r in rounds]

    def verdict(xs, ok):
        if not xs:
            return "n/a", "-"
        return fmt_ratio(xs), ("met" if ok(med(xs)) else "**not met**")

    w("## Targets (medians of ratios paired round by round; min-max in parentheses)")
    w("")
    w("| data set | metric | target | kllm (passthrough) | met? | kllm-fuse | met? |")
    w("|---|---|---|---|---|---|---|")

    def row2(ds, metric, target, fn, ok):
        cells = []
        for s in KLLMS:
            cells += verdict(fn(s), ok)
        w(f"| {ds} | {metric} | {target} | " + " | ".join(cells) + " |")

    for ds in b.data:
        row2(ds, "cold sequential 1 MiB reads vs gocryptfs", ">= 1.5x",
             lambda s: ratios(ds, "seq", "gocryptfs", s), lambda x: x >= 1.5)
        row2(ds, "cold sequential 1 MiB reads vs bindfs", ">= 1.0x",
             lambda s: ratios(ds, "seq", "bindfs", s), lambda x: x >= 1.0)
        row2(ds, "mmap page-touch vs bindfs", ">= 1.0x",
             lambda s: ratios(ds, "mmap", "bindfs", s), lambda x: x >= 1.0)
        row2(ds, "warm re-read vs raw page-cache read", ">= 0.9x",
             lambda s: warm_ratios(ds, s), lambda x: x >= 0.9)
        row2(ds, "4 concurrent readers vs bindfs", ">= 1.0x",
             lambda s: ratios(ds, "conc", "bindfs", s), lambda x: x >= 1.0)
        row2(ds, f"tensor-parallel load: daemon CPU, {TP_WORLD} processes / 1", "<= 1.2x",
             lambda s: tp_ratios(ds, s), lambda x: x <= 1.2)
        row2(ds, "cold sequential, verify on / off (hashing overlapped)", ">= 0.9x",
             lambda s: verify_ratios(ds, s), lambda x: x >= 0.9)
        x = warm_ratios(ds, "bindfs-kc")
        w(f"| {ds} | reference: FUSE page cache (bindfs -o kernel_cache) warm re-read vs raw "
          f"| ceiling for FUSE-served reads | {fmt_ratio(x)} | - | | |")
    ready = {k: [x for r in rounds for x in r["ready"][k]] for k in rounds[0]["ready"]}
    small, large = med(ready["100 x small"]), med(ready["100 x large"])
    flat = large <= 1.25 * small or large - small < 0.010
    w(f"| 100 shards | time until the mount answers (default mode) | < 0.5 s | "
      f"**{small * 1000:.0f} ms** (small), **{large * 1000:.0f} ms** (large) | "
      f"{'met' if max(small, large) < 0.5 else '**not met**'} | | |")
    w(f"| 100 shards | mount ready flat in shard size | large ~ small | "
      f"large/small = {large / small:.2f} | {'met' if flat else '**not met**'} | | |")
    budget = rounds[0]["rss"]["kllm"]["budget_mib"]
    read_mib = rounds[0]["rss"]["kllm"]["read_mib"]
    cells = []
    for s in KLLMS:
        xs = [r["rss"][s]["private_max_mib"] for r in rounds]
        cells += [f"**{med(xs):.1f} MiB** (max {max(xs):.1f})",
                  "met" if med(xs) <= budget + 64 else "**not met**"]
    w(f"| v2-bf16 | daemon peak RSS (without decoded backing memory), 2 x {read_mib:.0f} MiB "
      f"read | <= {budget} + 64 MiB | " + " | ".join(cells) + " |")
    bf16 = decode_table.get("v2 float BF16") if decode_table else None
    if bf16 is not None:
        w(f"| decode kernel | BF16 lock-v2 decode, one core | >= 1 GB/s | **{bf16:.3f} GB/s** | "
          f"{'met' if bf16 >= 1.0 else '**not met**'} | | |")
    w("")

    names = {"seq": "cold sequential 1 MiB", "mmap": "cold mmap page-touch",
             "conc": "cold, 4 concurrent readers", "warm": "warm re-read"}
    w("## Throughput (MiB/s, median over rounds) and paired ratios")
    w("")
    for ds, d in b.data.items():
        w(f"### {ds}: {d['mib']} MiB shard, lock {d['lock']}, {d['dtype']}")
        w("")
        w("| metric | kllm | kllm-fuse | bindfs | gocryptfs | raw | kllm/bindfs | kllm/gocryptfs "
          "| kllm/raw | fuse/bindfs | fuse/gocryptfs | fuse/raw |")
        w("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
        for m in METRICS + ["warm"]:
            vals = {s: med([r["datasets"][ds][m][s] for r in rounds]) for s in SYSTEMS}
            cells = []
            for s in KLLMS:
                to_raw = warm_ratios(ds, s) if m == "warm" else ratios(ds, m, "raw", s)
                cells += [fmt_ratio(ratios(ds, m, "bindfs", s)),
                          fmt_ratio(ratios(ds, m, "gocryptfs", s)), fmt_ratio(to_raw)]
            w(f"| {names[m]} | " + " | ".join(f"{vals[s]:.0f}" for s in SYSTEMS) + " | "
              + " | ".join(cells) + " |")
        w("")
        cpu = {s: med([r["datasets"][ds]["cpu_s_per_gib"][s] for r in rounds]) for s in SYSTEMS}
        dcpu = {s: med([r["datasets"][ds]["daemon_cpu_s_per_gib"][s] for r in rounds]) for s in KLLMS}
        w("CPU time per GiB of cold sequential read, whole machine (all cores: reader, kernel, "
          "daemon): " + ", ".join(f"{s} {cpu[s]:.2f} s" for s in SYSTEMS)
          + "; of the kllm-mount daemon alone: "
          + ", ".join(f"{s} {dcpu[s]:.2f} s" for s in KLLMS)
          + ". Passthrough cold sequential read: decode of the whole shard at open (daemon "
          "log) " + fmt_med([r["datasets"][ds]["decode_ms"].get("kllm") for r in rounds], " ms", 0)
          + " of " + fmt_med([r["datasets"][ds]["seq_s"]["kllm"] * 1000 for r in rounds], " ms", 0)
          + " in all.")
        w("")
        w("Warm re-read vs raw page cache, each system: " + ", ".join(
            f"{s} {fmt_ratio(warm_ratios(ds, s))}" for s in SYSTEMS if s != "raw")
          + f", bindfs -o kernel_cache {fmt_ratio(warm_ratios(ds, 'bindfs-kc'))}.")
        w("")
    w("Cold: a fresh mount (FUSE page cache and the daemon's caches empty; in passthrough "
      "nothing decoded yet) over underlying files in the page cache; every time includes "
      "the open. Warm re-read: right after the cold sequential read closed the file, "
      f"{WARM_PASSES} more passes through the same mount (each opens it again), each followed "
      "by a raw read of the plain file (page cache, no FUSE); the ratio is median(mount "
      "passes) / median(raw passes), paired per round.")
    w("")

    w("## Open and first byte (fresh mount, ms; median over rounds, min-max)")
    w("")
    w("| data set | system | open() | open() + first 4 KiB read | daemon's decode (log) |")
    w("|---|---|---:|---:|---:|")
    for ds in b.data:
        for s in SYSTEMS:
            rs = [r["datasets"][ds] for r in rounds]
            dec = fmt_med([x["open_decode_ms"].get(s) for x in rs], "", 1) if s == "kllm" else "-"
            w(f"| {ds} | {s} | {fmt_med([x['open_ms'][s] for x in rs], '', 2)} | "
              f"{fmt_med([x['ttfb_ms'][s] for x in rs], '', 2)} | {dec} |")
    w("")
    w("In passthrough the first open decodes the whole shard (on all cores) before it "
      "returns; every later read is served by the kernel. Through FUSE the open returns at "
      "once and each read is decoded on request.")
    w("")

    w(f"## Tensor-parallel load ({TP_WORLD} processes vs 1, fresh mount each)")
    w("")
    w(f"Each of {TP_WORLD} processes, started together, opens the shard, parses its "
      "safetensors header and preads its quarter of the rows (first dimension) of every "
      "tensor in 1 MiB requests; against one process reading all rows. Daemon CPU is "
      "utime + stime of the kllm-mount daemon (/proc/PID/stat) before and after.")
    w("")
    w("| data set | mode | daemon CPU, 1 process | daemon CPU, "
      f"{TP_WORLD} processes | CPU {TP_WORLD}/1 (paired) | MiB/s, 1 process | MiB/s, {TP_WORLD} processes |")
    w("|---|---|---:|---:|---:|---:|---:|")
    for ds in b.data:
        for s in KLLMS:
            rs = [r["datasets"][ds] for r in rounds]
            w(f"| {ds} | {LABEL[s]} | {fmt_med([x['tp_cpu_s'][s][1] for x in rs], ' s', 2)} | "
              f"{fmt_med([x['tp_cpu_s'][s][TP_WORLD] for x in rs], ' s', 2)} | "
              f"{fmt_ratio(tp_ratios(ds, s))} | {med([x['tp_mibps'][s][1] for x in rs]):.0f} | "
              f"{med([x['tp_mibps'][s][TP_WORLD] for x in rs]):.0f} |")
    w("")

    w("## Integrity: cold sequential read, verification on vs off")
    w("")
    w("A kLLM catalog manifest (`kllm-manifest.json`, SHA-256 of every sealed file) in the "
      "sealed directory; `--verify open` (the default: each file checked on first use) vs "
      "`--verify off`; fresh mount each; the time includes the open.")
    w("")
    w("| data set | mode | verify off (MiB/s) | verify on (MiB/s) | on / off (paired) | bytes hashed (on) |")
    w("|---|---|---:|---:|---:|---:|")
    for ds in b.data:
        for s in KLLMS:
            rs = [r["datasets"][ds] for r in rounds]
            w(f"| {ds} | {LABEL[s]} | {med([x['verify'][s]['off'] for x in rs]):.0f} | "
              f"{med([x['verify'][s]['on'] for x in rs]):.0f} | {fmt_ratio(verify_ratios(ds, s))} | "
              f"{med([x['verify_bytes'][s]['on'] for x in rs]) / MiB:.0f} MiB |")
    w("")

    w("## Mount ready (kllm-mount started until a lookup in the mount answers; median of all timed mounts, min-max)")
    w("")
    w("| shards | shard sizes | total (apparent) | ready |")
    w("|---|---|---:|---:|")
    for rs in b.ready_sets:
        xs = ready[rs["name"]]
        w(f"| {rs['count']} | {rs['label']}: {rs['sizes']}{' (sparse files)' if rs['sparse'] else ''} | "
          f"{rs['total_mib'] / 1024:.1f} GiB | {med(xs) * 1000:.1f} ms ({min(xs) * 1000:.1f}-{max(xs) * 1000:.1f}) |")
    w("")
    w(f"Default mode (`{a.kllm_opts or 'no options'}`; passthrough as root). Each shard has "
      f"{a.ready_tensors} locked BF16 tensors. Each round: one untimed mount per set (warms "
      f"the headers), then {READY_REPS} timed mounts; the table pools the "
      f"{READY_REPS * len(rounds)} timed mounts of all rounds. Flat in shard size means the "
      "large sets' median is within 25% (or 10 ms) of the small sets'.")
    w("")
    w("## Daemon memory")
    w("")
    w(f"Each mode with `--cache-size {budget}M`, a fresh mount each round: 4 concurrent "
      f"readers over the first {read_mib:.0f} MiB of the v2 shard; then, after "
      "`posix_fadvise(DONTNEED)`, one 4 KiB read in every MiB of the same range in random "
      "order by 4 threads (through FUSE: partial-block reads, which go through the daemon's "
      "cache). The daemon's RssAnon + RssFile sampled every 5 ms (its own memory); in "
      "passthrough the decoded shard is private tmpfs memory, counted in RssShmem only while "
      "the daemon maps it to fill it (so VmHWM includes it), and reported by `--status` as "
      "backing_bytes (taken while the file is open). The MiB/s column is the first phase's "
      "(in passthrough after the decode: the descriptor held open for `--status` opens the "
      "file first).")
    w("")
    w("| round | mode | RSS after mount | peak RssAnon+RssFile | peak RssShmem | VmHWM | backing_bytes | read MiB/s |")
    w("|---|---|---:|---:|---:|---:|---:|---:|")
    for i, r in enumerate(rounds):
        for s in KLLMS:
            x = r["rss"][s]
            w(f"| {i + 1} | {LABEL[s]} | {x['base_mib']:.1f} MiB | {x['private_max_mib']:.1f} MiB | "
              f"{x['shmem_max_mib']:.1f} MiB | {x['hwm_mib']:.1f} MiB | {x['backing_mib']:.0f} MiB | "
              f"{x['mibps']:.0f} |")
    w("")
    if decode_table is not None:
        w("## Decode kernel (`cargo bench --bench decode`)")
        w("")
        w(decode_table["_text"].strip())
        w("")
    w("## Per-round values (MiB/s)")
    w("")
    w("| round | data set | metric | " + " | ".join(SYSTEMS) + " |")
    w("|---|---|---|" + "---:|" * len(SYSTEMS))
    for r in rounds:
        for ds, res in r["datasets"].items():
            for m in METRICS + ["warm"]:
                w(f"| {r['round'] + 1} | {ds} | {m} | " + " | ".join(f"{res[m][s]:.0f}" for s in SYSTEMS) + " |")
    w("")
    return "\n".join(L) + "\n"


def run_decode_bench():
    log("decode kernel: cargo bench --bench decode")
    p = subprocess.run(["cargo", "bench", "--quiet", "--bench", "decode"], cwd=ROOT,
                       capture_output=True, text=True)
    if p.returncode != 0:
        log(p.stderr[-2000:])
        return None
    text = p.stdout
    table = {"_text": text}
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 6 and cells[0].startswith(("v1", "v2")):
            try:
                table[cells[0]] = float(cells[3])
            except ValueError:
                pass
    log(text)
    return table


def main():
    ap = argparse.ArgumentParser(prog="scripts/bench", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true",
                    help="a fast check of the script: 256 MiB (v1: 128 MiB), 2 rounds")
    ap.add_argument("--rounds", type=int, help="rounds (default 5; --quick 2)")
    ap.add_argument("--mib", type=int, help="size of the lock-v2 BF16 shard in MiB (default 1024)")
    ap.add_argument("--v1-mib", type=int,
                    help="size of the lock-v1 F32/F8 shard in MiB (default 512; 0 skips it)")
    ap.add_argument("--ready-tensors", type=int, default=64,
                    help="tensors per shard in the mount-ready sets (default 64)")
    ap.add_argument("--rss-budget-mib", type=int, default=0,
                    help="--cache-size of the RSS test (default 64, less for small shards so "
                         "that 10x the budget fits in the shard)")
    ap.add_argument("--kllm-opts", default="",
                    help="extra kllm-mount arguments for both modes (quoted)")
    ap.add_argument("--kllm-cache-size", default="2G",
                    help="--cache-size of kllm in passthrough mode: decoded shards kept after "
                         "their last close (default 2G, at least the data sets' size, so the "
                         "warm re-read finds the shard decoded); kllm-fuse keeps its default")
    ap.add_argument("--bindfs-opts", default="", help="extra bindfs arguments (quoted)")
    ap.add_argument("--gocryptfs-opts", default="", help="extra gocryptfs arguments (quoted)")
    ap.add_argument("--nice", type=int, default=0,
                    help="run the bench (and the daemons it starts) at this niceness, e.g. "
                         "-10 on a machine others load (default: unchanged)")
    ap.add_argument("--no-decode", action="store_true", help="skip cargo bench --bench decode")
    ap.add_argument("--out", help="results file (default target/bench/results-<time>.md; "
                                  "a .json of every value is written beside it)")
    ap.add_argument("--keep", action="store_true", help="keep the work directory")
    ap.add_argument("--skip-build", action="store_true", help="(handled by scripts/bench)")
    a = ap.parse_args()
    a.rounds = a.rounds or (2 if a.quick else 5)
    a.mib = a.mib or (256 if a.quick else 1024)
    if a.v1_mib is None:
        a.v1_mib = 128 if a.quick else 512
    if os.geteuid() != 0:
        raise SystemExit("scripts/bench: run as root (it drops the page cache)")
    for tool in (KLLM, GEN):
        if not os.access(tool, os.X_OK):
            raise SystemExit(f"scripts/bench: {tool} is missing (cargo build --release "
                             "--bin kllm-mount --example bench-shard)")
    started = datetime.datetime.now().strftime("%Y-%m-%d %H:%M:%S")
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    out = a.out or os.path.join(TARGET, "bench", f"results-{stamp}.md")
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    a.work = tempfile.mkdtemp(prefix="kllm-bench.", dir=os.environ.get("TMPDIR", "/tmp"))
    cmdline = "scripts/bench " + " ".join(sys.argv[1:])
    b = Bench(a)

    def cleanup(*_):
        b.unmount_all()
        for d in os.listdir(os.path.join(a.work, "mnt")) if os.path.isdir(os.path.join(a.work, "mnt")) else []:
            unmount(os.path.join(a.work, "mnt", d))
        if a.keep:
            log(f"work directory kept: {a.work}")
        else:
            shutil.rmtree(a.work, ignore_errors=True)

    def on_signal(sig, _frame):
        cleanup()
        raise SystemExit(128 + sig)

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    become_subreaper()
    if a.nice:
        os.nice(a.nice)
    t0 = time.time()
    try:
        log(f"bench: work directory {a.work}; {a.rounds} rounds; v2 {a.mib} MiB, v1 {a.v1_mib} MiB")
        decode = None if a.no_decode else run_decode_bench()
        b.make_data()
        for r in range(a.rounds):
            b.rounds.append(b.one_round(r))
        info = machine_info()
        text = report(b, info, decode, cmdline, started, time.time() - t0)
        with open(out, "w") as f:
            f.write(text)
        with open(os.path.splitext(out)[0] + ".json", "w") as f:
            json.dump(dict(info=info, args=vars(a), rounds=b.rounds, ready_sets=b.ready_sets,
                           data={k: {kk: vv for kk, vv in v.items() if kk != "cipher_files"}
                                 for k, v in b.data.items()},
                           decode=decode), f, indent=1)
        print(text)
        log(f"bench: results written to {out} ({(time.time() - t0) / 60:.1f} min)")
    finally:
        cleanup()


if __name__ == "__main__":
    main()
