"""Subcommands of the user-facing jobs: ``lowprec recipes``, ``train``, ``demo``, ``report``.

Each ``add_<name>(subparsers)`` builds its parser and sets ``handler``; ``lowprec.cli``
lists them. Bad input exits with code 2 and a message naming the option; nothing on disk is
overwritten.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import resource
import sys
from collections.abc import Callable
from dataclasses import MISSING, Field, fields, replace
from datetime import datetime
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from lowprec.autopilot import Plan, is_plan_dict
from lowprec.cli import parallel as cli_parallel
from lowprec.cli.args import int_arg, path_arg
from lowprec.distributed import env
from lowprec.jobs.model import model_names
from lowprec.jobs.run_summary import summary_cells
from lowprec.jobs.rundir import RunError, output_problem, read_config
from lowprec.jobs.train import ON_NONFINITE, TrainConfig, saved_config, train
from lowprec.recipes import Recipe, get_recipe, recipe_names
from lowprec.recipes.compose import LayerRulesError

log = logging.getLogger(__name__)

__all__ = ["add_demo", "add_recipes", "add_report", "add_train"]


def _recipe_arg(name: str) -> str:
    """argparse ``type`` of a recipe's preset name (argparse prefixes ``argument
    --recipe:``, so the message leaves out ``recipe:``)."""
    try:
        return get_recipe(name).name
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e).removeprefix("recipe: ")) from None


def _recipe_or_file(text: str) -> str | Recipe:
    """argparse ``type`` of ``train --recipe``: a preset name, or else a JSON file holding
    a recipe in ``Recipe.to_dict``'s format or a plan of ``lowprec tune`` (its recipe; a
    name ending in ``.json``, or any other existing file), read strictly (no code runs:
    :mod:`lowprec.recipes.serial`)."""
    path = Path(text)
    if text in recipe_names() or not (text.lower().endswith(".json") or path.is_file()):
        return _recipe_arg(text)
    try:
        d = json.loads(path.read_text(encoding="utf-8"))
    except OSError as e:
        raise argparse.ArgumentTypeError(f"cannot read {text}: {e.strerror or e}") from None
    except (UnicodeDecodeError, ValueError) as e:
        raise argparse.ArgumentTypeError(f"{text} is not JSON ({e})") from None
    if is_plan_dict(d):  # lowprec tune's plan: read as Plan.load reads it (its recipe)
        try:
            return Plan.from_dict(d).recipe
        except (KeyError, ValueError, TypeError) as e:
            raise argparse.ArgumentTypeError(f"{text} is not a valid plan ({e})") from None
    try:
        return Recipe.from_dict(d)
    except KeyError as e:  # a str() of a KeyError is only the key, quoted
        raise argparse.ArgumentTypeError(f"{text} is not a recipe (no key {e})") from None
    except (ValueError, TypeError) as e:
        raise argparse.ArgumentTypeError(f"{text} is not a recipe ({e})") from None


class _RecipeAction(argparse.Action):
    """``train --recipe``: the recipe (:func:`_recipe_or_file`) in ``recipe``, and in
    ``recipe_file`` the file it came from with what it says of its model (a plan's
    :attr:`~lowprec.autopilot.Plan.model`), for the messages of :func:`_run_train`."""

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: Any,
        option_string: str | None = None,
    ) -> None:
        try:
            recipe = _recipe_or_file(values)
        except argparse.ArgumentTypeError as e:
            raise argparse.ArgumentError(self, str(e)) from None
        setattr(namespace, self.dest, recipe)
        source = None
        if isinstance(recipe, Recipe):
            try:
                plan = Plan.load(values)
                what = "the plan" + (f", tuned on {plan.model}," if plan.model else "")
                source = (values, what, plan.model)
            except (OSError, ValueError, TypeError, KeyError):
                source = (values, "the recipe", "")  # a recipe file, not a plan
        namespace.recipe_file = source


def _repeated(values: list[Any] | None) -> Any | None:
    """The first value given twice in ``values`` (None: none is)."""
    seen: set[Any] = set()
    for v in values or []:
        if v in seen:
            return v
        seen.add(v)
    return None


# ---- lowprec recipes -----------------------------------------------------------------------


def add_recipes(subparsers: Any) -> None:
    p = subparsers.add_parser("recipes", help="list the named training recipes")
    p.set_defaults(handler=_run_recipes, parser=p)


def _run_recipes(args: argparse.Namespace) -> int:
    table = Table(title="lowprec recipes", title_justify="left")
    for col in ("name", "params", "master", "loss scaling", "autocast", "description"):
        table.add_column(col)
    for name in recipe_names():
        r = get_recipe(name)
        ls: str = r.loss_scaling
        if ls != "none":
            ls += f" 2^{math.log2(r.loss_scale):g}"
        table.add_row(
            r.name,
            r.param_dtype,
            "fp32" if r.master_weights else "-",
            ls,
            r.autocast or "-",
            r.description,
        )
    Console(file=sys.stdout, width=160).print(table)
    return 0


# ---- lowprec train -------------------------------------------------------------------------


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _field_type(f: Field[Any]) -> Callable[[str], Any]:
    """argparse ``type`` of TrainConfig field ``f``: parse the text as the field's type,
    then check it as the config does (the message without the field's name, which
    argparse gives as the flag)."""
    if f.name == "recipe":
        return _recipe_or_file
    kind = {"int": int, "float": float}.get(str(f.type), str)
    what = {int: "an integer", float: "a number", str: "a string"}[kind]

    def parse(text: str) -> Any:
        try:
            v = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
        try:
            TrainConfig.check_field(f.name, v)
        except (ValueError, TypeError) as e:
            raise argparse.ArgumentTypeError(str(e).removeprefix(f"{f.name} ")) from None
        return v

    return parse


def add_train(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "train",
        help="train the reference char-LM with a recipe",
        description="Train the reference character-level transformer on tinyshakespeare. "
        "Writes config.json, metrics.jsonl (one line per step), checkpoint.pt and "
        "summary.json to --out. Ctrl-C (or SIGTERM) finishes the current step, writes a "
        "checkpoint and exits with 130 (143); --resume --out DIR continues bit-exactly "
        "with the run's own configuration. The progress bar and the final table show the "
        "mean train loss of the last 10 steps and the median ms/step. See docs/cli.md and "
        "docs/reliability.md.",
    )
    config = p.add_argument_group(
        "the run's configuration",
        "one flag per field of lowprec.jobs.train.TrainConfig, saved in config.json; "
        "with --resume each defaults to the run's value, and only --steps may differ",
    )
    for f in fields(TrainConfig):
        default = f.default if f.default is not MISSING else None
        extra: dict[str, Any] = {"type": _field_type(f)}
        text = f.metadata["help"]
        if f.name == "recipe":
            text += f" (Recipe.to_dict format); presets: {', '.join(recipe_names())}"
            extra = {"action": _RecipeAction, "metavar": "NAME|FILE.json"}
        elif f.name == "model":
            extra = {"choices": model_names()}
            text += "; needs pip install 'lowprec[hf]' for the HF ones"
        elif str(f.type) == "bool":
            extra = {"action": "store_const", "const": True}
        config.add_argument(
            _flag(f.name), default=None, help=f"{text} (default {default})", **extra
        )
    p.add_argument(
        "--out",
        type=path_arg,
        default=None,
        help="run directory (default runs/<recipe>-<time>); must not exist unless --resume",
    )
    p.add_argument(
        "--resume",
        action="store_true",
        help="continue the run in --out (from its checkpoint; from step 0 if it has none) "
        "with the configuration in its config.json",
    )
    p.add_argument(
        "--on-nonfinite",
        choices=ON_NONFINITE,
        default="stop",
        help="a step with a NaN/Inf loss or gradient (recipes without loss scaling): stop "
        "(default; exit 1, the step not applied, the last checkpoint kept) or skip it "
        "(no update); loss-scaled recipes always skip, as their scaler does",
    )
    p.add_argument(
        "--max-skips",
        type=int_arg(1),
        default=25,
        help="stop after this many consecutive skipped steps (default 25)",
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    cli_parallel.add_options(p)
    p.set_defaults(handler=_run_train, parser=p, recipe_file=None)


def _train_config(args: argparse.Namespace) -> TrainConfig:
    """The run's configuration: the flags given over the defaults, or, with ``--resume``,
    over the run's ``config.json`` (a flag that differs from it, other than ``--steps``:
    :class:`RunError` naming the flag). Fills ``args.parallel`` from the run if not given."""
    parser: argparse.ArgumentParser = args.parser
    given = {f.name: getattr(args, f.name) for f in fields(TrainConfig)}
    given = {k: v for k, v in given.items() if v is not None}
    if not args.resume:
        try:  # each flag was checked alone: their combination, naming the flags
            TrainConfig.check_together(given, flags=True)
            return TrainConfig(**given)
        except ValueError as e:
            parser.error(str(e))
    if args.out is None:
        parser.error("--resume needs --out (the run directory to continue)")
    saved = read_config(args.out, "--resume")
    base = saved_config(args.out, saved)
    for name, v in given.items():
        if name == "recipe":
            differs = get_recipe(v).to_dict() != base.recipe_dict()
        else:
            differs = name != "steps" and v != getattr(base, name)
        if differs:
            shown = base.recipe_name if name == "recipe" else repr(getattr(base, name))
            value = v.name if isinstance(v, Recipe) else v
            raise RunError(
                f"--resume: {_flag(name)} {value} conflicts with the run in {args.out} "
                f"({name} {shown}); leave it out (only --steps may change)"
            )
    if args.parallel is None:
        args.parallel = (saved.get("parallel") or {}).get("mode")
    return replace(base, steps=given.get("steps", base.steps))


def _model_flags(cfg: TrainConfig) -> str:
    return (
        f"--model {cfg.model} --width {cfg.width} --depth {cfg.depth} --heads {cfg.heads} "
        f"--seq-len {cfg.seq_len}"
    )


def _run_train(args: argparse.Namespace) -> int:
    cfg = _train_config(args)
    args.recipe = cfg.recipe_name  # the default run directory's name
    if args.nproc_per_node is not None:  # torch's launcher runs this command N times
        return cli_parallel.launch(args, getattr(args, "argv", None) or sys.argv[1:])
    out = cli_parallel.setup(args)
    tuned = args.recipe_file[2] if args.recipe_file is not None else ""
    # the same model at other sizes (another model's layer names are checked by prepare)
    if tuned.split()[:2] == ["--model", cfg.model] and tuned != _model_flags(cfg):
        log.warning(
            "--recipe %s: the plan was tuned on %s, not on this run's model (%s): its "
            "formats per layer were chosen from that model's numerics; tune again for this "
            "one (lowprec tune %s)",
            args.recipe_file[0],
            args.recipe_file[2],
            _model_flags(cfg),
            _model_flags(cfg),
        )
    console = Console(width=max(Console().width, 120))
    # RunError (bad directory, too big), NonFiniteError and Interrupted: one line and the
    # exit code from lowprec.cli.main.main.
    try:
        summary = train(
            cfg,
            out,
            resume=args.resume,
            progress=not args.no_progress,
            on_nonfinite=args.on_nonfinite,
            max_skips=args.max_skips,
            parallel=args.parallel,
        )
        main = env.is_main()
    except LayerRulesError as e:
        if args.recipe_file is None:
            raise
        path, what, _ = args.recipe_file
        raise LayerRulesError(
            f"--recipe {path}: {what} does not fit this run's model ({_model_flags(cfg)}): {e}"
        ) from None
    finally:
        if args.parallel is not None:
            env.shutdown()
    if not main:
        return 0  # rank 0 prints
    table = Table(title=f"run {out}", title_justify="left")
    # this process's peak resident memory (shown, not saved: it is not reproducible)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    cells = summary_cells({**summary, "peak_rss_mib": peak})
    for col in cells:
        table.add_column(col, justify="right")
    table.add_row(*cells.values())
    console.print(table)
    console.print("train loss: the mean of the last 10 steps; ms/step: the median step")
    return 0


# ---- lowprec demo --------------------------------------------------------------------------


def add_demo(subparsers: Any) -> None:
    from lowprec.jobs.demo import DEMO_CONFIG, DEMO_RECIPES

    p = subparsers.add_parser(
        "demo",
        help="train the reference model once per recipe and compare (the main job)",
        description="Train the reference char-LM with each recipe (same seed, data and "
        "steps): each failure (FP8 without scales, FP16 without loss scaling or master "
        "weights) next to the techniques that cure it. Prints a table with a verdict per "
        "recipe judged against the seed-to-seed spread, writes loss curves and the HTML "
        f"numerics report. Default: {len(DEMO_RECIPES)} recipes, {DEMO_CONFIG.steps} steps "
        "each; --quick: a smoke run "
        "(docs/demo.md gives the measured times). Ctrl-C stops at a step boundary; "
        "--resume DIR finishes an interrupted demo.",
    )
    p.add_argument("--quick", action="store_true", help="a smoke run (40 short steps per recipe)")
    which = p.add_mutually_exclusive_group()
    which.add_argument(
        "--recipes",
        type=_recipe_arg,
        nargs="+",
        default=None,
        metavar="NAME",
        help=f"default: {' '.join(DEMO_RECIPES)}",
    )
    which.add_argument("--all", action="store_true", help="every registered recipe")
    seed = p.add_mutually_exclusive_group()
    seed.add_argument(
        "--seed",
        type=int_arg(0),
        default=None,
        help="seed of initialisation and data (default 0)",
    )
    seed.add_argument(
        "--seeds",
        type=int_arg(0),
        nargs="+",
        default=None,
        metavar="SEED",
        help="train every recipe at each seed and measure the seed-to-seed spread of the "
        "val-loss gaps (the verdicts then use it)",
    )
    p.add_argument(
        "--out",
        type=path_arg,
        default=None,
        help="output directory (default runs/demo-<time>); must not exist",
    )
    p.add_argument(
        "--resume",
        type=path_arg,
        default=None,
        metavar="DIR",
        help="finish the interrupted demo in DIR with its own settings (no other option "
        "but --no-progress)",
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.set_defaults(handler=_run_demo, parser=p)


def _run_demo(args: argparse.Namespace) -> int:
    from lowprec.jobs.demo import run_demo

    seeds = args.seeds or ([args.seed] if args.seed is not None else None)
    for flag, values in (("--recipes", args.recipes), ("--seeds", args.seeds)):
        twice = _repeated(values)
        if twice is not None:
            args.parser.error(f"{flag}: {twice} is given twice; give each once")
    if args.resume is not None:
        given = [
            flag
            for flag, v in (
                ("--quick", args.quick),
                ("--recipes", args.recipes),
                ("--all", args.all),
                ("--seed/--seeds", seeds),
                ("--out", args.out),
            )
            if v
        ]
        if given:
            args.parser.error(
                f"--resume: the demo's settings come from {args.resume}/demo.json; "
                f"leave out {', '.join(given)}"
            )
    out = args.resume or args.out or Path("runs") / f"demo-{datetime.now():%Y%m%d-%H%M%S}"
    run_demo(  # a RunError (a bad or damaged directory): one error line, no usage (main)
        out,
        quick=args.quick,
        recipes=recipe_names() if args.all else args.recipes,
        progress=not args.no_progress,
        console=Console(file=sys.stdout, width=180),
        seeds=seeds,
        resume=args.resume is not None,
    )
    return 0


# ---- lowprec report ------------------------------------------------------------------------


def add_report(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "report",
        help="write an HTML report comparing run directories",
        description="Compare runs of `lowprec train` / `lowprec demo` in one self-contained "
        "HTML page: summary table, loss curves, per-tensor scale charts at initialisation "
        "and at the end, underflow/overflow tables and a plain-language diagnosis per run.",
    )
    p.add_argument("runs", type=path_arg, nargs="+", metavar="RUN_DIR", help="run directories")
    p.add_argument(
        "-o",
        "--out",
        type=path_arg,
        default=Path("report.html"),
        help="the HTML file to write, ending in .html or .htm (default report.html); a "
        "missing folder is created (and said so)",
    )
    p.add_argument("--title", default="", help="page title")
    p.add_argument("--force", action="store_true", help="overwrite an existing --out file")
    p.set_defaults(handler=_run_report, parser=p)


def _run_report(args: argparse.Namespace) -> int:
    from lowprec.jobs.report import write_report

    if args.out.suffix.lower() not in (".html", ".htm"):  # any case: a browser opens both
        raise RunError(
            f"--out: {args.out} must end in .html or .htm (got {args.out.suffix or 'no suffix'})"
        )
    problem = output_problem(args.out)  # before --force: it cannot overwrite a directory
    if problem is not None:
        raise RunError(f"--out: {problem}")
    if args.out.exists() and not args.force:
        args.parser.error(f"--out: {args.out} already exists; pass --force to overwrite it")
    missing = not args.out.parent.exists()
    path = write_report(args.runs, args.out, title=args.title)  # RunError: one line (main)
    print(f"report: {path}" + (f" (created the folder {path.parent})" if missing else ""))
    return 0
