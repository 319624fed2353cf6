# -*- coding: utf-8 -*-
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""fla_env: the virtual environment and what pip installs in it (torch, transformers, fla, specops)."""

from __future__ import absolute_import, division, print_function

__metaclass__ = type

import hashlib
import json
import os
import re
import shutil
import tempfile

FLA_DISTRIBUTIONS = ("fla-core", "flash-linear-attention")
REPORTED_DISTRIBUTIONS = ("torch", "transformers", "fla-core", "flash-linear-attention", "triton", "specops")
FINGERPRINT_FILE = "specops-source.json"
# A locked pin: name==version, then an optional marker (hashes follow on continuation lines).
LOCK_PIN = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*==[^\s;\\]+)\s*(?:;([^\\]*))?")

# Runs inside the environment after specops is installed from a temporary copy of a checkout: without
# the direct-URL record pip freeze names the version (specops==0.1.0), not that vanished path. A wheel
# or sdist keeps its record: its path names the file it was installed from.
FORGET_SOURCE_PATH_SCRIPT = r"""
import os
from importlib import metadata
for entry in metadata.distribution("specops").files or []:
    if entry.name == "direct_url.json" and entry.parent.name.endswith(".dist-info"):
        target = str(entry.locate())
        if os.path.exists(target):
            os.remove(target)
"""
# Makes a venv created from another venv's interpreter see that venv's packages (site.addpackage).
BASE_ENV_PTH = "specops-base-environment.pth"

# Runs inside the environment: which requirements are satisfied, and where each distribution lives.
# pip (present in every venv) vendors `packaging`, so no extra package is needed to read specifiers.
STATE_SCRIPT = r"""
import json, sys
from importlib import metadata
try:
    from pip._vendor.packaging.requirements import Requirement
except ImportError:
    from packaging.requirements import Requirement
request = json.loads(sys.stdin.read())
prefix = sys.prefix

def lookup(name):
    try:
        dist = metadata.distribution(name)
    except metadata.PackageNotFoundError:
        return None, None
    location = str(dist.locate_file(""))
    return dist.version, location

out = {"requirements": [], "dists": {}, "prefix": prefix}
for text in request["requirements"]:
    req = Requirement(text)
    version, location = lookup(req.name)
    applies = req.marker is None or req.marker.evaluate()
    satisfied = not applies or (version is not None and (req.url is not None or
                                req.specifier.contains(version, prereleases=True)))
    out["requirements"].append({"requirement": text, "name": req.name, "installed": version,
                                "satisfied": bool(satisfied)})
for name in request["dists"]:
    version, location = lookup(name)
    out["dists"][name] = {"version": version, "location": location,
                          "in_env": bool(location) and location.startswith(prefix + "/")}
print(json.dumps(out))
"""


DISTRIBUTION_SUFFIXES = (".whl", ".tar.gz")


def is_distribution(path):
    """A built specops distribution (wheel or sdist) rather than a checkout."""
    return os.path.isfile(path) and path.endswith(DISTRIBUTION_SUFFIXES)


def source_files(root):
    """The specops files whose content defines the installed package, relative to `root`."""
    files = []
    for name in ("pyproject.toml", "README.md"):
        if os.path.isfile(os.path.join(root, name)):
            files.append(name)
    for directory, dirnames, filenames in os.walk(os.path.join(root, "src")):
        # Build leftovers and bytecode are not sources; they must not trigger a reinstall.
        dirnames[:] = sorted(d for d in dirnames if d != "__pycache__" and not d.endswith(".egg-info"))
        for filename in sorted(filenames):
            if not filename.endswith((".pyc", ".pyo")):
                files.append(os.path.relpath(os.path.join(directory, filename), root))
    return sorted(files)


def fingerprint_sources(root, extras):
    digest = hashlib.sha256()
    digest.update(json.dumps(sorted(extras)).encode("utf-8"))
    if is_distribution(root):
        with open(root, "rb") as handle:
            digest.update(b"distribution\0" + hashlib.sha256(handle.read()).hexdigest().encode("ascii"))
        return digest.hexdigest()
    for relative in source_files(root):
        with open(os.path.join(root, relative), "rb") as handle:
            content = handle.read()
        digest.update(relative.encode("utf-8") + b"\0" + hashlib.sha256(content).hexdigest().encode("ascii"))
    return digest.hexdigest()


class FlaEnvInstall(object):
    """Creates and updates the environment and installs into it; mixed into FlaEnv, whose __init__
    sets module, params, result, venv, venv_python, source, lock and lock_constraints."""

    # -- the environment -------------------------------------------------------------------------

    def _pyvenv_cfg(self):
        values = {}
        path = os.path.join(self.venv, "pyvenv.cfg")
        if os.path.isfile(path):
            with open(path) as handle:
                for line in handle:
                    if "=" in line:
                        key, value = line.split("=", 1)
                        values[key.strip()] = value.strip()
        return values

    def _check_existing(self, base):
        if not os.path.isfile(os.path.join(self.venv, "pyvenv.cfg")) or not os.path.exists(self.venv_python):
            self.module.fail_json(
                msg="%s exists but is not a virtual environment (no pyvenv.cfg or bin/python): remove it or "
                "choose another venv path" % self.venv, **self.result)
        cfg = self._pyvenv_cfg()
        made_by = cfg.get("version") or cfg.get("version_info") or ""
        if made_by and made_by.split(".")[:2] != base["version"].split(".")[:2]:
            self.module.fail_json(
                msg="virtual environment %s was created by Python %s but python '%s' is %s: remove the "
                "environment or set python to a %s interpreter" % (
                    self.venv, made_by, self.params["python"], base["version"], ".".join(made_by.split(".")[:2])),
                **self.result)
        wanted = "true" if self.params["system_site_packages"] else "false"
        return cfg.get("include-system-site-packages", "false").lower() != wanted

    def _create(self, base):
        cmd = [base["path"], "-m", "venv"]
        if self.params["system_site_packages"]:
            cmd.append("--system-site-packages")
        rc, out, err = self.module.run_command(cmd + [self.venv])
        if rc != 0:
            hint = ""
            if "ensurepip" in err:
                hint = " (install the interpreter's venv support, e.g. the python3-venv package)"
            self.module.fail_json(msg="could not create %s with %s%s: %s" % (self.venv, base["path"], hint,
                                                                             err.strip()), **self.result)

    def _replace(self, path, text):
        """Write text to a temporary file beside path, then move it over path with Ansible's atomic_move."""
        fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), prefix=".%s." % os.path.basename(path))
        with os.fdopen(fd, "w") as handle:
            handle.write(text)
        self.module.atomic_move(tmp, path)

    def _set_system_site_packages(self):
        path = os.path.join(self.venv, "pyvenv.cfg")
        wanted = "true" if self.params["system_site_packages"] else "false"
        with open(path) as handle:
            lines = handle.readlines()
        lines = [line for line in lines if not line.split("=", 1)[0].strip() == "include-system-site-packages"]
        lines.insert(1 if lines else 0, "include-system-site-packages = %s\n" % wanted)
        self._replace(path, "".join(lines))

    def _site_packages(self):
        rc, out, err = self.module.run_command(
            [self.venv_python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"])
        if rc != 0:
            self.module.fail_json(msg="could not read the site-packages of %s: %s" % (self.venv, err.strip()),
                                  **self.result)
        return out.strip().splitlines()[-1]

    def _sync_base_environment(self, base, check):
        """Point the environment at the site-packages of the venv its interpreter runs in (or stop)."""
        wanted = base["venv_site_packages"] if self.params["system_site_packages"] else []
        self.result["base_environment"] = wanted
        if check and not os.path.exists(self.venv_python):
            return bool(wanted)
        path = os.path.join(self._site_packages(), BASE_ENV_PTH)
        content = "".join(line + "\n" for line in wanted)
        try:
            with open(path) as handle:
                current = handle.read()
        except (IOError, OSError):
            current = None
        if current == (content or None):
            return False
        if not check:
            if content:
                self._replace(path, content)
            else:
                os.remove(path)
        return True

    def _state(self, reqs):
        request = {"requirements": reqs, "dists": list(REPORTED_DISTRIBUTIONS)}
        rc, out, err = self.module.run_command([self.venv_python, "-c", STATE_SCRIPT], data=json.dumps(request))
        if rc != 0:
            self.module.fail_json(
                msg="could not read the installed packages of %s (exit %d); if a requirement is malformed, fix "
                "it: %s" % (self.venv, rc, err.strip()[-2000:]), **self.result)
        return json.loads(out.strip().splitlines()[-1])

    def _stored_fingerprint(self):
        try:
            with open(os.path.join(self.venv, FINGERPRINT_FILE)) as handle:
                return json.load(handle).get("fingerprint")
        except (IOError, OSError, ValueError):
            return None

    def _store_fingerprint(self, value):
        path = os.path.join(self.venv, FINGERPRINT_FILE)
        self._replace(path, json.dumps({"fingerprint": value, "source": self.source,
                                        "extras": self.params["specops_extras"]}))

    # -- pip -------------------------------------------------------------------------------------

    def _pip(self, args):
        cmd = [self.venv_python, "-m", "pip"] + args[:1] + ["--disable-pip-version-check", "--no-input"]
        env = {"PIP_NO_INPUT": "1"}
        if self.params["pip_isolated"]:
            cmd.append("--isolated")
            env["PIP_CONFIG_FILE"] = os.devnull
        cmd += args[1:]
        rc, out, err = self.module.run_command(cmd, environ_update=env)
        return cmd, rc, out, err

    def _source_options(self):
        options = []
        if self.params["no_index"]:
            options.append("--no-index")
        if self.params["index_url"]:
            options += ["--index-url", self.params["index_url"]]
        for url in self.params["extra_index_url"]:
            options += ["--extra-index-url", url]
        for path in self.params["find_links"]:
            options += ["--find-links", path]
        return options

    def _describe_sources(self):
        parts = []
        if self.params["no_index"]:
            parts.append("no index (no_index is set)")
        else:
            parts.append("index %s" % (self.params["index_url"] or "the default index"))
            if self.params["extra_index_url"]:
                parts.append("extra indexes %s" % ", ".join(self.params["extra_index_url"]))
        if self.params["find_links"]:
            parts.append("wheelhouse %s" % ", ".join(self.params["find_links"]))
        text = ", ".join(parts)
        if not self.params["pip_isolated"]:
            text += " (plus what the host's pip configuration adds; pip_isolated=true ignores it)"
        return text

    def _fail_pip(self, action, cmd, rc, out, err):
        text = out + "\n" + err
        missing = re.findall(r"No matching distribution found for (\S+)", text)
        conflict = re.findall(r"Cannot install (.+?) because these package versions have conflicting", text)
        if missing:
            msg = ("pip cannot provide %s from %s: add a matching wheel (for this Python and platform) to the "
                   "wheelhouse (find_links) or point index_url at an index that has it"
                   % (", ".join(missing), self._describe_sources()))
        elif conflict:
            causes = re.findall(r"^\s+(The user requested .*|.* depends on .*)$", text, re.MULTILINE)
            msg = ("pip cannot install %s: the requirements conflict (%s); loosen or align the requirements"
                   % (conflict[0], "; ".join(c.strip() for c in causes) or "see stderr_tail"))
        else:
            msg = "pip failed (exit %d) while %s; the end of its output is in stderr_tail" % (rc, action)
        self.module.fail_json(msg=msg, cmd=cmd, stderr_tail=err[-4000:], stdout_tail=out[-2000:], **self.result)

    def _lock_pins(self):
        """The lock's pins as requirement strings (with their markers), for the installed-state check."""
        if not self.lock:
            return []
        try:
            with open(self.lock) as handle:
                lines = handle.read().splitlines()
        except (IOError, OSError) as error:
            self.module.fail_json(msg="cannot read requirements_lock %s: %s" % (self.lock, error), **self.result)
        pins = []
        for line in lines:
            match = LOCK_PIN.match(line)
            if match:
                pins.append(match.group(1) + ("; " + match.group(2).strip() if match.group(2) else ""))
        if not pins:
            self.module.fail_json(msg="requirements_lock %s pins no package (name==version lines)" % self.lock,
                                  **self.result)
        return pins

    def _constraint_options(self):
        """pip turns on hash checking for everything once a constraint carries a hash, and torch comes
        without one: the later installs get the lock's pins without their hashes."""
        if not self.lock:
            return []
        if self.lock_constraints is None:
            self.lock_constraints = os.path.join(self.module.tmpdir, "requirements-lock-constraints.txt")
            with open(self.lock_constraints, "w") as handle:
                handle.write("".join(pin + "\n" for pin in self._lock_pins()))
        return ["--constraint", self.lock_constraints]

    def _install_lock(self):
        cmd, rc, out, err = self._pip(["install"] + self._source_options()
                                      + ["--require-hashes", "--no-deps", "-r", self.lock])
        if rc != 0:
            self._fail_pip("installing the packages of %s" % self.lock, cmd, rc, out, err)

    def _install(self, reqs, specops):
        args = ["install"] + self._source_options() + self._constraint_options() + list(reqs)
        staging = None
        extras = self.params["specops_extras"]
        try:
            if specops and is_distribution(self.source):
                args.append("specops%s @ file://%s" % ("[%s]" % ",".join(extras) if extras else "", self.source))
                cmd, rc, out, err = self._pip(args)
                if rc != 0:
                    self._fail_pip("installing %s" % ", ".join(list(reqs) + ["specops"]), cmd, rc, out, err)
                # pip takes an installed specops of the same version (a previous build, or one seen through
                # system_site_packages) as this one: the environment gets this build, its dependencies stay.
                # A copy outside the environment is left alone (pip never uninstalls outside it).
                args = ["install", "--no-deps", "--force-reinstall"] + self._source_options() + [self.source]
            elif specops:
                # Build from a private copy: pip writes build/ and *.egg-info next to the sources.
                staging = tempfile.mkdtemp(prefix="specops-src-", dir=self.module.tmpdir)
                for relative in source_files(self.source):
                    target = os.path.join(staging, relative)
                    if not os.path.isdir(os.path.dirname(target)):
                        os.makedirs(os.path.dirname(target))
                    shutil.copy2(os.path.join(self.source, relative), target)
                args.append(staging + ("[%s]" % ",".join(extras) if extras else ""))
            cmd, rc, out, err = self._pip(args)
            if rc != 0:
                self._fail_pip("installing %s" % ", ".join(list(reqs) + (["specops"] if specops else [])),
                               cmd, rc, out, err)
            if staging:
                rc, out, err = self.module.run_command([self.venv_python, "-c", FORGET_SOURCE_PATH_SCRIPT])
                if rc != 0:
                    self.module.warn("pip freeze in %s names a temporary path for specops: %s" % (
                        self.venv, err.strip()[-500:]))
        finally:
            if staging:
                shutil.rmtree(staging, ignore_errors=True)
