"""The fleet's users (``user``: credentials of their own, issue 49, :mod:`tasks.ops.users`), their
caps (``cap``: :mod:`tasks.core.caps`) and what they used (``usage``: :mod:`tasks.ops.usage`)."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import click

from ..core.caps import parse_limits, read_cap_uses, remove_cap, set_cap, set_team
from ..core.errors import EXIT_CONFIG, ConfigError, DeviceFleetError
from ..core.registry import connect, reading
from ..ops.usage import parse_since, read_fleet_usage, usage_lines
from ..ops.users import add_user, list_users, remove_user
from .helpers import console, fail, load_settings


@click.group()
def user() -> None:
    """The fleet's users, each with credentials of their own (run by the fleet's admin)."""


@user.command("add")
@click.argument("name")
@click.option("--team", default=None, help="The team (a named set of users) the user is in.")
@click.option("--output", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="Where to write the credentials file (mode 0600). Default: ./credentials-NAME.json.")
def user_add(name: str, team: str | None, output: Path | None) -> None:
    """Add user NAME (new credentials if NAME exists: the old ones stop working)."""
    settings = load_settings()
    output = output or Path(f"credentials-{name}.json")
    url = settings.resolve_redis_url()
    client = connect(url)
    try:
        credentials = add_user(client, url, name, team=team, output=output)
    finally:
        client.close()
    console.print(f"added user {credentials.user}" + (f" (team {team})" if team else "")
                  + f"; credentials in {output} (mode 0600). Give them the file: their producer finds it at "
                  f"~/.config/devicefleet/credentials.json, or with DEVICEFLEET_CREDENTIALS=<file>.", highlight=False)


@user.command("remove")
@click.argument("name")
def user_remove(name: str) -> None:
    """Remove user NAME: their credentials stop working at once."""
    url = load_settings().resolve_redis_url()
    client = connect(url)
    try:
        removed = remove_user(client, name, url)
    finally:
        client.close()
    if not removed:
        fail(ConfigError(f"no user {name!r} on this fleet: `devicefleet user list` shows who is"), EXIT_CONFIG)
    console.print(f"removed user {name}", highlight=False)


@user.command("list")
def user_list() -> None:
    """The fleet's users: name, team, when added."""
    client = connect(load_settings().resolve_redis_url())
    try:
        users = list_users(client)
    finally:
        client.close()
    if not users:
        console.print("no users: every job is sent with the fleet's own password (`devicefleet user add NAME`)",
                      highlight=False)
    for info in users:
        added = time.strftime("%Y-%m-%d %H:%M", time.gmtime(info.added_at))
        state = "" if info.acl_user else "  (no Redis user: `devicefleet user add` it again)"
        console.print(f"{info.user}\tteam={info.team or '-'}\tadded {added} UTC{state}", highlight=False)


@click.group()
def cap() -> None:
    """Caps on the devices of each kind a user or team holds at once (fleet-wide, live)."""


def _cap_client(redis_url: str | None) -> Any:
    return reading(load_settings(redis_url=redis_url).resolve_redis_url())


@cap.command("set")
@click.argument("args", nargs=-1, required=True, metavar="[USER] KIND=DEVICES...")
@click.option("--team", help="Cap this team (named with `devicefleet cap team`) instead of a user.")
@click.option("--borrow/--no-borrow", default=False, show_default=True,
              help="Over the cap, run on devices no one else wants, as preemptible work.")
@click.option("--redis-url", help="Fleet to use (default: DEVICEFLEET_REDIS_URL, else the local fleet).")
def cap_set(args: tuple[str, ...], team: str | None, borrow: bool, redis_url: str | None) -> None:
    """Set USER's (or --team's) cap, e.g. `devicefleet cap set alice gpu=4 --borrow`."""
    user, items = (None, list(args)) if team is not None else (args[0], list(args[1:]))
    try:
        limits = parse_limits(items)
    except DeviceFleetError as exc:  # refused before anything is written
        fail(exc, EXIT_CONFIG)
    with _cap_client(redis_url) as client:
        set_cap(client, limits, user=user, team=team, borrow=borrow)
    name = f"team {team}" if team is not None else user
    for kind, limit in limits.items():
        click.echo(f"{name}: at most {limit} {kind} at once, borrowing {'on' if borrow else 'off'}")


@cap.command("team")
@click.argument("team")
@click.argument("users", nargs=-1, required=True)
@click.option("--redis-url", help="Fleet to use (default: DEVICEFLEET_REDIS_URL, else the local fleet).")
def cap_team(team: str, users: tuple[str, ...], redis_url: str | None) -> None:
    """Name TEAM's USERS (a team's cap counts their devices together)."""
    with _cap_client(redis_url) as client:
        cap_record = set_team(client, team, list(users))
    click.echo(f"team {team}: {', '.join(cap_record.members or [])}")


@cap.command("remove")
@click.argument("user", required=False)
@click.option("--team", help="Remove this team and its cap instead.")
@click.option("--redis-url", help="Fleet to use (default: DEVICEFLEET_REDIS_URL, else the local fleet).")
def cap_remove(user: str | None, team: str | None, redis_url: str | None) -> None:
    """Remove USER's cap (or --team with its cap)."""
    with _cap_client(redis_url) as client:
        remove_cap(client, user=user, team=team)


@cap.command("list")
@click.option("--json", "as_json", is_flag=True, help="Print the caps and what each holds as JSON.")
@click.option("--redis-url", help="Fleet to use (default: DEVICEFLEET_REDIS_URL, else the local fleet).")
def cap_list(as_json: bool, redis_url: str | None) -> None:
    """Each cap and what it holds now: `alice: 4/4 gpu (cap), borrowing off`."""
    with _cap_client(redis_url) as client:
        caps, uses = read_cap_uses(client)
    if as_json:
        click.echo(json.dumps({"caps": {subject: c.to_dict() for subject, c in caps.items()},
                               "held": [{"subject": u.subject, "kind": u.kind, "held": u.held, "limit": u.limit,
                                         "borrow": u.borrow, "line": u.line()} for u in uses]}, indent=2))
        return
    for use in uses:
        click.echo(use.line())
    for subject, c in caps.items():
        if c.members is not None:
            click.echo(f"team {subject.removeprefix('team:')}: {', '.join(c.members)}")
    if not caps:
        click.echo("no caps set (devicefleet cap set USER KIND=DEVICES)")


@click.command()
@click.option("--since", default=None, metavar="AGE", help="Only the last AGE, e.g. 7d, 12h (default: ever).")
@click.option("--json", "as_json", is_flag=True, help="Print each row as JSON.")
@click.option("--redis-url", help="Fleet to use (default: DEVICEFLEET_REDIS_URL, else the local fleet).")
def usage(since: str | None, as_json: bool, redis_url: str | None) -> None:
    """Per user and team: device-hours held, the device's busy fraction while held, held idle."""
    try:
        since_s = parse_since(since) if since is not None else None
    except DeviceFleetError as exc:
        fail(exc, EXIT_CONFIG)
    with _cap_client(redis_url) as client:
        rows = read_fleet_usage(client, since_s)
    if as_json:
        click.echo(json.dumps([row.to_dict() for row in rows], indent=2))
        return
    for line in usage_lines(rows) or ["no jobs counted" + (f" in the last {since}" if since else "")]:
        click.echo(line)
