# -*- coding: utf-8 -*-
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""What a module's exit_json/fail_json raise under the fixtures in conftest.py."""

from __future__ import absolute_import, division, print_function

__metaclass__ = type


class AnsibleExitJson(Exception):
    """exit_json was called; .result holds what the module returned."""

    def __init__(self, result):
        super(AnsibleExitJson, self).__init__(result)
        self.result = result


class AnsibleFailJson(Exception):
    """fail_json was called; .result holds msg and the rest."""

    def __init__(self, result):
        super(AnsibleFailJson, self).__init__(result.get("msg"))
        self.result = result


def exit_json(module, **kwargs):
    kwargs.setdefault("changed", False)
    raise AnsibleExitJson(kwargs)


def fail_json(module, **kwargs):
    kwargs["failed"] = True
    raise AnsibleFailJson(kwargs)
