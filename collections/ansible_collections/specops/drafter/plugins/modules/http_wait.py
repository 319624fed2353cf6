#!/usr/bin/python
# -*- coding: utf-8 -*-
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)

from __future__ import absolute_import, division, print_function

__metaclass__ = type

DOCUMENTATION = r"""
---
module: http_wait
short_description: Wait quietly until a URL answers an expected status
version_added: "0.1.0"
description:
  - Sends GET requests to O(url) until one answers a status in O(status_code), up to O(retries)
    more tries O(delay) seconds apart, inside one task. An C(until) loop over M(ansible.builtin.uri)
    prints a C(FAILED - RETRYING) line for every try of a server that is simply still starting;
    this module prints nothing while it waits, and fails only when the last try failed.
  - A refused or timed-out connection counts as status V(-1), as M(ansible.builtin.uri) reports it.
author:
  - specops maintainers (@specops)
options:
  url:
    description: The URL to GET.
    type: str
    required: true
  status_code:
    description: Statuses that end the wait.
    type: list
    elements: int
    default: [200]
  timeout:
    description: Seconds one request may take.
    type: int
    default: 30
  retries:
    description: Tries after the first.
    type: int
    default: 60
  delay:
    description: Seconds between two tries.
    type: float
    default: 1.0
attributes:
  check_mode:
    support: full
    description: Only sends GET requests.
  diff_mode:
    support: none
    description: Changes nothing.
  platform:
    support: full
    platforms: posix
    description: Runs wherever the URL can be reached from.
"""

EXAMPLES = r"""
- name: Wait until SGLang answers /health_generate (it opens its port before it is ready)
  specops.drafter.http_wait:
    url: http://127.0.0.1:30000/health_generate
    retries: 600
    delay: 2
"""

RETURN = r"""
status:
  description: The last status, V(-1) for a refused or timed-out connection.
  returned: always
  type: int
attempts:
  description: Requests sent.
  returned: always
  type: int
"""

import time
from urllib.error import HTTPError

from ansible.module_utils.basic import AnsibleModule
from ansible.module_utils.urls import open_url


def probe(url, timeout):
    try:
        return open_url(url, method="GET", timeout=timeout).getcode()
    except HTTPError as error:
        return error.code
    except Exception:  # refused, reset, timed out, DNS: not answering yet
        return -1


def main():
    module = AnsibleModule(
        argument_spec=dict(
            url=dict(type="str", required=True),
            status_code=dict(type="list", elements="int", default=[200]),
            timeout=dict(type="int", default=30),
            retries=dict(type="int", default=60),
            delay=dict(type="float", default=1.0),
        ),
        supports_check_mode=True,
    )
    params = module.params
    attempts = 0
    status = -1
    for attempt in range(params["retries"] + 1):
        if attempt:
            time.sleep(params["delay"])
        attempts += 1
        status = probe(params["url"], params["timeout"])
        if status in params["status_code"]:
            module.exit_json(changed=False, status=status, attempts=attempts)
    module.fail_json(msg="%s answered %s after %d tries %s s apart; expected %s"
                     % (params["url"], status, attempts, params["delay"], params["status_code"]),
                     status=status, attempts=attempts)


if __name__ == "__main__":
    main()
