"""The ``p2p-cocodc`` command line. Option names are a contract: scripts outside the project use them."""

from __future__ import annotations

import os
import signal
import sys
import tempfile
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from p2p_cocodc.cli.options import config_option, option, schema_options
from p2p_cocodc.config.bootstrap import BOOTSTRAP
from p2p_cocodc.config.join import SWARM
from p2p_cocodc.config.train import FIELDS, TRAINING, TrainConfig, build_config, load_toml
from p2p_cocodc.errors import Stopped, UserError
from p2p_cocodc.swarm.agreement import split_line

if TYPE_CHECKING:  # imported where used: --help must not pay for hivemind and torch
    from p2p_cocodc.config.join import SwarmOptions
    from p2p_cocodc.ops.monitoring import PeerMetrics

SIMULATOR_ONLY = ("events", "worker_speeds")  # fields that mean nothing to a peer: not options of join


def training_options(command: Callable[..., Any] | None = None, *, peer: bool = False) -> Any:
    """One click option per TrainConfig field, all defaulting to None so the file can fill them
    (``peer``: leave out the simulator's own), and --config."""
    if command is None:
        return lambda c: training_options(c, peer=peer)
    command = schema_options(TRAINING, skip=SIMULATOR_ONLY if peer else ())(command)
    return config_option("TOML profile with the same keys; command-line values override it")(command)


def _config_from(config_path: str | None, options: dict[str, Any]) -> Any:
    file_values = load_toml(config_path) if config_path else {}
    return build_config(file_values, {k: v for k, v in options.items() if v is not None})


def _swarm_from(config_path: str | None, options: dict[str, Any]) -> SwarmOptions:
    """join's own options: the profile's [swarm] table (its region by default the profile's file
    name), then the command line."""
    from p2p_cocodc.config.join import swarm_options
    from p2p_cocodc.config.schema import read_toml
    from p2p_cocodc.config.train import SWARM_TABLE
    from p2p_cocodc.swarm.records import REGION_CHARS

    swarm_file = read_toml(config_path).get(SWARM_TABLE, {}) if config_path else {}
    stem = Path(config_path).stem if config_path is not None else ""
    if "region" not in swarm_file and 0 < len(stem) <= 32 and set(stem) <= REGION_CHARS:
        swarm_file = {**swarm_file, "region": stem}  # peers/us-east.toml: us-east
    return swarm_options(swarm_file, options, config_path)


def check_output_paths(cfg: TrainConfig) -> None:
    """Fail now, before any set-up, if --out, --save or --checkpoint-dir cannot be written, or if
    --out or --save would replace what an earlier run left there (unless --force; --resume rewrites
    its own --out): a bad path must not cost a whole run, nor a run the results of another. Missing
    parent folders are created, as the run would."""
    if cfg.out is not None:
        file = Path(cfg.out)
        if file.is_dir():
            raise UserError(f"--out {cfg.out} is a folder: give a file name")
        _check_folder(f"--out {cfg.out}", file.parent)
        if file.is_file() and not (cfg.force or cfg.resume):  # a device or pipe holds nothing to lose
            raise UserError(f"--out {cfg.out} already exists; give a new file name, or --force to replace it")
        if file.exists():
            try:
                open(file, "ab").close()  # opened for appending: not changed
            except OSError as exc:
                raise UserError(f"--out {cfg.out}: cannot write it ({exc.strerror})") from None
    if cfg.save is not None:
        from p2p_cocodc.models.saved import check_save_target

        check_save_target(cfg.save, cfg.force)
        _check_folder(f"--save {cfg.save}", Path(cfg.save).parent)
    if cfg.checkpoint_dir is not None:
        _check_folder(f"--checkpoint-dir {cfg.checkpoint_dir}", Path(cfg.checkpoint_dir))
    if cfg.log_to is not None:
        from p2p_cocodc.ops.sinks import check_sinks, log_dir

        _check_folder(f"--log-dir {log_dir(cfg)}", log_dir(cfg))
        check_sinks(cfg)


def _check_folder(what: str, folder: Path) -> None:
    """Create ``folder`` if needed and write a nameless temporary file in it, or UserError."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except FileExistsError:
        raise UserError(f"{what}: {folder} is a file, not a folder") from None
    except OSError as exc:
        raise UserError(f"{what}: cannot create the folder {folder} ({exc.strerror})") from None
    try:
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as exc:
        raise UserError(f"{what}: cannot write in {folder} ({exc.strerror})") from None


@contextmanager
def stop_on_signals() -> Iterator[Callable[[], signal.Signals | None]]:
    """While open, SIGINT and SIGTERM do not end the process: the returned function says which
    arrived, so the run can stop after its current step. A second signal acts at once, as usual."""
    received: list[signal.Signals] = []
    watched = (signal.SIGINT, signal.SIGTERM)

    def note(signum: int, frame: Any) -> None:
        received.append(signal.Signals(signum))
        for sig, handler in previous.items():
            signal.signal(sig, handler)

    previous = {sig: signal.signal(sig, note) for sig in watched}
    try:
        yield lambda: received[0] if received else None
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


class _SetUpStopped(BaseException):
    """A peer's set-up interrupted by SIGINT or SIGTERM (``peer_signals``). A BaseException, like
    KeyboardInterrupt: no ``except Exception`` of the set-up's libraries swallows it."""

    def __init__(self, sig: signal.Signals) -> None:
        super().__init__(sig.name)
        self.sig = sig


class PeerSignals:
    """A peer's SIGINT and SIGTERM outside its event loop (``Peer.run`` handles them while it runs).

    While armed (the imports, the model, the data, before the run), the first one ends the set-up
    at once: nothing is written yet, and the process exits with 128 + the signal and one line, as
    any stop before training. Once ``hand_over`` is called, they are only noted: the peer's run
    stops at once on one noted before it took the signals over (``first``), and one that comes
    after the run (its summary written, its DHT stopped) changes nothing."""

    def __init__(self) -> None:
        self.received: list[signal.Signals] = []
        self.armed = True
        self.handed_over = False

    def __call__(self, signum: int, frame: Any) -> None:
        sig = signal.Signals(signum)
        self.received.append(sig)
        if self.armed:
            self.armed = False  # a second signal while the first one unwinds the set-up: noted
            raise _SetUpStopped(sig)

    def hand_over(self) -> None:
        self.armed = False
        self.handed_over = True

    def first(self) -> signal.Signals | None:
        return self.received[0] if self.received else None


@contextmanager
def peer_signals() -> Iterator[PeerSignals]:
    """``PeerSignals`` while open. After it, once the peer has run or a signal stopped it, the
    process only has to end, and SIGINT and SIGTERM are ignored: Python's own exit (a second or so
    with torch loaded) would otherwise end by the signal, not with the exit code the run earned.
    Else (an error of the set-up, or a caller in the same process) the handlers before."""
    handler = PeerSignals()
    previous = {sig: signal.signal(sig, handler) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield handler
    except _SetUpStopped as stopped:
        sig = stopped.sig
        raise Stopped(f"stopped by {sig.name} while starting, before training", 128 + sig) from None
    finally:
        ending = handler.handed_over or handler.received
        for sig, before in previous.items():
            signal.signal(sig, signal.SIG_IGN if ending else before)


ENV_PREFIX = "P2P_COCODC"


@click.group(context_settings={"help_option_names": ["-h", "--help"], "auto_envvar_prefix": ENV_PREFIX})
@click.version_option(package_name="p2p-cocodc")
def cli() -> None:
    """Train one model across regions joined by slow links: DiLoCo, Streaming DiLoCo, CoCoDC.

    Every option may also come from the environment, as P2P_COCODC_<COMMAND>_<OPTION> (for
    example P2P_COCODC_JOIN_BOOTSTRAP=host:31338, P2P_COCODC_SIMULATE_STEPS=96), and every
    training option from a --config profile. The command line wins over the environment, and the
    environment over the profile."""


@cli.command()
@training_options
@option("--quiet", is_flag=True, help="no progress (a bar, or lines when stderr is no terminal)")
def simulate(config_path: str | None, quiet: bool, **options: Any) -> None:
    """Simulate M workers over a modelled WAN in one process (virtual clock).

    With --checkpoint-dir, SIGINT or SIGTERM stops the run after the current step with a
    checkpoint; --resume continues it bit-exactly (--out is rewritten to match)."""
    cfg = _config_from(config_path, options)
    check_output_paths(cfg)

    from p2p_cocodc.ops.progress import progress_bars
    from p2p_cocodc.ops.sinks import open_sinks
    from p2p_cocodc.run.checkpoint import CheckpointWriter, find_resume_point
    from p2p_cocodc.run.records import RunLog
    from p2p_cocodc.run.simulator import Simulation

    checkpoint = find_resume_point(cfg)
    sim = Simulation(cfg) if checkpoint is None else Simulation.resumed(cfg, checkpoint)
    resumed = f", resumed after step {sim.step} from {checkpoint.path}" if checkpoint else ""
    # a replayed swarm may have been paced: its syncs then took the paced codec
    paced = f" ({cfg.paced_wire_codec} while paced)" if cfg.events and cfg.paced_wire_codec else ""
    click.echo(
        f"{cfg.algo}: {cfg.workers} workers, {sim.num_params / 1e6:.2f} M params, T={cfg.steps} "
        f"H={cfg.inner_steps} K={cfg.fragments} τ={sim.settings.overlap} "
        f"N={sim.settings.transmissions} codec={cfg.wire_codec}{paced}{resumed}",
        err=True,
    )
    writer = None
    if cfg.checkpoint_dir is not None:
        data = sim.setup.data_sha256()
        writer = CheckpointWriter(cfg.checkpoint_dir, cfg.checkpoint_every, cfg.computing_options(), data)
    log = RunLog(cfg.out, open_sinks(cfg, cfg.algo))
    try:
        tokens_per_step = cfg.workers * cfg.batch_size * cfg.seq_len
        with progress_bars([cfg.algo], cfg.steps, tokens_per_step, quiet) as (progress,):
            progress.training(sim.step)
            if writer is None:
                summary = sim.run(log, progress=progress.step)
            else:
                with stop_on_signals() as stop:
                    summary = sim.run(log, progress=progress.step, checkpoints=writer, stop=stop)
    finally:
        log.close()
    click.echo(
        f"final val ppl {summary['final_val_ppl']:.3f} (from {summary['initial_val_ppl']:.1f}), "
        f"{summary['bytes_sent'] / 1e6:.2f} MB sent per worker, stalled {summary['stall_s']:.1f} s "
        f"of {summary['sim_time_s']:.1f} s simulated; θ̄ sha256 {summary['global_params_sha256'][:16]}"
    )
    check_saved(summary)


def check_saved(summary: dict[str, Any]) -> None:
    """A run whose --save could not be written is no success, though θ̄ went to a fallback folder."""
    if summary["save_failed"] is not None:
        where = f"θ̄ saved to {summary['saved']} instead" if summary["saved"] else "θ̄ is in no folder"
        raise UserError(f"{summary['save_failed']}; {where}")


@cli.command()
@training_options(peer=True)
@schema_options(SWARM)
@option(
    "--check",
    is_flag=True,
    help="only check that this peer can join, and exit: files, ports, p2pd, the bootstrap, and "
    "that other peers can reach this one (the bootstrap dials it back); exit code 2 names what to fix",
)
@option("--quiet", is_flag=True, help="no progress (a bar, or lines when stderr is no terminal)")
@option("--verbose", "-v", is_flag=True, help="log every round's group, leader and recovery")
def join(config_path: str | None, check: bool, quiet: bool, verbose: bool, **options: Any) -> None:
    """Join a swarm as one peer (one region) and train with the others.

    Every training option of `simulate` applies; a --config profile may also hold these join
    options in a [swarm] table (command-line values win)."""
    import logging

    from p2p_cocodc.ops.logs import configure_logging

    configure_logging(logging.INFO if verbose else logging.WARNING)
    swarm_cli = {k: options.pop(k) for k in list(options) if k in SWARM.fields}
    cfg = _config_from(config_path, options)
    if cfg.events is not None:
        raise UserError("join: --events replays a swarm run in the simulator: use it with simulate")
    if "," in cfg.inner_share:
        raise UserError(f"join: --inner-share {cfg.inner_share}: a peer takes one share, or auto; not a list")
    check_output_paths(cfg)
    opts = _swarm_from(config_path, swarm_cli)
    if check:
        sys.exit(preflight(cfg, opts))

    with peer_signals() as signals:  # SIGINT or SIGTERM during the set-up: exit at once (143, 130)
        # hivemind and torch: imported once the options are known good
        from p2p_cocodc.peer.node import Peer
        from p2p_cocodc.peer.region import Region, follow_region
        from p2p_cocodc.run.checkpoint import find_resume_point
        from p2p_cocodc.swarm.dht import check_listen_address

        region = Region.from_env(opts.region_parallel)  # under torchrun: several processes train the replica
        if region is None and opts.region_parallel != "ddp":
            raise UserError(
                f"--region-parallel {opts.region_parallel} shards the replica across a region's ranks: start "
                "the peer with torchrun --nproc-per-node G (G ≥ 2), or leave the option out"
            )
        # the process that will listen: a taken --port now, not after set-up
        if region is None or region.leads:
            check_listen_address(opts.host, opts.port, opts.port_taken())
        if region is None:
            metrics = _peer_metrics(opts)
            peer = Peer(cfg, opts, resume=find_resume_point(cfg), metrics=metrics)
            signals.hand_over()  # the peer's from here: it stops at once on one that came meanwhile
            report_peer(run_peer(peer, cfg, quiet, signals.first), cfg.steps)
            return
    # A rank of a region keeps the default handlers: torchrun's SIGTERM ends it even in a collective.
    with region.joined(cfg, asdict(opts)):
        if not region.leads:  # rank 0 speaks for the region; the others train as it says
            follow_region(cfg, region)
            return
        with region.leading():
            metrics = _peer_metrics(opts)
            peer = Peer(cfg, opts, resume=find_resume_point(cfg), region=region, metrics=metrics)
            summary = run_peer(peer, cfg, quiet)
    report_peer(summary, cfg.steps)


def report_peer(summary: dict[str, Any], steps: int) -> None:
    """A peer's last words: warnings naming the peers it refused or screened out, then one line,
    the success line only for a run that stayed with the swarm to its end; an error (exit 2) for a
    run that failed to synchronise, 128 + the signal for one that left on SIGINT or SIGTERM."""
    culprits = (
        ("left out of the mean as outliers", "outliers"),
        ("refused", "refused"),
        ("sent forged member lists", "accused"),
    )
    for what, tally in culprits:
        if summary[tally]:
            named = ", ".join(f"{peer} ({count}×)" for peer, count in summary[tally].items())
            click.echo(f"warning: {what}: {named}", err=True)
    if summary["theta_disputed"]:
        named = ", ".join(f"{peer} (after step {step})" for peer, step in summary["theta_disputed"].items())
        click.echo(f"warning: θ̄ differed between this peer and {named}", err=True)
    if summary["failure"] is not None:
        ended = "stopped after" if summary["steps"] < steps else "ran to"
        raise UserError(f"{ended} step {summary['steps']}: {summary['failure']}")
    if summary["theta_behind_step"] is not None:
        raise UserError(
            f"θ̄ after step {summary['theta_behind_step']} differs from the one a majority of the peers hold, "
            "and the run ended before this peer could take theirs: its result is not the swarm's"
        )
    if summary["theta_unsettled_step"] is not None:
        raise UserError(split_line(summary["theta_unsettled_step"], summary["theta_split"]))
    failed, done = summary["rounds_failed"], summary["rounds_done"]
    skipped = f"; {failed} of {failed + done} syncs failed and were skipped on every peer" if failed else ""
    if summary["steps"] < steps:  # it left on SIGINT or SIGTERM: a clean leave, not a finished run
        saved = f"; θ̄ saved to {summary['saved']}" if summary.get("saved") else ""
        click.echo(
            f"left the swarm after step {summary['steps']} of {steps}: val ppl "
            f"{summary['final_val_ppl']:.3f} there, {summary['bytes_sent'] / 1e6:.2f} MB sent{skipped}; "
            f"θ̄ sha256 {summary['global_params_sha256'][:16]}{saved}"
        )
        check_saved(summary)
        if summary["stopped_by"] is not None:  # by convention: 128 + the signal (130, 143)
            sys.exit(128 + signal.Signals[summary["stopped_by"]])
        return
    share = summary["sync_boundary_share"]  # sync work between steps: shown once it costs training time
    boundary = ""
    if share > 0.01:
        boundary = f", sync work between steps {summary['sync_boundary_s']:.1f} s ({share:.0%} of training)"
    facts = (
        f"final val ppl {summary['final_val_ppl']:.3f} (from {summary['initial_val_ppl']:.1f}), "
        f"{summary['bytes_sent'] / 1e6:.2f} MB sent, stalled {summary['stall_s']:.1f} s of "
        f"{summary['wall_time_s']:.1f} s{boundary}{skipped}; θ̄ sha256 {summary['global_params_sha256'][:16]}"
    )
    if summary["theta_disputed"]:
        # it ends with the majority's θ̄, yet the swarm did not hold one θ̄ throughout: no success line
        click.echo(f"finished with the majority's θ̄ after a split (see the warnings above): {facts}")
    else:
        click.echo(facts)  # only a run that stayed with the swarm, one θ̄ at every check, gets this line
    check_saved(summary)


def preflight(cfg: Any, opts: Any) -> int:
    """``join --check``: a line per check, ``ok:`` on stdout or ``error:`` on stderr; exit code 0 or 2."""
    from p2p_cocodc.ops.preflight import run_checks

    def say(passed: bool | None, line: str) -> None:
        prefix = {True: "ok", None: "note", False: "error"}[passed]
        click.echo(f"{prefix}: {line}", err=passed is False)

    if run_checks(cfg, opts, say):
        click.echo("this peer can join: run the same command without --check")
        return 0
    return 2


def _peer_metrics(opts: SwarmOptions) -> PeerMetrics | None:
    """join --metrics-port: the peer's metrics, served from now on, on --host (a port in use is
    one line before any slow set-up); None without the option."""
    if opts.metrics_port is None:
        return None
    from p2p_cocodc.ops.monitoring import serve_peer_metrics

    metrics, server = serve_peer_metrics(opts.host, opts.metrics_port)
    click.echo(f"metrics at {server.url}", err=True)
    return metrics


def run_peer(
    peer: Any, cfg: Any, quiet: bool, signalled: Callable[[], signal.Signals | None] | None = None
) -> dict[str, Any]:
    """Run a peer on a uvloop event loop, with its progress on stderr unless quiet (``signalled``:
    ``Peer.run``'s)."""
    import uvloop

    from p2p_cocodc.ops.progress import progress_bars
    from p2p_cocodc.ops.sinks import open_sinks
    from p2p_cocodc.run.records import RunLog

    opts = peer.opts  # a W&B group per run; TensorBoard and W&B runs named after the region
    log = RunLog(cfg.out, open_sinks(cfg, f"{opts.run_id}-{opts.region or f'pid{os.getpid()}'}", opts.run_id))
    try:
        with progress_bars([peer.name], cfg.steps, cfg.batch_size * cfg.seq_len, quiet) as (progress,):
            return uvloop.run(peer.run(log, progress=progress, signalled=signalled))
    finally:
        log.close()


@cli.command()
@config_option("TOML file with these options as keys; command-line values override it")
@schema_options(BOOTSTRAP)
def bootstrap(config_path: str | None, **options: Any) -> None:
    """Run the swarm's bootstrap node: the DHT address peers join through, plus a status page."""
    from p2p_cocodc.config.bootstrap import bootstrap_options
    from p2p_cocodc.config.schema import read_toml
    from p2p_cocodc.ops.bootstrap import run_bootstrap

    file_values = read_toml(config_path) if config_path else {}
    opts = bootstrap_options(file_values, options, f"--config {config_path}")
    code = run_bootstrap(opts)
    if code:
        sys.exit(code)


@cli.command()
@option(
    "--bootstrap",
    required=True,
    metavar="HOST:PORT",
    help="the bootstrap's status server: the HOST:PORT `p2p-cocodc bootstrap` printed",
)
@option("--run-id", default=None, help="show this run only", show_default="every run on the board")
@option("--once", is_flag=True, help="print the table once as plain text (as when output is not a terminal)")
@option("--refresh", type=float, default=2.0, show_default=True, help="seconds between reads of /status")
def status(bootstrap: str, run_id: str | None, once: bool, refresh: float) -> None:
    """A live table of a run's peers, from the bootstrap's notice board: region, state, step,
    tokens/s, perplexity, fragment versions, last round, bytes in and out, stall and health; above
    it, for a run whose peers are all done, how it ended (also after their records left the board).
    The same, with charts, is the bootstrap's page http://HOST:PORT/."""
    from p2p_cocodc.ops.status_view import watch_status

    watch_status(bootstrap, run_id, once, refresh)


# the training options the demo passes on to every peer's join, with join's help and defaults
DEMO_OPTIONS = (
    "algo",
    "model",
    "steps",
    "inner_steps",
    "fragments",
    "overlap",
    "eval_every",
    "eval_batches",
    "tokenizer",
    "seq_len",
    "batch_size",
    "device",
    "precision",
)


@cli.command()
@option("--workers", "peers", type=click.IntRange(1, 16), default=3, show_default=True, help="peers to start")
@schema_options(TRAINING, only=DEMO_OPTIONS)
@option(
    "--workdir",
    type=click.Path(),
    default=None,
    help="logs and records go here",
    show_default="a new temp dir",
)
@option("--quiet", is_flag=True, help="no progress (bars, or lines when stderr is no terminal)")
def demo(peers: int, workdir: str | None, quiet: bool, **training: Any) -> None:
    """A whole swarm on this machine: a bootstrap and --workers peers on 127.0.0.1, live, then results."""
    from p2p_cocodc.ops.demo import run_demo

    click.echo(run_demo(peers, training, workdir, quiet))


@cli.command()
@click.argument("path", type=click.Path(dir_okay=False))
@option("--force", is_flag=True, help="replace an existing key (holders of the old one are shut out)")
@option("--owner", is_flag=True, help="an owner key, to certify peers with `admit`, not a shared secret")
def keygen(path: str, force: bool, owner: bool) -> None:
    """Create a swarm key file: give it (over a safe channel) to every peer and the bootstrap with
    --swarm-key-file, and only they can take part in your runs. With --owner: an owner key, kept
    by you alone; you certify each peer with `p2p-cocodc admit`."""
    from p2p_cocodc.swarm.trust import keygen as write_key
    from p2p_cocodc.swarm.trust import owner_keygen

    if owner:
        owner_id = owner_keygen(path, force)
        click.echo(f"wrote owner key to {path} (mode 600, keep it to yourself); owner id {owner_id}")
        click.echo(f"give peers and the bootstrap --owner {owner_id}; certify each peer: p2p-cocodc admit")
        return
    key_id = write_key(path, force)
    click.echo(f"wrote swarm key {key_id} to {path} (mode 600); pass --swarm-key-file {path} to every peer")


@cli.command()
@click.argument("peer_id")
@option("--owner-key", required=True, metavar="FILE", help="the owner key (`keygen --owner`)")
@option("--out", required=True, metavar="FILE", help="write the certificate here")
@option("--force", is_flag=True, help="replace an existing certificate file")
def admit(peer_id: str, owner_key: str, out: str, force: bool) -> None:
    """Certify PEER_ID (what `p2p-cocodc peer-id` printed on that peer) for the runs of your owner
    key: the peer joins with --owner, --identity and --certificate."""
    from p2p_cocodc.swarm.trust import admit as certify

    owner_id = certify(owner_key, peer_id, out, force)
    click.echo(f"wrote {out}: peer {peer_id} joins with --owner {owner_id} --certificate {out}")


@cli.command("peer-id")
@click.argument("identity", type=click.Path(dir_okay=False))
def peer_id(identity: str) -> None:
    """Print the peer id of an identity file (created if missing): what the run's owner certifies."""
    from p2p_cocodc.swarm.trust import ensure_identity

    click.echo(ensure_identity(identity).peer_id)


@cli.command()
@click.argument("runs", nargs=-1, required=True, type=click.Path())
@option(
    "--target-ppl",
    type=float,
    default=None,
    help="perplexity to reach",
    show_default="the worst final perplexity among the runs",
)
@option("--plot", "plot_path", type=click.Path(), default=None, help="write a PNG here")
def compare(runs: tuple[str, ...], target_ppl: float | None, plot_path: str | None) -> None:
    """Compare runs: final perplexity, steps and time to a target perplexity, bytes."""
    from p2p_cocodc.ops.compare import compare_runs

    click.echo(compare_runs(list(runs), target_ppl, plot_path))


MODEL_DEVICE = "where the model runs: auto (the first CUDA device if any, else the CPU), cpu, cuda:N, mps"


@cli.command()
@click.argument("model", metavar="MODEL", type=click.Path())
@option("--prompt", required=True, help="the text for the model to continue")
@option("--max-new-tokens", type=click.IntRange(1), default=100, show_default=True, help="tokens to add")
@option(
    "--temperature",
    type=click.FloatRange(0),
    default=0.8,
    show_default=True,
    help="sampling temperature; 0: greedy, always the likeliest token",
)
@option("--top-k", type=click.IntRange(0), default=50, show_default=True, help="draw among the top K; 0: all")
@option(
    "--seed",
    type=click.IntRange(0),
    default=None,
    help="seed of the sampling: one seed, one text",
    show_default="a new one each time",
)
@option("--device", default="auto", show_default=True, help=MODEL_DEVICE)
def generate(
    model: str,
    prompt: str,
    max_new_tokens: int,
    temperature: float,
    top_k: int,
    seed: int | None,
    device: str,
) -> None:
    """Continue --prompt with MODEL, a folder `--save` wrote; print the prompt and its continuation."""
    import torch

    from p2p_cocodc.algorithms.devices import resolve_device
    from p2p_cocodc.models.inference import generate as continue_text
    from p2p_cocodc.models.saved import load_saved

    where = resolve_device(device)
    lm, tokenizer, info = load_saved(model)
    generator = torch.Generator()
    if seed is None:
        generator.seed()
    else:
        generator.manual_seed(seed)
    text = continue_text(
        lm.to(where),
        tokenizer,
        prompt,
        max_new_tokens=max_new_tokens,
        temperature=temperature,
        top_k=top_k,
        generator=generator,
        context=info["seq_len"],
        device=where,
    )
    click.echo(text)


@cli.command("eval")
@click.argument("model", metavar="MODEL", type=click.Path())
@option(
    "--data",
    type=click.Path(),
    metavar="PATH",
    default=None,
    help="UTF-8 text file or folder of .txt files; its validation split is scored, split as a run splits it",
    show_default="the data MODEL was trained on",
)
@option(
    "--batches",
    type=click.IntRange(1),
    default=None,
    help="batches to score",
    show_default="the run's --eval-batches",
)
@option(
    "--seq-len",
    type=click.IntRange(1),
    default=None,
    help="tokens per sequence, at most the run's",
    show_default="the run's --seq-len",
)
@option("--device", default="auto", show_default=True, help=MODEL_DEVICE)
def eval_model(model: str, data: str | None, batches: int | None, seq_len: int | None, device: str) -> None:
    """Score MODEL, a folder `--save` wrote: its loss and perplexity on the validation split of
    --data, in the run's batches (on the run's own data: the run's final perplexity)."""
    from p2p_cocodc.algorithms.devices import Placement, resolve_device
    from p2p_cocodc.models.inference import evaluate_text
    from p2p_cocodc.models.saved import load_saved
    from p2p_cocodc.run.records import perplexity

    placement_device = resolve_device(device)
    lm, tokenizer, info = load_saved(model)
    run = info["run"]
    options = {name: f.default for name, f in FIELDS.items()} | run.get("options", {})
    if seq_len is not None and seq_len > info["seq_len"]:
        raise UserError(f"--seq-len {seq_len}: {model} was trained on sequences of {info['seq_len']} tokens")
    if data is None and run.get("data") is not None and not Path(run["data"]).exists():
        raise UserError(f"{model} was trained on {run['data']}, which is not there any more: give --data")
    data = data if data is not None else run.get("data")
    seq_len = seq_len or info["seq_len"]
    batches = batches or options["eval_batches"]
    placement = Placement(placement_device, options["precision"])
    batch_size = options["batch_size"]
    loss, tokens = evaluate_text(
        lm, tokenizer, data, seq_len=seq_len, batch_size=batch_size, batches=batches, placement=placement
    )
    where = "the embedded corpus" if data is None else data
    click.echo(
        f"val loss {loss:.6f}, perplexity {perplexity(loss):.4f} on {tokens} tokens of the validation split "
        f"of {where}"
    )


def main(args: Sequence[str] | None = None) -> None:
    """Entry point: bad input ends with one line that says what to fix, never a bare traceback.
    ``args``: the command line after the program's name (default: ``sys.argv[1:]``)."""
    try:
        cli.main(args=args, standalone_mode=False)
    except UserError as exc:
        click.echo(f"error: {exc}", err=True)
        sys.exit(2)
    except Stopped as exc:
        click.echo(str(exc), err=True)
        sys.exit(exc.exit_code)
    except click.exceptions.Abort:
        click.echo("interrupted", err=True)
        sys.exit(130)
    except click.ClickException as exc:
        exc.show()
        sys.exit(exc.exit_code)
    except KeyboardInterrupt:
        click.echo("interrupted", err=True)
        sys.exit(130)
