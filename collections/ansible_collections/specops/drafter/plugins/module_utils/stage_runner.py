# -*- coding: utf-8 -*-
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""Module side of the stage protocol: run `python -m specops.<stage>` in the ML environment."""

from __future__ import absolute_import, division, print_function

__metaclass__ = type

import json
import os


def run_stage(module, python, stage, request, plan=None, extra_env=None):
    """Run one package stage and return its JSON result; fail the module with a clear message.

    `plan` defaults to the module's check mode: the package then reports what it would do.
    """
    if plan is None:
        plan = module.check_mode
    if not os.path.isfile(python) or not os.access(python, os.X_OK):
        module.fail_json(
            msg="ML environment python %s does not exist or is not executable: "
            "run the fla_env role/module first or set 'python' to an environment with specops" % python
        )
    cmd = [python, "-m", "specops.%s" % stage, "--plan" if plan else "--run"]
    env = dict(os.environ)
    env.update(extra_env or {})
    env.setdefault("PYTHONUNBUFFERED", "1")
    rc, out, err = module.run_command(cmd, data=json.dumps(request), binary_data=True, environ_update=env)
    lines = [line for line in out.strip().splitlines() if line.strip()]
    result = None
    if lines:
        try:
            result = json.loads(lines[-1])
        except ValueError:
            result = None
    if rc == 2 and isinstance(result, dict) and result.get("failed"):
        module.fail_json(msg=result.get("msg", "%s failed" % stage), stderr_tail=err[-4000:])
    if rc != 0 or not isinstance(result, dict):
        module.fail_json(
            msg="specops.%s crashed (exit %s); the end of its error output follows" % (stage, rc),
            cmd=cmd,
            stderr_tail=err[-4000:],
            stdout_tail=out[-2000:],
        )
    return result
