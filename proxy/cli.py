"""Command line: ``toolproxy run | dev | check-registry | check-policy-data | registry diff | opa-data |
config-reference | import-mcp | mcp repin | policy | egress-rules``.

Owns: argument parsing and process-level concerns (logging set-up, exit
codes, signals). Must never: contain pipeline logic.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import sys
from typing import Any, Callable, Sequence

from . import startup

if __name__ == "__main__":  # python -m proxy.cli: the imports below are the process's start-up (proxy/startup.py)
    startup.begin()

from .audit import check_config as check_audit_config
from .config import ConfigError, describe, load_config, serving_problem
from .policy.decisions import check_config as check_decisions_config
from .event_loop import run_loop
from .identity import HopProof, configuration_problem
from .telemetry.logs import configure as configure_logging
from .registry import Registry, RegistryError, SERVICE_WIDE, load_registry, notices, unchecked_state
from .credentials.references import check_references


def make_call_token_key(out: str, alg: str, kid: str) -> int:
    import os

    from .calltokens import keys
    key = keys.signing_key(keys.generate(alg), kid)
    try:
        fd = os.open(out, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except OSError as exc:
        print(f"toolproxy call-token-key: cannot create {out} ({exc.strerror})", file=sys.stderr)
        return 1
    with os.fdopen(fd, "wb") as handle:
        handle.write(keys.private_pem(key.private))
    print(json.dumps(keys.jwks(key), indent=2))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.command != "run":
        startup.end(freeze=False)  # only the sidecar's start-up runs with young collections only
    command = _COMMANDS.get(args.command)
    return command(args) if command is not None else 2


def _parser() -> argparse.ArgumentParser:
    """The command line: every subcommand with its arguments."""
    parser = argparse.ArgumentParser(prog="toolproxy", description="Policy-driven sidecar proxy for AI-agent tool calls.")
    sub = parser.add_subparsers(dest="command", required=True)

    run = sub.add_parser("run", help="run the sidecar (agent, admin and ops listeners)",
                         description="Run the sidecar. Settings come from --config (YAML) and TOOLPROXY_* "
                                     "environment variables; see `toolproxy config-reference`.")
    run.add_argument("--config", "-c", help="YAML config file (optional)")

    dev = sub.add_parser("dev", help="run a local stack: OPA, Redis, demo backend and the proxy",
                         description="Start a real opa server (policies/), a real redis-server, the demo tool "
                                     "backend and the proxy; print endpoints and sample curls; stop all on Ctrl-C.")
    dev.add_argument("--config", "-c", help="extra YAML config for the proxy (optional)")
    dev.add_argument("--proxy-port", type=int, default=8787, help="agent API port (default 8787)")
    dev.add_argument("--admin-port", type=int, default=8788, help="admin API port (default 8788)")
    dev.add_argument("--ops-port", type=int, default=9464, help="metrics/probes port (default 9464)")
    dev.add_argument("--redis-port", type=int, default=6390, help="Redis port (default 6390)")
    dev.add_argument("--backend-port", type=int, default=8790, help="demo backend port (default 8790)")
    dev.add_argument("--registry", nargs="+", default=None,
                     help="registry YAML files or directories to serve (default: the config's registry.paths, "
                          "else the repo's examples/registry)")
    dev.add_argument("--policies", default=None,
                     help="Rego directory OPA serves and watches (default: the repo's policies/)")
    dev.add_argument("--opa-data", default=None,
                     help="OPA data directory for the demo (default: the repo's examples/opa/)")

    check = sub.add_parser("check-registry", help="validate registry files without starting anything")
    check.add_argument("paths", nargs="+", help="registry YAML files or directories")
    check.add_argument("--dev", action="store_true",
                       help="a development registry: a write that declares no resources and states no "
                            "service_wide_reason is a warning, not an error")
    check.add_argument("--previous", metavar="DIR", action="append",
                       help="the registry before this change (files or directories; repeatable): refuse a breaking "
                            "change that keeps the version number (exit 3)")

    registry_cmd = sub.add_parser("registry", help="registry tools (diff)")
    registry_sub = registry_cmd.add_subparsers(dest="registry_command", required=True)
    diff_cmd = registry_sub.add_parser(
        "diff", help="what changed per tool and version between two registries, breaking or compatible",
        description="Compare two registries (files or directories). Exit 0 whatever changed; 1 if one of them "
                    "is invalid. Breaking changes are marked BREAKING.")
    diff_cmd.add_argument("old", help="the previous registry (file or directory)")
    diff_cmd.add_argument("new", help="the new registry (file or directory)")

    policy_data = sub.add_parser(
        "check-policy-data", help="validate an OPA data document (roles, subjects, resources, thresholds, limits)",
        description="Check the data document the policies read (data.toolproxy) against "
                    "schemas/opa-data.schema.json and its cross references, before shipping it to OPA.")
    policy_data.add_argument("file", help="the JSON data document (e.g. examples/opa/data.json)")

    opa_data = sub.add_parser(
        "opa-data", help="print the registry's tool catalog as OPA data (data.toolproxy.catalog)",
        description="Print the tool catalog the proxy loads into OPA at start-up, for shipping it in a "
                    "bundle or ConfigMap instead (save it as toolproxy/catalog/data.json in the bundle and "
                    "set opa.push_catalog=false).")
    opa_data.add_argument("--registry", nargs="+", required=True, help="registry YAML files or directories")

    reference = sub.add_parser("config-reference", help="print every setting with its env variable, default and help")
    reference.add_argument("--json-schema", action="store_true",
                           help="print the config file's JSON Schema instead (the Helm chart's proxy.config schema)")

    key_cmd = sub.add_parser(
        "call-token-key", help="make a call-token signing key and print its public JWKS",
        description="Write a new private key (PEM, mode 0600) that signs the Txn-Token of every backend "
                    "request (call_tokens.signing_key_file; in Kubernetes a Secret for proxy.callTokens) and "
                    "print the public JWKS backends verify with (docs/backends.md).")
    key_cmd.add_argument("--out", required=True, help="where to write the private key (must not exist)")
    key_cmd.add_argument("--alg", choices=["EdDSA", "ES256"], default="EdDSA", help="EdDSA (Ed25519, default) or ES256")
    key_cmd.add_argument("--kid", default="", help="key id (default: the key's RFC 7638 thumbprint)")

    imp = sub.add_parser("import-mcp", help="draft registry entries from an upstream MCP server (for review)",
                         description="Connect to an MCP server (Streamable HTTP), read its tools/list and print "
                                     "registry YAML for a human to review. Every tool defaults to mode: write, "
                                     "risk: destructive, idempotency required; fields needing a decision are "
                                     "marked REVIEW. Upstream annotations are shown, never applied.")
    imp.add_argument("url", help="the upstream's MCP endpoint, e.g. http://crm.tools.svc:8080/mcp")
    imp.add_argument("--prefix", default="", help="prepend to every tool name (e.g. crm.)")
    imp.add_argument("--service", help="emit backend {service, path} instead of the URL "
                                       "(map the service in backends.services)")
    imp.add_argument("--path", help="with --service: the path (default: the URL's path)")
    imp.add_argument("--mode", choices=["auto", "legacy"], default="auto",
                     help="protocol negotiation (default auto: 2026-07-28 if offered, else initialize)")
    imp.add_argument("--timeout", type=float, default=15.0, help="seconds to wait for the upstream (default 15)")

    mcp_cmd = sub.add_parser("mcp", help="pinned MCP upstream tools (repin)")
    mcp_sub = mcp_cmd.add_subparsers(dest="mcp_command", required=True)
    repin_cmd = mcp_sub.add_parser(
        "repin", help="after review: print what changed upstream and write the new pins into registry files",
        description="List the upstream of every MCP contract in the given registry files, print per tool what "
                    "changed against its backend.pin, and write the new digests into the files (only the pin "
                    "values change; the file is validated first). Exit 1 if an upstream could not be listed, a "
                    "service is unknown, or a pinned tool is no longer listed upstream (its pin is kept).")
    repin_cmd.add_argument("paths", nargs="+", help="registry YAML files")
    repin_cmd.add_argument("--config", "-c", help="the proxy's YAML config (backends.services for service: "
                                                  "backends; TOOLPROXY_* env applies too)")
    repin_cmd.add_argument("--dry-run", action="store_true", help="print what would change; write nothing")
    repin_cmd.add_argument("--mode", choices=["auto", "legacy"], default="auto",
                           help="protocol negotiation (default auto: 2026-07-28 if offered, else initialize)")
    repin_cmd.add_argument("--timeout", type=float, default=15.0,
                           help="seconds to wait for each upstream (default 15)")

    resolve_cmd = sub.add_parser(
        "resolve", help="settle an open operation from your evidence (lifts the freeze it holds)",
        description="POST the operator's resolution of an UNKNOWN or NEEDS_TAKEOVER operation to the admin "
                    "listener (the same request as the console's Resolve button): audited, recorded, and the "
                    "resources it froze are thawed. The admin token is read from TOOLPROXY_ADMIN_TOKEN. "
                    "GET /v1/freezes lists the frozen resources and their operations.")
    resolve_cmd.add_argument("key", help="the operation key (a freeze's operation, a takeover's idempotency_key)")
    resolve_cmd.add_argument("--outcome", required=True, choices=["committed", "not_applied", "rejected"],
                             help="what you found at the target")
    resolve_cmd.add_argument("--evidence", required=True, help="what you checked (recorded and audited)")
    resolve_cmd.add_argument("--result", help="the result as JSON (committed only; checked against the outputSchema)")
    resolve_cmd.add_argument("--admin-url", default="http://127.0.0.1:8788",
                             help="the admin listener (default http://127.0.0.1:8788)")

    egress = sub.add_parser(
        "egress-rules", help="print (or apply) the nftables egress guard: default-deny for every UID but the proxy's",
        description="Print the nft script that lets --uid connect anywhere and every other socket of the pod only "
                    "to the proxy's agent port on loopback, DNS and the --allow list; nothing is resolved. The "
                    "chart's init container runs it with --apply in the pod's network namespace (docs/security.md).")
    egress.add_argument("--uid", type=int, action="append", required=True,
                        help="a UID that may connect anywhere: the toolproxy container's (runAsUser); repeat it for "
                             "OPA's when OPA fetches bundles")
    egress.add_argument("--config", "-c", help="the proxy's YAML config, for listen.port (TOOLPROXY_* env applies too)")
    egress.add_argument("--agent-port", type=int, help="the proxy's agent port (default: the config's listen.port)")
    egress.add_argument("--allow", action="append", default=[], metavar="CIDR:PORT",
                        help="an address or network and TCP port every UID may reach, e.g. the agent's model API "
                             "(repeatable; no names: they are never resolved)")
    egress.add_argument("--dns", action="append", default=[], metavar="CIDR",
                        help="the resolvers DNS may go to (repeatable; default: port 53 anywhere)")
    egress.add_argument("--apply", action="store_true", help="load the rules with `nft -f -` instead of printing")

    _add_policy_parsers(sub)
    return parser


def _config_reference(args: argparse.Namespace) -> int:
    if args.json_schema:
        from .config import json_schema
        print(json.dumps(json_schema(), indent=2))
        return 0
    for key, env, default, help_ in describe():
        print(f"{key}\t{env}\t{default!r}\t{help_}")
    return 0


def _repin(args: argparse.Namespace) -> int:
    from .authoring.mcp_repin import run as run_repin
    return run_repin(args)


def _policy(args: argparse.Namespace) -> int:
    from .authoring.policy_commands import run as run_policy
    return run_policy(args)


def _dev(args: argparse.Namespace) -> int:
    from .authoring.devstack import run_dev
    return run_dev(args)


def _resolve(args: argparse.Namespace) -> int:
    from .authoring.operator_resolve import resolve
    return resolve(args.admin_url, args.key, args.outcome, args.evidence, args.result)


def _egress_rules(args: argparse.Namespace) -> int:
    from .guard.egress_rules import run as run_egress_rules
    return run_egress_rules(args)


# Each subcommand's handler (looked up when called: the heavier modules are imported only by their command).
_COMMANDS: dict[str, Callable[[argparse.Namespace], int]] = {
    "check-registry": lambda args: check_registry(args.paths, previous=args.previous, dev=args.dev),
    "check-policy-data": lambda args: check_policy_data(args.file),
    "registry": lambda args: registry_diff(args.old, args.new),
    "opa-data": lambda args: print_opa_data(args.registry),
    "config-reference": lambda args: _config_reference(args),
    "call-token-key": lambda args: make_call_token_key(args.out, args.alg, args.kid),
    "import-mcp": lambda args: import_mcp(args),
    "mcp": lambda args: _repin(args),
    "policy": lambda args: _policy(args),
    "run": lambda args: run_sidecar(args.config),
    "dev": lambda args: _dev(args),
    "resolve": lambda args: _resolve(args),
    "egress-rules": lambda args: _egress_rules(args),
}


def _registry_or_report(paths: Sequence[str]) -> Registry | None:
    try:
        return load_registry(paths)
    except RegistryError as exc:
        print(f"registry invalid: {exc}", file=sys.stderr)
        return None


EXIT_BREAKING_SAME_VERSION = 3


def check_registry(paths: Sequence[str], previous: Sequence[str] | None = None, *, dev: bool = False) -> int:
    registry = _registry_or_report(paths)
    if registry is None:
        return 1
    for tool in registry.all():
        print(f"ok {tool.name} {tool.version} ({tool.mode}, {tool.risk}{_contract_summary(tool)}) from {tool.source}")
    refused = _print_notices(registry, dev)
    if previous:
        from .authoring.contract_diff import diff, same_version_breaks
        old = _registry_or_report(previous)
        if old is None:
            return 1
        breaks = same_version_breaks(diff(old, registry))
        for change in breaks:
            print(f"refused: {change.line()} -- bump the version", file=sys.stderr)
        if breaks:
            return EXIT_BREAKING_SAME_VERSION
    for line in unchecked_state(registry):  # the default: the backend alone checks a resource's state
        print(f"warning: {line}")
    from .authoring.flow_labels import unlabelled_others
    for line in unlabelled_others(registry.all()):  # a channel others write into, left unlabelled
        print(f"warning: {line}")
    if refused:
        print(f"registry refused: {refused} write(s) declare no resources without a service_wide_reason "
              f"(check-registry --dev accepts them for a development registry)", file=sys.stderr)
        return 1
    return 0


def _contract_summary(tool: Any) -> str:
    """What a contract declares beyond its mode and risk, as check-registry's ``ok`` line shows it."""
    status = "" if tool.status == "active" else f", {tool.status}"
    if tool.compensation is not None:
        status += f", compensated by {tool.compensation.tool}@{tool.compensation.version}"
    if tool.cancel_endpoint is not None:
        status += ", cancel endpoint"
    return status + _flow_summary(tool) + _approval_summary(tool)


def _flow_summary(tool: Any) -> str:
    status = ""
    if tool.flow_produces:
        status += f", flow produces {'+'.join(tool.flow_produces)}"
    if tool.flow_sink != "internal":
        status += f", flow sink {tool.flow_sink}"
    if tool.flow_sink_arguments:
        status += f", sink arguments {' '.join(tool.flow_sink_arguments)}"
    if tool.flow_integrity:
        status += f", integrity {tool.flow_integrity}"
    if tool.flow_payload_arguments:
        status += f", payload arguments {' '.join(tool.flow_payload_arguments)}"
    if tool.flow_trusted_source:
        status += ", trusted source"
    if tool.flow_directory:
        status += ", directory"
    return status


def _approval_summary(tool: Any) -> str:
    status = ""
    if tool.related_read is not None:  # shown to approvers beside a pending approval (docs/registry.md)
        status += f", related read {tool.related_read.tool}@{tool.related_read.version}"
    if tool.approver_may_read:
        status += f", approvers read {', '.join(tool.approver_may_read)}"
    return status


def _print_notices(registry: Registry, dev: bool) -> int:
    """Print the registry's notices; the number of them that refuse it (service-wide writes, unless ``dev``)."""
    refused = 0
    for level, line in notices(registry):  # opt-outs of the key requirement, old defaults, service-wide writes
        if level == SERVICE_WIDE and not dev:  # one unknown outcome would freeze the whole service
            print(f"error: {line}", file=sys.stderr)
            refused += 1
        else:
            print(f"{'warning' if level == SERVICE_WIDE else level}: {line}")
    return refused


def registry_diff(old_path: str, new_path: str) -> int:
    from .authoring.contract_diff import diff
    old, new = _registry_or_report([old_path]), _registry_or_report([new_path])
    if old is None or new is None:
        return 1
    changes = diff(old, new)
    for change in changes:
        print(change.line())
    breaking = sum(c.breaking for c in changes)
    print(f"{len(changes)} change(s), {breaking} breaking")
    return 0


def check_policy_data(path: str) -> int:
    from .decode import strict_loads
    from .errors import ProxyError
    from .policy.data import problems, summary
    try:
        with open(path, "rb") as handle:
            document = strict_loads(handle.read(), what="policy data", phase="request")
    except (OSError, ProxyError) as exc:
        print(f"policy data invalid: {path}: {exc.strerror if isinstance(exc, OSError) else exc}", file=sys.stderr)
        return 1
    found = problems(document)
    for problem in found:
        print(f"policy data invalid: {path}: {problem}", file=sys.stderr)
    if found:
        return 1
    print(f"ok {path}: {summary(document)}")
    return 0


def import_mcp(args: argparse.Namespace) -> int:
    from .authoring.mcp_import import draft, fetch_tools
    try:
        tools = asyncio.run(fetch_tools(args.url, mode=args.mode, timeout_s=args.timeout))
    except Exception as exc:  # ExceptionGroup from the SDK's task groups included
        print(f"import-mcp: cannot list tools at {args.url}: {type(exc).__name__}", file=sys.stderr)
        return 1
    sys.stdout.write(draft(tools, url=args.url, service=args.service, path=args.path, prefix=args.prefix))
    print(f"import-mcp: drafted {len(tools)} tool(s); resolve every REVIEW line before use", file=sys.stderr)
    return 0


def print_opa_data(paths: Sequence[str]) -> int:
    from .policy.client import catalog_document
    registry = _registry_or_report(paths)
    if registry is None:
        return 1
    print(json.dumps(catalog_document(registry), indent=2, sort_keys=True))
    return 0


def _add_policy_parsers(sub: Any) -> None:
    """``toolproxy policy replay | explain | check`` (run by ``proxy/authoring/policy_commands.py``)."""
    policy = sub.add_parser("policy", help="policy authoring: replay, explain, check",
                            description="Tools for policy authors; see docs/policy-authors.md.")
    commands = policy.add_subparsers(dest="policy_command", required=True)

    replay = commands.add_parser(
        "replay", help="replay recorded decisions against a candidate policy",
        description="Evaluate recorded decision inputs against a candidate policy in a scratch opa and report "
                    "what would change. Exit 1 when a --fail-on transition occurs, 2 when it cannot run.")
    source = replay.add_mutually_exclusive_group(required=True)
    source.add_argument("--records", help="JSON-lines file of decision records (other lines are skipped)")
    source.add_argument("--redis", help="Redis URL holding the decision stream")
    replay.add_argument("--stream", default=None,
                        help="stream key (default: <prefix>:decisions:{stream} with --key-prefix)")
    replay.add_argument("--key-prefix", default="toolproxy", help="redis.key_prefix of the proxy (default toolproxy)")
    _policy_args(replay)
    replay.add_argument("--fail-on", action="append", default=[],
                        help="exit 1 if this transition occurs, e.g. deny->allow (repeatable; 'any' for every change)")
    replay.add_argument("--format", choices=["text", "json"], default="text")
    replay.add_argument("--examples", type=int, default=3, help="examples per transition (default 3)")

    explain = commands.add_parser(
        "explain", help="why a call or a listing is decided the way it is: the input, the decision, which rules "
                   "applied, the rules behind each reason")
    what = explain.add_mutually_exclusive_group(required=True)
    what.add_argument("--body", help="a tool-call request body (JSON file, or - for stdin)")
    what.add_argument("--decision-id", help="a decision id from the records (with --records or --redis)")
    what.add_argument("--list", action="store_true",
                      help="a tool listing (tools/list) for the caller: which tools are shown, which hidden and why")
    explain.add_argument("--records", help="JSON-lines file of decision records (with --decision-id)")
    explain.add_argument("--redis", help="Redis URL holding the decision stream (with --decision-id)")
    explain.add_argument("--stream", default=None)
    explain.add_argument("--key-prefix", default="toolproxy")
    explain.add_argument("--subject", default="dev-user")
    explain.add_argument("--tenant", default="acme")
    explain.add_argument("--roles", default="agent", help="comma-separated roles")
    explain.add_argument("--scopes", default="tools:read,tools:write", help="comma-separated scopes")
    explain.add_argument("--agent", default="dev-agent")
    explain.add_argument("--flow", default=None, metavar="LABELS",
                         help="with --body: comma-separated flow labels the agent was exposed to (input.flow; an "
                              "external sink gets an empty one without it, as the proxy reads it)")
    _policy_args(explain)
    explain.add_argument("--listing-path", default="toolproxy/listing",
                         help="the listing rules' document (default toolproxy/listing: policies/listing.rego)")
    explain.add_argument("--format", choices=["text", "json"], default="text")

    check = commands.add_parser(
        "check", help="opa check --strict, opa fmt, and policy data against the registry",
        description="Exit 1 when any problem is found, 2 when the check cannot run.")
    check.add_argument("--policy", default="policies", help="Rego directory (default policies/)")
    check.add_argument("--data", nargs="+", default=["examples/opa"], help="OPA data files or directories")
    check.add_argument("--registry", nargs="+", default=["examples/registry"], help="registry files or directories")
    check.add_argument("--decision-path", default="toolproxy/decision",
                       help="opa.decision_path of the proxy: a package it never reads is flagged")
    check.add_argument("--opa", help="opa binary (default: the venv's, then PATH)")
    check.add_argument("--format", choices=["text", "json"], default="text")


def _policy_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--policy", default="policies", help="candidate Rego directory (default policies/)")
    parser.add_argument("--data", nargs="*", default=["examples/opa"], help="OPA data files or directories")
    parser.add_argument("--registry", nargs="*", default=["examples/registry"],
                        help="registry loaded as data.toolproxy.catalog (none: the data ships the catalog)")
    parser.add_argument("--decision-path", default="toolproxy/decision", help="opa.decision_path of the proxy")
    parser.add_argument("--opa", help="opa binary (default: the venv's, then PATH)")


def run_sidecar(config_path: str | None) -> int:
    startup.begin()  # already begun under python -m proxy.cli; here for the console script's entry
    try:
        return _run_sidecar(config_path)
    finally:
        startup.end(freeze=False)  # a start that failed (after a start, nothing is left to end)


async def _end_startup_when(ready: asyncio.Event) -> None:
    await ready.wait()  # the listeners are up: what start-up built lives as long as the process
    startup.end(freeze=True)


def _run_sidecar(config_path: str | None) -> int:
    from .fronts.app import serve
    from .process.runtime import check_key_layout
    try:
        config = load_config(config_path)
        check_key_layout(config)
        registry = load_registry(config.registry.paths)  # fail fast with a clear message; the runtime serves it
        check_references(registry, config.credentials, config.backends.services)
        check_audit_config(config.audit)
        check_decisions_config(config.decisions)
        identity_problem = configuration_problem(config.identity)
        if identity_problem:
            raise ConfigError(identity_problem)
        if config.identity.mode == "headers":
            HopProof(config.identity.headers)  # reads the hop secret now: a bad one stops here, in one line
        refused = serving_problem(config)  # what only the dev stack and tests may do (no fleet keys, TCP to OPA)
        if refused:
            raise ConfigError(refused)
    except (ConfigError, RegistryError) as exc:
        print(f"toolproxy: {exc}", file=sys.stderr)
        return 1
    configure_logging(config.log.level, config.log.format)

    async def main_async() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)

        def reload_on_sighup(runtime: Any) -> None:
            loop.add_signal_handler(signal.SIGHUP, runtime.reloader.request)

        ready = asyncio.Event()
        started = asyncio.create_task(_end_startup_when(ready))
        try:
            await serve(config, registry=registry, ready=ready, stop=stop, on_runtime=reload_on_sighup)
        finally:
            started.cancel()

    try:
        run_loop(main_async())
    except ConfigError as exc:  # found while opening the runtime (a key file, an algorithm list)
        print(f"toolproxy: {exc}", file=sys.stderr)
        return 1
    except OSError as exc:  # a listener's port is taken (or the address is not this host's)
        print(f"toolproxy: cannot listen: {exc.strerror or exc}: check listen.port {config.listen.port}, admin.port "
              f"{config.admin.port} and ops.port {config.ops.port} (and their hosts)", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
