"""`jetrl train CONFIG [key=value ...]` and `python -m jetrl.train CONFIG`: run the local trainer.

Exit status: 0 done; 1 the run could not start or continue (existing run directory, lint violation,
config drift on --resume, no checkpoint that verifies); 2 a bad config, model file or machine (one
line naming the field or the file); 130 interrupted by SIGINT (Ctrl-C), 143 by SIGTERM (128 + the
signal's number, the shell's convention): one line says the step it was at, the last checkpoint and
``--resume``, after the engine is shut down.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import warnings
from contextlib import contextmanager

__all__ = ["main", "build_parser", "Interrupted", "handle_signals", "quiet_engine_logs"]


class Interrupted(KeyboardInterrupt):
    """SIGINT or SIGTERM arrived; `signum` says which (the exit status is 128 + signum)."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


@contextmanager
def handle_signals():
    """SIGINT and SIGTERM raise `Interrupted` in the main thread (once: a second signal while the run shuts
    down is ignored, so the engine's shutdown is not cut short). The previous handlers come back after."""

    def _raise(signum, frame):
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        raise Interrupted(signum)

    old = {s: signal.signal(s, _raise) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for s, h in old.items():
            signal.signal(s, h)


def quiet_engine_logs(verbose: bool) -> None:
    """vLLM's INFO/WARNING lines off unless `verbose` (an explicit VLLM_LOGGING_LEVEL wins). Must run before
    vLLM is first imported: its logger reads the variable then."""
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "INFO" if verbose else "ERROR")
    if not verbose:
        os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
        os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")  # transformers' load/save bars too
        # vLLM logs a few warnings while importing, before its own logging config reads the variable
        logging.getLogger("vllm").setLevel(logging.ERROR)
        warnings.filterwarnings("ignore", category=FutureWarning, module=r"vllm(\.|$)")
        warnings.filterwarnings("ignore", category=DeprecationWarning, module=r"vllm(\.|$)")
    # jetrl's own notes (e.g. which GEMM backend 'auto' chose) go to stdout with the run's other log lines:
    # stderr carries the progress bar and errors only
    log = logging.getLogger("jetrl")
    if not any(getattr(h, "_jetrl_cli", False) for h in log.handlers):
        h = logging.StreamHandler(sys.stdout)
        h.setFormatter(logging.Formatter("%(message)s"))
        h._jetrl_cli = True
        log.addHandler(h)
        log.setLevel(logging.INFO if verbose else logging.WARNING)
        log.propagate = False


def user_error(prog: str, e: Exception) -> int:
    """A user's mistake (`ConfigError`, `ModelFileError`, `TrainError`) as one line on stderr; returns the
    exit code: 2 for a bad config or model file, 1 for a run that cannot go on."""
    from .config import ConfigError
    from .modelfiles import ModelFileError

    what, code = ("bad config: ", 2) if isinstance(e, ConfigError) else ("", 1)
    if isinstance(e, ModelFileError):
        what, code = "bad model file: ", 2
    print(f"{prog}: {what}{e}", file=sys.stderr)
    return code


def interrupt_line(trainer, signum: int, *, resume: str | None = None) -> str:
    """The one line an interrupted run prints; `resume` replaces ``--resume`` as the command to continue."""
    step = trainer.current_step if trainer is not None else 0
    where = f"interrupted at step {step}" if step else "interrupted during start-up"
    ckpt = getattr(trainer, "last_checkpoint", None) if trainer is not None else None
    if ckpt is None:
        again = "start again with --overwrite" if step > 1 else "start again with the same command"
        return f"{where}; no checkpoint yet; {again}"
    return f"{where}; last checkpoint step {ckpt}; resume with {resume or '--resume'}"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="jetrl train",
        description="Single-process GRPO/DAPO with vLLM rollouts, FP8 training and a byte-verified weight sync.",
        epilog="Exit status: 0 done, 1 cannot start/continue, 2 bad config or model file, 130 Ctrl-C, 143 SIGTERM.",
    )
    p.add_argument("config", help="YAML (.yaml/.yml) or JSON (.json) config file")
    p.add_argument("overrides", nargs="*", metavar="section.key=value", help="override config fields (YAML values)")
    p.add_argument("--resume", action="store_true", help="continue the run from its newest checkpoint that verifies")
    p.add_argument("--overwrite", action="store_true", help="replace an existing run directory")
    p.add_argument(
        "--dry-run",
        action="store_true",
        help="check the config, this machine and the model's files, print the resolved config, exit",
    )
    p.add_argument("--verbose", action="store_true", help="show vLLM's and transformers' INFO/WARNING logs")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_intermixed_args(argv)
    quiet_engine_logs(args.verbose)
    from .config import ConfigError, load_config
    from .loggers import check_loggers
    from .modelfiles import ModelFileError, check_model_dir
    from .trainer import Trainer, TrainError

    if args.resume and args.overwrite:
        print("jetrl train: --resume and --overwrite exclude each other", file=sys.stderr)
        return 2
    trainer = None
    with handle_signals():
        try:
            try:
                cfg = load_config(args.config, args.overrides)
                if args.dry_run:
                    from .checks import check_environment

                    if cfg.model.path is not None:
                        check_model_dir(cfg.model.path)
                    check_environment(cfg)
                    check_loggers(cfg)
                    print(json.dumps(cfg.to_dict(), indent=2))
                    print(f"dry run: config OK for this machine; outputs would go to {cfg.run_dir}")
                    return 0
                trainer = Trainer(cfg, resume=args.resume, overwrite=args.overwrite, verbose=args.verbose)
            except (ConfigError, ModelFileError, TrainError) as e:
                return user_error("jetrl train", e)
            try:
                summary = trainer.run()
            except TrainError as e:
                return user_error("jetrl train", e)
            finally:
                trainer.close()
        except Interrupted as e:
            if trainer is not None:
                trainer.close()  # idempotent: the engine is down before the line is printed
            sys.stdout.flush()
            if sys.stderr.isatty():
                sys.stderr.write("\n")  # past the progress bar's line
            print(f"jetrl train: {interrupt_line(trainer, e.signum)}", file=sys.stderr)
            return 128 + e.signum
    print(json.dumps(summary, indent=2))
    return 0
