"""Load time as users see it (issue #17): the measurements of scripts/bench that start from
a cold disk or a fresh mount and end where a user's wait ends.

- true cold: every cache dropped (`echo 3 > drop_caches`), the system mounted, then the
  whole shard read through it (open and first 4 KiB timed apart); against the plain file
  read directly from the disk, bindfs and gocryptfs, on the same disk;
- 5 s between mounting and the first open (an engine importing), then the same read;
- a loader's view, true cold: header then every tensor by pread, by mmap, by O_DIRECT
  preads (fastsafetensors) and by fio's io_uring engine with O_DIRECT (InstantTensor);
- a sharded checkpoint, true cold: every shard read in load order at once and 5 s after the
  mount, against the same files read directly from the disk;
- engine start (engines.py): kllm-mount started until a model is loaded.
"""

import json
import os
import shutil
import subprocess
import time

from host import MiB, drop_caches, log
from readers import load_tensors_direct, load_tensors_mmap, load_tensors_pread, read_seq_first

COLD_SYSTEMS = ["kllm", "kllm-fuse", "bindfs", "gocryptfs", "raw"]
DELAYED_SYSTEMS = ["kllm", "kllm-fuse"]
DELAY_S = 5.0  # an engine importing between mounting and its first open
LOADER_SYSTEMS = ["kllm", "kllm-fuse", "raw"]
SHARDED_SYSTEMS = ["kllm", "kllm-fuse", "raw"]
SHARDED_COUNT = 4  # a checkpoint as engines load most: several shards, in the index's order
LOADER_PATTERNS = ["pread", "mmap", "o_direct", "io_uring"]
LOADERS = {"pread": load_tensors_pread, "mmap": load_tensors_mmap,
           "o_direct": load_tensors_direct}


def fio_io_uring(path):
    """fio reading the whole file with io_uring and O_DIRECT, 16 MiB requests, 8 in flight
    (InstantTensor's way); returns (bytes, wall seconds of the fio process, its open
    included). Raises OSError when fio fails (e.g. the file system refuses O_DIRECT)."""
    size = os.path.getsize(path)
    t0 = time.perf_counter()
    p = subprocess.run(["fio", "--name=load", f"--filename={path}", "--readonly",
                        "--ioengine=io_uring", "--direct=1", "--rw=read", "--bs=16m",
                        "--iodepth=8", f"--size={size}", "--output-format=json"],
                       capture_output=True, text=True, timeout=600)
    dt = time.perf_counter() - t0
    if p.returncode != 0:
        raise OSError(f"fio: {(p.stderr or p.stdout).strip().splitlines()[-1:]}")
    job = json.loads(p.stdout[p.stdout.index("{"):])["jobs"][0]
    return job["read"]["io_bytes"], dt


def mounted_cold(b, s, ds):
    """Drop every cache, then mount system `s` fresh (what the daemon reads at mount comes
    from the disk too); returns the path of the shard."""
    drop_caches()
    if s != "raw":
        b.mount(s, ds)
    return b.path(s, ds)


def true_cold(b, s, ds, res):
    """The whole shard read right after a cold mount: MiB/s and the first 4 KiB (ms)."""
    p = mounted_cold(b, s, ds)
    try:
        n, dt, first = read_seq_first(p)
    finally:
        if s != "raw":
            b.umount(s, ds)
    res["cold_disk"][s] = n / dt / MiB
    res["cold_first_ms"][s] = first * 1000


def delayed_open(b, s, ds, res):
    """Cold mount, DELAY_S seconds of nothing, then the whole shard read (open included)."""
    p = mounted_cold(b, s, ds)
    try:
        time.sleep(DELAY_S)
        n, dt, first = read_seq_first(p)
    finally:
        b.umount(s, ds)
    res["delayed"][s] = n / dt / MiB
    res["delayed_first_ms"][s] = first * 1000


def loader_view(b, s, ds, pattern, res):
    """One loader pattern, true cold, on a fresh mount: MiB/s of tensor bytes, or the
    error (as text) where the pattern cannot run there."""
    p = mounted_cold(b, s, ds)
    try:
        if pattern == "io_uring":
            n, dt = fio_io_uring(p)
        else:
            n, dt = LOADERS[pattern](p)
        res["loader"][pattern][s] = n / dt / MiB
    except OSError as e:
        res["loader"][pattern][s] = None
        res["loader_error"].setdefault(pattern, {})[s] = f"{type(e).__name__}: {e}"[:160]
    finally:
        if s != "raw":
            b.umount(s, ds)


def sharded_read(b, s, delay, res):
    """The sharded checkpoint, true cold: every cache dropped, system `s` mounted fresh (raw:
    the sealed files themselves, as many bytes on the same disk as the plain ones), `delay`
    seconds of nothing, then every shard read in load order as one shard is read above;
    MiB/s over them all, into res["at once" or "delayed"][s]."""
    d = b.sharded
    drop_caches()
    root = d["sealed"] if s == "raw" else b.mount(s, "sharded")
    try:
        time.sleep(delay)
        t0 = time.perf_counter()
        n = sum(read_seq_first(os.path.join(root, f))[0] for f in d["files"])
        dt = time.perf_counter() - t0
    finally:
        if s != "raw":
            b.umount(s, "sharded")
    res["delayed" if delay else "at once"][s] = n / dt / MiB


def sharded_round(b, r):
    """Round `r` of the sharded checkpoint's reads, the systems' order alternated."""
    res = {"at once": {}, "delayed": {}}
    order = SHARDED_SYSTEMS if r % 2 == 0 else SHARDED_SYSTEMS[::-1]
    for s in order:
        sharded_read(b, s, 0, res)
    for s in order:
        if s != "raw":
            sharded_read(b, s, DELAY_S, res)
    return res


def loader_patterns():
    """The loader patterns this machine can run (io_uring needs fio)."""
    if shutil.which("fio"):
        return LOADER_PATTERNS
    log("loader view: fio is missing (apt-get install fio); io_uring skipped")
    return [p for p in LOADER_PATTERNS if p != "io_uring"]


def new_results():
    return {"cold_disk": {}, "cold_first_ms": {}, "delayed": {}, "delayed_first_ms": {},
            "loader": {p: {} for p in LOADER_PATTERNS}, "loader_error": {}}


def one_round(b, r, ds, res, undisturbed, loader=True):
    """Round `r` of the cold measurements of data set `ds`, the systems' order rotated."""
    rot = r % len(COLD_SYSTEMS)
    order = COLD_SYSTEMS[rot:] + COLD_SYSTEMS[:rot]
    res.update(new_results())
    for s in order:
        undisturbed(f"true cold {s}", lambda: true_cold(b, s, ds, res))
    for s in (DELAYED_SYSTEMS if r % 2 == 0 else DELAYED_SYSTEMS[::-1]):
        undisturbed(f"{DELAY_S:.0f} s delayed open {s}", lambda: delayed_open(b, s, ds, res))
    if loader:
        lo = [s for s in order if s in LOADER_SYSTEMS]
        for pattern in loader_patterns():
            for s in lo:
                undisturbed(f"loader {pattern} {s}",
                            lambda: loader_view(b, s, ds, pattern, res))


# ---------------------------------------------------------------- duration


def estimate_minutes(a, engines):
    """A forecast of a run's length on the reference machine (2 idle cores, a virtio disk),
    from its phases' costs there: seconds per GiB of data per round in each condition, per
    engine round per GiB of engine model, and fixed costs."""
    gib, v2 = (a.mib + a.v1_mib) / 1024, a.mib / 1024
    page_cache = 50 * gib + 10  # seven measurements x five systems, reopens, the 4 GiB shard
    # five cold reads and two delayed per set; the loader view; the sharded checkpoint
    cold = 32 * gib + 36 * v2 + 10 + 5 * v2
    setup = 20 * gib + 30 + (0 if a.no_decode else 60)
    eng = 0
    if engines:
        eng = 30 * a.engine_gib + a.engine_rounds * (40 + 100 * a.engine_gib)
        if a.vllm:
            eng += a.engine_rounds * 4 * 60
    return (setup + a.rounds * (page_cache + cold) + eng) / 60
