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
