"""`rlhfuse-plan`: execution plans and paper-scale predictions.

rlhfuse-plan plan --device h100 --nodes 32 --actor 13b --critic 33b --max-len 1024 --json plan.json --png plan.png
rlhfuse-plan paper-grid --out GRID.json --png grid.png
rlhfuse-plan sensitivity --max-lens 1024                   # ratio bands as each assumed input moves
rlhfuse-plan rt-sweep --actor 33b --critic 65b --max-len 1024 --png rt.png
rlhfuse-plan memory --actor 7b --critic 7b --actor-pp 2 --critic-pp 2 --tp 2 --gen-tp 2 --precision bf16-true
rlhfuse-plan memory --actor 7b --critic 7b --fsdp 8 --precision bf16-mixed   # pipeline=fsdp over 8 ranks
rlhfuse-plan calibrate            # CPU spec vs measured tiny-model runs (needs torch)
rlhfuse-plan calibrate --from gpu_check.json --out h200.json   # a GPU's factors fitted to make gpu-check
rlhfuse-plan paper-grid --device h200.json                      # ... and used: any --device takes the file
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

from rlhfuse.pipeline import SearchConfig
from rlhfuse.pipeline.colocation import Colocation
from rlhfuse.planner.grid import GRID_SEARCH, PAPER_RANGES, SPECULATION, Comparison, compare, paper_grid
from rlhfuse.planner.lengths import RESPONSES, LengthDistribution
from rlhfuse.planner.memory import PRECISIONS, fsdp_rank_memories, rank_memories
from rlhfuse.planner.plan_simulator import RLHFModels, Speculation, Workload
from rlhfuse.planner.specs import DEVICES, DeviceProfile, ModelSpec, cluster, device_profile, model


def _model_arg(text: str) -> ModelSpec:
    """A preset name (7b, 13b, 33b, 65b) or the path of a Hugging Face config.json."""
    path = Path(text)
    if path.suffix == ".json" and path.exists():
        return ModelSpec.from_hf_dict(json.loads(path.read_text()), name=path.parent.name or path.stem)
    try:
        return model(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _device_arg(text: str) -> DeviceProfile:
    """A preset name or a device file (`rlhfuse-plan calibrate --from ... --out FILE`)."""
    try:
        return device_profile(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _common(p: argparse.ArgumentParser, *, models: bool = True) -> None:
    p.add_argument(
        "--device", type=_device_arg, default="h100",
        help=f"device preset ({', '.join(sorted(DEVICES))}) or a device file from `calibrate --from` (default h100)",
    )  # fmt: skip
    p.add_argument("--nodes", type=int, default=32, help="nodes (default 32)")
    p.add_argument("--gpus-per-node", type=int, default=8, help="devices per node (default 8)")
    p.add_argument("--global-batch", type=int, default=512, help="samples per iteration (default 512)")
    p.add_argument("--mini-batch", type=int, default=64, help="samples per optimizer step (default 64)")
    p.add_argument("--seed", type=int, default=0, help="seed of the sampled response lengths")
    p.add_argument(
        "--len-median", type=float, default=RESPONSES.median, help="median response length (tokens)"
    )
    p.add_argument(
        "--len-sigma", type=float, default=RESPONSES.sigma, help="log-normal sigma of response lengths"
    )
    p.add_argument(
        "--even-pp", action="store_true",
        help="only pipelines whose stages hold equal layer counts (default: stages may differ by one layer)",
    )  # fmt: skip
    p.add_argument(
        "--search-iterations", type=int, default=GRID_SEARCH.max_iterations,
        help="re-schedule RLHFuse's fused training with rlhfuse.pipeline's search under this deterministic budget "
        "(annealing iterations per phase; default %(default)s; 0: the greedy list schedule only)",
    )  # fmt: skip
    if models:
        p.add_argument(
            "--actor", type=_model_arg, default=model("13b"), help="preset or config.json (default 13b)"
        )
        p.add_argument(
            "--critic", type=_model_arg, default=model("33b"), help="preset or config.json (default 33b)"
        )
        p.add_argument("--max-len", type=int, default=1024, help="max generation length (default 1024)")


def _fmt_ratio(value: float, lo_hi: tuple[float, float]) -> str:
    lo, hi = lo_hi
    mark = "in" if lo <= round(value, 2) <= hi else ("below" if value < lo else "above")
    return f"{value:5.2f} ({mark} {lo}-{hi})"


def print_comparison(comp: Comparison) -> None:
    for plan in (comp.base, comp.rlhfuse):
        b = plan.breakdown
        print(f"\n{plan.system}: {plan.models.name}, max_len {plan.workload.max_len}, {plan.cluster.gpus} x "
              f"{plan.cluster.device.name}")  # fmt: skip
        width = max(len(k) for k, _ in plan.layout_rows())
        for task, layout in plan.layout_rows():
            print(f"  {task:<{width}}  {layout}")
        print(f"  predicted s/iter: generation {b.generation:.2f}  inference (exposed) {b.inference:.2f}  "
              f"training {b.training:.2f}  others {b.others:.2f}  total {b.total:.2f}  "
              f"throughput {plan.throughput:.1f} samples/s")  # fmt: skip
    print(f"\nRLHFuse / RLHFuse-Base: throughput {_fmt_ratio(comp.throughput_ratio, PAPER_RANGES['throughput_ratio'])}"
          f", Gen+Inf {_fmt_ratio(comp.gen_inf_ratio, PAPER_RANGES['gen_inf_ratio'])}"
          f", train {_fmt_ratio(comp.train_ratio, PAPER_RANGES['train_ratio'])}"
          f" [at the fused lower bound: {comp.train_ratio_bound:.2f}]  (paper ranges in brackets)")  # fmt: skip


def _rt_cell(fraction: float | None) -> str:
    return "off" if fraction is None else f"{fraction:.0%}"


def grid_table(comps: Sequence[Comparison]) -> str:
    """The grid against the paper's ranges, one row per setting."""
    head = (f"{'actor/critic':<12} {'len':>5} | {'throughput':>10} {'gen+inf':>8} {'train':>6} {'train@LB':>8} | "
            f"{'spec':>5} {'gi+spec':>7} | "
            f"{'Rt':>4} {'m':>3} {'gen tp':>6} {'train (actor | critic)':<40} {'sched':<6}")  # fmt: skip
    rows = [head, "-" * len(head)]
    for c in comps:
        p = c.rlhfuse
        a, cr = p.train.actor, p.train.critic
        m = p.migration.m if p.migration else 0
        rows.append(
            f"{p.models.name:<12} {p.workload.max_len:>5} | {c.throughput_ratio:>10.2f} {c.gen_inf_ratio:>8.2f} "
            f"{c.train_ratio:>6.2f} {c.train_ratio_bound:>8.2f} | {c.spec_gain:>5.2f} {c.spec_gen_inf_ratio:>7.2f} | "
            f"{_rt_cell(p.rt_fraction):>4} {m:>3} {p.gen_tp:>6} "
            f"{f'dp{a.dp} pp{a.pp} tp{a.tp} b{a.micro_batch} | dp{cr.dp} pp{cr.pp} tp{cr.tp} b{cr.micro_batch}':<40} "
            f"{p.train.mode:<6}"
        )
    lo = {k: min(getattr(c, k) for c in comps) for k in PAPER_RANGES}
    hi = {k: max(getattr(c, k) for c in comps) for k in PAPER_RANGES}
    rows.append("-" * len(head))
    rows.append("ours:  " + ", ".join(f"{k} {lo[k]:.2f}-{hi[k]:.2f}" for k in PAPER_RANGES))
    rows.append("paper: " + ", ".join(f"{k} {a}-{b}" for k, (a, b) in PAPER_RANGES.items()))
    spec = next((c.speculation for c in comps if c.speculation is not None), None)
    if spec is not None:
        rows.append(
            f"spec = RLHFuse Gen+Inf without / with the speculative tail (k={spec.tokens}, acceptance "
            f"{spec.acceptance:.0%}, {spec.tokens_per_step:.2f} tokens per verify step, verifying where it pays); "
            "gi+spec = RLHFuse-Base Gen+Inf / RLHFuse's with migration and the speculative tail"
        )
    return "\n".join(rows)


def split_table(comps: Sequence[Comparison]) -> str:
    """Each setting's seconds per iteration for both systems, by part, and where RLHFuse's gain comes from."""
    parts = ("generation", "inference", "training", "reduction", "others")
    short = ("gen", "inf", "train", "reduce", "other")
    cells = " ".join(f"{n:>6}" for n in short)
    head = f"{'actor/critic':<12} {'len':>5} | Base s/iter: {cells} | RLHFuse s/iter: {cells} | gain: inter intra other"
    rows = [head, "-" * len(head)]
    for c in comps:
        p = c.rlhfuse
        base, ours = c.split("base"), c.split("rlhfuse")
        inter, intra, other = c.gain_sources
        rows.append(
            f"{p.models.name:<12} {p.workload.max_len:>5} | {'':12}" + " ".join(f"{base[k]:>6.2f}" for k in parts)
            + f" | {'':15}" + " ".join(f"{ours[k]:>6.2f}" for k in parts)
            + f" | {'':5}{inter:>5.0%} {intra:>5.0%} {other:>5.0%}"
        )  # fmt: skip
    rows.append(
        "-"
        * len(head)
        + "\ninf = inference not hidden under generation; train = training pipelines and optimizer "
        "steps; reduce = the exposed data-parallel gradient all-reduce (bucketed, overlapped with the last "
        "backward); other = task switching. gain = shares of the seconds RLHFuse saves: inter-stage fusion "
        "(Gen+Inf), intra-stage fusion (training), other"
    )
    return "\n".join(rows)


# what depends on the workload (the KV cache, activations) or is pipeline=fsdp's own
WORKLOAD_COMPONENTS = ("kv_cache", "activations")
FSDP_COMPONENTS = ("rollout_gathered", "train_gathered")


def memory_table(args: argparse.Namespace) -> str:
    """`rlhfuse-plan memory`: one row per pipeline rank of a fused group (every tp rank of it holds the same); with
    unequal tp, one per sub-rank of each pipeline rank (rank "v.j": the smaller-tp model's sub-stage j); with
    `--fsdp N`, one per rank of pipeline=fsdp over N ranks."""
    critic = None if args.critic_free else args.critic
    if args.fsdp:
        return fsdp_memory_table(args, critic)
    critic_tp = args.tp if args.critic_tp is None else args.critic_tp
    ranks = rank_memories(
        args.actor, critic, actor_pp=args.actor_pp, critic_pp=args.critic_pp, actor_tp=args.tp,
        critic_tp=critic_tp, gen_tp=args.gen_tp, precision=args.precision, offload=args.offload_frozen,
        reward=args.critic,
    )  # fmt: skip
    width = Colocation(args.actor_pp, args.tp, args.critic_pp, critic_tp).width
    cols = [c for c in ranks[0].components() if c not in (*WORKLOAD_COMPONENTS, *FSDP_COMPONENTS)]
    gib = 2**30
    tps = f"tp={args.tp}" if critic_tp == args.tp else f"actor_tp={args.tp} critic_tp={critic_tp}"
    rows = [
        f"{args.actor.name}/{'-' if critic is None else critic.name}: actor_pp={args.actor_pp} "
        f"critic_pp={args.critic_pp} {tps} generator.tp={args.gen_tp} {args.precision}"
        f"{' offload_frozen' if args.offload_frozen else ''} (GiB per device; KV cache and activations not included)",
        f"{'rank':>4} "
        + " ".join(f"{c:>18}" for c in cols)
        + f" {'param_bytes':>12} {'optimizer_bytes':>16}",
    ]
    for r, m in enumerate(ranks):
        comp = m.components()
        label = str(r) if width == 1 else f"{r // width}.{r % width}"
        rows.append(
            f"{label:>4} " + " ".join(f"{comp[c] / gib:>18.3f}" for c in cols)
            + f" {m.param_bytes / gib:>12.3f} {m.optimizer_bytes / gib:>16.3f}"
        )  # fmt: skip
    return "\n".join(rows)


def fsdp_memory_table(args: argparse.Namespace, critic: ModelSpec | None) -> str:
    """`rlhfuse-plan memory --fsdp N`: each rank of pipeline=fsdp over N ranks (`fsdp_rank_memories`), its gathered
    phases included (the workload's KV cache and activations are not)."""
    ranks = fsdp_rank_memories(
        args.actor, critic, world=args.fsdp, precision=args.precision, reward=args.critic,
        reshard_after_forward=not args.keep_gathered,
    )  # fmt: skip
    cols = [c for c in ranks[0].components() if c not in (*WORKLOAD_COMPONENTS, "frozen_offloaded")]
    gib = 2**30
    rows = [
        f"{args.actor.name}/{'-' if critic is None else critic.name}: pipeline=fsdp over {args.fsdp} ranks "
        f"{args.precision} reshard_after_forward={str(not args.keep_gathered).lower()} (GiB per device; KV cache "
        "and activations not included)",
        f"{'rank':>4} "
        + " ".join(f"{c:>18}" for c in cols)
        + f" {'param_bytes':>12} {'optimizer_bytes':>16}",
    ]
    for r, m in enumerate(ranks):
        comp = m.components()
        rows.append(
            f"{r:>4} " + " ".join(f"{comp[c] / gib:>18.3f}" for c in cols)
            + f" {m.param_bytes / gib:>12.3f} {m.optimizer_bytes / gib:>16.3f}"
        )  # fmt: skip
    return "\n".join(rows)


def _search(args: argparse.Namespace) -> SearchConfig | None:
    if args.search_iterations < 0:
        raise ValueError(
            f"--search-iterations={args.search_iterations} must be >= 0 (0: the greedy schedule)"
        )
    return replace(GRID_SEARCH, max_iterations=args.search_iterations) if args.search_iterations else None


def _responses(args: argparse.Namespace) -> LengthDistribution:
    return LengthDistribution(median=args.len_median, sigma=args.len_sigma)


def _workload(args: argparse.Namespace, max_len: int) -> Workload:
    return Workload(
        global_batch=args.global_batch, mini_batch=args.mini_batch, max_len=max_len, seed=args.seed,
        responses=_responses(args),
    )  # fmt: skip


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="rlhfuse-plan", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="command", required=True)
    p_plan = sub.add_parser("plan", help="plan one Actor/Critic setting; print the table and breakdown")
    _common(p_plan)
    p_plan.add_argument("--json", type=Path, help="write both plans and the ratios here")
    p_plan.add_argument("--png", type=Path, help="write a Figure-8-style bar chart here")
    p_grid = sub.add_parser(
        "paper-grid", help="the paper's grid: 4 model pairs x 3 max lengths on 32 x 8 H100"
    )
    _common(p_grid, models=False)
    p_grid.add_argument("--out", type=Path, default=Path("GRID.json"), help="JSON output (default GRID.json)")
    p_grid.add_argument("--png", type=Path, help="bar chart of every cell")
    p_grid.add_argument("--max-lens", type=int, nargs="+", default=[512, 1024, 2048])
    p_grid.add_argument(
        "--spec-acceptance", type=float, default=SPECULATION.acceptance,
        help="speculative tail: probability a draft token is accepted (default %(default)s; < 0: off)",
    )  # fmt: skip
    p_grid.add_argument(
        "--spec-tokens", type=int, default=SPECULATION.tokens,
        help="speculative tail: draft tokens verified per step (default %(default)s)",
    )  # fmt: skip
    p_sens = sub.add_parser(
        "sensitivity",
        help="the grid's ratio bands as each assumed input moves alone (MFU, MBU, overheads, ...)",
    )
    _common(p_sens, models=False)
    p_sens.add_argument("--max-lens", type=int, nargs="+", default=[1024], help="max lengths (default 1024)")
    p_sens.add_argument("--out", type=Path, help="write the bands as JSON here")
    # 15 grids: the greedy schedule unless --search-iterations is given (greedy: ~3 min at max length 1024 on this
    # machine; searched, several minutes)
    p_sens.set_defaults(search_iterations=0)
    p_sweep = sub.add_parser("rt-sweep", help="fused Gen+Inf time against the migration threshold (Figure 9)")
    _common(p_sweep)
    p_sweep.add_argument("--png", type=Path, help="line chart of the sweep")
    p_mem = sub.add_parser(
        "memory", help="what each device of one fused group holds under rlhfuse.runtime, by component"
    )
    p_mem.add_argument("--actor", type=_model_arg, default=model("13b"), help="preset or config.json")
    p_mem.add_argument("--critic", type=_model_arg, default=model("33b"), help="preset or config.json")
    p_mem.add_argument("--critic-free", action="store_true", help="no Critic is trained (grpo, rloo, ...)")
    p_mem.add_argument("--actor-pp", type=int, default=1, help="pipeline.actor_pp")
    p_mem.add_argument("--critic-pp", type=int, default=1, help="pipeline.critic_pp")
    p_mem.add_argument(
        "--tp", type=int, default=1, help="pipeline.actor_tp (and critic_tp unless --critic-tp)"
    )
    p_mem.add_argument(
        "--critic-tp",
        type=int,
        default=None,
        help="pipeline.critic_tp (unequal: the smaller-tp model's stages merged)",
    )
    p_mem.add_argument("--gen-tp", type=int, default=1, help="generator.tp")
    p_mem.add_argument("--precision", default="32-true", choices=PRECISIONS, help="pipeline.optim.precision")
    p_mem.add_argument("--offload-frozen", action="store_true", help="inferencer.offload_frozen=true")
    p_mem.add_argument(
        "--fsdp",
        type=int,
        default=0,
        metavar="WORLD",
        help="pipeline=fsdp over WORLD ranks (the pp/tp flags unused)",
    )
    p_mem.add_argument(
        "--keep-gathered", action="store_true", help="with --fsdp: pipeline.reshard_after_forward=false"
    )
    p_cal = sub.add_parser(
        "calibrate",
        help="--from gpu_check.json: fit a GPU's factors to make gpu-check's figures and write a device file; "
        "without it: calibrate the CPU spec on tiny-model runs (needs torch)",
    )
    p_cal.add_argument("--from", dest="figures", type=Path, help="make gpu-check's JSON file")
    p_cal.add_argument("--preset", choices=sorted(k for k in DEVICES if k != "cpu"),
                       help="datasheet peaks to keep (default: by the device's name in the file)")  # fmt: skip
    p_cal.add_argument(
        "--out", type=Path, default=Path("device.json"), help="device file (default device.json)"
    )
    p_cal.add_argument("--repeats", type=int, default=5, help="CPU calibration: runs per measurement")
    args = parser.parse_args(argv)

    try:
        if args.command == "calibrate":
            from rlhfuse.planner.calibrate import calibrate_cpu, calibrate_from

            if args.figures is None:
                print(calibrate_cpu(repeats=args.repeats).report())
                return 0
            calibration = calibrate_from(args.figures, args.preset)
            print(calibration.report())
            print(
                f"wrote {calibration.profile.save(args.out)} (use: --device {args.out}, or plan_device={args.out})"
            )
            return 0
        if args.command == "memory":
            print(memory_table(args))
            return 0
        spec = cluster(args.device.device, args.nodes, args.gpus_per_node)
        if args.command == "sensitivity":
            from rlhfuse.planner.sensitivity import GridInputs, sensitivity, sensitivity_table

            start = time.perf_counter()
            bands = sensitivity(
                base=GridInputs(args.device.eff, _responses(args), args.global_batch), max_lens=tuple(args.max_lens),
                cluster_spec=spec, mini_batch=args.mini_batch, seed=args.seed, even_pp=args.even_pp,
                search=_search(args),
            )  # fmt: skip
            print(sensitivity_table(bands))
            print(f"planner wall time for {len(bands)} grids: {time.perf_counter() - start:.1f} s")
            if args.out:
                args.out.write_text(json.dumps([b.to_dict() for b in bands], indent=1))
                print(f"wrote {args.out}")
            return 0
        if args.command == "paper-grid":
            start = time.perf_counter()
            comps = paper_grid(
                max_lens=tuple(args.max_lens), cluster_spec=spec, eff=args.device.eff, global_batch=args.global_batch,
                mini_batch=args.mini_batch, seed=args.seed, responses=_responses(args), even_pp=args.even_pp,
                search=_search(args),
                speculation=None if args.spec_acceptance < 0 else Speculation(args.spec_acceptance, args.spec_tokens),
            )  # fmt: skip
            seconds = time.perf_counter() - start
            print(grid_table(comps))
            print()
            print(split_table(comps))
            print(f"planner wall time for {len(comps)} settings x 2 systems: {seconds:.1f} s")
            args.out.write_text(json.dumps([c.to_dict() for c in comps], indent=1))
            print(f"wrote {args.out}")
            if args.png:
                from rlhfuse.planner.plan_plot import breakdown_chart

                print(f"wrote {breakdown_chart(comps, args.png)}")
            return 0
        comp = compare(
            RLHFModels(args.actor, args.critic),
            spec,
            _workload(args, args.max_len),
            args.device.eff,
            even_pp=args.even_pp,
            search=_search(args),
        )
        if args.command == "rt-sweep":
            print(f"{comp.rlhfuse.models.name}, max_len {args.max_len}: fused Gen+Inf seconds by Rt / batch")
            best = min(comp.rlhfuse.sweep, key=lambda x: x[1])
            for frac, seconds in comp.rlhfuse.sweep:
                print(f"  Rt {frac:4.0%}  {seconds:7.3f} s{'  <- best' if (frac, seconds) == best else ''}")
            print(f"  RLHFuse-Base Gen+Inf: {comp.base.breakdown.gen_inf:.3f} s")
            if args.png:
                from rlhfuse.planner.plan_plot import rt_sweep_chart

                print(f"wrote {rt_sweep_chart([comp.rlhfuse], args.png)}")
            return 0
        print_comparison(comp)
        if args.json:
            args.json.write_text(json.dumps(comp.to_dict(), indent=1))
            print(f"wrote {args.json}")
        if args.png:
            from rlhfuse.planner.plan_plot import breakdown_chart

            print(f"wrote {breakdown_chart([comp], args.png)}")
    except ValueError as exc:
        print(f"rlhfuse-plan: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
