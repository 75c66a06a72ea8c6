"""Sampling on the device (the sample_rows kernel, backends/cuda/kernels/sampling.py and its
emulation), through the emulated CuPy backend: Philox against its published test vectors,
greedy exactly the host's argmax, the filters' semantics, and picks that depend on the
row's own logits, seed and step alone. The real kernel is compared with this emulation
bit for bit on a GPU (compare_kernels_with_emulation)."""

from __future__ import annotations

import numpy as np
import pytest

from panechat.backends.cuda.cupy_backend import CupyBackend
from panechat.backends.cuda.kernels.emulation import emulate_sample_row
from panechat.backends.cuda.kernels.sampling import philox_word0, sampling_table, uniform
from panechat.engine.gguf.file import GGUFFile
from panechat.engine.model.forward import Batch, Model
from panechat.engine.serving.sampling import SamplingError, SamplingParams, device_sampling_rows, make_sampler


def test_philox_matches_the_random123_known_answers():
    assert philox_word0((0, 0, 0, 0), (0, 0)) == 0x6627E8D5
    assert philox_word0((0xFFFFFFFF,) * 4, (0xFFFFFFFF, 0xFFFFFFFF)) == 0x408F276D
    assert philox_word0((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0)) == 0xD16CFE09
    u = [uniform(5, s) for s in range(2000)]
    assert all(0 <= x < 1 for x in u) and 0.45 < np.mean(u) < 0.55 and len(set(u)) > 1990


def _pick(be, logits, **kw):
    """Device picks for logits [R, V] with the same parameters for every row."""
    R = logits.shape[0]
    p = SamplingParams(**{k: v for k, v in kw.items() if k != "step"})
    s = make_sampler(p)
    rows = device_sampling_rows([s] * R, [kw.get("step", 0)] * R)
    return be.sample_rows(be.asarray(np.asarray(logits, np.float32)), *rows)


def test_greedy_is_the_host_argmax_and_flags_non_finite_logits():
    be = CupyBackend.emulated_on_cpu()
    rng = np.random.default_rng(0)
    x = rng.standard_normal((5, 700)).astype(np.float32)
    x[1, [3, 400, 699]] = 9.0  # ties: the lowest index
    x[2, 600] = np.nan  # numpy's argmax lands on the NaN: bad
    x[3, 5] = np.inf
    x[4, :] = -np.inf
    got = _pick(be, x)
    assert got[:, 0].tolist() == [int(np.argmax(r)) for r in x]
    assert got[:, 1].tolist() == [0, 0, 1, 1, 1]
    host = make_sampler(SamplingParams())
    for r, pick in zip(x, got):  # the same error the host sampler raises
        if pick[1]:
            with pytest.raises(SamplingError):
                host(r)
            with pytest.raises(SamplingError):
                host.device_pick(pick)
        else:
            assert host.device_pick(pick) == host(r)
    assert _pick(be, x[:1], temperature=0.8)[0, 1] == 0  # a finite row samples
    assert _pick(be, x[2:3], temperature=0.8)[0, 1] == 1


def test_filters_keep_the_host_samplers_sets():
    x = np.log(np.array([0.4, 0.25, 0.15, 0.1, 0.06, 0.04], np.float32))
    ss = np.array([1, 0, 0], np.uint32)
    seen = {"k2": set(), "p": set(), "minp": set(), "all": set()}
    for step in range(300):
        ss[2] = step
        seen["k2"].add(emulate_sample_row(x, 1.0, 1.0, 0.0, 2, ss)[0])
        seen["p"].add(emulate_sample_row(x, 1.0, 0.6, 0.0, 0, ss)[0])  # 0.4 + 0.25 reaches 0.6
        seen["minp"].add(emulate_sample_row(x, 1.0, 1.0, 0.3, 0, ss)[0])  # >= 0.3 * 0.4
        seen["all"].add(emulate_sample_row(x, 1.0, 1.0, 0.0, 0, ss)[0])
    assert seen == {"k2": {0, 1}, "p": {0, 1}, "minp": {0, 1, 2}, "all": {0, 1, 2, 3, 4, 5}}
    assert emulate_sample_row(x, 1.0, 1e-6, 0.0, 0, ss)[0] == 0
    assert emulate_sample_row(x, 1.0, 1.0, 0.0, 1, ss)[0] == 0


def test_temperature_sampling_follows_the_softmax():
    x = np.array([2.0, 1.0, 0.5, 0.0, -1.0], np.float32)
    n = 4000
    counts = np.bincount([emulate_sample_row(x, 0.7, 1.0, 0.0, 0, np.array([9, 9, s], np.uint32))[0]
                          for s in range(n)], minlength=5)
    want = np.exp(x / 0.7) / np.exp(x / 0.7).sum()
    assert np.all(np.abs(counts / n - want) < 4 * np.sqrt(want * (1 - want) / n) + 1e-3), (counts / n, want)


def test_picks_depend_on_the_row_seed_and_step_alone(tiny):
    """A seeded request's tokens are the same alone or beside other rows, and greedy rows
    are the argmax of the logits `forward` returns (the emulated backend, a tiny model)."""
    path, _ = tiny("qwen2", "Q8_0", False)
    model = Model.load(GGUFFile.open(path), CupyBackend.emulated_on_cpu(), max_positions=32)
    a = model.args
    kv = model.backend.new_kv(4, a.n_layer, a.n_kv_head, 32, a.head_dim)
    prompts = [[1, 90, 198, 26], [50, 23, 63, 7], [28, 198, 66, 11]]
    for i, p in enumerate(prompts):
        model.forward(kv, Batch(np.array(p, np.int32), np.full(4, i, np.int32), np.arange(4, dtype=np.int32),
                                np.array([3])))
    samplers = [make_sampler(SamplingParams(temperature=1.5, top_k=40, top_p=0.95, seed=11)),
                make_sampler(SamplingParams()),
                make_sampler(SamplingParams(temperature=2.0, min_p=0.01, seed=12))]

    def step(rows, n):
        batch = Batch(np.array([5 + r for r in rows], np.int32), np.array(rows, np.int32),
                      np.full(len(rows), 4, np.int32), np.arange(len(rows)))
        picks = model.forward_tokens(kv, batch, *device_sampling_rows([samplers[r] for r in rows], [n] * len(rows)))
        return picks, model.forward(kv, batch)

    together, logits = step([2, 0, 1], 7)
    assert together[2, 0] == np.argmax(logits[2])
    for pos, r in enumerate([2, 0, 1]):
        alone, _ = step([r], 7)
        assert alone[0].tolist() == together[pos].tolist()
    steps = {int(step([0], n)[0][0, 0]) for n in range(12)}
    assert len(steps) > 1  # the step moves the draw


def test_sampling_table_layout():
    f, k, ss = sampling_table([0.0, 0.5], [1.0, 0.9], [0.0, 0.1], [0, 5], [2**40 + 3, 7], [1, 2])
    assert f.dtype == np.float32 and f.shape == (2, 4) and f[1].tolist()[:3] == pytest.approx([0.5, 0.9, 0.1])
    assert k.tolist() == [0, 5] and ss.dtype == np.uint32
    assert ss.tolist() == [[3, 256, 1], [7, 0, 2]]


def test_engine_samples_on_the_device_and_seeded_replies_do_not_depend_on_the_batch(tiny):
    """The engine with the emulated CuPy backend: every token comes from sample_rows (only
    ids cross), and each request's tokens are the same alone as in a busy batch."""
    from panechat.engine.serving.engine import Engine, EngineConfig
    from panechat.engine.model.loader import load_model

    path, _ = tiny("llama", "Q8_0")
    be = CupyBackend.emulated_on_cpu()
    lm = load_model(path, be, max_positions=64)
    prompts = [[1, 90, 198, 26], [50, 23, 63], [28, 198, 66, 11, 216]]
    params = [SamplingParams(temperature=1.2, top_k=50, seed=3, max_tokens=5),
              SamplingParams(max_tokens=5),
              SamplingParams(temperature=0.9, top_p=0.9, min_p=0.02, seed=4, max_tokens=5)]

    def run(which: list[int]) -> list[list[int]]:
        eng = Engine(lm, EngineConfig(max_concurrent=3, ctx_size=64, verify_invariance=False)).start()
        try:
            gens = [eng.submit(prompt_ids=prompts[i], params=params[i]) for i in which]
            return [list(g.result().token_ids) for g in gens]
        finally:
            eng.stop()

    be.kernels.module.launches.clear()
    together = run([0, 1, 2])
    picked = sum(grid[0] for name, grid in be.kernels.module.launches if name == "sample_rows")  # a row a pick
    assert picked >= sum(map(len, together))  # every token (drafts' checks too: several rows a launch)
    assert [run([i])[0] for i in range(3)] == together
