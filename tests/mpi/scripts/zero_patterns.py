"""Under mpirun -n 2: the ZeRO user-pattern matrix. Each PATTERN is a way users write their model or their step;
each cell (pattern, stage 1-3, overlap on/off) trains a few steps through the library API and ends within 1e-5
of stage 0 (the same pattern, the same data) with every rank holding the same model, or is refused on every rank
with one line.

    python zero_patterns.py PATTERN[,PATTERN...] [STAGES (default 1,2,3)] [OVERLAPS (default 0,1)]

Rank 0 prints one line per cell: `CELL pattern stage overlap OK|DIFFERS diff ranks apart spread`, or
`CELL pattern stage overlap REFUSED message`
(any other outcome raises, and the launch fails).
"""

import sys

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

import hpctrain
from hpctrain.base.errors import HpctrainError

ctx = hpctrain.init()
STEPS = 4


class Block(torch.nn.Module):
    def __init__(self, norm: bool):
        super().__init__()
        self.lin = torch.nn.Linear(16, 16)
        self.norm = torch.nn.BatchNorm1d(16) if norm else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.lin(x)
        if self.norm is not None:
            x = self.norm(x)
        return torch.tanh(x)


class Net(torch.nn.Module):
    """A stem and a head in the root unit, three blocks as units; `pattern` picks what the forward does."""

    def __init__(self, pattern: str):
        super().__init__()
        self.pattern = pattern
        self.stem = torch.nn.Linear(6, 16)
        self.blocks = torch.nn.ModuleList(Block(pattern == "buffers") for _ in range(3))
        self.head = torch.nn.Linear(16, 4)
        if pattern == "tied-registered":  # one weight registered in a unit and outside it
            self.extra = torch.nn.Linear(16, 16, bias=False)
            self.extra.weight = self.blocks[0].lin.weight
        if pattern == "buffers":  # besides BatchNorm's: a buffer the forward updates from each rank's batch
            self.register_buffer("seen", torch.zeros(16))
        if pattern == "frozen":
            self.blocks[1].requires_grad_(False)
            self.stem.bias.requires_grad_(False)
            self.blocks[2].lin.bias.requires_grad_(False)
        self.step = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        if self.pattern == "buffers":
            with torch.no_grad():
                self.seen.mul_(0.9).add_(x.mean(0))
        for i, block in enumerate(self.blocks):
            if self.pattern == "unused" and i == 1 and self.step % 2:
                continue  # a unit the odd steps skip, on every rank alike
            if self.pattern.startswith("checkpoint"):  # checkpoint-accumulate: not reentrant, 2 micro-batches
                x = checkpoint(block, x, use_reentrant=self.pattern == "checkpoint-reentrant")
            else:
                x = block(x)
        if self.pattern == "tied-registered":
            x = x + self.extra(x)
        if self.pattern == "tied-outside":  # GPT-2's idiom: a unit's weight read by the root's forward
            x = x + F.linear(x, self.blocks[0].lin.weight)
        return self.head(x)


def batch(step: int, micro: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * ctx.rank + 10 * step + micro)
    return torch.randn(8, 6, generator=g), torch.randint(0, 4, (8,), generator=g)


def train(pattern: str, stage: int, overlap: bool) -> tuple[dict, list[float]]:
    """The model's whole state after STEPS steps, and the norms any clipping returned."""
    torch.manual_seed(0)
    model = Net(pattern)
    hpctrain.broadcast_parameters(model)
    opt = hpctrain.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=0.01), model, zero=stage,
                                        overlap=overlap, bucket_mb=0.0005)
    norms = []
    try:
        for step in range(STEPS):
            model.step = step
            opt.zero_grad()
            micros = 2 if pattern.endswith("accumulate") else 1
            for micro in range(micros):
                x, y = batch(step, micro)
                loss = F.cross_entropy(model(x), y) / micros
                if micro < micros - 1:
                    with opt.no_sync():
                        loss.backward()
                else:
                    loss.backward()
            if pattern == "clip-synchronize":
                opt.synchronize()
                norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)))
            elif pattern == "clip-optimizer":
                norms.append(opt.clip_grad_norm_(0.05))
            elif pattern == "clip-both":  # the guide's "synchronize() before clipping", then the optimizer's clip
                opt.synchronize()
                norms.append(opt.clip_grad_norm_(0.05))
            opt.step()
        return opt.model_state_dict(rank=None), norms
    finally:
        opt.close()


def run(pattern: str, stages: list[int], overlaps: list[bool]) -> None:
    reference, ref_norms = train(pattern, 0, False)
    for stage in stages:
        for overlap in overlaps:
            cell = f"CELL {pattern} {stage} {int(overlap)}"
            try:
                state, norms = train(pattern, stage, overlap)
            except HpctrainError as exc:
                message = str(exc)
                assert "\n" not in message, message
                if ctx.rank == 0:
                    print(cell, "REFUSED", message, flush=True)
                continue
            diff = max(float((reference[k].double() - state[k].double()).abs().max()) for k in reference)
            diff = max([diff] + [abs(a - b) for a, b in zip(ref_norms, norms)])
            assert len(norms) == len(ref_norms), (cell, norms)
            states = ctx.comm.allgather({k: v.cpu() for k, v in state.items()})
            spread = max(float((s[k].double() - states[0][k].double()).abs().max()) for s in states for k in s)
            diff = max(ctx.comm.allgather(diff))
            verdict = "OK" if diff <= 1e-5 and spread == 0 else "DIFFERS"
            if ctx.rank == 0:
                print(cell, verdict, f"{diff:.3g}", f"ranks apart {spread:.3g}", flush=True)


patterns = sys.argv[1].split(",")
stages = [int(s) for s in (sys.argv[2] if len(sys.argv) > 2 else "1,2,3").split(",")]
overlaps = [bool(int(s)) for s in (sys.argv[3] if len(sys.argv) > 3 else "0,1").split(",")]
for name in patterns:
    run(name, stages, overlaps)
if ctx.rank == 0:
    print("PATTERNS DONE", flush=True)
