# -*- coding: utf-8 -*-
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""fla_env: the backend verification (the envcheck stage in the environment) and its cache."""

from __future__ import absolute_import, division, print_function

__metaclass__ = type

import hashlib
import json
import os

from ansible_collections.specops.drafter.plugins.module_utils.stages.stage_runner import run_stage

# specops.backend.REQUIRE_BACKENDS, the extraction's vocabulary, and the deprecated aliases (new name),
# which the module translates before envcheck sees them.
REQUIRE_BACKENDS = ["auto", "fla", "torch", "any"]
DEPRECATED_REQUIRE_BACKENDS = {"fla-cuda": "fla"}
REQUIRE_BACKEND_CHOICES = REQUIRE_BACKENDS + sorted(DEPRECATED_REQUIRE_BACKENDS)


class FlaEnvVerify(object):
    """Runs envcheck, or reuses its report for the same environment, options and GPUs; mixed into
    FlaEnv (it writes the cache with FlaEnvInstall._replace)."""

    def _require_backend(self):
        """The requirement envcheck checks: a deprecated alias becomes its new name, with a deprecation."""
        require = self.params["require_backend"]
        if require in DEPRECATED_REQUIRE_BACKENDS:
            self.module.deprecate(
                "require_backend %s is deprecated: use %s, the value the extraction's require_backend takes "
                "for the same requirement" % (require, DEPRECATED_REQUIRE_BACKENDS[require]),
                version="1.0.0", collection_name="specops.drafter")
            require = DEPRECATED_REQUIRE_BACKENDS[require]
        return require

    def _verify(self, state, fingerprint, check):
        """Set verification, backend and verification_cached in the result; pass the warnings on."""
        request = {"require_backend": self.require_backend}
        if self.params["gdr_sizes"] is not None:
            request["gdr_sizes"] = self.params["gdr_sizes"]
        cache = self._verify_cache_path(state, fingerprint) if self.params["verify_cache_dir"] else None
        report = self._cached_report(cache)
        if report is None:
            report = run_stage(self.module, self.venv_python, "envcheck", request)
            report.pop("changed", None)
            if cache and not check:
                self._keep_report(cache, report)
        else:
            self.result["verification_cached"] = True
        self.result["verification"] = report
        self.result["backend"] = report.get("backend")
        for warning in report.get("warnings", []):
            self.module.warn(warning)

    def _gpu_identity(self):
        """What a verification depends on beyond the environment: the GPUs and their driver."""
        smi = self.module.get_bin_path("nvidia-smi")
        if not smi:
            return "no nvidia-smi"
        rc, out, err = self.module.run_command(
            [smi, "--query-gpu=uuid,name,driver_version", "--format=csv,noheader"])
        return out.strip() if rc == 0 else "nvidia-smi failed (exit %d)" % rc

    def _verify_cache_path(self, state, fingerprint):
        key = {"venv": self.venv, "dists": state["dists"], "specops": fingerprint,
               "require_backend": self.require_backend, "gdr_sizes": self.params["gdr_sizes"],
               "gpus": self._gpu_identity()}
        digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode("utf-8")).hexdigest()
        return os.path.join(self.params["verify_cache_dir"], "envcheck-%s.json" % digest[:32])

    def _cached_report(self, path):
        try:
            with open(path) as handle:
                return json.load(handle)
        except (TypeError, IOError, OSError, ValueError):
            return None

    def _keep_report(self, path, report):
        # exist_ok: runs on one host may keep their verifications in one directory at the same time.
        os.makedirs(os.path.dirname(path), exist_ok=True)
        self._replace(path, json.dumps(report))
