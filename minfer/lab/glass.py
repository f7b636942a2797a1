"""The glass engine: step a real engine in a notebook and watch its memory and its scheduler.

    from minfer.lab.glass import GlassEngine
    GlassEngine(llm)          # in a notebook cell: buttons, the KV pool, the queues, the last step, the prefix tree

Nothing here is simulated. Every view is drawn from `engine.snapshot(detail=True)`, the engine's own
state frozen between steps (its blocks and reference counts, its queues, the last step's batch: see
`minfer.engine.snapshot`); `GlassEngine` draws them as HTML and drives `llm` with the same calls a server makes:
`add_request`, `step`, `abort_request`. Changing a knob (token budget, sequences per step, pool
size, block size) gives `llm` a fresh engine with those settings over the same model.
"""
from __future__ import annotations

import dataclasses
import html
from typing import Optional

from minfer.engine.engine import Engine
from minfer.engine.snapshot import EngineSnapshot
from minfer.llm import LLM
from minfer.sampling_params import SamplingParams

SHARED_PREFIX = ("You are a patient teacher. Answer in two short sentences, with one example, and end with a "
                 "question that checks the student understood. ")


# ---------------------------------------------------------------- drawing (HTML)
def colour(name: str) -> str:
    """A stable colour per sequence: its request's hue, lighter for later completions."""
    request, _, index = name.partition("/")
    hue = (int(request) * 67) % 360 if request.isdigit() else 0
    return f"hsl({hue}, 65%, {55 + 8 * (int(index) % 4) if index.isdigit() else 55}%)"


def holders(p: EngineSnapshot) -> dict[int, list[str]]:
    """Block id -> labels of the sequences whose block table holds it."""
    held: dict[int, list[str]] = {}
    for seq in p.sequences:
        for block_id in seq.block_table:
            held.setdefault(block_id, []).append(seq.label)
    return held


def pool_html(p: EngineSnapshot) -> str:
    cells, held = [], holders(p)
    for b in p.blocks:
        if b.state == "used":
            style = f"background:{colour(held[b.block_id][0]) if b.block_id in held else '#999'}"
            style += ";outline:3px solid #222" if b.ref_count > 1 else ""
        else:
            style = "background:#ddd;border:1px dashed #888" if b.state == "cached" else "background:#fff;border:1px solid #ccc"
        tip = f"block {b.block_id}: {b.state}" + (f", held by {', '.join(held[b.block_id])}" if b.block_id in held else "")
        text = str(b.ref_count) if b.ref_count > 1 else ""
        cells.append(f'<div title="{html.escape(tip)}" style="width:18px;height:18px;{style};font-size:10px;'
                     f'text-align:center;line-height:18px">{text}</div>')
    counts = {s: sum(b.state == s for b in p.blocks) for s in ("used", "cached", "free")}
    legend = (f"<b>KV pool</b>: {counts['used']} used, {counts['cached']} cached (free, a prefix hit revives them), "
              f"{counts['free']} free; a number is a block's reference count (shared prefix)")
    return f'<div>{legend}</div><div style="display:flex;flex-wrap:wrap;gap:2px;max-width:760px">{"".join(cells)}</div>'


def queues_html(p: EngineSnapshot) -> str:
    columns = []
    for state in ("waiting", "running", "preempted"):
        cards = [f'<div style="border-left:6px solid {colour(s.label)};padding:1px 4px;margin:2px 0">{s.label}: '
                 f'{s.num_computed}/{s.num_tokens} tokens in the pool, {len(s.block_table)} blocks'
                 + (f", {s.num_cached_prompt_tokens} from the prefix cache" if s.num_cached_prompt_tokens else "")
                 + "</div>" for s in p.sequences if s.state == state]
        columns.append(f'<div style="flex:1"><b>{state}</b> ({len(cards)}){"".join(cards) or "<div>-</div>"}</div>')
    return f'<div style="display:flex;gap:12px;max-width:760px">{"".join(columns)}</div>'


def step_html(p: EngineSnapshot) -> str:
    used = sum(count for _, count, _ in p.last_step)
    parts = [f'<div title="{name}: {count} {kind}" style="width:{max(2, 700 * count // max(p.token_budget, 1))}px;'
             f'height:16px;background:{colour(name)};{"" if kind == "prefill" else "border:1px solid #222;"}"></div>'
             for name, count, kind in p.last_step]
    prefills = sum(count for _, count, kind in p.last_step if kind == "prefill")
    return (f"<b>Step {p.steps}</b>: {used} of a budget of {p.token_budget} tokens: {prefills} in prefill chunks, "
            f"{used - prefills} decodes (outlined), {p.last_padding} padding rows"
            f'<div style="display:flex;gap:1px;width:700px;background:#f4f4f4">{"".join(parts)}</div>')


def prefix_html(p: EngineSnapshot, hits: set[int]) -> str:
    children: dict[Optional[int], list[tuple[int, int]]] = {}
    findable = [b for b in p.blocks if b.prefix_hash is not None]
    for b in findable:
        children.setdefault(b.parent_hash, []).append((b.prefix_hash, b.block_id))
    known = {b.prefix_hash for b in findable}
    roots = [r for r in children if r is None or r not in known]

    def node(h: int, block_id: int) -> str:
        return f'<span style="{"background:#ffd54f" if block_id in hits else ""}">{block_id}</span>'

    def branch(parent: Optional[int]) -> str:
        items = []
        for h, block_id in children.get(parent, []):
            chain = [node(h, block_id)]
            while len(children.get(h, [])) == 1:  # a run without a fork: one line, "3 → 4 → 5"
                h, block_id = children[h][0]
                chain.append(node(h, block_id))
            items.append(f"<li>block {' → '.join(chain)}{branch(h)}</li>")
        return f"<ul style='margin:0'>{''.join(items)}</ul>" if items else ""

    tree = "".join(branch(r) for r in roots) or "<div>(no full block yet)</div>"
    return ("<b>Prefix cache</b> (full blocks, each after the block before it in its sequence; where two "
            f"sequences part, the tree forks; the last admission's hits marked){tree}")


# ---------------------------------------------------------------- the widget
class GlassEngine:
    """Buttons and live views over `llm`'s engine (see the module docstring)."""

    def __init__(self, llm: LLM, max_tokens: int = 24) -> None:
        import ipywidgets as w

        self.llm, self.hits = llm, set()
        self.finished: dict[str, object] = {}  # request id -> its final RequestOutput, for the timeline
        self.prompt = w.Text(value="Explain what a KV cache is.", description="prompt", layout=w.Layout(width="420px"))
        self.max_tokens = w.IntSlider(value=max_tokens, min=1, max=128, description="max_tokens")
        self.share = w.Checkbox(value=True, description="with the shared prefix")
        self.abort_choice = w.Dropdown(options=[], description="request")
        c, wide = llm.engine.config, {"style": {"description_width": "initial"}}
        self.knobs = {
            "max_num_batched_tokens": w.IntSlider(value=c.max_num_batched_tokens, min=16, max=1024, step=16,
                                                  description="token budget", **wide),
            "max_num_seqs": w.IntSlider(value=c.max_num_seqs, min=1, max=64, description="sequences per step", **wide),
            "num_gpu_blocks_override": w.IntSlider(value=min(llm.engine.blocks.num_blocks, 256), min=8, max=512,
                                                   description="pool blocks", **wide),
            "block_size": w.Dropdown(options=[4, 8, 16, 32], value=c.block_size, description="block size", **wide)}
        buttons = [(w.Button(description="step"), lambda _: self.step()), (w.Button(description="run 5 steps"),
                   lambda _: self.step(5)), (w.Button(description="add request"), lambda _: self.add()),
                   (w.Button(description="abort"), lambda _: self.abort()),
                   (w.Button(description="new engine with these knobs"), lambda _: self.rebuild())]
        for button, action in buttons:
            button.on_click(action)
        self.views = {name: w.HTML() for name in ("step", "pool", "queues", "prefix", "timeline")}
        self.box = w.VBox([w.HBox([b for b, _ in buttons[:2]]), w.HBox([self.prompt, self.max_tokens, self.share,
                                                                        buttons[2][0]]),
                           w.HBox([self.abort_choice, buttons[3][0]]), *self.views.values(),
                           w.HBox(list(self.knobs.values())[:2]), w.HBox([*list(self.knobs.values())[2:], buttons[4][0]])])
        self.render()

    def _ipython_display_(self) -> None:
        from IPython.display import display

        display(self.box)

    # ---------------------------------------------------------------- actions
    def add(self, prompt: Optional[str] = None, max_tokens: Optional[int] = None, shared_prefix: Optional[bool] = None) -> str:
        text = self.prompt.value if prompt is None else prompt
        if self.share.value if shared_prefix is None else shared_prefix:
            text = SHARED_PREFIX + text
        params = SamplingParams(temperature=0, max_tokens=max_tokens or self.max_tokens.value)
        request_id = self.llm.add_request(text, params)
        self.render()
        return request_id

    def step(self, n: int = 1) -> None:
        now = self.llm.engine.snapshot(detail=True)
        for _ in range(n):
            if not now.has_unfinished:
                break
            waiting = {s.label for s in now.sequences if s.state == "waiting"}
            for output in self.llm.step():
                if output.finished:
                    self.finished[output.request_id] = output
            now = self.llm.engine.snapshot(detail=True)  # after this step, and before the next
            admitted = [s for s in now.sequences if s.label in waiting and s.state == "running"]
            if admitted:  # the blocks the newest admission found in the prefix cache
                s = admitted[-1]
                self.hits = set(s.block_table[:s.num_cached_prompt_tokens // now.block_size])
        self.render(now)

    def abort(self, request_id: Optional[str] = None) -> None:
        target = request_id or self.abort_choice.value
        if target:
            self.llm.abort_request(target)
        self.render()

    def rebuild(self) -> None:
        """A fresh engine over the same model, with the knobs' settings (requests in flight are dropped)."""
        old = self.llm.engine
        settings = {name: knob.value for name, knob in self.knobs.items()}
        config = dataclasses.replace(old.config, **settings)
        self.llm.engine = Engine(old.model, old.tokenizer, config, eos_token_ids=old.eos_token_ids)
        self.hits, self.finished = set(), {}
        self.render()

    # ---------------------------------------------------------------- drawing
    def render(self, p: Optional[EngineSnapshot] = None) -> None:
        """Redraw every view from `p`, the engine's state now (taken here if not given)."""
        p = p or self.llm.engine.snapshot(detail=True)
        self.views["step"].value = step_html(p)
        self.views["pool"].value = pool_html(p)
        self.views["queues"].value = queues_html(p)
        self.views["prefix"].value = prefix_html(p, self.hits)
        self.views["timeline"].value = self._timeline_html(p)
        self.abort_choice.options = sorted(p.request_ids)

    def _timeline_html(self, p: EngineSnapshot) -> str:
        """Every request seen: the live ones from the engine, the finished ones from their last output."""
        live = {s.request_id: s for s in p.sequences if s.index == 0}
        rows = []
        for request_id in sorted(set(live) | set(self.finished), key=int):
            done = self.finished.get(request_id)
            metrics = done.metrics if done is not None else live[request_id].metrics
            tokens = len(done.outputs[0].token_ids) if done is not None else live[request_id].num_output_tokens
            ttft = f"{1000 * metrics.ttft:.0f} ms" if metrics.ttft is not None else "-"
            tpot = f"{1000 * metrics.tpot:.0f} ms" if metrics.tpot else "-"
            state = done.outputs[0].finish_reason if done is not None else "in the engine"
            rows.append(f"<tr><td>{request_id}</td><td>{state}</td><td>{tokens}</td><td>{ttft}</td><td>{tpot}</td></tr>")
        return ("<b>Requests</b> (TTFT: arrival to first token; TPOT: time per output token after it)<table><tr>"
                "<th>request</th><th>state</th><th>tokens out</th><th>TTFT</th><th>TPOT</th></tr>"
                f"{''.join(rows[-12:])}</table>")
