"""The ``llm_api`` command (a console script of the package): ``llm_api serve``.

``llm_api serve [--host 127.0.0.1] [--port 8000] [--grpc-port 50051] [--key-file llm_api.key] [--no-auth]
[--ssl-keyfile KEY --ssl-certfile CERT [--ssl-ca-certs CA]]``
serves the model the environment's settings describe (the same variables as under TorchServe, see
README), without TorchServe. The ``--ssl-*`` options are settings declared with a flag (``Setting.flag``:
``SSL_KEYFILE``, ...), added here from their declarations; one given wins over its variable. A bad setting,
flag or TLS file stops it before anything loads and before a port opens, with a message naming it (exit 2);
a model that fails to load exits 1; a stop by SIGTERM/SIGINT after the drain exits 0.
``--ray [--replicas N] [--max-replicas M [--autoscaling-config JSON]] [--cpus-per-replica C] [--routing prefix|random]
[--ray-address A]``
serves the same routes as a Ray Serve application instead (``llm_api.scale_out``; docs/scale-out.md), HTTPS
from Ray's proxy with ``--ssl-keyfile``/``--ssl-certfile``; ``--ssl-ca-certs`` is refused there (exit 2):
Ray Serve 2.60 hands its proxy (uvicorn) the CA file but not ``ssl_cert_reqs``, so uvicorn's default,
no client certificate asked, would serve every client while the flag promised mutual TLS.
"""

from __future__ import annotations

import argparse
import asyncio
import ipaddress
import json
import logging
import sys
from pathlib import Path

from llm_api.model import preflight
from llm_api.model.settings import ConfigError, Settings, declared_settings
from llm_api.server.log_format import LOG_FORMAT
from llm_api.server.tls import load_server_tls


def _port(allow_zero: bool):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a port number") from None
        low = 0 if allow_zero else 1
        if not low <= value <= 65535:
            raise argparse.ArgumentTypeError(f"{value} is not a port number ({low} to 65535)")
        return value

    return parse


def _count(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a count (1 or more)")
    return int(text)


def _json_object(text: str) -> dict:
    try:
        value = json.loads(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text[:100]!r} is not JSON") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"{text[:100]!r} is not a JSON object")
    return value


def _host(text: str) -> str:
    if text == "localhost":
        return text
    try:
        ipaddress.ip_address(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an IP address (e.g. 127.0.0.1, 0.0.0.0, ::1)") from None
    return text


def parser() -> argparse.ArgumentParser:
    main = argparse.ArgumentParser(prog="llm_api", description="llm_api: serve a Hugging Face causal LM")
    commands = main.add_subparsers(dest="command", required=True)
    serve = commands.add_parser(
        "serve", help="serve the model over HTTP and gRPC without TorchServe",
        description="Serve the model (settings from the environment, see README) over HTTP (native, OpenAI, "
                    "tokenizer, /health, /ready, /metrics) and TorchServe's gRPC inference API.")
    serve.add_argument("--host", type=_host, default="127.0.0.1",
                       help="address to listen on (default 127.0.0.1: this machine only; 0.0.0.0 in a container)")
    serve.add_argument("--port", type=_port(False), default=8000, help="HTTP port (default 8000)")
    serve.add_argument("--grpc-port", type=_port(True), default=50051, help="gRPC port (default 50051; 0: none)")
    serve.add_argument("--key-file", type=Path, default=Path("llm_api.key"),
                       help="where a generated bearer key is written when LLM_API_KEY is unset (default ./llm_api.key)")
    serve.add_argument("--no-auth", action="store_true",
                       help="serve without a bearer key (only behind a gateway that authenticates)")
    serve.add_argument("--served-model-name", nargs="+", metavar="NAME", default=None,
                       help="more names the model answers to in 'model' (SERVED_MODEL_NAME; MODEL_NAME stays its first)")
    flagged = serve.add_argument_group("settings also given as flags (over their variables; README, Configuration)")
    for declared in declared_settings().values():
        if declared.flag:
            flagged.add_argument(declared.flag, dest=declared.env, default=None, metavar="PATH",
                                 help=f"{declared.flag_help} (the variable {declared.env})")
    ray = serve.add_argument_group("Ray Serve (pip install 'llm_api[ray]'; docs/scale-out.md)")
    ray.add_argument("--ray", action="store_true",
                     help="serve as a Ray Serve application: model replicas behind Ray's HTTP proxy and a "
                          "prefix-affinity router (no gRPC listener)")
    ray.add_argument("--replicas", type=_count, default=1, help="model replicas (default 1; with --max-replicas: "
                                                                "the fewest)")
    ray.add_argument("--max-replicas", type=_count, default=None,
                     help="autoscale up to this many replicas on requests in flight (default: no autoscaling)")
    ray.add_argument("--autoscaling-config", type=_json_object, default={}, metavar="JSON",
                     help="with --max-replicas: fields of Ray Serve's AutoscalingConfig over ours (a target of "
                          "MAX_NUM_SEQS requests in flight per replica, 10 s up, 120 s down), e.g. "
                          "'{\"downscale_delay_s\": 600}'")
    ray.add_argument("--cpus-per-replica", type=float, default=1.0,
                     help="CPUs each replica reserves (its torch threads; default 1)")
    ray.add_argument("--routing", choices=("prefix", "random"), default="prefix",
                     help="prefix: to the replica holding the prompt's prefix while load is balanced (default); "
                          "random: the less loaded of two at random")
    ray.add_argument("--ray-address", default=None,
                     help="a running Ray cluster to join (default RAY_ADDRESS, else a local one is started)")
    return main


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    flags = {declared.env: getattr(args, declared.env) for declared in declared_settings().values()
             if declared.flag and getattr(args, declared.env) is not None}
    if args.served_model_name is not None:  # (the flag wins over the variable, as for every flag)
        flags["SERVED_MODEL_NAME"] = " ".join(args.served_model_name)
    try:
        settings = Settings.from_env(flags=flags)
        if args.ray and settings.ssl_ca_certs:
            raise ConfigError("SSL_CA_CERTS (--ssl-ca-certs) is not served under --ray: Ray Serve 2.60 gives its "
                              "proxy the CA file but does not make it require a client certificate, so every client "
                              "would be served; use llm_api serve without --ray for mutual TLS, or a proxy that "
                              "checks client certificates in front of --ray")
        tls = load_server_tls(settings)  # (a bad TLS file stops the command here, before torch or Ray loads)
    except ConfigError as err:
        print(f"llm_api: {err}", file=sys.stderr)
        return 2
    if args.grpc_port and args.grpc_port == args.port:
        print(f"llm_api: --port and --grpc-port are both {args.port}; give them different ports", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format=LOG_FORMAT)
    if args.ray:
        if args.max_replicas is not None and args.max_replicas < args.replicas:
            print(f"llm_api: --max-replicas {args.max_replicas} is below --replicas {args.replicas}", file=sys.stderr)
            return 2
        try:
            from llm_api.scale_out.run import serve_on_ray
        except ImportError as err:
            print(f"llm_api: --ray needs Ray Serve (pip install 'llm_api[ray]'): {err}", file=sys.stderr)
            return 2
        from llm_api.scale_out.deployments import Scaling, autoscaling_config

        scaling = Scaling(args.replicas, args.max_replicas, args.cpus_per_replica, args.routing,
                          args.autoscaling_config)
        try:
            preflight.check(settings)  # (a bad model file or setting: refused before a cluster starts)
            autoscaling_config(settings, scaling)  # (refused here, before a cluster starts)
        except ValueError as err:
            print(f"llm_api: {err}", file=sys.stderr)
            return 2
        return serve_on_ray(settings, args.host, args.port, args.key_file, not args.no_auth, scaling,
                            args.ray_address, tls)
    from llm_api.server.server import ServeOptions, serve  # (imports torch: after the cheap checks)

    options = ServeOptions(host=args.host, port=args.port, grpc_port=args.grpc_port, key_file=args.key_file,
                           auth=not args.no_auth, tls=tls)
    try:
        return asyncio.run(serve(settings, options))
    except OSError as err:  # a port in use, an address not on this machine
        print(f"llm_api: cannot listen: {err}", file=sys.stderr)
        return 1
