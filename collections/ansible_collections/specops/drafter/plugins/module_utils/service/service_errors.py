# -*- coding: utf-8 -*-
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""The one error of the service window: a message that names the thing and the fix, plus result fields."""

from __future__ import absolute_import, annotations, division, print_function

__metaclass__ = type


class ServiceError(Exception):
    """An error the user can act on; `fields` go into the module's result beside msg."""

    def __init__(self, msg: str, **fields) -> None:
        super(ServiceError, self).__init__(msg)
        self.msg = msg
        self.fields = fields


def one_refusal(problems: list, **fields) -> ServiceError:
    """Several errors as one: each numbered with its fix, their fields merged (one alone is returned as it is)."""
    merged = dict(fields)
    for problem in problems:
        merged.update(problem.fields)
    if len(problems) == 1:
        return ServiceError(problems[0].msg, **merged)
    return ServiceError("%d problems, each to fix: %s" % (
        len(problems), "; ".join("(%d) %s" % (number, problem.msg) for number, problem in enumerate(problems, 1))),
        **merged)
