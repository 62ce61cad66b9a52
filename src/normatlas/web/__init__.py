"""The atlas as a local web page: ``normatlas serve`` (issue 22).

A page is a view of the library, not a second implementation: a single page (plain HTML, CSS and
JavaScript in ``static/``, no framework, no build step, no asset from elsewhere) asks a small JSON API
for the taxonomy, a reduction classified and computed by the core, the placement presets, the model
matrix, the papers, the experiment results and inspection reports, and draws them. The server is the
standard library's ``ThreadingHTTPServer`` bound to loopback (:mod:`normatlas.web.server`); the API is
documented in ``docs/web.md``.
"""

from __future__ import annotations

from .server import AtlasServer, Config, make_server

__all__ = ["AtlasServer", "Config", "make_server"]
