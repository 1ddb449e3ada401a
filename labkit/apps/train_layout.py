"""The train app's layout: the strategy its flags ask for, every axis's size, and every refusal, worded in
the command line's own flags, before any rank starts (`python -m labkit.apps.train`).

    --dp N / --pp N alone          dp / pp (notebooks 04, 06); both: hybrid (notebook 07)
    any of --tp --cp --ep --zero   composed (notebook 14's layouts, labkit.compose); --cp-method ring|allgather|
                                   ulysses|hybrid: how attention crosses the --cp ranks (default ring); also
    --ep-over, --dp-replicate,     EP folded over dp x cp (x tp); HSDP: --dp = replicas x shards
    --dp-shard
    nothing                        single (one process: the reference)

An explicit --strategy that cannot run a given flag is refused, never silently given size 1.
"""
from __future__ import annotations

import math
import re

PROG = "python -m labkit.apps.train"
STRATEGIES = ("single", "dp", "pp", "hybrid", "composed")
AXES = ("dp", "pp", "cp", "tp", "ep")  # the report's axes; world size = dp x pp x cp x tp (ep is folded, no ranks)
COMPOSED_FLAGS = ("tp", "cp", "ep", "zero", "ep_over", "dp_replicate", "dp_shard", "ep_overlap")
# labkit.compose's messages name its arguments; the app's name its flags
FLAGS = {"dp": "--dp", "pp": "--pp", "cp": "--cp", "tp": "--tp", "ep": "--ep", "zero": "--zero",
         "ep_over": "--ep-over", "dp_replicate": "--dp-replicate", "dp_shard": "--dp-shard",
         "microbatches": "--microbatches", "batch": "--batch-size", "seq_len": "--seq-len",
         "capacity_factor": "--capacity-factor", "cp_method": "--cp-method",
         "ep_overlap": "--ep-overlap"}


def refuse(message: str):
    """Stop the app with one line (exit status 1), before any rank starts."""
    raise SystemExit(f"{PROG}: {message}")


def as_flags(message: str) -> str:
    """A labkit.compose message with its argument names as the app's flags: 'tp=3' -> '--tp 3'."""
    return re.sub(r"\b(" + "|".join(FLAGS) + r")=([^\s,:;)]+)", lambda m: f"{FLAGS[m[1]]} {m[2].strip(chr(39))}", message)


def choose_strategy(args) -> str:
    """The strategy that runs the layout the flags ask for (see the module's docstring); refuses an
    explicit --strategy that would ignore one of them."""
    composed = [FLAGS[a] for a in COMPOSED_FLAGS if getattr(args, a, None) is not None]
    if args.strategy is None:
        if composed:
            return "composed"
        if args.dp is not None and args.pp is not None:
            return "hybrid"
        return "pp" if args.pp is not None else "dp" if args.dp is not None else "single"
    if composed and args.strategy != "composed":
        refuse(f"{'/'.join(composed)} belong to the composed strategy, not --strategy {args.strategy}: "
               "leave --strategy out (or say --strategy composed)")
    ignored = {"single": ("dp", "pp"), "dp": ("pp",), "pp": ("dp",)}.get(args.strategy, ())
    bad = [f"--{a} {getattr(args, a)}" for a in ignored if getattr(args, a) not in (None, 1)]
    if bad:
        refuse(f"--strategy {args.strategy} does not run {' and '.join(bad)}: leave --strategy out (the flags "
               "choose it: --dp alone dp, --pp alone pp, both hybrid) or say --strategy hybrid")
    return args.strategy


def resolve_mesh(strategy: str, dp: int | None, pp: int | None, world_size: int | None):
    """(dp, pp) for a strategy of notebooks 04-07; missing sizes come from the launcher's world size (or 2).
    Whether they fit that world is `check_layout`'s question."""
    if strategy == "single":
        return 1, 1
    if strategy == "dp":
        return dp or world_size or 2, 1
    if strategy == "pp":
        return 1, pp or world_size or 2
    if dp is None and pp is None:
        return 2, (world_size // 2 if world_size else 2)
    if dp is None:
        return max(1, (world_size or 2 * pp) // pp), pp
    if pp is None:
        return dp, max(1, (world_size or 2 * dp) // dp)
    return dp, pp


def model_config(args):
    """The run's ModelConfig: the named config, with --capacity-factor for a MoE."""
    from labkit.model import get_config

    extra = {} if args.capacity_factor is None else {"capacity_factor": args.capacity_factor}
    try:
        return get_config(args.model, **extra)
    except ValueError as e:
        refuse(as_flags(str(e)))


def composed_dims(args):
    from labkit.compose.dims import ParallelDims

    return ParallelDims(dp=args.dp, pp=args.pp, cp=args.cp, tp=args.tp, ep=args.ep, zero=args.zero,
                        microbatches=args.microbatches, cp_method=args.cp_method or "ring", ep_over=ep_over(args),
                        ep_overlap=bool(getattr(args, "ep_overlap", None)),
                        dp_replicate=getattr(args, "dp_replicate", None) or 1, dp_shard=getattr(args, "dp_shard", None))


def ep_over(args) -> tuple:
    """--ep-over "dp,cp" as ("dp", "cp"); refused unless among dp, cp, tp with dp first."""
    text = getattr(args, "ep_over", None) or "dp"
    axes = tuple(a.strip() for a in text.split(","))
    if set(axes) - {"dp", "cp", "tp"} or "dp" not in axes or len(set(axes)) != len(axes):
        refuse(f"--ep-over {text}: name the axes ep is folded over, comma-separated, dp first: dp, dp,cp or dp,cp,tp")
    return tuple(a for a in ("dp", "cp", "tp") if a in axes)


def resolve_layout(args, world: int | None) -> int:
    """Choose the strategy, fill every size (args.dp ... args.zero, args.microbatches) and check the layout
    against the launcher's world, the model and the batch; returns the world size. Refuses with one line."""
    args.strategy = choose_strategy(args)
    for name in ("dp", "pp", "cp", "tp", "ep", "microbatches", "dp_replicate", "dp_shard"):
        value = getattr(args, name, None)
        if value is not None and value < 1:
            refuse(f"{FLAGS.get(name, '--' + name)} {value}: every size must be at least 1")
    hsdp = getattr(args, "dp_replicate", None) is not None or getattr(args, "dp_shard", None) is not None
    if args.strategy == "composed":
        args.pp, args.cp, args.tp, args.ep = (v or 1 for v in (args.pp, args.cp, args.tp, args.ep))
        if hsdp:
            if args.zero == 0:
                refuse("--dp-replicate/--dp-shard with --zero 0: HSDP shards inside each replica; use --zero 1, 2 or "
                       "3 (left out: 3, FSDP), or leave --dp-replicate and --dp-shard out for plain dp")
            args.zero = 3 if args.zero is None else args.zero
            r, s = args.dp_replicate or 1, args.dp_shard
            if args.dp is None and s is not None:
                args.dp = r * s
        args.zero = args.zero or 0
        if args.dp is None:
            rest = args.pp * args.cp * args.tp
            folded = math.prod(getattr(args, a) for a in ep_over(args) if a != "dp")  # ep's ranks outside dp
            args.dp = world // rest if world and world % rest == 0 else max(1, args.ep // math.gcd(args.ep, folded))
    else:
        args.dp, args.pp = resolve_mesh(args.strategy, args.dp, args.pp, world)
        args.cp, args.tp, args.ep, args.zero = 1, 1, 1, 0
    if args.microbatches is None:
        args.microbatches = 2 * args.pp if args.pp > 1 else 1
    if args.cp_method is not None and args.cp < 2:
        refuse(f"--cp-method {args.cp_method} chooses how attention crosses the context-parallel ranks, but there are "
               f"none (--cp {args.cp}): add --cp 2 or more, or leave --cp-method out")
    check_layout(args, world, model_config(args))
    if args.strategy == "composed":  # the rest of labkit.compose's checks (heads, sequence pieces, experts)
        try:
            composed_dims(args).check(model_config(args), batch=args.batch_size, seq_len=args.seq_len, world_size=world)
        except ValueError as e:
            refuse(as_flags(str(e)))
    return args.dp * args.pp * args.cp * args.tp


def resolve_composed(args, world: int | None) -> int:
    """`resolve_layout` for the composed strategy (the name this had before the flags chose the strategy)."""
    args.strategy = "composed"
    return resolve_layout(args, world)


def check_layout(args, world: int | None, config) -> None:
    """The refusals every strategy shares, each naming the flag and the fix."""
    product = args.dp * args.pp * args.cp * args.tp
    if world is not None and product != world:
        sizes = " x ".join(f"--{a} {getattr(args, a)}" for a in ("dp", "pp", "cp", "tp"))
        refuse(f"{sizes} needs {product} processes, but the launcher started {world}: change --dp/--pp/--cp/--tp "
               f"so that their product is {world}, or start {product} processes (torchrun --nproc-per-node "
               f"{product}); --ep is folded over --dp (and --ep-over's axes) and is not in the product")
    if args.pp > config.n_layers:
        refuse(f"--pp {args.pp} is more stages than --model {args.model}'s {config.n_layers} layers: every stage "
               f"needs a layer; use --pp {config.n_layers} or fewer")
    parts = args.dp * args.microbatches
    if args.batch_size % parts:
        lower, upper = args.batch_size // parts * parts, (args.batch_size // parts + 1) * parts
        sizes = f"--batch-size {lower} or {upper}" if lower else f"--batch-size {upper}"
        refuse(f"--batch-size {args.batch_size} does not split over --dp {args.dp} x --microbatches "
               f"{args.microbatches} = {parts} equal parts (each replica's rows, cut into micro-batches): use "
               f"{sizes} (a multiple of {parts}), or change --dp or --microbatches")
    dropless = config.n_experts / config.top_k if config.n_experts else None
    if dropless and args.cp * args.tp > 1 and config.capacity_factor < dropless:
        given = "" if args.capacity_factor is not None else " (the config's default)"
        refuse(f"--model {args.model} with --capacity-factor {config.capacity_factor:g}{given} drops the tokens past "
               f"an expert's capacity, chosen per whole sequence by the lab's MoE; under --cp {args.cp} --tp {args.tp} no rank "
               f"sees a whole sequence, so this run would drop other tokens than the one-process run. Add --capacity-factor "
               f"{dropless:g} (n_experts / top_k: no token dropped; the lab's requirement, so that runs equal one process)")
