# -*- coding: utf-8 -*-
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""Where the server listens and where it is checked: refused while it serves when this host cannot be it."""

from __future__ import absolute_import, division, print_function

__metaclass__ = type

from ansible_collections.specops.drafter.plugins.module_utils.service.service_settings import settings_problems

# TEST-NET-1 (RFC 5737): documentation only, an interface of no host.
ELSEWHERE = "192.0.2.1"


def spec(host="127.0.0.1", port="30000"):
    return {"argv": ["python", "-m", "sglang.launch_server", "--host", host, "--port", port]}


def test_local_and_wildcard_addresses_and_their_url_pass():
    assert settings_problems(spec(), "http://127.0.0.1:30000") == []
    assert settings_problems(spec("0.0.0.0"), "http://localhost:30000") == []


def test_a_host_this_machine_has_no_address_for_is_named_once():
    problems = settings_problems(spec(ELSEWHERE), "http://%s:30000" % ELSEWHERE)
    assert problems == ["sglang_service_host %s: the server cannot listen there, no interface of this host has "
                        "that address; use an address of this host (127.0.0.1, 0.0.0.0 for every interface, or one "
                        "that `ip -brief address` lists)" % ELSEWHERE]


def test_a_url_of_another_host_or_port_is_refused():
    [other_host] = settings_problems(spec(), "http://%s:30000" % ELSEWHERE)
    assert other_host.startswith("sglang_service_url http://%s:30000 names %s, which is not this host" % (ELSEWHERE, ELSEWHERE))
    [other_port] = settings_problems(spec(), "http://127.0.0.1:30001")
    assert "names port 30001 but the server listens on 30000 (sglang_service_port)" in other_port
    # An adopted unit gives no spec: only its URL is checked.
    assert settings_problems(None, "http://127.0.0.1:30001") == []


def test_a_port_out_of_range_is_named():
    assert settings_problems(spec(port="70000"), "")[0] == "sglang_service_port: 70000 is not a port number (1-65535)"
