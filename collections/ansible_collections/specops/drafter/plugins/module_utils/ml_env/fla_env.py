# -*- coding: utf-8 -*-
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""fla_env: one ML environment on the managed host, created, brought up to date and verified.

The venv and pip are in fla_env_install, the backend verification and its cache in fla_env_verify.
"""

from __future__ import absolute_import, division, print_function

__metaclass__ = type

import json
import os

from ansible_collections.specops.drafter.plugins.module_utils.ml_env.fla_env_install import (
    FLA_DISTRIBUTIONS,
    FlaEnvInstall,
    fingerprint_sources,
    is_distribution,
)
from ansible_collections.specops.drafter.plugins.module_utils.ml_env.fla_env_verify import FlaEnvVerify


class FlaEnv(FlaEnvInstall, FlaEnvVerify):
    """Holds the module; run() reads the host, brings the environment up to date, verifies it and exits."""

    def __init__(self, module):
        self.module = module
        self.params = module.params
        self.venv = os.path.abspath(self.params["venv"])
        self.venv_python = os.path.join(self.venv, "bin", "python")
        self.source = os.path.abspath(self.params["specops_source"])
        self.lock = self.params["requirements_lock"]
        self.lock_constraints = None
        self.require_backend = self._require_backend()
        self.result = dict(
            changed=False,
            venv=self.venv,
            python=self.venv_python,
            created=False,
            installed=[],
            removed=[],
            backend=None,
            verification=None,
            verification_cached=False,
            base_environment=[],
        )

    # -- facts about the host -------------------------------------------------------------------

    def _base_python(self):
        name = self.params["python"]
        if "/" in name:
            path = name if os.path.isfile(name) and os.access(name, os.X_OK) else None
        else:
            path = self.module.get_bin_path(name)
        if not path:
            self.module.fail_json(
                msg="python interpreter '%s' not found on the managed host: install it or set python "
                "to an existing interpreter (for example /usr/bin/python3)" % name, **self.result)
        # The real executable, not a wrapper (pyenv shims, alternatives): that is what the venv records.
        script = ("import json, site, sys; print('%d.%d.%d' % sys.version_info[:3]); print(sys.executable); "
                  "print(json.dumps(site.getsitepackages() if sys.prefix != sys.base_prefix else []))")
        rc, out, err = self.module.run_command([path, "-c", script])
        lines = out.strip().splitlines()
        if rc != 0 or len(lines) < 3:
            self.module.fail_json(msg="python interpreter %s does not run (exit %d): %s" % (path, rc, err.strip()),
                                  **self.result)
        return {"path": lines[1] or path, "version": lines[0], "venv_site_packages": json.loads(lines[2])}

    def _gpu_visible(self):
        if os.path.exists("/dev/nvidia0"):
            return {"visible": True, "evidence": "/dev/nvidia0 exists"}
        smi = self.module.get_bin_path("nvidia-smi")
        if not smi:
            return {"visible": False, "evidence": "no /dev/nvidia0 and no nvidia-smi"}
        rc, out, err = self.module.run_command([smi, "-L"])
        if rc == 0 and "GPU" in out:
            return {"visible": True, "evidence": "nvidia-smi -L lists %s" % out.strip().splitlines()[0]}
        return {"visible": False, "evidence": "no /dev/nvidia0 and nvidia-smi -L lists no GPU (exit %d)" % rc}

    def _want_fla(self, gpu):
        mode = self.params["fla"]
        return mode == "always" or (mode == "auto" and gpu["visible"])

    def _requirements(self, want_fla):
        reqs = [self.params["torch"], self.params["transformers"]]
        if want_fla:
            reqs += ["%s==%s" % (name, self.params["fla_version"]) for name in FLA_DISTRIBUTIONS]
        return reqs + list(self.params["extra_requirements"])

    def _check_source(self):
        if is_distribution(self.source):
            return
        if os.path.isfile(self.source):
            self.module.fail_json(
                msg="specops_source %s is a file but not a wheel (.whl) or sdist (.tar.gz) of specops: point it at "
                "the wheel the collection ships, at an sdist, or at a checkout" % self.source, **self.result)
        for needed in ("pyproject.toml", os.path.join("src", "specops", "__init__.py")):
            if not os.path.isfile(os.path.join(self.source, needed)):
                self.module.fail_json(
                    msg="specops_source %s is not a specops checkout (%s is missing): point it at the "
                    "checkout, at a staged copy of its src/, pyproject.toml and README.md, or at a built wheel or sdist"
                    % (self.source, needed),
                    **self.result)

    # -- the run ---------------------------------------------------------------------------------

    def run(self):
        base = self._base_python()
        self.result["base_python"] = base
        self._check_source()
        gpu = self._gpu_visible()
        self.result["gpu_visible"] = gpu
        want_fla = self._want_fla(gpu)
        reqs = self._requirements(want_fla)
        self.result["requirements"] = reqs
        fingerprint = fingerprint_sources(self.source, self.params["specops_extras"])
        self.result["specops_fingerprint"] = fingerprint
        check = self.module.check_mode

        if not os.path.exists(self.venv) or (os.path.isdir(self.venv) and not os.listdir(self.venv)):
            self.result.update(changed=True, created=True)
            if check:
                self.result["installed"] = reqs + ["specops (source)"]
                self.result["msg"] = ("check mode: %s does not exist yet; would create it with %s (%s) and install %s"
                                      % (self.venv, base["path"], base["version"], ", ".join(self.result["installed"])))
                self.module.exit_json(**self.result)
            self._create(base)
        elif self._check_existing(base):
            self.result["changed"] = True
            if not check:
                self._set_system_site_packages()
        if self._sync_base_environment(base, check):
            self.result["changed"] = True

        lock_pins = self._lock_pins()
        state = self._state(reqs + lock_pins)
        lock_missing = [r["requirement"] for r in state["requirements"][len(reqs):] if not r["satisfied"]]
        state["requirements"] = state["requirements"][:len(reqs)]
        missing = [r["requirement"] for r in state["requirements"] if not r["satisfied"]]
        specops_stale = (state["dists"]["specops"]["version"] is None
                         or self._stored_fingerprint() != fingerprint)
        remove = []
        if not want_fla:
            remove = [name for name in FLA_DISTRIBUTIONS if state["dists"][name]["in_env"]]
            outside = [name for name in FLA_DISTRIBUTIONS
                       if state["dists"][name]["version"] and not state["dists"][name]["in_env"]]
            if outside:
                self.module.warn(
                    "%s installed outside %s (%s) and visible through system_site_packages; fla=%s cannot "
                    "remove it: on a host without a GPU transformers would pick fla's kernels and crash" % (
                        ", ".join(outside), self.venv, state["dists"][outside[0]]["location"], self.params["fla"]))
        installing = (missing + ["%s (%s)" % (pin.split(";")[0].strip(), self.lock) for pin in lock_missing]
                      + (["specops (source)"] if specops_stale else []))
        self.result.update(installed=installing, removed=remove)
        if installing or remove:
            self.result["changed"] = True

        if not check:
            if remove:
                cmd, rc, out, err = self._pip(["uninstall", "--yes"] + remove)
                if rc != 0:
                    self._fail_pip("removing %s" % ", ".join(remove), cmd, rc, out, err)
            # The lock first, exactly as it is; then the requirements, constrained by it: their errors are
            # the ones to see, not those of building specops. Every requirement goes to pip each time,
            # so the resolver keeps the satisfied ones.
            if lock_missing:
                self._install_lock()
            if missing:
                self._install(reqs, specops=False)
            if specops_stale:
                self._install(reqs, specops=True)
                self._store_fingerprint(fingerprint)
            if missing or lock_missing or specops_stale or remove:
                state = self._state(reqs + lock_pins)
                still = ["%s (installed %s)" % (r["requirement"], r["installed"])
                         for r in state["requirements"] if not r["satisfied"]]
                state["requirements"] = state["requirements"][:len(reqs)]
                if still:
                    self.module.fail_json(msg="after pip install, still not satisfied: %s; check the requirement "
                                          "strings against what the index provides" % ", ".join(still), **self.result)
                if specops_stale and not state["dists"]["specops"]["in_env"]:
                    self.module.fail_json(msg="after pip install, specops in %s is still the one at %s, not %s" % (
                        self.venv, state["dists"]["specops"]["location"], self.source), **self.result)

        self.result["versions"] = dict((name, d["version"]) for name, d in state["dists"].items())
        complete = not (check and (installing or self.result["created"]))
        self.result["verification_cached"] = False
        if self.params["verify"] and complete:
            self._verify(state, fingerprint, check)

        self.result["msg"] = self._message(check, installing, remove, complete)
        self.module.exit_json(**self.result)

    def _message(self, check, installing, remove, complete):
        prefix = "check mode: would " if check else ""
        parts = []
        if self.result["created"]:
            parts.append("create %s" % self.venv if check else "created %s" % self.venv)
        if installing:
            parts.append(("install " if check else "installed ") + ", ".join(installing))
        if remove:
            parts.append(("remove " if check else "removed ") + ", ".join(remove))
        text = (prefix + "; ".join(parts)) if parts else "%s is up to date" % self.venv
        if self.result["backend"]:
            text += "; backend %s" % self.result["backend"]
            if self.result.get("verification_cached"):
                text += " (verified earlier on this environment and GPU)"
        elif self.params["verify"] and not complete:
            text += "; verification skipped until the environment is complete"
        return text
