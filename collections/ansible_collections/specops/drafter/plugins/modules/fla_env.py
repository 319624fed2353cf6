#!/usr/bin/python
# -*- coding: utf-8 -*-
# Copyright: specops maintainers
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)

from __future__ import absolute_import, division, print_function

__metaclass__ = type

DOCUMENTATION = r"""
---
module: fla_env
short_description: Build the ML environment for hidden-state extraction and prove which backend it runs
version_added: "0.1.0"
description:
  - Creates or updates a Python virtual environment on the managed host with torch, transformers,
    fla (C(fla-core) and C(flash-linear-attention)), any extra requirements and the specops package,
    from a built distribution (the wheel the collection ships) or from a checkout.
  - Idempotent. pip runs only when a requirement is not satisfied by what is installed in the
    environment (read with C(importlib.metadata) inside it), when fla must be removed, or when the
    specops package changed (a fingerprint of the wheel or sdist, or of a checkout's C(src/) and
    C(pyproject.toml), is stored in the environment). Otherwise nothing is run and C(changed) is false.
  - Then runs C(python -m specops.envcheck) inside the environment. It reports the Python, library
    versions, CUDA devices, and the backend extraction will use. C(fla-cuda) is reported only after
    fla's C(chunk_gated_delta_rule) ran on the GPU and matched transformers' torch reference
    (computed in fp32) within a tolerance; otherwise C(torch-cuda) or C(torch-cpu).
  - On a host without a GPU the backend is C(torch-cpu) and a note says fla is not usable there.
    If fla and triton still import there, a warning says so, because transformers would choose
    fla's kernels and crash.
  - Fails with a message that names the fix when the interpreter does not exist, when pip cannot
    find a requirement in the given index or wheelhouse, and when torch is a CUDA build on a host
    without an NVIDIA driver.
  - The module itself never imports torch; everything that needs it runs inside the environment.
author:
  - specops maintainers (@specops)
options:
  venv:
    description:
      - Path of the virtual environment on the managed host. Created when it does not exist.
    type: path
    required: true
  python:
    description:
      - Interpreter that creates the environment, as a name looked up on C(PATH) or an absolute path.
      - An existing environment must have been made by the same C(major.minor) version.
    type: str
    default: python3
  system_site_packages:
    description:
      - Let the environment see the interpreter's site-packages, for host images that already ship a
        CUDA torch (set O(torch=torch) to accept it). Changing it on an existing environment
        rewrites its C(pyvenv.cfg).
      - When O(python) itself runs inside a virtual environment (an image whose torch lives in its own
        venv), a venv made from it would see only the base interpreter's packages. The environment
        then also gets a C(.pth) file naming that venv's site-packages, so its torch, triton and the
        rest are seen; what this module installs still comes first, and pip never removes the
        image's packages (they are outside the environment).
    type: bool
    default: false
  torch:
    description:
      - pip requirement for torch, for example C(torch==2.13.0) or C(torch==2.11.0+cu130).
        Where it comes from is set by O(index_url), O(extra_index_url) and O(find_links).
    type: str
    default: torch
  transformers:
    description:
      - pip requirement for transformers. The torch reference of the gated delta rule comes from it.
    type: str
    default: transformers==5.23.0
  fla:
    description:
      - Whether to install fla (C(fla-core) and C(flash-linear-attention)).
      - V(auto) installs it only when an NVIDIA GPU is visible (C(/dev/nvidia0) exists or
        C(nvidia-smi -L) lists one) and removes it from the environment otherwise, because
        transformers would pick fla's kernels on a host without a GPU and crash.
      - V(always) installs it regardless; V(never) removes it from the environment.
    type: str
    choices: [auto, always, never]
    default: auto
  fla_version:
    description:
      - Version of C(fla-core) and C(flash-linear-attention) to install.
    type: str
    default: 0.6.0
  extra_requirements:
    description:
      - More pip requirements for the environment.
    type: list
    elements: str
    default: []
  specops_source:
    description:
      - Path on the managed host of the specops package - a built distribution (a wheel, C(.whl), or an
        sdist, C(.tar.gz)), such as the wheel shipped inside this collection, or a specops checkout
        (or a staged copy holding C(src/), C(pyproject.toml) and C(README.md)).
      - It is installed as a regular, non-editable package and reinstalled only when its fingerprint
        (the distribution's content, or the checkout's sources) changes.
    type: path
    required: true
  specops_extras:
    description:
      - Extras of the specops package to install with it (C(ml) brings tokenizers, matplotlib, einops, jinja2).
    type: list
    elements: str
    default: [ml]
  requirements_lock:
    description:
      - Path on the managed host of a lock file (pip requirements format, every package pinned with
        C(==) and C(--hash), as C(uv pip compile --generate-hashes) or C(pip-compile --generate-hashes)
        write it), for example the checkout's C(requirements/ml.lock).
      - Its packages are installed exactly, hash-checked and without their dependencies, whenever one of
        them is missing or at another version; every other install (O(torch), O(transformers),
        O(extra_requirements), specops) then runs with the lock as constraints, so none of them moves a
        locked package. A package the lock leaves out (torch, whose build the index decides) is not
        constrained.
    type: path
  index_url:
    description:
      - Base URL of the package index (pip C(--index-url)), for example C(https://download.pytorch.org/whl/cpu).
    type: str
  extra_index_url:
    description:
      - More package indexes (pip C(--extra-index-url)).
    type: list
    elements: str
    default: []
  find_links:
    description:
      - Local wheelhouse directories (pip C(--find-links)), for GPU hosts without network access.
      - Without an index, the wheelhouse must hold every dependency; when O(specops_source) is a checkout
        or an sdist, C(setuptools>=68) too, because pip builds specops in an isolated build environment.
    type: list
    elements: path
    default: []
  no_index:
    description:
      - Ignore every package index and install only from O(find_links) (pip C(--no-index)).
    type: bool
    default: false
  pip_isolated:
    description:
      - Ignore the host's pip configuration files and C(PIP_*) environment variables, so only the
        sources given here are used (pip C(--isolated) with C(PIP_CONFIG_FILE=/dev/null)).
    type: bool
    default: false
  verify:
    description:
      - Run C(specops.envcheck) in the environment and return its report. In check mode it runs
        without the kernel test, and only when the environment is already complete.
    type: bool
    default: true
  require_backend:
    description:
      - V(fla-cuda) fails the task unless the verification proved fla's kernels on the GPU.
      - V(any) accepts whatever backend the host supports and reports it.
    type: str
    choices: [any, fla-cuda]
    default: any
  verify_cache_dir:
    description:
      - Directory on the managed host where successful verifications are kept, one file per
        environment and GPU (the installed versions, the specops sources, the GPUs' UUIDs, names and
        driver, and the verification options). A later run with the same key returns the kept report
        (RV(verification_cached)) without running the kernel test again.
      - Empty runs the verification every time.
    type: path
  gdr_sizes:
    description:
      - Shapes for the gated delta rule comparison, each a mapping of C(batch), C(seq_len),
        C(k_heads), C(v_heads), C(head_k_dim), C(head_v_dim) and C(dtype) (C(float32) or
        C(bfloat16)). Missing keys take the small default shape. Default is a small fp32 and bf16 pair.
    type: list
    elements: dict
attributes:
  check_mode:
    support: full
    description: Reports what would be created, installed and removed; installs nothing.
  diff_mode:
    support: none
    description: Nothing is shown as a diff; RV(installed) and RV(removed) list the changes.
  platform:
    support: full
    platforms: posix
    description: Runs on POSIX hosts with a Python that can create virtual environments.
requirements:
  - Python 3 with the C(venv) module (Debian, Ubuntu - C(python3-venv)) on the managed host.
notes:
  - The first verification on a GPU compiles and autotunes fla's triton kernels, which takes a minute
    or more; later runs use triton's cache.
"""

EXAMPLES = r"""
- name: CPU environment on a host without a GPU (the local default)
  specops.drafter.fla_env:
    venv: /opt/specops/venv
    python: python3.11
    torch: torch==2.13.0
    specops_source: /opt/specops/wheels/specops-0.1.0-py3-none-any.whl

- name: GPU host without network, from a wheelhouse, reusing the image's CUDA torch
  specops.drafter.fla_env:
    venv: /opt/specops/venv
    python: /usr/bin/python3
    system_site_packages: true
    torch: torch
    find_links: [/opt/wheelhouse]
    no_index: true
    fla: always
    specops_source: /opt/specops/src
    require_backend: fla-cuda
  register: env

- name: Later stages use its interpreter
  ansible.builtin.debug:
    msg: "{{ env.python }} runs {{ env.backend }}"
"""

RETURN = r"""
venv:
  description: Absolute path of the environment.
  returned: always
  type: str
  sample: /opt/specops/venv
python:
  description: The environment's interpreter; later stages run the package with it.
  returned: always
  type: str
  sample: /opt/specops/venv/bin/python
base_python:
  description: The interpreter O(python) resolved to, and its version.
  returned: always
  type: dict
  sample: {"path": "/usr/bin/python3.11", "version": "3.11.7"}
created:
  description: Whether the environment was (in check mode, would be) created.
  returned: always
  type: bool
gpu_visible:
  description: Whether an NVIDIA GPU is visible on the host, and how that was decided.
  returned: always
  type: dict
  sample: {"visible": false, "evidence": "no /dev/nvidia0 and no nvidia-smi"}
requirements:
  description: The requirements the environment must satisfy (specops excluded).
  returned: always
  type: list
  elements: str
  sample: ["torch==2.13.0", "transformers==5.23.0"]
installed:
  description: Requirements pip was (in check mode, would be) asked to install, specops included as C(specops (source)).
  returned: always
  type: list
  elements: str
removed:
  description: Distributions that were (in check mode, would be) uninstalled.
  returned: always
  type: list
  elements: str
  sample: ["fla-core", "flash-linear-attention"]
specops_fingerprint:
  description: Fingerprint of the specops sources installed in the environment.
  returned: always
  type: str
versions:
  description: Installed versions of the main distributions in the environment (null when absent).
  returned: when the environment exists
  type: dict
  sample: {"torch": "2.13.0+cpu", "transformers": "5.23.0", "fla-core": null, "triton": null, "specops": "0.1.0"}
backend:
  description:
    - C(fla-cuda), C(torch-cuda) or C(torch-cpu); null when not verified (O(verify=false), or
      check mode where only C(verification.backend_expected) is known).
  returned: always
  type: str
  sample: torch-cpu
verification:
  description:
    - The report of C(specops.envcheck), null when it did not run. Keys include C(python),
      C(versions) (torch, torch_cuda, transformers, fla, triton, specops), C(cuda_available),
      C(devices) (name, capability, memory_gib), C(fla_importable), C(triton_importable),
      C(transformers_gdr_impl), C(backend), C(backend_expected), C(gdr_max_abs_error),
      C(gdr_rel_error), C(gdr) (every comparison with its tolerance), C(notes) and C(warnings).
  returned: always
  type: dict
verification_cached:
  description: Whether the verification was read from O(verify_cache_dir) instead of being run.
  returned: always
  type: bool
base_environment:
  description: Site-packages of the virtual environment O(python) runs in, that the environment sees through a C(.pth) file; empty when none.
  returned: always
  type: list
  elements: str
msg:
  description: What was done, in a sentence.
  returned: always
  type: str
"""

import hashlib
import json
import os
import re
import shutil
import tempfile

from ansible.module_utils.basic import AnsibleModule
from ansible_collections.specops.drafter.plugins.module_utils.stage_runner import run_stage

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


class FlaEnv(object):
    def __init__(self, module):
        self.module = module
        self.params = module.params
        self.venv = os.path.abspath(self.params["venv"])
        self.venv_python = os.path.join(self.venv, "bin", "python")
        self.source = os.path.abspath(self.params["specops_source"])
        self.lock = self.params["requirements_lock"]
        self.lock_constraints = None
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
               "require_backend": self.params["require_backend"], "gdr_sizes": self.params["gdr_sizes"],
               "gpus": self._gpu_identity()}
        digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode("utf-8")).hexdigest()
        return os.path.join(self.params["verify_cache_dir"], "envcheck-%s.json" % digest[:32])

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
            request = {"require_backend": self.params["require_backend"]}
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

        self.result["msg"] = self._message(check, installing, remove, complete)
        self.module.exit_json(**self.result)

    def _cached_report(self, path):
        try:
            with open(path) as handle:
                return json.load(handle)
        except (TypeError, IOError, OSError, ValueError):
            return None

    def _keep_report(self, path, report):
        directory = os.path.dirname(path)
        if not os.path.isdir(directory):
            os.makedirs(directory)
        self._replace(path, json.dumps(report))

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


def main():
    module = AnsibleModule(
        argument_spec=dict(
            venv=dict(type="path", required=True),
            python=dict(type="str", default="python3"),
            system_site_packages=dict(type="bool", default=False),
            torch=dict(type="str", default="torch"),
            transformers=dict(type="str", default="transformers==5.23.0"),
            fla=dict(type="str", default="auto", choices=["auto", "always", "never"]),
            fla_version=dict(type="str", default="0.6.0"),
            extra_requirements=dict(type="list", elements="str", default=[]),
            specops_source=dict(type="path", required=True),
            specops_extras=dict(type="list", elements="str", default=["ml"]),
            requirements_lock=dict(type="path"),
            index_url=dict(type="str"),
            extra_index_url=dict(type="list", elements="str", default=[]),
            find_links=dict(type="list", elements="path", default=[]),
            no_index=dict(type="bool", default=False),
            pip_isolated=dict(type="bool", default=False),
            verify=dict(type="bool", default=True),
            require_backend=dict(type="str", default="any", choices=["any", "fla-cuda"]),
            gdr_sizes=dict(type="list", elements="dict"),
            verify_cache_dir=dict(type="path"),
        ),
        supports_check_mode=True,
    )
    FlaEnv(module).run()


if __name__ == "__main__":
    main()
