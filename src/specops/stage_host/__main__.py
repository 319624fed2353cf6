"""`python -m specops.stage_host --socket PATH --key KEY [--idle S]`: started by the collection's client."""

import argparse

from specops.stage_host.server import run

parser = argparse.ArgumentParser(prog="python -m specops.stage_host")
parser.add_argument("--socket", required=True, help="the Unix socket to serve at")
parser.add_argument("--key", required=True, help="the environment this host was started for")
parser.add_argument("--idle", type=float, default=120.0, help="seconds without a call before it exits")
args = parser.parse_args()
raise SystemExit(run(args.socket, args.key, args.idle))
