"""Experts carved out of a dense model's MLPs (MoEfication, Zhang et al., 2022), chapter 10.

    carve_model(model, calibration_token_ids(tokenizer), num_experts=16, top_k=4)
    LLM("smollm2-135m", carve_experts=16, carve_top_k=4)       # the same, at load time

A SwiGLU MLP is a sum over its intermediate neurons: down(silu(gate x) * up x) = sum_n down[:, n] h_n.
Split the neurons into E groups of equal size and it is exactly the sum of E smaller SwiGLU MLPs,
the experts; running all E reproduces the dense layer (weight 1 on each, no softmax: a dense model
sums its parts). Running only k of them is an approximation, good to the extent that the other
E - k would have added little for this token.

Which neurons go together: those that fire on the same tokens. Each neuron is described by its
|activation| over the calibration tokens (unit length), and balanced k-means (every cluster gets
exactly N / E neurons, so the experts stack into one [E, 2F, D] tensor) groups neurons whose
activation patterns point the same way. Then a token that needs one neuron of a group tends to
need the others, and skipping a group skips neurons that were mostly quiet together.

Which experts a token needs: a linear router, fitted by least squares on the calibration tokens,
predicts from the MLP's input the size (L2 norm) of each expert's output; the k largest
predictions run. Nothing is trained by gradient descent, and the model never learned to be
sparse: quality falls as k / E falls (docs/benchmarks.md measures how fast). Trained MoEs
learn routing and experts together (`minfer.lab.tiny_moe`).

Calibration text: `minfer.texts.calibration_token_ids`, pydoc topics outside the evaluation set.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from minfer.config import check_carve_args
from minfer.layers.moe import moe_mlp, route_topk
from minfer.quant.awq import calibration_batch, run_layer

KMEANS_ITERATIONS = 15
RIDGE = 1e-3  # the router's least-squares regulariser, relative to the inputs' mean square


class CarvedMoE(nn.Module):
    """E experts carved from one dense SwiGLU MLP, a linear router, top-k with weight 1 each.

    last_expert_ids holds the [tokens, k] experts of the latest call (to measure what a step reads)."""

    def __init__(self, router: torch.Tensor, router_bias: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor,
                 top_k: int) -> None:
        super().__init__()
        self.router = nn.Parameter(router, requires_grad=False)          # [E, D]
        self.router_bias = nn.Parameter(router_bias, requires_grad=False)  # [E]
        self.gate_up = nn.Parameter(gate_up, requires_grad=False)        # [E, 2F, D]
        self.down = nn.Parameter(down, requires_grad=False)              # [E, D, F]
        self.num_experts = gate_up.shape[0]
        self.top_k = top_k
        self.last_expert_ids: Optional[torch.Tensor] = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        scores = F.linear(flat, self.router, self.router_bias)
        _, expert_ids = route_topk(scores, self.top_k, normalize=False)  # softmax keeps the order: top-k of the scores
        self.last_expert_ids = expert_ids
        weights = torch.ones(expert_ids.shape, dtype=torch.float32, device=x.device)
        return moe_mlp(flat, weights, expert_ids, self.gate_up, self.down).view(x.shape)


def balanced_assign(similarity: torch.Tensor, size: int) -> torch.Tensor:
    """Each row (neuron) to one column (cluster), every cluster taking exactly `size` rows, greedily
    by descending similarity. similarity [N, E] with N = E * size; returns [N] cluster ids."""
    num_rows, num_clusters = similarity.shape
    order = torch.argsort(similarity.flatten(), descending=True).tolist()
    assignment, room, left = [-1] * num_rows, [size] * num_clusters, num_rows
    for flat in order:
        row, cluster = divmod(flat, num_clusters)
        if assignment[row] < 0 and room[cluster]:
            assignment[row], room[cluster], left = cluster, room[cluster] - 1, left - 1
            if not left:
                break
    return torch.tensor(assignment, device=similarity.device)


def cluster_neurons(activations: torch.Tensor, num_experts: int, iterations: int = KMEANS_ITERATIONS,
                    seed: int = 0) -> torch.Tensor:
    """Balanced k-means (cosine) of the neurons' |activation| patterns: activations [T, N] ->
    [E, N / E] neuron indices per expert, each row sorted."""
    features = F.normalize(activations.abs().T.float(), dim=1)  # [N, T]: one unit vector per neuron
    size = features.shape[0] // num_experts
    gen = torch.Generator().manual_seed(seed)
    centroids = features[torch.randperm(features.shape[0], generator=gen)[:num_experts]]
    for _ in range(iterations):
        assignment = balanced_assign(features @ centroids.T, size)
        members = F.one_hot(assignment, num_experts).T.float()  # [E, N]
        centroids = F.normalize(members @ features, dim=1)  # each cluster's mean direction
    return torch.stack([torch.where(assignment == e)[0] for e in range(num_experts)])


def fit_router(x: torch.Tensor, targets: torch.Tensor, ridge: float = RIDGE) -> tuple[torch.Tensor, torch.Tensor]:
    """Least squares with a bias: x [T, D] -> targets [T, E]. Returns (weight [E, D], bias [E])."""
    design = torch.cat([x.double(), torch.ones(len(x), 1, dtype=torch.float64, device=x.device)], dim=1)
    gram = design.T @ design
    gram += ridge * gram.diagonal().mean() * torch.eye(len(gram), dtype=torch.float64, device=gram.device)
    solution = torch.linalg.solve(gram, design.T @ targets.double())  # [D + 1, E]
    return solution[:-1].T.float().contiguous(), solution[-1].float().contiguous()


def carve_mlp(mlp: nn.Module, x: torch.Tensor, num_experts: int, top_k: int) -> CarvedMoE:
    """A dense `minfer.models.llama.MLP` as a CarvedMoE, clustered and routed on its inputs x [T, D]."""
    f = mlp.intermediate_size
    gate_w, up_w = mlp.gate_up_proj.weight.float().split(f)
    down_w = mlp.down_proj.weight.float()
    h = F.silu(x @ gate_w.T) * (x @ up_w.T)  # [T, N]: every neuron's activation
    groups = cluster_neurons(h, num_experts)
    # the size of each expert's contribution to the output, per token: what the router predicts
    targets = torch.stack([(h[:, g] @ down_w[:, g].T).norm(dim=-1) for g in groups], dim=1)
    router, bias = fit_router(x, targets)
    dtype = mlp.gate_up_proj.weight.dtype
    gate_up = torch.stack([torch.cat([gate_w[g], up_w[g]]) for g in groups]).to(dtype)
    down = torch.stack([down_w[:, g] for g in groups]).to(dtype)
    return CarvedMoE(router.to(dtype), bias.to(dtype), gate_up, down, top_k)


@torch.no_grad()
def carve_model(model: nn.Module, calibration_token_ids: Sequence[int], num_experts: int, top_k: int,
                window: Optional[int] = None) -> None:
    """Replace every decoder layer's MLP by a CarvedMoE, in place, fitted on the calibration tokens
    (read by the dense model, in windows of `window`; see `minfer.quant.awq.calibration_batch`)."""
    check_carve_args(num_experts, top_k, model.config.intermediate_size)
    if not all(hasattr(layer.mlp, "gate_up_proj") for layer in model.layers):
        raise ValueError("carve_experts needs a dense model: every layer's MLP one SwiGLU (an MoE model has experts already)")
    inputs: dict[int, torch.Tensor] = {}
    hooks = [layer.mlp.register_forward_pre_hook(lambda module, args, i=i: inputs.__setitem__(i, args[0]))
             for i, layer in enumerate(model.layers)]
    try:
        x, rope = calibration_batch(model, calibration_token_ids, window)
        for i in range(len(model.layers)):  # the dense model, every layer reading the one before
            x = run_layer(model, i, x, rope)
    finally:
        for hook in hooks:
            hook.remove()
    for i, layer in enumerate(model.layers):
        layer.mlp = carve_mlp(layer.mlp, inputs.pop(i).flatten(0, -2).float(), num_experts, top_k)


def set_top_k(model: nn.Module, top_k: int) -> None:
    """Run a carved model with another k (the carving does not depend on it)."""
    carved = [layer.mlp for layer in model.layers if isinstance(layer.mlp, CarvedMoE)]
    if not carved:
        raise ValueError("this model has no carved experts: build it with carve_model or LLM(..., carve_experts=E)")
    check_carve_args(carved[0].num_experts, top_k)
    for mlp in carved:
        mlp.top_k = top_k
