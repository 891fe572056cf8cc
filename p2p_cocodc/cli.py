"""The ``p2p-cocodc`` command line. Option names are a contract: scripts outside the project use them."""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import click

from p2p_cocodc.config import FIELDS, build_config, load_toml
from p2p_cocodc.errors import UserError


def training_options(command: Callable[..., Any]) -> Callable[..., Any]:
    """One click option per TrainConfig field, all defaulting to None so the file can fill them."""
    for name, f in reversed(FIELDS.items()):
        flag = "--" + name.replace("_", "-")
        help_text = f"{f.metadata['help']} [default: {f.default}]"
        if str(f.type).startswith("bool"):
            command = click.option(f"{flag}/--no-{flag[2:]}", name, default=None, help=help_text)(command)
        else:
            command = click.option(flag, name, default=None, help=help_text, metavar=_metavar(f))(command)
    return click.option(
        "--config",
        "config_path",
        type=click.Path(),
        default=None,
        help="TOML file with the same keys; command-line values override it",
    )(command)


def _metavar(f: Any) -> str:
    if f.metadata["choices"]:
        return "[" + "|".join(f.metadata["choices"]) + "]"
    kind = str(f.type).split(" |")[0].upper()
    return kind + ("|auto" if f.metadata["auto"] else "")


def _config_from(config_path: str | None, options: dict[str, Any]) -> Any:
    file_values = load_toml(config_path) if config_path else {}
    return build_config(file_values, {k: v for k, v in options.items() if v is not None})


@click.group()
@click.version_option(package_name="p2p-cocodc")
def cli() -> None:
    """Train one model across regions joined by slow links: DiLoCo, Streaming DiLoCo, CoCoDC."""


@cli.command()
@training_options
@click.option("--quiet", is_flag=True, help="no progress bar")
def simulate(config_path: str | None, quiet: bool, **options: Any) -> None:
    """Simulate M workers over a modelled WAN in one process (virtual clock)."""
    from p2p_cocodc.metrics import RunLog
    from p2p_cocodc.progress import ProgressBar
    from p2p_cocodc.sim import Simulation

    cfg = _config_from(config_path, options)
    sim = Simulation(cfg)
    click.echo(
        f"{cfg.algo}: {cfg.workers} workers, {sim.num_params / 1e6:.2f} M params, T={cfg.steps} "
        f"H={cfg.inner_steps} K={cfg.fragments} τ={sim.settings.overlap} "
        f"N={sim.settings.transmissions} codec={cfg.codec}",
        err=True,
    )
    log = RunLog(cfg.out)
    try:
        with ProgressBar(cfg.steps, disable=quiet) as bar:
            summary = sim.run(log, progress=bar.update)
    finally:
        log.close()
    click.echo(
        f"final val ppl {summary['final_val_ppl']:.3f} (from {summary['initial_val_ppl']:.1f}), "
        f"{summary['bytes_sent'] / 1e6:.2f} MB sent per worker, stalled {summary['stall_s']:.1f} s "
        f"of {summary['sim_time_s']:.1f} s simulated; θ̄ sha256 {summary['global_params_sha256'][:16]}"
    )


@cli.command()
@training_options
@click.option("--bootstrap", required=True, help="bootstrap multiaddr, or the HOST:PORT it printed")
@click.option("--run-id", default="default", show_default=True, help="runs sharing one DHT stay apart")
@click.option("--host", default="127.0.0.1", show_default=True, help="address this peer listens on")
@click.option("--port", type=int, default=0, show_default=True, help="libp2p port (0: any free one)")
@click.option("--announce", default=None, help="address other peers dial (default: --host)")
@click.option("--shard", default=None, metavar="I/N", help="read data shard I of N (default: by peer id)")
@click.option(
    "--wait-peers", type=float, default=300.0, show_default=True, help="seconds to wait for --workers peers"
)
@click.option(
    "--round-timeout",
    type=float,
    default=60.0,
    show_default=True,
    help="seconds a sync may take beyond what measured step times predict",
)
@click.option("--quiet", is_flag=True, help="no progress bar")
def join(
    config_path: str | None,
    bootstrap: str,
    run_id: str,
    host: str,
    port: int,
    announce: str | None,
    shard: str | None,
    wait_peers: float,
    round_timeout: float,
    quiet: bool,
    **options: Any,
) -> None:
    """Join a swarm as one peer (one region) and train with the others."""
    from p2p_cocodc.peer import Peer, SwarmOptions, parse_shard

    cfg = _config_from(config_path, options)
    opts = SwarmOptions(
        bootstrap=bootstrap,
        run_id=run_id,
        host=host,
        port=port,
        announce=announce,
        shard=parse_shard(shard) if shard is not None else None,
        wait_peers_s=wait_peers,
        round_timeout_s=round_timeout,
    )
    summary = run_peer(Peer(cfg, opts), cfg, quiet)
    click.echo(
        f"final val ppl {summary['final_val_ppl']:.3f} (from {summary['initial_val_ppl']:.1f}), "
        f"{summary['bytes_sent'] / 1e6:.2f} MB sent, stalled {summary['stall_s']:.1f} s of "
        f"{summary['wall_time_s']:.1f} s; θ̄ sha256 {summary['global_params_sha256'][:16]}"
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
@click.argument("runs", nargs=-1, required=True, type=click.Path())
@click.option(
    "--target-ppl",
    type=float,
    default=None,
    help="perplexity to reach (default: the worst final perplexity among the runs)",
)
@click.option("--plot", "plot_path", type=click.Path(), default=None, help="write a PNG here")
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
    except click.exceptions.Abort:
        click.echo("interrupted", err=True)
        sys.exit(130)
    except click.ClickException as exc:
        exc.show()
        sys.exit(exc.exit_code)
    except KeyboardInterrupt:
        click.echo("interrupted", err=True)
        sys.exit(130)
