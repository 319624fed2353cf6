# -*- coding: utf-8 -*-
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""file_watch: a wait is woken by an atomic write into a watched directory, not by its timeout."""

from __future__ import absolute_import, division, print_function

__metaclass__ = type

import os
import threading
import time

from ansible_collections.specops.drafter.plugins.module_utils.common.file_watch import FALLBACK_POLL_S, FileWatch


def write_atomically(path, text, after):
    time.sleep(after)
    partial = str(path) + ".tmp"
    with open(partial, "w") as handle:
        handle.write(text)
    os.rename(partial, str(path))


def test_an_atomic_write_wakes_the_wait_long_before_its_timeout(tmp_path):
    target = tmp_path / "work.state"
    with FileWatch([str(target)]) as watch:
        assert watch.notified  # Linux: inotify
        writer = threading.Thread(target=write_atomically, args=(target, '{"state": "finished"}', 0.2))
        started = time.monotonic()
        writer.start()
        while not target.exists():
            watch.wait(300)
        writer.join()
    # Woken by the rename: a timeout would have taken 300 s.
    assert time.monotonic() - started < 150


def test_a_directory_not_there_yet_is_polled_rather_than_missed(tmp_path):
    with FileWatch([str(tmp_path / "later" / "work.state")]) as watch:
        assert not watch.notified
        started = time.monotonic()
        watch.wait(300)
    assert time.monotonic() - started < 150 and FALLBACK_POLL_S < 1
