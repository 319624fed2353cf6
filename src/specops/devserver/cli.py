"""`python -m specops.devserver`: SGLang's launch flags, listening at once, ready after warmup."""

from __future__ import annotations

import argparse
import errno
import logging
import os
import signal
import sys
import threading
from pathlib import Path

from specops.devserver.engine import Engine
from specops.devserver.memory import MemorySaver
from specops.devserver.process_tree import ProcessTree, device_files_for
from specops.devserver.routes import App, DevHTTPServer
from specops.devserver.speculative import ALGORITHM
from specops.devserver.versions import DEFAULT_VERSION, VERSIONS, SGLangVersion

logger = logging.getLogger("specops.devserver")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m specops.devserver",
        description="Serve a causal LM from a directory behind SGLang's HTTP API (development stand-in).",
    )
    parser.add_argument(
        "--model-path", required=True, help="directory with config.json, weights and tokenizer"
    )
    parser.add_argument(
        "--tokenizer-path", default=None, help="reported by /get_model_info (default: model path)"
    )
    parser.add_argument("--served-model-name", default=None, help="name listed by /v1/models")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=30000)
    parser.add_argument(
        "--startup-delay",
        type=float,
        default=0.0,
        help="seconds to stay 'starting' after loading, to mimic a large model's startup",
    )
    parser.add_argument("--device", default="cpu", help="torch device for the model (cpu, cuda, cuda:1 ...)")
    parser.add_argument(
        "--num-threads",
        type=int,
        default=1,
        help="torch CPU threads (default 1: small models gain little from more; contended cores lose a lot)",
    )
    parser.add_argument("--weight-version", default="default", help="reported by /get_model_info")
    parser.add_argument(
        "--tp-size",
        "--tensor-parallel-size",
        type=int,
        default=1,
        help="above 1: run SGLang's process tree, one scheduler child per rank holding its device and a "
        "detokenizer (process_tree.py); the model computes in the launcher, on CPU only",
    )
    parser.add_argument(
        "--device-file",
        default=None,
        help="with --tp-size > 1 on CPU: the file each scheduler rank holds as its GPU, with {rank} "
        "in it (e.g. /tmp/devs/nvidia{rank}), as a GPU holder scan sees it",
    )
    parser.add_argument(
        "--enable-memory-saver",
        action="store_true",
        help="allow /release_memory_occupation and /resume_memory_occupation",
    )
    parser.add_argument(
        "--mem-fraction-static",
        type=float,
        default=0.88,
        help="share of the device the weights and the KV pool take, as in SGLang (the KV pool fills it)",
    )
    parser.add_argument(
        "--device-memory-gib",
        type=float,
        default=0.0,
        help="on the CPU: lay the weights, KV pool and CUDA graphs out on a simulated device of this size "
        "and report them in /server_info as SGLang does (0: no device, no free memory reported)",
    )
    parser.add_argument(
        "--enable-weights-cpu-backup",
        action="store_true",
        help="keep a CPU copy of released weights so resume needs no disk read",
    )
    parser.add_argument(
        "--speculative-algorithm",
        default=None,
        help="DFLASH: speculate on greedy requests with the drafter at --speculative-draft-model-path "
        "and report spec_verify_ct / spec_accept_length / spec_accept_rate; any other value is only recorded",
    )
    parser.add_argument(
        "--speculative-draft-model-path",
        default=None,
        help="DFlash drafter checkpoint (config.json + safetensors)",
    )
    parser.add_argument(
        "--speculative-num-draft-tokens",
        type=int,
        default=None,
        help="DFlash block size, verified token included (default: the drafter's block_size)",
    )
    parser.add_argument(
        "--sglang-version",
        default=DEFAULT_VERSION,
        choices=sorted(VERSIONS),
        help="the SGLang release whose answers and failures to imitate (pause modes, flush, release, "
        "load and info endpoints)",
    )
    parser.add_argument(
        "--api-key",
        default=None,
        help="require `Authorization: Bearer KEY` on every endpoint but health, ready and metrics, as SGLang "
        "does (on the admin endpoints only when --admin-api-key is not set)",
    )
    parser.add_argument(
        "--admin-api-key",
        default=None,
        help="0.5.23: the only key that opens the admin endpoints (pause, continue, flush, release, resume, "
        "weights_checker), where --api-key is then refused",
    )
    parser.add_argument(
        "--weight-cache-mode",
        default="off",
        help="0.5.23: off, daemon or client; not off: a release that includes weights kills the server",
    )
    parser.add_argument(
        "--max-running-requests",
        type=int,
        default=0,
        help="the running batch's size: a request beyond it waits in the queue until one ends (0: no bound, "
        "every new request joins at the next step)",
    )
    parser.add_argument(
        "--grammar-compile-delay",
        type=float,
        default=0.0,
        help="seconds a constrained request (regex, json_schema, ebnf) spends in the grammar queue before it "
        "can be scheduled (the tokens are not constrained)",
    )
    parser.add_argument(
        "--forgiving",
        action="store_true",
        help="lenient development mode: listen before loading, answer 400 where SGLang's scheduler "
        "crashes (release while busy, resume of an unreleased tag) or serves garbage (weights released "
        "without --enable-weights-cpu-backup), refuse memory calls without --enable-memory-saver, and "
        "serve every info and load path; by default the server fails as SGLang fails",
    )
    parser.add_argument(
        "--release-fault-file",
        default=None,
        help="for tests: a file naming a fault (busy, unanswered, lost) to inject into each release, read at "
        "each release (release_faults.py)",
    )
    parser.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    return parser


def _draft_model_path(args: argparse.Namespace) -> tuple[str | None, str | None]:
    """(the drafter to speculate with or None, the message to exit 2 with or None)."""
    algorithm = (args.speculative_algorithm or "").upper()
    if algorithm != ALGORITHM:
        if algorithm:
            logger.warning(
                "--speculative-algorithm %s is recorded only: this server speculates with %s",
                args.speculative_algorithm,
                ALGORITHM,
            )
        return None, None
    path = args.speculative_draft_model_path
    if not path:
        return None, (
            f"--speculative-algorithm {ALGORITHM} needs --speculative-draft-model-path: "
            "point it at the DFlash drafter checkpoint directory"
        )
    if not (Path(path) / "config.json").is_file():
        return None, (
            f"--speculative-draft-model-path {path} has no config.json: point it at a DFlash "
            "drafter checkpoint directory (config.json + safetensors)"
        )
    return path, None


def _version_problem(args: argparse.Namespace, version: SGLangVersion) -> str | None:
    """A flag the imitated release does not have (its own argument parser would refuse it)."""
    if args.admin_api_key and not version.admin_paths:
        return f"--admin-api-key: SGLang {version.name} has no such flag (0.5.23 has it)"
    if args.weight_cache_mode not in version.weight_cache_modes:
        return (
            f"--weight-cache-mode {args.weight_cache_mode}: SGLang {version.name} takes "
            f"{', '.join(version.weight_cache_modes)}"
        )
    return None


def _bind(host: str, port: int) -> DevHTTPServer | str:
    """The listening server, or the message to exit with."""
    try:
        return DevHTTPServer((host, port))
    except OSError as error:
        if error.errno == errno.EADDRINUSE:
            return (
                f"port {port} on {host} is already in use by another process: stop it "
                f"(`ss -ltnp 'sport = :{port}'` shows which) or pass another --port"
            )
        return f"cannot listen on {host}:{port}: {error.strerror or error}"


def _start(engine: Engine, delay: float, stop: threading.Event, failure: list[str], load: bool) -> None:
    """Load (unless done), wait out the startup delay, warm up; only then /health_generate is 200."""
    try:
        if load:
            engine.load()
        if delay > 0:
            logger.info("startup delay: %.1f s", delay)
            if stop.wait(delay):
                return
        engine.warmup()
        engine.mark_up()
    except Exception as error:  # any load failure ends the server: it can never become ready
        logger.exception("startup failed")
        failure.append(f"cannot start serving {engine.model_path}: {error}")
        stop.set()


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="[%(asctime)s] %(message)s", stream=sys.stderr)
    model_dir = Path(args.model_path)
    if not (model_dir / "config.json").is_file():
        print(
            f"devserver: --model-path {model_dir} has no config.json: point it at a model directory "
            "saved with save_pretrained",
            file=sys.stderr,
        )
        return 2

    draft_path, problem = _draft_model_path(args)
    if problem:
        print(f"devserver: {problem}", file=sys.stderr)
        return 2

    version = VERSIONS[args.sglang_version]
    problem = _version_problem(args, version)
    if problem:
        print(f"devserver: {problem}", file=sys.stderr)
        return 2

    # SGLang logs every argument at start, both keys included (0.5.23 entrypoints/engine.py:173-174, :311):
    # whoever quotes this log must redact them.
    logger.info("server_args=%s", dict(vars(args)))

    try:
        device_files = device_files_for(args.device_file, args.tp_size)
    except ValueError as error:
        print(f"devserver: {error}", file=sys.stderr)
        return 2
    if args.tp_size > 1 and args.device.startswith("cuda"):
        print(
            f"devserver: --tp-size {args.tp_size} runs on CPU only: its scheduler children hold the devices "
            "while the model computes in the launcher, which on CUDA would hold the GPU memory itself; "
            "use --tp-size 1 on CUDA",
            file=sys.stderr,
        )
        return 2

    strict = not args.forgiving
    # Before torch is imported, so its thread pool starts at this size.
    os.environ["OMP_NUM_THREADS"] = str(args.num_threads)
    engine = Engine(
        str(model_dir),
        device=args.device,
        weight_version=args.weight_version,
        num_threads=args.num_threads,
        draft_model_path=draft_path,
        num_draft_tokens=args.speculative_num_draft_tokens,
    )
    engine.grammar_compile_delay = args.grammar_compile_delay
    engine.max_running_requests = args.max_running_requests
    engine.idle_needs_empty_grammar_queue = version.idle_needs_empty_grammar_queue
    if not version.reads_waiting_timeout:
        engine.waiting_timeout = -1.0
    memory = MemorySaver(
        engine,
        args.enable_memory_saver,
        args.enable_weights_cpu_backup,
        strict=strict,
        version=version,
        mem_fraction_static=args.mem_fraction_static,
        simulated_device_gib=args.device_memory_gib,
        weight_cache_mode=args.weight_cache_mode,
    )
    engine.place_model = memory.place
    # SGLang's launcher spawns its children before the weights load (entrypoints/engine.py).
    tree = ProcessTree(args.tp_size, device_files) if args.tp_size > 1 else None
    memory.ranks = tree
    if strict:
        # SGLang starts its HTTP server only after every scheduler has loaded its weights
        # (entrypoints/http_server.py `launch_server` at sgl-project/sglang 0025436e): a connection
        # refused means "loading or dead", never "up".
        try:
            engine.load()
        except Exception as error:  # any load failure ends the server before it listens
            logger.exception("startup failed")
            print(f"devserver: cannot start serving {engine.model_path}: {error}", file=sys.stderr)
            return 1
    server = _bind(args.host, args.port)
    if isinstance(server, str):
        print(f"devserver: {server}", file=sys.stderr)
        return 1
    server.app = App(
        engine=engine,
        memory=memory,
        server_args=dict(vars(args)),
        strict=strict,
        version=version,
        api_key=args.api_key,
        admin_api_key=args.admin_api_key,
    )
    stop = threading.Event()
    failure: list[str] = []

    def shut_down(*_: object) -> None:
        # Child exits are expected once the launcher shuts down, not crashes: SGLang stops its watchdog
        # then (0.5.23 managers/tokenizer_manager.py:3542-3544). A supervisor's stop signals the children
        # too (systemd's control group), and the tree must still end cleanly.
        if tree is not None:
            tree.stop_watching()
        stop.set()

    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, shut_down)

    serving = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.2}, name="http")
    serving.start()
    logger.info("listening on http://%s:%d (starting)", args.host, args.port)
    threading.Thread(
        target=_start,
        args=(engine, args.startup_delay, stop, failure, not strict),
        name="startup",
        daemon=True,
    ).start()

    # A timed wait keeps the main thread responsive to signals.
    while not stop.wait(0.5):
        pass
    engine.begin_shutdown()
    logger.info("shutting down: health answers 503, waiting for %d in-flight request(s)", engine.pending)
    engine.wait_idle()
    server.shutdown()
    serving.join()
    server.server_close()
    if tree is not None:
        tree.stop()
    if failure:
        print(f"devserver: {failure[0]}", file=sys.stderr)
        return 1
    logger.info("stopped")
    return 0
