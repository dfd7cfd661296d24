"""``/ui/results`` renders a benchmark report's Markdown, never the report's own HTML:
a report holding a script, an event handler or a ``javascript:`` link is shown as text
to a viewer's session, while its Markdown (tables, code, links, its plots) still
renders."""

from __future__ import annotations

from html.parser import HTMLParser
from pathlib import Path

import pytest
from fastapi import FastAPI

from fusuma.api.app import create_app
from fusuma.paths import Paths
from fusuma.state.roles import Role
from tests.unit import test_api, test_api_roles

paths = test_api.paths

REPORT = """\
# Boot <script>alert("title")</script>

<script>document.title = "pwned"</script>

<img src=x onerror="alert('img')">

| mode | boot_ms <b onmouseover=alert(1)>x</b> |
|---|---|
| tcg | 812 |

See [the data](boot-1.json), [the source](https://example.org/fusuma) and
[a trap](javascript:alert(1)), ![plot](boot.png), ![trap](data:image/svg+xml,x).

```
<script>shown as code</script>
```
"""


class Elements(HTMLParser):
    """Every element of an HTML text with its attributes, as a browser would see them."""

    def __init__(self, text: str) -> None:
        super().__init__()
        self.found: list[tuple[str, dict[str, str | None]]] = []
        self.feed(text)

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.found.append((tag, dict(attrs)))


@pytest.fixture
def app(paths: Paths, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> FastAPI:
    results = tmp_path / "results"
    (results / "boot").mkdir(parents=True)
    (results / "boot" / "report.md").write_text(REPORT)
    (results / "boot" / "boot.png").write_bytes(b"\x89PNG\r\n\x1a\n")
    monkeypatch.setenv("FUSUMA_RESULTS_DIR", str(results))
    return create_app(paths)


def test_a_reports_html_is_text(app: FastAPI) -> None:
    r = test_api_roles.client_as(app, Role.VIEWER).get("/ui/results/boot")
    assert r.status_code == 200, r.text
    page = r.text
    article = page.split('<article class="card report" id="report">', 1)[1].split(
        "</article>", 1)[0]
    # The report brought no element of its own: no script, no handler, no trap URL.
    found = Elements(article).found
    tags = {tag for tag, _ in found}
    assert tags <= {"h1", "p", "table", "thead", "tbody", "tr", "th", "td", "a", "img",
                    "pre", "code"}, tags
    for tag, attrs in found:
        assert not any(a.startswith("on") for a in attrs), (tag, attrs)
        for a in ("href", "src"):
            url = attrs.get(a)
            assert url is None or url.startswith(("https:", "/ui/results/", "boot-1")), \
                (tag, attrs)
    # ... and says it all as text.
    assert '&lt;script&gt;document.title = "pwned"&lt;/script&gt;' in article
    assert "&lt;img src=x onerror=" in article
    assert "&lt;script&gt;shown as code&lt;/script&gt;" in article
    # Its Markdown renders: heading, table, code, safe links, its plot under the report.
    assert "<h1>Boot &lt;script&gt;" in article and "<td>812</td>" in article
    assert '<a href="boot-1.json">the data</a>' in article
    assert '<a href="https://example.org/fusuma">the source</a>' in article
    assert "<a>a trap</a>" in article
    assert '<img alt="plot" src="/ui/results/boot/boot.png" />' in article
    # The only scripts of the page are fusuma's own, and the policy forbids inline ones.
    assert page.count("<script") == page.count('<script src="/static/')
    assert "script-src 'self'" in r.headers["content-security-policy"]
