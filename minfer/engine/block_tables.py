"""Every running sequence's block table, kept as a row of one tensor between steps.

A step's attention needs the block tables of its sequences as one int32 tensor [seqs, widest].
Built afresh every step from Python lists, that costs time in proportion to the batch times the
length of every table (a 4,096-token sequence holds 256 blocks of 16), although between two
steps almost nothing changes: a decoding sequence gains a block once every block_size tokens.

So each sequence gets a row of a preallocated tensor the first time it is scheduled, keeps it
until it leaves, and the row is written only where its table changed: usually one new block id at
the end; the whole row after a preemption (new blocks) or a rejected draft (blocks given back).
All of a step's changes go in with one indexed write, and the step's tables are one
`index_select` of its rows: the number of tensor operations does not grow with the batch.
(vLLM's persistent input batch and block table work the same way.)
"""
from __future__ import annotations

import torch

from minfer.sequence import Sequence


class BlockTables:
    def __init__(self, max_blocks_per_seq: int, rows: int = 64) -> None:
        self.table = torch.zeros(rows, max_blocks_per_seq, dtype=torch.int32)  # CPU: copied to the device per step
        self.row_of: dict[Sequence, int] = {}
        self.written: list[list[int]] = [[] for _ in range(rows)]  # what each row holds, as the sequence had it
        self.free_rows = list(range(rows - 1, -1, -1))

    def rows(self, seqs: list[Sequence]) -> list[int]:
        """Each sequence's row, after writing whatever changed in its table since the last call."""
        rows, changed_rows, changed_cols, values = [], [], [], []
        for seq in seqs:
            row = self.row_of.get(seq)
            if row is None:
                row = self._assign(seq)
            table, written = seq.block_table, self.written[row]
            if table != written:  # a list comparison in C: cheap next to one tensor operation
                same = len(written) <= len(table) and table[:len(written)] == written
                start = len(written) if same else 0  # grown at the end (the usual case), or rewritten whole
                changed_rows += [row] * (len(table) - start)
                changed_cols += range(start, len(table))
                values += table[start:]
                self.written[row] = list(table)
            rows.append(row)
        if values:
            self.table[torch.tensor(changed_rows), torch.tensor(changed_cols)] = torch.tensor(values, dtype=torch.int32)
        return rows

    def gather(self, rows: list[int], width: int) -> torch.Tensor:
        """The tables of these rows, [len(rows), width] int32. Columns past a sequence's own table hold
        old block ids: valid addresses that no reader uses (every reader stops at its sequence's length)."""
        return self.table[torch.tensor(rows), :width]

    def release(self, seq: Sequence) -> None:
        """The sequence has left the engine: its row is free for the next one."""
        row = self.row_of.pop(seq, None)
        if row is not None:
            self.written[row] = []
            self.free_rows.append(row)

    def _assign(self, seq: Sequence) -> int:
        if not self.free_rows:  # more sequences than rows: twice the rows
            grown = len(self.written)
            self.table = torch.cat([self.table, torch.zeros_like(self.table)])
            self.written += [[] for _ in range(grown)]
            self.free_rows = list(range(2 * grown - 1, grown - 1, -1))
        row = self.free_rows.pop()
        self.row_of[seq] = row
        return row
