# -*- coding: utf-8 -*-
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""SGLang's HTTP API as the service window uses it: server info, pause/continue, flush, release/resume, load, health.

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
RELEASES = (
    ((0, 5, 23), {"pause_modes": True, "all_tags": ("kv_cache", "weights", "cuda_graph")}),
    ((0, 5, 4), {"pause_modes": False, "all_tags": ("weights", "kv_cache")}),
)

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
    """One server's API; the api key goes as `Authorization: Bearer` on every call
    (sglang 0.5.23 srt/entrypoints/http_server.py:2884 add_api_key_middleware guards every endpoint)."""

    def __init__(self, url: str, api_key: str = "", timeout: float = 30.0) -> None:
        self.url = url.rstrip("/")
        self.api_key = api_key or ""
        self.timeout = timeout

    def call(self, path: str, body=None, timeout: float | None = None) -> Answer:
        data = None if body is None else json.dumps(body).encode("utf-8")
        headers = {"Content-Type": "application/json"}
        if self.api_key:
            headers["Authorization"] = "Bearer %s" % self.api_key
        request = Request(self.url + path, data=data, headers=headers, method="GET" if data is None else "POST")
        try:
            with urlopen(request, timeout=timeout or self.timeout) as response:
                return Answer(response.status, response.read().decode("utf-8", "replace"))
        except HTTPError as error:
            return Answer(error.code, error.read().decode("utf-8", "replace"))
        except (URLError, OSError, ValueError) as error:
            return Answer(-1, str(getattr(error, "reason", error)))

    def server_info(self) -> dict | None:
        """/server_info (0.5.23, http_server.py:863), else /get_server_info (0.5.4, http_server.py:496)."""
        for path in ("/server_info", "/get_server_info"):
            answer = self.call(path)
            if answer.ok and isinstance(answer.json(), dict):
                return answer.json()
            if answer.status in (401, 403):
                break
        return None

    def server_info_answer(self) -> Answer:
        """The answer that explains why server_info() found nothing."""
        return self.call("/server_info")

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

    def health_generate(self, timeout: float) -> Answer:
        # A 1-token generation; while paused it waits HEALTH_CHECK_TIMEOUT (20 s) and answers 503
        # (sglang 0.5.23 http_server.py:218, :723).
        return self.call("/health_generate", timeout=timeout)
