"""Chapter 10: mixture of experts — top-k routing, dispatch and combine, the experts a batch
touches, and the load-balancing loss.

Fill in each function (replace `raise NotImplementedError`), then run `check("ch10")` in the
notebook.
"""
from __future__ import annotations

import torch


def route_top_k(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Pick each token's top_k experts from the router's logits [T, E], and their weights.

    Softmax over the E experts (in float32), keep the top_k largest probabilities per token
    (largest first, as `torch.topk` orders them) and their expert ids. With renormalize=True the
    kept weights are divided by their sum, so each token's weights sum to 1 (Mixtral, Qwen3-MoE);
    with False they stay the plain softmax probabilities (Qwen2-MoE, Switch with top-1).
    Returns (weights [T, top_k] float32, expert_ids [T, top_k] int64).

    Raises ValueError when router_logits is not 2-D or top_k is not in [1, E].
    """
    raise NotImplementedError("write me")


def dispatch(expert_ids: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Group the token-expert pairs by expert, so that each expert can run on its tokens at once.

    expert_ids [T, k]: pair p = t * k + j is token t's j-th choice (expert_ids.reshape(-1)[p]).
    Returns (order, counts): order [T * k] int64, the pair indices sorted by expert id, pairs of
    the same expert kept in increasing order (a stable sort); counts [E] int64, how many pairs
    each expert got (zeros included; sums to T * k). Expert e's pairs are then
    order[sum(counts[:e]) : sum(counts[:e + 1])], and the token of pair p is p // k.
    """
    raise NotImplementedError("write me")


def combine(expert_outputs: torch.Tensor, order: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Undo the dispatch: add each pair's expert output, times its weight, into its token's row.

    expert_outputs [T * k, D]: row i is the output of pair order[i] (the order `dispatch` returned);
    weights [T, k]: the routing weights. Pair p belongs to token p // k, slot p % k, so
    out[p // k] += weights[p // k, p % k] * expert_outputs[i]. Returns out [T, D] in float32
    (a token whose pairs all carry weight 0 gets a zero row).
    """
    raise NotImplementedError("write me")


def moe_layer(x: torch.Tensor, weights: torch.Tensor, expert_ids: torch.Tensor, gate_up: torch.Tensor,
              down: torch.Tensor) -> torch.Tensor:
    """The MoE MLP by dispatch, one matmul pair per expert, combine.

    x [T, D]; weights, expert_ids [T, k] (from `route_top_k`); gate_up [E, 2F, D] (gate rows first,
    then up rows) and down [E, D, F]: expert e computes down[e] @ (silu(g) * u) with
    (g, u) = gate_up[e] @ h split in two halves. Use `dispatch` to group the pairs by expert, run
    each expert that got pairs once on all its tokens, and `combine` the outputs.
    Returns [T, D] in float32.
    """
    raise NotImplementedError("write me")


def expected_distinct_experts(num_experts: int, top_k: int, batch_size: int) -> float:
    """How many different experts a batch of tokens touches, on average.

    num_experts: the experts E of the layer; top_k: how many each token picks (k distinct experts,
    chosen uniformly at random); batch_size: the tokens B in the batch, which choose independently
    of each other.
    Returns the expected number of experts that at least one token of the batch picked (a count,
    as a float between 0 and E; 0.0 for batch_size 0), computed exactly, without sampling.
    Raises ValueError unless 1 <= top_k <= num_experts and batch_size >= 0.
    """
    raise NotImplementedError("write me")


def load_balancing_loss(router_probs: torch.Tensor, expert_ids: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Switch Transformers' auxiliary loss, E * sum_e f_e * P_e, as a scalar tensor.

    router_probs [T, E]: the router's softmax probabilities; expert_ids [T, k]: the experts chosen.
    f_e: the share of the T * k token-expert assignments that went to expert e (computed from counts: no
    gradient flows through it); P_e: the mean of router_probs[:, e] over the tokens (the gradient
    flows through it, into the router). The loss is 1.0 when both are uniform, and E when every
    token goes to one expert with probability 1: minimising it spreads the load.
    """
    raise NotImplementedError("write me")
