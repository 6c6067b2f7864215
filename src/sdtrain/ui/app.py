"""The HTTP layer: the JSON API under /api/ (the page uses nothing else) and the static page.

Safe by default: a request must name a loopback host unless a token guards the app (a web page elsewhere
cannot reach a local UI through DNS rebinding); with a token every request carries it; a POST must be JSON (a
form on another site cannot send one without the browser asking first, which this app never allows).
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import re
import subprocess
import threading
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any
from urllib.parse import parse_qsl, urlencode

from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import FileResponse, JSONResponse, RedirectResponse, Response, StreamingResponse
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles

from sdtrain import runview
from sdtrain.ui import jobs, start
from sdtrain.ui.jobs import Queue, Refused
from sdtrain.ui.runs import NotFound, Runs, clean, inside, valid_name

log = logging.getLogger(__name__)

STATIC = Path(__file__).parent / "static"
RECIPES = Path(__file__).resolve().parents[1] / "configs"
COOKIE = "sdtrain_ui_token"
LOOPBACK = {"127.0.0.1", "localhost", "::1", "[::1]"}
# An event stream ends after this long and the browser reconnects from its last event: a lost client's
# stream does not poll forever.
STREAM_SECONDS = 600
SCRATCH = ".sdtrain-ui"
# Data previews of the start page kept under ROOT/.sdtrain-ui/previews: older ones are deleted.
KEEP_PREVIEWS = 20
_PREVIEW_NAME = re.compile(r"^preview-\d+\.png$")


def error(message: str, status: int = 400, **extra: Any) -> JSONResponse:
    return JSONResponse({"error": message, **extra}, status_code=status)


def ok(value: Any, status: int = 200) -> JSONResponse:
    return JSONResponse(clean(value), status_code=status)


class Guard:
    """ASGI middleware: loopback Host or the token, and JSON-only POSTs."""

    def __init__(self, app: Any, token: str | None):
        self.app, self.token = app, token

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        request = Request(scope)
        refusal = self._refusal(request)
        if refusal is not None:
            return await refusal(scope, receive, send)
        if self.token and request.query_params.get("token") and request.method == "GET":
            # The address printed at start carries the token once; a cookie carries it from then on.
            query = urlencode([(k, v) for k, v in parse_qsl(scope.get("query_string", b"").decode())
                               if k != "token"])
            response = RedirectResponse(scope["path"] + (f"?{query}" if query else ""), status_code=303)
            response.set_cookie(COOKIE, self.token, httponly=True, samesite="strict")
            return await response(scope, receive, send)
        return await self.app(scope, receive, send)

    def _refusal(self, request: Request) -> Response | None:
        if self.token:
            if not self._carries_token(request):
                return error("this UI needs its token: open the address `sdtrain ui` printed (it ends in ?token=), "
                             "or send Authorization: Bearer $SDTRAIN_UI_TOKEN", 401)
        elif (request.url.hostname or "") not in LOOPBACK:
            return error(f"host '{request.url.hostname}' refused: without SDTRAIN_UI_TOKEN the UI answers "
                         "only on 127.0.0.1 and localhost", 403)
        if request.method == "POST":
            if request.headers.get("content-type", "").split(";")[0].strip() != "application/json":
                return error("POST a JSON body (Content-Type: application/json)", 415)
            origin = request.headers.get("origin")
            if origin and origin.split("://", 1)[-1] != request.headers.get("host"):
                return error(f"origin {origin} refused: the API answers its own page only", 403)
        return None

    def _carries_token(self, request: Request) -> bool:
        given = [request.query_params.get("token"), request.cookies.get(COOKIE)]
        header = request.headers.get("authorization", "")
        if header.lower().startswith("bearer "):
            given.append(header[7:].strip())
        return any(g and hmac.compare_digest(g.encode(), self.token.encode()) for g in given)


class Api:
    """The routes' handlers over one root's runs and one job queue."""

    def __init__(self, root: Path, queue: Queue):
        self.runs = Runs(root)
        self.root = self.runs.root
        self.queue = queue
        self.scratch = self.root / SCRATCH
        self._environment: list | None = None
        self._devices: list | None = None

    # ------------------------------------------------------------------------------------------ listing

    async def index(self, request: Request) -> Response:
        return FileResponse(STATIC / "index.html")

    async def routes(self, request: Request) -> Response:
        return ok({"root": self.root, "routes": API_ROUTES, "docs": "docs/ui.md"})

    async def list_runs(self, request: Request) -> Response:
        return ok({"root": self.root, "runs": await run_in_threadpool(self._list)})

    def _list(self) -> list[dict]:
        found = self.runs.find()
        # A run the UI queued has no config.yaml yet, so runview does not list it; the queue does.
        found += [job.run for job in self.queue.jobs
                  if job.kind != "prepare" and job.run not in found and job.run.is_dir()]
        return [self._with_job(run, self.runs.summary(run)) for run in sorted(found, key=self.runs.name)]

    def _with_job(self, run: Path, summary: dict) -> dict:
        job = self.queue.job_for(run)
        summary = {**summary, "job": job.to_json() if job else None}
        if job and job.state == "queued":
            summary["status"] = "queued"
        elif job and job.state == "running" and summary.get("status") != "running":
            summary["status"] = "starting"
        return summary

    async def run_action(self, request: Request) -> Response:
        """/api/runs/{run}/{action...}: run ids hold slashes, so one route splits them."""
        try:
            run, rest = self.runs.split(request.path_params["rest"])
        except NotFound as exc:
            return error(str(exc), 404)
        action = rest[0] if rest else ""
        handlers = {("GET", ""): self._get, ("GET", "metrics"): self._metrics, ("GET", "events"): self._events,
                    ("GET", "files"): self._file, ("GET", "log"): self._log, ("POST", "stop"): self._stop,
                    ("POST", "resume"): self._resume, ("POST", "export"): self._export,
                    ("POST", "preview"): self._preview_run}
        handler = handlers.get((request.method, action))
        if handler is None or (action != "files" and len(rest) > 1):
            return error(f"no route {request.method} {request.url.path}; GET /api lists them", 404)
        try:
            return await handler(request, run, rest[1:])
        except NotFound as exc:
            return error(str(exc), 404)
        except Refused as exc:
            return error(str(exc), 409)

    async def _get(self, request: Request, run: Path, rest: list[str]) -> Response:
        detail = await run_in_threadpool(self.runs.detail, run)
        detail["summary"] = self._with_job(run, detail["summary"])
        detail["resumable"] = self._resume_command(run) is not None
        detail["child_log"] = await run_in_threadpool(_tail, run / jobs.CHILD_LOG, 40)
        return ok(detail)

    async def _metrics(self, request: Request, run: Path, rest: list[str]) -> Response:
        query = request.query_params
        by = query.get("by", "step")
        if by not in ("step", "samples"):
            return error(f"by={by}: pass by=step or by=samples")
        try:
            lo = float(query["from"]) if query.get("from") else None
            hi = float(query["to"]) if query.get("to") else None
            points = min(max(int(query.get("points", 2000)), 10), 20000)
        except ValueError:
            return error("from, to and points are numbers")
        keys = [k for k in query.get("keys", "").split(",") if k] or None
        return ok(await run_in_threadpool(self.runs.metrics, run, keys, by, lo, hi, points))

    async def _file(self, request: Request, run: Path, rest: list[str]) -> Response:
        path = self.runs.file(run, "/".join(rest))
        download = request.query_params.get("download") is not None
        return FileResponse(path, filename=path.name if download else None,
                            content_disposition_type="attachment" if download else "inline")

    async def _log(self, request: Request, run: Path, rest: list[str]) -> Response:
        lines = min(max(int(request.query_params.get("lines", "200") or 200), 1), 5000)
        return ok({"lines": await run_in_threadpool(runview.log_tail, run, lines),
                   "child_log": await run_in_threadpool(_tail, run / jobs.CHILD_LOG, 40)})

    async def _events(self, request: Request, run: Path, rest: list[str]) -> Response:
        if "after" in request.query_params:
            after = int(request.query_params["after"] or 0)
            found = await run_in_threadpool(runview.read_events, run, after)
            summary = self._with_job(run, await run_in_threadpool(self.runs.summary, run))
            return ok({"events": found, "next": found[-1]["index"] + 1 if found else after, "summary": summary})
        last = request.headers.get("last-event-id", "")
        after = int(last) + 1 if last.isdigit() else 0
        seconds = min(float(request.query_params.get("seconds", STREAM_SECONDS)), STREAM_SECONDS)
        return StreamingResponse(self._stream(request, run, after, seconds), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-store"})

    async def _stream(self, request: Request, run: Path, after: int, seconds: float) -> AsyncIterator[str]:
        """Server-sent events: each new events.jsonl line as `run`, the summary as `summary` when it changes."""
        end, sent, quiet = time.monotonic() + seconds, None, 0
        yield "retry: 2000\n\n"
        while time.monotonic() < end and not await request.is_disconnected():
            for event in await run_in_threadpool(runview.read_events, run, after):
                after = event["index"] + 1
                yield f"id: {event['index']}\nevent: run\ndata: {json.dumps(clean(event))}\n\n"
            summary = self._with_job(run, await run_in_threadpool(self.runs.summary, run))
            if summary != sent:
                sent = summary
                yield f"event: summary\ndata: {json.dumps(clean(summary))}\n\n"
            quiet += 1
            if quiet % 15 == 0:
                yield ": still here\n\n"
            await asyncio.sleep(min(1.0, max(end - time.monotonic(), 0)))

    # ------------------------------------------------------------------------------------------ acting

    async def _stop(self, request: Request, run: Path, rest: list[str]) -> Response:
        summary = await run_in_threadpool(self.runs.summary, run)
        job = self.queue.cancel(run)
        if summary.get("status") == "running" or (job and job.state == "running"):
            # The trainer saves, then exits as on SIGTERM; a run the CLI started stops alike.
            await run_in_threadpool(runview.request_stop, run)
            return ok({"run": self.runs.name(run), "stopping": True})
        if job:
            return ok({"run": self.runs.name(run), "stopping": False, "cancelled": True})
        raise Refused(f"run '{self.runs.name(run)}' is {summary.get('status')}, not running or queued")

    def _resume_command(self, run: Path) -> list[str] | None:
        argv = self.queue.last_command(run)
        if argv:
            return argv
        # A run the CLI started: its newest resolved config, with the run folder it records, is the same run.
        configs = sorted(run.glob("config.*.yaml"), key=lambda p: (p.stat().st_mtime_ns, p.name))
        config = configs[-1] if configs else run / "config.yaml"
        return jobs.train_command(config, run, []) if config.is_file() else None

    async def _resume(self, request: Request, run: Path, rest: list[str]) -> Response:
        summary = await run_in_threadpool(self.runs.summary, run)
        if summary.get("status") == "running":
            raise Refused(f"run '{self.runs.name(run)}' is running (its folder is locked by its trainer); "
                          "stop it first")
        argv = self._resume_command(run)
        if argv is None:
            raise Refused(f"run '{self.runs.name(run)}' has no config.yaml to resume from; start it anew")
        with contextlib.suppress(FileNotFoundError):
            (run / "stop").unlink()  # a stop request the last run already obeyed must not stop this one
        job = self.queue.submit(run, "resume", argv, self.queue.last_gpus(run))
        return ok({"run": self.runs.name(run), "job": job.to_json()}, 202)

    async def _export(self, request: Request, run: Path, rest: list[str]) -> Response:
        if not (run / "checkpoints").is_dir():
            raise Refused(f"run '{self.runs.name(run)}' has no checkpoint to export yet")
        job = self.queue.submit(run, "export", jobs.export_command(run, run / jobs.EXPORT_DIR))
        return ok({"run": self.runs.name(run), "job": job.to_json(), "out": f"{self.runs.name(run)}/export"}, 202)

    async def _body(self, request: Request) -> dict[str, Any]:
        try:
            body = await request.json()
        except ValueError:
            raise Refused("the request body is not JSON") from None
        if not isinstance(body, dict):
            raise Refused("the request body is a JSON object: {\"recipe\": ...} or {\"config\": ...}")
        return body

    def _config_text(self, body: dict[str, Any]) -> tuple[str, str]:
        """(text, what it came from): a bundled recipe by name, or YAML text."""
        if body.get("config") is not None:
            if not isinstance(body["config"], str):
                raise Refused("config: pass the YAML as text")
            jobs.check_yaml(body["config"])
            return body["config"], "config"
        recipe = body.get("recipe")
        if not isinstance(recipe, str) or recipe not in recipe_names():
            raise Refused(f"recipe '{recipe}': not a bundled recipe; GET /api/recipes lists them")
        return (RECIPES / f"{recipe}.yaml").read_text(), recipe

    def _new_run(self, body: dict[str, Any], source: str) -> Path:
        name = body.get("name") or f"{source.replace('/', '-')}-{time.strftime('%Y%m%d-%H%M%S')}"
        if not isinstance(name, str) or not valid_name(name):
            raise Refused(f"name {json.dumps(str(name)[:80])}: use letters, digits, . _ + - "
                          "(and / for a group folder, 3 deep at most)")
        run = self.root / name
        if run.exists() and any(run.iterdir()):
            raise Refused(f"run '{name}' already exists under {self.root}; choose another name, or resume it")
        return run

    async def check(self, request: Request) -> Response:
        try:
            body = await self._body(request)
            text, source = self._config_text(body)
            overrides = jobs.check_overrides(body.get("overrides"))
            run = self._new_run(body, source) if body.get("name") else self.root / "check"
        except Refused as exc:
            return ok({"ok": False, "problems": [str(exc)]})
        passed, lines = await run_in_threadpool(self._check, text, run, overrides)
        return ok({"ok": passed, "problems": [] if passed else lines, "message": lines[0] if passed and lines
                   else None})

    def _check(self, text: str, run: Path, overrides: list[str]) -> tuple[bool, list[str]]:
        # The check reads a file; it goes under the root's own folder, never beside the user's files.
        self.scratch.mkdir(exist_ok=True)
        path = self.scratch / f"check-{time.monotonic_ns()}.yaml"
        path.write_text(text)
        try:
            return jobs.run_check(path, run, overrides)
        finally:
            path.unlink(missing_ok=True)

    async def start(self, request: Request) -> Response:
        try:
            body = await self._body(request)
            text, source = self._config_text(body)
            overrides = jobs.check_overrides(body.get("overrides"))
            run = self._new_run(body, source)
            gpus = start.check_gpus(body.get("gpus"), await run_in_threadpool(self._device_list))
        except Refused as exc:
            return error(str(exc), 422)
        passed, lines = await run_in_threadpool(self._check, text, run, overrides)
        if not passed:
            return error(lines[0], 422, problems=lines)
        run.mkdir(parents=True, exist_ok=True)
        config = run / jobs.CONFIG_FILE
        config.write_text(text)
        argv = jobs.distributed(jobs.train_command(config, run, overrides), len(gpus))
        try:
            job = self.queue.submit(run, "train", argv, gpus)
        except Refused as exc:
            return error(str(exc), 409)
        return ok({"run": self.runs.name(run), "job": job.to_json()}, 201)

    async def recipes(self, request: Request) -> Response:
        return ok({"recipes": recipe_names()})

    async def recipe(self, request: Request) -> Response:
        name = request.path_params["name"]
        if name not in recipe_names():
            return error(f"recipe '{name}': not a bundled recipe; GET /api/recipes lists them", 404)
        return ok({"name": name, "config": (RECIPES / f"{name}.yaml").read_text()})

    async def compare(self, request: Request) -> Response:
        names = [n for n in request.query_params.get("runs", "").split(",") if n]
        if len(names) < 2:
            return error("compare: pass two or more runs, ?runs=a,b")
        try:
            runs = [self.runs.resolve(name) for name in names]
        except NotFound as exc:
            return error(str(exc), 404)
        return ok(await run_in_threadpool(self.runs.compare, runs))

    async def environment(self, request: Request) -> Response:
        if self._environment is None:
            self._environment = await run_in_threadpool(runview.environment)
        return ok({"environment": [list(row) for row in self._environment]})

    async def queue_state(self, request: Request) -> Response:
        return ok({"parallel": self.queue.parallel, "jobs": [job.to_json() for job in self.queue.jobs[-200:]]})

    # ------------------------------------------------------------------------------------------ the start page

    async def config_keys(self, request: Request) -> Response:
        try:
            return ok({"keys": await run_in_threadpool(start.KEYS.get)})
        except (Refused, OSError, ValueError, subprocess.TimeoutExpired) as exc:
            return error(f"the config reference: {exc}", 500)

    async def check_keys(self, request: Request) -> Response:
        """The YAML as typed, checked in this process (no model, no child): each problem with its key and line."""
        try:
            body = await self._body(request)
            text = body.get("config")
            if not isinstance(text, str):
                raise Refused("config: pass the YAML as text")
            overrides = jobs.check_overrides(body.get("overrides"))
        except Refused as exc:
            return error(str(exc), 422)
        problems = await run_in_threadpool(start.check_keys, text, overrides, self.scratch)
        return ok({"ok": not problems, "problems": problems})

    async def families(self, request: Request) -> Response:
        try:
            found = await run_in_threadpool(start.FAMILIES.get)
        except (Refused, OSError, ValueError, subprocess.TimeoutExpired) as exc:
            return error(f"the model families: {exc}", 500)
        return ok({"families": found, "modes": list(start.MODES)})

    async def form(self, request: Request) -> Response:
        """The short form as a recipe and overrides, which the page then checks and starts as any config."""
        try:
            body = await self._body(request)
            names = [f["name"] for f in await run_in_threadpool(start.FAMILIES.get)]
            return ok(start.form_recipe(body, names, recipe_names(), self.root))
        except Refused as exc:
            return error(str(exc), 422)

    async def devices(self, request: Request) -> Response:
        return ok({"devices": await run_in_threadpool(self._device_list)})

    def _device_list(self) -> list[dict[str, Any]]:
        if self._devices is None:
            self._devices = start.devices()
        return self._devices

    async def inspect_data(self, request: Request) -> Response:
        try:
            body = await self._body(request)
            path = start.text_field(body, "path")
        except Refused as exc:
            return error(str(exc), 422)
        return ok(await run_in_threadpool(start.inspect_data, path, self.root))

    async def prepare(self, request: Request) -> Response:
        """`sdtrain prepare folder SOURCE --out ROOT/data/NAME`, queued: the source is any folder the user typed,
        passed as an argument; the shards go under the root."""
        try:
            body = await self._body(request)
            source = start.text_field(body, "source")
            name = start.text_field(body, "name")
            if not valid_name(name):
                raise Refused(f"name {json.dumps(name[:80])}: use letters, digits, . _ + - for the data folder")
            out = self.root / "data" / name
            if out.exists() and any(p.name not in (jobs.JOB_FILE, jobs.CHILD_LOG) for p in out.iterdir()):
                raise Refused(f"data/{name} already exists under {self.root}; choose another name")
            out.mkdir(parents=True, exist_ok=True)
            job = self.queue.submit(out, "prepare", jobs.prepare_command(str(Path(source).expanduser()), out))
        except Refused as exc:
            return error(str(exc), 422)
        return ok({"out": str(out), "job": job.to_json()}, 202)

    async def prepare_state(self, request: Request) -> Response:
        name = request.path_params["name"]
        job = self.queue.job_for(self.root / "data" / name) if valid_name(name) else None
        if job is None:
            return error(f"no prepare job for data/{name}", 404)
        self.queue.poll()
        return ok({"job": job.to_json(), "log": await run_in_threadpool(_tail, job.run / jobs.CHILD_LOG, 5)})

    async def preview(self, request: Request) -> Response:
        """`sdtrain data preview` of a config from the start page: its PNG under ROOT/.sdtrain-ui/previews."""
        try:
            body = await self._body(request)
            text, _ = self._config_text(body)
            overrides = jobs.check_overrides(body.get("overrides"))
        except Refused as exc:
            return error(str(exc), 422)
        folder = self.scratch / "previews"
        folder.mkdir(parents=True, exist_ok=True)
        stamp = time.time_ns()
        config, out = folder / f"preview-{stamp}.yaml", folder / f"preview-{stamp}.png"
        config.write_text(text)
        try:
            passed, line = await run_in_threadpool(jobs.run_preview, config, out, overrides)
        finally:
            config.unlink(missing_ok=True)
        _prune(folder, KEEP_PREVIEWS)
        if not passed:
            return error(line, 422)
        return ok({"url": f"/api/previews/{out.name}", "message": line})

    async def preview_file(self, request: Request) -> Response:
        name = request.path_params["name"]
        path = self.scratch / "previews" / name
        if not _PREVIEW_NAME.match(name) or not path.is_file() or not inside(self.root, path):
            return error(f"no preview '{name}'", 404)
        return FileResponse(path)

    async def _preview_run(self, request: Request, run: Path, rest: list[str]) -> Response:
        """A run's data preview, from the config it trains with, written into the run folder."""
        config, overrides = self._run_config(run)
        out = run / jobs.PREVIEW_FILE
        passed, line = await run_in_threadpool(jobs.run_preview, config, out, overrides)
        if not passed:
            return error(line, 422)
        name = self.runs.name(run)
        return ok({"url": f"/api/runs/{name}/files/{jobs.PREVIEW_FILE}?t={time.time_ns()}", "message": line})

    def _run_config(self, run: Path) -> tuple[Path, list[str]]:
        """The config a run trains with: its newest resolved config, else the UI's with the overrides it queued."""
        configs = sorted(run.glob("config*.yaml"), key=lambda p: (p.stat().st_mtime_ns, p.name))
        if configs:
            return configs[-1], []
        if not (run / jobs.CONFIG_FILE).is_file():
            raise Refused(f"run '{self.runs.name(run)}' has no config to preview the data of")
        argv = self.queue.last_command(run) or []
        overrides = [a for a in argv if jobs.is_override(a) and not a.startswith("run_dir=")]
        return run / jobs.CONFIG_FILE, overrides


def recipe_names() -> list[str]:
    return sorted(p.relative_to(RECIPES).with_suffix("").as_posix() for p in RECIPES.glob("**/*.yaml"))


def _prune(folder: Path, keep: int) -> None:
    """Delete all but the newest `keep` previews."""
    found = sorted(folder.glob("preview-*.png"), key=lambda p: p.name)
    for old in found[:-keep]:
        old.unlink(missing_ok=True)


def _tail(path: Path, lines: int) -> list[str]:
    try:
        with open(path, "rb") as handle:
            handle.seek(0, 2)
            handle.seek(max(handle.tell() - 200 * lines, 0))
            return handle.read().decode(errors="replace").splitlines()[-lines:]
    except OSError:
        return []


API_ROUTES = [
    ("GET", "/api", "this list"),
    ("GET", "/api/runs", "every run under the root: summary, status, job"),
    ("POST", "/api/runs", "start a run: {recipe|config, overrides, name, gpus}; checked first, then queued"),
    ("GET", "/api/runs/{run}", "one run: summary, config, samples, checkpoints and files, log tail"),
    ("GET", "/api/runs/{run}/metrics", "curves: ?keys=loss,lr&by=step|samples&from=&to=&points=2000"),
    ("GET", "/api/runs/{run}/events", "server-sent events (events.jsonl lines, summary); ?after=N: JSON poll"),
    ("GET", "/api/runs/{run}/log", "the log's tail: ?lines=200"),
    ("GET", "/api/runs/{run}/files/{path}", "a file inside the run folder (?download to save it)"),
    ("POST", "/api/runs/{run}/stop", "stop after a save (a queued run leaves the queue)"),
    ("POST", "/api/runs/{run}/resume", "run the same command again: it resumes from the newest checkpoint"),
    ("POST", "/api/runs/{run}/export", "sdtrain export into RUN/export"),
    ("POST", "/api/runs/{run}/preview", "sdtrain data preview of the run's config into RUN/ui-preview.png"),
    ("GET", "/api/recipes", "the bundled recipes"),
    ("GET", "/api/recipes/{name}", "a recipe's YAML"),
    ("POST", "/api/check", "check a config as `sdtrain train CONFIG --check` does: {recipe|config, overrides}"),
    ("GET", "/api/compare", "?runs=a,b: their summaries, config differences, sample steps they share"),
    ("GET", "/api/environment", "versions and devices of the machine the UI runs on"),
    ("GET", "/api/queue", "the job queue"),
    ("GET", "/api/config/keys", "every config key: name, type, default, doc (the configuration reference)"),
    ("POST", "/api/check/keys", "{config, overrides}: unknown keys and bad values, each with key, line, message"),
    ("GET", "/api/families", "the model families and the short form's modes"),
    ("POST", "/api/form", "{family, pretrained, data, mode, steps, lr, resolution, batch_size}: recipe, overrides"),
    ("GET", "/api/devices", "the GPUs of the UI's machine (nvidia-smi): index, name, memory"),
    ("POST", "/api/data/inspect", "{path}: shards, images (prepare them first), empty or missing"),
    ("POST", "/api/data/prepare", "{source, name}: sdtrain prepare folder SOURCE --out ROOT/data/NAME, queued"),
    ("GET", "/api/data/prepare/{name}", "that job's state and its log's tail"),
    ("POST", "/api/preview", "{recipe|config, overrides}: sdtrain data preview; the grid's URL"),
    ("GET", "/api/previews/{name}", "a data preview's PNG"),
]


def create_app(root: Path, token: str | None = None, parallel: int = 1, poll: bool = True) -> Starlette:
    """The app over `root`. `poll`: run the queue's background thread (tests poll by hand)."""
    queue = Queue(root, parallel)
    api = Api(root, queue)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        if poll:
            queue.start()
            # The start page's reference and families come from children (the families import torch): ask them
            # now, so the page has them when someone opens it.
            threading.Thread(target=start.warm, name="sdtrain-ui-warm", daemon=True).start()
        try:
            yield
        finally:
            queue.close()

    async def unexpected(request: Request, exc: Exception) -> Response:
        log.exception("sdtrain ui: %s %s failed", request.method, request.url.path, exc_info=exc)
        return error(f"internal error: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''} "
                     "(the UI's terminal has the details)", 500)

    routes = [
        Route("/", api.index),
        Route("/favicon.ico", lambda request: Response(status_code=204)),
        Route("/api", api.routes),
        Route("/api/runs", api.list_runs, methods=["GET"]),
        Route("/api/runs", api.start, methods=["POST"]),
        Route("/api/runs/{rest:path}", api.run_action, methods=["GET", "POST"]),
        Route("/api/recipes", api.recipes),
        Route("/api/recipes/{name:path}", api.recipe),
        Route("/api/check", api.check, methods=["POST"]),
        Route("/api/compare", api.compare),
        Route("/api/environment", api.environment),
        Route("/api/queue", api.queue_state),
        Route("/api/config/keys", api.config_keys),
        Route("/api/check/keys", api.check_keys, methods=["POST"]),
        Route("/api/families", api.families),
        Route("/api/form", api.form, methods=["POST"]),
        Route("/api/devices", api.devices),
        Route("/api/data/inspect", api.inspect_data, methods=["POST"]),
        Route("/api/data/prepare", api.prepare, methods=["POST"]),
        Route("/api/data/prepare/{name:path}", api.prepare_state),
        Route("/api/preview", api.preview, methods=["POST"]),
        Route("/api/previews/{name}", api.preview_file),
        Mount("/static", StaticFiles(directory=STATIC), name="static"),
    ]
    app = Starlette(routes=routes, lifespan=lifespan, exception_handlers={Exception: unexpected})
    app.state.api, app.state.queue = api, queue
    app.add_middleware(Guard, token=token)
    return app

