# -*- coding: utf-8 -*-
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""SGLang's HTTP API as the service window uses it: server info, pause/continue, flush, release/resume, load, health,
weights checksums; and what each SGLang release offers (RELEASES), the one table of version facts on this side.

Standard library only (urllib): the guard calls it outside Ansible, on hosts without requests.
"""

from __future__ import absolute_import, annotations, division, print_function

__metaclass__ = type

import json
import re

from urllib.error import HTTPError, URLError
from urllib.request import Request, urlopen

# The first SGLang this code was read against with pause modes (sglang 0.5.23
# srt/managers/io_struct.py:1927 PauseGenerationReqInput.mode: abort | retract | in_place);
# sglang 0.5.4 srt/entrypoints/http_server.py:1062 pause_generation takes no body: pause = abort all.
FIRST_VERSION_WITH_PAUSE_MODES = (0, 5, 23)

# What each SGLang release offers the window, newest first; a version not listed takes the newest
# entry at or below it. The development server's own table (specops.devserver.versions) is held
# against this one by a test.
# - pause_modes: PauseGenerationReqInput.mode (0.5.23 srt/managers/io_struct.py:1927); 0.5.4's
#   /pause_generation takes no body and aborts (srt/entrypoints/http_server.py:1062).
# - all_tags: what `[]` releases, GPU_MEMORY_ALL_TYPES (0.5.23 srt/constants.py:6 and
#   srt/managers/scheduler_components/weight_updater.py:345-346; 0.5.4
#   srt/managers/scheduler_update_weights_mixin.py:107).
# - admin_api_key: --admin-api-key, the only key of the admin endpoints when set (0.5.23 srt/utils/auth.py:133-141).
# - weights_checker: /weights_checker checksums (0.5.23 srt/entrypoints/http_server.py:1599-1620).
# - weight_cache_mode: --weight-cache-mode; other than off, a release including weights kills the scheduler
#   (0.5.23 srt/managers/scheduler_components/weight_updater.py:293-307, 368-369).
# - grammar_queue_load: /v1/loads?include=queues counts the grammar queue (0.5.23 srt/managers/load_snapshot.py:179-186).
RELEASES = (
    ((0, 5, 23), {"pause_modes": True, "all_tags": ("kv_cache", "weights", "cuda_graph"), "admin_api_key": True,
                  "weights_checker": True, "weight_cache_mode": True, "grammar_queue_load": True}),
    ((0, 5, 4), {"pause_modes": False, "all_tags": ("weights", "kv_cache"), "admin_api_key": False,
                 "weights_checker": False, "weight_cache_mode": False, "grammar_queue_load": False}),
)

# Endpoints that only the admin key opens when the server has one (0.5.23 srt/entrypoints/http_server.py ADMIN_OPTIONAL:
# 1026 flush, 1301 update_weights_from_disk, 1576 release, 1588 resume, 1600 weights_checker, 1832 pause, 1845 continue).
ADMIN_PATHS = ("/flush_cache", "/update_weights_from_disk", "/release_memory_occupation", "/resume_memory_occupation",
               "/weights_checker", "/pause_generation", "/continue_generation")

# Server arguments that are secrets: /server_info returns every argument, both keys included (0.5.23
# srt/server_args.py:316-333 redacts only watermark secrets); they never leave SglangApi.
SECRET_ARGUMENTS = ("api_key", "admin_api_key")

# Draft and target weights share the `weights` tag (their backups are --enable-weights-cpu-backup and
# --enable-draft-weights-cpu-backup); released without a backup their content is thrown away
# (torch_memory_saver; sglang 0.5.23 srt/managers/scheduler_components/weight_updater.py:345-366).
WEIGHT_TAGS = ("weights",)


def parse_version(text) -> tuple[int, ...] | None:
    """(0, 5, 23) from "0.5.23", "0.5.23.post1" or "v0.5.23rc0"; None for anything else (a stand-in's name)."""
    match = re.match(r"v?(\d+)\.(\d+)(?:\.(\d+))?", str(text or ""))
    if not match:
        return None
    return tuple(int(part or 0) for part in match.groups())


def has_pause_modes(version) -> bool:
    parsed = parse_version(version)
    return parsed is not None and parsed >= FIRST_VERSION_WITH_PAUSE_MODES


def release_facts(version) -> dict:
    """RELEASES' entry for a version (the newest at or below it; the newest for a name it cannot read)."""
    parsed = parse_version(version)
    for first, facts in RELEASES:
        if parsed is None or parsed >= first:
            return facts
    return RELEASES[-1][1]


def release_tags_keeping_weights(version) -> tuple:
    """The tags that free the GPU without moving the weights: every tag of the version but `weights`."""
    return tuple(tag for tag in release_facts(version)["all_tags"] if tag not in WEIGHT_TAGS)


def offers(version, feature: str) -> bool:
    """Whether the SGLang release `version` offers `feature` (a key of RELEASES' entries)."""
    return bool(release_facts(version).get(feature))


def redacted(info: dict) -> dict:
    """Server info without its secrets, before anything stores, logs or returns it."""
    return dict((key, "<redacted>" if key in SECRET_ARGUMENTS and value else value) for key, value in info.items())


def releases_weights(tags) -> bool:
    """An empty tag list means every tag (sglang 0.5.23 srt/managers/io_struct.py ReleaseMemoryOccupationReqInput)."""
    return not tags or any(tag in WEIGHT_TAGS for tag in tags)


class Answer(object):
    """One HTTP answer; status -1 when nothing answered (refused, timed out)."""

    __slots__ = ("status", "text")

    def __init__(self, status: int, text: str) -> None:
        self.status = status
        self.text = text

    @property
    def ok(self) -> bool:
        return self.status == 200

    def json(self, default=None):
        try:
            return json.loads(self.text)
        except ValueError:
            return default

    def describe(self) -> str:
        if self.status == -1:
            return "no answer (%s)" % self.text[:200]
        return "HTTP %d %s" % (self.status, self.text.strip()[:300])


class SglangApi(object):
    """One server's API, with its keys as `Authorization: Bearer`: the admin key on the admin endpoints when given,
    the api key everywhere else (sglang 0.5.23 srt/utils/auth.py:74-151: /health, /ready and /metrics need no key;
    with --admin-api-key set the admin endpoints refuse the api key; 0.5.4 has only --api-key, on every endpoint but
    /health and /metrics, srt/utils/common.py:1129)."""

    def __init__(self, url: str, api_key: str = "", timeout: float = 30.0, admin_api_key: str = "") -> None:
        self.url = url.rstrip("/")
        self.api_key = api_key or ""
        self.admin_api_key = admin_api_key or ""
        self.timeout = timeout

    def key_for(self, path: str) -> str:
        if self.admin_api_key and path.split("?")[0] in ADMIN_PATHS:
            return self.admin_api_key
        return self.api_key

    def call(self, path: str, body=None, timeout: float | None = None) -> Answer:
        data = None if body is None else json.dumps(body).encode("utf-8")
        headers = {"Content-Type": "application/json"}
        key = self.key_for(path)
        if key:
            headers["Authorization"] = "Bearer %s" % key
        request = Request(self.url + path, data=data, headers=headers, method="GET" if data is None else "POST")
        try:
            with urlopen(request, timeout=timeout or self.timeout) as response:
                return Answer(response.status, response.read().decode("utf-8", "replace"))
        except HTTPError as error:
            return Answer(error.code, error.read().decode("utf-8", "replace"))
        except (URLError, OSError, ValueError) as error:
            return Answer(-1, str(getattr(error, "reason", error)))

    def server_info(self) -> dict | None:
        """/server_info (0.5.23, http_server.py:863), else /get_server_info (0.5.4, http_server.py:496); its keys
        redacted."""
        for path in ("/server_info", "/get_server_info"):
            answer = self.call(path)
            if answer.ok and isinstance(answer.json(), dict):
                return redacted(answer.json())
            if answer.status in (401, 403):
                break
        return None

    def server_info_answer(self) -> Answer:
        """The answer that explains why server_info() found nothing (never one that carries the info)."""
        answer = self.call("/server_info")
        return Answer(answer.status, "(server info)") if answer.ok else answer

    def weights_checksum(self) -> str | None:
        """The server's checksum over its loaded weights (0.5.23 /weights_checker action checksum,
        per_engine_checksum); None where the server does not answer one."""
        answer = self.call("/weights_checker", {"action": "checksum"}, timeout=600)
        body = answer.json() if answer.ok else None
        checksum = body.get("per_engine_checksum") if isinstance(body, dict) and body.get("success") else None
        return checksum if isinstance(checksum, str) else None

    def grammar_queue(self) -> int | None:
        """Constrained requests waiting for their grammar (0.5.23 /v1/loads?include=queues); None where not said."""
        answer = self.call("/v1/loads?include=queues")
        body = answer.json() if answer.ok else None
        ranks = body.get("loads") if isinstance(body, dict) else None
        total = 0
        try:
            for rank in ranks or []:
                total += int(rank["queues"]["grammar"])
        except (KeyError, TypeError, ValueError):
            return None
        return total if ranks else None

    def pause(self, mode: str | None) -> Answer:
        """mode None: the body-less pause of versions without modes, which aborts every request."""
        return self.call("/pause_generation", {} if mode is None else {"mode": mode})

    def continue_generation(self) -> Answer:
        # Only /continue_generation ends a pause, also after a resume (sglang 0.5.23 http_server.py:1846).
        return self.call("/continue_generation", {})

    def flush_cache(self) -> Answer:
        # 400 while requests run or wait (sglang 0.5.23 http_server.py:1027; 0.5.4 http_server.py:610).
        return self.call("/flush_cache", {})

    def release(self, tags: list) -> Answer:
        return self.call("/release_memory_occupation", {"tags": list(tags) or None}, timeout=600)

    def resume(self, tags: list) -> Answer:
        return self.call("/resume_memory_occupation", {"tags": list(tags) or None}, timeout=600)

    def running_requests(self) -> int | None:
        """Requests running or waiting per /get_load (0.5.4 http_server.py:510, GetLoadReqOutput
        num_reqs + num_waiting_reqs per dp rank); None when the server does not say."""
        answer = self.call("/get_load")
        ranks = answer.json() if answer.ok else None
        if isinstance(ranks, dict):
            ranks = [ranks]
        if not isinstance(ranks, list):
            return None
        try:
            return sum(int(rank.get("num_reqs", 0)) + int(rank.get("num_waiting_reqs", 0)) for rank in ranks)
        except (AttributeError, TypeError, ValueError):
            return None

    def generate_one_token(self, timeout: float) -> Answer:
        """A greedy 1-token /generate: 200 the moment a token comes back through the tokenizer, scheduler and
        detokenizer. /health_generate proves the same but answers only on a whole second after it began
        (0.5.23 entrypoints/http_server.py:779-781), so a window that ends on it stays down up to a second
        longer than the service; the window's end is read with this instead."""
        return self.call("/generate", {"input_ids": [0], "sampling_params": {"max_new_tokens": 1, "temperature": 0.0}},
                         timeout=timeout)

    def health_generate(self, timeout: float) -> Answer:
        # A 1-token generation; while paused it waits HEALTH_CHECK_TIMEOUT (20 s) and answers 503
        # (sglang 0.5.23 http_server.py:218, :723).
        return self.call("/health_generate", timeout=timeout)
