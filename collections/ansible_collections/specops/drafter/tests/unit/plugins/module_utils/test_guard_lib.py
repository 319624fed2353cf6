# -*- coding: utf-8 -*-
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""The guard's code as guard_control places it in <state_dir>/guard_lib: every module_utils file the guard
imports (through its subpackages), nothing else from the collection, and only the standard library besides."""

from __future__ import absolute_import, division, print_function

__metaclass__ = type

import ast
import os
import subprocess
import sys

from ansible_collections.specops.drafter.plugins.module_utils.window import guard_control

PACKAGE = guard_control.PACKAGE
MODULE_UTILS = os.path.dirname(os.path.dirname(os.path.abspath(guard_control.__file__)))


def imports_of(name):
    """The module_utils (dotted names under module_utils) and the other top-level modules NAME imports."""
    with open(os.path.join(MODULE_UTILS, *name.split(".")) + ".py") as handle:
        tree = ast.parse(handle.read())
    ours, others = set(), set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith(PACKAGE + "."):
            base = node.module[len(PACKAGE) + 1:]
            for alias in node.names:
                # `from <package>.common import procfs` imports a module; `from <package>.common.procfs import x` a name.
                candidate = base + "." + alias.name
                is_module = os.path.isfile(os.path.join(MODULE_UTILS, *candidate.split(".")) + ".py")
                ours.add(candidate if is_module else base)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            others.add(node.module.split(".")[0])
        elif isinstance(node, ast.Import):
            others.update(alias.name.split(".")[0] for alias in node.names)
    return ours, others


def test_the_guard_files_are_the_guard_and_what_it_imports_all_standard_library_only():
    seen, todo, foreign = set(), ["window.guard"], {}
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        ours, others = imports_of(name)
        todo.extend(ours)
        outside = sorted(m for m in others if m != "__future__" and m not in sys.stdlib_module_names)
        if outside:
            foreign[name] = outside
    assert foreign == {}, "the guard runs outside Ansible, from guard_lib: %s" % foreign
    assert sorted(seen) == sorted(guard_control.GUARD_FILES)


def test_the_placed_guard_imports_from_guard_lib_alone(tmp_path):
    lib = guard_control.place_guard_lib(str(tmp_path))
    for name in guard_control.GUARD_FILES:
        parts = (PACKAGE + "." + name).split(".")
        assert os.path.isfile(os.path.join(lib, *parts[:-1] + [parts[-1] + ".py"])), name
        for depth in range(1, len(parts)):
            assert os.path.isfile(os.path.join(lib, *parts[:depth] + ["__init__.py"])), parts[:depth]
    # -S: no site-packages, so neither Ansible nor an installed collection can stand in for a missing file.
    probe = ("import sys, %s as guard; print(guard.__file__); "
             "print(sorted(m for m in sys.modules if m.split('.')[0] == 'ansible'))") % (PACKAGE + ".window.guard")
    env = dict(os.environ, PYTHONPATH=lib)
    done = subprocess.run([sys.executable, "-S", "-c", probe], env=env, cwd=str(tmp_path),
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, check=False)
    assert done.returncode == 0, done.stderr.decode()
    where, ansible = done.stdout.decode().splitlines()
    assert where.startswith(lib + os.sep)
    assert ansible == "[]"
