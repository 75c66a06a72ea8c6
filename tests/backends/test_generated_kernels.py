"""The per-type kernels generated from the quant-type registry (backends/cpu/generated.py)
and numba's on-disk cache: each type's kernel has an index file of its own, a warm start
reads every one from the cache without compiling, and no type is ever served another
type's code (the products are each type's own, bit for bit)."""

import json
import os
import subprocess
import sys

import numpy as np

from panechat.backends.cpu import numpy_kernels as nk
from panechat.backends.quant.gguf_tensor import GGUFTensor

TYPES = ("Q8_0", "Q4_0")  # two types of one template: one bytecode, two loaders

# One process: the kernel of each type (one thread) on its weights, into a fresh cache dir (set
# after import, so whatever the package sets, these kernels go there).
_RUN = """
import json, sys
import numpy as np
from numba.core import config
from panechat.backends.cpu import quant_kernels as qk
config.CACHE_DIR = sys.argv[1]
data = np.load(sys.argv[2])
stats = {}
for qtype in %r:
    out = np.empty((2, 16), np.float32)
    qk.linear_block32(data["x"], data[qtype], qtype, out)
    np.save(f"{sys.argv[1]}/{qtype}.npy", out)
    s = qk.kernel(qtype).stats
    stats[qtype] = [sum(s.cache_hits.values()), sum(s.cache_misses.values())]
print(json.dumps(stats))
""" % (TYPES,)


def _run(cache, data):
    env = dict(os.environ, NUMBA_NUM_THREADS="1")
    done = subprocess.run([sys.executable, "-c", _RUN, str(cache), str(data)], env=env, capture_output=True,
                          text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_two_generated_kernels_cache_apart_and_a_warm_start_compiles_nothing(tmp_path):
    rng = np.random.default_rng(3)
    x = rng.standard_normal((2, 64), dtype=np.float32)
    w = {q: GGUFTensor.from_array(rng.standard_normal((16, 64), dtype=np.float32), q) for q in TYPES}
    np.savez(tmp_path / "data.npz", x=x, **{q: t.blocks for q, t in w.items()})
    want = {q: nk.linear(x, t.dequantize(), np.empty((2, 16), np.float32)) for q, t in w.items()}
    assert not np.array_equal(want["Q8_0"], want["Q4_0"])  # the types' products differ
    cache = tmp_path / "cache"
    cache.mkdir()
    cold = _run(cache, tmp_path / "data.npz")
    assert all(hits == 0 and misses > 0 for hits, misses in cold.values()), cold
    for q in TYPES:
        assert np.array_equal(np.load(cache / f"{q}.npy"), want[q]), q
        assert len(list(cache.rglob(f"*_linear_{q.lower()}-*.nbi"))) == 1, q  # an index of its own
    warm = _run(cache, tmp_path / "data.npz")
    assert all(hits > 0 and misses == 0 for hits, misses in warm.values()), warm  # read, not compiled
    for q in TYPES:  # each served its own code
        assert np.array_equal(np.load(cache / f"{q}.npy"), want[q]), q
