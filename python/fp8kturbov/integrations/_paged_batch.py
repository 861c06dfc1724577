"""The host bookkeeping of a paged batch: which page holds which position of which sequence.

Every attention layer of a model sees the same tokens, so one `PagedBatch` serves them all: the
block table, the sequence lengths and the slots of a step are computed once per forward and used
by each layer's pools (`fp8kturbov.integrations._pools`). Only real tokens take positions:
padding (a 0 in the attention mask) gets slot -1, which the write skips, so a left-padded prompt
and its unpadded twin give the same cache. Everything here is NumPy on the host: no device
synchronisation.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
from numpy.typing import NDArray

from .._limits import MAX_Q_LEN


@dataclass(frozen=True)
class Step:
    """One forward's new tokens, ``batch × q_len`` of them in row-major order.

    ``slots``: int64 ``[batch * q_len]``, -1 for padding. ``query_rows``: the flat indices (into
    ``batch * q_len``) of the real tokens, sequence by sequence; ``query_start``: int32
    ``[batch + 1]``, sequence ``s`` owning ``query_rows[query_start[s]:query_start[s+1]]``.
    ``seq_lens``: int32 ``[batch]``, the cached positions once the step is written;
    ``block_tables``: int32 ``[batch, pages]`` of pages of ``block_size`` tokens, pages enough
    for the longest sequence.
    ``uploads``: device copies of these arrays, made by the first layer that needs them and
    shared by the others (`fp8kturbov.integrations._pools`).
    """

    slots: NDArray[np.int64]
    query_rows: NDArray[np.int64]
    query_start: NDArray[np.int32]
    seq_lens: NDArray[np.int32]
    block_tables: NDArray[np.int32]
    block_size: int
    uploads: dict[Any, Any] = field(default_factory=dict, compare=False, repr=False)

    @property
    def query_slots(self) -> NDArray[np.int64]:
        """The slots of the real tokens, in query-row order (the decode's fused append)."""
        return self.slots[self.query_rows]

    @property
    def new_tokens(self) -> NDArray[np.int32]:
        """Real new tokens per sequence."""
        return np.diff(self.query_start).astype(np.int32)

    @property
    def max_new_tokens(self) -> int:
        return int(self.new_tokens.max(initial=0))

    @property
    def one_token_each(self) -> bool:
        """Every sequence has exactly one new token: a plain decode (no ``query_start``)."""
        return bool(np.all(self.new_tokens == 1))

    def sequence_slots(self, seq: int, first: int) -> NDArray[np.int64]:
        """The slots of sequence ``seq``'s cached positions ``first .. seq_lens[seq] - 1``."""
        positions = np.arange(first, int(self.seq_lens[seq]), dtype=np.int64)
        block_size = self.block_size
        return self.block_tables[seq, positions // block_size].astype(np.int64) * block_size + positions % block_size

    @property
    def fits_multi_token_decode(self) -> bool:
        """At most ``MAX_Q_LEN`` new tokens per sequence: the multi-token decode takes the step."""
        return self.max_new_tokens <= MAX_Q_LEN


class PagedBatch:
    """Block tables and lengths of ``batch_size`` sequences over pages of ``block_size`` tokens.

    Pages are numbered in the order they are first needed (``num_pages`` of them so far); a
    sequence's page is kept once given, so positions rewritten after `crop` reuse it.
    """

    def __init__(self, batch_size: int, block_size: int) -> None:
        self.batch_size = batch_size
        self.block_size = block_size
        self.seq_lens = np.zeros(batch_size, dtype=np.int64)
        self.tables = np.zeros((batch_size, 0), dtype=np.int32)
        self.pages_per_row = np.zeros(batch_size, dtype=np.int64)
        self.num_pages = 0

    def reserve(self, tokens_per_sequence: int) -> None:
        """Give every sequence the pages of ``tokens_per_sequence`` positions now (``max_cache_len``)."""
        self._grow_rows(np.full(self.batch_size, tokens_per_sequence, dtype=np.int64))

    def plan(self, real: NDArray[np.bool_]) -> Step:
        """The next step for ``real`` (bool ``[batch, q_len]``, True where a new token is not padding);
        the lengths advance."""
        if real.shape[0] != self.batch_size:
            raise ValueError(f"a step of {real.shape[0]} sequences on a cache of batch size "
                             f"{self.batch_size}")
        new_tokens = real.sum(axis=1).astype(np.int64)
        self._grow_rows(self.seq_lens + new_tokens)
        rank = np.cumsum(real, axis=1) - 1  # each real token's index among its row's new tokens
        positions = self.seq_lens[:, None] + rank
        rows = np.broadcast_to(np.arange(self.batch_size)[:, None], real.shape)
        safe = np.where(real, positions, 0)
        pages = self.tables[rows, safe // self.block_size].astype(np.int64)
        slots = np.where(real, pages * self.block_size + safe % self.block_size, -1)
        self.seq_lens = self.seq_lens + new_tokens
        query_start = np.concatenate([[0], np.cumsum(new_tokens)]).astype(np.int32)
        used_pages = max(1, -(-int(self.seq_lens.max(initial=0)) // self.block_size))
        return Step(slots=slots.reshape(-1).astype(np.int64),
                    query_rows=np.flatnonzero(real.reshape(-1)).astype(np.int64),
                    query_start=query_start, seq_lens=self.seq_lens.astype(np.int32),
                    block_tables=np.ascontiguousarray(self.tables[:, :used_pages]),
                    block_size=self.block_size)

    def crop(self, tokens: int) -> None:
        """Forget the last ``tokens`` positions of every sequence (their pages stay assigned)."""
        self.seq_lens = np.maximum(self.seq_lens - tokens, 0)

    def select(self, rows: NDArray[np.int64]) -> tuple[NDArray[np.int64], NDArray[np.int64]]:
        """Make sequence ``i`` a copy of sequence ``rows[i]`` (beam search's reorder, or a new batch
        size); returns the ``(source, destination)`` pages whose contents the pools must copy, all
        sources read before any destination is written. Sequence ``i`` keeps its own pages (new
        ones where it had too few), so a reorder every step takes no more memory."""
        rows = np.asarray(rows, dtype=np.int64).reshape(-1)
        old_tables, old_lens = self.tables, self.seq_lens
        kept = min(len(rows), self.batch_size)
        self.batch_size = len(rows)
        self.seq_lens = old_lens[rows].copy()
        self.tables = np.zeros((self.batch_size, old_tables.shape[1]), dtype=np.int32)
        self.tables[:kept] = old_tables[:kept]
        self.pages_per_row = np.concatenate([self.pages_per_row[:kept],
                                             np.zeros(self.batch_size - kept, dtype=np.int64)])
        self._grow_rows(self.seq_lens)
        used = -(-self.seq_lens // self.block_size)
        source = [old_tables[r, :n] for r, n in zip(rows, used)]
        destination = [self.tables[i, :n] for i, n in enumerate(used)]
        return (np.concatenate(source).astype(np.int64) if source else np.zeros(0, np.int64),
                np.concatenate(destination).astype(np.int64) if destination else np.zeros(0, np.int64))

    def _grow_rows(self, lengths: NDArray[np.int64]) -> None:
        """Give each sequence pages for ``lengths[s]`` positions (new pages numbered in order)."""
        needed = -(-np.asarray(lengths, dtype=np.int64) // self.block_size)
        width = int(needed.max(initial=0))
        if width > self.tables.shape[1]:
            grown = np.zeros((self.batch_size, width), dtype=np.int32)
            grown[:, :self.tables.shape[1]] = self.tables
            self.tables = grown
        for s in np.flatnonzero(needed > self.pages_per_row):
            count = int(needed[s] - self.pages_per_row[s])
            self.tables[s, self.pages_per_row[s]:needed[s]] = np.arange(
                self.num_pages, self.num_pages + count, dtype=np.int32)
            self.num_pages += count
            self.pages_per_row[s] = needed[s]
