"""The `replicator` command line.

Exit codes: 0 success; 1 failure; 2 usage or configuration error (the message names the file, the key and what is
wrong); 3 boot error (port in use, unreadable certificate, data directory not writable).
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from collections.abc import Coroutine
from typing import Any

from shared.config import Config, ConfigError, load
from shared.logs import log

EXIT_USAGE = 2


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # type: ignore[override]
        self.print_usage(sys.stderr)
        print(f"{self.prog}: error: {message}", file=sys.stderr)
        sys.exit(EXIT_USAGE)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="replicator", description="A replication node: identical databases across a cluster.")
    commands = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    run = commands.add_parser("run", help="run one node in the foreground until SIGTERM or SIGINT")
    run.add_argument("--config", required=True, help="the node's TOML config file")
    run.add_argument("--workers", type=int, help="worker processes (overrides node.workers)")
    run.add_argument("--log-format", choices=["json", "text"], help="json lines (default) or text for a terminal")
    run.add_argument(
        "--check-integrity",
        action="store_true",
        help="check every database file at boot with PRAGMA integrity_check (every page and index) instead of "
        "quick_check",
    )

    demo = commands.add_parser("demo", help="boot a local TLS cluster on loopback, replicate, report, stop")
    demo.add_argument("--nodes", type=int, default=3)
    demo.add_argument("--workers", type=int, default=2)
    demo.add_argument("--records", type=int, default=2000)
    demo.add_argument("--dir", help="keep the cluster's files here instead of a temporary folder")

    certs = commands.add_parser("certs", help="create the cluster CA or a node certificate")
    certs_commands = certs.add_subparsers(dest="certs_command", required=True, parser_class=_Parser)
    ca = certs_commands.add_parser("ca", help="create a cluster CA: DIR/ca.pem and DIR/ca.key")
    ca.add_argument("--out", required=True)
    node_cert = certs_commands.add_parser("node", help="issue a node certificate signed by the CA")
    node_cert.add_argument("--ca", required=True, help="the CA folder")
    node_cert.add_argument("--name", required=True)
    node_cert.add_argument("--host", action="append", default=[], help="a host name or IP for the SAN (repeatable)")
    node_cert.add_argument("--out", required=True)
    revoke = certs_commands.add_parser(
        "revoke",
        help="sign a revocation with the CA key: one certificate serial, or every certificate of the node so far",
    )
    revoke.add_argument("--ca", required=True, help="the CA folder (ca.pem and ca.key)")
    revoke.add_argument("--name", required=True, help="the node whose certificate is revoked")
    revoke.add_argument(
        "--serial", default="", help="the certificate serial in hex (default: every certificate issued until now)"
    )
    revoke.add_argument("--out", help="write the signed revocation to this file (default: print it)")
    revoke.add_argument("--admin", help="also store it through this node's admin URL (PUT /nodes/NAME/revocations)")

    init = commands.add_parser("init", help="write a ready-to-run config file and the node's certificate")
    init.add_argument("--name", required=True)
    init.add_argument("--url", required=True)
    init.add_argument("--port", type=int, required=True)
    init.add_argument("--admin-port", type=int, required=True)
    init.add_argument("--data", required=True)
    init.add_argument("--ca", required=True)
    init.add_argument("--config", required=True)
    init.add_argument("--peer", action="append", default=[], metavar="NAME=URL")
    init.add_argument("--host", default="127.0.0.1", help="the address to listen on")
    init.add_argument("--workers", type=int)

    status = commands.add_parser("status", help="the node's cluster status as a table")
    status.add_argument("--admin", default="http://127.0.0.1:9926", help="the node's admin URL")
    status.add_argument("--json", action="store_true", help="print the JSON document instead of a table")

    verify = commands.add_parser(
        "verify",
        help="compare every database's digest across nodes",
        description="Compare every database's digest across nodes: exit 0 when identical, 1 when they differ or a "
        "node cannot be reached, 2 on a usage error.",
    )
    verify.add_argument("--admin", action="append", required=True, help="an admin URL (repeat for each node)")
    verify.add_argument(
        "--repair",
        action="store_true",
        help="first run an anti-entropy round on every node with each of its connected peers (POST /antientropy) "
        "and report what each node changed, then compare",
    )
    verify.add_argument(
        "--json",
        action="store_true",
        help='print one JSON object: {"identical", "nodes", "databases", "differences"} (and "repairs" with --repair)',
    )

    delete_database = commands.add_parser(
        "delete-database",
        help="delete a database cluster-wide (DELETE /databases/NAME on one node's admin port)",
        description="Delete a database on every node: each drops every record written to it up to the deletion, for "
        "good, and removes the database. Writes after the deletion create it again. Exit 0 when the node took the "
        "request, 1 when it refused it or cannot be reached, 2 on a usage error.",
    )
    delete_database.add_argument("--admin", required=True, help="a node's admin URL, e.g. http://127.0.0.1:9926")
    delete_database.add_argument("name", help="the database to delete")
    delete_database.add_argument(
        "--token", default="", help="sent as Authorization: Bearer TOKEN (an admin port behind an authenticating proxy)"
    )

    clone = commands.add_parser(
        "clone",
        help="make a new node from a running one: register with it, copy every database, then run (or stop)",
        description="Bootstrap an empty node from a running one, the leader: wait until the leader is ready, check "
        "that its cluster CA is this node's and issued its certificate, register this node with it (an introduction "
        "signed by the leader), copy every database the leader holds, then run on as a normal node (or stop, with "
        "--no-run). Exit 0 when done, 1 when the leader is unreachable, never ready, refuses the registration or the "
        "sessions, 2 on a usage or configuration error (a node.data_dir that is not empty), 3 on a certificate or "
        "port problem (another cluster CA, a certificate that does not name the node, a port in use).",
    )
    clone.add_argument(
        "--leader",
        required=True,
        help="the leader's admin URL, http://HOST:ADMIN_PORT (readiness, its CA, its registry and introductions are "
        "served there; not its wss:// node URL)",
    )
    clone.add_argument(
        "--config", required=True, help="the new node's config file (`replicator init` writes one); node.data_dir empty"
    )
    clone.add_argument(
        "--no-run", action="store_true", help="stop cleanly once every database is copied (exit 0) instead of running"
    )
    repair_blobs = commands.add_parser(
        "repair-blobs",
        help="fetch again from peers the blobs a node is missing (POST /repair/blobs/DATABASE on its admin port)",
        description="Scan a database on one node for records whose blob file is absent or damaged and fetch each from "
        "the peers that hold the database, paced. Exit 0 when every one was repaired (or none was missing), 1 when "
        "some could not be or the node cannot be reached, 2 on a usage error.",
    )
    repair_blobs.add_argument("--admin", required=True, help="the node's admin URL, e.g. http://127.0.0.1:9926")
    repair_blobs.add_argument("database", help="the database to repair")
    repair_blobs.add_argument("--json", action="store_true", help="print the node's JSON answer")
    repair_blobs.add_argument(
        "--timeout", type=float, default=3600.0, help="seconds to wait for the repair to finish (default 3600)"
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    match args.command:
        case "run":
            return _run(args)
        case "demo":
            from coordinator.demo import run_demo

            return _asyncio_run(run_demo(args.nodes, args.workers, args.records, args.dir))
        case "certs":
            from coordinator import certs_cmd

            if args.certs_command == "ca":
                return certs_cmd.cmd_certs_ca(args.out)
            if args.certs_command == "revoke":
                return certs_cmd.cmd_certs_revoke(args.ca, args.name, args.serial, args.out, args.admin)
            return certs_cmd.cmd_certs_node(args.ca, args.name, args.host, args.out)
        case "init":
            from coordinator import certs_cmd

            return certs_cmd.cmd_init(
                args.name,
                args.url,
                args.port,
                args.admin_port,
                args.data,
                args.ca,
                args.config,
                args.peer,
                host=args.host,
                workers=args.workers,
            )
        case "status":
            from coordinator.inspect import cmd_status

            return _asyncio_run(cmd_status(args.admin, args.json))
        case "verify":
            from coordinator.inspect import cmd_verify

            return _asyncio_run(cmd_verify(args.admin, repair=args.repair, as_json=args.json))
        case "delete-database":
            from coordinator.delete_database import cmd_delete_database

            return _asyncio_run(cmd_delete_database(args.admin, args.name, args.token))
        case "repair-blobs":
            from coordinator.repair_blobs import cmd_repair_blobs

            return _asyncio_run(cmd_repair_blobs(args.admin, args.database, args.json, args.timeout))
        case "clone":
            from coordinator.clone import cmd_clone

            return _asyncio_run(cmd_clone(args.leader, args.config, no_run=args.no_run))
    return EXIT_USAGE


def _run(args: argparse.Namespace) -> int:
    try:
        config = load(args.config)
    except ConfigError as exc:
        print(f"replicator: {exc}", file=sys.stderr)
        return EXIT_USAGE
    if args.workers is not None:
        if not 1 <= args.workers <= 256:
            print(f"replicator: --workers: expected 1 to 256, got {args.workers}", file=sys.stderr)
            return EXIT_USAGE
        config.node.workers = args.workers
    if args.log_format:
        config.log.format = args.log_format
    log.configure_from(config.log, node=config.node.name, worker="coordinator")
    return _asyncio_run(_serve(config, args.workers, args.check_integrity))


async def _serve(config: Config, cli_workers: int | None, check_integrity: bool = False) -> int:
    from coordinator.node import Node

    node = Node(config, loop=asyncio.get_running_loop(), cli_workers=cli_workers, check_integrity=check_integrity)
    return await node.run()


def _asyncio_run(coro: Coroutine[Any, Any, int]) -> int:
    try:
        import uvloop  # type: ignore[import-not-found]
    except ImportError:
        return asyncio.run(coro)
    return uvloop.run(coro)


if __name__ == "__main__":
    sys.exit(main())
