"""Measuring a router (chapter 08, benchmarks/bench_router.py): the cheap candidates, and one cheap model
studied against the full model on a graded task set.

* `build_cheap_model(name, target, tokenizer)`: the candidates of `CHEAP_MODELS`, made from the target.
* `RouterStudy`: one candidate's graded answers beside the full model's, with c measured: accuracy,
  how well each confidence signal separates (AUC), the threshold sweep as cost against accuracy, the
  operating point (the cheapest threshold at the full model's accuracy) and its measured seconds.
* `study_router` measures c and picks the signal; `cheapest_study` picks the candidate.
The routing itself (signals, thresholds, costs) is `minfer.lab.router`.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from minfer.lab.bench.spec import cost_ratio
from minfer.models.llama import LlamaModel
from minfer.quant.linear import quantize_model
from minfer.lab.router import (SIGNALS, RoutingResult, cheapest_threshold, evaluate_routing, route, separation_auc,
                           threshold_sweep)
from minfer.speculative.pruned_draft import init_draft_from_target, load_draft
from minfer.texts import calibration_token_ids


CHEAP_MODELS = ("int4-awq", "int8", "first-24-layers", "distilled-draft")


def build_cheap_model(name: str, target: LlamaModel, tokenizer) -> LlamaModel:
    """A cheap stand-in for `target` (left untouched), by name:
    int4-awq         the target's weights in int4 with activation-aware scales (chapter 06)
    int8             the target's weights in int8, one scale per output channel
    first-24-layers  the target cut after 24 of its 30 layers (its final norm and head kept)
    distilled-draft  the two-layer draft distilled from the target (`minfer/drafts`, chapter 08)"""
    weight = target.embed_tokens.weight
    if name == "int4-awq":
        return quantize_model(copy.deepcopy(target), "awq", calibration_token_ids=calibration_token_ids(tokenizer))
    if name == "int8":
        return quantize_model(copy.deepcopy(target), "int8")
    if name == "first-24-layers":
        return init_draft_from_target(target, list(range(24)), target.config.intermediate_size,
                                      torch.arange(target.config.vocab_size, device=weight.device))
    if name == "distilled-draft":
        return load_draft("smollm2-135m-draft", target, weight.dtype, weight.device)
    raise ValueError(f"cheap model must be one of {CHEAP_MODELS}, got {name!r}")


@dataclass
class RouterStudy:
    """One cheap model against the full model on a graded task set (rows of `minfer.lab.router_tasks.answer_tasks`)."""
    name: str
    cost_ratio: float  # c: one cheap decode step / one full decode step
    cheap_rows: list[dict]
    full_rows: list[dict]
    signal: str = "min_prob"  # the signal the operating point uses: the cheapest one at the full model's accuracy

    @property
    def cheap_correct(self) -> list[bool]:
        return [r["correct"] for r in self.cheap_rows]

    @property
    def full_correct(self) -> list[bool]:
        return [r["correct"] for r in self.full_rows]

    @property
    def accuracy(self) -> float:
        return sum(self.cheap_correct) / len(self.cheap_rows)

    @property
    def full_accuracy(self) -> float:
        return sum(self.full_correct) / len(self.full_rows)

    def confidences(self, signal: Optional[str] = None) -> list[float]:
        return [r[signal or self.signal] for r in self.cheap_rows]

    @property
    def routable(self) -> bool:
        """Right on some tasks and wrong on others: only then has a confidence signal anything to separate."""
        return any(self.cheap_correct) and not all(self.cheap_correct)

    def auc(self, signal: str) -> Optional[float]:
        """separation_auc of the signal, None when the cheap model is always right or always wrong."""
        if not self.routable:
            return None
        return separation_auc(self.confidences(signal), self.cheap_correct)

    def operating_point_for(self, signal: str) -> RoutingResult:
        """The cheapest threshold whose accuracy is the full model's; everything full when none is."""
        threshold = cheapest_threshold(self.confidences(signal), self.cheap_correct, self.full_correct,
                                       self.full_accuracy)
        if threshold is None:  # no threshold that sends anything cheap keeps accuracy: escalate all
            return evaluate_routing([0.0] * len(self.cheap_rows), self.cheap_correct, self.full_correct, 1.0,
                                    self.cost_ratio)
        return evaluate_routing(self.confidences(signal), self.cheap_correct, self.full_correct, threshold,
                                self.cost_ratio)

    @property
    def operating_point(self) -> RoutingResult:
        return self.operating_point_for(self.signal)

    def sweep(self) -> list[RoutingResult]:
        return threshold_sweep(self.confidences(), self.cheap_correct, self.full_correct, self.cost_ratio)

    def sweep_table(self, rows: int = 12) -> list[RoutingResult]:
        """About `rows` points of the sweep, evenly spread over the share routed cheap, plus the operating point."""
        sweep = self.sweep()
        picked = {round(i * (len(sweep) - 1) / (rows - 1)) for i in range(rows)}
        table = [r for i, r in enumerate(sweep) if i in picked]
        op = self.operating_point
        if all(r.threshold != op.threshold for r in table):
            table = sorted(table + [op], key=lambda r: r.threshold)
        return table

    def routed_cheap(self, result: RoutingResult) -> list[bool]:
        """Which requests `result` serves cheap (none when it escalates everything)."""
        if result.share_cheap == 0:
            return [False] * len(self.cheap_rows)
        return [route(c, result.threshold) == "cheap" for c in self.confidences()]

    def timed_cost(self, result: RoutingResult) -> Optional[float]:
        """Measured: seconds of every cheap attempt plus the escalated full answers, over the seconds of the
        full model answering everything. None when the rows were answered in batches (no seconds per task)."""
        if any(r["seconds"] is None for r in self.cheap_rows + self.full_rows):
            return None
        cheap_s = sum(r["seconds"] for r in self.cheap_rows)
        full_s = sum(r["seconds"] for r, cheap in zip(self.full_rows, self.routed_cheap(result)) if not cheap)
        return (cheap_s + full_s) / sum(r["seconds"] for r in self.full_rows)

    def by_kind(self) -> dict[str, dict]:
        """Per task kind at the operating point: counts of tasks, right answers, requests routed cheap."""
        kinds: dict[str, dict] = {}
        for go_cheap, cheap, full in zip(self.routed_cheap(self.operating_point), self.cheap_rows, self.full_rows):
            k = kinds.setdefault(cheap["kind"], dict.fromkeys(
                ["n", "full_right", "cheap_right", "routed_cheap", "served_right"], 0))
            k["n"] += 1
            k["full_right"] += full["correct"]
            k["cheap_right"] += cheap["correct"]
            k["routed_cheap"] += go_cheap
            k["served_right"] += cheap["correct"] if go_cheap else full["correct"]
        return kinds

    def summary(self) -> dict:
        op = self.operating_point
        return {"accuracy": self.accuracy, "cost_ratio": self.cost_ratio,
                "auc": {s: self.auc(s) for s in SIGNALS}, "signal": self.signal,
                "operating_threshold": op.threshold, "operating_share_cheap": op.share_cheap,
                "operating_cost": op.cost_with_classifier, "timed_cost": self.timed_cost(op)}


def cheapest_study(studies: Sequence[RouterStudy]) -> RouterStudy:
    """The routable cheap model whose operating point costs least, counting the cheap attempt every request pays.

    A model that is never right (or always right) gives its signals nothing to separate, so it is picked only
    when no candidate is routable: its cost can still come out lowest when its timed c is small."""
    candidates = [s for s in studies if s.routable] or list(studies)
    return min(candidates, key=lambda s: s.operating_point.cost_with_classifier)


def study_router(name: str, cheap: LlamaModel, full: LlamaModel, cheap_rows: list[dict], full_rows: list[dict],
                 repeats: int = 20) -> RouterStudy:
    """Measure c, then pick the signal whose operating point costs least (ties: the best-separating one)."""
    study = RouterStudy(name, cost_ratio(cheap, full, repeats=repeats), cheap_rows, full_rows)
    study.signal = min(SIGNALS, key=lambda s: (study.operating_point_for(s).cost_with_classifier,
                                               -(study.auc(s) or 0.0)))
    return study
