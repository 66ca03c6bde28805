"""The decode step of a stock Hugging Face model, captured in CUDA graphs and replayed.

A small decode batch spends more time launching kernels than running them (hundreds of launches per
step for a 30-layer model). ``DecodeGraphRunner`` captures the whole forward of a pure decode step (one
new token per sequence, every sequence sampling) once per batch size of a ladder
(``capture_batch_sizes``: 1, 2, 4, 8, then steps of 8 up to the maximum), largest first, into one memory
pool, and replays it: a batch is padded up to the next captured size; above the largest it is not
taken (``accepts``) and the model runner runs it eagerly.

Contract:
- Inputs live in static buffers: one flat int64 tensor on the device, filled with one host-to-device copy
  per step from a (pinned) host twin, viewed as input ids, positions, slot mapping, context lengths and
  block tables ``[max_batch, max_blocks]``. A padding row has slot -1 (the store kernel writes nothing)
  and context length 0 (the decode kernel reads nothing and outputs zeros), so padding never touches a
  real sequence's cache. Only a backend that ``supports_cuda_graphs`` honours those two conventions
  (the Triton one), so graphs require it.
- Each captured graph ends by copying its logits into one shared ``[max_batch, vocab]`` buffer, so the
  per-size logits inside the pool can be reused by the next (smaller) capture. ``run`` returns a view of
  that buffer, valid until the next ``run``: the caller samples from it before stepping again.
- No host synchronization inside the step: the host buffer is written only after the previous step's
  tokens were read back (the engine's sampler does that), so the asynchronous copy from it has finished.
- ``capture=False`` runs the very same path (static buffers, padding, the per-size metadata) eagerly
  instead of replaying: the runner's logic is tested on CPU this way (Triton under ``TRITON_INTERPRET=1``),
  and a GPU test compares replay with it bit for bit.
"""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass

import torch
from torch import nn

from llm_api.engine.attention import METADATA_KWARG, AttentionBackend, PagedAttentionMetadata
from llm_api.engine.kv_cache import PagedKVCache

logger = logging.getLogger(__name__)

PADDING_SLOT = -1


def capture_batch_sizes(max_batch_size: int) -> list[int]:
    """The ladder of captured batch sizes, ascending: 1, 2, 4, 8, 16, 24, ... up to ``max_batch_size``."""
    if max_batch_size < 1:
        raise ValueError("max_batch_size must be at least 1")
    sizes = [s for s in (1, 2, 4, 8) if s <= max_batch_size]
    sizes += range(16, max_batch_size + 1, 8)
    if sizes[-1] != max_batch_size:
        sizes.append(max_batch_size)
    return sizes


@dataclass(frozen=True)
class DecodeRow:
    """One sequence of a decode step: the token it feeds, at which position, into which slot, and its
    block table (``table_version`` changes only when the table is rebuilt; between rebuilds it grows)."""

    token_id: int
    position: int
    slot: int
    request_id: str
    table_version: int
    block_ids: list[int]


class DecodeGraphRunner:
    def __init__(self, model: nn.Module, kv_cache: PagedKVCache, backend: AttentionBackend, device: torch.device,
                 max_model_len: int, batch_sizes: list[int], capture: bool):
        self.model = model
        self.backend = backend
        self.device = torch.device(device)
        self.batch_sizes = sorted(batch_sizes)
        self.max_batch_size = self.batch_sizes[-1]
        self.capture_enabled = capture
        self.block_size = kv_cache.block_size
        self.max_blocks = -(-max_model_len // self.block_size)
        batch, blocks = self.max_batch_size, self.max_blocks
        # Layout of the flat buffers: ids | positions | slots | context lens | block tables.
        numel = 4 * batch + batch * blocks
        pin = self.device.type == "cuda"
        self._host = torch.zeros(numel, dtype=torch.long, pin_memory=pin)
        self._static = torch.zeros(numel, dtype=torch.long, device=self.device)
        self._host_numpy = [view.numpy() for view in self._split(self._host)]
        # Per row: (request id, table version, entries written) of what the host block table holds.
        self._row_tables: list[tuple[str, int, int] | None] = [None] * self.max_batch_size
        self.input_ids, self.positions, self.slot_mapping, self.context_lens, self.block_tables = \
            self._split(self._static)
        self._metadata = {size: self._metadata_for(kv_cache, size) for size in self.batch_sizes}
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._logits: torch.Tensor | None = None  # [max_batch, vocab], written by every size
        self.steps_by_size: Counter[int] = Counter()  # padded size -> decode steps run through it

    def _split(self, flat: torch.Tensor):
        batch, blocks = self.max_batch_size, self.max_blocks
        ids, positions, slots, context_lens = (flat[i * batch:(i + 1) * batch] for i in range(4))
        return ids, positions, slots, context_lens, flat[4 * batch:].view(batch, blocks)

    def _metadata_for(self, kv_cache: PagedKVCache, size: int) -> PagedAttentionMetadata:
        # Static views of the buffers: the attention function finds them already on the device, so it
        # neither copies nor allocates them during capture.
        return self.backend.metadata(
            key_caches=kv_cache.key_caches,
            value_caches=kv_cache.value_caches,
            slot_mapping=self.slot_mapping[:size],
            block_tables=self.block_tables[:size],
            context_lens=self.context_lens[:size],
            query_start_loc=list(range(size + 1)),
            context_lens_list=[],  # only the per-sequence prefill loop reads it; a decode step has none
            num_decode_seqs=size,
            max_query_len=1,
            query_start_loc_tensor=torch.arange(size + 1, dtype=torch.int32, device=self.device),
        )

    # ------------------------------------------------------------------ capture

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every size, largest first into one pool (each smaller graph reuses its memory). Each size
        first runs once eagerly, outside capture: Triton compiles its kernels for the shape and cuBLAS picks
        its algorithms there, which capture would not allow."""
        self._logits = None
        self._fill(self.max_batch_size, [])
        pool = torch.cuda.graph_pool_handle() if self.capture_enabled else None
        for size in sorted(self.batch_sizes, reverse=True):
            logits = self._forward(size)
            if self._logits is None:
                self._logits = torch.empty((self.max_batch_size, logits.shape[-1]), dtype=logits.dtype,
                                           device=logits.device)
            if not self.capture_enabled:
                continue
            torch.cuda.synchronize(self.device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self._logits[:size].copy_(self._forward(size))
            self._graphs[size] = graph
        if self.capture_enabled:
            torch.cuda.synchronize(self.device)
        logger.info("decode step %s for batch sizes %s", "captured in CUDA graphs" if self.capture_enabled
                    else "runs eagerly on static buffers", self.batch_sizes)

    def _forward(self, size: int) -> torch.Tensor:
        output = self.model(input_ids=self.input_ids[None, :size], position_ids=self.positions[None, :size],
                            use_cache=False, **{METADATA_KWARG: self._metadata[size]})
        return output.logits[0]  # [size, vocab]

    # ------------------------------------------------------------------ replay

    def accepts(self, batch_size: int) -> bool:
        return batch_size <= self.max_batch_size

    def padded_size(self, batch_size: int) -> int:
        return next(size for size in self.batch_sizes if size >= batch_size)

    @torch.inference_mode()
    def run(self, rows: list[DecodeRow]) -> torch.Tensor:
        """Logits ``[len(rows), vocab]`` of one decode step, in the order of ``rows``."""
        if not rows or not self.accepts(len(rows)):
            raise ValueError(f"a captured decode step takes 1..{self.max_batch_size} rows, got {len(rows)}")
        if self._logits is None:
            raise RuntimeError("DecodeGraphRunner.capture() has not run")
        size = self.padded_size(len(rows))
        self.steps_by_size[size] += 1
        self._fill(size, rows)
        if self.capture_enabled:
            self._graphs[size].replay()
        else:
            self._logits[:size].copy_(self._forward(size))
        return self._logits[: len(rows)]

    def _fill(self, size: int, rows: list[DecodeRow]) -> None:
        # Written through numpy views of the host buffer: converting Python ints is the cost here, and
        # numpy takes a list of them in one call (torch.tensor on 128 x 64 nested ints took ~1 ms).
        ids, positions, slots, context_lens, block_tables = self._host_numpy
        num_rows = len(rows)
        if num_rows:
            ids[:num_rows] = [r.token_id for r in rows]
            positions[:num_rows] = [r.position for r in rows]
            slots[:num_rows] = [r.slot for r in rows]
            context_lens[:num_rows] = positions[:num_rows] + 1
            for i, row in enumerate(rows):
                self._write_block_row(block_tables, i, row)
        ids[num_rows:size] = 0
        positions[num_rows:size] = 0
        slots[num_rows:size] = PADDING_SLOT
        context_lens[num_rows:size] = 0
        for i in range(num_rows, size):  # a padding row's table is never read; forget whose it was
            self._row_tables[i] = None
        self._static.copy_(self._host, non_blocking=True)

    def _write_block_row(self, block_tables, index: int, row: DecodeRow) -> None:
        """Row ``index`` of the host block table := ``row.block_ids``, writing only what changed since the last
        step: when the row held the same request under the same table version, its first entries are
        already there (a table only grows between rebuilds, see ``model_runner.BlockTables``)."""
        block_ids = row.block_ids
        if len(block_ids) > self.max_blocks:
            raise ValueError(f"a sequence holds {len(block_ids)} blocks; the captured tables have {self.max_blocks}")
        known = self._row_tables[index]
        written = known[2] if known is not None and known[:2] == (row.request_id, row.table_version) else 0
        if written < len(block_ids):
            block_tables[index, written:len(block_ids)] = block_ids[written:]
        self._row_tables[index] = (row.request_id, row.table_version, len(block_ids))
