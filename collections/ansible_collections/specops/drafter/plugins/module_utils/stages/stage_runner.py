# -*- coding: utf-8 -*-
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""Module side of the stage protocol: run `python -m specops.<stage>` in the ML environment."""

from __future__ import absolute_import, division, print_function

__metaclass__ = type

import json
import os

from ansible.module_utils.basic import AnsibleModule
from ansible_collections.specops.drafter.plugins.module_utils.stages import stage_host

# The options every stage module has besides its request; documented once in doc_fragments/stage.py.
STAGE_OPTIONS = dict(
    python=dict(type="path", required=True),
)


def stage_module(request_options, **kwargs):
    """The AnsibleModule of a stage: the shared options plus the stage's request options, check mode supported."""
    argument_spec = dict(STAGE_OPTIONS)
    argument_spec.update(request_options)
    return AnsibleModule(argument_spec=argument_spec, supports_check_mode=True, **kwargs)


def stage_request(module, request_options):
    """The stage's request: each request option that is set (the package applies its defaults to the rest)."""
    return dict((key, module.params[key]) for key in request_options if module.params[key] is not None)


def stage_result(module, stage, request_options, figures=None, renamed=None, optional=(),
                 wrap=None, extra_env=None, nice=0):
    """Run the stage with the module's request and return the module's result.

    With `figures` (key -> value when the package leaves it out), the result is those keys, `changed`
    and the package's `msg`; `renamed` (package key -> figure key) takes a figure from a key the
    package names otherwise; `optional` keys are returned only when the package gives them. Without
    `figures`, it is the package's result as it came. `wrap` turns the command into the one run (a
    systemd scope); `nice` lowers its priority (`nice -n`); `extra_env` is added to its environment.
    """
    outcome = run_stage(module, module.params["python"], stage, stage_request(module, request_options),
                        extra_env=extra_env, wrap=wrap, nice=nice)
    if figures is None:
        outcome.setdefault("changed", False)
        return outcome
    result = dict(figures)
    result.update((key, outcome[key]) for key in figures if key in outcome)
    result.update((key, outcome[source]) for source, key in (renamed or {}).items() if source in outcome)
    result.update((key, outcome[key]) for key in optional if key in outcome)
    result["changed"] = bool(outcome.get("changed"))
    if outcome.get("msg"):
        result["msg"] = outcome["msg"]
    return result


def run_stage(module, python, stage, request, plan=None, extra_env=None, wrap=None, nice=0):
    """Run one package stage and return its JSON result; fail the module with a clear message.

    `plan` defaults to the module's check mode: the package then reports what it would do. `wrap` and
    `nice` apply to a run, not to a plan.
    """
    if plan is None:
        plan = module.check_mode
    if not os.path.isfile(python) or not os.access(python, os.X_OK):
        module.fail_json(
            msg="ML environment python %s does not exist or is not executable: "
            "run the fla_env role/module first or set 'python' to an environment with specops" % python
        )
    mode = "--plan" if plan else "--run"
    cmd = [python, "-m", "specops.%s" % stage, mode]
    wrapped = wrap is not None and not plan
    if wrapped:
        cmd = wrap(cmd)
    nice = 0 if plan else int(nice or 0)
    if nice:
        cmd = ["nice", "-n", str(nice)] + cmd
    env = dict(os.environ)
    env.update(extra_env or {})
    env.setdefault("PYTHONUNBUFFERED", "1")
    data = json.dumps(request)
    # Forked from the stage host where it may be (a wrapped command's bounds are its own process's).
    outcome = None
    if not wrapped:
        outcome = stage_host.run(python, "specops.%s" % stage, [mode], data.encode(), env, nice=nice)
    if outcome is None:
        outcome = module.run_command(cmd, data=data, binary_data=True, environ_update=env)
    rc, out, err = outcome
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
        module.fail_json(msg=crash_message(stage, rc, err), cmd=cmd, stderr_tail=err[-4000:],
                         stderr_lines=error_lines(err), stdout_tail=out[-2000:])
    return result


# Playbooks show the last of `stderr_lines` after `msg` (what ansible.builtin.command returns too).
CRASH_LINES = 40


def error_lines(err):
    """The last non-blank lines of a crashed stage's error output; the exception comes last."""
    return [line for line in err.splitlines() if line.strip()][-CRASH_LINES:]


def crash_message(stage, rc, err):
    """Say how the stage ended; the error output's last line (the exception) follows in stderr_lines."""
    if rc is not None and rc < 0:
        how = ("specops.%s was killed by signal %d (exit %d), by the out-of-memory killer or an operator; "
               "a rerun resumes from what it finished" % (stage, -rc, rc))
    elif rc == 0:
        how = "specops.%s crashed (exit 0) without a JSON result on stdout (see stdout_tail)" % stage
    else:
        how = "specops.%s crashed (exit %s)" % (stage, rc)
    if not error_lines(err):
        return how + "; it wrote no error output"
    return how + "; the end of its error output follows:"
