"""`EngineConfig`: the engine's limits and batching knobs, in a module of their own so the
CLI can read the defaults and limits without loading the engine."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

def format_size(n: float) -> str:
    """1536 MiB -> '1.5 GiB' (binary units, for start-up lines and benchmarks)."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


@dataclass
class EngineConfig:
    """Limits and batching knobs (the CLI flags of the same names, whose defaults these are).

    Every limit lives in `validate()`, which construction runs: an EngineConfig that exists
    is a valid one."""

    MAX_CONCURRENT: ClassVar[int] = 64
    MAX_QUEUE: ClassVar[int] = 4096  # a queued request holds its prompt's token list (a few KiB .. ~150 KiB)
    MIN_CTX: ClassVar[int] = 64  # tokens; less leaves no room for a chat template and a reply
    MAX_STRAGGLER_MS: ClassVar[float] = 1000.0

    KV_MEMORY_SHARE: ClassVar[float] = 0.25  # of free RAM / device memory, the default KV budget
    KV_DTYPES: ClassVar[tuple[str, ...]] = ("f16", "f32")
    SPEC_MODES: ClassVar[tuple[str, ...]] = ("ngram", "draft", "off")  # --spec (engine/serving/speculation.py)

    max_concurrent: int = 4
    kv_sessions: int | None = None  # a KV budget of this many whole contexts (when kv_memory is None)
    kv_memory: int | None = None  # KV budget in bytes; default: KV_MEMORY_SHARE of free memory
    kv_dtype: str = "f16"
    prefix_caching: bool = True  # share computed KV blocks between sequences with the same prefix
    max_queue: int = 64  # a client past the running ones waits in line (latency) rather than get a 429
    max_queue_per_client: int | None = None  # one client's waiting requests (None: up to max_queue)
    ctx_size: int = 4096
    prefill_chunk: int = 512
    straggler_ms: float = 2.0
    verify_invariance: bool = True
    spec: str = "ngram"  # speculative decoding: n-gram or draft-model drafts checked exactly, or off
    draft_model: str | None = None  # --draft-model PATH|NAME: the drafter of --spec draft (draft_model.py)
    # KV snapshots (engine/kv/persistence.py): a folder turns them on (the CLI passes
    # $XDG_CACHE_HOME/panechat/kv unless --kv-snapshots off); None: off
    kv_snapshot_dir: str | None = None
    kv_snapshot_memory: int = 4 << 30  # --kv-snapshot-memory: bytes of snapshots kept on disk
    kv_snapshot_min_tokens: int = 256  # shorter conversations are cheaper to prefill than to read

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Raise ValueError, one line naming the flag and its range, for a value out of range."""
        if not 1 <= self.max_concurrent <= self.MAX_CONCURRENT:
            raise ValueError(f"--max-concurrent must be between 1 and {self.MAX_CONCURRENT}")
        if self.kv_sessions is not None and self.kv_sessions < self.max_concurrent:
            raise ValueError("--kv-sessions must be at least --max-concurrent")
        if self.kv_memory is not None and self.kv_memory <= 0:
            raise ValueError("--kv-memory must be a positive size, like 2GiB")
        if self.spec not in self.SPEC_MODES:
            raise ValueError(f"--spec must be one of {', '.join(self.SPEC_MODES)}")
        if self.spec == "draft" and not self.draft_model:
            raise ValueError("--spec draft needs --draft-model PATH|NAME (a small model with the same vocabulary)")
        if self.draft_model and self.spec != "draft":
            raise ValueError(f"--draft-model drafts only with --spec draft (not --spec {self.spec})")
        if self.kv_dtype not in self.KV_DTYPES:
            raise ValueError(f"--kv-dtype must be one of {', '.join(self.KV_DTYPES)}")
        if not 0 <= self.max_queue <= self.MAX_QUEUE:
            raise ValueError(f"--max-queue must be between 0 and {self.MAX_QUEUE}")
        if self.max_queue_per_client is not None and not 1 <= self.max_queue_per_client <= self.MAX_QUEUE:
            raise ValueError(f"--max-queue-per-client must be between 1 and {self.MAX_QUEUE}")
        if self.ctx_size < self.MIN_CTX:
            raise ValueError(f"--ctx-size must be at least {self.MIN_CTX}")
        if self.prefill_chunk < 1:
            raise ValueError("--prefill-chunk must be >= 1")
        if self.kv_snapshot_memory < 0:
            raise ValueError("--kv-snapshot-memory must be >= 0")
        if self.kv_snapshot_min_tokens < 1:
            raise ValueError("kv_snapshot_min_tokens must be >= 1")
        if not 0 <= self.straggler_ms <= self.MAX_STRAGGLER_MS:
            raise ValueError(f"--straggler-ms must be between 0 and {self.MAX_STRAGGLER_MS:g}")
