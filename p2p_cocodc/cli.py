"""The ``p2p-cocodc`` command line. Option names are a contract: scripts outside the project use them."""

from __future__ import annotations

import signal
import sys
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict
from pathlib import Path
from typing import Any

import click

from p2p_cocodc.config import FIELDS, TrainConfig, build_config, load_toml
from p2p_cocodc.errors import Stopped, UserError
from p2p_cocodc.names import HF_PREFIX


class Option(click.Option):
    """click's option, but a default stated in words reads as it is written (click wraps it in
    parentheses), so that every default in --help reads ``[default: …]``."""

    def get_help_extra(self, ctx: click.Context) -> Any:
        extra = super().get_help_extra(ctx)
        if isinstance(self.show_default, str):
            extra["default"] = self.show_default
        return extra


def option(*names: str, **kwargs: Any) -> Callable[..., Any]:
    return click.option(*names, cls=Option, **kwargs)


SIMULATOR_ONLY = ("events",)  # fields that mean nothing to a peer: not options of join


def training_options(command: Callable[..., Any] | None = None, *, peer: bool = False) -> Any:
    """One click option per TrainConfig field, all defaulting to None so the file can fill them
    (``peer``: leave out the simulator's own)."""
    if command is None:
        return lambda c: training_options(c, peer=peer)
    for name, f in reversed(FIELDS.items()):
        if peer and name in SIMULATOR_ONLY:
            continue
        flag = "--" + name.replace("_", "-")
        shown = {"help": f.metadata["help"], "show_default": f.metadata["shown"]}
        if str(f.type).startswith("bool"):
            command = option(f"{flag}/--no-{flag[2:]}", name, default=None, **shown)(command)
        else:
            command = option(flag, name, default=None, metavar=_metavar(f), **shown)(command)
    return option(
        "--config",
        "config_path",
        type=click.Path(dir_okay=False),
        default=None,
        help="TOML profile with the same keys; command-line values override it",
    )(command)


# click's own names for its types, so that every option of every command reads alike
METAVARS = {"int": "INTEGER", "float": "FLOAT", "str": "TEXT"}


def _metavar(f: Any) -> str:
    if f.metadata["choices"]:
        return "[" + "|".join(f.metadata["choices"]) + "]"
    if f.metadata["path"]:
        return f.metadata["path"]
    kind = METAVARS[str(f.type).split(" |")[0]]
    return kind + ("|auto" if f.metadata["auto"] else "")


def _config_from(config_path: str | None, options: dict[str, Any]) -> Any:
    file_values = load_toml(config_path) if config_path else {}
    return build_config(file_values, {k: v for k, v in options.items() if v is not None})


def check_output_paths(cfg: TrainConfig) -> None:
    """Fail now, before any set-up, if --out, --save or --checkpoint-dir cannot be written: a bad
    path must not cost a whole run. Missing parent folders are created, as the run would."""
    for option, path in (("--out", cfg.out), ("--save", cfg.save)):
        if path is not None:
            file = Path(path)
            if option == "--save" and cfg.model.startswith(HF_PREFIX):  # saved as a folder
                from p2p_cocodc.hf import check_save_folder

                check_save_folder(path)
                _check_folder(f"{option} {path}", file.parent)
                continue
            if file.is_dir():
                raise UserError(f"{option} {path} is a folder: give a file name")
            _check_folder(f"{option} {path}", file.parent)
            if file.exists():
                try:
                    open(file, "ab").close()  # opened for appending: not changed
                except OSError as exc:
                    raise UserError(f"{option} {path}: cannot write it ({exc.strerror})") from None
    if cfg.checkpoint_dir is not None:
        _check_folder(f"--checkpoint-dir {cfg.checkpoint_dir}", Path(cfg.checkpoint_dir))


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
@option("--quiet", is_flag=True, help="no progress bar")
def simulate(config_path: str | None, quiet: bool, **options: Any) -> None:
    """Simulate M workers over a modelled WAN in one process (virtual clock).

    With --checkpoint-dir, SIGINT or SIGTERM stops the run after the current step with a
    checkpoint; --resume continues it bit-exactly (--out is rewritten to match)."""
    cfg = _config_from(config_path, options)
    check_output_paths(cfg)

    from p2p_cocodc.checkpoint import CheckpointWriter, find_resume_point
    from p2p_cocodc.metrics import RunLog
    from p2p_cocodc.progress import ProgressBar
    from p2p_cocodc.sim import Simulation

    checkpoint = find_resume_point(cfg)
    sim = Simulation(cfg) if checkpoint is None else Simulation.resumed(cfg, checkpoint)
    resumed = f", resumed after step {sim.step} from {checkpoint.path}" if checkpoint else ""
    click.echo(
        f"{cfg.algo}: {cfg.workers} workers, {sim.num_params / 1e6:.2f} M params, T={cfg.steps} "
        f"H={cfg.inner_steps} K={cfg.fragments} τ={sim.settings.overlap} "
        f"N={sim.settings.transmissions} codec={cfg.codec}{resumed}",
        err=True,
    )
    writer = None
    if cfg.checkpoint_dir is not None:
        data = sim.setup.data_sha256()
        writer = CheckpointWriter(cfg.checkpoint_dir, cfg.checkpoint_every, cfg.computing_options(), data)
    log = RunLog(cfg.out)
    try:
        with ProgressBar(cfg.steps, disable=quiet) as bar:
            if writer is None:
                summary = sim.run(log, progress=bar.update)
            else:
                with stop_on_signals() as stop:
                    summary = sim.run(log, progress=bar.update, checkpoints=writer, stop=stop)
    finally:
        log.close()
    click.echo(
        f"final val ppl {summary['final_val_ppl']:.3f} (from {summary['initial_val_ppl']:.1f}), "
        f"{summary['bytes_sent'] / 1e6:.2f} MB sent per worker, stalled {summary['stall_s']:.1f} s "
        f"of {summary['sim_time_s']:.1f} s simulated; θ̄ sha256 {summary['global_params_sha256'][:16]}"
    )


@cli.command()
@training_options(peer=True)
@option("--bootstrap", default=None, help="bootstrap multiaddr, or the HOST:PORT it printed")
@option("--run-id", default=None, help="runs sharing one DHT stay apart", show_default="default")
@option("--host", default=None, metavar="HOST", help="address this peer listens on", show_default="127.0.0.1")
@option("--port", type=int, default=None, help="libp2p port", show_default="0, any free one")
@option("--announce", default=None, metavar="HOST", help="address other peers dial", show_default="--host")
@option("--shard", default=None, metavar="I/N", help="read data shard I of N", show_default="a free one")
@option(
    "--identity",
    default=None,
    metavar="FILE",
    help="private key file, created if missing: a restarted peer keeps its id",
    show_default="a new id each run",
)
@option(
    "--swarm-key-file",
    default=None,
    metavar="FILE",
    help="admit only holders of this key (made by `p2p-cocodc keygen`)",
    show_default="an open run",
)
@option(
    "--owner",
    default=None,
    metavar="OWNER_ID",
    help="admit only peers certified by this owner (the id `p2p-cocodc keygen --owner` printed)",
)
@option(
    "--certificate",
    default=None,
    metavar="FILE",
    help="with --owner: this peer's certificate (from the owner's `p2p-cocodc admit`; needs --identity)",
)
@option(
    "--wait-peers", type=float, default=None, help="seconds to wait for --workers peers", show_default="300"
)
@option(
    "--round-timeout",
    type=float,
    default=None,
    help="seconds a sync may take beyond what measured step times predict",
    show_default="60",
)
@option(
    "--pace",
    type=click.Choice(["link", "fixed"]),
    default=None,
    help="link: when this peer's link cannot carry cocodc's sends, ask the swarm to send less "
    "(every peer takes the pace a round agreed); fixed: never ask",
    show_default="link",
)
@option("--quiet", is_flag=True, help="no progress bar")
@option("--verbose", "-v", is_flag=True, help="log every round's group, leader and recovery")
def join(config_path: str | None, quiet: bool, verbose: bool, **options: Any) -> None:
    """Join a swarm as one peer (one region) and train with the others.

    Every training option of `simulate` applies; a --config profile may also hold these join
    options in a [swarm] table (command-line values win)."""
    import logging

    from p2p_cocodc.config import SWARM_TABLE, read_toml
    from p2p_cocodc.logs import configure_logging

    configure_logging(logging.INFO if verbose else logging.WARNING)
    swarm_cli = {k: options.pop(k) for k in list(options) if k not in FIELDS}
    cfg = _config_from(config_path, options)
    if cfg.events is not None:
        raise UserError("join: --events replays a swarm run in the simulator: use it with simulate")
    check_output_paths(cfg)

    from p2p_cocodc.checkpoint import find_resume_point
    from p2p_cocodc.peer import Peer, swarm_options  # hivemind: imported once the options are known good
    from p2p_cocodc.region import Region, follow_region

    swarm_file = read_toml(config_path).get(SWARM_TABLE, {}) if config_path else {}
    opts = swarm_options(swarm_file, swarm_cli)
    region = Region.from_env()  # under torchrun: this region's replica is trained by several processes
    if region is None:
        summary = run_peer(Peer(cfg, opts, resume=find_resume_point(cfg)), cfg, quiet)
    else:
        with region.joined(cfg, asdict(opts)):
            if not region.leads:  # rank 0 speaks for the region; the others train as it says
                follow_region(cfg, region)
                return
            with region.leading():
                summary = run_peer(Peer(cfg, opts, resume=find_resume_point(cfg), region=region), cfg, quiet)
    culprits = (
        ("left out of the mean as outliers", "outliers"),
        ("refused", "refused"),
        ("sent forged member lists", "accused"),
    )
    for what, tally in culprits:
        if summary[tally]:
            named = ", ".join(f"{peer} ({count}×)" for peer, count in summary[tally].items())
            click.echo(f"warning: {what}: {named}", err=True)
    if summary["failure"] is not None:
        raise UserError(f"stopped after step {summary['steps']}: {summary['failure']}")
    if summary["theta_behind_step"] is not None:
        raise UserError(
            f"θ̄ after step {summary['theta_behind_step']} differs from the one a majority of the peers hold, "
            "and the run ended before this peer could take theirs: its result is not the swarm's"
        )
    if summary["theta_unsettled_step"] is not None:
        raise UserError(
            f"θ̄ after step {summary['theta_unsettled_step']} differs between this peer and "
            f"{', '.join(summary['theta_disputed'])}, and no majority of the peers tells which one is the "
            "swarm's: this run did not stay synchronised"
        )
    failed, done = summary["rounds_failed"], summary["rounds_done"]
    skipped = f"; {failed} of {failed + done} syncs failed and were skipped on every peer" if failed else ""
    click.echo(  # only a run that stayed with the swarm to its end gets this line
        f"final val ppl {summary['final_val_ppl']:.3f} (from {summary['initial_val_ppl']:.1f}), "
        f"{summary['bytes_sent'] / 1e6:.2f} MB sent, stalled {summary['stall_s']:.1f} s of "
        f"{summary['wall_time_s']:.1f} s{skipped}; θ̄ sha256 {summary['global_params_sha256'][:16]}"
    )


def run_peer(peer: Any, cfg: Any, quiet: bool) -> dict[str, Any]:
    """Run a peer on a uvloop event loop, with a progress bar unless quiet."""
    import uvloop

    from p2p_cocodc.metrics import RunLog
    from p2p_cocodc.progress import ProgressBar

    log = RunLog(cfg.out)
    try:
        with ProgressBar(cfg.steps, disable=quiet) as bar:
            return uvloop.run(peer.run(log, progress=bar.update))
    finally:
        log.close()


@cli.command()
@option(
    "--identity",
    default="bootstrap.id",
    show_default=True,
    help="private key file, created on first run; keeps the peer id (and so the join address) stable",
)
@option("--host", default="127.0.0.1", show_default=True, help="address to listen on (0.0.0.0: all)")
@option(
    "--port",
    type=int,
    default=31337,
    show_default=True,
    help="libp2p port; fixed so restarts keep the address",
)
@option("--announce", default=None, metavar="HOST", help="public address peers dial", show_default="--host")
@option(
    "--address-file", default="bootstrap.json", show_default=True, help="write the join addresses here (JSON)"
)
@option(
    "--status-host", default=None, metavar="HOST", help="address of the HTTP server", show_default="--host"
)
@option(
    "--status-port",
    type=int,
    default=31338,
    show_default=True,
    help="HTTP port serving /address (for join --bootstrap HOST:PORT), /status and /health",
)
@option("--refresh", type=float, default=1.0, show_default=True, help="seconds between reads of swarm status")
@option(
    "--swarm-key-file",
    default=None,
    metavar="FILE",
    help="accept records only from holders of this key (made by `p2p-cocodc keygen`)",
    show_default="open",
)
@option(
    "--owner",
    default=None,
    metavar="OWNER_ID",
    help="accept records only from peers this owner certified (`p2p-cocodc keygen --owner`)",
)
def bootstrap(
    identity: str,
    host: str,
    port: int,
    announce: str | None,
    address_file: str,
    status_host: str | None,
    status_port: int,
    refresh: float,
    swarm_key_file: str | None,
    owner: str | None,
) -> None:
    """Run the swarm's bootstrap node: the DHT address peers join through, plus a status page."""
    from p2p_cocodc.bootstrap import BootstrapOptions, run_bootstrap

    opts = BootstrapOptions(
        identity=identity,
        host=host,
        port=port,
        announce=announce,
        address_file=address_file,
        status_host=status_host,
        status_port=status_port,
        refresh_s=refresh,
        swarm_key_file=swarm_key_file,
        owner=owner,
    )
    code = run_bootstrap(opts)
    if code:
        sys.exit(code)


def _demo_option(name: str, default: Any = None, **kwargs: Any) -> Callable[..., Any]:
    """A join option the demo passes through: join's help text; default None means join's default."""
    f = FIELDS[name]
    shown = default if default is not None else f.metadata["shown"]
    if f.metadata["choices"]:
        kwargs["type"] = click.Choice(f.metadata["choices"])
    return option(
        "--" + name.replace("_", "-"),
        name,
        default=default,
        metavar=_metavar(f),
        help=f.metadata["help"],
        show_default=str(shown),
        **kwargs,
    )


@cli.command()
@option("--workers", "peers", type=click.IntRange(1, 16), default=3, show_default=True, help="peers to start")
@_demo_option("algo", "cocodc")
@_demo_option("model", "micro")
@_demo_option("steps", 192, type=int)
@_demo_option("inner_steps", 48, type=int)
@_demo_option("fragments", 4, type=int)
@_demo_option("overlap")
@_demo_option("eval_every", 24, type=int)
@_demo_option("eval_batches", type=int)
@_demo_option("tokenizer")
@_demo_option("seq_len", type=int)
@_demo_option("batch_size", type=int)
@_demo_option("device")
@_demo_option("precision")
@option(
    "--workdir",
    type=click.Path(),
    default=None,
    help="logs and records go here",
    show_default="a new temp dir",
)
@option("--quiet", is_flag=True, help="no live progress bars")
def demo(peers: int, workdir: str | None, quiet: bool, **training: Any) -> None:
    """A whole swarm on this machine: a bootstrap and --workers peers on 127.0.0.1, live, then results."""
    from p2p_cocodc.demo import run_demo

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
    from p2p_cocodc.compare import compare_runs

    click.echo(compare_runs(list(runs), target_ppl, plot_path))


def main() -> None:
    """Entry point: bad input ends with one line that says what to fix, never a bare traceback."""
    try:
        cli.main(standalone_mode=False)
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
