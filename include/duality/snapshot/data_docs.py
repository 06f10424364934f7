"""Great Expectations' Data Docs views, with their Jinja templates compiled once.

GE's views make a new Jinja environment for every build, so each validation compiled its
templates again (a tenth of a warm validation's time, docs/benchmarks.md). These views give
that environment Jinja's own bytecode cache, kept in the user's temporary folder: shared by the
batch server's steps and by separate processes. The site's configuration in
`duality.validate` names them.
"""

from __future__ import annotations

from typing import Any

from great_expectations.render.view import DefaultJinjaIndexPageView, DefaultJinjaPageView
from jinja2 import FileSystemBytecodeCache


def _cache() -> FileSystemBytecodeCache | None:
    try:
        return FileSystemBytecodeCache()
    except (RuntimeError, OSError):  # no private folder of this user's in the temporary folder
        return None


_COMPILED = _cache()


class PageView(DefaultJinjaPageView):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.env.bytecode_cache = _COMPILED


class IndexPageView(DefaultJinjaIndexPageView):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.env.bytecode_cache = _COMPILED


def views() -> dict[str, Any]:
    """The parts of a SiteBuilder configuration that name these views."""
    return {
        "site_index_builder": {
            "class_name": "DefaultSiteIndexBuilder",
            "view": {"module_name": __name__, "class_name": "IndexPageView"},
        },
        "validations": {"view": {"module_name": __name__, "class_name": "PageView"}},
    }
