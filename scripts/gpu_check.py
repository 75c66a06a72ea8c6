#!/usr/bin/env python3
"""Device check of the CuPy backend (issue 7): one run, one compact report.

    python3 scripts/gpu_check.py [--quick] [--budget SECONDS] [--report FILE]

Needs an NVIDIA GPU, cupy (cupy-cuda12x or cupy-cuda13x, with NVRTC), numpy and gguf;
no internet, no pip install of panechat (a plain checkout works). numba is optional (the
numpy backend used for comparisons falls back to its GEMV path without it).

What it checks, in order (each section reports PASS / FAIL / SKIP and goes on):
  1. versions: GPU, driver, CUDA driver API and runtime, NVRTC, cupy, numpy, gguf;
  2. every CUDA kernel variant against the numpy emulation of its documented arithmetic,
     bit for bit (backends/cuda/kernels/): the block-form Q8_0 / Q4_x kernels, the RMS norm
     fused into the products, attention over the paged float16 / float32 store;
  3. the backend's start-up self_check() (rows alone vs in batches, bit for bit);
  3b. each decode product alone at B = 1 (20 launches in one CUDA graph): weight bytes per
     second vs the copy bandwidth, for Q8_0 / F16 and the block-form Q4_0 / Q4_1 kernels;
  4. tiny llama/qwen2 models (tests/tiny_gguf.py; F32, F16, Q8_0, Q4_1, Q4_0, BF16, and
     head_dim 128) and gemma3 (sliding window, GELU): GPU logits == emulated backend bit for bit; vs the numpy backend and
     the float64 reference within REL_TOL; same greedy tokens as the numpy backend;
  5. batch invariance on the device: check_model_invariance, and 4 sequences decoded alone
     vs together with 2 extra sequences in shuffled row order, every logit bit for bit;
  6. real-width models (qwen2-1.5B and llama-7B hidden sizes, 2 and 1 layers): GPU vs
     numpy backend and float64 within REL_TOL, batch invariance;
  6b. decode steps replayed from the per-bucket CUDA graphs == the eager steps, bit for
     bit (R = 1, 3, 5, 17: padded rows), and greedy device sampling == the host argmax;
  7. synthetic full-width GGUF files (qwen2-1.5B-like Q8_0, llama-7B-like F16, written
     with gguf.GGUFWriter into a temp dir; fewer layers than the real 7B to keep the file
     and the time small): load, batch invariance, prefill speed, and decode throughput
     S_TG at B = 1, 4, 16, 64 next to the weight-bandwidth limit
     B * (measured copy bandwidth) / (weight bytes read per step), through the model's
     forward pass and through the Engine (host loop, scheduler, device sampling);
  8. the tensor-core (MMA) mode (PANECHAT_CUPY_MMA=1, cupy_mma.py): the x split bit for
     bit, every MMA weight form within the documented error bound of float64, rows alone
     == in batches of 2..64 bit for bit, self_check and tiny models with it on, and its
     speed (prefill 512 tokens, B = 1 and 64) on the synthetic models; `--mma-only` runs
     just this (and the versions);
  9. issue 15's targets, each figure with PASS / FAIL against it.
Exit status: 0 everything passed, 1 a check failed, 2 it could not start (no GPU, ...).
Designed to finish within 7 minutes on an H100/H200 (the default --budget 420; run it
with a timeout of 540 s); --budget skips the remaining optional parts (reported as SKIP)
if the time runs out.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import platform
import subprocess
import sys
import tempfile
import time
import traceback
import types
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
REL_TOL = 1e-4  # |gpu - ref| / max|ref| for the numpy backend and float64 comparisons


# --------------------------------------------------------------------------------------
# set-up
# --------------------------------------------------------------------------------------

def _bootstrap() -> str:
    """Make `panechat.backends` / `panechat.engine` importable from this checkout."""
    sys.path.insert(0, str(ROOT))  # tests.tiny_gguf
    try:
        import panechat.backends  # noqa: F401
        import panechat.engine  # noqa: F401

        return f"installed package at {Path(panechat.backends.__file__).parent.parent}"
    except ImportError:
        pass
    for name in [m for m in sys.modules if m == "panechat" or m.startswith("panechat.")]:
        del sys.modules[name]
    pkg = types.ModuleType("panechat")
    pkg.__path__ = []
    sys.modules["panechat"] = pkg
    for sub in ("backends", "engine"):
        spec = importlib.util.spec_from_file_location(
            f"panechat.{sub}", ROOT / sub / "__init__.py", submodule_search_locations=[str(ROOT / sub)])
        mod = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = mod
        spec.loader.exec_module(mod)
        setattr(pkg, sub, mod)
    return f"checkout at {ROOT} (not installed)"


class Report:
    def __init__(self, path: str | None, budget: float):
        self.t0 = time.perf_counter()
        self.budget = budget
        self.path = path
        self.lines: list[str] = []
        self.passed = self.failed = self.skipped = 0
        self.figures: dict[tuple[str, str], float] = {}  # (model label, what) -> measured value

    def elapsed(self) -> float:
        return time.perf_counter() - self.t0

    def left(self) -> float:
        return self.budget - self.elapsed()

    def say(self, line: str = "") -> None:
        print(line, flush=True)
        self.lines.append(line)
        if self.path:
            with open(self.path, "a", encoding="utf-8") as f:
                f.write(line + "\n")

    def section(self, title: str) -> None:
        self.say(f"== {title}  [{self.elapsed():.0f} s]")

    def result(self, ok: bool, what: str) -> bool:
        if ok:
            self.passed += 1
        else:
            self.failed += 1
        self.say(f"  {'PASS' if ok else 'FAIL'} {what}")
        return ok

    def skip(self, what: str) -> None:
        self.skipped += 1
        self.say(f"  SKIP {what}")

    def error(self, what: str, e: BaseException) -> None:
        tb = traceback.extract_tb(e.__traceback__)
        where = f" at {Path(tb[-1].filename).name}:{tb[-1].lineno}" if tb else ""
        msg = str(e).strip().splitlines()[0] if str(e).strip() else ""
        self.result(False, f"{what}: {type(e).__name__}: {msg}{where}")


def _rel(a: np.ndarray, ref: np.ndarray) -> float:
    return float(np.abs(np.asarray(a, np.float64) - ref).max() / max(np.abs(ref).max(), 1e-30))


# --------------------------------------------------------------------------------------
# model helpers
# --------------------------------------------------------------------------------------

def _batch(tokens, slots, positions, last):
    from panechat.engine.model.forward import Batch

    return Batch(np.asarray(tokens, np.int32), np.asarray(slots, np.int32),
                 np.asarray(positions, np.int32), np.asarray(last, np.int64))


def _kv(model, n_slots: int, ctx: int = 64, dtype: str = "f16"):
    a = model.args
    return model.backend.new_kv(n_slots, a.n_layer, a.n_kv_head, ctx, a.head_dim, dtype)


def _forward_all(model, tokens, chunk: int, ctx: int = 64) -> np.ndarray:
    kv = _kv(model, 1, ctx, "f32")  # compared with float64: the KV must not round to 16 bits
    out = []
    for s in range(0, len(tokens), chunk):
        t = tokens[s:s + chunk]
        n = len(t)
        out.append(np.array(model.forward(kv, _batch(t, [0] * n, range(s, s + n), range(n)))))
    return np.concatenate(out)


def _greedy(model, prompt, steps: int, ctx: int = 64):
    kv = _kv(model, 1, ctx, "f32")
    toks, logits = list(prompt), []
    n = len(prompt)
    lg = model.forward(kv, _batch(prompt, [0] * n, range(n), [n - 1]))[0]
    for _ in range(steps):
        logits.append(np.array(lg))
        toks.append(int(np.argmax(lg)))
        p = len(toks) - 1
        lg = model.forward(kv, _batch([toks[-1]], [0], [p], [0]))[0]
    return toks[n:], logits


def _run_together(model, seqs, steps: int, order_seed: int, ctx: int):
    """The test suite's batched run (tests/model_runs.py): all sequences in one batch
    per step, rows shuffled every step. Returns logits[seq][step]."""
    from tests.model_runs import run_batched

    return run_batched(model, _kv(model, len(seqs), ctx), seqs, steps, order_seed)


def _invariance(model, steps: int = 6, ctx: int = 64, seed: int = 0) -> str | None:
    from panechat.engine.model.invariance import check_model_invariance

    rng = np.random.default_rng(seed)
    V = model.args.vocab_size
    prompts = [rng.integers(0, V, n).tolist() for n in (6, 10, 3, 9)]
    extra = [rng.integers(0, V, n).tolist() for n in (3, 7)]
    alone = [_run_together(model, [p], steps, 0, ctx)[0] for p in prompts]
    together = _run_together(model, prompts + extra, steps, 5, ctx)
    for i in range(len(prompts)):
        for s in range(steps + 1):
            if not np.array_equal(alone[i][s], together[i][s]):
                d = np.abs(alone[i][s] - together[i][s]).max()
                return f"sequence {i} step {s}: alone != batched (max |diff| {d:.3g})"
    return check_model_invariance(model, _kv(model, 3, ctx))


# --------------------------------------------------------------------------------------
# synthetic full-width GGUF files
# --------------------------------------------------------------------------------------

BIG = [
    dict(label="qwen2-1.5B-like", arch="qwen2", n_embd=1536, n_head=12, n_kv=2, n_ff=8960,
         vocab=151936, n_layer=28, quick_layers=4, qtype="Q8_0", tied=True),
    dict(label="llama-7B-like", arch="llama", n_embd=4096, n_head=32, n_kv=32, n_ff=11008,
         vocab=32000, n_layer=8, quick_layers=2, qtype="F16", tied=False, real_layers=32),
]


class _Pool:
    """Random values to tile tensors from (fast to write; the values only need to be
    plausible: weights ~ N(0, 1/K), Q8_0 blocks with int8 q and a per-block scale)."""

    def __init__(self, seed: int):
        rng = np.random.default_rng(seed)
        self.normal = rng.standard_normal(1 << 23, dtype=np.float32)
        self.q = rng.integers(-127, 128, 1 << 24, dtype=np.int8)
        self.rng = rng

    def take(self, pool: np.ndarray, n: int) -> np.ndarray:
        off = int(self.rng.integers(0, pool.size))
        return np.resize(np.roll(pool, -off), n)

    def f16(self, rows: int, cols: int) -> np.ndarray:
        return (self.take(self.normal, rows * cols) * np.float32(cols ** -0.5)).astype(np.float16).reshape(rows, cols)

    def q8_0(self, rows: int, cols: int) -> np.ndarray:
        """Raw Q8_0 blocks [rows, cols/32 * 34]: q uniform in [-127, 127] (std ~73),
        d ~ 1/(73 sqrt(cols)) so that w ~ N(0, 1/cols)-ish."""
        nb = cols // 32
        raw = np.empty((rows, nb, 34), np.uint8)
        d = (np.float32(1 / (73 * np.sqrt(cols))) * (1 + 0.1 * self.take(self.normal, rows * nb))).astype(np.float16)
        raw[..., :2] = d.view(np.uint8).reshape(rows, nb, 2)
        raw[..., 2:] = self.take(self.q, rows * cols).view(np.uint8).reshape(rows, nb, 32)
        return raw.reshape(rows, nb * 34)


def write_synthetic(path: Path, spec: dict, n_layer: int, seed: int = 0) -> None:
    import gguf

    p = _Pool(seed)
    E, H, G, F, V = spec["n_embd"], spec["n_head"], spec["n_kv"], spec["n_ff"], spec["vocab"]
    hd = E // H
    w = gguf.GGUFWriter(str(path), spec["arch"])
    w.add_name(spec["label"])
    w.add_block_count(n_layer)
    w.add_context_length(4096)
    w.add_embedding_length(E)
    w.add_feed_forward_length(F)
    w.add_head_count(H)
    w.add_head_count_kv(G)
    w.add_rope_freq_base(1000000.0 if spec["arch"] == "qwen2" else 10000.0)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_vocab_size(V)
    # a tokenizer covering the vocabulary (the engine path decodes every generated id)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list([f"t{i}" for i in range(V - 2)] + ["<s>", "</s>"])
    w.add_token_types([1] * (V - 2) + [3, 3])
    w.add_token_merges(["t 1"])
    w.add_bos_token_id(V - 2)
    w.add_eos_token_id(V - 1)
    w.add_add_bos_token(False)
    w.add_chat_template("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    qt = getattr(gguf.GGMLQuantizationType, spec["qtype"])

    def mat(name: str, rows: int, cols: int) -> None:
        if spec["qtype"] == "Q8_0":
            raw = p.q8_0(rows, cols)
            w.add_tensor(name, raw, raw_shape=raw.shape, raw_dtype=qt)
        else:
            w.add_tensor(name, p.f16(rows, cols))

    def vec(name: str, n: int, scale: float = 0.1, base: float = 1.0) -> None:
        w.add_tensor(name, (base + scale * p.take(p.normal, n)).astype(np.float32))

    mat("token_embd.weight", V, E)
    for i in range(n_layer):
        b = f"blk.{i}."
        vec(b + "attn_norm.weight", E)
        mat(b + "attn_q.weight", H * hd, E)
        mat(b + "attn_k.weight", G * hd, E)
        mat(b + "attn_v.weight", G * hd, E)
        if spec["arch"] == "qwen2":
            vec(b + "attn_q.bias", H * hd, 0.1, 0.0)
            vec(b + "attn_k.bias", G * hd, 0.1, 0.0)
            vec(b + "attn_v.bias", G * hd, 0.1, 0.0)
        mat(b + "attn_output.weight", E, H * hd)
        vec(b + "ffn_norm.weight", E)
        mat(b + "ffn_gate.weight", F, E)
        mat(b + "ffn_up.weight", F, E)
        mat(b + "ffn_down.weight", E, F)
    vec("output_norm.weight", E)
    if not spec["tied"]:
        mat("output.weight", V, E)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


# --------------------------------------------------------------------------------------
# sections
# --------------------------------------------------------------------------------------

def versions(rep: Report, cp, where: str) -> None:
    rep.section("versions")
    import gguf

    try:
        import numba

        nb = numba.__version__
    except Exception as e:  # noqa: BLE001
        nb = f"unavailable ({type(e).__name__})"
    rep.say(f"  python {platform.python_version()}, numpy {np.__version__}, cupy {cp.__version__}, "
            f"gguf {getattr(gguf, '__version__', '?')}, numba {nb}; panechat: {where}")
    rt = cp.cuda.runtime
    props = rt.getDeviceProperties(cp.cuda.Device().id)
    name = props.get("name", b"?")
    name = name.decode() if isinstance(name, bytes) else name

    def cv(v):
        return f"{v // 1000}.{v % 1000 // 10}"

    try:
        from cupy.cuda import nvrtc

        nv = ".".join(map(str, nvrtc.getVersion()))
    except Exception as e:  # noqa: BLE001
        nv = f"unavailable ({type(e).__name__})"
    from panechat.backends.cuda.cupy_backend import _driver_version

    rep.say(f"  GPU: {name}, sm_{cp.cuda.Device().compute_capability}, "
            f"{props.get('multiProcessorCount')} SMs, {props.get('totalGlobalMem', 0) / 2**30:.1f} GiB, "
            f"L2 {props.get('l2CacheSize', 0) / 2**20:.0f} MiB")
    rep.say(f"  driver {_driver_version()} (CUDA {cv(rt.driverGetVersion())}); CUDA runtime "
            f"{cv(rt.runtimeGetVersion())}; NVRTC {nv}")
    try:
        smi = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,clocks.max.sm,clocks.max.mem",
                              "--format=csv,noheader"], capture_output=True, text=True, timeout=20)
        if smi.returncode == 0:
            rep.say(f"  nvidia-smi: {smi.stdout.strip().splitlines()[0]}")
    except Exception:  # noqa: BLE001
        pass


def kernels_vs_emulation(rep: Report, be) -> None:
    rep.section("kernels vs the numpy emulation of their arithmetic (bit for bit)")
    from panechat.backends.cuda.cupy_backend import compare_kernels_with_emulation

    t = time.perf_counter()
    problems = compare_kernels_with_emulation(be)
    for p in problems[:12]:
        rep.result(False, p)
    if len(problems) > 12:
        rep.say(f"  ... and {len(problems) - 12} more")
    if not problems:
        rep.result(True, f"every kernel variant identical to the emulation ({time.perf_counter() - t:.1f} s)")


def self_check(rep: Report, be) -> None:
    rep.section("backend self_check (rows alone vs batched, bit for bit)")
    t = time.perf_counter()
    problem = be.self_check()
    rep.result(problem is None, f"self_check() -> {problem} ({time.perf_counter() - t:.1f} s)")


def tiny_models(rep: Report, be, tmp: Path) -> list:
    from panechat.backends.cuda.cupy_backend import CupyBackend
    from panechat.backends.cpu.numpy_backend import cpu_backend
    from panechat.engine.gguf.file import GGUFFile
    from panechat.engine.model.forward import Model
    from tests.tiny_gguf import reference_logits, write_tiny_gguf

    rep.section(f"tiny models: GPU == emulation bit for bit; vs numpy and float64 < {REL_TOL:g}; greedy tokens")
    nb = cpu_backend()
    cases = [(a, q, t, {}) for a in ("llama", "qwen2")
             for q, t in (("F32", True), ("F16", False), ("Q8_0", True), ("Q4_1", False), ("Q4_0", True))]
    cases.append(("llama", "Q8_0", True, dict(n_embd=256, n_head=2, n_kv=1, n_ff=160)))  # head_dim 128
    cases.append(("llama", "BF16", False, {}))  # BF16 resident as stored (issue 15)
    cases.append(("gemma3", "F32", True, dict(n_layer=7, head_dim=32, window=5)))  # window + GELU
    models = []
    for arch, qtype, tied, shape in cases:
        label = f"{arch} {qtype}{' hd128' if shape and arch != 'gemma3' else ''}"
        try:
            path = tmp / f"tiny-{arch}-{qtype}-{len(shape)}.gguf"
            weights = write_tiny_gguf(path, arch, qtype=qtype, tied=tied, seed=3, **shape)
            gf = GGUFFile.open(path)
            gm = Model.load(gf, be, max_positions=64)
            em = Model.load(gf, CupyBackend.emulated_on_cpu(), max_positions=64)
            nm = Model.load(gf, nb, max_positions=64)
            tokens = np.random.default_rng(1).integers(0, gm.args.vocab_size, 23).tolist()
            ref = reference_logits(weights, arch, tokens)
            exact, worst_ref = True, 0.0
            for chunk in (23, 5, 1):
                got = _forward_all(gm, tokens, chunk)
                exact &= np.array_equal(got, _forward_all(em, tokens, chunk))
                worst_ref = max(worst_ref, _rel(got, ref))
            vs_np = _rel(_forward_all(gm, tokens, 23), _forward_all(nm, tokens, 23).astype(np.float64))
            gt, _ = _greedy(gm, tokens[:5], 16)
            nt, nlog = _greedy(nm, tokens[:5], 16)
            same = sum(a == b for a, b in zip(gt, nt))
            greedy_ok, note = gt == nt, ""
            if not greedy_ok:
                i = next(k for k in range(len(gt)) if gt[k] != nt[k])
                top2 = np.sort(nlog[i])[-2:]
                margin = float(top2[1] - top2[0]) / float(np.abs(nlog[i]).max())
                greedy_ok = margin < 10 * REL_TOL  # a near-tie flips legitimately
                note = f" (first difference at step {i}, numpy top-2 margin {margin:.1e})"
            ok = exact and worst_ref < REL_TOL and vs_np < REL_TOL and greedy_ok
            rep.result(ok, f"{label}: {'bit-exact' if exact else 'DIFFERS'} vs emulation; vs float64 "
                       f"{worst_ref:.1e}; vs numpy {vs_np:.1e}; greedy {same}/16 same{note}")
            models.append((label, gm))
        except Exception as e:  # noqa: BLE001
            rep.error(label, e)
    return models


def invariance(rep: Report, models: list, title: str, steps: int, ctx: int = 64) -> None:
    rep.section(title)
    for label, model in models:
        try:
            t = time.perf_counter()
            problem = _invariance(model, steps=steps, ctx=ctx)
            rep.result(problem is None, f"{label}: {problem or 'bit-identical alone vs batched'} "
                       f"({time.perf_counter() - t:.1f} s)")
        except Exception as e:  # noqa: BLE001
            rep.error(label, e)


MID = [("qwen2 1536/12/2/8960 x2 Q8_0", "qwen2", "Q8_0", dict(n_layer=2, n_embd=1536, n_head=12, n_kv=2, n_ff=8960)),
       ("llama 4096/32/32/11008 x1 F16", "llama", "F16", dict(n_layer=1, n_embd=4096, n_head=32, n_kv=32, n_ff=11008))]


def real_width(rep: Report, be, tmp: Path, cases=MID) -> list:
    from panechat.backends.cpu.numpy_backend import cpu_backend
    from panechat.engine.gguf.file import GGUFFile
    from panechat.engine.model.forward import Model
    from tests.tiny_gguf import reference_logits, write_tiny_gguf

    rep.section(f"real-width models (tiny vocab): GPU vs numpy backend and float64 < {REL_TOL:g}")
    out = []
    for label, arch, qtype, shape in cases:
        if rep.left() < 120:
            rep.skip(f"{label} (time budget)")
            continue
        try:
            t = time.perf_counter()
            path = tmp / f"mid-{arch}.gguf"
            weights = write_tiny_gguf(path, arch, qtype=qtype, tied=True, seed=5, **shape)
            gf = GGUFFile.open(path)
            gm = Model.load(gf, be, max_positions=64)
            nm = Model.load(gf, cpu_backend(), max_positions=64)
            tokens = np.random.default_rng(2).integers(0, gm.args.vocab_size, 12).tolist()
            ref = reference_logits(weights, arch, tokens)
            del weights
            got = _forward_all(gm, tokens, 12)
            r_ref, r_np = _rel(got, ref), _rel(got, _forward_all(nm, tokens, 12).astype(np.float64))
            same = bool((got.argmax(-1) == ref.argmax(-1)).all())
            rep.result(r_ref < REL_TOL and r_np < REL_TOL,
                       f"{label}: vs float64 {r_ref:.1e}, vs numpy {r_np:.1e}, argmax {'same' if same else 'differs'} "
                       f"({time.perf_counter() - t:.0f} s)")
            out.append((label, gm))
        except Exception as e:  # noqa: BLE001
            rep.error(label, e)
    return out


def copy_bandwidth(cp) -> float:
    """Device-to-device copy, bytes read + written per second."""
    n = 1 << 30  # 4 GiB of float32 each way
    a = cp.ones(n, cp.float32)
    b = cp.empty_like(a)
    for _ in range(2):
        b[...] = a
    start, stop = cp.cuda.Event(), cp.cuda.Event()
    start.record()
    reps = 10
    for _ in range(reps):
        b[...] = a
    stop.record()
    stop.synchronize()
    ms = cp.cuda.get_elapsed_time(start, stop) / reps
    del a, b
    cp.get_default_memory_pool().free_all_blocks()
    return 2 * n * 4 / (ms / 1e3)


def host_bandwidth() -> float:
    """The CPU dry run's stand-in for copy_bandwidth."""
    a = np.ones(1 << 25, np.float32)
    b = np.empty_like(a)
    t = time.perf_counter()
    for _ in range(3):
        np.copyto(b, a)
    return 3 * 2 * a.nbytes / (time.perf_counter() - t)


# (weight type, N, K): the decode products of the synthetic models (qwen2-1.5B: q/o, gate/up,
# down, the head; llama-7B: q, gate/up, down) and the block-form Q4 kernels at the same shapes;
# Q6_K (the head and half the down products of a Q4_K_M file), Q5_K, Q5_0 in their block forms
GEMV = [("Q8_0", 1536, 1536), ("Q8_0", 8960, 1536), ("Q8_0", 1536, 8960), ("Q8_0", 151936, 1536),
        ("F16", 4096, 4096), ("F16", 11008, 4096), ("F16", 4096, 11008),
        ("Q4_0", 8960, 1536), ("Q4_0", 1536, 8960), ("Q4_1", 8960, 1536), ("Q4_0", 11008, 4096),
        ("Q6_K", 151936, 1536), ("Q6_K", 1536, 8960), ("Q5_K", 8960, 1536), ("Q5_0", 8960, 1536)]


def _raw_blocks(rng: np.random.Generator, qtype: str, n: int, k: int) -> np.ndarray:
    """Valid blocks [n, k / block * bytes]: random codes, small f16 d (and m)."""
    if qtype not in ("Q8_0", "Q4_0", "Q4_1"):  # Q5_x, K-quants
        from panechat.backends.cuda.widen import random_blocks
        return random_blocks(rng, qtype, n, k)
    size, head = {"Q8_0": (34, 2), "Q4_0": (18, 2), "Q4_1": (20, 4)}[qtype]
    raw = rng.integers(0, 256, (n, k // 32, size), dtype=np.uint8)
    raw[..., :head] = (rng.uniform(0.5, 1.5, (n, k // 32, head // 2)) * 0.01).astype(np.float16).view(np.uint8)
    return raw.reshape(n, -1)


def decode_gemv(rep: Report, be, cp) -> None:
    """Each decode product alone at B = 1: 20 launches back to back replayed from one CUDA
    graph (no host between them), weight bytes per second next to the device's copy
    bandwidth -- whether the linear kernels stream, apart from the rest of the step."""
    from panechat.backends.cuda.step_graphs import GraphCapture
    from panechat.backends.quant.gguf_tensor import GGUFTensor

    rep.section("decode products at B = 1 (one linear kernel, 20 launches in a CUDA graph) vs copy bandwidth")
    if cp is None:
        rep.say("  ---- not measured here (CPU dry run)")
        return
    bw = copy_bandwidth(cp)
    rng = np.random.default_rng(0)
    rep.say(f"  device copy bandwidth {bw / 1e12:.2f} TB/s (bytes read + written); kernel = linear_<kind>_1_<NC>")
    for qtype, n, k in GEMV:
        if rep.left() < 60:
            rep.skip(f"decode product {qtype} {n}x{k} (time budget)")
            continue
        try:
            if qtype == "F16":
                t = GGUFTensor("w", (n, k), "F16", (rng.standard_normal((n, k), dtype=np.float32) * 0.02).astype(np.float16))
            else:
                t = GGUFTensor("w", (n, k), qtype, _raw_blocks(rng, qtype, n, k))
            w = be.linear_weight(t)
            x = cp.asarray(rng.standard_normal((1, k), dtype=np.float32))
            out = cp.empty((1, n), cp.float32)
            reps = 20

            def launches(x=x, w=w, out=out):
                for _ in range(reps):
                    be.kernels.linear(x, w, out)
                return out

            replay = GraphCapture(cp).capture(launches)
            replay()
            cp.cuda.Device().synchronize()
            t0 = time.perf_counter()
            for _ in range(5):
                replay()
            cp.cuda.Device().synchronize()
            dt = (time.perf_counter() - t0) / (5 * reps)
            frac = w.nbytes / dt / bw
            rep.figures[("decode product", f"{qtype} {n}x{k}")] = frac
            rep.say(f"  {qtype:5s} N={n:6d} K={k:5d} ({w.kind}): {w.nbytes / 1e6:7.1f} MB in {dt * 1e6:7.1f} us = "
                    f"{w.nbytes / dt / 1e12:.2f} TB/s, {frac:.0%} of the copy bandwidth")
            del w, x, out, replay
            cp.get_default_memory_pool().free_all_blocks()
        except Exception as e:  # noqa: BLE001
            rep.error(f"decode product {qtype} {n}x{k}", e)


def synthetic(rep: Report, be, cp, tmp: Path, quick: bool, batches, specs=BIG, engine: bool = True) -> None:
    from panechat.engine.gguf.file import GGUFFile
    from panechat.engine.model.forward import Model

    rep.section("synthetic full-width models: invariance, prefill, decode throughput vs bandwidth limit")
    dry = cp is None
    try:
        bw = host_bandwidth() if dry else copy_bandwidth(cp)
        rep.say(f"  {'host' if dry else 'device'} copy bandwidth {bw / 1e12:.2f} TB/s (bytes read + written)")
    except Exception as e:  # noqa: BLE001
        rep.error("copy bandwidth", e)
        return

    def sync():
        if not dry:
            cp.cuda.Device().synchronize()

    def free():
        if not dry:
            cp.get_default_memory_pool().free_all_blocks()

    for spec in specs:
        n_layer = spec["quick_layers"] if quick else spec["n_layer"]
        label = f"{spec['label']} {spec['qtype']} {n_layer} layers"
        if rep.left() < 75:
            rep.skip(f"{label} (time budget)")
            continue
        path = tmp / f"{spec['label']}.gguf"
        model = kv = None
        try:
            t = time.perf_counter()
            write_synthetic(path, spec, n_layer)
            t_write = time.perf_counter() - t
            t = time.perf_counter()
            model = Model.load(GGUFFile.open(path), be, max_positions=1024)
            t_load = time.perf_counter() - t
            path_tok = _tokenizer_of(path)
            path.unlink()
            lin = [model.output] + [getattr(L, n) for L in model.layers for n in
                                    ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")]
            step_bytes = sum(be.nbytes(w) for w in lin)
            real = spec.get("real_layers")
            rep.say(f"  {label}: file written in {t_write:.0f} s, loaded in {t_load:.0f} s; "
                    f"{step_bytes / 1e9:.2f} GB of matmul weights read per step"
                    + (f" (the real model has {real} layers)" if real else ""))
            problem = _invariance(model, steps=3, ctx=64)
            rep.result(problem is None, f"{label}: batch invariance: {problem or 'bit-identical alone vs batched'}")
            # prefill: one sequence of 512 tokens in one chunk
            n_pre = 512 if not dry else 32
            kv = _kv(model, max(batches), 640)  # prefill 0..511, decode at 256..265
            toks = np.random.default_rng(3).integers(0, model.args.vocab_size, n_pre)
            model.forward(kv, _batch(toks[:16], [0] * 16, range(16), [15]))  # warm-up
            sync()
            t = time.perf_counter()
            model.forward(kv, _batch(toks, [0] * n_pre, range(n_pre), [n_pre - 1]))
            rep.figures[(spec["label"], "prefill tok/s")] = pp = n_pre / (time.perf_counter() - t)
            rep.say(f"    prefill {n_pre} tokens: {pp:,.0f} tok/s")
            rep.say("        B   ms/step   S_TG tok/s   limit tok/s   of limit")
            for B in batches:
                if rep.left() < 20:
                    rep.skip(f"{label} B={B} (time budget)")
                    continue
                rng = np.random.default_rng(B)

                def step(p, B=B, rng=rng, model=model, kv=kv):
                    return model.forward(kv, _batch(rng.integers(0, model.args.vocab_size, B),
                                                    range(B), [p] * B, range(B)))

                pos = 256
                for i in range(2):
                    step(pos + i)
                n_steps = 8 if not dry else 1
                t = time.perf_counter()
                for i in range(n_steps):
                    step(pos + 2 + i)  # returns host logits: synchronised
                dt = (time.perf_counter() - t) / n_steps
                limit = B * bw / step_bytes
                rep.figures[(spec["label"], f"B={B} ms/step")] = dt * 1e3
                rep.figures[(spec["label"], f"B={B} of limit")] = B / dt / limit
                rep.say(f"    {B:5d}   {dt * 1e3:7.2f}   {B / dt:10,.0f}   {limit:11,.0f}   {B / dt / limit:7.1%}")
            if engine:
                engine_path(rep, model, path_tok, spec["label"], batches, bw, step_bytes, dry)
        except Exception as e:  # noqa: BLE001
            rep.error(label, e)
        finally:
            if path.exists():
                path.unlink()
            model = kv = None
            free()


def _tokenizer_of(path: Path):
    """(tokenizer, chat template) of a GGUF file (read before the file is deleted)."""
    from panechat.engine.text.chat_template import ChatTemplate
    from panechat.engine.gguf.file import GGUFFile
    from panechat.engine.model.loader import load_tokenizer

    gf = GGUFFile.open(path)
    tok = load_tokenizer(gf)
    return tok, ChatTemplate.from_metadata(gf.metadata, tok)


def engine_path(rep: Report, model, tok_template, label: str, batches, bw: float, step_bytes: int,
                dry: bool) -> None:
    """Decode through the Engine (scheduler, device sampling, host loop, events): B
    requests of a 16-token prompt generating N tokens each; tokens/s from the first token
    of the last request to arrive to the end (steady decode)."""
    from panechat.engine.serving.engine import Engine, EngineConfig
    from panechat.engine.model.loader import LoadedModel
    from panechat.engine.serving.sampling import SamplingParams

    lm = LoadedModel(Path(label), model, *tok_template)
    n_tok = 4 if dry else 48
    rep.say(f"    engine path (Engine.submit .. finish, host loop and device sampling included; {n_tok} tokens each)")
    rep.say("        B   ms/step   S_TG tok/s   of limit")
    for B in (batches[0], batches[-1]) if len(batches) > 1 else batches:
        if rep.left() < 20:
            rep.skip(f"{label} engine path B={B} (time budget)")
            continue
        eng = Engine(lm, EngineConfig(max_concurrent=B, ctx_size=256, verify_invariance=False)).start()
        try:
            rng = np.random.default_rng(B)
            params = SamplingParams(temperature=0.8, top_k=40, seed=1, max_tokens=n_tok)
            gens = [eng.submit(prompt_ids=rng.integers(0, model.args.vocab_size - 2, 16).tolist(), params=params)
                    for _ in range(B)]
            results = [g.result() for g in gens]
            errors = [r.error for r in results if r.error]
            if errors:
                rep.result(False, f"{label} engine path B={B}: {errors[0]}")
                continue
            rates = [r.timings["decode_tok_s"] for r in results if r.timings.get("decode_tok_s")]
            per_seq = min(rates) if rates else 0.0  # the slowest stream's decode rate
            ms = 1e3 / per_seq if per_seq else float("nan")
            limit = B * bw / step_bytes
            rep.figures[(label, f"engine B={B} ms/step")] = ms
            rep.say(f"    {B:5d}   {ms:7.2f}   {B * per_seq:10,.0f}   {B * per_seq / limit:7.1%}")
        finally:
            eng.stop()


#: issue 15's targets: (what, model label, figure key, compare, threshold, unit)
TARGETS = [
    ("B=1 decode >= 60% of the bandwidth limit", "llama-7B-like", "B=1 of limit", ">=", 0.60, "%"),
    ("B=1 decode >= 40% of the bandwidth limit", "qwen2-1.5B-like", "B=1 of limit", ">=", 0.40, "%"),
    ("B=64 ms/step <= 2x the B=1 ms/step", "llama-7B-like", "B=64/B=1", "<=", 2.0, "x"),
    ("prefill 512 tokens >= 20,000 tok/s", "qwen2-1.5B-like", "prefill tok/s", ">=", 20000.0, "tok/s"),
    ("prefill 512 tokens >= 20,000 tok/s", "qwen2-1.5B-like MMA", "prefill tok/s", ">=", 20000.0, "tok/s"),
    ("B=64 ms/step <= 2x the B=1 ms/step", "llama-7B-like MMA", "B=64/B=1", "<=", 2.0, "x"),
]


def targets(rep: Report, dry: bool, failed_before: int) -> None:
    """Every target's measured figure and PASS/FAIL against it ("not measured here" on the
    CPU dry run, where nothing ran on a GPU)."""
    rep.section("targets (issue 15)")
    f = dict(rep.figures)
    for label in {t[1] for t in TARGETS}:
        b1, b64 = f.get((label, "B=1 ms/step")), f.get((label, "B=64 ms/step"))
        if b1 and b64:
            f[(label, "B=64/B=1")] = b64 / b1
    for what, label, key, cmp, limit, unit in TARGETS:
        name = f"{label}: {what}"
        if dry:
            rep.say(f"  ---- {name}: not measured here (CPU dry run)")
            continue
        v = f.get((label, key))
        if v is None:
            rep.skip(f"{name}: not measured (skipped or failed above)")
            continue
        shown = f"{v:.1%}" if unit == "%" else f"{v:.2f}x" if unit == "x" else f"{v:,.0f} tok/s"
        rep.result(v >= limit if cmp == ">=" else v <= limit, f"{name}: measured {shown}")
    if dry:
        rep.say("  ---- invariance and every kernel == emulation: not measured here (CPU dry run; "
                f"the emulated checks above: {failed_before} failed)")
    else:
        rep.result(failed_before == 0, f"invariance and every kernel == emulation: {failed_before} checks failed above")


def graphs_and_sampling(rep: Report, models: list) -> None:
    """Decode steps replayed from CUDA graphs (rows padded to the bucket) == the eager steps,
    bit for bit; greedy device sampling == the host argmax of the same logits."""
    from tests.model_runs import new_kv

    rep.section("CUDA graphs per batch bucket == eager steps; device sampling == host argmax")
    for label, model in models:
        be = model.backend
        try:
            graphs = be.graphs
            if graphs is None:
                rep.skip(f"{label}: graphs off (PANECHAT_CUDA_GRAPHS=0)")
                continue
            rng = np.random.default_rng(0)
            V = model.args.vocab_size
            outs = []
            for use in (graphs, None):
                be.graphs = use
                kv = new_kv(model, 17, 64)
                model.forward(kv, _batch(rng.integers(0, V, 17 * 4), np.repeat(range(17), 4),
                                         np.tile(range(4), 17), np.arange(3, 68, 4)))
                got = []
                for R in (1, 3, 5, 17):
                    got.append(model.forward(kv, _batch(np.arange(R) + 5, range(R), [4] * R, range(R))))
                outs.append(got)
                rng = np.random.default_rng(0)
            be.graphs = graphs
            same = all(np.array_equal(a, b) for a, b in zip(*outs))
            z = np.zeros(3)
            picks = model.forward_tokens(new_kv(model, 3, 64), _batch([1, 2, 3], range(3), [0] * 3, range(3)),
                                         z.astype(np.float32), np.ones(3, np.float32), z.astype(np.float32),
                                         z.astype(np.int32), z.astype(np.uint64), z.astype(np.int64))
            host = model.forward(new_kv(model, 3, 64), _batch([1, 2, 3], range(3), [0] * 3, range(3))).argmax(-1)
            ok = same and graphs.enabled and picks[:, 0].tolist() == host.tolist()
            rep.result(ok, f"{label}: graphs {'on' if graphs.enabled else 'OFF: ' + str(graphs.disabled_because)}, "
                       f"{graphs.capturer.captures} captured; R=1,3,5,17 {'bit-identical' if same else 'DIFFER'} "
                       f"to eager; greedy device picks {'==' if picks[:, 0].tolist() == host.tolist() else '!='} "
                       "host argmax")
        except Exception as e:  # noqa: BLE001
            be.graphs = graphs
            rep.error(label, e)


def mma_mode(rep: Report, cp, tmp: Path, dry: bool, quick: bool, speed: bool = True) -> None:
    """The tensor-core mode: (a) invariance bit for bit, (b) error vs float64 within the
    documented bound, (c) speed on the synthetic models (figures labelled "... MMA")."""
    from panechat.backends.cuda.cupy_backend import CupyBackend
    from panechat.backends.cuda.mma_check import BATCHES, check_mma
    from panechat.engine.gguf.file import GGUFFile
    from panechat.engine.model.forward import Model
    from tests.tiny_gguf import reference_logits, write_tiny_gguf

    rep.section("tensor-core (MMA) mode, PANECHAT_CUPY_MMA=1: split bit for bit, error bound, invariance, speed")
    try:
        be = CupyBackend.emulated_on_cpu(mma=True) if dry else CupyBackend(mma=True)
    except Exception as e:  # noqa: BLE001
        rep.error("MMA backend", e)
        return
    rep.say(f"  backend: {be.describe()}")
    t = time.perf_counter()
    for ok, line in check_mma(be, batches=(2, 3, 5, 8, 9, 17, 33) if dry else BATCHES):
        rep.result(ok, line)
    problem = be.self_check()
    rep.result(problem is None, f"self_check() with the MMA mode on -> {problem} ({time.perf_counter() - t:.1f} s)")
    for arch, qtype in (("llama", "Q8_0"), ("qwen2", "F16"), ("llama", "Q4_1")):
        label = f"MMA tiny {arch} {qtype}"
        try:
            path = tmp / f"mma-tiny-{arch}-{qtype}.gguf"
            weights = write_tiny_gguf(path, arch, qtype=qtype, tied=True, seed=3)
            model = Model.load(GGUFFile.open(path), be, max_positions=64)
            tokens = np.random.default_rng(1).integers(0, model.args.vocab_size, 23).tolist()
            got = _forward_all(model, tokens, 23)
            chunked = np.array_equal(got, _forward_all(model, tokens, 5))
            r_ref = _rel(got, reference_logits(weights, arch, tokens))
            problem = _invariance(model, steps=4)
            rep.result(r_ref < REL_TOL and chunked and problem is None,
                       f"{label}: vs float64 {r_ref:.1e}; chunked prefill {'bit-identical' if chunked else 'DIFFERS'}; "
                       f"{problem or 'alone == batched, bit for bit'}")
        except Exception as e:  # noqa: BLE001
            rep.error(label, e)
    if speed:
        specs = [dict(spec, label=spec["label"] + " MMA") for spec in (_dry_specs() if dry else BIG)]
        synthetic(rep, be, cp, tmp, quick, (1, 64), specs, engine=False)


def _dry_specs() -> list[dict]:
    """Small stand-ins for BIG (CPU dry run: exercises this script, not the GPU)."""
    return [dict(spec, n_embd=128, n_head=4, n_kv=spec["n_kv"] and (4 if spec["n_kv"] == spec["n_head"] else 2),
                 n_ff=192, vocab=300, n_layer=2, quick_layers=1) for spec in BIG]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer layers in the synthetic models, B = 1, 16, 64")
    ap.add_argument("--budget", type=float, default=420.0, help="seconds before optional parts are skipped")
    out_dir = os.environ.get("OUT")
    ap.add_argument("--report", default=os.path.join(out_dir, "gpu_check.txt") if out_dir else None,
                    help="also append the report to this file (default: $OUT/gpu_check.txt when $OUT is set)")
    ap.add_argument("--mma-only", action="store_true",
                    help="only the versions and the tensor-core (MMA) mode's checks and speed")
    ap.add_argument("--dry-run-cpu", action="store_true",
                    help="no GPU: run this script's logic on the numpy emulation with small models")
    args = ap.parse_args()
    rep = Report(args.report, args.budget)
    rep.say(f"panechat scripts/gpu_check.py  (budget {args.budget:.0f} s{', quick' if args.quick else ''}"
            f"{', CPU DRY RUN: nothing here runs on a GPU' if args.dry_run_cpu else ''})")
    try:
        where = _bootstrap()
        from panechat.backends import BackendUnavailable
        from panechat.backends.cuda.cupy_backend import CupyBackend
    except Exception as e:  # noqa: BLE001
        rep.say(f"cannot import panechat from {ROOT}: {type(e).__name__}: {e}")
        return 2
    cp = None
    if args.dry_run_cpu:
        t = time.perf_counter()
        be = CupyBackend.emulated_on_cpu()
        t_build = time.perf_counter() - t
    else:
        try:
            import cupy as cp
        except Exception as e:  # noqa: BLE001
            rep.say(f"cannot import cupy: {type(e).__name__}: {e}")
            return 2
        try:
            t = time.perf_counter()
            be = CupyBackend()
            t_build = time.perf_counter() - t
        except BackendUnavailable as e:
            rep.say(f"no usable GPU: {e}")
            return 2
        try:
            versions(rep, cp, where)
        except Exception as e:  # noqa: BLE001
            rep.error("versions", e)
    rep.say(f"  backend: {be.describe()}")
    rep.say(f"  kernels built and loaded in {t_build:.1f} s")
    if args.mma_only:
        with tempfile.TemporaryDirectory(prefix="panechat-gpu-check-") as tmpdir:
            _mma_section(rep, cp, Path(tmpdir), args)
        return _finish(rep, args)
    for name, fn in (("kernels", lambda: kernels_vs_emulation(rep, be)), ("self_check", lambda: self_check(rep, be)),
                     ("decode products", lambda: decode_gemv(rep, be, cp))):
        try:
            fn()
        except Exception as e:  # noqa: BLE001
            rep.error(name, e)
    with tempfile.TemporaryDirectory(prefix="panechat-gpu-check-") as tmpdir:
        tmp = Path(tmpdir)
        tiny = []
        try:
            tiny = tiny_models(rep, be, tmp)
        except Exception as e:  # noqa: BLE001
            rep.error("tiny models", e)
        pick = [m for m in tiny if m[0] in ("llama Q8_0", "qwen2 F16", "llama F32", "llama Q8_0 hd128")]
        invariance(rep, pick, "batch invariance on the device (4 sequences alone vs together, 8 steps)", 8)
        graphs_and_sampling(rep, [m for m in tiny if m[0] in ("llama Q8_0", "qwen2 F16")])
        mid = []
        try:
            mid = real_width(rep, be, tmp, [(f"{c[0]} (shrunk: dry run)", c[1], c[2], dict(
                c[3], n_embd=192, n_head=6, n_kv=6 if c[3]["n_kv"] == c[3]["n_head"] else 2, n_ff=256))
                for c in MID] if args.dry_run_cpu else MID)
        except Exception as e:  # noqa: BLE001
            rep.error("real-width models", e)
        invariance(rep, mid, "batch invariance, real-width models (3 steps)", 3)
        del tiny, mid, pick
        synthetic(rep, be, cp, tmp, args.quick, (1, 16, 64) if args.quick else (1, 4, 16, 64),
                  _dry_specs() if args.dry_run_cpu else BIG)
        _mma_section(rep, cp, tmp, args)
    return _finish(rep, args)


def _mma_section(rep: Report, cp, tmp: Path, args) -> None:
    """The tensor-core section; an exception in it is a failed check, not a crash."""
    try:
        mma_mode(rep, cp, tmp, args.dry_run_cpu, args.quick)
    except Exception as e:  # noqa: BLE001
        rep.error("tensor-core (MMA) mode", e)


def _finish(rep: Report, args) -> int:
    """The targets' figures with PASS / FAIL, the summary line, and the exit status."""
    targets(rep, args.dry_run_cpu, rep.failed)
    rep.section(f"summary: {rep.passed} passed, {rep.failed} failed, {rep.skipped} skipped, "
                f"{rep.elapsed():.0f} s")
    return 1 if rep.failed else 0


if __name__ == "__main__":
    sys.exit(main())
