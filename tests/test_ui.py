"""`sdtrain ui`: the API over fake run folders, the queue with harmless children, auth, one-line errors."""

from __future__ import annotations

import fcntl
import json
import os
import signal
import sys
from pathlib import Path

import pytest

pytest.importorskip("starlette")
pytest.importorskip("httpx")

from starlette.testclient import TestClient  # noqa: E402

from sdtrain.cli.main import main  # noqa: E402
from sdtrain.runview import thin  # noqa: E402
from sdtrain.ui import jobs  # noqa: E402
from sdtrain.ui.app import create_app  # noqa: E402

PNG = bytes.fromhex("89504e470d0a1a0a0000000d4948445200000001000000010806000000"
                    "1f15c4890000000d4944415478da63f8cfc0f01f0005000201a5f7f1a30000000049454e44ae426082")
LOCAL = "http://127.0.0.1:8765"


def fake_run(path: Path, steps: int = 20, every: int = 1, lr: float = 1e-3, max_steps: int = 20,
             checkpoints: tuple[int, ...] = (10, 20), samples: tuple[int, ...] = (10,)) -> Path:
    """A run folder as the trainer writes one, without training: config, metrics, samples, checkpoints."""
    path.mkdir(parents=True)
    (path / "config.yaml").write_text(
        f"stage: diffusion\nrun_dir: {path}\nmodel:\n  family: sd15\noptim:\n  lr: {lr}\n"
        f"train:\n  max_steps: {max_steps}\ndata:\n  batch_size: 4\n")
    lines = [json.dumps({"step": s, "loss": 1.0 / s, "lr": lr, "img_per_s": 10.0, "samples": 4 * s,
                         "time": 1000.0 + s}) for s in range(every, steps + 1, every)]
    (path / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    for step in samples:
        (path / "samples").mkdir(exist_ok=True)
        (path / "samples" / f"step_{step:08d}.png").write_bytes(PNG)
    for step in checkpoints:
        folder = path / "checkpoints" / f"step_{step:08d}"
        folder.mkdir(parents=True)
        (folder / "meta.json").write_text(json.dumps({"step": step, "samples": 4 * step}))
        (folder / "lora.safetensors").write_bytes(b"\0" * 16)
    (path / "events.jsonl").write_text(json.dumps({"time": 1000.0, "event": "start", "step": 0}) + "\n" +
                                       json.dumps({"time": 1000.0 + steps, "event": "end", "step": steps}) + "\n")
    (path / "train.log").write_text("first line\nlast line\n")
    return path


@pytest.fixture
def root(tmp_path) -> Path:
    root = tmp_path / "runs"
    fake_run(root / "alpha")
    fake_run(root / "group" / "beta", lr=2e-3, samples=(10, 20))
    (tmp_path / "secret.txt").write_text("outside the root")
    return root


@pytest.fixture
def client(root) -> TestClient:
    with TestClient(create_app(root, poll=False), base_url=LOCAL) as client:
        yield client


def test_lists_every_run_with_its_summary(client):
    runs = client.get("/api/runs").json()["runs"]
    assert [r["id"] for r in runs] == ["alpha", "group/beta"]
    assert runs[0]["step"] == 20 and runs[0]["max_steps"] == 20 and runs[0]["loss"] == pytest.approx(0.05)
    assert runs[0]["status"] == "finished" and runs[0]["job"] is None


def test_one_run_has_config_samples_checkpoints_and_log(client):
    run = client.get("/api/runs/group/beta").json()
    assert run["summary"]["id"] == "group/beta" and run["config"]["optim"]["lr"] == 2e-3
    assert [s["step"] for s in run["samples"]] == [20, 10]
    assert client.get(run["samples"][0]["url"]).content == PNG
    checkpoint = run["checkpoints"][-1]
    assert [c["name"] for c in run["checkpoints"]] == ["step_00000010", "step_00000020"]
    weights = next(f for f in checkpoint["files"] if f["weights"])
    download = client.get(weights["url"] + "?download")
    assert download.status_code == 200 and "attachment" in download.headers["content-disposition"]
    assert run["log"][-1] == "last line" and run["resumable"]
    assert client.get("/api/runs/nothing").status_code == 404


def test_metrics_are_thinned_to_a_screen_and_whole_when_zoomed(tmp_path):
    root = tmp_path / "runs"
    run = fake_run(root / "long", steps=100_000, max_steps=100_000)
    spike = json.dumps({"step": 54_321, "loss": 50.0, "lr": 1e-3, "samples": 4 * 54_321})
    with open(run / "metrics.jsonl", "a") as f:
        f.write(spike + "\n")
    with TestClient(create_app(root, poll=False), base_url=LOCAL) as client:
        data = client.get("/api/runs/long/metrics?keys=loss,lr").json()  # its speed: benchmarks/ui_scale.py
        loss = data["series"]["loss"]
        assert 1000 < len(loss["x"]) <= 2002 and max(loss["y"]) == 50.0 and loss["x"][-1] == 100_000
        zoomed = client.get("/api/runs/long/metrics?keys=loss&from=1000&to=1500").json()["series"]["loss"]
        assert zoomed["x"] == list(range(999, 1502))
        by_samples = client.get("/api/runs/long/metrics?keys=loss&by=samples").json()
        assert by_samples["series"]["loss"]["x"][-1] == 400_000
        assert client.get("/api/runs/long/metrics?by=time").status_code == 400


def test_thinning_keeps_the_envelope_and_non_finite_points():
    xs = list(range(10_000))
    ys = [float(x % 7) for x in xs]
    ys[5000] = float("nan")
    tx, ty = thin(xs, ys, 200)
    assert len(tx) <= 250 and tx == sorted(tx) and min(ty) == 0 and max(v for v in ty if v == v) == 6
    assert 5000 in tx


@pytest.mark.parametrize("path", ["files/%2e%2e/%2e%2e/secret.txt", "files/..%2F..%2Fsecret.txt",
                                  "files//etc/passwd", "files/%2Fetc%2Fpasswd", "files/link", "files/samples"])
def test_files_outside_the_run_are_refused(client, root, path):
    (root / "alpha" / "link").symlink_to(root.parent / "secret.txt")
    response = client.get(f"/api/runs/alpha/{path}")
    assert response.status_code == 404 and "outside" not in response.text


def test_events_poll_and_stream(client, root):
    with open(root / "alpha" / "events.jsonl", "a") as f:
        f.write(json.dumps({"time": 1001.0, "event": "save", "step": 10}) + "\n")
    polled = client.get("/api/runs/alpha/events?after=2").json()
    assert [e["event"] for e in polled["events"]] == ["save"] and polled["next"] == 3
    assert polled["summary"]["id"] == "alpha"
    with client.stream("GET", "/api/runs/alpha/events?seconds=0.3") as stream:
        text = "".join(stream.iter_text())
    assert "event: run" in text and '"event": "save"' in text and "id: 2" in text and "event: summary" in text


# ------------------------------------------------------------------------------------------ starting runs

# A child that trains nothing: it waits for SIGTERM, then exits as a clean stop does (75). (One killed by the
# signal before its handler is in place reads as stopped too, as a trainer stopped while it loads does.)
SLEEPER = ("import signal, sys\n"
           "signal.signal(signal.SIGTERM, lambda *a: sys.exit(75))\n"
           "print('child', sys.argv[1:], flush=True)\n"
           "signal.pause()\n")


@pytest.fixture
def stubbed(monkeypatch) -> list[list[str]]:
    """The train, check and export commands replaced by harmless children; the checks' arguments recorded."""
    checked: list[list[str]] = []

    def check(config, run, overrides):
        checked.append([str(config), str(run), *overrides])
        bad = [o for o in overrides if o.startswith("bad")]
        code = ("import sys; print('sdtrain train: error: bad.key: no such key; see docs', file=sys.stderr); "
                "sys.exit(2)") if bad else "print('ok: diffusion from scratch; no weight was loaded')"
        return [sys.executable, "-c", code]

    monkeypatch.setattr(jobs, "check_command", check)
    monkeypatch.setattr(jobs, "train_command",
                        lambda config, run, overrides: [sys.executable, "-c", SLEEPER, str(config), *overrides])
    monkeypatch.setattr(jobs, "export_command", lambda run, out: [sys.executable, "-c", "print('exported')"])
    return checked


def ended(client, name: str) -> str:
    """A run's job state once its child has exited: waited on, not polled for."""
    queue = client.app.state.queue
    queue.job_for(queue.root / name).process.wait(timeout=60)
    return job_state(client, name)


def job_state(client, name: str) -> str:
    client.app.state.queue.poll()
    return client.get(f"/api/runs/{name}").json()["summary"]["job"]["state"]


def test_start_stop_resume_through_the_queue(client, root, stubbed):
    started = client.post("/api/runs", json={"recipe": "lora", "name": "new", "overrides": ["train.max_steps=5"]})
    assert started.status_code == 201, started.text
    assert stubbed[0][1] == str(root.resolve() / "new") and stubbed[0][2:] == ["train.max_steps=5"]
    assert (root / "new" / "ui-config.yaml").read_text() == (jobs.Path(jobs.__file__).parents[1] / "configs" /
                                                               "lora.yaml").read_text()
    second = client.post("/api/runs", json={"config": "stage: diffusion\n", "name": "next"})
    assert second.status_code == 201
    # One at a time: the second waits for the first.
    assert job_state(client, "new") == "running" and job_state(client, "next") == "queued"
    statuses = {r["id"]: r["status"] for r in client.get("/api/runs").json()["runs"]}
    assert statuses["next"] == "queued"
    assert client.post("/api/runs/next/stop", json={}).json()["cancelled"]
    assert job_state(client, "next") == "cancelled"
    assert client.post("/api/runs/new/stop", json={}).json()["stopping"]
    assert (root / "new" / "stop").exists()
    assert ended(client, "new") == "stopped"
    resumed = client.post("/api/runs/new/resume", json={})
    assert resumed.status_code == 202 and not (root / "new" / "stop").exists()
    first = json.loads((root / "new" / jobs.JOB_FILE).read_text())
    assert resumed.json()["job"]["argv"] == first["train_argv"]
    assert client.post("/api/runs/new/resume", json={}).status_code == 409  # one job a run at a time
    client.post("/api/runs/new/stop", json={})
    assert ended(client, "new") == "stopped"


def test_a_restarted_ui_keeps_its_queue_and_its_running_child(root, stubbed):
    with TestClient(create_app(root, poll=False), base_url=LOCAL) as client:
        assert client.post("/api/runs", json={"recipe": "lora", "name": "first"}).status_code == 201
        assert client.post("/api/runs", json={"recipe": "lora", "name": "later"}).status_code == 201
        pid = client.get("/api/runs/first").json()["summary"]["job"]["pid"]
    try:
        # The child outlived its UI: the next UI counts it against --parallel and keeps the queue's order.
        with TestClient(create_app(root, poll=False), base_url=LOCAL) as client:
            assert job_state(client, "first") == "running" and job_state(client, "later") == "queued"
    finally:
        os.kill(pid, signal.SIGKILL)


def test_resume_of_a_cli_run_repeats_its_config_and_export_queues(client, root, stubbed, monkeypatch):
    commands = []
    monkeypatch.setattr(jobs, "train_command", lambda config, run, overrides: commands.append(config) or
                        [sys.executable, "-c", "pass"])
    assert client.post("/api/runs/alpha/resume", json={}).status_code == 202
    assert commands == [root / "alpha" / "config.yaml"]
    assert ended(client, "alpha") == "done"
    exported = client.post("/api/runs/alpha/export", json={})
    assert exported.status_code == 202 and exported.json()["out"] == "alpha/export"


def test_a_locked_run_is_running_and_refuses_resume(client, root):
    with open(root / "alpha" / ".sdtrain.lock", "a+") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        lock.write("sdtrain train (pid 1 on elsewhere)\n")
        lock.flush()
        assert client.get("/api/runs/alpha").json()["summary"]["status"] == "running"
        refused = client.post("/api/runs/alpha/resume", json={})
        assert refused.status_code == 409 and "stop it first" in refused.json()["error"]


@pytest.mark.parametrize(("body", "says"), [
    ({"config": "stage: [diffusion\n"}, "config: line 2, column 1"),
    ({"config": "- a list\n"}, "not a mapping"),
    ({"recipe": "../../etc/passwd"}, "not a bundled recipe"),
    ({"recipe": "lora", "overrides": ["--help"]}, "write key=value"),
    ({"recipe": "lora", "overrides": ["x=1; rm -rf /\nsecond"]}, "write key=value"),
    ({"recipe": "lora", "overrides": ["run_dir=/tmp/elsewhere"]}, "set the name"),
    ({"recipe": "lora", "name": "../escape"}, 'name "../escape"'),
    ({"recipe": "lora", "name": "alpha"}, "already exists"),
    ({"recipe": "lora", "overrides": ["bad.key=1"]}, "bad.key: no such key; see docs"),
])
def test_a_bad_start_is_one_line_and_writes_nothing(client, root, stubbed, body, says):
    before = sorted(p for p in root.rglob("*") if ".sdtrain-ui" not in p.parts)
    response = client.post("/api/runs", json=body)
    assert response.status_code == 422
    message = response.json()["error"]
    assert says in message and "\n" not in message and "Traceback" not in response.text
    assert sorted(p for p in root.rglob("*") if ".sdtrain-ui" not in p.parts) == before
    checked = client.post("/api/check", json=body).json()
    assert not checked["ok"] and says in checked["problems"][0]


def test_check_passes_a_good_config(client, stubbed):
    checked = client.post("/api/check", json={"recipe": "lora", "overrides": ["train.max_steps=5"]}).json()
    assert checked == {"ok": True, "problems": [], "message": "ok: diffusion from scratch; no weight was loaded"}


def test_a_damaged_metrics_file_is_one_line_not_a_traceback(client, root):
    with open(root / "alpha" / "metrics.jsonl", "a") as f:
        f.write('{"step": 21, "loss": \n\x00\x00garbage\n')
    assert client.get("/api/runs").status_code == 200
    run = client.get("/api/runs/alpha").json()
    assert run["summary"]["step"] == 20 and "\n" not in (run["summary"]["problem"] or "")
    assert client.get("/api/runs/alpha/metrics").status_code == 200


def test_compare_lists_config_differences_and_shared_steps(client):
    compared = client.get("/api/compare?runs=alpha,group/beta").json()
    assert [r["id"] for r in compared["runs"]] == ["alpha", "group/beta"]
    differences = {d["key"]: d["values"] for d in compared["differences"]}
    assert differences["optim.lr"] == [1e-3, 2e-3] and "model.family" not in differences
    assert compared["common_sample_steps"] == [10]
    assert client.get("/api/compare?runs=alpha").status_code == 400


def test_recipes_and_the_route_list(client):
    assert "lora" in client.get("/api/recipes").json()["recipes"]
    assert "demo/diffusion" in client.get("/api/recipes").json()["recipes"]
    assert "stage:" in client.get("/api/recipes/demo/diffusion").json()["config"]
    assert client.get("/api/recipes/..%2F..%2Fpyproject").status_code == 404
    routes = {(method, path) for method, path, _ in client.get("/api/").json()["routes"]}
    assert ("POST", "/api/runs/{run}/stop") in routes
    page = client.get("/")
    assert page.status_code == 200 and "cdn" not in page.text.lower() and "http" not in page.text.split("<body")[1]
    assert client.get("/static/vendor/uPlot.iife.min.js").status_code == 200


# ------------------------------------------------------------------------------------------ safety


def test_the_token_guards_every_request(root):
    with TestClient(create_app(root, token="s3cret", poll=False), base_url="http://10.0.0.5:8765") as client:
        assert client.get("/api/runs").status_code == 401
        assert client.get("/").status_code == 401
        assert client.get("/api/runs", headers={"Authorization": "Bearer wrong"}).status_code == 401
        assert client.get("/api/runs", headers={"Authorization": "Bearer s3cret"}).status_code == 200
        login = client.get("/?token=s3cret", follow_redirects=False)
        assert login.status_code == 303 and login.headers["location"] == "/"
        assert "httponly" in login.headers["set-cookie"].lower()
        client.cookies.set("sdtrain_ui_token", "s3cret")
        assert client.get("/api/runs").status_code == 200


def test_without_a_token_only_loopback_hosts_and_json_posts(root):
    with TestClient(create_app(root, poll=False), base_url="http://evil.example:8765") as client:
        assert client.get("/api/runs").status_code == 403
    with TestClient(create_app(root, poll=False), base_url=LOCAL) as client:
        assert client.post("/api/runs/alpha/stop", data={"a": "b"}).status_code == 415
        crossed = client.post("/api/runs/alpha/stop", json={}, headers={"Origin": "http://evil.example"})
        assert crossed.status_code == 403


def test_cli_refuses_another_address_without_a_token(monkeypatch, capsys, tmp_path):
    monkeypatch.delenv("SDTRAIN_UI_TOKEN", raising=False)
    assert main(["ui", str(tmp_path), "--host", "0.0.0.0"]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert "SDTRAIN_UI_TOKEN" in line and not (tmp_path / ".sdtrain-ui").exists()


def test_cli_names_the_extra_when_starlette_is_missing(monkeypatch, capsys, tmp_path):
    monkeypatch.setitem(sys.modules, "uvicorn", None)
    assert main(["ui", str(tmp_path)]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.endswith("pip install 'sdtrain[ui]'")


def test_the_trainer_imports_nothing_of_the_ui():
    import subprocess

    code = ("import sys, sdtrain.cli.main; "
            "print(sorted(m for m in sys.modules if m.startswith(('sdtrain.ui', 'starlette', 'uvicorn'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


# ------------------------------------------------------------------------------------------ the start page


def test_config_keys_come_from_the_reference(client):
    keys = {k["name"]: k for k in client.get("/api/config/keys").json()["keys"]}
    assert keys["data.resolution"]["type"] == "int" and keys["data.resolution"]["doc"]
    assert keys["stage"]["default"] == "???" and keys["optim.lr"]["section"] == "optim"


def test_keys_are_checked_as_typed_each_with_its_line(client):
    recipe = client.get("/api/recipes/lora").json()["config"]
    assert client.post("/api/check/keys", json={"config": recipe}).json() == {"ok": True, "problems": []}
    bad = (recipe.replace("  resolution: 512", "  resolutio: 512").replace("max_steps: 1500", "max_steps: many")
           .replace("mode: lora", "mode: lorra") + "nonsense: 1\n")
    problems = client.post("/api/check/keys", json={"config": bad}).json()["problems"]
    found = {p["key"]: p for p in problems}
    assert set(found) == {"data.resolutio", "train.max_steps", "mode", "nonsense"}
    assert "Did you mean: 'resolution'" in found["data.resolutio"]["message"]
    lines = bad.splitlines()
    assert all(lines[p["line"] - 1].strip().startswith(p["key"].split(".")[-1] + ":") for p in problems)
    assert all("\n" not in p["message"] for p in problems)
    (broken,) = client.post("/api/check/keys", json={"config": "data:\n  batch_size: [1\n"}).json()["problems"]
    assert broken["line"] == 3 and "fix the YAML" in broken["message"]
    (override,) = client.post("/api/check/keys", json={"config": recipe, "overrides": ["train.max_steps=x"]}
                              ).json()["problems"]
    assert override["key"] == "train.max_steps" and override["line"] is None
    assert client.post("/api/check/keys", json={"config": recipe, "overrides": ["--x"]}).status_code == 422


def test_the_key_check_loads_no_torch(tmp_path):
    import subprocess

    code = ("import sys; from pathlib import Path; from sdtrain.ui import start; "
            "p = start.check_keys('stage: diffusion\\nmode: lorra\\n', [], Path(sys.argv[1])); "
            "print(p[0]['key'], 'torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["mode", "False"]


FAMILIES = [{"name": n, "title": n.upper()} for n in ("sd", "sdxl", "flux", "z-image")]


@pytest.fixture
def families(monkeypatch):
    """The family list without importing torch: a child that prints a fixed list."""
    from sdtrain.ui import start

    printed = json.dumps(FAMILIES)
    monkeypatch.setattr(start, "FAMILIES", start.Cached(lambda: [sys.executable, "-c", f"print({printed!r})"]))


@pytest.mark.parametrize(("family", "mode", "recipe"), [
    ("flux", "lora", "flux-lora"), ("sd", "lora", "lora"), ("sdxl", "full", "sdxl-finetune"),
    ("z-image", "full", "finetune-full"), ("sd", "dreambooth", "dreambooth"),
    ("sd", "textual_inversion", "textual-inversion"), (None, "lora", "lora"),
])
def test_the_short_form_is_a_recipe_and_overrides(client, root, families, family, mode, recipe):
    assert client.get("/api/families").json()["families"] == FAMILIES
    (root / "shards").mkdir()
    form = {"family": family, "pretrained": "org/model", "data": "shards", "mode": mode, "steps": "200",
            "lr": "2e-4", "resolution": 768, "batch_size": "2"}
    filled = client.post("/api/form", json=form).json()
    assert filled["recipe"] == recipe
    assert filled["overrides"] == ["model.pretrained=org/model", f"data.shards={(root / 'shards').resolve()}",
                                   *([f"model.family={family}"] if family else []), "train.max_steps=200",
                                   "optim.lr=0.0002", "data.resolution=768", "data.batch_size=2"]


@pytest.mark.parametrize(("change", "says"), [
    ({"family": "nope"}, "family 'nope'"), ({"mode": "controlnet"}, "mode 'controlnet'"),
    ({"steps": "many"}, "steps"), ({"steps": 2.5}, "steps"), ({"lr": "-1"}, "lr"), ({"lr": "nan"}, "lr"),
    ({"pretrained": ""}, "pretrained: fill it in"), ({"data": "a\nb"}, "data: one line"),
])
def test_a_bad_short_form_is_one_line(client, families, change, says):
    form = {"family": "sd", "pretrained": "org/model", "data": "/data/x", "mode": "lora", **change}
    refused = client.post("/api/form", json=form)
    assert refused.status_code == 422 and says in refused.json()["error"]


def test_a_data_folder_is_inspected_and_prepared_as_a_queued_job(client, root, tmp_path, stubbed, monkeypatch):
    images = tmp_path / "photos"
    images.mkdir()
    (images / "a.jpg").write_bytes(PNG)
    (images / "a.txt").write_text("a photo")
    (root / "ready").mkdir()
    (root / "ready" / "manifest.json").write_text("{}")
    inspect = {p: client.post("/api/data/inspect", json={"path": p}).json()["kind"]
               for p in (str(images), "ready", str(tmp_path / "none"))}
    assert inspect == {str(images): "images", "ready": "shards", str(tmp_path / "none"): "missing"}
    commands = []
    monkeypatch.setattr(jobs, "prepare_command", lambda source, out: commands.append((source, out)) or
                        [sys.executable, "-c", "print('prepared')"])
    queued = client.post("/api/data/prepare", json={"source": str(images), "name": "photos"})
    assert queued.status_code == 202 and commands == [(str(images), root.resolve() / "data" / "photos")]
    client.app.state.queue.job_for(root.resolve() / "data" / "photos").process.wait(timeout=60)
    state = client.get("/api/data/prepare/photos").json()
    assert state["job"]["state"] == "done" and "prepared" in state["log"]
    assert "data/photos" not in [r["id"] for r in client.get("/api/runs").json()["runs"]]
    assert client.post("/api/data/prepare", json={"source": str(images), "name": "../up"}).status_code == 422
    assert client.get("/api/data/prepare/nothing").status_code == 404


# ------------------------------------------------------------------------------------------ GPUs

GPUS = "0, NVIDIA H100 80GB HBM3, 81559 MiB\n1, NVIDIA H100 80GB HBM3, 81559 MiB\n2, NVIDIA A10, 23028 MiB\n"


@pytest.fixture
def gpus(monkeypatch):
    """A machine with three GPUs, as nvidia-smi would list them."""
    from sdtrain.ui import start

    monkeypatch.setattr(start, "devices_command", lambda: [sys.executable, "-c", f"print({GPUS!r}, end='')"])


def test_devices_come_from_nvidia_smi(client, gpus):
    devices = client.get("/api/devices").json()["devices"]
    assert [d["index"] for d in devices] == [0, 1, 2] and devices[2] == {"index": 2, "name": "NVIDIA A10",
                                                                         "memory": "23028 MiB"}


def test_no_nvidia_smi_is_no_gpu(client, monkeypatch):
    from sdtrain.ui import start

    monkeypatch.setattr(start, "devices_command", lambda: None)
    assert client.get("/api/devices").json()["devices"] == []
    refused = client.post("/api/runs", json={"recipe": "lora", "name": "x", "gpus": [0]})
    assert refused.status_code == 422 and "has: none" in refused.json()["error"]


def test_two_gpus_run_under_torchrun_as_scale_out_documents():
    argv = jobs.distributed(jobs.train_command(Path("c.yaml"), Path("runs/r"), ["train.max_steps=5"]), 2)
    assert argv == [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                    "-m", "sdtrain", "train", "c.yaml", "run_dir=runs/r", "train.max_steps=5"]
    scale_out = (Path(__file__).parents[1] / "docs" / "scale-out.md").read_text()
    assert "torchrun --standalone --nproc_per_node 2 -m sdtrain train" in scale_out
    one = jobs.train_command(Path("c.yaml"), Path("runs/r"), [])
    assert jobs.distributed(one, 1) == one


@pytest.mark.parametrize("given", [[7], ["0"], [True], [0, 0], "0,1"])
def test_gpu_ids_are_the_machines_integers(client, gpus, stubbed, given):
    refused = client.post("/api/runs", json={"recipe": "lora", "name": "x", "gpus": given})
    assert refused.status_code == 422 and "gpus" in refused.json()["error"]


def test_jobs_on_disjoint_gpus_run_together(client, root, gpus, stubbed, monkeypatch):
    given_to_children = []
    environment = jobs.child_environment
    monkeypatch.setattr(jobs, "child_environment", lambda gpus=None: given_to_children.append(
        environment(gpus).get("CUDA_VISIBLE_DEVICES")) or environment(gpus))
    for name, given in (("a", [0, 1]), ("b", [2]), ("c", [1, 2]), ("d", []), ("e", []), ("f", [0])):
        assert client.post("/api/runs", json={"recipe": "lora", "name": name, "gpus": given}).status_code == 201
    states = {name: job_state(client, name) for name in "abcdef"}
    # c waits for GPUs 1 and 2; f could take GPU 0 but waits behind c, which asked first; e waits for d (--parallel 1).
    assert states == {"a": "running", "b": "running", "c": "queued", "d": "running", "e": "queued", "f": "queued"}
    assert jobs.Queue(root).job_for(root.resolve() / "c").gpus == [1, 2]  # a restarted UI keeps them
    for name in "abd":
        client.post(f"/api/runs/{name}/stop", json={})
        assert ended(client, name) == "stopped"
    assert [g for g in given_to_children if g][:2] == ["0,1", "2"]  # (the checks and CPU jobs get none)
    assert {name: job_state(client, name) for name in "cef"} == {"c": "running", "e": "running", "f": "running"}
    assert json.loads((root / "a" / jobs.JOB_FILE).read_text())["train_gpus"] == [0, 1]
    for name in "cef":
        client.post(f"/api/runs/{name}/stop", json={})
        assert ended(client, name) == "stopped"
    resumed = client.post("/api/runs/a/resume", json={}).json()
    assert resumed["job"]["gpus"] == [0, 1]
    client.post("/api/runs/a/stop", json={})
    assert ended(client, "a") == "stopped"
    assert [g for g in given_to_children if g][-1] == "0,1"


# ------------------------------------------------------------------------------------------ data preview

# A child that writes the grid where --out says, as `sdtrain data preview` does; one with data.shards=bad fails.
PREVIEWER = ("import sys\n"
             "args = sys.argv[1:]\n"
             "if 'data.shards=bad' in args:\n"
             "    print('sdtrain data: error: data.shards: bad: no shards there', file=sys.stderr); sys.exit(2)\n"
             "out = args[args.index('--out') + 1]\n"
             f"open(out, 'wb').write({PNG!r})\n"
             "print(out + ': the first 1 samples as training receives them')\n")


@pytest.fixture
def previews(monkeypatch) -> list[list[str]]:
    made: list[list[str]] = []
    monkeypatch.setattr(jobs, "preview_command", lambda config, out, overrides: made.append(
        [str(config), str(out), *overrides]) or [sys.executable, "-c", PREVIEWER, str(config), "--out", str(out),
                                                 *overrides])
    return made


def test_the_start_page_previews_its_data(client, root, previews):
    shown = client.post("/api/preview", json={"recipe": "lora", "overrides": ["data.shards=/data/x"]})
    assert shown.status_code == 200, shown.text
    assert client.get(shown.json()["url"]).content == PNG
    config, out, *overrides = previews[0]
    assert Path(out).parent == root.resolve() / ".sdtrain-ui" / "previews" and overrides == ["data.shards=/data/x"]
    assert not Path(config).exists()  # the config it read is not left behind
    failed = client.post("/api/preview", json={"recipe": "lora", "overrides": ["data.shards=bad"]})
    assert failed.status_code == 422 and failed.json()["error"] == "data.shards: bad: no shards there"
    assert client.get("/api/previews/..%2F..%2Fsecret.txt").status_code == 404
    assert client.post("/api/preview", json={"recipe": "lora", "overrides": ["--out=/etc/x\n"]}).status_code == 422


def test_a_run_previews_the_data_it_trains_on(client, root, previews):
    shown = client.post("/api/runs/alpha/preview", json={})
    assert shown.status_code == 200 and client.get(shown.json()["url"]).content == PNG
    assert previews[0][:2] == [str(root / "alpha" / "config.yaml"), str(root / "alpha" / jobs.PREVIEW_FILE)]


def test_every_route_is_in_the_guide():
    from sdtrain.ui.app import API_ROUTES

    guide = (Path(__file__).parents[1] / "docs" / "ui.md").read_text()
    missing = [f"{method} {path}" for method, path, _ in API_ROUTES if path != "/api" and
               not any(f"{method} {path}" in line for line in guide.splitlines())]
    assert missing == []
