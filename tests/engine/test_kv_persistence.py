"""KV snapshots in the engine (engine/kv/persistence.py) on the default model: an evicted
conversation's KV is written and read back instead of re-prefilled, an engine stop writes
the idle conversations, a new engine restores them; the reply is the same bit for bit as a
fresh prefill's. A damaged, truncated or other-model snapshot is ignored with one log line
and the conversation still gets the fresh prefill's reply."""

from __future__ import annotations

import logging
import shutil

import pytest

from panechat.backends.paged_kv import bytes_per_block
from panechat.engine.serving.engine import SNAPSHOT_DTYPES, Engine, EngineConfig
from panechat.engine.gguf.header import read_gguf_header
from panechat.engine.kv.snapshot import KVShape, model_identity, read_snapshot, write_snapshot
from panechat.engine.serving.sampling import SamplingParams

LONG_Q = "Summarize: " + " ".join(f"item {i} is a {['cat', 'dog', 'fish'][i % 3]}." for i in range(60))
OTHER_Q = "List: " + " ".join(f"color {i} is {['red', 'green', 'blue'][i % 3]}." for i in range(20))
PARAMS = SamplingParams(max_tokens=12)
FIRST = [{"role": "user", "content": LONG_Q}]


def _engine(lm, snapshots=None, **kw):
    cfg = dict(max_concurrent=1, kv_sessions=1, ctx_size=1024, verify_invariance=False)  # one row a step
    if snapshots is not None:
        cfg.update(kv_snapshot_dir=str(snapshots), kv_snapshot_min_tokens=64)
    cfg.update(kw)
    return Engine(lm, EngineConfig(**cfg)).start()


@pytest.fixture(scope="module")
def reference(loaded_model):
    """Replies with no snapshots at all: the first turn, and the second turn's (second
    messages, reply)."""
    e = _engine(loaded_model)
    try:
        first = e.submit(FIRST, params=PARAMS).result()
        second = FIRST + [{"role": "assistant", "content": first.text},
                          {"role": "user", "content": "And the dogs?"}]
        return first, second, e.submit(second, params=PARAMS).result()
    finally:
        e.stop()


@pytest.fixture(scope="module")
def stopped_dir(loaded_model, reference, tmp_path_factory):
    """A snapshot folder left by an engine that answered the first turn and stopped."""
    d = tmp_path_factory.mktemp("kv")
    e = _engine(loaded_model, d)
    try:
        assert e.submit(FIRST, params=PARAMS, conversation="a").result().token_ids == reference[0].token_ids
    finally:
        e.stop()
    assert e.stats().kv_snapshots_written == 1
    return d


def _files(d):
    return sorted(d.glob("*/*.kvsnap"))


def _shape(lm):
    a = lm.model.args
    return KVShape(SNAPSHOT_DTYPES[EngineConfig().kv_dtype], a.n_layer, a.n_kv_head, a.head_dim)


def test_an_evicted_conversation_is_restored_not_reprefilled(loaded_model, reference, tmp_path):
    first, second, want = reference
    a = loaded_model.model.args
    block = bytes_per_block(a.n_layer, a.n_kv_head, a.head_dim, EngineConfig().kv_dtype)
    # 36 blocks: "a" (33 blocks) and "b" (11) do not fit together, so "b" evicts a's tail
    # (the least recently used cached blocks); a's next turn still needs only 35
    e = _engine(loaded_model, tmp_path, kv_memory=36 * block)
    try:
        assert e.submit(FIRST, params=PARAMS, conversation="a").result().token_ids == first.token_ids
        e.submit([{"role": "user", "content": OTHER_Q}], params=PARAMS, conversation="b").result()
        assert e.stats().evictions >= 5  # "a"'s tail was evicted for "b": more than min_gain tokens
        got = e.submit(second, params=PARAMS, conversation="a").result()
        s = e.stats()
        assert got.token_ids == want.token_ids
        assert s.kv_snapshots_restored == 1
        assert got.usage["reused_tokens"] > len(reference[0].token_ids) + 400  # the whole first turn
    finally:
        e.stop()


def test_a_new_engine_restores_what_the_stopped_one_wrote(loaded_model, reference, stopped_dir, tmp_path):
    d = tmp_path / "kv"
    shutil.copytree(stopped_dir, d)
    e = _engine(loaded_model, d)
    try:
        got = e.submit(reference[1], params=PARAMS, conversation="a").result()
        assert got.token_ids == reference[2].token_ids
        assert e.stats().kv_snapshots_restored == 1
        assert got.usage["reused_tokens"] > 400
    finally:
        e.stop()


def test_without_snapshots_nothing_is_written_or_restored(loaded_model, reference, stopped_dir, tmp_path):
    e = _engine(loaded_model, None)
    try:
        got = e.submit(reference[1], params=PARAMS).result()
        assert got.token_ids == reference[2].token_ids and got.usage["reused_tokens"] == 0
        assert e.stats().kv_snapshots_restored == 0
    finally:
        e.stop()


def _truncate(p, model_id, shape):
    p.write_bytes(p.read_bytes()[:-1000])


def _flip(p, model_id, shape):
    data = bytearray(p.read_bytes())
    data[len(data) // 2] ^= 0x04  # one bit of one K/V value
    p.write_bytes(bytes(data))


def _other_model(p, model_id, shape):
    tokens, arrays = read_snapshot(p, model_id, shape)  # a whole, valid file, only of another model
    write_snapshot(p, "0" * 32, shape, tokens, [(k.copy(), v.copy()) for k, v in arrays])


@pytest.mark.parametrize("damage,why", [(_truncate, "truncated"), (_flip, "checksum"),
                                        (_other_model, "another model")],
                         ids=["truncated", "one-bit-flipped", "other-model"])
def test_a_bad_snapshot_is_ignored_with_one_line_and_the_reply_is_right(
        loaded_model, reference, stopped_dir, tmp_path, caplog, damage, why):
    d = tmp_path / "kv"
    shutil.copytree(stopped_dir, d)
    (snap,) = _files(d)
    shape = _shape(loaded_model)  # the cache's dtype (float16 by default)
    damage(snap, model_identity(loaded_model.path, read_gguf_header(loaded_model.path).data_start), shape)
    caplog.set_level(logging.INFO, logger="panechat.engine")
    e = _engine(loaded_model, d)
    try:
        got = e.submit(reference[1], params=PARAMS, conversation="a").result()
        assert got.token_ids == reference[2].token_ids  # the fresh prefill's reply
        assert e.stats().kv_snapshots_restored == 0 and got.usage["reused_tokens"] == 0
    finally:
        e.stop()
    lines = [r.getMessage() for r in caplog.records if "ignored" in r.getMessage()]
    assert len(lines) == 1 and why in lines[0] and snap.name in lines[0], lines
    assert not snap.exists()  # deleted; the stop wrote a good one for the new history
    assert len(_files(d)) == 1
