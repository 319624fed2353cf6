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
      - What the verification requires of the gated delta rule's implementation. The values are those of
        O(specops.drafter.extract_hidden_states#module:require_backend) and mean the same.
      - V(fla) fails the task unless the verification proved fla's kernels on the GPU (RV(backend) is
        C(fla-cuda)).
      - V(auto) is V(fla) where torch in the environment sees a CUDA GPU, else V(any).
      - V(torch) verifies the environment without requiring fla, for an extraction that forces the
        PyTorch reference implementation.
      - V(any) accepts whatever backend the host supports and reports it.
      - V(fla-cuda) is a deprecated alias of V(fla), removed in 1.0.0.
      - Ignored when O(verify=false).
    type: str
    choices: [auto, fla, torch, any, fla-cuda]
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
    require_backend: fla
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
      C(transformers_gdr_impl), C(backend), C(backend_expected), C(require_backend) (the requirement
      checked, V(auto) resolved to V(fla) or V(any)), C(gdr_max_abs_error),
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

from ansible.module_utils.basic import AnsibleModule
from ansible_collections.specops.drafter.plugins.module_utils.ml_env.fla_env import FlaEnv
from ansible_collections.specops.drafter.plugins.module_utils.ml_env.fla_env_verify import REQUIRE_BACKEND_CHOICES


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
            require_backend=dict(type="str", default="any", choices=REQUIRE_BACKEND_CHOICES),
            gdr_sizes=dict(type="list", elements="dict"),
            verify_cache_dir=dict(type="path"),
        ),
        supports_check_mode=True,
    )
    FlaEnv(module).run()


if __name__ == "__main__":
    main()
