"""Async scheduling: the host prepares step n + 1 while the model computes step n.

A synchronous engine does everything in turn: schedule, prepare, run the model, read the tokens
back, append them, decode their text, check for stops, report. While the host does its part the
model waits, and while the model runs the host waits. On a GPU a decode step of a small model
can take less time than the host's part of it.

With async scheduling (`EngineConfig.async_scheduling`, vLLM's name) the engine launches step
n + 1 before it reads step n's tokens:

    step() call k:   schedule n+1 -> prepare n+1 -> launch n+1 -> read step n's tokens -> text, stops, outputs of n
    the model:       ......... step n ..........|.................... step n + 1 .....................

What makes that possible:
- the scheduler only needs to know how many tokens each sequence will have, not which: a
  sequence with a token in flight (`Sequence.num_pending`) brings that one token to step n + 1;
- its input there is a placeholder that the device fills from step n's draws before the model
  reads it (`ModelRunner.forward`'s drawn_before): the token never visits the host first;
- a sequence that step n ends (EOS, a stop string) has already been scheduled for step n + 1:
  that row is computed and thrown away, one wasted row per finished sequence. One whose
  max_tokens step n reaches is not scheduled (its length is known without its token).

On a GPU, launching is queueing kernels: the host returns at once and the device runs the steps
back to back, while the host reads step n's tokens and works on them. For that, nothing in a launch may
wait for the device: no value read back, and every input copied from pinned memory without blocking
(`minfer.host_copy.to_device`); `tests/test_async_scheduling.py` checks both. And reading step n's tokens
must wait for step n only: a plain read would also wait for step n + 1, queued before it on the same
stream, and the device would sit idle while the host works. So a launch also queues the copy of its
tokens to the host, with an event behind it (`minfer.host_copy.to_host`), and the read waits for that
event. (Log-probabilities are read from the logits later, which does wait for the queue: a request that
asks for them costs the overlap of the steps it is in.)
On a CPU the model runs on the calling thread, so nothing overlaps there: the steps come out the same, in
the same order, and a step costs what it costs synchronously (running the model on a second thread was
measured slower; see docs/benchmarks.md). The CPU runs exactly the code that a GPU runs, which is what
the tests check against the synchronous engine.
"""
from __future__ import annotations

from typing import Optional

import torch

from minfer.engine.model_runner import Draws, ModelRunner, PreparedStep, StepOutput, step_output
from minfer.host_copy import HostCopy, to_host
from minfer.layers.sampler import sample
from minfer.sequence import Sequence


class InFlightStep:
    """A launched step: its inputs, and its logits and draws, on the device, being computed; its tokens on their
    way to the host."""

    def __init__(self, step: PreparedStep, draws: Draws, logits: torch.Tensor, drawn: Optional[torch.Tensor]) -> None:
        self.step, self.draws, self.logits, self.drawn = step, draws, logits, drawn
        self.tokens: Optional[HostCopy] = to_host(drawn) if drawn is not None else None
        self.expert_load: Optional[HostCopy] = None  # a mixture of experts' routing in this step (the engine's)

    def result(self) -> StepOutput:
        """Its StepOutput, with the tokens on the host: waits for this step's copy only."""
        tokens = self.tokens  # (read once: the benchmark's threaded step makes it on demand)
        return step_output(self.step, self.draws, self.logits, tokens.wait().tolist() if tokens is not None else [])


def run_step(runner: ModelRunner, step: PreparedStep, draws: Draws, previous: Optional[InFlightStep]
             ) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """A prepared step's forward pass and draws, queued: (logits, the drawn token ids on the device or None)."""
    logits, _ = runner.forward(step, previous.drawn if step.pending_rows is not None else None)
    return logits, sample(logits[draws.rows], draws.settings) if draws.indices else None


def launch(runner: ModelRunner, batch: list[tuple[Sequence, int]], previous: Optional[InFlightStep]) -> InFlightStep:
    """Prepare the batch and queue its forward pass and draws, reading nothing back. previous: the step in flight,
    whose draws are this step's inputs where sequences wait on them."""
    step = runner.prepare(batch)
    draws = runner.draws(step)
    return InFlightStep(step, draws, *run_step(runner, step, draws, previous))
