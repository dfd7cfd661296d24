"""The web dashboard's server side: the page, its data, the login, results.

- ``GET /`` is the dashboard (a Jinja2 template and a small plain-JavaScript file
  shipped in the package: no CDN, no build step). The page reads ``/1.0/ui/state`` and
  keeps itself current from ``/1.0/events`` (EventSource), so a change made anywhere
  (the page, the CLI, another API client, a supervisor) shows within a second.
- On TCP the page needs a session: ``/login`` takes an API token and sets an HttpOnly,
  Secure, SameSite=Strict cookie; writes made with that cookie must carry the session's
  CSRF token in ``X-CSRF-Token`` (the page has it; another site cannot read it). On the
  UNIX socket the file system already decided who may connect (the sessions:
  ``fusuma.api.sessions``).
- The daemon's sampler (``fusuma.api.sampler``) keeps each running VM's CPU %, vCPU
  wait % and host memory for the last five minutes, for the sparklines.
- ``/ui/results`` renders the benchmark reports in ``docs/results`` with their plots.
- ``/manual/`` serves the manual (the MkDocs site `make docs` builds into ``build/site``)
  of the fusuma that runs, beside the dashboard; the API's Swagger UI stays at ``/docs``.
"""

from __future__ import annotations

import html
import logging
import os
import re
import urllib.parse
from pathlib import Path
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import (
    FileResponse,
    HTMLResponse,
    PlainTextResponse,
    RedirectResponse,
    Response,
)

from fusuma.api.daemon import Daemon
from fusuma.api.roles import ADMIN, PUBLIC, VIEWER, RoleRoute, identity_of
from fusuma.api.sessions import COOKIE, SESSION_S
from fusuma.errors import FusumaError, NotFoundError
from fusuma.state.roles import Role
from fusuma.views.host import ps_data
from fusuma.views.share import host_ksm, report_data

LOG = logging.getLogger(__name__)

HERE = Path(__file__).parent
STATIC = HERE / "static"
TEMPLATES = HERE / "templates"


def results_dir() -> Path:
    """Where the benchmark reports are: FUSUMA_RESULTS_DIR, else the source tree's
    docs/results (next to the package when installed from a clone)."""
    env = os.environ.get("FUSUMA_RESULTS_DIR")
    if env:
        return Path(env)
    return Path(__file__).resolve().parents[3] / "docs" / "results"


def manual_dir() -> Path:
    """Where the built manual is: FUSUMA_MANUAL_DIR, else the source tree's build/site
    (what `make docs` builds), so the daemon serves the manual of its own version."""
    env = os.environ.get("FUSUMA_MANUAL_DIR")
    if env:
        return Path(env)
    return Path(__file__).resolve().parents[3] / "build" / "site"


# The site's theme has inline scripts and styles of its own; nothing may come from
# elsewhere.
MANUAL_CSP = ("default-src 'self'; script-src 'self' 'unsafe-inline'; "
              "style-src 'self' 'unsafe-inline'; img-src 'self' data:; "
              "frame-ancestors 'none'")


def manual_file(base: Path, rel: str) -> Path | None:
    """The file of the built manual that ``/manual/REL`` names (a directory's
    index.html), or None: nothing outside ``base`` is ever named, whatever REL holds
    (``..``, a symbolic link out)."""
    root = base.resolve()
    try:
        target = (root / rel).resolve()
    except (OSError, RuntimeError, ValueError):
        return None
    if not target.is_relative_to(root):
        return None
    if target.is_dir():
        target = target / "index.html"
    return target if target.is_file() else None


# -- the state the page shows -----------------------------------------------------------
def vcpu_cores(pid: int) -> dict[int, int]:
    """vCPU index -> the core its thread last ran on (/proc/PID/task/TID/stat field 39)."""
    from fusuma.governor import measure

    out: dict[int, int] = {}
    for tid, st in measure.read_threads(pid).items():
        if st.vcpu is None:
            continue
        try:
            fields = Path(f"/proc/{pid}/task/{tid}/stat").read_text().rsplit(")", 1)[1]
            out[st.vcpu] = int(fields.split()[36])
        except (OSError, IndexError, ValueError):
            continue
    return out


def ui_state(d: Daemon) -> dict[str, Any]:
    """Everything the dashboard shows, in one read."""
    from fusuma.supervisor import rpc

    c = d.ctx()
    data = ps_data(c, memory=d.sampler.memory)
    host = c.parts.host
    governor: dict[str, Any] = {}
    for p in data["partitions"]:
        if p["supervisor_pid"] is None:
            continue
        try:
            governor[p["name"]] = c.parts.client(p["name"]).send(
                rpc.GovernorStatus(limit=20), timeout=2.0).status
        except FusumaError as exc:
            governor[p["name"]] = {"error": str(exc)}
        try:
            p["memory_usage_mib"] = round(c.parts.cg.memory_current(p["name"]) / 2**20, 1)
        except FusumaError:
            p["memory_usage_mib"] = None
    # Each partition's QEMU version comes from ps_data: cached probes only, so a page
    # load runs no binary.
    for p in data["partitions"]:
        p.setdefault("memory_usage_mib", None)
    samples = d.sampler.history()
    lent: dict[int, str] = {}
    for v in data["vms"]:
        st = governor.get(v["partition"], {})
        ctl: dict[str, Any] = next(
            (x for x in st.get("vms", []) if x.get("name") == v["name"]), {})
        v["governor"] = ctl or None
        for core in ctl.get("dedicated_cores") or []:
            lent[int(core)] = v["name"]
        pts = samples.get(v["name"], [])
        last = next((p for p in reversed(pts) if "cpu_pct" in p), None)
        v["cpu_pct"] = last["cpu_pct"] if last else None
        v["wait_pct"] = last["wait_pct"] if last else None
        v["vcpu_cores"] = vcpu_cores(v["pid"]) if v["pid"] and v["state"] in (
            "running", "paused") else {}
    owner = {core: p["name"] for p in data["partitions"] for core in p["cpus"]}
    cores = []
    for core in host.cpus:
        cores.append({"core": core, "partition": owner.get(core),
                      "vcpus": [f"{v['name']}/{i}" for v in data["vms"]
                                for i, cc in v["vcpu_cores"].items() if cc == core],
                      "lent_to": lent.get(core)})
    try:
        share = report_data(c)
    except FusumaError as exc:
        share = {"error": str(exc)}
    # The CPU governor's decisions and the memory governor's, in one log.
    decisions = sorted((dd | {"partition": name} for name, st in governor.items()
                        for dd in [*st.get("decisions", []),
                                   *(st.get("memory") or {}).get("decisions", [])]),
                       key=lambda x: -x["at"])[:30]
    from fusuma.memshare.ksm import KSM_RISK

    return {"host": {"cores": host.cpus, "memory_mib": host.memory_total_mib,
                     "memory_for_partitions_mib": host.memory_available_for_partitions_mib,
                     "hostname": os.uname().nodename},
            "partitions": data["partitions"], "vms": data["vms"], "cores": cores,
            "networks": data["networks"],
            "share": share, "ksm_risk": KSM_RISK, "decisions": decisions,
            "samples": samples, "last_event_id": d.hub.last_id}


SAFE_URL = re.compile(r"(?:https?:|mailto:|#|/(?!/)|[A-Za-z0-9._-]+(?:[/#?]|$))",
                      re.IGNORECASE)


def md_to_html(text: str) -> str:
    """A report's Markdown as HTML that carries none of the report's own HTML: raw
    HTML blocks and inline tags come out as escaped text (Python-Markdown's documented
    way: without its ``html_block`` and ``html`` processors), and a link or image whose
    URL is not http(s), mailto, a fragment or a relative path loses it
    (``javascript:``, ``data:``). A report is a file in the results directory, not
    fusuma's own page: whoever can write one must not run script in a viewer's
    session."""
    import markdown
    from markdown.treeprocessors import Treeprocessor

    class DropUnsafeUrls(Treeprocessor):
        def run(self, root: Any) -> None:
            for el in root.iter():
                for attr in ("href", "src"):
                    url = el.get(attr)
                    if url is not None and not SAFE_URL.match(url.strip()):
                        del el.attrib[attr]

    md = markdown.Markdown(extensions=["tables", "fenced_code"])
    md.preprocessors.deregister("html_block")
    md.inlinePatterns.deregister("html")
    md.treeprocessors.register(DropUnsafeUrls(md), "drop_unsafe_urls", 0)
    return str(md.convert(text))


# -- routes --------------------------------------------------------------------------
def router(d: Daemon) -> APIRouter:
    from jinja2 import Environment, FileSystemLoader, select_autoescape

    env = Environment(loader=FileSystemLoader(str(TEMPLATES)),
                      autoescape=select_autoescape(["html"]))
    r = APIRouter(include_in_schema=False, route_class=RoleRoute)

    def page(template: str, **ctx: Any) -> HTMLResponse:
        return HTMLResponse(env.get_template(template).render(**ctx),
                            headers={"Cache-Control": "no-store",
                                     "Content-Security-Policy":
                                         "default-src 'self'; img-src 'self' data:; "
                                         "style-src 'self'; script-src 'self'; "
                                         "frame-ancestors 'none'",
                                     "X-Content-Type-Options": "nosniff"})

    @r.get("/", dependencies=[VIEWER])
    def index(request: Request) -> HTMLResponse:
        sess = request.scope.get("state", {}).get("session")
        who = identity_of(request)
        return page("index.html", csrf=sess.csrf if sess else "",
                    tcp=sess is not None, hostname=os.uname().nodename,
                    role=who.role.value if who else "", who=who.name if who else "")

    @r.get("/login", dependencies=[PUBLIC])
    def login_page(request: Request, error: str = "") -> HTMLResponse:
        return page("login.html", error=error)

    @r.post("/login", dependencies=[PUBLIC])
    async def login(request: Request) -> Response:
        from fusuma.ops.tokens import digest

        # Read the form by hand: the request limits (app.Limits) label every POST body
        # JSON, so FastAPI's Form() would not find the field.
        raw = await request.body()
        try:
            fields = urllib.parse.parse_qs(raw.decode("utf-8", "replace"), max_num_fields=8)
        except ValueError:
            fields = {}
        token = (fields.get("token") or [""])[0].strip()
        if not token or len(token) > 200:
            return RedirectResponse("/login?error=give+an+API+token", status_code=303)
        h = digest(token)
        rec = await d.authenticate(lambda: d.db().token_by_hash(h))
        if rec is None:
            return RedirectResponse("/login?error=that+token+is+not+valid+(unknown+or+"
                                    "revoked)", status_code=303)
        if not rec.role.includes(Role.VIEWER):
            why = (f"token {rec.name!r} has the {rec.role} role, which reads only "
                   "/metrics; the dashboard needs the viewer role or above")
            return RedirectResponse("/login?" + urllib.parse.urlencode({"error": why}),
                                    status_code=303)
        sid, _ = d.sessions.create(rec.name, h)
        resp = RedirectResponse("/", status_code=303)
        resp.set_cookie(COOKIE, sid, max_age=SESSION_S, httponly=True, secure=True,
                        samesite="strict", path="/")
        return resp

    @r.post("/logout", dependencies=[PUBLIC])
    def logout(request: Request) -> Response:
        d.sessions.drop(request.cookies.get(COOKIE))
        resp = RedirectResponse("/login", status_code=303)
        resp.delete_cookie(COOKIE, path="/")
        return resp

    @r.get("/static/{name}", dependencies=[PUBLIC])
    def static(name: str) -> FileResponse:
        path = STATIC / name
        if "/" in name or name.startswith(".") or not path.is_file():
            raise NotFoundError(f"no static file {name!r}.")
        return FileResponse(path, headers={"Cache-Control": "no-cache"})

    @r.get("/1.0/ui/state", dependencies=[VIEWER])
    def state() -> dict[str, Any]:
        return ui_state(d)

    @r.get("/ui/results", dependencies=[VIEWER])
    def results() -> HTMLResponse:
        base = results_dir()
        reports = sorted(p.parent.name for p in base.glob("*/report.md")) \
            if base.is_dir() else []
        return page("results.html", reports=reports, body=None, name=None, base=str(base))

    @r.get("/ui/results/{name}", dependencies=[VIEWER])
    def result(name: str) -> HTMLResponse:
        base = results_dir()
        path = base / name / "report.md"
        if not re.fullmatch(r"[A-Za-z0-9._-]+", name) or name.startswith(".") \
                or not path.is_file():
            raise NotFoundError(f"no report {name!r} in {base}.")
        body = md_to_html(path.read_text())
        # Plots referenced relative to the report become URLs under it.
        body = re.sub(r'src="([A-Za-z0-9._-]+\.png)"',
                      lambda m: f'src="/ui/results/{html.escape(name)}/{m.group(1)}"', body)
        plots = sorted(p.name for p in (base / name).glob("*.png"))
        return page("results.html", reports=None, body=body, name=name, plots=plots,
                    base=str(base))

    @r.get("/ui/results/{name}/{plot}", dependencies=[VIEWER])
    def plot(name: str, plot: str) -> FileResponse:
        base = results_dir()
        ok = re.fullmatch(r"[A-Za-z0-9._-]+", name) and re.fullmatch(
            r"[A-Za-z0-9._-]+\.png", plot) and not name.startswith(".")
        path = base / name / plot
        if not ok or not path.is_file():
            raise NotFoundError(f"no plot {plot!r} in report {name!r}.")
        return FileResponse(path)

    @r.get("/manual", dependencies=[VIEWER])
    def manual_root() -> Response:
        return RedirectResponse("/manual/", status_code=308)

    @r.get("/manual/{rel:path}", dependencies=[VIEWER])
    def manual(rel: str) -> Response:
        base = manual_dir()
        if not (base / "index.html").is_file():
            return PlainTextResponse(
                f"The manual is not built: run `make docs` in fusuma's source tree (it "
                f"builds the site into {base}), or point FUSUMA_MANUAL_DIR at a built "
                f"site.\n", status_code=404, headers={"Cache-Control": "no-store"})
        path = manual_file(base, rel)
        if path is not None and path.name == "index.html" and rel and \
                not rel.endswith(("/", "index.html")):
            # A page's directory without its slash: the page's relative links need it.
            return RedirectResponse("/manual/" + urllib.parse.quote(rel) + "/",
                                    status_code=308)
        if path is None:
            return PlainTextResponse(f"No page /manual/{rel} in the manual.\n",
                                     status_code=404)
        return FileResponse(path, headers={"Cache-Control": "no-cache",
                                           "Content-Security-Policy": MANUAL_CSP,
                                           "X-Content-Type-Options": "nosniff"})

    @r.put("/1.0/share/ksm", dependencies=[ADMIN])
    def ksm(body: dict[str, Any]) -> dict[str, Any]:
        run = body.get("run")
        if not isinstance(run, bool) or set(body) - {"run"}:
            from fusuma.errors import SpecError

            raise SpecError('give {"run": true} or {"run": false}.')
        k = host_ksm()
        k.set_run(1 if run else 0)
        return {"run": run, **k.read_settings().as_json()}

    return r

