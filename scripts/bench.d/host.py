"""The machine under scripts/bench: paths and constants, page-cache control, CPU
accounting, and mounting and unmounting FUSE file systems (Python standard library only)."""

import json
import os
import subprocess
import sys
import time

MiB = 1 << 20
READ = 1 << 20  # the readers' request size
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# Where cargo builds (CARGO_TARGET_DIR, a cargo config's target-dir, else target/).
TARGET = subprocess.run([os.path.join(ROOT, "scripts", "target-dir")], check=True,
                        capture_output=True, text=True).stdout.strip()
KLLM = os.path.join(TARGET, "release", "kllm-mount")
GEN = os.path.join(TARGET, "release", "examples", "bench-shard")
# kllm-mount with its default options (--mode auto: passthrough as root), and with every
# read through the daemon; then the peers; "raw" is the plain file, no FUSE
KLLM_MODES = {"kllm": None, "kllm-fuse": "fuse"}
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


def busy_seconds():
    """CPU time spent by the whole machine, all cores (user, nice, system, irq, softirq)."""
    with open("/proc/stat") as f:
        t = [int(x) for x in f.readline().split()[1:8]]
    return (t[0] + t[1] + t[2] + t[5] + t[6]) / os.sysconf("SC_CLK_TCK")


def process_cpu_seconds(pid):
    """utime + stime of process `pid`, all its threads (/proc/PID/stat)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def kllm_status(mnt):
    """`kllm-mount --status MNT` as a dict."""
    p = run([KLLM, "--status", mnt], capture_output=True, text=True, timeout=30, check=False)
    if p.returncode != 0:
        raise RuntimeError(f"kllm-mount --status {mnt} failed ({p.returncode}): "
                           f"{p.stderr.strip()}; mountinfo: "
                           + " ".join(l.split()[4] for l in open("/proc/self/mountinfo")
                                      if mnt in l))
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


def catalog_manifest(sealed):
    """kLLM's catalog manifest (kllm-manifest.json) of the directory `sealed`: the SHA-256
    of every file under it, by path."""
    files = {}
    for r, _, fs in os.walk(sealed):
        for f in fs:
            full = os.path.join(r, f)
            files[os.path.relpath(full, sealed)] = sha256_file(full)
    return json.dumps({"format": "kllm-catalog", "version": 1, "files": dict(sorted(files.items()))},
                      indent=2)


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


OWN_DROPS = [0]  # drops of the page cache by this process (the cold measurements')


def drop_caches():
    os.sync()
    with open("/proc/sys/vm/drop_caches", "w") as f:
        f.write("3\n")
    OWN_DROPS[0] += 1


def foreign_drop_count():
    """How often another process dropped the page cache since boot."""
    return drop_count() - OWN_DROPS[0]


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


def fs_type(path):
    """The type of the file system holding `path` (its longest mount point prefix)."""
    real, best, kind = os.path.realpath(path), "", "?"
    with open("/proc/self/mountinfo") as f:
        for line in f:
            fields = line.split()
            mnt, fstype = fields[4], fields[fields.index("-") + 1]
            if (real == mnt or real.startswith(mnt.rstrip("/") + "/")) and len(mnt) >= len(best):
                best, kind = mnt, fstype
    return kind
