"""The host's work per decode step does not grow with the batch: ATen operations counted per step, and the
persistent block tables that keep the step's tensors from being rebuilt sequence by sequence."""
import tempfile

import pytest

from minfer.lab.bench.host import measure, tiny_llm
from minfer.engine.block_tables import BlockTables
from minfer.outputs import RequestMetrics
from minfer.sampling_params import SamplingParams
from minfer.sequence import Sequence


@pytest.fixture(scope="module")
def host_llm():
    with tempfile.TemporaryDirectory() as folder:
        yield tiny_llm(folder, 256)


@pytest.mark.parametrize("sampling", ["greedy", "mixed"])
def test_operations_per_decode_step_do_not_grow_with_the_batch(host_llm, sampling):
    """On a GPU each ATen operation is a kernel launch: a step of 256 sequences must not launch more than a step of
    32, and the engine's own operations (all but the forward pass) not more than 1.3x those of one sequence.
    (The forward pass of one sequence reads its KV cache in place on a CPU, a few operations fewer than a batch's.)"""
    rows = {batch: measure(host_llm, batch, steps=2, sampling=sampling, repeats=1) for batch in (1, 32, 256)}
    assert rows[256].ops_per_step == rows[32].ops_per_step, {b: r.ops_per_step for b, r in rows.items()}
    assert rows[256].ops_outside_forward <= 1.3 * rows[1].ops_outside_forward, {b: r.ops_outside_forward
                                                                                 for b, r in rows.items()}
    assert rows[256].ops_per_step <= 1.4 * rows[1].ops_per_step  # measured 1.33x greedy, 1.12x mixed


def seq(table):
    s = Sequence([1, 2, 3], SamplingParams(), 8, 0, RequestMetrics(0.0))
    s.block_table = table
    return s


def test_block_tables_write_only_what_changed():
    tables = BlockTables(max_blocks_per_seq=6, rows=2)
    a, b = seq([4, 7]), seq([1])
    assert tables.rows([a, b]) == [0, 1]
    assert tables.gather([0, 1], 2).tolist() == [[4, 7], [1, 0]]
    a.block_table.append(9)  # grown at the end
    b.block_table[:] = [5, 6]  # rewritten whole (a preemption gives new blocks)
    assert tables.rows([b, a]) == [1, 0]
    assert tables.gather([0, 1], 3).tolist()[0] == [4, 7, 9] and tables.gather([1], 2).tolist() == [[5, 6]]
    del a.block_table[1:]  # a rejected draft's block given back, another taken
    a.block_table.append(3)
    tables.rows([a])
    assert tables.gather([0], 2).tolist() == [[4, 3]]
    c = seq([8, 8, 8])
    assert tables.rows([c]) == [2]  # more sequences than rows: the table grows
    tables.release(a)
    d = seq([2])
    assert tables.rows([d]) == [0]  # a's row, reused and rewritten
    assert tables.gather([0], 1).tolist() == [[2]] and tables.gather([2], 3).tolist() == [[8, 8, 8]]
