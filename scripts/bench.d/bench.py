#!/usr/bin/env python3
"""The driver of scripts/bench (Python 3 standard library only). See scripts/bench --help
and docs/PERFORMANCE.md.

Per round, for each data set (a lock-v2 BF16 shard, a lock-v1 F32/F8 shard), after dropping
every cache and re-reading the underlying files (sealed shard, plain shard, gocryptfs cipher
file) into the page cache:
  for each cold metric (sequential 1 MiB reads, mmap page-touch, 4 concurrent readers), for
  each system in an order rotated round by round (kllm-mount, bindfs, gocryptfs, and "raw":
  the plain file read directly from the page cache): mount it fresh (its own caches and the
  FUSE page cache are then cold), measure, unmount. Right after the cold sequential read the
  same file is read again through the same mount: the warm re-read.
Then the kllm-mount daemon's RSS while reading 10x its cache budget, and the time until a
fresh kllm-mount answers for 1, 10 and 100 shards of small and of large sizes.
Ratios are paired within a round (kllm-mount / peer, measured minutes apart on the same
machine state) and reported as medians over rounds.
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
SYSTEMS = ["kllm", "bindfs", "gocryptfs", "raw"]
METRICS = ["seq", "mmap", "conc"]
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
    """Sequential READ-byte preads into one buffer; returns (bytes, seconds)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size
        end = size if length is None else min(size, start + length)
        buf = bytearray(READ)
        mv = memoryview(buf)
        t0 = time.perf_counter()
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
    mmap load does); returns (bytes, seconds)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size
        t0 = time.perf_counter()
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

    def mount(self, system, ds, extra=()):
        d = self.data[ds]
        mnt = self.mnt(system, ds)
        os.makedirs(mnt, exist_ok=True)
        unmount(mnt)
        if system == "kllm":
            cmd = [KLLM, d["sealed"], mnt, "--key", d["key"],
                   "--log-file", os.path.join(self.work, "logs", f"kllm-{ds}.log"),
                   *self.kllm_opts, *extra]
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
        run(cmd, timeout=120)
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
        if system == "kllm":
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
            cpu0 = busy_seconds()
            n, dt = self.measure(metric, p)
            res[metric][s] = n / dt / MiB
            if metric == "seq":
                # what reading costs the machine: reader, kernel and daemon together
                res.setdefault("cpu_s_per_gib", {})[s] = (busy_seconds() - cpu0) / (n / 2**30)
            if metric == "seq":
                self.measure_warm(s, ds, p, res)
        finally:
            if s != "raw":
                self.umount(s, ds)

    def one_round(self, r):
        rec = {"round": r, "datasets": {}, "ready": {}, "rss": None,
               "loadavg": os.getloadavg()[0], "disturbed": 0}
        t0 = time.time()
        drop_caches()
        self.warm_underlying()
        rot = r % len(SYSTEMS)
        order = SYSTEMS[rot:] + SYSTEMS[:rot]
        for ds, d in self.data.items():
            res = {m: {} for m in METRICS + ["warm", "warm_raw"]}
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
            rec["datasets"][ds] = res
            log(f"round {r + 1} {ds}: " + "; ".join(
                f"{m} " + " ".join(f"{s}={res[m][s]:.0f}" for s in SYSTEMS) for m in METRICS + ["warm"])
                + f" MiB/s ({time.time() - t0:.0f} s)")
        rec["rss"] = self.rss_test()
        rec["ready"] = self.ready_test()
        log(f"round {r + 1}: RSS peak {rec['rss']['hwm_mib']:.1f} MiB (budget "
            f"{rec['rss']['budget_mib']} MiB); ready "
            + " ".join(f"[{k}] {statistics.median(v) * 1000:.0f} ms" for k, v in rec["ready"].items())
            + f"; load {rec['loadavg']:.1f}; repeated {rec['disturbed']}; {time.time() - t0:.0f} s")
        return rec

    def rss_test(self):
        ds = "v2-bf16"
        size = os.path.getsize(self.path("raw", ds))
        budget = self.a.rss_budget_mib or max(2, min(64, size // (10 * MiB)))
        mnt = self.mount("kllm", ds, extra=["--cache-size", f"{budget}M"])
        pids = [p for p in pids_for(mnt) if "kllm-mount" in open(f"/proc/{p}/cmdline", "rb").read().decode(errors="replace")]
        if len(pids) != 1:
            raise SystemExit(f"bench: cannot find the kllm-mount daemon of {mnt} ({pids})")
        pid = pids[0]

        def status(field):
            with open(f"/proc/{pid}/status") as f:
                for line in f:
                    if line.startswith(field + ":"):
                        return int(line.split()[1]) / 1024.0  # kB -> MiB
            return 0.0

        base = status("VmRSS")
        samples = []
        stop = threading.Event()

        def sampler():
            while not stop.is_set():
                samples.append(status("VmRSS"))
                time.sleep(0.005)

        th = threading.Thread(target=sampler)
        th.start()
        length = min(size, 10 * budget * MiB)
        try:
            # 1: whole-block reads, 4 concurrent readers over 10x the budget
            n, dt = read_conc(self.path("kllm", ds), 4, length)
            # 2: the kernel's copy of those pages dropped (clean pages of the mount's file),
            # one 4 KiB read in every MiB of the same range, in random order: partial-block
            # reads, which go through the daemon's cache and make it evict
            fd = os.open(self.path("kllm", ds), os.O_RDONLY)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            os.close(fd)
            scatter(self.path("kllm", ds), 0, length)
        finally:
            stop.set()
            th.join()
        hwm = status("VmHWM")
        self.umount("kllm", ds)
        return dict(budget_mib=budget, read_mib=n / MiB, base_mib=base,
                    sampled_max_mib=max(samples or [0]), hwm_mib=hwm, mibps=n / dt / MiB)

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
    w(f"kllm-mount options: `{a.kllm_opts or '(defaults)'}`; bindfs: `-r {a.bindfs_opts}`; "
      f"gocryptfs: `-ro {a.gocryptfs_opts}`.  ")
    w("1-minute load average at the start of each round: "
      + ", ".join(f"{r['loadavg']:.1f}" for r in rounds)
      + f" ({info['cores']} cores){'; the bench ran at nice ' + str(a.nice) if a.nice else ''}.  ")
    w("Measurements repeated because another process dropped the page cache during them: "
      + ", ".join(str(r["disturbed"]) for r in rounds) + " (per round).")
    w("")

    def ratios(ds, metric, peer, num="kllm"):
        out = []
        for r in rounds:
            res = r["datasets"][ds][metric]
            if res.get(peer) and res.get(num):
                out.append(res[num] / res[peer])
        return out

    def warm_ratios(ds, s="kllm"):
        return [r["datasets"][ds]["warm"][s] / r["datasets"][ds]["warm_raw"][s] for r in rounds]

    # targets
    w("## Targets (medians of ratios paired round by round; min-max in parentheses)")
    w("")
    w("| data set | metric | target | result | met? |")
    w("|---|---|---|---|---|")

    def row(ds, metric, target, xs, ok):
        w(f"| {ds} | {metric} | {target} | {xs} | {'met' if ok else '**not met**'} |")

    for ds in b.data:
        x = ratios(ds, "seq", "gocryptfs")
        row(ds, "cold sequential 1 MiB reads vs gocryptfs", ">= 1.5x", fmt_ratio(x), med(x) >= 1.5)
        x = ratios(ds, "seq", "bindfs")
        row(ds, "cold sequential 1 MiB reads vs bindfs", ">= 1.0x", fmt_ratio(x), med(x) >= 1.0)
        x = ratios(ds, "mmap", "bindfs")
        row(ds, "mmap page-touch vs bindfs", ">= 1.0x", fmt_ratio(x), med(x) >= 1.0)
        x = warm_ratios(ds)
        row(ds, "warm re-read vs raw page-cache read", ">= 0.8x", fmt_ratio(x), med(x) >= 0.8)
        x = warm_ratios(ds, "bindfs-kc")
        w(f"| {ds} | reference: warm re-read of the FUSE page cache itself (bindfs -o "
          f"kernel_cache) vs raw | (ceiling for any FUSE daemon) | {fmt_ratio(x)} | - |")
        x = [r["datasets"][ds]["warm"]["kllm"] / r["datasets"][ds]["warm"]["bindfs-kc"]
             for r in rounds]
        w(f"| {ds} | warm re-read vs that ceiling | - | {fmt_ratio(x)} | - |")
    # every timed mount of every round, pooled (ready times are a few scheduler ticks, so
    # a pooled median is steadier than a median of per-round medians)
    ready = {k: [x for r in rounds for x in r["ready"][k]] for k in rounds[0]["ready"]}
    small, large = med(ready["100 x small"]), med(ready["100 x large"])
    row("100 shards", "time until the mount answers", "< 0.5 s",
        f"**{small * 1000:.0f} ms** (small shards), **{large * 1000:.0f} ms** (large shards)",
        max(small, large) < 0.5)
    flat = large <= 1.25 * small or large - small < 0.010
    row("100 shards", "mount ready flat in shard size", "large ~ small",
        f"large/small = {large / small:.2f}", flat)
    rss = [r["rss"] for r in rounds]
    hwm = med([x["hwm_mib"] for x in rss])
    budget = rss[0]["budget_mib"]
    row("v2-bf16", f"daemon peak RSS reading 2 x {rss[0]['read_mib']:.0f} MiB", f"<= {budget} + 64 MiB",
        f"**{hwm:.1f} MiB** (max {max(x['hwm_mib'] for x in rss):.1f})", hwm <= budget + 64)
    bf16 = decode_table.get("v2 float BF16") if decode_table else None
    if bf16 is not None:
        row("decode kernel", "BF16 lock-v2 decode, one core", ">= 1 GB/s", f"**{bf16:.3f} GB/s**",
            bf16 >= 1.0)
    w("")

    # throughput details
    w("## Throughput (MiB/s, median over rounds) and paired ratios")
    w("")
    for ds, d in b.data.items():
        w(f"### {ds}: {d['mib']} MiB shard, lock {d['lock']}, {d['dtype']}")
        w("")
        w("| metric | kllm-mount | bindfs | gocryptfs | raw page cache | kllm/bindfs | kllm/gocryptfs | kllm/raw |")
        w("|---|---:|---:|---:|---:|---:|---:|---:|")
        names = {"seq": "cold sequential 1 MiB", "mmap": "cold mmap page-touch",
                 "conc": "cold, 4 concurrent readers", "warm": "warm re-read (2nd pass)"}
        for m in METRICS + ["warm"]:
            vals = {s: med([r["datasets"][ds][m][s] for r in rounds]) for s in SYSTEMS}
            to_raw = warm_ratios(ds) if m == "warm" else ratios(ds, m, "raw")
            w(f"| {names[m]} | {vals['kllm']:.0f} | {vals['bindfs']:.0f} | {vals['gocryptfs']:.0f} | "
              f"{vals['raw']:.0f} | {fmt_ratio(ratios(ds, m, 'bindfs'))} | "
              f"{fmt_ratio(ratios(ds, m, 'gocryptfs'))} | {fmt_ratio(to_raw)} |")
        w("")
        cpu = {s: med([r["datasets"][ds]["cpu_s_per_gib"][s] for r in rounds]) for s in SYSTEMS}
        w("CPU time of the whole machine (all cores: reader, kernel, daemon) per GiB of cold "
          "sequential read, median: " + ", ".join(f"{s} {cpu[s]:.2f} s" for s in SYSTEMS)
          + f" ({info['cores']} cores).")
        w("")
        w("Warm re-read vs raw page cache, each system: " + ", ".join(
            f"{s} {fmt_ratio(warm_ratios(ds, s))}" for s in SYSTEMS if s != "raw")
          + f", bindfs -o kernel_cache {fmt_ratio(warm_ratios(ds, 'bindfs-kc'))}.")
        w("")
    w("Cold: a fresh mount (FUSE page cache and the daemon's caches empty) over underlying "
      "files in the page cache. Warm re-read: right after the cold sequential read, "
      f"{WARM_PASSES} more passes through the same mount, each followed by a raw read of "
      "the plain file (page cache, no FUSE); the ratio is median(mount passes) / "
      "median(raw passes), paired per round.")
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
    w(f"Each shard has {a.ready_tensors} locked BF16 tensors. Each round: one untimed mount "
      f"per set (warms the headers), then {READY_REPS} timed mounts; the table pools the "
      f"{READY_REPS * len(rounds)} timed mounts of all rounds. Flat in shard size means the "
      "large sets' median is within 25% (or 10 ms) of the small sets'.")
    w("")
    w("## Daemon memory")
    w("")
    w(f"kllm-mount with `--cache-size {budget}M` (a fresh mount each round): 4 concurrent "
      f"readers over the first {rss[0]['read_mib']:.0f} MiB of the v2 shard (whole-block "
      "reads); then, after `posix_fadvise(DONTNEED)` dropped the kernel's copy, one 4 KiB "
      "read in every MiB of the same range, in random order by 4 threads (partial-block "
      "reads, which go through the daemon's cache). The MiB/s column is the first phase's.")
    w("")
    w("| round | RSS after mount | max sampled VmRSS | VmHWM | read MiB/s |")
    w("|---|---:|---:|---:|---:|")
    for i, x in enumerate(rss):
        w(f"| {i + 1} | {x['base_mib']:.1f} MiB | {x['sampled_max_mib']:.1f} MiB | {x['hwm_mib']:.1f} MiB | {x['mibps']:.0f} |")
    w("")
    if decode_table is not None:
        w("## Decode kernel (`cargo bench --bench decode`)")
        w("")
        w(decode_table["_text"].strip())
        w("")
    w("## Per-round values (MiB/s)")
    w("")
    w("| round | data set | metric | kllm | bindfs | gocryptfs | raw |")
    w("|---|---|---|---:|---:|---:|---:|")
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
    ap.add_argument("--kllm-opts", default="", help="extra kllm-mount arguments (quoted)")
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
