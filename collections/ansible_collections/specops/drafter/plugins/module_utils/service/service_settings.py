# -*- coding: utf-8 -*-
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""Settings of the server that can be checked while it serves: where it listens and where it is checked.

The module runs on the server's host and checks the server there (health, the port's holder, the
stop). A --host this host has no address for makes the launch fail after the stop; a URL naming
another host, or another port, makes the checks look at some other server on this host's port. Both
are refused before anything is touched.
"""

from __future__ import absolute_import, annotations, division, print_function

__metaclass__ = type

import errno
import socket

from urllib.parse import urlparse

WILDCARDS = ("", "0.0.0.0", "::")


def option_after(argv: list[str], name: str) -> str | None:
    return argv[argv.index(name) + 1] if name in argv[:-1] else None


def bind_error(host: str) -> str | None:
    """Why this host cannot listen on `host` (an address or a name), or None when it can."""
    if host in WILDCARDS:
        return None
    try:
        addresses = socket.getaddrinfo(host, 0, 0, socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError) as error:
        return "the name does not resolve (%s)" % error
    last = None
    for family, kind, proto, _name, address in addresses:
        try:
            with socket.socket(family, kind, proto) as probe:
                # Port 0: the kernel picks a free port, so the probe never meets a listener.
                probe.bind((address[0], 0) + tuple(address[2:]))
            return None
        except OSError as error:
            last = error
    if last is not None and last.errno == errno.EADDRNOTAVAIL:
        return "no interface of this host has that address"
    return str(last)


def port_error(port: str | None) -> str | None:
    try:
        number = int(str(port))
    except ValueError:
        return "%r is not a port number" % port
    return None if 1 <= number <= 65535 else "%d is not a port number (1-65535)" % number


def url_problems(url: str, spec_port: str | None, refused_host: str | None = None) -> list[str]:
    parsed = urlparse(url)
    if parsed.scheme not in ("http", "https") or not parsed.hostname:
        return ["sglang_service_url %s is not an http(s) URL with a host" % url]
    try:
        url_port = parsed.port or (443 if parsed.scheme == "https" else 80)
    except ValueError:
        return ["sglang_service_url %s has no valid port" % url]
    problems = []
    reason = None if parsed.hostname == refused_host else bind_error(parsed.hostname)
    if reason:
        problems.append(
            "sglang_service_url %s names %s, which is not this host (%s): the server is checked, and stopped, "
            "on the host it runs on, so this URL would look at another server; leave sglang_service_url unset "
            "(it follows sglang_service_host and sglang_service_port) or name an address of this host"
            % (url, parsed.hostname, reason)
        )
    if spec_port is not None and str(url_port) != str(spec_port):
        problems.append(
            "sglang_service_url %s names port %d but the server listens on %s (sglang_service_port): the health "
            "checks would reach whatever holds port %d; leave sglang_service_url unset or give both the same port"
            % (url, url_port, spec_port, url_port)
        )
    return problems


def settings_problems(spec: dict | None, url: str) -> list[str]:
    """What is wrong with where the server listens (spec argv --host, --port) and where it is checked (url)."""
    argv = [str(arg) for arg in (spec or {}).get("argv") or []]
    host, port = option_after(argv, "--host"), option_after(argv, "--port")
    problems = []
    refused_host = None
    if host is not None:
        reason = bind_error(host)
        if reason:
            refused_host = host
            problems.append(
                "sglang_service_host %s: the server cannot listen there, %s; use an address of this host "
                "(127.0.0.1, 0.0.0.0 for every interface, or one that `ip -brief address` lists)"
                % (host, reason)
            )
    if port is not None:
        reason = port_error(port)
        if reason:
            problems.append("sglang_service_port: %s" % reason)
            port = None
    if url:
        problems += url_problems(url, port, refused_host)
    return problems
