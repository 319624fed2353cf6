"""A long-lived interpreter on the host with torch and transformers imported, that forks each stage call.

Starting a stage anew costs its imports (torch, transformers and a model class: 2.5-3.5 CPU-s on a
2-core host) every time; forked from this process, a stage starts in milliseconds. The wire protocol is
the collection's (`plugins/module_utils/stages/stage_host.py` is the client, which starts the host on a miss);
docs/architecture.md describes both ends.
"""
