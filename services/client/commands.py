"""What each client subcommand prints: aligned tables for people, `--json` for scripts."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Sequence
from datetime import UTC, datetime, timedelta
from typing import Any
from urllib.parse import quote, urlencode

from rankscope.services.client.http import ClientError, Gateway
from rankscope.services.client.verdicts import finding_lines, pace_lines, verdicts
from rankscope.shared.subjects import token
from rankscope.shared.timestamps import format_ts
from rankscope.shared.wire import FindingKind

__all__ = ["add_client_commands", "client_options", "identifier", "ranktable_client"]


def table(rows: Sequence[Sequence[Any]], header: Sequence[str]) -> str:
    """Rows as aligned columns under a header."""
    cells = [[str(c) for c in header]] + [["" if c is None else str(c) for c in r] for r in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(header))]
    return "\n".join(
        "  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in cells
    )


def _out(args: argparse.Namespace, data: Any, text: str) -> None:
    print(json.dumps(data, indent=2) if args.json else text)


def _timeline(args: argparse.Namespace, gateway: Gateway) -> None:
    params = "?" + urlencode(
        {"limit": args.limit, **({"instanceId": args.instance} if args.instance else {})}
    )
    seen = ""
    while True:
        found = gateway.call("GET", "/v1/cluster/timeline" + params)
        entries = [e for e in found["timeline"] if e["at"] > seen]
        if args.json:
            print(
                json.dumps(found if not args.follow else entries, indent=None if args.follow else 2)
            )
        else:
            if not seen:
                said = _verdicts(gateway)
                print(
                    table(
                        [
                            (
                                r["deviceRank"],
                                r["nodeId"],
                                r["statusKind"],
                                r["phase"],
                                round(r["secondsInPhase"], 1),
                                r["activeCommandId"],
                                said.get(r["runnerId"]),
                            )
                            for r in found["runners"]
                        ],
                        ["RANK", "NODE", "STATUS", "PHASE", "SECONDS", "COMMAND", "DIAGNOSIS"],
                    )
                    + "\n",
                    flush=True,
                )
            for e in entries:
                step = e["attrs"].get("step", "")
                print(
                    f"{e['at']}  rank {e['deviceRank']} {e['nodeId']:<10} "
                    f"{e['phase']:<24} {e['event']:<20} {step}"
                )
            for u in found["unreachableNodes"]:
                print(f"unreachable: {u['nodeId']}: {u['error']}", file=sys.stderr)
        if not args.follow:
            return
        seen = entries[-1]["at"] if entries else seen
        time.sleep(1)


def _verdicts(gateway: Gateway) -> dict[str, str]:
    """The diagnosis' word on each rank it names (none, said on stderr, when it cannot
    be had)."""
    try:
        return verdicts(gateway.call("GET", "/v1/cluster/diagnosis")["findings"])
    except ClientError as error:
        print(f"rankscope: no diagnosis beside the ranks: {error}", file=sys.stderr)
        return {}


def _placement(args: argparse.Namespace, gateway: Gateway) -> None:
    found = gateway.call("GET", "/v1/placement/runners")
    if args.pid is not None:
        instance, rank = args.pid
        ranks = [p for p in found if (p.get("instanceId"), p["deviceRank"]) == (instance, rank)]
        if not ranks:
            raise ClientError(f"no rank {rank} of {instance} is placed")
        if ranks[0].get("pid") is None:
            raise ClientError(f"rank {rank} of {instance} has not said its process id yet")
        _out(args, ranks[0], str(ranks[0]["pid"]))
        return
    said = {} if args.json else _verdicts(gateway)
    _out(
        args,
        found,
        table(
            [
                (
                    p["runnerId"],
                    p["nodeId"],
                    p["deviceRank"],
                    p["worldSize"],
                    f"[{p['startLayer']}, {p['endLayer']})",
                    p["nLayers"],
                    p["statusKind"],
                    p.get("pid"),
                    said.get(p["runnerId"]),
                )
                for p in found
            ],
            ["RUNNER", "NODE", "RANK", "WORLD", "LAYERS", "OF", "STATUS", "PID", "DIAGNOSIS"],
        ),
    )


def _diagnose(args: argparse.Namespace, gateway: Gateway) -> None:
    if args.bundle:
        path = f"/v1/cluster/diagnosis/history/{quote(args.bundle, safe='')}/bundle"
        data = gateway.download(path)
        target = args.output or f"incident-{args.bundle}.tar.gz"
        try:
            with open(target, "wb") as out:
                out.write(data)
        except OSError as exc:
            raise ClientError(f"cannot write {target}: {exc}") from None
        print(f"wrote {target} ({len(data):,} bytes)")
        return

    def lines(found: dict[str, Any]) -> list[str]:
        return [
            line
            for f in found["findings"]
            for line in finding_lines(f, args.verbose or args.stacks, args.stacks)
        ]

    if args.history:
        query = urlencode(
            {k: v for k, v in (("since", args.since), ("instanceId", args.instance)) if v}
        )
        found = gateway.call("GET", f"/v1/cluster/diagnosis/history?{query}")
        window = (
            f"incidents since {args.since}"
            if args.since
            else "incidents the diagnosis stream still holds (its retention)"
        ) + (f" of {args.instance}" if args.instance else "")
        told = lines(found)
        _out(args, found, "\n".join([f"{window}: {len(found['findings'])}", *told]))
        return
    narrowed = urlencode(
        {k: v for k, v in (("instanceId", args.instance), ("kind", args.kind)) if v}
    )
    found = gateway.call("GET", f"/v1/cluster/diagnosis?{narrowed}")
    said = "\n".join(lines(found)) or "no findings: every instance is healthy"
    if found.get("omitted"):
        said += f"\n{found['omitted']} more left out (over the answer's size): narrow with "
        said += "--instance or --kind"
    _out(args, found, said if args.json else said + _pace(gateway))
    if found["findings"]:
        raise SystemExit(1)


PACE_SPAN_S = 120
"""How far back `diagnose` shows each rank's work per step."""


def _pace(gateway: Gateway) -> str:
    """Each rank's work per step over the last `PACE_SPAN_S` as strips, under a heading
    (nothing when no rank decoded; a line saying why when the gateway cannot tell)."""
    since = format_ts(datetime.now(UTC) - timedelta(seconds=PACE_SPAN_S))
    try:
        paced = gateway.call("GET", f"/v1/cluster/pace?since={quote(since)}&points=60")
    except ClientError as error:
        return f"\n(work per step unknown: {error})"
    strips = pace_lines(paced["runners"])
    if not strips:
        return ""
    return (
        f"\nwork per decode step, the last {PACE_SPAN_S // 60} minutes (each rank against its "
        "quickest: ' ' as quick, '█' twice as slow or more):\n" + "\n".join(strips)
    )


def _ranktable(args: argparse.Namespace, gateway: Gateway) -> None:
    if args.follow:
        try:
            gateway.call("GET", f"/v1/jobs/{quote(args.job, safe='')}/ranktable")
        except ClientError as error:
            if error.status != 404:
                raise
            print(
                f"rankscope: job {args.job!r} has no rank table yet; waiting for its first "
                "(Ctrl-C stops)",
                file=sys.stderr,
                flush=True,
            )
        for data in gateway.events(f"/v1/jobs/{quote(args.job, safe='')}/ranktable/stream"):
            table_now = json.loads(json.loads(data)["rankTable"])
            print(data if args.json else json.dumps(table_now, indent=2), flush=True)
        return
    found = gateway.call("GET", f"/v1/jobs/{quote(args.job, safe='')}/ranktable")
    _out(args, found, json.dumps(json.loads(found["rankTable"]), indent=2))


def _runners(args: argparse.Namespace, gateway: Gateway) -> None:
    if args.action == "list":
        found = gateway.call("GET", f"/v1/runners?page={args.page}&per_page={args.per_page}")
        _out(
            args,
            found,
            table(
                [
                    (
                        r["id"],
                        (r.get("worker") or {}).get("model", {}).get("id"),
                        (r.get("compute_info") or {}).get("num_accelerators"),
                        r["num_replicas"],
                        r["priority"],
                        (r.get("runner_metrics") or {}).get("pods_running"),
                    )
                    for r in found["runners"]
                ],
                ["ID", "MODEL", "RANKS", "REPLICAS", "PRIORITY", "PODS RUNNING"],
            ),
        )
    elif args.action == "create":
        try:
            with open(args.file) as spec:
                body = json.load(spec)
        except (OSError, ValueError) as exc:
            raise ClientError(f"cannot read the spec file {args.file}: {exc}") from None
        if not isinstance(body, dict):
            raise ClientError(f"the spec file {args.file} holds no Runner object")
        if not args.if_missing:
            found = gateway.call(
                "POST", "/v1/runners", body if "runners" in body else {"runners": [body]}
            )
            _out(args, found, "" if args.json else _created(found, gateway))
            return
        said: dict[str, str] = {}
        for runner in body.get("runners", [body]):
            try:
                gateway.call("POST", "/v1/runners", {"runners": [runner]})
                said[runner.get("id")] = "created"
            except ClientError as error:
                if error.status != 409:
                    raise
                said[runner.get("id")] = "exists"
        _out(args, said, "\n".join(f"{how} {runner_id}" for runner_id, how in said.items()))
    else:
        found = gateway.call("DELETE", f"/v1/runners/{quote(args.id, safe='')}")
        _out(args, found, f"deleted {args.id}")


def _created(found: dict[str, Any], gateway: Gateway) -> str:
    """Each spec created, and where its instances were placed or why they were not."""
    placed: dict[str, list[dict[str, Any]]] = {}
    for rank in gateway.call("GET", "/v1/placement/runners"):
        placed.setdefault(rank.get("instanceId") or "", []).append(rank)
    lines = []
    for judged in found.get("placements", []):
        said = f"created {judged['runner_id']}"
        if judged.get("accepted") is None:
            lines.append(f"{said}, not judged yet: {judged['reason']}")
        elif not judged["accepted"]:
            lines.append(f"{said}, refused: {judged['reason']}")
        elif not judged.get("instances"):
            why = judged.get("reason") or "no room yet"
            lines.append(f"{said}, not placed (it waits for room): {why}")
        else:
            lines.append(f"{said}, placed:")
            for instance in judged["instances"]:
                shards = ", ".join(
                    f"rank {r['deviceRank']} on {r['nodeId']} layers "
                    f"[{r['startLayer']}, {r['endLayer']})"
                    for r in sorted(placed.get(instance, []), key=lambda r: r["deviceRank"])
                )
                lines.append(f"  {instance}: {shards or 'its ranks are not reported yet'}")
    return "\n".join(lines)


def ranktable_client(args: argparse.Namespace) -> int:
    """`rankscope ranktable JOB`: print (or follow) a job's rank table."""
    run: Any = _run(_ranktable)
    return int(run(args, None))


def _rank_of(text: str) -> tuple[str, int]:
    """`INSTANCE:RANK` as (instance id, rank)."""
    instance, _, rank = text.rpartition(":")
    if not instance or not rank.isdigit():
        raise argparse.ArgumentTypeError(f"expected INSTANCE:RANK such as demo-0:1, got {text!r}")
    return identifier(instance), int(rank)


def identifier(text: str) -> str:
    """An id argument, refused (usage error) when it could not name a NATS subject: the
    same limit the gateway and the gRPC service apply."""
    try:
        token(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def client_options(parser: argparse.ArgumentParser, *, nested: bool = False) -> None:
    """The options every client command takes; `nested`, for an action of a command
    (`runners create ... --json`), each left as the command's when not given."""
    unset: Any = argparse.SUPPRESS if nested else None
    parser.add_argument(
        "--url", default=unset, help="gateway URL [RANKSCOPE_URL, http://127.0.0.1:8000]"
    )
    parser.add_argument(
        "--json",
        action="store_true",
        default=unset if nested else False,
        help="print JSON for scripts",
    )


def _run(handler: Any) -> Any:
    def run(args: argparse.Namespace, _settings: object) -> int:
        try:
            handler(args, Gateway(args.url))
        except ClientError as error:
            print(f"rankscope: {error}", file=sys.stderr)
            return 1
        except KeyboardInterrupt:
            return 130
        except BrokenPipeError:  # `| head` has read enough: end quietly, as cat does
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            return 0
        return 0

    return run


def add_client_commands(commands: Any) -> list[argparse.ArgumentParser]:
    """Add the client subcommands; returns their parsers."""
    made = []

    def command(name: str, help: str, handler: Any) -> argparse.ArgumentParser:
        parser: argparse.ArgumentParser = commands.add_parser(name, help=help)
        client_options(parser)
        parser.set_defaults(handler=_run(handler))
        made.append(parser)
        return parser

    timeline = command("timeline", "the cross-rank timeline", _timeline)
    timeline.add_argument("--follow", "-f", action="store_true", help="keep printing new entries")
    timeline.add_argument("--limit", type=int, default=50, help="newest entries (50)")
    timeline.add_argument("--instance", type=identifier, help="only this instance")
    placement = command("placement", "which layers sit on which node", _placement)
    placement.add_argument(
        "--pid",
        type=_rank_of,
        metavar="INSTANCE:RANK",
        help="print only that rank's process id (kill -STOP \"$(rankscope placement --pid "
        'demo-0:1)")',
    )
    diagnose = command("diagnose", "findings that name the stuck rank (exit 1 when any)", _diagnose)
    diagnose.add_argument(
        "--verbose", "-v", action="store_true", help="each rank's evidence, where it waits"
    )
    diagnose.add_argument("--stacks", action="store_true", help="with each rank's whole stack")
    diagnose.add_argument("--bundle", metavar="INCIDENT", help="write that incident as one file")
    diagnose.add_argument("-o", "--output", help="with --bundle: where (incident-ID.tar.gz)")
    diagnose.add_argument("--history", action="store_true", help="past incidents too")
    diagnose.add_argument("--since", help="with --history: from this RFC 3339 time")
    diagnose.add_argument("--instance", type=identifier, help="only this instance")
    diagnose.add_argument(
        "--kind", choices=[k.value for k in FindingKind], help="only findings of this kind"
    )
    runners = command("runners", "Runner specs", _runners)
    actions = runners.add_subparsers(dest="action", required=True)
    listing = actions.add_parser("list", help="list Runner specs")
    listing.add_argument("--page", type=int, default=1)
    listing.add_argument("--per-page", type=int, default=128)
    create = actions.add_parser("create", help="create from a JSON file")
    create.add_argument("file")
    create.add_argument(
        "--if-missing", action="store_true", help="one that exists already is fine (exit 0)"
    )
    delete = actions.add_parser("delete", help="delete one")
    delete.add_argument("id", type=identifier)
    for action in (listing, create, delete):
        client_options(action, nested=True)
    return made
