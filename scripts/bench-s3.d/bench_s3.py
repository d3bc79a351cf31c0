#!/usr/bin/env python3
"""Remote sources, measured: one sealed shard served by a local S3 server (s3s-fs), read
through `kllm-mount s3://` in each serving mode (the mount included), next to the server's
own limit and the usual ways to get a checkpoint out of a bucket. See docs/PERFORMANCE.md.

Systems (each reads the whole shard once, sequentially, 1 MiB at a time, cold):
  ranged-gets     parallel ranged GETs of the plain shard into memory (boto3, 16 MiB parts,
                  16 in flight): the server's limit on this machine
  wire            the same GETs by curl into /dev/null (curl 7.75+ signs them): what the
                  server and loopback give when no byte is kept, so no fresh memory is paid
  download-read   boto3 download_file of the plain shard to local disk, then read it
  kllm-fuse       kllm-mount s3://... --mode fuse, mount + read
  kllm-pt         kllm-mount s3://... --mode passthrough, mount + open (decode) + read
  kllm-*-checked  the same two from a prefix that also holds kllm-manifest.json, so each
                  file is checked against it before its first byte (--verify open, the
                  default): what the check costs
  kllm-*-2s       the same two, the read begun 2 s after the mount (an engine importing),
                  timed from the open: what decode ahead (passthrough) and fetch ahead
                  (FUSE) make of the wait; kllm-fuse-checked-2s: the same under a
                  manifest, where check ahead hashes and stores each shard from one download
  kllm-s3fs       kllm-mount over an s3fs-fuse mount of the sealed prefix (when s3fs works)
  rclone          rclone mount of the bucket, the plain shard read (when rclone works)
For kllm-mount also: time to the first byte (from the mount command's start), the
daemon's peak memory (VmHWM) and the bytes it downloaded (`remote_bytes_fetched`). Each round runs the systems in turn, in reverse order every
other round; the ratios are medians of ratios paired round by round. Before each system the
host's pace is taken (SHA-256 of 64 MiB in memory on one core): on a shared VM the same CPU
work runs at a pace that moves by up to 2x within a minute, and the report says how far it
moved during the run.
"""

import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

# The main benchmark's helpers: kLLM's catalog manifest is written in one place.
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench.d"))
from host import catalog_manifest  # noqa: E402

MiB = 1 << 20
READ = 1 << 20
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TARGET = os.environ.get("CARGO_TARGET_DIR", os.path.join(ROOT, "target"))
KLLM = os.path.join(TARGET, "release", "kllm-mount")
GEN = os.path.join(TARGET, "release", "examples", "bench-shard")
ACCESS, SECRET = "AKBENCHKLLM", "SKBENCHKLLMnotsecret"
BUCKET = "bench"


def log(*a):
    print(*a, file=sys.stderr, flush=True)


def drop_caches():
    os.sync()
    with open("/proc/sys/vm/drop_caches", "w") as f:
        f.write("3\n")


def warm(path):
    with open(path, "rb", buffering=0) as f:
        while f.read(8 * MiB):
            pass


def free_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def read_all(path, first=None):
    """Read a file sequentially; (bytes, seconds, seconds to the first byte from `first`)."""
    t0 = time.perf_counter()
    fd = os.open(path, os.O_RDONLY)
    buf = bytearray(READ)
    mv = memoryview(buf)
    total, off, t_first = 0, 0, None
    try:
        while True:
            n = os.preadv(fd, [mv], off)
            if t_first is None:
                t_first = time.perf_counter() - (first if first is not None else t0)
            if n <= 0:
                break
            off += n
            total += n
    finally:
        os.close(fd)
    return total, time.perf_counter() - t0, t_first


def is_mounted(mnt):
    real = os.path.realpath(mnt)
    with open("/proc/self/mountinfo") as f:
        return any(line.split()[4] == real for line in f)


def unmount(mnt):
    for _ in range(50):
        if not is_mounted(mnt):
            return
        if subprocess.run(["fusermount3", "-u", mnt], stderr=subprocess.DEVNULL).returncode == 0:
            break
        time.sleep(0.1)
    if is_mounted(mnt):
        subprocess.run(["fusermount3", "-uz", mnt], stderr=subprocess.DEVNULL)
    time.sleep(0.2)


def daemon_pid(mnt):
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/cmdline", "rb") as f:
                if mnt.encode() in f.read().split(b"\0"):
                    return int(d)
        except OSError:
            pass
    return None


def vm_hwm_kib(pid):
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return None


class Bench:
    def __init__(self, a):
        self.a = a
        self.work = a.work
        self.data = os.path.join(self.work, "s3root-api")
        self.mnt = os.path.join(self.work, "mnt")
        self.mnt2 = os.path.join(self.work, "mnt2")
        os.makedirs(self.mnt, exist_ok=True)
        os.makedirs(self.mnt2, exist_ok=True)
        self.port = free_port()
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self.env = dict(os.environ, AWS_ACCESS_KEY_ID=ACCESS, AWS_SECRET_ACCESS_KEY=SECRET,
                        AWS_REGION="us-east-1", AWS_ENDPOINT_URL=self.endpoint)
        self.server = None

    # ------------------------------------------------------------ data and server

    def make_data(self):
        gen = os.path.join(self.work, "gen")
        if not os.path.exists(os.path.join(gen, "kllm.key")):
            log(f"making a {self.a.mib} MiB sealed shard")
            subprocess.run([GEN, "shard", gen, "--mib", str(self.a.mib)], check=True)
        self.gen = gen
        self.key = os.path.join(gen, "kllm.key")
        self.plain = os.path.join(gen, "plain", "model.safetensors")
        self.size = os.path.getsize(self.plain)
        # kLLM's catalog manifest of the sealed files (the key lives beside them).
        self.manifest = os.path.join(self.work, "kllm-manifest.json")
        with open(self.manifest, "w") as f:
            f.write(catalog_manifest(os.path.join(gen, "sealed")))

    def upload(self):
        """Objects go in through the S3 API, never by copying into the server's folder:
        s3s-fs stores an object's ETag when it is put, and for a file copied in behind its
        back it hashes the whole object on every GET and HEAD (a 16 MiB ranged GET of a
        512 MiB object then costs an MD5 of 512 MiB, and the server runs at ~30 MiB/s)."""
        c = self.s3()
        if not os.path.isdir(os.path.join(self.data, BUCKET)):
            c.create_bucket(Bucket=BUCKET)
        for top, base in (("sealed", "sealed"), ("plain", "plain"), ("checked", "sealed")):
            if os.path.isdir(os.path.join(self.data, BUCKET, top)):
                continue
            base = os.path.join(self.gen, base)
            for d, _, files in os.walk(base):
                for f in files:
                    path = os.path.join(d, f)
                    key = top + "/" + os.path.relpath(path, base)
                    c.upload_file(path, BUCKET, key)
            if top == "checked":
                c.upload_file(self.manifest, BUCKET, "checked/kllm-manifest.json")
        log("uploaded the sealed and plain checkpoints through the S3 API")

    def start_server(self):
        self.server = subprocess.Popen(
            [self.a.s3s_fs, "--host", "127.0.0.1", "--port", str(self.port),
             "--access-key", ACCESS, "--secret-key", SECRET, self.data],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        for _ in range(200):
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=0.2).close()
                return
            except OSError:
                time.sleep(0.05)
        raise SystemExit("s3s-fs did not answer")

    def cold(self):
        """Page cache dropped, then the server's files read back in: every system finds the
        server warm and itself cold (the server's disk is not what is measured)."""
        drop_caches()
        for d, _, files in os.walk(self.data):
            for f in files:
                warm(os.path.join(d, f))

    def s3(self):
        import boto3
        from botocore.config import Config
        return boto3.client("s3", endpoint_url=self.endpoint, aws_access_key_id=ACCESS,
                            aws_secret_access_key=SECRET, region_name="us-east-1",
                            config=Config(max_pool_connections=32))

    # ------------------------------------------------------------ systems

    def ranged_gets(self):
        c = self.s3()
        part, inflight = 16 * MiB, 16
        parts = [(o, min(part, self.size - o)) for o in range(0, self.size, part)]
        out = bytearray(self.size)
        lock, it = threading.Lock(), iter(parts)
        t0 = time.perf_counter()

        def work():
            while True:
                with lock:
                    p = next(it, None)
                if p is None:
                    return
                off, n = p
                body = c.get_object(Bucket=BUCKET, Key="plain/model.safetensors",
                                    Range=f"bytes={off}-{off + n - 1}")["Body"].read()
                assert len(body) == n
                out[off:off + n] = body

        ts = [threading.Thread(target=work) for _ in range(inflight)]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
        return {"seconds": time.perf_counter() - t0}

    def wire(self):
        curl = shutil.which("curl")
        if not curl:
            return {"skipped": "curl not installed"}
        part = 16 * MiB
        url = f"{self.endpoint}/{BUCKET}/plain/model.safetensors"
        cfg = []
        for off in range(0, self.size, part):
            end = min(off + part, self.size) - 1
            if cfg:
                cfg.append("next")
            cfg += [f'url = "{url}"', f'range = "{off}-{end}"', 'output = "/dev/null"',
                    'aws-sigv4 = "aws:amz:us-east-1:s3"', f'user = "{ACCESS}:{SECRET}"',
                    'header = "x-amz-content-sha256: UNSIGNED-PAYLOAD"',
                    'write-out = "%{http_code} %{size_download}\\n"']
        path = os.path.join(self.work, "curl.cfg")
        with open(path, "w") as f:
            f.write("\n".join(cfg) + "\n")
        t0 = time.perf_counter()
        r = subprocess.run([curl, "-s", "--parallel", "--parallel-max", "16", "-K", path],
                           capture_output=True, text=True)
        dt = time.perf_counter() - t0
        got = [line.split() for line in r.stdout.splitlines() if line.strip()]
        if r.returncode != 0 or any(c != "206" for c, _ in got):
            return {"skipped": f"curl failed ({r.returncode}): {r.stderr.strip()[:200]}"}
        assert sum(int(n) for _, n in got) == self.size
        return {"seconds": dt}

    def download_read(self):
        c = self.s3()
        dst = os.path.join(self.work, "downloaded.safetensors")
        t0 = time.perf_counter()
        c.download_file(BUCKET, "plain/model.safetensors", dst)
        n, _, _ = read_all(dst)
        dt = time.perf_counter() - t0
        os.unlink(dst)
        assert n == self.size
        return {"seconds": dt}

    def kllm(self, mode, source, checked=False, delay=0):
        t0 = time.perf_counter()
        subprocess.run([KLLM, source, self.mnt, "--key", self.key, "--mode", mode,
                        "--cache-size", "0"], check=True, env=self.env)
        t_mount = time.perf_counter() - t0
        pid = daemon_pid(self.mnt)
        if delay:
            time.sleep(delay)
            t0 = time.perf_counter()
        n, _, first = read_all(os.path.join(self.mnt, "model.safetensors"), first=t0)
        dt = time.perf_counter() - t0
        hwm = vm_hwm_kib(pid) if pid else None
        st = json.loads(subprocess.run([KLLM, "--status", self.mnt], check=True,
                                       capture_output=True, text=True).stdout)
        if checked:
            assert st["verified_files"] >= 1 and st["failed_files"] == 0, st
        unmount(self.mnt)
        assert n == self.size, (n, self.size)
        return {"seconds": dt, "mount_s": t_mount, "first_byte_s": first, "daemon_hwm_mib":
                hwm / 1024 if hwm else None,
                "fetched_mib": st["remote_bytes_fetched"] / MiB}

    def kllm_over_s3fs(self):
        if not shutil.which("s3fs"):
            return {"skipped": "s3fs not installed"}
        pw = os.path.join(self.work, "s3fs.passwd")
        with open(pw, "w") as f:
            f.write(f"{ACCESS}:{SECRET}\n")
        os.chmod(pw, 0o600)
        t0 = time.perf_counter()
        r = subprocess.run(["s3fs", f"{BUCKET}:/sealed", self.mnt2, "-o", f"passwd_file={pw}",
                            "-o", f"url={self.endpoint}", "-o", "use_path_request_style",
                            "-o", "parallel_count=16", "-o", "multipart_size=16"],
                           capture_output=True, text=True)
        if r.returncode != 0 or not is_mounted(self.mnt2):
            return {"skipped": f"s3fs did not mount: {r.stderr.strip()[:200]}"}
        try:
            res = self.kllm("fuse", self.mnt2)
            res["seconds"] = time.perf_counter() - t0
            # s3fs downloads; kllm-mount reads a local directory.
            res["fetched_mib"] = None
            return res
        except Exception as e:  # noqa: BLE001
            return {"skipped": f"kllm-mount over s3fs failed: {e}"}
        finally:
            unmount(self.mnt)
            unmount(self.mnt2)

    def rclone(self):
        if not shutil.which("rclone"):
            return {"skipped": "rclone not installed"}
        # A CA bundle meant for https elsewhere is of no use on http and rclone fails on it.
        env = {k: v for k, v in os.environ.items() if k != "AWS_CA_BUNDLE"}
        env.update(RCLONE_CONFIG_B_TYPE="s3", RCLONE_CONFIG_B_PROVIDER="Other",
                   RCLONE_CONFIG_B_ACCESS_KEY_ID=ACCESS, RCLONE_CONFIG_B_SECRET_ACCESS_KEY=SECRET,
                   RCLONE_CONFIG_B_ENDPOINT=self.endpoint)
        t0 = time.perf_counter()
        # The bucket's root, not B:bench/plain: rclone first HEADs a prefix as if it were a
        # file, s3s-fs answers 500 for a key that is a folder, and rclone retries that for
        # minutes before it mounts.
        p = subprocess.Popen(["rclone", "mount", f"B:{BUCKET}", self.mnt2, "--read-only",
                              "--vfs-cache-mode", "off", "--buffer-size", "64M"],
                             env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        for _ in range(600):
            if is_mounted(self.mnt2):
                break
            if p.poll() is not None:
                return {"skipped": f"rclone exited: {p.stderr.read().decode()[-300:]}"}
            time.sleep(0.05)
        else:
            p.kill()
            return {"skipped": f"rclone did not mount in 30 s: {p.stderr.read().decode()[-300:]}"}
        try:
            n, _, first = read_all(os.path.join(self.mnt2, "plain", "model.safetensors"),
                                   first=t0)
            assert n == self.size
            return {"seconds": time.perf_counter() - t0, "first_byte_s": first}
        finally:
            unmount(self.mnt2)
            p.send_signal(signal.SIGTERM)
            p.wait()

    # ------------------------------------------------------------ the run

    def run(self):
        self.make_data()
        os.makedirs(self.data, exist_ok=True)
        self.start_server()
        self.upload()
        source = f"s3://{BUCKET}/sealed"
        checked = f"s3://{BUCKET}/checked"
        systems = [
            ("ranged-gets", self.ranged_gets),
            ("wire", self.wire),
            ("download-read", self.download_read),
            ("kllm-fuse", lambda: self.kllm("fuse", source)),
            ("kllm-pt", lambda: self.kllm("passthrough", source)),
            ("kllm-fuse-checked", lambda: self.kllm("fuse", checked, True)),
            ("kllm-pt-checked", lambda: self.kllm("passthrough", checked, True)),
            ("kllm-fuse-2s", lambda: self.kllm("fuse", source, delay=2)),
            ("kllm-pt-2s", lambda: self.kllm("passthrough", source, delay=2)),
            ("kllm-fuse-checked-2s", lambda: self.kllm("fuse", checked, True, delay=2)),
            ("kllm-s3fs", self.kllm_over_s3fs),
            ("rclone", self.rclone),
        ]
        results = {name: [] for name, _ in systems}
        try:
            for r in range(self.a.rounds):
                for name, fn in (systems if r % 2 == 0 else systems[::-1]):
                    self.cold()
                    pace = host_pace()
                    res = fn()
                    res["host_pace_mb_s"] = pace
                    if "seconds" in res:
                        res["mb_s"] = self.size / MiB / res["seconds"]
                    log(f"round {r + 1} {name}: {json.dumps(res)}")
                    results[name].append(res)
        finally:
            unmount(self.mnt)
            unmount(self.mnt2)
            if self.server:
                self.server.terminate()
                self.server.wait()
        return results


PACE_BYTES = 64 * MiB
_PACE_BUF = None


def host_pace():
    """MiB/s of SHA-256 over 64 MiB in memory on this core: the same CPU work each time, so
    its spread over a run is the host's, not any system's."""
    import hashlib
    global _PACE_BUF
    if _PACE_BUF is None:
        _PACE_BUF = os.urandom(PACE_BYTES)
    t0 = time.perf_counter()
    hashlib.sha256(_PACE_BUF).digest()
    return PACE_BYTES / MiB / (time.perf_counter() - t0)


def median(xs):
    xs = sorted(x for x in xs if x is not None)
    return xs[len(xs) // 2] if xs else None


def report(results, size, a):
    server = "s3s-fs 0.14.1 as published" if a.stock_server else "s3s-fs 0.14.1, 1 MiB read buffer, TCP_NODELAY"
    lines = [f"# Remote source: one {size / MiB:.0f} MiB shard from {server} on 127.0.0.1",
 "", f"{a.rounds} rounds, medians; MiB/s over the whole shard (mount included; for the "
             "-2s rows, from the open 2 s after the mount).", "",
             "| system | MiB/s | s | first byte s | daemon peak MiB | MiB downloaded |",
             "|---|---|---|---|---|---|"]
    for name, runs in results.items():
        if runs and all("skipped" in r for r in runs):
            why = " ".join(runs[0]["skipped"].split()).replace("|", "/")
            lines.append(f"| {name} | skipped: {why} | | | | |")
            continue
        m = {k: median([r.get(k) for r in runs]) for k in
             ("mb_s", "seconds", "first_byte_s", "daemon_hwm_mib", "fetched_mib")}
        f = lambda v, d=2: "" if v is None else f"{v:.{d}f}"  # noqa: E731
        lines.append(f"| {name} | {f(m['mb_s'], 0)} | {f(m['seconds'])} | "
                     f"{f(m['first_byte_s'], 3)} | {f(m['daemon_hwm_mib'], 0)} | "
                     f"{f(m['fetched_mib'], 0)} |")
    lines.append("")

    def paired(a, b):
        """Medians (min, max) of a's MiB/s over b's, round by round."""
        rs = sorted(x["mb_s"] / y["mb_s"] for x, y in zip(results.get(a, []), results.get(b, []))
                    if x.get("mb_s") and y.get("mb_s"))
        return (rs[len(rs) // 2], rs[0], rs[-1]) if rs else None

    def said(r, target):
        if r is None:
            return "not measured"
        m, lo, hi = r
        return f"{m:.2f}x ({lo:.2f}-{hi:.2f}; target >= {target}x, {'met' if m >= target else 'not met'})"

    lines.append("Medians of ratios paired round by round (min-max):")
    lines.append("")
    for mode in ("kllm-fuse", "kllm-pt"):
        lines.append(f"- {mode}: {said(paired(mode, 'ranged-gets'), 0.8)} the server's limit, "
                     f"{said(paired(mode, 'download-read'), 1.3)} download-then-read")
    for mode in ("kllm-fuse", "kllm-pt"):
        c = paired(f"{mode}-checked", mode)
        if c:
            lines.append(f"- {mode}-checked (under a manifest): {c[0]:.2f}x ({c[1]:.2f}-{c[2]:.2f}) "
                         f"{mode}'s MiB/s, {said(paired(mode + '-checked', 'ranged-gets'), 0.8)} "
                         "the server's limit")
    for mode in ("kllm-fuse", "kllm-pt", "kllm-fuse-checked"):
        d = paired(f"{mode}-2s", "ranged-gets")
        if d:
            lines.append(f"- {mode}-2s (the read 2 s after the mount, from the open): "
                         f"{d[0]:.2f}x ({d[1]:.2f}-{d[2]:.2f}) the server's limit")
    w = paired("ranged-gets", "wire")
    if w:
        lines.append(f"- ranged-gets / wire: {w[0]:.2f}x ({w[1]:.2f}-{w[2]:.2f}): what keeping "
                     "the bytes in fresh memory costs against sending them nowhere")
    paces = sorted(r["host_pace_mb_s"] for runs in results.values() for r in runs
                   if r.get("host_pace_mb_s"))
    if paces:
        lines.append(f"- host pace (SHA-256 of 64 MiB in memory, one core, before each system): "
                     f"median {paces[len(paces) // 2]:.0f} MiB/s, {paces[0]:.0f}-{paces[-1]:.0f}: "
                     f"the same CPU work ran {paces[-1] / paces[0]:.2f}x faster at the host's "
                     "best than at its worst in this run")
    return "\n".join(lines) + "\n"


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mib", type=int, default=512, help="shard size (default 512)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--work", default=None, help="data folder (default: a temporary one)")
    p.add_argument("--s3s-fs", required=True, help="the s3s-fs server program")
    p.add_argument("--stock-server", action="store_true",
                   help="(scripts/bench-s3) the published s3s-fs, 4 KiB reads; noted in the report")
    p.add_argument("--out", default=None, help="write the report here too")
    a = p.parse_args()
    tmp = None
    if a.work is None:
        tmp = a.work = tempfile.mkdtemp(prefix="kllm-bench-s3.")
    try:
        b = Bench(a)
        results = b.run()
        text = report(results, b.size, a)
        print(text)
        if a.out:
            with open(a.out, "w") as f:
                f.write(text)
            with open(a.out + ".json", "w") as f:
                json.dump(results, f, indent=1)
    finally:
        if tmp:
            shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
