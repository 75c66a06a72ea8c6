"""`panechat bench sweep` on the CuPy backend's code path (the emulated kernels: no GPU
here): decode steps go through the per-bucket graphs and greedy picks are made on the
device, and sequence 0's tokens are the same at every B."""

from __future__ import annotations

from panechat.app.bench.sweep import sweep_cell
from panechat.backends.cuda.cupy_backend import CupyBackend
from panechat.engine.gguf.file import GGUFFile
from panechat.engine.model.forward import Model


def test_sweep_cells_pick_on_the_device_and_agree_across_batch_sizes(tiny):
    path, _ = tiny("llama", "Q8_0")
    be = CupyBackend.emulated_on_cpu()
    model = Model.load(GGUFFile.open(path), be, max_positions=32)
    be.kernels.module.launches.clear()
    one = sweep_cell(model, 6, 4, 1)
    three = sweep_cell(model, 6, 4, 3)
    assert one["seq0"] == three["seq0"]
    assert sum(name == "sample_rows" for name, _ in be.kernels.module.launches) == 8
    assert be.graphs.capturer.captures == 2  # buckets 1 and 4
