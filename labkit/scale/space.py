"""The options a search may choose: the lab's whole space, or what one framework's code could run (issue 34 item 5).

A published run was chosen among the options its code had: Megatron-LM 2021 had no context parallelism, no ZeRO,
no sequence parallelism and no selective recompute; DeepSpeed's ZeRO-3 rows of the same paper ran without tensor or
pipeline parallelism. Ranking such a run against Ulysses or HSDP asks whether the model agrees with options its
authors did not have; ranking it in its framework's space asks whether the model agrees with the choice they made.
labkit.scale.ranking reports both (`rank_published(..., space=...)`); bench/scale.py --ranks prints both.

labkit/scale/frameworks.json holds each framework's options; a set of published_runs.json names its framework
("framework"; a row may name its own), every field optional, an option left out only where a source says the
code lacked it (each field's reason in its "sources"):

    cp_methods   the context-parallel methods it ran ([] or absent cp: cp = 1 only)
    zero         the ZeRO stages ("dp" is plain data parallelism)
    recompute    the recompute policies
    schedules    the pipeline schedules for pp > 1 ("1f1b", "interleaved", "zb"; the row's own is always in)
    tp, pp       whether it could use tensor / pipeline parallelism at all
    hsdp         whether it could replicate sharded groups (dp_replicate > 1)
    ddp_alone    true where plain data parallelism ("dp") runs only as the one parallel axis (torchtitan: "DDP has
                 not supported > 1D parallelism"); with tp, pp or cp its data-parallel ranks shard (FSDP)
    grad_accumulation  false where a step without a pipeline is one forward and backward of the whole local batch
                 (torchtitan until June 2025): for pp = 1 the micro-batch is then global batch / dp
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from labkit.scale.layout import SCHEDULES, ZERO_STAGES, Layout
from labkit.scale.specs import RECOMPUTE
from labkit.scale.cp_traffic import CP_METHODS


@dataclass(frozen=True)
class Space:
    cp_methods: tuple = CP_METHODS
    zero: tuple = ZERO_STAGES
    recompute: tuple = RECOMPUTE
    schedules: tuple = SCHEDULES
    tp: bool = True
    pp: bool = True
    hsdp: bool = True
    ddp_alone: bool = False
    grad_accumulation: bool = True
    carries: bool = False  # a framework's space runs every layout as the row's code did (`traits`); the lab's, its own

    def traits(self, published) -> dict:
        """How the space's layouts run what is not a choice but the code's: sequence parallelism, when plain DP /
        ZeRO-1/2 reduce gradients, what ZeRO-3 gathers at once, how the ring's K/V move. A framework's space takes the published layout's
        (Megatron-LM 2021: no SP, its local DDP's reduction after the backward); the lab's, the lab's own (SP on,
        buckets overlapped, FSDP2's blocks), whatever the row ran."""
        source = published if self.carries and published is not None else Layout()
        return {trait: getattr(source, trait) for trait in ("sequence_parallel", "grad_reduce", "zero3_unit", "kv_rotation")}

    def allows_axes(self, pp: int, cp: int, tp: int) -> bool:
        return (cp == 1 or bool(self.cp_methods)) and (tp == 1 or self.tp) and (pp == 1 or self.pp)

    def allows_micro_batch(self, micro_batch: int, batch: int, dp: int, pp: int) -> bool:
        """Whether a layout may split a data-parallel rank's share of the global batch (batch / dp) into micro-batches
        of `micro_batch`: always with a pipeline, which splits it into its micro-batches; without one only where
        the code accumulates gradients over several passes, else one pass of the whole share."""
        return self.grad_accumulation or pp > 1 or micro_batch == batch // dp

    def zero_stages(self, pp: int, cp: int, tp: int) -> tuple:
        """The ZeRO stages a layout with these axes may take: `zero`, less plain data parallelism where
        `ddp_alone` and another axis is on."""
        if self.ddp_alone and max(pp, cp, tp) > 1:
            return tuple(z for z in self.zero if z != "dp")
        return self.zero


LAB = Space()  # every option the lab's model prices
FRAMEWORKS_FILE = Path(__file__).with_name("frameworks.json")
_CHOICES = {"cp_methods": CP_METHODS, "zero": ZERO_STAGES, "recompute": RECOMPUTE, "schedules": SCHEDULES}
_SWITCHES = ("tp", "pp", "hsdp", "ddp_alone", "grad_accumulation")


@lru_cache(maxsize=4)  # space_of reads it once per published row: parse it once (Spaces are frozen)
def load_frameworks(path: Path | str = FRAMEWORKS_FILE) -> dict:
    """{name: Space} from the data file; a ValueError names the framework, the field and what it may hold."""
    return {name: space_from(given, name) for name, given in json.loads(Path(path).read_text())["frameworks"].items()}


def space_from(given: dict, name: str = "framework") -> Space:
    """A Space from a framework's entry: its options, each field's reason in "sources"."""
    if not isinstance(given, dict):
        raise ValueError(f"{name}: must be an object of the options its code had, got {given!r}")
    out, sources = {}, given.get("sources", {})
    for key, value in given.items():
        if key == "sources":
            continue
        if key in _CHOICES:
            if not isinstance(value, list) or any(v not in _CHOICES[key] for v in value):
                raise ValueError(f"{name}.{key}={value!r}: a list of some of {list(_CHOICES[key])}")
            out[key] = tuple(v for v in _CHOICES[key] if v in value)  # the lab's order, so the search's is fixed
        elif key in _SWITCHES:
            if not isinstance(value, bool):
                raise ValueError(f"{name}.{key}={value!r}: true or false (whether its code could use it; ddp_alone: "
                                 "whether its plain data parallelism ran only as the one axis)")
            out[key] = value
        else:
            raise ValueError(f"{name}.{key}: not an option of a search's space; use {sorted([*_CHOICES, *_SWITCHES])}")
        if key not in sources:
            raise ValueError(f"{name}.{key}: give its reason in {name}.sources.{key} (the source that says the code lacked the rest)")
    for key in ("zero", "recompute"):
        if key in out and not out[key]:
            raise ValueError(f"{name}.{key}=[]: name at least one ('dp' is plain data parallelism, 'none' no recompute)")
    return Space(**out, carries=True)


def space_of(row: dict, set_info: dict, frameworks: dict | None = None) -> tuple[str, Space]:
    """(name, Space) of the framework a published row ran: the row's "framework", else its set's; ("lab", LAB) where
    neither names one. A name the frameworks file lacks is a ValueError that lists the names it has."""
    name = row.get("framework", set_info.get("framework"))
    if name is None:
        return "lab", LAB
    frameworks = load_frameworks() if frameworks is None else frameworks
    if name not in frameworks:
        raise ValueError(f"row {row.get('id')}: framework {name!r} is not in {FRAMEWORKS_FILE.name}: one of {sorted(frameworks)}")
    return name, frameworks[name]
