# -*- coding: utf-8 -*-
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)

from __future__ import absolute_import, division, print_function

__metaclass__ = type


class ModuleDocFragment(object):
    # The options of module_utils/stages/stage_runner.py STAGE_OPTIONS, shared by every stage module.
    DOCUMENTATION = r"""
options:
  python:
    description:
      - The ML environment's interpreter, with specops and the libraries the stage needs (torch,
        transformers, fla), as built by M(specops.drafter.fla_env).
      - The module runs C(python -m specops.<stage>) with it, the request as JSON on stdin.
    type: path
    required: true
notes:
  - The module needs no third-party Python library on the host; the work runs in O(python).
  - The stage runs forked from a stage host, C(python -m specops.stage_host), a process in O(python) that
    has torch and transformers imported, instead of importing them anew (2.5-3.5 CPU seconds a call). The
    first call for an environment starts it and runs without it; it ends after 5 idle minutes. A stage in a
    systemd scope starts anew; C(SPECOPS_STAGE_HOST=0) in the task's environment turns the host off. The
    window's work goes through the host as well, and the guard finds its forked stage by the standard
    streams it shares with its caller, which carries C(SPECOPS_WINDOW_TOKEN).
"""
